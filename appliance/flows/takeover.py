"""What a controller finds when it takes a managed run over (flows/managed.py): a job of the run that still runs,
detached on its head node, is waited for; a job whose launcher (a controller of this machine, killed) took the
run's lock and never started it is taken over at once; a handover the killed controller began is finished, its
downtime on the timeline."""

from __future__ import annotations

import re
import time

from .. import report
from ..checkpoint import runs
from ..cluster import Cluster, find_cluster
from ..errors import ApplianceError
from ..protocol import EXIT_STOPPED
from ..spec import duration_seconds
from ..train import headjob
from ..train.launch import JobResult
from .control import Control, gone_here

log = report.get(__name__)


def lease_runs(ctx, cluster: Cluster) -> bool:
    """The cluster's lease has not ended (Blazar still has it, its end not passed by the cloud's clock)."""
    from ..checkpoint.job import lease_over_for

    return bool(cluster.lease_id) and not lease_over_for(ctx.site)(cluster.lease_id, cluster.site.region)


def lease_left(ctx, cluster: Cluster) -> float | None:
    """Seconds of the cluster's lease left by the cloud's clock (<= 0: over or gone); None when it cannot tell."""
    site = ctx.lease_site(cluster) or ctx.site
    try:
        info, now = site.cloud.lease_at(str(cluster.lease_id))
    except Exception:  # noqa: BLE001 - cannot tell
        return None
    if info is None or info.ended:
        return 0.0
    return (info.end - now).total_seconds()


def live_job(ctx) -> dict | None:
    from ..checkpoint import job

    try:
        return job.live_job(ctx.spec, ctx.checkpoints, ctx.site)
    except FileNotFoundError:  # no container yet: a new run
        return None


def wait_for_live_job(ctx, control: Control, on_follow=None) -> dict | None:
    """A controller that starts while a job of the run still runs (its controller was killed, the laptop slept: the
    job went on, detached on its head node) waits for that job to end, by the run's lock, and takes the run from
    there; a resume now would be refused. A cancel meanwhile asks that job to stop (its STOP file). A job an earlier
    controller locked the run for and never started is taken over at once (never_started). ``on_follow(cluster)``:
    told of a job an earlier controller launched that runs on a head node this machine knows, which is followed
    (its next cluster made meanwhile, as for a job of this controller's). Returns that job ({job_id, cluster}), or
    None."""
    said = stop_asked = False
    looked: set[str] = set()  # each job's launcher and head asked once (a record that could not say "not started"
    followed = None           # leaves the lock's ttl to decide)
    while (job := live_job(ctx)) is not None:
        jid = str(job.get("job_id"))
        if jid not in looked:
            looked.add(jid)
            how, cl = _launched(ctx, control, job)
            if how == "not started":
                never_started(ctx, control, job, cl)
                continue
            if how == "runs" and on_follow is not None and followed is None:
                followed, said = {"job_id": jid, "cluster": cl}, True
                log.info(f"[run] job {jid} of run {ctx.spec.name} runs on {cl.name}, launched by a controller that "
                         "is gone: following it to its end, which is handed over as any job's")
                control.running("following", job_id=jid, cluster=cl.name)
                on_follow(cl)
        if not said:
            said = True
            age = time.time() - float(job.get("heartbeat", 0))
            log.info(f"[run] job {jid} of run {ctx.spec.name} still runs on cluster {job.get('cluster')} "
                     f"(its lock renewed {age:.0f}s ago): waiting for it to end")
            control.record("waiting", job_id=jid, cluster=job.get("cluster"))
        if control.cancel is not None and not stop_asked:
            stop_asked = True
            cl = find_cluster(str(job.get("cluster")))
            try:
                if cl is not None:
                    headjob.ask_to_stop(cl, ctx.spec.name, "appliance cancel")
            except ApplianceError as e:
                log.info(f"[run] could not ask job {jid} to stop: {e}")
        control.changed.wait(control.poll)  # the next look at the lock, or at once on a cancel
        control.changed.clear()
    return followed


def _launched(ctx, control: Control, job: dict) -> tuple[str, Cluster | None]:
    """How a live job of the run stands when an earlier controller launched it (the run's lock names it; not this
    one) on a cluster this machine knows (its own record, or the one rebuilt from the run's state: runcluster.py):
    ("runs", cluster) when its head node runs a job of the run; ("not started", cluster) when it does not, and that
    controller was of this machine and is gone, or the store says it never started it (store_says_not_started);
    else ("", None): a head that cannot be asked, a job `appliance train` launched, a launcher that may still start
    it, a job that ran and has ended (its exit status on the head: its head's beat releases the lock within its
    interval, node/lockbeat.py)."""
    launcher = str(job.get("launcher") or "")
    cl = find_cluster(str(job.get("cluster"))) if launcher and launcher != control.id else None
    runs_now = headjob.job_runs(cl, ctx.spec.name) if cl is not None else None
    if runs_now:
        return "runs", cl
    if launcher and store_says_not_started(control, job, cl):
        return "not started", cl
    if cl is None:
        return "", None
    if runs_now is False and gone_here(launcher):
        ended = headjob.job_end(cl, ctx.spec.name, str(job.get("job_id")))
        return ("not started", cl) if ended is None else ("", None)
    return "", None


def store_says_not_started(control: Control, job: dict, cl: Cluster | None) -> bool:
    """The run's store says the job was never started, whatever machine its launcher ran on: its launcher is the
    controller this one took the run over from (its lock went stale: it is gone), and the job's lock has no word of
    a start (RunLock.started: its launcher's, once it started the job, and the head node's beat's), or its
    cluster's record has no servers for its lease (never booted: nothing could run there)."""
    if not control.took_over or job.get("launcher") != control.took_over:
        return False
    if not job.get("started"):
        return True
    return cl is not None and cl.lease_id == job.get("lease_id") and not cl.site.servers


def never_started(ctx, control: Control, job: dict, cl: Cluster | None) -> None:
    """A live lock of the run's job whose launcher was a controller of this machine that is gone, and no job of the
    run runs on its head node: that controller was killed between taking the run's lock and starting the job. The
    job is marked ended here, so its lock is taken over at once instead of a ttl (300 s of paid, idle lease) later,
    and the store credential made for it is deleted."""
    launcher, where = str(job.get("launcher")), cl.name if cl is not None else str(job.get("cluster"))
    runs.job_not_started(ctx.spec.name, str(job.get("job_id")), launcher)
    log.info(f"[run] job {job.get('job_id')} of run {ctx.spec.name} holds the run's lock but never started on "
             f"{where} (its controller {launcher} is gone): taking the run over now")
    control.record("job not started", job_id=job.get("job_id"), cluster=where, launcher=launcher)
    _withdraw_job_creds(ctx, str(job.get("job_id")))


def _withdraw_job_creds(ctx, job_id: str) -> None:
    """The store credential its launcher made for the job that never started (sites/base.py ``_job_app_cred``: an
    application credential named appliance-RUN-JOB-XXXXXX, which an EC2 credential of the job's goes with), deleted:
    nothing else will."""
    name = f"appliance-{ctx.spec.name}-{job_id}"
    ours = re.compile(rf"^{re.escape(name)}-[0-9a-f]{{6}}$")
    try:
        cloud = ctx.site.cloud
        for ac in cloud.list_app_creds():
            if ours.match(str(ac.get("name"))):
                cloud.delete_app_cred(ac["id"])
    except Exception as e:  # noqa: BLE001 - it expires APP_CRED_AFTER_LEASE after the lease ends (sites/base.py)
        log.info(f"[run] warning: could not delete the store credential {name} of that job "
                 f"({type(e).__name__}: {e}); it expires after its lease")


def unfinished_handover(control: Control) -> dict | None:
    """A handover an earlier controller began (the old job ended with its lease) and that no job's first step
    finished: this controller finishes it, and its downtime is on the timeline as any handover's."""
    for e in reversed(control.state.get("events") or []):
        if e.get("event") in ("downtime", "job"):
            return None
        if e.get("event") == "handover":
            return {"warm": False, "takeover": True}
    return None


def followed_result(ctx, job_id: str, cluster: Cluster, resumed_at: int | None = None) -> JobResult | None:
    """The end of a job an earlier controller launched and this one followed (wait_for_live_job), as its launcher
    would have had it, into the run's record: finished (exit 0 on its head with no stop report: the run has, too),
    or stopped for its lease's end (rank 0's stop report with a commit and the lease ending within twice
    lease.stop_margin; or the lease over, its nodes gone: the newest commit is where it stopped). None otherwise
    (it failed, a user stopped it, the head cannot say): the run resumes, as after any takeover. ``resumed_at``:
    the step the job began at by the run's timeline (the job before it ended there), for a job whose head is gone
    with its lease and whose launcher's records are on another machine."""
    spec = ctx.spec
    end = headjob.job_end(cluster, spec.name, job_id) or {}
    stopped, left = end.get("stopped"), lease_left(ctx, cluster)
    near = left is not None and left <= 2 * duration_seconds(spec.lease.stop_margin)
    done = end.get("rc") == 0 and stopped is None
    if not done and not (left is not None and left <= 0) and not (near and stopped and stopped.get("committed")):
        return None
    name, step = newest_commit(ctx)
    if stopped and stopped.get("step") is not None:
        step = stopped["step"]
    jobs = (runs.load(spec.name) or {}).get("jobs", [])
    started = next((j.get("started") for j in jobs if j.get("job_id") == job_id), None)
    before = [j["last_step"] for j in jobs if j.get("job_id") != job_id and j.get("last_step") is not None]
    resumed = end.get("resumed") or ({"step": resumed_at} if resumed_at is not None else None) or (  # rank 0's
        {"step": before[-1]} if before else None)  # word, the run's timeline (every machine's jobs), this machine's
    res = JobResult(job_id=job_id, exit_code=0 if done else EXIT_STOPPED, world_size=cluster.world_size,
                    wall_s=time.time() - started if started else 0.0, started_at=started or 0.0,
                    rank_hosts=[n.name for n in cluster.nodes], lease_end=not done, resumed=resumed,
                    stopped=None if done else {**(stopped or {}), "committed": True, "step": step,
                                               "reason": (stopped or {}).get("reason") or "lease end"},
                    commits=[{"name": name, "step": step}] if done and name else [])
    runs.job_ended(spec, cluster, res)
    return res


def newest_commit(ctx) -> tuple[str | None, int | None]:
    """(name, step) of the run's newest committed checkpoint; (None, None) when it has none or the store does not
    answer (a followed job's end is then recorded without its step)."""
    try:
        newest = ctx.checkpoints.committed()
    except Exception:  # noqa: BLE001
        return None, None
    return (newest[0].name, newest[0].step) if newest else (None, None)
