"""`appliance doctor --gpu` on one node: the checks that run something on the device, each judged here.

After the node doctor's own checks (appliance/node/doctor.py), in order:
- ``nccl linkage`` / ``cuda archs``: which NCCL Horovod's library loads and the CUDA archs in it, read from the
  file (appliance/node/linkage.py);
- ``nccl allreduce (1 rank)`` / ``nccl at run time (1 rank)``: hvd.allreduce and hvd.broadcast of tensors on the
  GPU in one process, with ``NCCL_DEBUG=VERSION``: NCCL prints its version once, /proc/self/maps shows exactly
  one libnccl;
- ``resume bit-exact``: op determinism and seeds, K steps, a tf.train.Checkpoint, a restore in a new process,
  N-K steps; the weights equal those of N uninterrupted steps (np.array_equal), on the GPU (the CPU without one);
- ``weights on the CPU``: that checkpoint loaded in a new process with ``CUDA_VISIBLE_DEVICES=""``, its predictions
  within a tolerance of the device's.
The jobs are appliance/node/gpujobs.py, run with the venv's Python; the cluster-wide checks (every rank, the
benchmark) are appliance/flows/gpucheck.py's. Without a GPU the GPU-only checks say ``skip`` with ``no GPU``.
"""

from __future__ import annotations

import json
import os
import platform
import re
import shutil
import socket
import tempfile
import time
from pathlib import Path

from ..protocol import Line, parse
from . import linkage
from .doctor import Check, _run

GPUJOBS = Path(__file__).with_name("gpujobs.py")
NO_GPU = "no GPU"
BROADCAST = 7.0  # what rank 0 broadcasts in the nccl job (rank * 10 + 7)
CPU_TOLERANCE = 1e-4  # |CPU prediction - device prediction| <= this x max(1, max |device prediction|)
RESUME_STEPS, RESUME_SPLIT = 8, 3
NCCL_REBUILD = ("rebuild Horovod for the GPU: images/install-stack.sh --variant gpu (HOROVOD_GPU_OPERATIONS=NCCL, "
                "NCCL linked as a shared library)")
ASK = "attach the report (its path is printed last) to a question"
_VERSION = re.compile(r"^NCCL version (\S+)", re.M)


def job(python: str, args: list[str], env: dict | None = None, timeout: float = 300) -> tuple[dict, str, float]:
    """Run one gpujobs.py job: (its result, its whole output, seconds). A job that printed no result has an
    ``error`` made of its exit status and last line."""
    e = {**os.environ, "TF_CPP_MIN_LOG_LEVEL": "3", "TF_USE_LEGACY_KERAS": "1", **(env or {})}
    t0 = time.monotonic()
    rc, out = _run([python, str(GPUJOBS), *args, "--limit", str(int(timeout) - 10)], timeout=timeout, env=e)
    result = None
    for line in out.splitlines():
        got = parse(line, (Line.RESULT,))
        if got is not None:
            result = got[1]
    if not isinstance(result, dict):
        tail = (out.strip().splitlines() or [""])[-1][-300:]
        result = {"error": f"exit {rc}: {tail}"}
    return result, out, time.monotonic() - t0


def first_line(error: str) -> str:
    """The sentence of a TensorFlow error that says what went wrong, without the op's decorations."""
    text = re.sub(r"\{\{function_node [^}]*\}\}\s*", "", error)
    for line in text.splitlines():
        line = re.sub(r"\s*\[Op:[^\]]*\]\s*$", "", line).strip()
        if line and not line.startswith(("Graph execution error", "Detected at node", "File ", "[[")) \
                and not line.endswith("Error: Graph execution error:"):
            return line
    return text.strip()[:200]


def op_of(error: str) -> str | None:
    """The op a TensorFlow error names: the graph node, or the eager op (not the tf.function it ran in)."""
    for pat in (r"\{\{node ([^}]+)\}\}", r"Detected at node (\S+)", r"__wrapped__(\w+?)_device_",
                r"\[Op:(?!__inference)([^\]]+)\]"):
        m = re.search(pat, error)
        if m:
            return m.group(1)
    return None


# -- NCCL -----------------------------------------------------------------------------------------------------------

def _job_errors(results: dict[int, dict], size: int) -> str | None:
    missing = [r for r in range(size) if r not in results]
    for r in sorted(results):
        if "error" in results[r]:
            return f"rank {r}{' on ' + results[r]['host'] if results[r].get('host') else ''}: " \
                   f"{first_line(results[r]['error'])}"
    return f"rank(s) {', '.join(map(str, missing))} reported nothing (see the job's log)" if missing else None


def allreduce_verdict(results: dict[int, dict], size: int, label: str) -> Check:
    """Every rank got the sum of 1..size and rank 0's broadcast, on its GPU."""
    name, want = f"nccl allreduce ({label})", float(size * (size + 1) // 2)
    err = _job_errors(results, size)
    if err:
        return Check(name, "fail", err, "see the nccl line of the report; `NCCL_DEBUG=INFO` shows NCCL's own view")
    for r in sorted(results):
        got = results[r]
        if got["sum"] != [want] * 4 or got["broadcast"] != [BROADCAST] * 4:
            return Check(name, "fail", f"rank {r}: allreduce sum {got['sum'][0]}, broadcast {got['broadcast'][0]}; "
                         f"expected {want}, {BROADCAST}", ASK)
        if "GPU" not in str(got.get("device", "")).upper():
            return Check(name, "fail", f"rank {r}: the allreduce ran on {got.get('device')}, not the GPU: this Horovod "
                         "has no GPU operations", NCCL_REBUILD)
    shared = sorted({results[r]["host"] for r in results if results[r].get("shared_gpu")})
    note = f"; ranks share a GPU on {', '.join(shared)}" if shared else ""
    return Check(name, "ok", f"{size} rank(s), tensors on the GPU: allreduce sum = {want:g}, broadcast from rank 0 = "
                 f"{BROADCAST:g}{note}")


def runtime_verdict(results: dict[int, dict], outputs: dict[int, str], size: int, label: str) -> Check:
    """With NCCL_DEBUG=VERSION, NCCL prints its version when a communicator starts, on the communicator's rank 0
    (NVIDIA/nccl src/init.cc ``showVersion``): at least one line in the job, never two in one rank (two NCCLs in one
    process). Each rank mapped exactly one libnccl, and every rank's reports the same version."""
    name = f"nccl at run time ({label})"
    if _job_errors(results, size):
        return Check(name, "skip", "the allreduce did not run")
    printed = {r: _VERSION.findall(outputs.get(r, "")) for r in results}
    for r in sorted(results):
        where = f"rank {r}" + (f" on {results[r]['host']}" if results[r].get("host") else "")
        mapped = results[r].get("nccl_libs", [])
        if len(printed[r]) > 1:
            return Check(name, "fail", f"{where}: NCCL started {len(printed[r])} times ({', '.join(printed[r])}): two "
                         "NCCLs in one process", NCCL_REBUILD)
        if len(mapped) != 1:
            why = ("none: NCCL is compiled into Horovod's library (see nccl linkage)" if not mapped else
                   ", ".join(mapped))
            return Check(name, "fail", f"{where}: {len(mapped)} libnccl mapped ({why})", NCCL_REBUILD)
    lines = [v for seen in printed.values() for v in seen]
    if not lines:
        return Check(name, "fail", "NCCL printed no version (NCCL_DEBUG=VERSION): the GPU allreduce did not go "
                     "through NCCL", NCCL_REBUILD)
    versions = {results[r].get("nccl_version") or "?" for r in results}
    if len(versions) > 1:
        return Check(name, "fail", f"the ranks run different NCCLs: {', '.join(sorted(versions))}",
                     "install the same stack on every node (the appliance image, or `appliance up --install`)")
    libs = sorted({lib for r in results for lib in results[r]["nccl_libs"]})
    return Check(name, "ok", f"NCCL {lines[0]} started once; one libnccl in each of {size} rank(s) "
                 f"({versions.pop()}): {', '.join(libs)}", data={"nccl_version": lines[0], "libnccl": libs})


def nccl_one_rank(python: str, p: dict, gpus: int) -> list[Check]:
    """The NCCL checks in one process on this node's first GPU (no horovodrun: Horovod runs as one process)."""
    names = ("nccl allreduce (1 rank)", "nccl at run time (1 rank)")
    if not gpus:
        return [Check(n, "skip", NO_GPU) for n in names]
    if "horovod" not in p or "tensorflow" not in p:
        return [Check(n, "skip", "TensorFlow or Horovod is not importable") for n in names]
    res, out, secs = job(python, ["nccl"], env={"NCCL_DEBUG": "VERSION"}, timeout=240)
    checks = [allreduce_verdict({0: res}, 1, "1 rank"), runtime_verdict({0: res}, {0: out}, 1, "1 rank")]
    checks[0].seconds, checks[0].data = round(secs, 1), res
    return checks


# -- resume -----------------------------------------------------------------------------------------------------------

def resume_verdict(a: dict, b: dict | None) -> Check:
    """The uninterrupted run (``a``: the train job) against the restored one (``b``: the resume job)."""
    name = "resume bit-exact"
    err = a.get("error") or (b or {}).get("error")
    if err:
        op = op_of(err)
        if op:
            return Check(name, "fail", f"op {op} under op determinism: {first_line(err)}",
                         "a job with this op cannot resume bit-exactly: replace the op, or accept a resume that is "
                         "not bit-exact (docs/resume.md)")
        return Check(name, "fail", first_line(err), ASK)
    steps, split, device = b["steps"], b["split"], b["device"]
    if b["differ"]:
        return Check(name, "fail", f"after a restore in a new process the weights differ from {steps} uninterrupted "
                     f"steps' on {device}: {len(b['differ'])} of {b['variables']} variables, max |diff| "
                     f"{b['max_abs_diff']:.3g} ({b['differ'][0]} first)", ASK)
    return Check(name, "ok", f"{split} steps, checkpoint, restore in a new process, {steps - split} steps == {steps} "
                 f"uninterrupted steps, bit for bit ({b['variables']} variables, {device})")


def cpu_verdict(c: dict | None, trained_on: str) -> Check:
    name = "weights on the CPU"
    if c is None:
        return Check(name, "skip", "no checkpoint: the resume check did not finish")
    if "error" in c:
        return Check(name, "fail", f"the {trained_on} checkpoint does not load on the CPU: {first_line(c['error'])}",
                     ASK)
    tol = CPU_TOLERANCE * max(1.0, c["scale"])
    if c["gpus_visible"]:
        return Check(name, "fail", f"CUDA_VISIBLE_DEVICES=\"\" still showed {c['gpus_visible']} GPU(s)", ASK)
    if c["max_abs_diff"] > tol:
        return Check(name, "fail", f"the {trained_on} checkpoint loads on the CPU but predicts differently: max "
                     f"|diff| {c['max_abs_diff']:.3g} > {tol:.1g}", ASK)
    return Check(name, "ok", f"the {trained_on} checkpoint loads in a new CPU-only process: predictions within "
                 f"{c['max_abs_diff']:.1e} (tolerance {tol:.0e})")


def resume_checks(python: str, p: dict, seeds: tuple[int, int] = (1, 1), inject: str = "none") -> list[Check]:
    """The bit-exact resume, then the CPU restore of its final checkpoint. ``seeds``: the first and the second
    process's (a different second seed gives other batches after the restore: the check must fail); ``inject``: an
    op gpujobs.py adds to every step (``timestamp``: one TensorFlow refuses under op determinism)."""
    if "tensorflow" not in p:
        return [Check(n, "skip", "TensorFlow is not importable") for n in ("resume bit-exact", "weights on the CPU")]
    d = tempfile.mkdtemp(prefix="appliance-doctor-")
    try:
        common = ["--dir", d, "--steps", str(RESUME_STEPS), "--split", str(RESUME_SPLIT), "--inject", inject]
        a, _, ta = job(python, ["train", *common, "--seed", str(seeds[0])])
        b, tb = None, 0.0
        if "error" not in a:
            b, _, tb = job(python, ["resume", *common, "--seed", str(seeds[1])])
        resumed = resume_verdict(a, b)
        resumed.seconds, resumed.data = round(ta + tb, 1), {"train": a, "resume": b}
        c, tc = None, 0.0
        if b is not None and "error" not in b:
            c, _, tc = job(python, ["cpu-restore", "--dir", d], env={"CUDA_VISIBLE_DEVICES": ""})
        on_cpu = cpu_verdict(c, (b or {}).get("device", "?"))
        on_cpu.seconds, on_cpu.data = round(tc, 1), c
        return [resumed, on_cpu]
    finally:
        shutil.rmtree(d, ignore_errors=True)


# -- the node -------------------------------------------------------------------------------------------------------

def nvidia_smi() -> dict:
    """The GPUs nvidia-smi lists (index, name, memory, driver, compute capability) and its own text."""
    fields = ["index", "name", "memory.total", "driver_version", "compute_cap"]
    rc, out = _run(["nvidia-smi", f"--query-gpu={','.join(fields)}", "--format=csv,noheader"], timeout=30)
    if rc not in (0, 127):  # a driver older than the compute_cap field
        fields.pop()
        rc, out = _run(["nvidia-smi", f"--query-gpu={','.join(fields)}", "--format=csv,noheader"], timeout=30)
    if rc != 0:
        return {"gpus": [], "text": out.strip()[-500:] if rc != 127 else "nvidia-smi: not found"}
    gpus = [dict(zip(fields, (x.strip() for x in line.split(",")))) for line in out.splitlines() if line.strip()]
    smi = {"gpus": gpus, "text": _run(["nvidia-smi"], timeout=30)[1]}
    if len(gpus) > 1:
        smi["topology"] = _run(["nvidia-smi", "topo", "-m"], timeout=30)[1]
    return smi


def linkage_checks(p: dict, gpus: int) -> list[Check]:
    if "horovod_dir" not in p:
        return [Check("nccl linkage", "skip", "horovod is not importable")]
    t0 = time.monotonic()
    checks = linkage.check(Path(p["horovod_dir"]), expect="gpu" if gpus else "any")
    checks[0].seconds = round(time.monotonic() - t0, 1)
    return checks


def node_info(p: dict, smi: dict, checks: list[Check]) -> dict:
    """What the report says of this node besides its checks."""
    nccl = next((c.data["nccl_version"] for c in checks if c.data and "nccl_version" in c.data), None)
    versions = {"python": p.get("python"), "tensorflow": p.get("tensorflow"), "tf_keras": p.get("tf_keras"),
                "horovod": p.get("horovod"), "nccl (run time)": nccl,
                **{f"{k.replace('_version', '')} (TensorFlow's build)": v for k, v in p.get("tf_build", {}).items()},
                "driver": smi["gpus"][0].get("driver_version") if smi["gpus"] else None}
    return {"host": socket.gethostname(), "kernel": platform.release(), "python": p.get("executable"),
            "versions": versions, "gpus": smi["gpus"], "nvidia_smi": smi["text"],
            **({"nvidia_smi_topology": smi["topology"]} if "topology" in smi else {})}


def node_checks(python: str, p: dict) -> tuple[list[Check], dict]:
    """This node's GPU checks (CPU-only where it has no GPU) and what the report says of it."""
    t0 = time.monotonic()
    smi = nvidia_smi()
    gpus = len(smi["gpus"])
    checks = linkage_checks(p, gpus) + nccl_one_rank(python, p, gpus) + resume_checks(python, p)
    info = node_info(p, smi, checks)
    info["seconds"] = round(time.monotonic() - t0, 1)
    return checks, json.loads(json.dumps(info, default=str))
