"""The appliance image: element scripts lint, `make image` refusals, `appliance doctor`, the node watchdog,
`appliance image upload` to the local cloud's Glance, and the boot-time installer (`appliance up --install`)."""

import hashlib
import json
import os
import shutil
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest
from click.testing import CliRunner

from appliance.node import doctor
from appliance.node.watchdog import node_watch
from appliance.cli import main
from conftest import ROOT, needs_netns

ELEMENT = ROOT / "images" / "elements" / "appliance-stack"
SCRIPTS = [ROOT / "images" / "install-stack.sh", ROOT / "images" / "build.sh",
           ROOT / "appliance" / "provision" / "contextualize.sh", ROOT / "appliance" / "provision" / "heat_boot.sh",
           ELEMENT / "static" / "etc" / "profile.d" / "appliance.sh",
           *sorted(p for d in ("extra-data.d", "install.d", "post-install.d") for p in (ELEMENT / d).iterdir())]


def test_shell_scripts_pass_shellcheck():
    sc = shutil.which("shellcheck")
    assert sc, "shellcheck is missing: `make install` installs it (Debian package shellcheck)"
    r = subprocess.run([sc, "-x", *map(str, SCRIPTS)], capture_output=True, text=True)
    assert r.returncode == 0, r.stdout + r.stderr


def test_element_layout_and_one_set_of_steps():
    for d in ("extra-data.d", "install.d", "post-install.d"):
        for hook in (ELEMENT / d).iterdir():
            assert os.access(hook, os.X_OK), f"{hook} is not executable (DIB skips it)"
    install = (ELEMENT / "install.d" / "50-appliance-stack").read_text()
    # the image runs the same script as `make install` (cpu) and `appliance up --install`, with the gpu variant
    assert "images/install-stack.sh" in install and '"${DIB_APPLIANCE_VARIANT:-gpu}"' in install
    assert "images/install-stack.sh --variant cpu" in (ROOT / "Makefile").read_text()
    copied = (ELEMENT / "extra-data.d" / "50-appliance-source").read_text()
    for f in ("appliance", "pyproject.toml", "README.md", "requirements.lock", "images/install-stack.sh"):
        assert f in copied and (ROOT / f).exists()
    unit = (ELEMENT / "static" / "etc" / "systemd" / "system" / "appliance-watchdog.service").read_text()
    assert "ExecStart=/opt/appliance/venv/bin/appliance watchdog --node" in unit
    lock = (ROOT / "requirements.lock").read_text()
    assert "# gpu: tensorflow==2.18.1" in lock and "# gpu: nvidia-nccl-cu12==" in lock


def test_make_image_refuses_clearly_where_dib_cannot_run(tmp_path):
    env = {**os.environ, "PATH": f"{tmp_path}:/usr/bin:/bin", "CC_IMAGES": ""}
    r = subprocess.run(["bash", str(ROOT / "images" / "build.sh"), str(tmp_path / "img")], capture_output=True,
                       text=True, env=env)
    assert r.returncode != 0
    assert r.stderr.startswith("make image: error: "), r.stderr
    assert "diskimage-builder is not installed (fix: pip install diskimage-builder" in r.stderr
    assert not list(tmp_path.glob("img*")), "nothing is written when the build cannot run"


def test_install_stack_rejects_bad_arguments(tmp_path):
    script = ROOT / "images" / "install-stack.sh"
    r = subprocess.run(["bash", str(script), "--variant", "tpu"], capture_output=True, text=True)
    assert r.returncode == 1 and "--variant must be cpu or gpu" in r.stderr
    r = subprocess.run(["bash", str(script), "--venv", str(tmp_path / "v")], capture_output=True, text=True)
    assert r.returncode == 1 and "are required" in r.stderr
    r = subprocess.run(["bash", str(script), "--venv", str(tmp_path / "v"), "--lock", str(tmp_path / "nope"),
                        "--appliance", str(ROOT)], capture_output=True, text=True)
    assert r.returncode == 1 and "not found" in r.stderr
    assert not (tmp_path / "v").exists()


def test_doctor_fails_clearly_when_the_stack_is_missing(tmp_path):
    bare = tmp_path / "bare"
    subprocess.run([getattr(sys, "_base_executable", sys.executable), "-m", "venv", "--without-pip", str(bare)],
                   check=True)
    checks = {c.name: c for c in doctor.run_checks(str(bare / "bin" / "python"), str(tmp_path / "etc"))}
    assert checks["python"].status == "ok"
    for name in ("tensorflow", "tf-keras", "keras 3", "horovod"):
        assert checks[name].status == "fail" and "install-stack.sh" in checks[name].fix, checks[name]
    assert checks["allreduce (2 ranks)"].status == "skip"
    assert checks["nic"].status == "skip"  # no cluster.json: not a cluster node
    r = CliRunner().invoke(main, ["doctor", "--python", str(bare / "bin" / "python"), "--no-allreduce",
                                  "--etc", str(tmp_path / "etc")])
    assert r.exit_code == 1
    assert any(line.strip().startswith("FAIL tensorflow") and "(fix: " in line for line in r.output.splitlines())


def test_python_3_11_and_3_12_are_accepted():
    for v, want in (("3.11.0rc1", "ok"), ("3.12.3", "ok"), ("3.10.12", "fail"), ("3.13.1", "fail")):
        c = doctor.stack_checks({"python": v, "executable": "/v/bin/python"}, {})[0]
        assert c.status == want, (v, c)


def test_node_watchdog_stops_running_jobs_before_the_vendordata_lease_end(tmp_path, said):
    run_dir = tmp_path / "runs" / "r1"
    run_dir.mkdir(parents=True)
    (run_dir / ".appliance-run").touch()  # the launcher marks the run directories it makes
    vd = tmp_path / "vendordata2.json"
    now = time.time()

    def lease_end_in(seconds):
        end = time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(now + seconds))
        vd.write_text(json.dumps({"chameleon": {"lease_id": "L", "lease_end": end}}))

    # a process table: a training rank (APPLIANCE_RUN_DIR in its environment) and an unrelated process
    proc = tmp_path / "proc"
    for pid, env in (("101", {"PATH": "/bin", "APPLIANCE_RUN_DIR": str(run_dir)}), ("102", {"PATH": "/bin"})):
        (proc / pid).mkdir(parents=True)
        (proc / pid / "environ").write_bytes(b"\0".join(f"{k}={v}".encode() for k, v in env.items()) + b"\0")
    watch = dict(margin=600, once=True, vendordata=[str(vd)], proc=str(proc))
    lease_end_in(3600)  # far away: nothing to do
    assert node_watch(**watch) == []
    assert not (run_dir / "STOP").exists()
    lease_end_in(300)  # within the margin
    said.clear()
    assert node_watch(**watch) == [str(run_dir)]
    req = json.loads((run_dir / "STOP").read_text())
    assert req["reason"] == "lease end (node watchdog)" and req["deadline"] < now + 300
    assert "asked the job" in said[0]
    assert node_watch(**watch) == []  # an existing request is left as it is
    vd.write_text("{}")  # not a Chameleon node: says so, does nothing
    said.clear()
    assert node_watch(**watch) == []
    assert "no lease end" in said[0]


def test_running_run_dirs_reads_the_real_process_table(tmp_path):
    from appliance.node.watchdog import running_run_dirs

    # the child says when it runs: before its exec, /proc shows the parent's environment. It must not exec again
    # after saying so (`sh -c 'echo ready; exec sleep'` did): while a process execs, its environ reads empty
    job = subprocess.Popen([sys.executable, "-c", "import time; print('ready', flush=True); time.sleep(60)"],
                           stdout=subprocess.PIPE, text=True, env={**os.environ, "APPLIANCE_RUN_DIR": str(tmp_path)})
    assert job.stdout.readline().strip() == "ready"
    try:
        assert str(tmp_path) in running_run_dirs()
    finally:
        job.kill()
        job.wait()
    assert str(tmp_path) not in running_run_dirs()


@pytest.mark.slow
@needs_netns
def test_image_upload_to_the_local_glance(cloud, tmp_path):
    from appliance.flows import image_upload

    img = tmp_path / "appliance-test.qcow2"
    img.write_bytes(os.urandom(3 * 1024 * 1024 + 17))
    md5 = hashlib.md5(img.read_bytes()).hexdigest()
    first = image_upload(str(img), "appliance-test", cloud="local")
    assert first["status"] == "active" and first["size"] == img.stat().st_size and first["checksum"] == md5
    stored = Path(os.environ["APPLIANCE_HOME"]) / "localcloud" / "images" / first["id"]
    assert stored.exists() and hashlib.md5(stored.read_bytes()).hexdigest() == md5
    again = image_upload(str(img), "appliance-test", cloud="local")
    assert again["id"] == first["id"]  # the same file again: no second image
    r = CliRunner().invoke(main, ["image", "upload", str(tmp_path / "missing.qcow2"), "--name", "x", "--cloud", "local"])
    assert r.exit_code != 0 and "no image file" in r.output
    r = CliRunner().invoke(main, ["image", "upload", str(img), "--name", "x", "--cloud", "local",
                                  "--disk-format", "vhdx"])
    assert r.exit_code == 2


def stack_tag(python: str, variant: str = "cpu") -> str:
    """The wheel-cache key install-stack.sh computes for ``python`` (its --print-tag, the key's one source)."""
    r = subprocess.run(["bash", str(ROOT / "images" / "install-stack.sh"), "--print-tag", "--variant", variant,
                        "--python", python, "--venv", "/nonexistent/venv", "--lock", str(ROOT / "requirements.lock"),
                        "--appliance", str(ROOT)], capture_output=True, text=True)
    assert r.returncode == 0, r.stderr
    return r.stdout.split()[1]


def _cache_wheel(tag: str, tmp_path: Path) -> None:
    """The wheel `make install` built for ``tag``, in the local cloud's wheel cache, as if an earlier cluster had
    built it (a build on the node takes ~5 minutes here)."""
    from appliance import sites
    from appliance.store.objects import open_store

    built = sorted((Path.home() / ".cache" / "appliance" / "wheels" / tag).glob("horovod-*.whl"))
    assert built, f"make install builds Horovod into ~/.cache/appliance/wheels/{tag}/"
    store, _ = open_store("swift://appliance-wheels/", sites.open_site("local").store_creds())
    store.ensure_container()
    store.put(f"{tag}/{built[-1].name}", built[-1])
    digest = tmp_path / "digest"
    digest.write_text(hashlib.sha256(built[-1].read_bytes()).hexdigest() + "\n")
    store.put(f"{tag}/{built[-1].name}.sha256", digest)


def _install_and_train(tmp_path: Path, said, name: str, image: str, tag: str) -> dict:
    """`appliance up SPEC --install` on a stock image, then the digits example trained there (`appliance train
    --json`) and the doctor: what each gave, for the test to judge."""
    from appliance import flows

    _cache_wheel(tag, tmp_path)
    spec = tmp_path / f"{name}.yaml"
    spec.write_text(textwrap.dedent(f"""\
        name: {name}
        cloud: local
        image: {image}
        nodes: {{count: 1}}
        lease: {{duration: 2h}}
        train: {{code: {ROOT / 'examples' / 'digits'}, command: python train.py --epochs 4}}
        """))
    said.clear()
    cl = flows.up(str(spec), install=True)
    try:
        got = {"python": cl.python, "installed": dict(cl.site.installed), "said": list(said)}
        r = CliRunner().invoke(main, ["train", str(spec), "--json"])
        got["train"] = (r.exit_code, r.output[-2000:])
        got["job"] = json.loads(r.stdout[r.stdout.index("{"):]) if r.exit_code == 0 else {}
        got["checks"] = {c.name: c for c in flows.doctor_cluster(cl)[cl.head.name]}
        return got
    finally:
        flows.down(name)


def _installed_from_the_cache_and_trained(got: dict, tag: str, minor: str) -> None:
    """A fresh venv on the node's own disk with the node's Python ``minor``, Horovod from the wheel cache (no
    build), and the digits example trained to its end (4 epochs, rank 0's result)."""
    installed = got["installed"]
    assert got["python"] == "/mnt/local/appliance/venv/bin/python"
    assert {k: installed[k] for k in ("tag", "built", "cached")} == {"tag": tag, "built": None, "cached": True}
    assert f"python{minor}" in installed["interpreter"] or f"/{minor}." in installed["interpreter"], installed
    said = got["said"]
    assert any("the wheel cache has" in m for m in said) and not any("building horovod" in m for m in said)
    assert got["train"][0] == 0, got["train"][1]
    job = got["job"]
    assert job["exit_code"] == 0 and job["ranks_reported"] == [0] and job["epochs"] == 4, job


@pytest.mark.slow
@needs_netns
def test_up_install_on_a_24_04_node_without_python_3_11_trains_then_doctor(cloud, tmp_path, said):
    """The boot-time installer on a stock CC-Ubuntu24.04 node, which has no python3.11 (Ubuntu noble ships 3.12):
    install-stack.sh finds the node's 3.12 by itself, makes a fresh venv on the node's own disk, takes Horovod's
    3.12 build from the object store's wheel cache (no build) and checks it, the digits example trains to its end,
    then the doctor passes there. Where this machine has no 3.12 to boot a 24.04 node with, the same on a
    CC-Ubuntu22.04 node and its python3.11. (The other path is the same script: `make install` runs it for this
    checkout's venv, and tests/test_install_stack.py checks which Python it takes on each image.)"""
    from appliance.testbed import nodeimage

    py = nodeimage.python312()
    image, minor = ("CC-Ubuntu24.04", "3.12") if py else ("CC-Ubuntu22.04", "3.11")
    tag = stack_tag(py or "/usr/bin/python3.11")
    got = _install_and_train(tmp_path, said, "inst24", image, tag)
    _installed_from_the_cache_and_trained(got, tag, minor)
    checks = got["checks"]
    assert not [c for c in checks.values() if c.status == "fail"], doctor.format_checks(list(checks.values()))
    assert "/mnt/local/appliance/venv" in checks["python"].detail  # the node's own new venv
    assert checks["nic"].status == "ok"
    assert checks["horovod build"].status == "ok" and "Gloo" in checks["horovod build"].detail
    assert checks["allreduce (2 ranks)"].status == "ok"  # a real 2-rank horovodrun allreduce on the node
    assert checks["keras 3"].status == "ok" and checks["keras 3"].detail.endswith(", backend tensorflow")
    assert checks["nvidia driver"].status == "skip" and "CPU node" in checks["nvidia driver"].detail


def test_doctor_on_a_gpu_machine_without_the_stack(monkeypatch):
    """As seen on an H100 with the driver and CUDA but no TensorFlow or Horovod: the GPU checks say the stack is
    missing, not "built without NCCL" or "a CPU build" (which would send the user to the wrong fix)."""
    replies = {"nvidia-smi": (0, "NVIDIA H100 80GB HBM3, 580.159.04\n"), "nvcc": (0, "Cuda compilation tools, "
                                                                                    "release 13.0, V13.0.48\n")}
    monkeypatch.setattr(doctor, "_run", lambda cmd, timeout=60, env=None: next(
        (v for k, v in replies.items() if k in cmd[0]), (127, "")))
    probe = {"python": "3.12.3", "tensorflow_error": "ModuleNotFoundError", "horovod_error": "ModuleNotFoundError"}
    checks = {c.name: c for c in doctor.gpu_checks(probe)}
    assert checks["nvidia driver"].status == "ok" and "H100" in checks["nvidia driver"].detail
    assert checks["cuda"].status == "ok" and "13.0" in checks["cuda"].detail
    assert "no Horovod" in checks["nccl"].detail and "no TensorFlow" in checks["tensorflow sees the GPUs"].detail
    assert checks["nccl"].fix == doctor.INSTALL_FIX


def test_the_node_bundle_is_the_package_and_holds_no_c(tmp_path):
    """`appliance up --install` ships the package, its lock and the install script; there is no C of ours to build
    (issue 50: the stager is http.client, hashlib and processes)."""
    from appliance.provision import install

    d = install.bundle(tmp_path / "b")
    assert (d / "pyproject.toml").is_file() and (d / "appliance" / "store" / "httpget.py").is_file()
    assert not list(d.rglob("*.so")) and not list(d.rglob("*.c")) and not (d / "setup.py").exists()
