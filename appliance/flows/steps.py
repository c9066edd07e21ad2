"""The steps a run is made of, each taking the run's context (RunContext, built once per command): check,
stage, run a job, resume. `flows` composes them into the CLI's verbs and `flows.managed` into a run across
leases; both import them from here (no step looks itself up through the package)."""


from __future__ import annotations

import dataclasses
import functools
import time
import types
from collections.abc import Callable

from ..checkpoint.job import JobCheckpoints, refuse_if_running
from ..checkpoint.resume import choose_checkpoint, find_spec
from ..checkpoint.runs import RunRecords, record_resume
from ..cluster import Cluster, find_cluster, from_node_config, load_cluster, node_config_path
from ..data import stage_cluster
from ..data.stream import JobStream, stream_index
from ..errors import ApplianceError, SpecError
from .. import report
from ..provision import lifecycle
from ..remote import pack_code
from ..sites import Site, for_cluster, for_spec, load_spec, open_site
from ..protocol import keras_switch
from ..spec import Spec, keras_choice
from ..store.checkpoints import CheckpointStore
from ..train.launch import JobResult, train

log = report.get(__name__)


@dataclasses.dataclass
class RunContext:
    """What a command needs for one run, resolved once here and passed down: the spec, its site (one client, one
    Keystone session for the whole command), the store credentials and the run's checkpoint store. No step below
    resolves a site of its own."""

    spec: Spec
    site: Site  # the run's own site: its store and checkpoints, its controller's credential
    _others: dict = dataclasses.field(default_factory=dict, repr=False)  # other sites its clusters are on, by region

    @classmethod
    def of(cls, spec: Spec) -> RunContext:
        return cls(spec, for_spec(spec))

    def with_spec(self, spec: Spec) -> RunContext:
        """The same run's context for its spec as changed for one job (a lease's duration, an alternative's node
        type): the same site clients."""
        return RunContext(spec, self.site, self._others)

    def at(self, region: str | None) -> Site:
        """The site ``region`` of the run's cloud (a managed run's alternative at another site: CHI@TACC for a run
        at CHI@UC), one client each for the whole command; the run's own for None or its own region."""
        if region is None or region == self.site.region:
            return self.site
        if region not in self._others:
            self._others[region] = open_site(self.spec.cloud, region)
        return self._others[region]

    def site_of(self, name: str) -> Site:
        """The site of the cluster recorded as ``name`` (the run's own when there is none)."""
        cl = find_cluster(name)
        return self.at(cl.site.region) if cl is not None and cl.cloud == self.spec.cloud else self.site

    def creds(self, url: str):
        """Store credentials for ``url`` (None for file://: Site.store_creds)."""
        return self.site.store_creds(url)

    @functools.cached_property
    def checkpoints(self) -> CheckpointStore | None:
        """The run's checkpoint store (None: the spec has no checkpoint.url), for as long as the process runs: a
        token the store refuses (a bare Keystone token lives a day; a managed run's controller runs for weeks) is
        made again from the site's credentials."""
        url = self.spec.checkpoint.url
        return CheckpointStore(url, self.spec.name, self.creds(url),
                               renew=lambda: self.site.fresh_store_creds(url)) if url else None

    def lease_site(self, cluster: Cluster) -> Site | None:
        """The site whose lease the cluster runs on (the spec's own when they agree), None without a lease."""
        if not cluster.lease_id:
            return None
        if cluster.cloud == self.spec.cloud:
            return self.at(cluster.site.region)
        return for_cluster(cluster)


def data_creds(url: str, kind: str, region: str | None = None):
    """Credentials for an object-store URL on a site (none for file://: Site.store_creds); the site is said, so
    that nobody uploads to the local cloud meaning Chameleon."""
    site = open_site(kind, region)
    creds = site.store_creds(url)
    if not url.startswith("file:"):
        log.info(f"{url} at {site.describe()}")
    return creds


def resolve_cluster(spec: Spec, cluster_name: str | None = None) -> Cluster:
    """The cluster a spec runs on: one named explicitly, the run's own (made by `appliance up`), the one this
    machine heads (a Heat stack's head node), or the site's default (the local testbed, brought up if needed)."""
    if cluster_name:
        return load_cluster(cluster_name)
    own = find_cluster(spec.name)
    if own is not None:
        return own
    if node_config_path() is not None:  # on the head node of a cluster contextualized at boot (Heat)
        return from_node_config()
    cl = for_spec(spec).default_cluster(spec)
    if cl is None:
        raise ApplianceError(f"no cluster for run {spec.name!r}", f"run `appliance up {spec.path}` first")
    return cl


def check(spec_path: str, *, here: bool = True) -> Spec:
    """`appliance check`: everything that can be checked before a lease is paid for: the spec's own rules, its
    site's (Chameleon's 7-day cap and sites; the local cloud's node types and pool sizes), the training code (it
    exists and is small enough to copy to the nodes), and with ``here`` what it names on this machine (its key_file:
    Site.check_here; a plan, which logs in nowhere, does without)."""
    spec = load_spec(spec_path)
    if here:
        for_spec(spec).check_here(spec)
    try:
        pack_code(spec.code_dir)
    except ApplianceError as e:
        raise SpecError(f"train.code: {e.message}", e.fix) from None
    req = spec.train.requirements
    if req and not (spec.code_dir / req).is_file():
        raise SpecError(f"train.requirements: no file {req} in {spec.code_dir}",
                        "write the script's packages there, one per line as pip reads them, or remove the field")
    return spec


def stage_to_nodes(run: RunContext, cluster: Cluster, url: str, dest: str, *, mode: str, out=None,
                   **kw) -> dict[str, dict]:
    """stage_cluster with what the nodes get for ``url`` as a job's nodes get it (Site.job_store_creds): with
    Keystone and swift://, an application credential of the staging's own (renewable tokens, restricted), deleted
    when staging ends; before, the nodes got this machine's Keystone token, which keystoneauth hands out until
    30 s before it expires (a long stage in a long-lived `appliance resume` could then fail with 401 midway), and
    which can do anything the user can for up to a day."""
    if mode == "stream":  # nothing to stage: the job reads the shards; the indexes are checked now, not on every rank
        ds = run.spec.dataset  # every dataset it names (``url``: its source, None for a mix), validation's too
        for at, u in ds.urls() if ds is not None else [("dataset.source", url)]:
            index = stream_index(u, run.creds(u), at)
            (out or log.info)(f"[stage] stream mode: {len(index['shards'])} shard(s), {index.get('samples', '?')} "
                              f"sample(s), {sum(s['size'] for s in index['shards']) / 1e9:.2f} GB in {u} are read "
                              "while the job trains; nothing is staged")
        return {}
    creds, withdraw = run.site.job_store_creds(url, name=f"appliance-{run.spec.name}-stage",
                                               lease_end=cluster.lease_end_at, say=log.info)
    try:
        return stage_cluster(cluster, url, dest, mode=mode, creds=creds, out=out or log.info, **kw)
    finally:
        if withdraw is not None:
            try:
                withdraw()
            except Exception as e:  # noqa: BLE001 - it expires on its own a week after the lease
                log.info(f"[stage] note: could not delete the staging's application credential ({e}); it expires on "
                         "its own")


def run_job(spec: Spec, cluster: Cluster, *, run: RunContext | None = None, control=None, on_first_step=None,
            **kw) -> JobResult:
    """A training job with the appliance's hooks: checkpoints (settings, credentials file, lease watchdog, rank 0's
    reports) and the run record. ``run``: the command's context, when it has one already; ``control``: the managed
    run's controller (managed.Control: the job on its timeline, and stopped by a cancel); ``on_first_step``: told
    the job's timeline once its first step is done (JobCheckpoints)."""
    run = run or RunContext.of(spec)
    stream = JobStream(run.site)
    ck = JobCheckpoints(run.site, run.lease_site(cluster), extend_by=control.extend_by if control else None,
                        on_first_step=on_first_step, launcher=control.id if control else None,
                        on_extended=stream.renew)
    hooks = [ck, stream, RunRecords()] + ([control.hook(ck.user_stop)] if control is not None else [])
    return train(spec, cluster, hooks=hooks, **kw)


def resume(run: str, *, spec_path: str | None = None, cluster_name: str | None = None, nodes: int | None = None,
           url: str | None = None, cloud: str = "local", site_name: str | None = None,
           out: Callable[[str], None] | None = None, control=None, lease_duration: str | None = None, on_ask=None,
           spec: Spec | None = None, ctx: RunContext | None = None,
           acquire: Callable[[dict], tuple[Cluster, str] | None] | None = None) -> JobResult | None:
    """`appliance resume RUN`: the newest good committed checkpoint -> a cluster (the named one; the run's own, or a
    new lease + `up`, when it has one or is on a site with leases; else the default) -> the dataset staged (only
    what is missing) -> the checkpoint staged to every node -> the job, restoring it. None if the run is complete.
    ``control``: the managed run's controller (run_job); ``lease_duration``: a new lease's, instead of the spec's (a
    managed run's, cut to its limits); ``on_ask``: told of a new lease before Blazar is asked (a managed run's
    ledger in the store: lifecycle._leased); ``spec``, ``ctx``: the run's spec and context as made already (a
    managed run's, at its start: the file is not read again mid-run); ``acquire(phases)``: the cluster instead,
    and the node type its job runs as (a managed run's recovery strategy, recovery.py: its lease and boot go into
    ``phases``, the downtime's; None: no cluster, and no job)."""
    t = {"start": time.time()}  # the resume's downtime, phase by phase (resume_breakdown)
    if spec is None:
        spec = find_spec(run, spec_path, url, creds=data_creds(url, cloud, site_name) if url else None)
    if nodes is not None and nodes != spec.nodes.count:
        spec = dataclasses.replace(spec, nodes=dataclasses.replace(spec.nodes, count=nodes))
    if lease_duration is not None:
        spec = dataclasses.replace(spec, lease=dataclasses.replace(spec.lease, duration=lease_duration))
    ctx = ctx.with_spec(spec) if ctx is not None else RunContext.of(spec)
    ck = _resume_point(ctx)
    if ck is _COMPLETE:
        return None
    t["checkpoint chosen"] = time.time()
    up_phases: dict[str, float] = {}
    if acquire is not None:
        got = acquire(up_phases)
        if got is None:
            return None
        cluster, node_type = got
        if node_type != spec.nodes.node_type:  # an alternative's: what the job's records say it ran on
            spec = dataclasses.replace(spec, nodes=dataclasses.replace(spec.nodes, node_type=node_type))
            ctx = ctx.with_spec(spec)
    elif control is not None:  # a managed run's cluster comes from its recovery strategy, never the site's default
        raise ApplianceError(f"run {run} is a managed run: it trains only on a lease of its own, never on "
                             f"{ctx.site.describe()}'s default cluster", f"`appliance run {spec.path}` continues it")
    else:
        cluster = _resume_cluster(ctx, cluster_name, up_phases, on_ask)
    t["cluster ready"] = time.time()
    if spec.dataset is not None:
        stage_to_nodes(ctx, cluster, spec.dataset.source, spec.dataset.dest, mode=spec.dataset.mode, out=out)
    t["data staged"] = time.time()
    early: dict = {}

    def first(marks: dict, resumed: dict | None) -> None:
        # the downtime as soon as the job's first step is done: a managed run's timeline and notify hook hear it
        # then, not when the job ends, which may be a lease later
        early["breakdown"] = resume_breakdown(t, up_phases, types.SimpleNamespace(timeline=marks, resumed=resumed))
        if control is not None:
            control.first_step(early["breakdown"])
    if ck is None:
        # a resume of the files only: no checkpoint to restore
        res = run_job(spec, cluster, run=ctx, out=out, restore="", control=control, on_first_step=first)
    else:
        rel = f"appliance/runs/{run}/restore/{ck.name}"
        stage_to_nodes(ctx, cluster, f"{spec.checkpoint.url.rstrip('/')}/{run}/{ck.name}/", rel, mode="full",
                       out=out)
        t["checkpoint staged"] = time.time()
        res = run_job(spec, cluster, run=ctx, out=out, restore=f"{cluster.head.workdir}/{rel}",
                      control=control, on_first_step=first)
    res.resume_breakdown = early.get("breakdown") or resume_breakdown(t, up_phases, res)
    record_resume(run, res.job_id, res.resume_breakdown)
    return res


_COMPLETE = object()  # _resume_point: the run has finished


def _resume_point(ctx: RunContext):
    """The committed checkpoint to resume from; None when the run has only its synced working directory (level
    3); _COMPLETE when the run has finished. Refuses while another job of the run is alive (its lock)."""
    spec, cs = ctx.spec, ctx.checkpoints
    try:
        ck = choose_checkpoint(spec, cs)
    except ApplianceError:
        files = synced_files(ctx)  # level 3: only the synced working directory
        if files is None:
            raise
        ck = None
        log.info(f"[resume] run {spec.name}: no committed checkpoint; the synced working directory (manifest "
                 f"{files['seq']}, {len(files['files'])} file(s)) is restored on the head node before the script runs")
    refuse_if_running(spec, cs, ctx.site)
    if ck is None:
        return None
    meta = cs.read_manifest(ck)["meta"]
    log.info(f"[resume] run {spec.name}: checkpoint {ck.name} (step {ck.step}, epoch {meta['epoch']}, batch "
             f"{meta['offset']}, made on {meta['world_size']} rank(s))")
    if meta.get("complete"):
        log.info(f"[resume] run {spec.name} already finished at step {ck.step}; nothing to do")
        return _COMPLETE
    refused = keras_switch(meta.get("keras"), keras_choice(spec)[0])
    if refused:
        raise ApplianceError(f"run {spec.name}: checkpoint {ck.name}: {refused}")
    return ck


def _resume_cluster(ctx: RunContext, cluster_name: str | None, up_phases: dict[str, float], on_ask=None) -> Cluster:
    """The named cluster; else the run's own (a new lease + `up` on a site with leases) or the site's default."""
    spec = ctx.spec
    if cluster_name:
        return load_cluster(cluster_name)
    own = find_cluster(spec.name)
    default = None if own is not None else ctx.site.default_cluster(spec)
    if own is not None and own.cloud == spec.cloud and own.site.region != spec.site:  # the run went on elsewhere
        spec = dataclasses.replace(spec, site=own.site.region)
    cluster = default if default is not None else lifecycle.up(ctx.site_of(spec.name), spec, timings=up_phases,
                                                               on_ask=on_ask)
    if cluster.world_size != spec.world_size:
        log.info(f"[resume] note: cluster {cluster.name} has {cluster.world_size} rank(s), the spec asks for "
                 f"{spec.world_size}")
    return cluster


RESUME_PHASES = ("find checkpoint", "lease", "boot", "ssh + contextualize", "install", "cluster (other)", "stage data",
                 "stage checkpoint", "job setup", "horovod start", "restore", "first step")  # in the order they run


def resume_breakdown(t: dict[str, float], up_phases: dict[str, float], res: JobResult) -> dict[str, float | None]:
    """Seconds of each part of a resume's downtime, from `appliance resume` to the job's first step (issue 16
    goal 5). ``t``: flows.resume's marks; ``up_phases``: lifecycle.up's (absent when the cluster was reused);
    ``res.timeline``: the job's (horovodrun started, rank 0 restored, first step done)."""
    tl, r = res.timeline, res.resumed or {}
    restore = r.get("restore_s")

    def span(a, b):
        return round(b - a, 2) + 0.0 if a is not None and b is not None else None  # + 0.0: never "-0.0"

    staged = t.get("checkpoint staged", t["data staged"])
    out: dict[str, float | None] = {"find checkpoint": span(t["start"], t["checkpoint chosen"])}
    rest_of_up = t["cluster ready"] - t["checkpoint chosen"]  # each part rounded only once it is computed: rounded
    for k in ("lease", "boot", "ssh + contextualize", "install"):  # parts can add up to more than their whole
        if k in up_phases:
            out[k] = round(up_phases[k], 2)
            rest_of_up -= up_phases[k]
    out["cluster (other)"] = span(0.0, rest_of_up)
    out["stage data"] = span(t["cluster ready"], t["data staged"])
    out["stage checkpoint"] = span(t["data staged"], t.get("checkpoint staged"))
    out["job setup"] = span(staged, tl.get("launched"))  # contextualize check, code copy, lock, credentials file
    at_restored = tl.get("resumed")
    out["horovod start"] = span(tl.get("launched"), at_restored - restore if at_restored and restore is not None
                                else at_restored)  # horovodrun, Python + TensorFlow import, the model built
    out["restore"] = restore
    out["first step"] = span(at_restored, tl.get("first_step"))
    out["total"] = span(t["start"], tl.get("first_step"))
    return out


def synced_files(ctx: RunContext) -> dict | None:
    """The newest manifest of the run's synced working directory (level 3) that verifies, or None."""
    from ..store.filesync import FileSet

    url = ctx.spec.checkpoint.url
    if not url:
        return None
    with report.prefixed("[resume] "):
        return FileSet(url, ctx.spec.name, ctx.creds(url)).newest_good()

