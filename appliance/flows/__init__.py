"""Workflows: the one place that composes steps. Each CLI verb parses its arguments and calls one function here.

Data flows one way, spec -> lease -> cluster -> stage -> train -> checkpoint -> resume; the steps below this module
(sites, provision, data, train, checkpoint, bench) do not import each other upwards, and none of them decides
which cluster a run uses or strings steps together: that is here (resolve_cluster, run_job, resume, ...).
"""

from __future__ import annotations

import json
import socket
from collections.abc import Callable
from pathlib import Path

from ..checkpoint.resume import choose_checkpoint, find_spec
from ..checkpoint.runs import list_runs, run_details, running_on  # noqa: F401 (CLI)
from ..cluster import Cluster, find_cluster, load_cluster
from ..data import dataset_summary, listing, pack_dir, pack_from_store, remove, unstaged, upload
from ..data.stream import stream_check
from ..errors import ApplianceError, SpecError  # noqa: F401 (SpecError: the CLI's)
from .. import paths, report
from ..node import doctor as node_doctor
from ..node.watchdog import node_watch  # noqa: F401 (re-exported for the CLI)
from ..provision import heat, lifecycle
from ..remote import Session
from ..sites import Site, for_spec, load_spec, open_site
from ..sites.local import (  # noqa: F401 (the simulator's verbs, for the CLI)
    cloud_start, cloud_status, cloud_stop, testbed_down, testbed_status, testbed_up)
from ..spec import Spec
from ..store.objects import StoreRefused, unreachable
from ..train.headjob import job_log
from ..train.launch import JobResult
from .gpucheck import doctor_gpu, examine_nodes  # noqa: F401 (doctor_gpu: the CLI's)
from .steps import (  # noqa: F401 (the steps, for the CLI and the tests)
    RESUME_PHASES, RunContext, check, data_creds, resolve_cluster, resume, resume_breakdown, run_job, stage_to_nodes,
    synced_files)

log = report.get(__name__)

__all__ = ["RunContext", "resolve_cluster", "run_job", "run_managed", "train_spec", "stage_spec", "resume", "up",
           "down", "status", "adopt", "site", "data_creds", "doctor", "doctor_gpu", "job_summary", "list_runs",
           "node_watch"]


# -- sites and credentials --------------------------------------------------------------------------


def site(kind: str, region: str | None = None) -> Site:
    return open_site(kind, region)


# -- clusters -------------------------------------------------------------------------------------


def check_online(spec: Spec) -> dict:
    """`appliance check --online`: what the spec names in the object store, asked before a lease is paid for (on
    Chameleon a node takes 10-20 minutes to boot before `appliance stage` would find a typo): the dataset URL
    names objects (the stager's rules and its one-line errors; in mode stream, every shard index.json names is in
    the store at its size), and checkpoint.url is reachable and not refused
    (a store that refuses the checkpoints refuses the job). Reads only: a bucket that is not there yet is left to
    the first job to make. Also says whether the run already has committed checkpoints (`appliance train` would
    refuse to start over them; `appliance resume` continues them), and, with a checkpoint.url, the plan of its
    managed run (`appliance run SPEC --plan`: leases, SUs, Chameleon's usage policy)."""
    out: dict = {}
    run = RunContext.of(spec)
    for at, url in spec.dataset.urls() if spec.dataset is not None else []:  # source, or streams, and validation
        found = {"field": at, **dataset_summary(url, creds=run.creds(url))}
        if spec.dataset.mode == "stream":
            index = stream_check(url, run.creds(url), at)  # every shard there, of its size
            found.update(shards=len(index["shards"]), samples=sum(s["samples"] for s in index["shards"]))
        out.setdefault("datasets", []).append(found)
        out.setdefault("dataset", found)  # the first (dataset.source, or the mix's first)
    ck = spec.checkpoint
    cs = run.checkpoints
    if cs is not None:
        state = {"url": ck.url, "container": "there", "committed": 0, "newest": None}
        try:
            try:
                cs.store.reach()
            except FileNotFoundError:
                state["container"] = "not there yet"
            else:
                old = cs.committed()
                state.update(committed=len(old), newest=old[0].name if old else None)
        except StoreRefused as e:
            raise ApplianceError(f"checkpoint.url {ck.url}: {e.message}; a job would be refused", e.fix) from None
        except ApplianceError:
            raise
        except Exception as e:
            said = unreachable(cs.store, e)
            if said is None:
                raise
            raise said from None
        out["checkpoint"] = state
    if cs is not None and run.site.cloud_up():  # a managed run's: what `appliance run SPEC` would book
        from .plan import make

        try:
            out["plan"] = make(run)
        except ApplianceError as e:
            out["plan"] = {"error": e.message}
    return out


def up(spec_path: str, *, spec: Spec | None = None, **kw) -> Cluster:
    spec = spec or check(spec_path)
    return lifecycle.up(for_spec(spec), spec, **kw)


def down(name: str) -> list[str]:
    return lifecycle.down(name)


def status(name: str) -> dict:
    return lifecycle.status(name)


def adopt(stack: str, *, cloud: str = "chameleon", site_name: str | None = None, **kw) -> Cluster:
    return heat.adopt(open_site(cloud, site_name), stack, **kw)


def lease_create(spec_path: str, *, start: str | None = None) -> dict:
    spec = load_spec(spec_path)
    return lifecycle.lease_create(for_spec(spec), spec, start=start)


# -- data -----------------------------------------------------------------------------------------


def stage_spec(spec_path: str, cluster_name: str | None = None, out: Callable[[str], None] | None = None,
               concurrency: int = 16, keep_extra: bool = False) -> dict[str, dict]:
    """`appliance stage SPEC`: the spec's dataset to every node's local disk (files of objects no longer in the
    store are removed unless ``keep_extra``)."""
    spec = load_spec(spec_path)
    if spec.dataset is None:
        raise ApplianceError(f"{spec_path}: no dataset to stage", "add a dataset: {source: swift://..., dest: data}")
    cluster = resolve_cluster(spec, cluster_name)
    return stage_to_nodes(RunContext.of(spec), cluster, spec.dataset.source, spec.dataset.dest,
                          mode=spec.dataset.mode, concurrency=concurrency, keep_extra=keep_extra, out=out)


def data_upload(src: str, url: str, *, cloud: str, site_name: str | None = None, **kw) -> int:
    return upload(src, url, creds=data_creds(url, cloud, site_name), **kw)


def data_pack(src: str, url: str, *, cloud: str, site_name: str | None = None, **kw) -> dict:
    if "://" in src:  # a dataset in a store, object by object
        return pack_from_store(src, url, src_creds=data_creds(src, cloud, site_name),
                               creds=data_creds(url, cloud, site_name), **kw)
    return pack_dir(src, url, creds=data_creds(url, cloud, site_name), **kw)


def data_list(url: str, *, cloud: str, site_name: str | None = None) -> list[dict]:
    return listing(url, creds=data_creds(url, cloud, site_name))


def data_remove(url: str, *, cloud: str, site_name: str | None = None) -> int:
    return remove(url, creds=data_creds(url, cloud, site_name))


# -- training -------------------------------------------------------------------------------------


def train_spec(spec_path: str, cluster_name: str | None = None, out: Callable[[str], None] | None = None) -> JobResult:
    """`appliance train SPEC`: validate the spec, find its cluster, run the job."""
    spec = load_spec(spec_path)
    cluster = resolve_cluster(spec, cluster_name)
    if spec.dataset is not None and spec.dataset.mode != "stream":  # one line before the job, not the script's
        # own traceback on every rank
        missing = unstaged(cluster, spec.dataset.dest)
        if missing:
            raise ApplianceError(f"dataset.dest {spec.dataset.dest} is empty or missing on {', '.join(missing)}: the "
                                 "job would find no data", f"stage it first: `appliance stage {spec.path}`")
    return run_job(spec, cluster, out=out)


def logs(run: str, cluster_name: str | None = None, *, lines: int = 50, follow: bool = False,
         out: Callable[[str], None] = print, url: str | None = None, cloud: str = "local",
         site_name: str | None = None) -> str:
    """`appliance logs RUN`: the run's newest job's output, from the head node of ``cluster_name`` (default: the
    cluster of the run's record, then the run's own cluster); ``url``: from the run's store, as its controller
    shipped it (any machine). Returns the job id."""
    from ..checkpoint import runs

    if url is not None:
        from .managed import store_logs

        return store_logs(run, url=url, cloud=cloud, site_name=site_name, lines=lines, follow=follow, out=out)

    name = cluster_name or (runs.load(run) or {}).get("cluster") or (run if find_cluster(run) else None)
    copies = sorted((paths.home() / "runs" / run).glob(f"{run}-*.log"), key=lambda p: p.stat().st_mtime)
    if name is None and not copies:
        raise ApplianceError(f"no record of run {run!r} on this machine and no cluster named {run!r}",
                             "name the cluster: `appliance logs RUN --cluster NAME` (`appliance status` lists them), or "
                             "a managed run's store: `appliance logs RUN --url URL`")
    why = f"no cluster of run {run!r} on this machine"
    if name is not None:
        try:
            return job_log(load_cluster(name), run, lines=lines, follow=follow, out=out)
        except ApplianceError as e:
            if cluster_name is not None or not copies:
                raise
            why = e.message
    # the head node is gone (the lease ended, `appliance down`) or does not answer: what the launcher showed is
    # kept on this machine, line for line
    copy = copies[-1]
    text = copy.read_text(errors="replace").splitlines()
    out(f"[appliance] not from the head node ({why}): this machine's copy of what `appliance train` showed, {copy}")
    for line in text[-lines:] if lines > 0 else text:
        out(line)
    return copy.stem


def plot_run(run: str, path: str | None = None, *, spec_path: str | None = None) -> dict:
    """`appliance ls RUN --plot`: the run's metrics from its newest committed checkpoint (one CSV across every
    job of the run) as a PNG, with the jobs' resume steps marked."""
    from ..checkpoint import plot, runs

    spec = find_spec(run, spec_path)
    cs = RunContext.of(spec).checkpoints
    ck = choose_checkpoint(spec, cs)
    buf = bytearray()
    try:
        cs.store.get(f"{cs.prefix}{ck.name}/metrics/metrics.csv", buf.extend)
    except Exception as e:
        raise ApplianceError(f"checkpoint {ck.name} of run {run} has no metrics ({type(e).__name__}: {e})",
                             "the run's script must use the appliance's callback or Checkpointer") from None
    series = plot.read_metrics(buf.decode(errors="replace"))
    jobs = (runs.load(run) or {}).get("jobs", [])
    out = Path(path or runs.record_dir(run) / "metrics.png")
    plot.plot(series, jobs, out, f"run {run}: {len(jobs)} job(s), newest checkpoint {ck.name}")
    steps = sorted({s for pts in series.values() for s, _ in pts})
    return {"run": run, "png": str(out), "checkpoint": ck.name, "metrics": sorted(series),
            "steps": [steps[0], steps[-1]] if steps else [], "resumed_at": [j.get("first_step") for j in jobs[1:]],
            "step_axis_problems": plot.step_axis_problems(series)}


def job_summary(res: JobResult) -> dict:
    """The job's summary as data (the CLI formats it)."""
    r0 = res.results.get(0, {})
    summary = {
        "job_id": res.job_id, "exit_code": res.exit_code, "failure": res.failure,
        "ranks": res.world_size, "nodes": sorted(set(res.rank_hosts)), "hostnames_reported": res.hostnames,
        "ranks_reported": sorted(res.results), "epochs": r0.get("epochs"),
        "val_accuracy": r0.get("val_accuracy"),
        "same_weights_on_all_ranks": len({r.get("weights_sha256") for r in res.results.values()}) == 1
        if res.results else None,
        "wall_seconds": round(res.wall_s, 1), "log": res.log_path, "run": res.run,
        "stopped": res.stopped, "resumed": res.resumed, "resume_breakdown": res.resume_breakdown,
        "checkpoints_committed": len(res.commits),
        "last_checkpoint": res.commits[-1]["name"] if res.commits else None, "stream": res.stream,
    }
    if res.cluster_cloud in ("local", "chameleon"):  # a cluster on a site: its lease and how to end it
        summary["next"] = [f"  appliance status {res.run}        # lease time left, nodes",
                           f"  appliance down {res.run} --yes   # delete servers, FIP and lease",
                           "  appliance cloud stop              # stop the local cloud" if res.cluster_cloud == "local" else ""]
    return summary


# -- bench, doctor --------------------------------------------------------------------------------


def bench(spec_path: str, cluster_name: str | None, cfg, *, overhead: bool = False, repeats: int = 3,
          out_dir: str | None = None, command: str = "", out=None) -> dict:
    """`appliance bench`: throughput and scaling (or, with ``overhead``, appliance train vs bare horovodrun)."""
    from .. import bench as bench_mod
    from ..bench import report

    spec = load_spec(spec_path)
    cl = resolve_cluster(spec, cluster_name)
    if not overhead:
        return bench_mod.run_bench(spec, cl, cfg, out_dir=Path(out_dir) if out_dir else None, out=out,
                                   command=command, run_job=run_job)
    rep = bench_mod.overhead(spec, cl, cfg, repeats=repeats, out=out, run_job=run_job)
    rep["command"] = command
    if out_dir:
        Path(out_dir).mkdir(parents=True, exist_ok=True)
        (Path(out_dir) / "overhead.json").write_text(json.dumps(rep, indent=1) + "\n")
        (Path(out_dir) / "overhead.md").write_text(
            f"# Launch overhead\n\nCommand: `{rep['command']}`\n\n" + "\n".join(report.overhead_lines(rep)) + "\n")
    return rep


def doctor(cluster_name: str | None = None, python: str | None = None, etc: str | None = None,
           allreduce: bool = True) -> dict[str, list]:
    """`appliance doctor`: this node's checks, or every node's of a cluster (over SSH, in parallel). With
    ``--gpu``: gpucheck.doctor_gpu."""
    if not cluster_name:
        return {socket.gethostname(): node_doctor.run_checks(python, etc, allreduce=allreduce)}
    return doctor_cluster(load_cluster(cluster_name), allreduce=allreduce)


def doctor_cluster(cluster: Cluster, allreduce: bool = True) -> dict[str, list]:
    """Run the node doctor (`python -m appliance.node.doctor`) on every node with the cluster's Python."""
    return {name: checks for name, (checks, _) in examine_nodes(cluster, allreduce).items()}


# -- leases and images (the site's verbs) -----------------------------------------------------------


def lease(verb: str, *args, cloud: str, site_name: str | None = None, **kw):
    """`appliance lease show|list|extend|delete` on a site, said before the answer (after it is had: a refusal
    is one line)."""
    site = open_site(cloud, site_name)
    out = getattr(lifecycle, f"lease_{verb}")(site, *args, **kw)
    log.info(f"leases at {site.describe()}")
    return out


def image_upload(path: str, name: str, *, cloud: str, site_name: str | None = None,
                 disk_format: str | None = None) -> dict:
    return lifecycle.image_upload(open_site(cloud, site_name), path, name, disk_format=disk_format)


from .managed import cancel as cancel_run, plan as plan_run, run_managed, start as start_managed, timeline  # noqa: E402,F401,E501
from .ettr import ettr as run_ettr  # noqa: E402,F401 (`appliance ls RUN`)
