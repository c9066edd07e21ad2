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
