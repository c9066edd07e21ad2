"""`appliance bench`: synthetic-data training throughput on 1..N nodes of a cluster, before a lease is spent.

The job (``job/synthetic.py``) runs through the same launch path as training (``flows.run_job``:
contextualize, code copy, horovodrun on the head node, scrubbed environment), once per node count, with
every (model, batch size) cell inside that one launch. Each cell's throughput is *measured*: all ranks'
samples over the wall time between two barriers. From the cells:

- scaling efficiency(n) = aggregate(n nodes) / (n x aggregate(1 node)); 1.0 is linear scaling;
- speedup(n) = aggregate(n nodes) / aggregate(1 node), plotted against the ideal line;
- the allreduce share of a step: 1 - (step time without allreduce) / (step time with it);
- per-rank spread: (fastest - slowest rank) / mean, a straggler shows here.

``overhead`` launches the same job through ``appliance train`` and through a bare ``horovodrun`` on the
head node, alternately, and reports the throughput ratio (goal >= 0.98) and the end-to-end wall times.
"""

from __future__ import annotations

import dataclasses
import json
import os
import re
import shlex
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path

from ..cluster import Cluster
from ..errors import ApplianceError
from ..protocol import rank_environment
from ..sites import rank_env as site_rank_env
from ..train.launch import train as train_job
from ..spec import Checkpoint, Spec
from .. import report as messages  # not `report`: bench/report.py, once imported, is this package's `report`

log = messages.get(__name__)

JOB_DIR = Path(__file__).with_name("job")
MODELS = ("resnet50", "cnn", "mlp")
CPU_NOTE = ("CPU testbed: every node is a network namespace on this one machine, so all ranks share its cores; "
            "these numbers measure the launch and communication path, not the hardware. Run on GPU nodes for "
            "numbers that say what a lease will deliver.")


@dataclass
class BenchConfig:
    models: list[str] = field(default_factory=lambda: ["cnn", "mlp"])
    batch_sizes: list[int] = field(default_factory=lambda: [16, 32])
    nodes: list[int] | None = None  # node counts to run on; None = 1 and every power of two up to all
    steps: int = 20
    warmup: int = 5
    precision: str = "fp32"
    image_size: int = 224
    local_steps: bool = True  # also time the steps without allreduce (the allreduce share)

    def __post_init__(self):
        bad = [m for m in self.models if m not in MODELS]
        if bad:
            raise ApplianceError(f"unknown model(s) {', '.join(bad)}", f"choose from {', '.join(MODELS)}", exit_code=2)
        if not self.models or not self.batch_sizes or any(b < 1 for b in self.batch_sizes):
            raise ApplianceError("bench needs at least one model and positive batch sizes",
                                 "e.g. --models cnn --batch-sizes 16,32", exit_code=2)
        if self.steps < 1 or self.warmup < 0:
            raise ApplianceError("--steps must be >= 1 and --warmup >= 0", exit_code=2)
        if self.precision not in ("fp32", "mixed"):
            raise ApplianceError(f"unknown precision {self.precision!r}", "fp32 or mixed", exit_code=2)

    def command(self) -> str:
        return (f"python synthetic.py --models {','.join(self.models)} "
                f"--batch-sizes {','.join(map(str, self.batch_sizes))} --steps {self.steps} --warmup {self.warmup} "
                f"--precision {self.precision} --image-size {self.image_size}"
                + ("" if self.local_steps else " --no-local"))


def node_counts(cfg: BenchConfig, cluster: Cluster) -> list[int]:
    total = len(cluster.nodes)
    if cfg.nodes:
        bad = [n for n in cfg.nodes if not 1 <= n <= total]
        if bad:
            raise ApplianceError(f"cluster {cluster.name!r} has {total} node(s); cannot bench on "
                                 f"{', '.join(map(str, bad))}", f"--nodes between 1 and {total}", exit_code=2)
        return sorted(set(cfg.nodes))
    counts, n = [], 1
    while n < total:
        counts.append(n)
        n *= 2
    return counts + [total]


def bench_spec(spec: Spec, cfg: BenchConfig) -> Spec:
    """The spec the benchmark runs under: the cluster's spec with the synthetic job as its training command, no
    dataset and no checkpoints. Its run name is SPEC's name + '-bench'."""
    name = f"{spec.name[:32]}-bench"
    train = dataclasses.replace(spec.train, command=cfg.command(), code=str(JOB_DIR), env={})
    return dataclasses.replace(spec, name=name, train=train, dataset=None, checkpoint=Checkpoint())


def _cells(result: dict) -> list[dict]:
    r0 = result.get(0) or {}
    if "bench" not in r0:
        raise ApplianceError("the benchmark job ended without rank 0's results", "see the job log")
    return r0["bench"]


def scaling(runs: list[dict]) -> list[dict]:
    """Speedup and efficiency of every (model, batch) cell against the same cell on the fewest nodes.

    ``runs``: [{"nodes": n, "cells": [...]}, ...]. With 1 node among them the baseline is 1 node; otherwise
    the smallest count n0 measured, and efficiency(n) = agg(n) * n0 / (agg(n0) * n)."""
    if not runs:
        return []
    runs = sorted(runs, key=lambda r: r["nodes"])
    base_n = runs[0]["nodes"]
    base = {(c["model"], c["batch"]): c["aggregate"] for c in runs[0]["cells"]}
    out = []
    for r in runs:
        for c in r["cells"]:
            b = base.get((c["model"], c["batch"]))
            speedup = c["aggregate"] / b if b else None
            out.append({"model": c["model"], "batch": c["batch"], "nodes": r["nodes"], "ranks": c["ranks"],
                        "aggregate": c["aggregate"], "baseline_nodes": base_n,
                        "speedup": speedup,
                        "efficiency": speedup * base_n / r["nodes"] if speedup is not None else None,
                        "allreduce_share": c["allreduce_share"], "per_rank_spread": c["per_rank_spread"],
                        "step_ms": c["step_ms"], "local_step_ms": c["local_step_ms"]})
    return out


def run_bench(spec: Spec, cluster: Cluster, cfg: BenchConfig, out_dir: Path | None = None,
              out: Callable[[str], None] | None = None,
              command: str = "appliance bench", run_job: Callable | None = None) -> dict:
    """Run the synthetic benchmark on 1..N nodes of ``cluster``; write bench.json, bench.md and the plots to
    ``out_dir`` (default: the run's results folder); return the report. ``run_job``: how a job runs (flows.run_job:
    the appliance's hooks included, as `appliance train`; default train.launch.train alone)."""
    train = run_job or train_job

    from .. import paths
    from . import report

    counts = node_counts(cfg, cluster)
    bspec = bench_spec(spec, cfg)
    out_dir = Path(out_dir) if out_dir else paths.home() / "runs" / bspec.name / time.strftime("%Y%m%dT%H%M%S")
    runs, jobs = [], []
    try:
        for n in counts:
            part = cluster if n == len(cluster.nodes) else cluster.subset(n)
            log.info(f"[bench] {n} node(s), {part.world_size} rank(s): {', '.join(cfg.models)} x batch "
                     f"{', '.join(map(str, cfg.batch_sizes))}, {cfg.steps} steps after {cfg.warmup} warm-up")
            res = train(bspec, part, out=out)
            jobs.append({"nodes": n, "job_id": res.job_id, "exit_code": res.exit_code, "wall_s": round(res.wall_s, 2),
                         "log": res.log_path})
            if res.exit_code != 0:
                raise ApplianceError(f"benchmark job on {n} node(s) failed: {res.failure}", f"full log: {res.log_path}",
                                     exit_code=res.exit_code)
            runs.append({"nodes": n, "ranks": part.world_size, "hosts": res.results[0].get("hosts"),
                         "cells": _cells(res.results)})
    finally:
        if counts and counts[-1] != len(cluster.nodes):  # the last job contextualized a part: put the whole back
            from ..provision.contextualize import contextualize

            with messages.muted():
                contextualize(cluster)
    first = runs[0]["cells"][0] if runs and runs[0]["cells"] else {}
    device = first.get("device", "?")
    rep = {
        "command": command, "spec": spec.path, "cluster": cluster.name, "cloud": cluster.cloud,
        "device": device, "config": dataclasses.asdict(cfg) | {"nodes": counts},
        "note": CPU_NOTE if cluster.cloud in ("testbed", "local") and device.startswith("CPU") else None,
        "runs": runs, "scaling": scaling(runs), "jobs": jobs,
        "definitions": {
            "aggregate": "all ranks' samples / wall time between the barriers around the measured steps (samples/s)",
            "efficiency": "aggregate(n nodes) / (n x aggregate(1 node)); 1.0 = linear scaling. Some write the "
                          "ratio the other way round (n x single-node / n-node), which is its reciprocal",
            "allreduce_share": "1 - step time without allreduce / step time with it",
            "per_rank_spread": "(fastest - slowest rank's samples/s) / mean",
        },
    }
    report.write(rep, out_dir)
    rep["out_dir"] = str(out_dir)
    return rep


# ---------------------------------------------------------------------------------------------
# launch overhead: appliance train vs bare horovodrun

RESULT_LINE = re.compile(r"^\[(\d+)\]<stdout>:APPLIANCE_RESULT (.*)$")


def bare_horovodrun(cluster: Cluster, spec: Spec, session, on_line=None,
                    rank_env: Mapping[str, str] | None = None) -> tuple[dict[int, dict], float, int]:
    """Run the spec's command with a bare horovodrun on the head node, the way a user would by hand after
    `appliance train` copied the code there: venv on PATH, the cluster's ssh config, nothing else but
    ``rank_env``, what the appliance's ranks get on these machines too (sites.rank_env: a fair comparison).
    Returns (per-rank results, wall seconds, exit code)."""
    from ..train.headjob import code_dir
    from ..train.launch import SYSTEM_PATH

    venv_bin = str(Path(cluster.python).parent)
    etc_bin = f"{cluster.config_dir(cluster.head)}/bin"
    if cluster.single_host:
        hosts, nic = f"localhost:{cluster.world_size}", ""
    else:
        hosts = ",".join(f"{n.name}:{n.slots}" for n in cluster.nodes)
        nic = f"--network-interface {shlex.quote(cluster.nic)} " if len(cluster.nodes) > 1 and cluster.nic else ""
    # horovodrun puts its whole environment on every rank's command line: the same allow-list as `train`
    env = rank_environment(path=etc_bin + ":" + venv_bin + ":" + SYSTEM_PATH,
                           home="/root" if cluster.head.user == "root" else f"/home/{cluster.head.user}", nic=None,
                           extra=rank_env, launcher_env=os.environ)
    assigns = " ".join(f"{k}={shlex.quote(v)}" for k, v in env.items())
    cmd = (f"cd {shlex.quote(code_dir(cluster, spec.name))} && exec env -i {assigns} "
           f"horovodrun -np {cluster.world_size} -H {hosts} {nic}--gloo {spec.train.command}")
    results: dict[int, dict] = {}

    def line(stream: str, text: str) -> None:
        m = RESULT_LINE.match(text)
        if m:
            results[int(m.group(1))] = json.loads(m.group(2))
        if on_line:
            on_line(text)

    t0 = time.monotonic()
    r = session.head.run(cmd, on_line=line)
    return results, time.monotonic() - t0, r.rc


def overhead(spec: Spec, cluster: Cluster, cfg: BenchConfig, repeats: int = 3,
             out: Callable[[str], None] | None = None,
             run_job: Callable | None = None) -> dict:
    """The same synthetic job through `appliance train` and through bare horovodrun on the same nodes,
    alternately ``repeats`` times each; best throughput of each path, ratio = appliance / bare. What the cluster's
    site gives the appliance's ranks (sites.rank_env) the bare ones get too."""
    from ..remote import Session

    rank_env = site_rank_env(cluster)
    train = run_job or train_job

    if len(cfg.models) != 1 or len(cfg.batch_sizes) != 1:
        raise ApplianceError("--overhead measures one cell", "give one --models and one --batch-sizes", exit_code=2)
    bspec = bench_spec(spec, dataclasses.replace(cfg, local_steps=False))
    samples = {"appliance": [], "bare": []}
    walls = {"appliance": [], "bare": []}

    def via_appliance() -> None:
        res = train(bspec, cluster, out=out)  # also copies the code and contextualizes for the bare run
        if res.exit_code != 0:
            raise ApplianceError(f"benchmark job failed: {res.failure}", f"full log: {res.log_path}",
                                 exit_code=res.exit_code)
        samples["appliance"].append(_cells(res.results)[0]["aggregate"])
        walls["appliance"].append(res.wall_s)

    def via_bare() -> None:
        with Session(cluster) as session:
            results, wall, rc = bare_horovodrun(cluster, bspec, session, on_line=out, rank_env=rank_env)
        if rc != 0 or 0 not in results:
            raise ApplianceError(f"bare horovodrun exited with status {rc}", "run it by hand on the head node to see why")
        samples["bare"].append(_cells(results)[0]["aggregate"])
        walls["bare"].append(wall)

    via_appliance()  # the first job copies the code to the nodes; not counted (a cold start for both paths)
    samples["appliance"].clear()
    walls["appliance"].clear()
    for i in range(repeats):  # alternate the order (A B, B A, ...) so neither path always runs first
        for step in ((via_appliance, via_bare) if i % 2 == 0 else (via_bare, via_appliance)):
            step()
        log.info(f"[bench] overhead round {i + 1}/{repeats}: appliance train {samples['appliance'][-1]:.1f} "
                 f"samples/s (job {walls['appliance'][-1]:.1f} s end to end), bare horovodrun "
                 f"{samples['bare'][-1]:.1f} samples/s ({walls['bare'][-1]:.1f} s)")
    best = {k: max(v) for k, v in samples.items()}
    paired = sorted(a / b for a, b in zip(samples["appliance"], samples["bare"]))
    return {"model": cfg.models[0], "batch": cfg.batch_sizes[0], "steps": cfg.steps, "nodes": len(cluster.nodes),
            "ranks": cluster.world_size, "repeats": repeats,
            "samples_per_s": {k: [round(x, 2) for x in v] for k, v in samples.items()},
            "wall_s": {k: [round(x, 2) for x in v] for k, v in walls.items()},
            "best": {k: round(v, 2) for k, v in best.items()},
            "ratio": round(best["appliance"] / best["bare"], 4), "goal": 0.98,
            "ratio_median_of_rounds": round(paired[len(paired) // 2], 4),
            "note": "ratio: best in-job throughput through `appliance train` / best through bare horovodrun (the "
                    "same job, nodes and steps, in alternating order after one uncounted warm-up job); "
                    "ratio_median_of_rounds: the median of the per-round ratios; wall_s: launch to exit, the "
                    "appliance's including its contextualize step and code copy"}
