"""`appliance doctor --gpu [--cluster NAME]`: every node's checks with the GPU ones, then the checks that need every
rank, then one report.

1. On every node at once, `python -m appliance.node.doctor --gpu` (over SSH; on this machine without --cluster):
   the node doctor's checks and appliance/node/gpudoctor.py's, each node's versions and nvidia-smi.
2. With GPUs, through the launch path `appliance train` uses (appliance/train/launch.py: contextualize, the code on
   every node, horovodrun on the head node, the environment's allow-list): the benchmark on 1 GPU; hvd.allreduce
   and hvd.broadcast of GPU tensors on one rank per GPU of every node (appliance/node/gpujobs.py ``nccl``, with
   ``NCCL_DEBUG=VERSION``); the benchmark on every GPU, and the scaling efficiency. Without a GPU they say
   ``skip`` (no GPU).
3. The report: JSON and Markdown (appliance/node/doctor_report.py), under ~/.appliance/doctor/ unless named.
"""

from __future__ import annotations

import dataclasses
import getpass
import shlex
import shutil
import socket
import sys
import tempfile
import time
from collections import defaultdict
from collections.abc import Callable
from pathlib import Path

from .. import paths, report
from ..bench import JOB_DIR, BenchConfig, bench_spec
from ..cluster import Cluster, Node, load_cluster
from ..errors import ApplianceError
from ..node import doctor as node_doctor, doctor_report, gpudoctor
from ..node.doctor import Check
from ..protocol import Line, parse
from ..remote import Session
from ..spec import Spec, Train
from ..train.launch import JobHooks, JobResult, train as train_job

log = report.get(__name__)

# ResNet-50, a batch a P100's 16 GB holds, a few steps: a number in about a minute per launch
BENCH = BenchConfig(models=["resnet50"], batch_sizes=[32], steps=20, warmup=5, local_steps=False)
JOB_LIMIT = 600  # seconds a doctor job may run on the nodes before it is ended
NODE_TIMEOUT = 1200  # seconds the node doctor may take over SSH with --gpu (300 without)
NAMES = ("nccl allreduce (all ranks)", "bench (1 GPU)", "bench (all GPUs)")


def examine_nodes(cluster: Cluster, allreduce: bool = True, gpu: bool = False) -> dict[str, tuple[list[Check], dict]]:
    """The node doctor on every node of ``cluster`` at once, with the cluster's Python: its checks and its info."""
    if cluster.single_host:
        return {cluster.head.name: node_doctor.examine(cluster.python, cluster.config_dir(cluster.head), allreduce,
                                                        gpu)}

    def one(remote) -> tuple[list[Check], dict]:
        node = remote.node
        cmd = (f"{shlex.quote(cluster.python)} -m appliance.node.doctor --python {shlex.quote(cluster.python)} "
               f"--etc {shlex.quote(cluster.config_dir(node))}" + ("" if allreduce else " --no-allreduce")
               + (" --gpu" if gpu else ""))
        r = remote.run(cmd, timeout=NODE_TIMEOUT if gpu else 300)
        got = {kind: body for kind, body in filter(None, (parse(line, (Line.DOCTOR, Line.DOCTOR_INFO))
                                                          for line in r.out.splitlines()))}
        if Line.DOCTOR in got:
            return [Check(**c) for c in got[Line.DOCTOR]], got.get(Line.DOCTOR_INFO, {})
        tail = (r.err.strip().splitlines() or [f"exit {r.rc}"])[-1]
        fix = ("the node's appliance package is older than this one: update it (`appliance up SPEC --install`, or "
               "a new image)" if "unrecognized arguments" in tail else
               "the node lacks the appliance package: use the appliance image or `appliance up --install`")
        return [Check("appliance", "fail", f"the doctor did not run on {node.name}: {tail}", fix)], {}

    with Session(cluster) as session:
        return session.each(one)


def this_machine(python: str, gpus: int) -> Cluster:
    """This machine as a one-node cluster (no SSH), one rank per GPU: `appliance doctor --gpu` on a node."""
    node = Node(name=socket.gethostname(), private_ip="127.0.0.1", address=None,
                workdir=str(paths.home() / "doctor"), slots=max(1, gpus), user=getpass.getuser())
    return Cluster(name="", cloud="node", nodes=[node], python=python)


def view(cluster: Cluster, slots: dict[str, int]) -> Cluster:
    """The nodes of ``cluster`` named in ``slots``, with that many ranks each (a view: never saved as such)."""
    nodes = [dataclasses.replace(n, slots=slots[n.name]) for n in cluster.nodes if slots.get(n.name)]
    return dataclasses.replace(cluster, nodes=nodes, subset_of=len(cluster.nodes))


def slots_check(cluster: Cluster, gpus: dict[str, int]) -> Check | None:
    """Whether the spec's nodes.slots fits the GPUs each node has (a cluster a spec made; None for this machine)."""
    if cluster.cloud == "node":
        return None
    for n in cluster.nodes:
        if not gpus.get(n.name):
            return Check("ranks per node", "fail", f"{n.name} has no GPU (nvidia-smi lists none); the checks below run "
                         "on the nodes that have", f"see {n.name}'s lines above; a node type with GPUs for every node")
        if n.slots > gpus.get(n.name, 0):
            return Check("ranks per node", "fail", f"{n.slots} rank(s) on {n.name}, which has {gpus.get(n.name, 0)} "
                         "GPU(s): ranks would share a GPU, which NCCL refuses",
                         f"set nodes.slots to {gpus.get(n.name, 0)} in the spec")
    spare = sorted({(n.slots, gpus[n.name]) for n in cluster.nodes if n.slots < gpus[n.name]})
    if spare:
        return Check("ranks per node", "ok", f"nodes.slots {spare[0][0]} uses {spare[0][0]} of {spare[0][1]} GPUs per "
                     "node (these checks use all of them)")
    return Check("ranks per node", "ok", "nodes.slots = the GPUs of every node")


class _RankLines(JobHooks):
    """Every rank's lines, kept (NCCL's version line is one)."""

    def __init__(self):
        self.lines: dict[int, list[str]] = defaultdict(list)

    def rank_line(self, rank: int, text: str) -> bool:
        self.lines[rank].append(text)
        return False


def _spec(name: str, command: str, code: Path, env: dict[str, str] | None = None) -> Spec:
    return Spec(name=name, train=Train(command=command, code=str(code), env=env or {}, start_timeout=120))


def _failed(name: str, res: JobResult) -> Check:
    return Check(name, "fail", f"the job failed: {res.failure}", f"its log: {res.log_path}")


def nccl_every_rank(cluster: Cluster, run: Callable) -> list[Check]:
    """gpujobs.py's nccl job on one rank per GPU of every node, through horovodrun as `appliance train` runs it."""
    n = cluster.world_size
    label = f"{n} ranks"
    code = Path(tempfile.mkdtemp(prefix="appliance-doctor-"))
    try:
        shutil.copy(gpudoctor.GPUJOBS, code / "gpujobs.py")
        spec = _spec("doctor-nccl", f"python gpujobs.py nccl --limit {JOB_LIMIT}", code, {"NCCL_DEBUG": "VERSION"})
        lines, said = _RankLines(), []
        t0 = time.monotonic()
        res = run(spec, cluster, out=said.append, hooks=[lines])
    except ApplianceError as e:
        return [Check(f"nccl allreduce ({label})", "fail", f"the job did not start: {e.message}", e.fix),
                Check(f"nccl at run time ({label})", "skip", "the allreduce did not run")]
    finally:
        shutil.rmtree(code, ignore_errors=True)
    checks = [gpudoctor.allreduce_verdict(res.results, n, label),
              gpudoctor.runtime_verdict(res.results, {r: "\n".join(v) for r, v in lines.lines.items()}, n, label)]
    if res.exit_code != 0 and checks[0].status == "ok":
        checks[0] = _failed(checks[0].name, res)
    checks[0].seconds = round(time.monotonic() - t0, 1)
    checks[0].data = {"results": res.results, "log": res.log_path}
    return checks


def bench(cluster: Cluster, run: Callable, label: str) -> Check:
    """The synthetic benchmark (appliance/bench/job/synthetic.py) on ``cluster``'s ranks: its samples/s."""
    bspec = bench_spec(_spec("doctor", "", JOB_DIR), BENCH)
    bspec = dataclasses.replace(bspec, train=dataclasses.replace(
        bspec.train, command=f"timeout -k 10 {JOB_LIMIT} {bspec.train.command}"))
    t0 = time.monotonic()
    name = f"bench ({label})"
    try:
        res = run(bspec, cluster, out=[].append)
    except ApplianceError as e:
        return Check(name, "fail", f"the job did not start: {e.message}", e.fix)
    if res.exit_code != 0 or not res.results.get(0, {}).get("bench"):
        check = _failed(name, res)
    else:
        cell = res.results[0]["bench"][0]
        check = Check(name, "ok", f"{cell['aggregate']:.1f} samples/s: {cell['model']}, batch {cell['batch']} per "
                      f"rank, {cell['ranks']} rank(s), {cell['device']}", data=cell)
    check.seconds = round(time.monotonic() - t0, 1)
    return check


def efficiency(one: Check, every: Check) -> None:
    """Adds the scaling efficiency to the every-GPU bench line: aggregate(N) / (N x aggregate(1)), 1.0 = linear."""
    if one.status == "ok" and every.status == "ok":
        eff = every.data["aggregate"] / (every.data["ranks"] * one.data["aggregate"])
        every.detail += f"; scaling efficiency {eff:.2f} (1.0 = linear)"
        every.data = {**every.data, "efficiency": eff}


def cluster_checks(cluster: Cluster, gpus: dict[str, int], run: Callable | None = None) -> list[Check]:
    """The checks that need every rank (or GPUs at all): skipped without a GPU."""
    run = run or train_job
    if not sum(gpus.values()):
        return [Check(n, "skip", gpudoctor.NO_GPU) for n in NAMES]
    checks = [c for c in (slots_check(cluster, gpus),) if c is not None]
    if not gpus.get(cluster.head.name):
        return checks + [Check(n, "fail", f"the head node {cluster.head.name} has no GPU", "lease GPU nodes")
                         for n in NAMES]
    every = view(cluster, gpus)
    try:
        log.info("[doctor] the benchmark on 1 GPU")
        one = bench(view(cluster, {cluster.head.name: 1}), run, "1 GPU")
        if every.world_size == 1:
            return checks + [Check(NAMES[0], "skip", "one GPU in all: see the 1-rank lines"), one,
                             Check(NAMES[2], "skip", "one GPU in all")]
        log.info(f"[doctor] an NCCL allreduce and broadcast on {every.world_size} ranks")
        checks += nccl_every_rank(every, run)
        log.info(f"[doctor] the benchmark on {every.world_size} GPUs")
        all_of_them = bench(every, run, f"{every.world_size} GPUs")
        efficiency(one, all_of_them)
        return checks + [one, all_of_them]
    finally:
        if not cluster.single_host:  # the jobs contextualized views of it: the whole cluster's files back
            _contextualize(cluster)


def _contextualize(cluster: Cluster) -> None:
    from ..provision.contextualize import contextualize

    try:
        with report.muted():
            contextualize(cluster)
    except ApplianceError as e:
        log.info(f"[doctor] note: the cluster's files were not restored ({e.message}); `appliance train` does it")


def doctor_gpu(cluster_name: str | None = None, python: str | None = None, etc: str | None = None,
               allreduce: bool = True, report_path: str | None = None, command: str = "appliance doctor --gpu",
               run: Callable | None = None) -> dict:
    """`appliance doctor --gpu`: the report (as build() makes it) with ``report`` = its JSON and Markdown paths."""
    t0 = time.monotonic()
    log.info(f"[doctor] the checks of {'every node of ' + cluster_name if cluster_name else 'this node'}, with the "
             "GPU ones (TensorFlow starts several times on each node)")
    if cluster_name:
        cluster = load_cluster(cluster_name)
        nodes = examine_nodes(cluster, allreduce, gpu=True)
    else:
        python = python or sys.executable
        nodes = {socket.gethostname(): node_doctor.examine(python, etc, allreduce, gpu=True)}
        cluster = this_machine(python, len(next(iter(nodes.values()))[1].get("gpus", [])))
    gpus = {name: len(info.get("gpus", [])) for name, (_, info) in nodes.items()}
    every = cluster_checks(cluster, gpus, run)
    rep = doctor_report.build(nodes, every, cluster=cluster_name, command=command, seconds=time.monotonic() - t0)
    path = Path(report_path) if report_path else (
        paths.home() / "doctor" / f"{cluster_name or socket.gethostname()}-{time.strftime('%Y%m%dT%H%M%S')}.json")
    json_p, md_p = doctor_report.write(rep, path)
    rep["report"] = {"json": str(json_p), "markdown": str(md_p)}
    return rep
