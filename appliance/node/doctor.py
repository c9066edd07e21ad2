"""`appliance doctor`: is this node ready to train? One line per check, with the fix.

Checks, in order: Python, TensorFlow, tf-keras, Keras 3 (its version and backend), Horovod (version, built with TensorFlow + Gloo, NCCL on GPU
nodes), the NVIDIA driver, CUDA, NCCL, TensorFlow sees every GPU, a 2-rank allreduce through horovodrun on
this node, the NIC the cluster uses, firewalld's trusted peers; and whether the stager's MD5 lanes and https reads
are built (said, not failed: without them it checks at hashlib's speed and reads https a TLS record per call). GPU
checks are skipped (not failed) on a node without NVIDIA GPUs; everything else must pass. The stack is probed in a
child process with the venv's Python, so the doctor still reports when TensorFlow or Horovod is broken or missing.
``--gpu`` adds the checks that run on the device (appliance/node/gpudoctor.py) and prints the node's versions and
nvidia-smi for the report (`appliance doctor --gpu`, appliance/flows/gpucheck.py).
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path

from ..protocol import Env, Line, emit, rank_environment

# the checkout's lock (make install: editable), the copy install-stack.sh leaves in the venv, or a client install's
LOCKS = (Path(__file__).resolve().parents[2] / "requirements.lock", Path(sys.prefix) / "appliance-requirements.lock",
         Path(sys.prefix) / "share" / "appliance" / "requirements.lock")
PYTHONS = ("3.11.", "3.12.")  # the stack's pins install on both (Ubuntu 22.04's python3.11, 24.04's python3.12)
INSTALL_FIX = "install the stack: images/install-stack.sh (docs/image.md), or use the appliance image"

PROBE = r"""
import json, os, sys
out = {"python": sys.version.split()[0], "executable": sys.executable}
try:
    import tensorflow as tf
    out["tensorflow"] = tf.__version__
    out["tf_gpus"] = len(tf.config.list_physical_devices("GPU"))
    out["tf_cuda"] = bool(tf.test.is_built_with_cuda())
    info = tf.sysconfig.get_build_info()
    out["tf_build"] = {k: str(info[k]) for k in ("cuda_version", "cudnn_version") if k in info}
except Exception as e:
    out["tensorflow_error"] = f"{type(e).__name__}: {e}"
try:
    import tf_keras
    out["tf_keras"] = tf_keras.__version__
except Exception as e:
    out["tf_keras_error"] = f"{type(e).__name__}: {e}"
try:
    import keras
    out["keras"] = keras.__version__
    out["keras_backend"] = keras.config.backend()
except Exception as e:
    out["keras_error"] = f"{type(e).__name__}: {e}"
try:
    import horovod
    import horovod.tensorflow as hvd
    out["horovod"] = horovod.__version__
    out["horovod_dir"] = os.path.dirname(horovod.__file__)
    out["hvd_gloo"] = bool(hvd.gloo_built()); out["hvd_nccl"] = bool(hvd.nccl_built())
    out["hvd_mpi"] = bool(hvd.mpi_built())
except Exception as e:
    out["horovod_error"] = f"{type(e).__name__}: {e}"
print("APPLIANCE_PROBE " + json.dumps(out))
"""

ALLREDUCE = r"""
import horovod.tensorflow as hvd, tensorflow as tf
hvd.init()
v = hvd.allreduce(tf.constant([float(hvd.rank() + 1)] * 4), op=hvd.Sum).numpy().tolist()
print("APPLIANCE_ALLREDUCE", hvd.rank(), hvd.size(), v)
"""


@dataclass
class Check:
    name: str
    status: str  # ok | fail | skip
    detail: str
    fix: str | None = None
    seconds: float | None = None  # how long the check took, where it runs something (the GPU checks)
    data: dict | None = None  # the numbers behind it, for the report (appliance/node/doctor_report.py)


def _pins(locks=LOCKS) -> dict[str, str]:
    pins = {}
    lock = next((p for p in locks if p.exists()), None)
    if lock is not None:
        for line in lock.read_text().splitlines():
            m = re.match(r"^([A-Za-z0-9_.-]+)==(\S+)", line)
            if m:
                pins[m.group(1).lower().replace("-", "_")] = m.group(2)
    return pins


def _run(cmd: list[str], timeout: float = 60, env: dict | None = None) -> tuple[int, str]:
    try:
        p = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=env)
        return p.returncode, p.stdout + p.stderr
    except FileNotFoundError:
        return 127, f"{cmd[0]}: not found"
    except subprocess.TimeoutExpired:
        return 124, f"timed out after {timeout:.0f} s"


def probe(python: str) -> dict:
    env = {**os.environ, "TF_CPP_MIN_LOG_LEVEL": "3", "TF_USE_LEGACY_KERAS": "1"}
    rc, out = _run([python, "-c", PROBE], timeout=120, env=env)
    for line in out.splitlines():
        if line.startswith("APPLIANCE_PROBE "):
            return json.loads(line[len("APPLIANCE_PROBE "):])
    return {"error": (out.strip().splitlines() or [f"exit {rc}"])[-1]}


def gpu_checks(p: dict) -> list[Check]:
    rc, out = _run(["nvidia-smi", "--query-gpu=name,driver_version", "--format=csv,noheader"], timeout=30)
    if rc == 127 and not Path("/dev/nvidia0").exists():
        why = "no NVIDIA GPU on this node (CPU node)"
        return [Check(n, "skip", why) for n in ("nvidia driver", "cuda", "nccl", "tensorflow sees the GPUs")]
    checks = []
    gpus = [g.strip() for g in out.strip().splitlines() if g.strip()] if rc == 0 else []
    if rc == 0 and gpus:
        checks.append(Check("nvidia driver", "ok", f"{len(gpus)} GPU(s): {'; '.join(gpus)}"))
    else:
        checks.append(Check("nvidia driver", "fail", f"nvidia-smi: {out.strip()[-200:] or 'no GPU listed'}",
                            "use a CC-Ubuntu*-CUDA image (the driver comes with it); gpu_k80 needs the CUDA 11 image"))
    cuda = os.environ.get("CUDA_HOME", "/usr/local/cuda")
    rc, out = _run([f"{cuda}/bin/nvcc", "--version"], timeout=30)
    m = re.search(r"release ([\d.]+)", out)
    checks.append(Check("cuda", "ok", f"CUDA {m.group(1)} at {cuda}") if rc == 0 and m else
                  Check("cuda", "fail", f"no nvcc at {cuda}", "use a CC-Ubuntu*-CUDA image or set CUDA_HOME"))
    if p.get("hvd_nccl"):
        checks.append(Check("nccl", "ok", "Horovod built with NCCL"))
    elif "horovod" not in p:  # no Horovod at all (seen on a bare GPU machine): not a build without NCCL
        checks.append(Check("nccl", "fail", "no Horovod in this Python, so no NCCL allreduce", INSTALL_FIX))
    else:
        checks.append(Check("nccl", "fail", "Horovod was built without NCCL: GPU allreduce falls back to Gloo",
                            "rebuild: images/install-stack.sh --variant gpu (needs libnccl-dev)"))
    seen = p.get("tf_gpus", 0)
    if "tensorflow" not in p:
        checks.append(Check("tensorflow sees the GPUs", "fail", f"no TensorFlow in this Python ({len(gpus)} GPU(s) "
                            "unused)", INSTALL_FIX))
    elif gpus and seen == len(gpus):
        checks.append(Check("tensorflow sees the GPUs", "ok", f"{seen} of {len(gpus)}"))
    else:
        checks.append(Check("tensorflow sees the GPUs", "fail", f"{seen} of {len(gpus)}"
                            + ("" if p.get("tf_cuda") else " (this TensorFlow is a CPU build)"),
                            "install the GPU variant (images/install-stack.sh --variant gpu): tensorflow + its "
                            "CUDA/cuDNN wheels"))
    return checks


def stack_checks(p: dict, pins: dict[str, str]) -> list[Check]:
    if "error" in p:
        return [Check("python", "fail", p["error"], "check the venv's python (`--python`)")]
    good = p["python"].startswith(PYTHONS)
    checks = [Check("python", "ok" if good else "fail", f"{p['python']} ({p['executable']})",
                    None if good else "the stack is pinned for Python 3.11 and 3.12: make the venv with one of them")]
    for key, pin_names, label in (("tensorflow", ("tensorflow_cpu", "tensorflow"), "tensorflow"),
                                  ("tf_keras", ("tf_keras",), "tf-keras"), ("horovod", ("horovod",), "horovod")):
        have = p.get(key)
        pin = next((pins[n] for n in pin_names if n in pins), None)
        if have is None:
            checks.append(Check(label, "fail", p.get(f"{key}_error", "not importable"), INSTALL_FIX))
        elif pin and have != pin:
            checks.append(Check(label, "fail", f"{have}, the lock pins {pin}", INSTALL_FIX))
        else:
            checks.append(Check(label, "ok", have))
    checks.insert(3, keras3_check(p, pins))
    if "horovod" in p:
        built = [n for n, k in (("Gloo", "hvd_gloo"), ("NCCL", "hvd_nccl"), ("MPI", "hvd_mpi")) if p.get(k)]
        ok = p.get("hvd_gloo") and "tensorflow" in p
        checks.append(Check("horovod build", "ok" if ok else "fail", f"TensorFlow, {', '.join(built) or 'no controller'}",
                            None if ok else "rebuild Horovod with HOROVOD_WITH_GLOO=1 (images/install-stack.sh)"))
    return checks


def keras3_check(p: dict, pins: dict[str, str]) -> Check:
    """Keras 3, which a job whose code uses Keras 3 API runs (train.keras, appliance/node/keras3.py): importable,
    a 3.x, the lock's version, on the TensorFlow backend (Horovod's ops are TensorFlow's)."""
    have, backend, pin = p.get("keras"), p.get("keras_backend"), pins.get("keras")
    if have is None:
        return Check("keras 3", "fail", p.get("keras_error", "not importable"), INSTALL_FIX)
    if not have.startswith("3."):
        return Check("keras 3", "fail", f"keras {have} is not Keras 3", INSTALL_FIX)
    if pin and have != pin:
        return Check("keras 3", "fail", f"{have}, the lock pins {pin}", INSTALL_FIX)
    if backend != "tensorflow":
        return Check("keras 3", "fail", f"{have}, backend {backend}", "Horovod's ops are TensorFlow's: unset "
                     "KERAS_BACKEND or set it to tensorflow (and \"backend\" in ~/.keras/keras.json)")
    return Check("keras 3", "ok", f"{have}, backend tensorflow")


def allreduce_check(python: str, timeout: float = 120) -> Check:
    hr = Path(python).parent / "horovodrun"
    if not hr.exists():
        return Check("allreduce (2 ranks)", "fail", f"no horovodrun beside {python}", INSTALL_FIX)
    # horovodrun puts its whole environment on every rank's command line: the same allow-list as `train`
    env = rank_environment(path=f"{Path(python).parent}:{os.environ.get('PATH', '/usr/bin:/bin')}",
                           home=os.environ.get("HOME", "/root"), nic=None, launcher_env=os.environ)
    env["TF_CPP_MIN_LOG_LEVEL"] = "3"
    rc, out = _run([str(hr), "-np", "2", "-H", "localhost:2", "--gloo", python, "-c", ALLREDUCE],
                   timeout=timeout, env=env)
    got = re.findall(r"APPLIANCE_ALLREDUCE (\d) 2 \[([\d., ]+)\]", out)
    if rc == 0 and len(got) == 2 and all(v.split(",")[0].strip() == "3.0" for _, v in got):
        return Check("allreduce (2 ranks)", "ok", "horovodrun -np 2 on this node: sum = 3.0 on both ranks")
    tail = " | ".join(out.strip().splitlines()[-2:])[-300:]
    return Check("allreduce (2 ranks)", "fail", f"exit {rc}: {tail}",
                 "run `horovodrun --check-build`; rebuild with images/install-stack.sh if Gloo is missing")


def nic_checks(etc: Path | None) -> list[Check]:
    cfg_p = etc / "cluster.json" if etc else None
    if not cfg_p or not cfg_p.exists():
        return [Check("nic", "skip", "no cluster.json here: not a contextualized cluster node"),
                Check("firewalld", "skip", "no cluster.json here")]
    cfg = json.loads(cfg_p.read_text())
    env = etc / "env"
    m = re.search(r"^GLOO_SOCKET_IFNAME=(\S+)", env.read_text(), re.M) if env.exists() else None
    checks, my_ip = [], None
    if m is None:
        checks.append(Check("nic", "fail", f"{env} names no NIC", "re-run contextualize: `appliance train` or `up`"))
    else:
        nic = m.group(1)
        rc, out = _run(["ip", "-o", "-4", "addr", "show", "dev", nic], timeout=10)
        addr = re.search(r"inet ([\d.]+)", out)
        my_ip = addr.group(1) if rc == 0 and addr else None
        checks.append(Check("nic", "ok", f"{nic} {my_ip} (Gloo/NCCL)") if my_ip else
                      Check("nic", "fail", f"{nic} has no IPv4 address here", "re-run contextualize"))
    peers = [n["ip"] for n in cfg.get("nodes", []) if n["ip"] != my_ip]
    fw = shutil.which("firewall-cmd")
    state = _run([fw, "--state"], timeout=10)[1].strip() if fw else "not installed"
    if state != "running":
        checks.append(Check("firewalld", "ok", f"{state}: peers are not filtered"))
    else:
        rc, out = _run([fw, "--zone=trusted", "--list-sources"], timeout=10)
        trusted = {src.split("/")[0] for src in out.split()}
        missing = [ip for ip in peers if ip not in trusted]
        checks.append(Check("firewalld", "ok", f"running; all {len(peers)} peers trusted") if not missing else
                      Check("firewalld", "fail", f"running; peers not in the trusted zone: {', '.join(missing)}",
                            "re-run contextualize, or `sudo firewall-cmd --zone=trusted --add-source=IP --permanent "
                            "&& sudo firewall-cmd --reload`"))
    return checks


def examine(python: str | None = None, etc: str | None = None, allreduce: bool = True,
            gpu: bool = False) -> tuple[list[Check], dict]:
    """Every check of this node, and what the report says of it (versions, GPUs, nvidia-smi). ``gpu``: also the
    GPU checks of `appliance doctor --gpu` (appliance/node/gpudoctor.py)."""
    python = python or sys.executable
    etc_p = Path(etc or os.environ.get(Env.ETC) or "/etc/appliance")
    t0 = time.monotonic()
    p = probe(python)
    checks = stack_checks(p, _pins())
    checks[0].seconds = round(time.monotonic() - t0, 1)  # the probe's: Python, TensorFlow and Horovod imported
    checks += gpu_checks(p)
    if allreduce:
        t0 = time.monotonic()
        checks.append(allreduce_check(python) if "horovod" in p else
                      Check("allreduce (2 ranks)", "skip", "horovod is not importable"))
        checks[-1].seconds = round(time.monotonic() - t0, 1)
    checks += nic_checks(etc_p)
    if not gpu:
        return checks, {"probe": p}
    from . import gpudoctor

    more, info = gpudoctor.node_checks(python, p)
    return checks + more, info


def run_checks(python: str | None = None, etc: str | None = None, allreduce: bool = True) -> list[Check]:
    return examine(python, etc, allreduce)[0]


def as_dicts(checks: list[Check]) -> list[dict]:
    return [asdict(c) for c in checks]


def format_checks(checks: list[Check]) -> list[str]:
    mark = {"ok": "ok  ", "fail": "FAIL", "skip": "skip"}
    return [f"{mark[c.status]} {c.name:<26} {c.detail}" + (f"  (fix: {c.fix})" if c.fix else "")
            + (f"  [{c.seconds:.0f} s]" if c.seconds and c.seconds >= 1 else "") for c in checks]


def main(argv: list[str] | None = None) -> int:
    """Node-side entry (`python -m appliance.node.doctor`), used by `appliance doctor --cluster` over SSH."""
    import argparse

    ap = argparse.ArgumentParser()
    ap.add_argument("--python")
    ap.add_argument("--etc")
    ap.add_argument("--no-allreduce", action="store_true")
    ap.add_argument("--gpu", action="store_true", help="also the GPU checks (appliance/node/gpudoctor.py)")
    a = ap.parse_args(argv)
    checks, info = examine(a.python, a.etc, allreduce=not a.no_allreduce, gpu=a.gpu)
    emit(Line.DOCTOR, as_dicts(checks))
    if a.gpu:
        emit(Line.DOCTOR_INFO, info)
    return 1 if any(c.status == "fail" for c in checks) else 0


if __name__ == "__main__":
    sys.exit(main())
