"""`appliance run SPEC`: a run to its end across leases, and the controller that drives it (issue 52).

Where the controller lives: in a process of its own on the machine that typed `appliance run` (``start``: a new
session, so closing the terminal or killing the shell that started it leaves it running), with everything another
machine needs in the object store beside the run's checkpoints, ``URL/RUN/controller/``:

- ``lock/<generation>.json``: the controller's lease on the run (store/runlock.py, the same rules as a job's):
  one controller per run; a second `appliance run SPEC` is refused while the first renews it; a controller that is
  gone (its machine off) is taken over once its heartbeat is older than the lock's ttl (at once on the machine that
  ran it, which can see its process is gone);
- ``state.json``: what the run did, lease by lease (the timeline `appliance ls RUN` shows, from any machine);
- ``cancel.json``: `appliance cancel RUN` asks the controller that holds the lock to stop the run: its job stops
  with a checkpoint at the next step and the run's cluster goes (its lease with it).

Why not on the head node: the head is deleted at its lease end, so a controller there has to move to the next
cluster's head before the end, which needs the next lease to start before the current one ends (a warm handover,
lease.overlap: handover.py) and a credential on the node that can book leases, which the nodes do not get. A
machine that stays up (a Chameleon KVM instance, a lab server) runs the controller through any number of lease
ends today.
"""

from __future__ import annotations

import dataclasses
import datetime as dt
import json
import os
import socket
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable

from .. import report
from ..checkpoint import runs
from ..checkpoint.runs import RunStatus
from ..checkpoint.resume import find_spec
from ..cluster import Cluster, find_cluster
from ..errors import ApplianceError, NoSUs, SpecError
from ..provision import lifecycle
from ..spec import Spec, duration_seconds
from ..train.launch import JobResult
from . import credential, runcluster, steps, stopping, takeover
from .budget import Budget, Ledger, estimate, newest_meta, steps_made
from .control import CONTROL, NOTIFIED, Control, busy, gone_here, read_logs, read_timeline  # noqa: F401
from .ettr import job_end_marks
from .handover import Warm, overlap_cost
from .leases import Asked, booked_for, reconcile
from .recovery import Recovery

log = report.get(__name__)

READY_FD = "APPLIANCE_CONTROLLER_READY_FD"  # start(): the pipe the detached controller says "ready" on


# -- the run --------------------------------------------------------------------------------------


def run_managed(spec_path: str, *, spec: Spec | None = None, max_restarts: int = 0,
                out: Callable[[str], None] | None = None) -> JobResult | None:
    """`appliance run SPEC --foreground` (and the detached controller `appliance run SPEC` starts): the run to its
    end across leases, with nobody at the lease ends. The first job runs on the run's own cluster (`appliance up`,
    made or reused; the dataset staged, only what is missing), or resumes when the run has committed work already.
    Then, until a job ends with 0:
    - it ended for its lease's end (stopped before it with a commit, or the end took its nodes): the run resumes
      on the next cluster, made while the job trained (lease.overlap: handover.Warm), or on a new lease once the
      old cluster has gone (its hosts free for it); without the hosts, on nodes.alternatives, or at the earliest
      free slot within lease.wait, or it parks;
    - it failed otherwise: resumed on the same cluster up to ``max_restarts`` times in a row (a crash is most
      often the script's own and would happen again), then its failure is the run's;
    - its user stopped it (SIGTERM, Ctrl-C) or cancelled the run (`appliance cancel RUN`): the run stops there;
      a cancel also takes the run's cluster down.
    Returns the last job's result (None: the run had finished already). ``spec``: the spec already loaded (else
    read from ``spec_path`` once: every job of the run, resumes included, runs with it and the one RunContext)."""
    spec = _needs_url(spec or steps.check(spec_path))
    ctx = steps.RunContext.of(spec)
    control = Control(spec, ctx.creds(spec.checkpoint.url), renew=lambda: ctx.creds(spec.checkpoint.url))
    control.take()
    runs.mark_managed(spec)
    _ready(control)
    credential.forget_others(ctx)
    if duration_seconds(spec.lease.overlap):
        log.info(f"[run] warm handover: each next lease starts {spec.lease.overlap} before the current one ends, "
                 f"which costs {overlap_cost(spec):.2f} node-hours per lease end ({spec.nodes.count} node(s))")
    status = RunStatus.FAILED
    run = _Run(ctx, control, max_restarts, out)
    refused: NoSUs | None = None
    try:
        try:
            res = run.loop()
        except NoSUs as e:  # Chameleon's portal refused a lease of the run: it holds none, and waits for SUs
            res, refused = run.out_of_sus(e), e
        status = run.final_status(res)
        if refused is None:
            return res
    finally:  # each step whatever the one before did (a 503 taking the warm cluster down skipped the rest)
        _each(lambda: run.warm is not None and run.warm.abandon(),  # booked or made and not used: it goes
              lambda: status == RunStatus.FINISHED and not spec.lease.keep_when_done and run.release(),
              run.settle,  # the last job's progress and node-hours, into the state close writes
              run.close_ledger,  # every lease it deleted, closed on its ledger
              lambda: control.close(status),
              lambda: credential.drop(ctx))  # the controller's own credential, last: its tokens stop with it
    raise refused  # after the run's end steps: its one line, and a non-zero exit


def _each(*steps) -> None:
    """Every step, each whatever the ones before raised; a failure is said in one line (what it left is found again
    by the next `appliance run`, or ends with its lease)."""
    for step in steps:
        try:
            step()
        except Exception as e:  # noqa: BLE001
            log.info(f"[run] warning: a step of the run's end failed ({type(e).__name__}: {e}); the next "
                     "`appliance run` of the spec, or `appliance down`, takes what it left")


class _Run:
    """The loop of a managed run: its jobs, and what follows each."""

    def __init__(self, ctx, control: Control, max_restarts: int, out):
        self.ctx, self.control, self.max_restarts, self.out = ctx, control, max_restarts, out
        self.spec = ctx.spec
        self.current = _current_cluster(self.spec)  # the cluster of the run's newest job
        self.warm: Warm | None = None
        self.parked = False  # no hosts within lease.wait: the run holds no lease and looks again (wait_for_hosts)
        self.limited: str | None = None  # the limit that ended the run (limits: budget.py)
        self.ledger = Ledger(json.loads(json.dumps(control.state.get("leases") or {})))
        self.budget = Budget(self.spec, self.ledger)
        control.on_job, control.extend_by = self.job_started, self.extend_by
        control.on_cancel = lambda req: self.later(stopping.enforce, ctx, control)  # a job that does not answer
        control.on_job_end = lambda res: self.later(self.job_ended, res)
        self._later: list[threading.Thread] = []
        self._progress = threading.Lock()  # the run's progress: a job's end and a handover's downtime
        control.on_first_step = self.downtime
        self.handing_over: dict | None = None  # a handover whose job has not made its first step yet: {"warm"}
        # every lease the run asks for, in the store first (leases.py); the handovers' and slots' bookings too
        self.asking = control.on_ask = Asked(control, self.booked)
        self.recovery = Recovery(self)  # where the run goes on after a lease end (recovery.py)

    def booked(self, info, nodes: int, node_type: str, site: str | None) -> None:
        """A lease Blazar made for the run (leases.Asked): counted in its node-hours from now, booked ahead too."""
        self.ledger.track(info, nodes, node_type, site if site not in (None, self.spec.site) else None)

    def earlier_booking(self, cluster: str):
        """The next lease an earlier controller booked for ``cluster`` (handover.Warm keeps it): leases.booked_for."""
        return booked_for(self.ctx, self.control, cluster)

    def job_started(self, cluster: Cluster, spec: Spec | None = None) -> None:
        """A job starts on ``cluster``: its lease is counted; with lease.overlap, its next cluster is made
        meanwhile (handover.Warm)."""
        self.current = cluster.name
        if self.warm is not None:  # made for a cluster that is not used (a restart on the same one): it goes
            self.warm.abandon()
            self.warm = None
        if spec is not None and cluster.lease_id:  # on the ledger now; its dates beside the job (its start is the
            self.adopt(cluster, spec.nodes.node_type)  # handover's downtime)
        if duration_seconds(self.spec.lease.overlap) and cluster.lease_id and cluster.lease_end_at:
            self.warm = Warm(self.ctx, cluster, self.control.record, steps.stage_to_nodes,
                             self.control.poll, plan=self).start()

    def job_ended(self, res: JobResult) -> None:
        """The run's pace and progress (steps made per second of training, the newest step of its total: the
        estimated finish `appliance ls RUN` shows), and its node-hours so far; beside the handover, not before
        it (the store and the cloud are read)."""
        made, wall = steps_made(res), res.wall_s or 0.0
        meta = newest_meta(self.ctx)
        with self._progress:
            p = dict(self.control.state.get("progress") or {})
            p["steps"] = p.get("steps", 0) + made
            p["train_s"] = round(p.get("train_s", 0.0) + wall, 1)
            p["lease_s"] = duration_seconds(self.spec.lease.duration) / self.ctx.site.time_scale()
            if meta.get("step") is not None:
                p["step"] = int(meta["step"])
            if meta.get("steps_per_epoch") and meta.get("total_epochs"):
                p["total_steps"] = int(meta["steps_per_epoch"]) * int(meta["total_epochs"])
            self.control.update(progress=p, estimate=estimate(p, time.time()))
        self.account()

    def release(self) -> None:
        """The run has finished: its cluster and lease go, so no node-hours are spent on nodes nobody uses until
        the lease's end (its final checkpoint, and a level-3 script's files, are in the store; lease.keep_when_done
        keeps them for what else is on the nodes' disks)."""
        for name in dict.fromkeys((self.current, self.spec.name)):
            if name and find_cluster(name) is not None:
                log.info(f"[run] run {self.spec.name} finished: its cluster {name} and its lease go (its final "
                         "checkpoint is in the store; lease.keep_when_done: true keeps them)")
                try:
                    lifecycle.down(name, self.ctx.site_of(name))
                except ApplianceError as e:  # said; the lease ends by itself
                    log.info(f"[run] warning: cluster {name} was not taken down ({e}): `appliance down {name}`")

    def close_ledger(self) -> None:
        """The run's end: the leases it deleted (a cancel, a finish, a next cluster not used) closed on its ledger
        at the first look after, into the state close writes."""
        if any(not e["closed"] for e in self.ledger.copy().values()):
            self.account()

    def later(self, fn, *args) -> None:
        """``fn(*args)`` in a thread of its own; `settle` waits for them all (before the run's last state)."""
        t = threading.Thread(target=fn, args=args, daemon=True)
        t.start()
        self._later.append(t)

    def settle(self) -> None:
        for t in list(self._later):
            if t is not threading.current_thread():
                t.join(timeout=120)

    # the run's leases and limits (budget.py)

    def elsewhere(self, cluster: Cluster) -> str | None:
        """The cluster's site when it is not the run's own (an alternative at another site), else None."""
        region = cluster.site.region
        return region if cluster.cloud == self.spec.cloud and self.ctx.at(region) is not self.ctx.site else None

    def adopt(self, cluster: Cluster, node_type: str) -> None:
        """The lease of a cluster the run goes on on, on its ledger now (one the run did not ask for: `appliance up`
        made it, or an earlier controller), its dates read beside the caller (a read that fails leaves it held: the
        next look reads them)."""
        site = self.elsewhere(cluster)
        self.ledger.hold(cluster.lease_id, len(cluster.nodes), node_type, site)
        self.later(self.track, cluster.lease_id, len(cluster.nodes), node_type, site)

    def track(self, lease_id: str, nodes: int, node_type: str, site: str | None = None) -> None:
        """Count a lease of the run (its dates from Blazar, at ``site``: None for the run's own) in its node-hours."""
        try:
            info = self.ctx.at(site).cloud.get_lease(lease_id)
        except Exception as e:  # noqa: BLE001 - held on the ledger: read at the next look
            log.info(f"[run] warning: could not read lease {lease_id} ({type(e).__name__}: {e}); read again later")
            return
        if info is not None:
            self.ledger.track(info, nodes, node_type, site)
            self.account()

    def account(self) -> dict | None:
        """The run's node-hours now (spent, booked ahead, its limit), into the controller's state."""
        c = self.ctx.site.cloud
        try:
            now = c.now()
            self.ledger.refresh(lambda site: self.ctx.at(site).cloud, now)
        except Exception as e:  # noqa: BLE001 - the cloud did not answer: the last count stands
            log.info(f"[run] warning: could not read the run's leases ({type(e).__name__}: {e})")
            return None
        nh = self.budget.summary(now)
        self.control.update(leases=self.ledger.copy(), node_hours=nh)
        return nh

    def lease_length(self, start: dt.datetime | None, nodes: int | None = None) -> tuple[int | None, str]:
        """Seconds of the longest lease the run may book from ``start`` (None: now) within its limits."""
        if not self.budget.limited:
            return duration_seconds(self.spec.lease.duration), ""
        self.settle()  # every lease of the run counted (a job's is, beside its start)
        self.account()
        now = self.ctx.site.cloud.now()
        return self.budget.lease_seconds(start or now, now, nodes)

    def extend_by(self, lease_id: str, end: dt.datetime, warm: bool = False) -> tuple[dt.timedelta | None, str]:
        """How far a lease of the run may be extended: the job's watchdog asks near the stop; with lease.overlap,
        handover.Warm asks (``warm``) before it books the next lease, and the watchdog does not extend."""
        if not warm and duration_seconds(self.spec.lease.overlap) and self.warm is not None:
            return None, "with lease.overlap the run extends before it books its next lease, not at the stop"
        if not self.budget.limited:
            return dt.timedelta(days=7), ""  # no cap of the run's own: Chameleon's, at most 7 days at a time
        self.settle()
        self.account()
        nodes = (self.ledger.copy().get(lease_id) or {}).get("nodes") or self.spec.nodes.count
        return self.budget.extension(lease_id, end, self.ctx.site.cloud.now(), nodes)

    def new_lease(self, start: dt.datetime | None = None) -> dict | None:
        """The keyword a new lease of the run is asked for with (its duration cut to the limits), or None: the run
        has reached a limit, and ends here with its checkpoint (said, on the timeline and to notify)."""
        length, why = self.lease_length(start)
        if length is None:
            self.limited = why
            spec = self.spec
            log.info(f"[run] error: run {spec.name} has reached {why}: no lease of it is worth booking (fix: its "
                     f"newest checkpoint is committed; raise the limit in {spec.path}, then `appliance run "
                     f"{spec.path}` continues it)")
            self.control.record("limit", reason=why)
            return None
        if length < duration_seconds(self.spec.lease.duration):
            log.info(f"[run] the next lease is {length / 3600:.2f} h, cut to {why}")
            return {"lease_duration": f"{length // 60}m"}
        return {}

    def out_of_sus(self, e: NoSUs) -> None:
        """A lease of the run was refused for its project's SUs: the run parks with its committed checkpoint."""
        self.parked = True
        log.info(f"[run] error: run {self.spec.name} is parked, holding no lease: {e.message} (fix: {e.fix}; then "
                 f"`appliance run {self.spec.path}` continues it from its newest checkpoint)")
        self.control.parked("no SUs", reason=e.message[:300])

    def final_status(self, res: JobResult | None) -> RunStatus:
        """The run's status once its loop has ended with ``res`` (its last job's result)."""
        if self.control.cancel:
            return RunStatus.CANCELLED
        if self.limited:
            return RunStatus.LIMIT
        if self.parked:
            return RunStatus.PARKED
        if res is None or res.exit_code == 0:
            return RunStatus.FINISHED
        return RunStatus.STOPPED if (res.stopped or {}).get("committed") else RunStatus.FAILED

    def resume(self, **kw) -> JobResult | None:
        """A resume of the run, through the control plane's bad hours (recovery.Recovery.patiently): a step of it the
        cloud or the store does not answer (its cluster's lease, boot, staging) is a wait, then the resume again;
        each of its steps finds what the one before made (the cluster, the data staged)."""
        return self.recovery.patiently(lambda: steps.resume(self.spec.name, spec=self.spec, ctx=self.ctx,
                                                            out=self.out, control=self.control, on_ask=self.asking,
                                                            **kw))

    def loop(self) -> JobResult | None:
        spec, control = self.spec, self.control
        res = self.first_job()
        restarts = stuck = 0
        while res is not None and res.exit_code != 0 and control.cancel is None and not control.lost:
            if res.lease_end:
                restarts = 0
                stuck = stuck + 1 if steps_made(res) <= 1 else 0
                if stuck >= 2:  # each new lease would be stopped again as soon as it starts: lease after lease
                    log.info(f"[run] error: job {res.job_id} stopped for its lease end after {steps_made(res)} "
                             f"step(s), as the one before it: the jobs start too close to their lease's end (fix: "
                             f"a longer lease.duration than {spec.lease.duration}, or a shorter lease.stop_margin "
                             f"than {spec.lease.stop_margin}; then `appliance run {spec.path}`)")
                    control.record("stuck", job_id=res.job_id)
                    break
                res = self.handover(res)
            elif res.stopped is not None and res.stopped.get("committed"):
                log.info(f"[run] job {res.job_id} was stopped ({res.stopped.get('reason')}): run {spec.name} stops "
                         f"here; `appliance run {spec.path}` continues it")
                break
            elif restarts < self.max_restarts and not res.abandoned:
                restarts += 1
                log.info(f"[run] job {res.job_id} failed ({res.failure}); restart {restarts} of {self.max_restarts}, "
                         "from the newest committed checkpoint")
                res = self.resume(acquire=self.recovery.next_cluster)  # its cluster again while its lease runs
            else:
                break
        if control.cancel is not None:
            for name in dict.fromkeys((self.current, spec.name)):
                if name and find_cluster(name) is not None:
                    log.info(f"[run] run {spec.name} cancelled: its cluster {name} goes")
                    lifecycle.down(name, self.ctx.site_of(name))
        return res

    def handover(self, res: JobResult) -> JobResult | None:
        """The job ended with its lease: onto the next cluster made meanwhile (warm: waited for only while its
        lease starts soon, handover.Warm.ready), else a new lease (cold); the recovery strategy (recovery.py)
        returns the cluster, inside the resume (its lease and boot are downtime). A cancel meanwhile ends it."""
        spec, site = self.spec, self.ctx.site_of(self.current or self.spec.name)
        warm, self.warm = self.warm, None
        old = self.current
        self.control.handing_over(after=res.job_id, warm=warm is not None)
        nxt = warm.ready(self.control) if warm is not None else None
        if self.control.cancel is not None or self.control.lost:
            if warm is not None:
                warm.abandon()  # made as the cancel came: it goes too
            return res
        gone = None
        if nxt is not None:
            log.info(f"[run] job {res.job_id} ended with its lease: run {spec.name} goes on on {nxt.name}, up and "
                     "staged already")
            gone = threading.Thread(target=lifecycle.teardown, args=(old, site), daemon=True)
            gone.start()  # the old cluster goes while the checkpoint is staged on the new one
        else:
            if warm is not None:
                warm.abandon()
            log.info(f"[run] job {res.job_id} ended with its lease: run {spec.name} goes on on a new lease")
            if old and old != spec.name and find_cluster(old) is not None:
                lifecycle.down(old, site)  # the strategy takes down the one named RUN itself
        self.handing_over = {"warm": nxt is not None}
        choice = warm.choice if nxt is not None else None
        ended = self.recovery.ended_lease(old)  # its lease, as the resume may be asked again (Recovery.patiently)
        res = self.resume(acquire=lambda phases: self.recovery.next_cluster(phases, nxt, choice, ended=ended))
        if gone is not None:
            gone.join()
        if res is not None and res.resume_breakdown and self.handing_over is not None:  # no first step was made
            self.downtime(res.job_id, res.resume_breakdown)
        self.handing_over = None
        return res

    def downtime(self, job_id: str, breakdown: dict) -> None:
        """A handover's downtime, on the timeline (and to notify) as soon as the new job's first step is done."""
        how, self.handing_over = self.handing_over, None
        if how is None:  # not a handover: the run's first job, a restart after a failure
            return
        self.control.record("downtime", job_id=job_id, warm=how["warm"], breakdown=breakdown,
                            **({"takeover": True} if how.get("takeover") else {}))
        if breakdown.get("total") is not None:  # the estimate counts one per lease end ahead
            with self._progress:
                p = self.control.state.get("progress") or {}
                self.control.update(progress={**p, "downtime_s": [*p.get("downtime_s", [])[-9:], breakdown["total"]]})

    def followed_end(self, job_id: str, cluster: Cluster) -> JobResult | None:
        """A job an earlier controller launched, followed to its end: its result (takeover.followed_result), on
        the timeline and in the run's pace, for the loop to end the run with or hand over; None: the run resumes."""
        events = self.control.state.get("events") or []
        res = takeover.followed_result(self.ctx, job_id, cluster, resumed_at=_began_at(events, job_id))
        down = [e for e in events if e.get("event") == "downtime" and e.get("job_id") == job_id]
        if res is not None and down:  # its resume's downtime, which its launcher put on the timeline only
            res.resume_breakdown = down[-1].get("breakdown")
            runs.record_resume(self.spec.name, job_id, res.resume_breakdown)
        if res is not None:
            self.control.record("job end", job_id=job_id, exit_code=res.exit_code, lease_end=res.lease_end,
                                step=(res.stopped or {}).get("step") or max((c["step"] for c in res.commits),
                                                                            default=None), followed=True,
                                **job_end_marks(res))
            self.later(self.job_ended, res)
        return res

    def first_job(self) -> JobResult | None:
        """A managed run's first job: a resume when the run has committed work, else a fresh job; either on the
        cluster the recovery strategy returns (recovery.py: the run's own while its lease runs, else a new lease
        of the spec's node type or of an alternative, a slot, or none: the run parks)."""
        ctx, spec, control = self.ctx, self.spec, self.control
        if (cl := runcluster.adopt(ctx, control)) is not None:  # the run's cluster, from its state (any machine)
            self.current = cl.name
        followed = takeover.wait_for_live_job(ctx, control, on_follow=lambda cl: self.job_started(cl, spec))
        if control.cancel is not None:
            return None
        reconcile(ctx, control, self.ledger)  # leases an earlier controller asked for that nothing here uses go
        if followed is not None and (res := self.followed_end(**followed)) is not None:
            return res  # the loop hands it over, onto the next cluster made while it was followed
        if _has_committed_work(ctx):  # the cluster it has while its lease runs, else a new lease: the strategy's
            log.info(f"[run] run {spec.name} has committed work: resuming it")
            self.handing_over = takeover.unfinished_handover(control)
            return self.resume(acquire=self.recovery.next_cluster)
        got = self.recovery.next_cluster({})  # the run's own cluster (`appliance up`) while its lease runs, or new
        if got is None:
            return None
        cluster, node_type = got
        if node_type != spec.nodes.node_type:  # an alternative's: what the job's records say it ran on
            spec = dataclasses.replace(spec, nodes=dataclasses.replace(spec.nodes, node_type=node_type))
        if spec.dataset is not None:
            steps.stage_to_nodes(ctx, cluster, spec.dataset.source, spec.dataset.dest, mode=spec.dataset.mode,
                                 out=self.out)
        return steps.run_job(spec, cluster, run=ctx.with_spec(spec), out=self.out, control=control)


def _began_at(events: list[dict], job_id: str) -> int | None:
    """The step job ``job_id`` began at, by the run's timeline: where the job before it ended (None: it restored
    nothing, or the timeline does not say)."""
    start = next((i for i, e in enumerate(events) if e.get("event") == "job" and e.get("job_id") == job_id), None)
    if start is None or not events[start].get("restore"):
        return None
    for e in reversed(events[:start]):  # the job just before: its end, unless its "job" comes first (its end was
        if e.get("event") == "job":     # never recorded: where it stopped is not on the timeline)
            return None
        if e.get("event") == "job end":
            return e.get("step")
    return None


def _current_cluster(spec: Spec) -> str | None:
    """The cluster of the run's newest job, from its record on this machine (RUN or RUN-h)."""
    return (runs.load(spec.name) or {}).get("cluster") or None


def _has_committed_work(ctx) -> bool:
    """Committed checkpoints or synced files of the run in its store. A store that is not reachable is an error
    here, not "none" (a fresh job over committed work would be refused anyway, after a lease was paid for)."""
    cs = ctx.checkpoints
    if cs is None:
        return False
    try:
        if cs.committed():
            return True
    except FileNotFoundError:  # no container yet: a new run
        return False
    return steps.synced_files(ctx) is not None


# -- the detached controller, and what any machine can ask of it ---------------------------------------


def _ready(control: Control) -> None:
    """Tell the `appliance run` that started this controller (start) that it holds the run."""
    fd = os.environ.pop(READY_FD, None)
    if fd and fd.isdigit():
        try:
            os.write(int(fd), f"ok {control.id}\n".encode())
            os.close(int(fd))
        except OSError:  # the starter is gone (killed): nothing to tell
            pass


def start(spec_path: str, *, max_restarts: int = 0) -> dict:
    """`appliance run SPEC`: the controller in a process of its own (a new session: it outlives the terminal and
    the shell that typed the command), its output in ~/.appliance/runs/RUN/controller.log. Returns once it holds
    the run (its lock in the store), or raises with its own error line."""
    spec = _needs_url(steps.check(spec_path))
    where = runs.record_dir(spec.name)
    where.mkdir(parents=True, exist_ok=True)
    log_path = where / "controller.log"
    ctx = steps.RunContext.of(spec)
    live = Control(spec, ctx.creds(spec.checkpoint.url))  # refused before anything is made: nothing of the live
    holder = live.lock.read()                               # controller's (its credential file) is touched
    if holder is not None and live.lock.alive(holder, ended=gone_here):
        raise busy(spec.name, holder)
    made = credential.make(ctx, where)  # the controller's own credential (credential.py), not yours
    r, w = os.pipe()
    cmd = [sys.executable, "-m", "appliance.cli", "run", os.path.abspath(spec_path), "--foreground",
           "--max-restarts", str(max_restarts)]
    with open(log_path, "ab") as f:
        f.write(f"\n== {time.strftime('%Y-%m-%d %H:%M:%S')} {' '.join(cmd[3:])}\n".encode())
        f.flush()
        p = subprocess.Popen(cmd, stdin=subprocess.DEVNULL, stdout=f, stderr=subprocess.STDOUT, pass_fds=(w,),
                             start_new_session=True, env={**credential.controller_env(made), READY_FD: str(w)})
    os.close(w)
    with os.fdopen(r, "rb") as pipe:
        said = pipe.read().decode(errors="replace")  # until the controller says ready, or exits
    if not said.startswith("ok "):
        rc = p.wait()
        credential.drop(ctx, made)  # made for it, and not used
        lines = [x for x in log_path.read_text(errors="replace").splitlines() if x.strip()]
        last = lines[-1] if lines else f"exit {rc}"
        raise ApplianceError(f"the controller of run {spec.name} did not start: {last.removeprefix('error: ')}",
                             f"its log: {log_path}")
    own = {"credential": made[credential.CRED_ENV], "expires": made[credential.EXPIRES_ENV]} if made else None
    return {"run": spec.name, "controller": said.split()[1], "pid": p.pid, "log": str(log_path), "credential": own}


def plan(spec_path: str, *, run_for: str | None = None) -> dict:
    """`appliance run SPEC --plan`: the run's leases, their cost and Chameleon's policy on them (plan.py); books
    nothing."""
    from . import plan as planning

    spec = steps.check(spec_path, here=False)
    return planning.make(steps.RunContext.of(spec), run_for)


def _needs_url(spec: Spec) -> Spec:
    if not spec.checkpoint.url:
        raise SpecError(f"{spec.path}: a managed run keeps its checkpoints and its state in the object store, and "
                        "the spec has no checkpoint.url", "add `checkpoint: {url: swift://CONTAINER/}` (or s3://)")
    return spec


def _control_of(run: str, url: str | None, cloud: str, site_name: str | None) -> Control:
    """A reader of RUN's controller record (from this machine's run record, or ``url``)."""
    spec = find_spec(run, None, url, creds=steps.data_creds(url, cloud, site_name) if url else None)
    if not spec.checkpoint.url:
        raise ApplianceError(f"run {run} has no checkpoint.url: it has no controller", "`appliance ls` lists runs")
    return Control(spec, steps.RunContext.of(spec).creds(spec.checkpoint.url))


def cancel(run: str, *, url: str | None = None, cloud: str = "local", site_name: str | None = None) -> dict:
    """`appliance cancel RUN`: ask the run's live controller (on any machine) to stop the run."""
    c = _control_of(run, url, cloud, site_name)
    holder = c.lock.read()
    if holder is None or not c.lock.alive(holder, ended=gone_here):
        raise ApplianceError(f"run {run} has no live controller, so nothing to cancel", "a job started with "
                             "`appliance train` stops with Ctrl-C there; `appliance ls` shows the run")
    req = {"controller": holder["job_id"], "at": time.time(), "by": socket.gethostname()}
    c.cs.put_text("cancel.json", json.dumps(req), tempfile.gettempdir())
    try:  # its job, stopped by its head node's beat, whoever launched it (stopping.py)
        job = stopping.ask(c.run_store())
    except Exception as e:  # noqa: BLE001 - the controller asks again (stopping.enforce)
        log.info(f"[run] warning: the stop request for run {run}'s job is not in the store ({type(e).__name__}: "
                 f"{e}); its controller writes it when it sees the cancel")
        job = None
    return {"run": run, "controller": holder["job_id"], "host": holder.get("cluster"), "pid": holder.get("head"),
            "job": job}


def timeline(run: str, *, url: str | None = None, cloud: str = "local", site_name: str | None = None) -> dict | None:
    """The run's controller state from the store (None: it never had a controller), with whether one is alive."""
    return read_timeline(_control_of(run, url, cloud, site_name))


def store_logs(run: str, *, url: str | None, cloud: str = "local", site_name: str | None = None, lines: int = 50,
               follow: bool = False, out: Callable[[str], None] = print, poll: float = 5.0) -> str:
    """`appliance logs RUN --url URL`: the newest job's output from the store, as its controller shipped it
    (Control.ship_log: its last LOG_TAIL bytes, every LOG_EVERY), from any machine; ``follow``: new lines until
    the timeline says that job ended. Returns the job id."""
    return read_logs(_control_of(run, url, cloud, site_name), run, lines=lines, follow=follow, out=out, poll=poll)
