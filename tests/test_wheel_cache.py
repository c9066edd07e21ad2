"""The Horovod wheel cache is installed as root on every node: only a wheel whose recorded SHA-256 matches is used
(issue 14, item 12). On a file:// store here; the Swift cache path runs in test_image.py."""

import hashlib

from appliance.provision.install import fetch_cached_wheel
from appliance.store.objects import FileStore


def cache(tmp_path, wheel: bytes, recorded: str | None):
    root = tmp_path / "cache"
    (root / "tag").mkdir(parents=True)
    (root / "tag" / "horovod-0.28.1-cp311-linux_x86_64.whl").write_bytes(wheel)
    if recorded is not None:
        (root / "tag" / "horovod-0.28.1-cp311-linux_x86_64.whl.sha256").write_text(recorded + "\n")
    dest = tmp_path / "dest"
    dest.mkdir()
    return FileStore(str(root)), dest


def test_a_wheel_that_matches_its_hash_is_used(tmp_path):
    store, dest = cache(tmp_path, b"wheel", hashlib.sha256(b"wheel").hexdigest())
    assert fetch_cached_wheel(store, "tag/", dest) == "horovod-0.28.1-cp311-linux_x86_64.whl"
    assert (dest / "horovod-0.28.1-cp311-linux_x86_64.whl").read_bytes() == b"wheel"


def test_a_changed_wheel_is_not_used(tmp_path, said):
    store, dest = cache(tmp_path, b"tampered", hashlib.sha256(b"wheel").hexdigest())
    said.clear()
    assert fetch_cached_wheel(store, "tag/", dest) is None
    assert not list(dest.iterdir()) and "does not match its recorded SHA-256" in said[0]


def test_a_wheel_without_a_recorded_hash_is_not_used(tmp_path, said):
    store, dest = cache(tmp_path, b"wheel", None)
    said.clear()
    assert fetch_cached_wheel(store, "tag/", dest) is None
    assert "no recorded SHA-256" in said[0]


def test_the_local_wheelhouse_fetches_a_pin_that_moved(tmp_path, monkeypatch):
    """The local cloud's nodes install from a wheelhouse here. It counted a package as there by its name, so after a
    pin moved (python-blazarclient 4.6.0 -> 4.5.0) the old wheel stayed the only one and every `up --install` failed
    on the node: "No matching distribution found for python-blazarclient==4.5.0" (the fresh run of 2468ffb)."""
    import subprocess

    from appliance import paths
    from appliance.sites import local

    monkeypatch.setattr(local.Path, "home", lambda: tmp_path)
    wh = tmp_path / ".cache" / "appliance" / "wheelhouse"
    wh.mkdir(parents=True)
    lock = [ln for ln in paths.LOCK.read_text().splitlines() if ln and not ln.startswith("#")]
    for ln in lock:
        name, version = ln.split("==")
        if name != "python-blazarclient":
            (wh / f"{name.replace('-', '_')}-{version}-py3-none-any.whl").write_text("")
    (wh / "python_blazarclient-4.6.0-py3-none-any.whl").write_text("")  # the old pin's wheel
    for extra in ("pip-26.3-py3-none-any.whl", "setuptools-84.2.1-py3-none-any.whl", "wheel-0.48.0-py3-none-any.whl",
                  f"horovod-{paths.lock_pin('horovod')}.tar.gz"):
        (wh / extra).write_text("")
    asked = []
    monkeypatch.setattr(local.subprocess, "run", lambda cmd, **kw: (
        asked.append(cmd), subprocess.CompletedProcess(cmd, 0, "", ""))[1])
    local.local_wheelhouse()
    wanted = {a for cmd in asked for a in cmd if "==" in a and not a.startswith("horovod")}
    assert wanted == {f"python-blazarclient=={paths.lock_pin('python-blazarclient')}"}, wanted


def test_the_local_wheelhouse_has_each_node_pythons_wheels(tmp_path, monkeypatch):
    """A CC-Ubuntu24.04 node installs with Python 3.12: a package whose only wheel here is for this Python (cp311)
    is fetched for 3.12 too, as a binary wheel for that Python; a pure-Python wheel serves both."""
    import subprocess

    from appliance import paths
    from appliance.sites import local

    monkeypatch.setattr(local.Path, "home", lambda: tmp_path)
    monkeypatch.setattr(local, "node_pythons", lambda: ["3.11", "3.12"])
    monkeypatch.setattr(local.sys, "version_info", (3, 11, 2, "final", 0))
    wh = tmp_path / ".cache" / "appliance" / "wheelhouse"
    wh.mkdir(parents=True)
    for ln in (ln for ln in paths.LOCK.read_text().splitlines() if ln and not ln.startswith("#")):
        name, version = ln.split("==")
        tag = "cp311-cp311-manylinux_2_17_x86_64" if name == "numpy" else "py3-none-any"
        (wh / f"{name.replace('-', '_')}-{version}-{tag}.whl").write_text("")
    for extra in ("pip-26.3-py3-none-any.whl", "setuptools-84.2.1-py3-none-any.whl", "wheel-0.48.0-py3-none-any.whl",
                  f"horovod-{paths.lock_pin('horovod')}.tar.gz"):
        (wh / extra).write_text("")
    monkeypatch.setattr(local, "_tags_of", lambda v: {t for t in __import__("packaging.tags").tags.parse_tag(
        f"cp{v.replace('.', '')}-cp{v.replace('.', '')}-manylinux_2_17_x86_64")} | {
        t for t in __import__("packaging.tags").tags.parse_tag("py3-none-any")})
    asked = []
    monkeypatch.setattr(local.subprocess, "run", lambda cmd, **kw: (
        asked.append(cmd), subprocess.CompletedProcess(cmd, 0, "", ""))[1])
    local.local_wheelhouse()
    assert len(asked) == 1, asked
    cmd = asked[0]
    assert [a for a in cmd if "==" in a] == [f"numpy=={paths.lock_pin('numpy')}"]
    assert cmd[cmd.index("--python-version") + 1] == "3.12" and "--only-binary" in cmd
