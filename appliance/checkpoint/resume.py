"""`appliance resume RUN` and `appliance runs`.

resume: the run's spec (from its run record, or the copy saved next to its checkpoints, or ``--spec``) ->
the newest committed checkpoint that verifies against its manifest (older ones if not, saying so) -> a
cluster (the run's own if its lease still runs, else a new lease + `up`; or one named with ``--cluster``) ->
the dataset staged (only what is missing) -> the checkpoint staged to every node (checked against the store's
ETags, which were checked against the manifest) -> the job, restoring it.
"""

from __future__ import annotations

import dataclasses
import tempfile
from collections.abc import Callable
from pathlib import Path

from ..errors import ApplianceError
from ..spec import Spec, load_spec
from . import runs
from .store import CheckpointStore


def _creds(spec: Spec, url: str):
    from ..data.store import parse_url

    if parse_url(url)[0] == "file":
        return None
    from ..data import creds as creds_mod

    return creds_mod.resolve(spec.cloud, spec.site, log=lambda m: None)


def find_spec(run: str, spec_path: str | None = None, url: str | None = None) -> Spec:
    if spec_path:
        spec = load_spec(spec_path)
        if spec.name != run:
            raise ApplianceError(f"{spec_path} is the spec of run {spec.name!r}, not {run!r}",
                                 f"use `appliance resume {spec.name} --spec {spec_path}`")
        return spec
    rec = runs.load(run)
    if rec and rec.get("spec_path") and Path(rec["spec_path"]).exists():
        return load_spec(rec["spec_path"])
    if url:  # the copy saved beside the checkpoints: resume from another machine
        cs = CheckpointStore(url, run, None)
        tmp = Path(tempfile.mkdtemp(prefix="appliance-spec-")) / f"{run}.yaml"
        buf = bytearray()
        cs.store.get(cs.prefix + "spec.yaml", buf.extend)
        tmp.write_bytes(bytes(buf))
        return load_spec(str(tmp))
    raise ApplianceError(f"no record of run {run!r} on this machine", f"give its spec: `appliance resume {run} "
                         "--spec SPEC.yaml` (see `appliance runs`)")


def choose_checkpoint(spec: Spec, log: Callable[[str], None] = print):
    """(CheckpointStore, Committed) of the newest committed checkpoint that verifies."""
    url = spec.checkpoint.url
    if not url:
        raise ApplianceError(f"run {spec.name!r} has no checkpoint.url in its spec, so there is nothing to resume",
                             "add checkpoint: {url: swift://checkpoints/} and start it with `appliance train`")
    cs = CheckpointStore(url, spec.name, _creds(spec, url))
    good, problems = cs.newest_good(log=lambda m: log(f"[resume] {m}"))
    if good is None:
        if problems:
            raise ApplianceError(f"run {spec.name!r}: no committed checkpoint in {url} passed verification "
                                 f"({'; '.join(problems)})", f"start it again with `appliance train {spec.path}`")
        raise ApplianceError(f"run {spec.name!r} has no committed checkpoint in {url}",
                             f"start it with `appliance train {spec.path}`")
    if problems:
        log(f"[resume] the newest checkpoint is unusable ({problems[0]}); using {good.name} "
            f"(step {good.step}) instead")
    return cs, good


def resume(run: str, *, spec_path: str | None = None, cluster_name: str | None = None, nodes: int | None = None,
           url: str | None = None, out: Callable[[str], None] | None = None, log=print):
    """Continue a run from its newest good committed checkpoint. Returns the JobResult (None if complete)."""
    from ..cluster import find_cluster
    from ..data import stage_cluster
    from ..train.launch import resolve_cluster, train

    spec = find_spec(run, spec_path, url)
    if nodes is not None and nodes != spec.nodes.count:
        spec = dataclasses.replace(spec, nodes=dataclasses.replace(spec.nodes, count=nodes))
    cs, ck = choose_checkpoint(spec, log=log)
    meta = cs.read_manifest(ck)["meta"]
    log(f"[resume] run {run}: checkpoint {ck.name} (step {ck.step}, epoch {meta['epoch']}, batch {meta['offset']}, "
        f"made on {meta['world_size']} rank(s))")
    if meta.get("complete"):
        log(f"[resume] run {run} already finished at step {ck.step}; nothing to do")
        return None
    # a cluster: the named one, the run's own (up is idempotent: it reuses a live lease, or makes a new one)
    if cluster_name:
        from ..cluster import load_cluster

        cluster = load_cluster(cluster_name)
    elif find_cluster(spec.name) is not None or spec.cloud == "chameleon":
        from ..provision.lifecycle import up

        cluster = up(spec.path, spec=spec, log=log)
    else:
        cluster = resolve_cluster(spec, None, log=log)
    if cluster.world_size != spec.world_size and not cluster_name:
        log(f"[resume] note: cluster {cluster.name} has {cluster.world_size} rank(s), the spec asks for "
            f"{spec.world_size}")
    if spec.dataset is not None:
        from ..data.store import parse_url

        scheme = parse_url(spec.dataset.source)[0]
        stage_cluster(cluster, spec.dataset.source, spec.dataset.dest, mode=spec.dataset.mode,
                      creds=None if scheme == "file" else _creds(spec, spec.dataset.source), out=out or log)
    rel = f"appliance/runs/{run}/restore/{ck.name}"
    stage_cluster(cluster, f"{spec.checkpoint.url.rstrip('/')}/{run}/{ck.name}/", rel, mode="full",
                  creds=_creds(spec, spec.checkpoint.url), out=out or log)
    return train(spec, cluster, out=out, restore=f"{cluster.head.workdir}/{rel}")


def list_runs() -> list[dict]:
    return runs.list_runs()
