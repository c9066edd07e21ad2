"""Run records: ~/.appliance/runs/RUN/run.json, one per run, updated by every job of the run.

A run is a spec's ``name``; it may span several jobs (the first, then each `appliance resume`), several leases
and clusters. The record keeps what `appliance ls` shows: status, step, last committed checkpoint, the
spec, and node-hours used vs lost (lost = node time spent after the last commit of a job that then failed,
i.e. work that has to be redone).
"""

from __future__ import annotations

import contextlib
import datetime as dt
import fcntl
import json
import os
import socket
import time
from enum import StrEnum
from pathlib import Path

from .. import paths
from ..cluster import Cluster
from ..spec import Spec
from ..train.launch import JobContext, JobHooks, JobResult


class RunRecords(JobHooks):
    """The `train` hook that keeps the run record of each job (flows.run_job adds it)."""

    def started(self, ctx: JobContext) -> None:
        self.spec, self.cluster = ctx.spec, ctx.cluster
        job_started(ctx.spec, ctx.cluster, ctx.job_id, restore=ctx.restore)

    def finish(self, result: JobResult) -> None:
        job_ended(self.spec, self.cluster, result)


def record_dir(run: str) -> Path:
    """~/.appliance/runs/RUN on this machine: the run record and the job logs (not the run directory on the
    head node, train.headjob.run_dir)."""
    return paths.home() / "runs" / run


def load(run: str) -> dict | None:
    p = record_dir(run) / "run.json"
    try:
        return json.loads(p.read_text())
    except (OSError, ValueError):
        return None


def save(rec: dict) -> None:
    d = record_dir(rec["run"])
    d.mkdir(parents=True, exist_ok=True)
    tmp = d / "run.json.tmp"
    tmp.write_text(json.dumps(rec, indent=1, sort_keys=True))
    os.replace(tmp, d / "run.json")


@contextlib.contextmanager
def _updating(run: str):
    """One read-modify-write of a run's record at a time: a managed run's controller writes it from several
    threads (its status, a job's start and end, a resume's downtime), and a second command may too. Without it a
    write could put back a record read before another's write, and lose that write."""
    d = record_dir(run)
    d.mkdir(parents=True, exist_ok=True)
    with open(d / "run.json.lock", "a") as f:
        fcntl.flock(f, fcntl.LOCK_EX)  # released when f closes
        yield


def _new(spec: Spec) -> dict:
    return {"run": spec.name, "spec_path": str(Path(spec.path).resolve()) if spec.path else None,
            "checkpoint_url": spec.checkpoint.url, "status": "new", "step": 0, "last_checkpoint": None,
            "jobs": [], "node_seconds_used": 0.0, "node_seconds_lost": 0.0}


def job_started(spec: Spec, cluster: Cluster, job_id: str, restore: str | None = None) -> None:
    with _updating(spec.name):
        rec = load(spec.name) or _new(spec)
        if spec.path:
            rec["spec_path"] = str(Path(spec.path).resolve())
        rec["checkpoint_url"] = spec.checkpoint.url
        rec["status"] = "running"
        rec["cluster"] = cluster.name
        rec["lease_id"] = cluster.lease_id
        rec["lease_end"] = cluster.lease_end
        rec["jobs"].append({"job_id": job_id, "started": time.time(), "nodes": len(cluster.nodes),
                            "world_size": cluster.world_size, "restore": restore, "status": "running"})
        save(rec)


def job_not_started(run: str, job_id: str, launcher: str) -> None:
    """A job that holds the run's lock and never started: its launcher (a controller of this machine, ``launcher``)
    was killed between taking the lock and starting it. Ended, so its lock is taken over at once (checkpoint.job
    job_ended_here), not a ttl later."""
    with _updating(run):
        rec = load(run) or {"run": run, "status": "new", "step": 0, "last_checkpoint": None, "jobs": [],
                            "node_seconds_used": 0.0, "node_seconds_lost": 0.0}
        job = next((j for j in rec["jobs"] if j.get("job_id") == job_id), None)
        if job is None:
            job = {"job_id": job_id, "nodes": 0}
            rec["jobs"].append(job)
        job.update({"status": "not started", "ended": time.time(), "launcher": launcher})
        save(rec)


def mark_managed(spec: Spec) -> None:
    """The run has a controller (`appliance run`): `appliance ls RUN` reads its timeline from the store."""
    with _updating(spec.name):
        rec = load(spec.name) or _new(spec)
        rec["managed"] = True
        if spec.path:
            rec["spec_path"] = str(Path(spec.path).resolve())
        rec["checkpoint_url"] = spec.checkpoint.url
        save(rec)


def mark_status(run: str, status: str, controller: str | None = None) -> None:
    """A managed run's status, as its controller (``controller``: its id, host:pid:...) last said it (running,
    handover, parked, finished, limit, cancelled, ...): what `appliance ls` shows for it, rather than its last
    job's (a job that stopped for its lease's end is not a run that stopped)."""
    with _updating(run):
        rec = load(run)
        if rec is not None and (rec.get("managed_status"), rec.get("controller")) != (status, controller):
            rec["managed_status"], rec["controller"] = status, controller
            save(rec)


class RunStatus(StrEnum):
    """A managed run's status, as its controller says it (its state in the store, `appliance ls`); the first four
    while a controller runs it (GOING), the others once the run has ended."""

    STARTING = "starting"  # the controller holds the run, no job yet
    RUNNING = "running"  # a job trains (launched by this controller, or followed: flows/takeover.py)
    HANDOVER = "handover"  # a job ended with its lease: the next cluster, then the resume
    PARKED = "parked"  # no hosts (or no SUs) for the next lease: no lease held, the controller looks again
    WAITING = "waiting"  # the cloud does not answer (Keystone, Blazar, Nova): the run waits with its checkpoint
    FINISHED = "finished"
    STOPPED = "stopped"  # its user stopped it, with a commit: `appliance run SPEC` continues it
    FAILED = "failed"
    CANCELLED = "cancelled"
    LIMIT = "limit"  # limits.node_hours or limits.deadline reached


GOING = (RunStatus.STARTING, RunStatus.RUNNING, RunStatus.HANDOVER, RunStatus.PARKED, RunStatus.WAITING)
ENDED = tuple(s for s in RunStatus if s not in GOING) + (RunStatus.PARKED,)  # a run may end parked (no SUs)
_AWAY = frozenset({RunStatus.WAITING})  # the cloud may go away in any step that asks it for the next cluster

# The status changes a managed run's controller makes (flows/control.py Control: one method per transition, each
# named by the timeline event that makes it); every other change is refused. An ended run's status changes no more.
NEXT: dict[RunStatus, frozenset[RunStatus]] = {
    RunStatus.STARTING: frozenset({RunStatus.RUNNING, RunStatus.HANDOVER, RunStatus.PARKED, *_AWAY, *ENDED}),
    RunStatus.RUNNING: frozenset({RunStatus.RUNNING, RunStatus.HANDOVER, RunStatus.PARKED, *_AWAY, *ENDED}),
    RunStatus.HANDOVER: frozenset({RunStatus.RUNNING, RunStatus.PARKED, *_AWAY, *ENDED}),
    RunStatus.PARKED: frozenset({RunStatus.RUNNING, *_AWAY, *ENDED}),
    RunStatus.WAITING: frozenset({RunStatus.RUNNING, RunStatus.HANDOVER, RunStatus.PARKED, *_AWAY, *ENDED}),
}


def machine_tag() -> str:
    """What tells this machine's processes from those of another that has the same hostname (containers, cloned
    VMs): its boot and its pid namespace (Linux); "" where there is no /proc."""
    import hashlib

    try:
        boot = Path("/proc/sys/kernel/random/boot_id").read_text().strip()
        ns = os.readlink("/proc/self/ns/pid")
    except OSError:
        return ""
    return hashlib.sha256(f"{boot} {ns}".encode()).hexdigest()[:10]


def of_this_machine(controller_id: str) -> bool:
    """A controller id (host:pid:start.random[:machine_tag]) of this machine: its hostname, and its machine tag
    where it has one."""
    host, _pid, *rest = (controller_id or "::").split(":")
    return host == socket.gethostname() and not (len(rest) > 1 and rest[1] != machine_tag())


def process_gone(controller_id: str) -> bool:
    """A controller of this machine (its id: host:pid:start.random[:machine_tag]) whose process is gone: killed, or
    a zombie not yet reaped. False for another machine's, which this one cannot tell: another hostname, or the same
    hostname with another machine tag (a container of the same name: its pids are not ours to look at)."""
    host, pid, *rest = controller_id.split(":")
    if host != socket.gethostname() or not pid.isdigit():
        return False
    if len(rest) > 1 and rest[1] != machine_tag():
        return False
    try:
        os.kill(int(pid), 0)
    except ProcessLookupError:
        return True
    except PermissionError:  # another user's process of that pid: not ours, so ours is gone
        return True
    try:  # killed, and not yet reaped by its parent (init, once `appliance run` has returned): a zombie
        return open(f"/proc/{pid}/stat").read().rsplit(")", 1)[1].split()[0] in ("Z", "X")
    except (OSError, IndexError):  # no /proc (macOS): the pid answers, so it runs
        return False


def job_ended(spec: Spec, cluster: Cluster, res) -> dict:
    with _updating(spec.name):
        rec = load(spec.name) or _new(spec)
        _job_end(rec, cluster, res)
        save(rec)
    return rec


def _job_end(rec: dict, cluster: Cluster, res) -> None:
    """A job's end, into its run's record: how it ended, its steps and commits, node time used and lost."""
    job = next((j for j in rec["jobs"] if j["job_id"] == res.job_id), None)
    if job is None:
        job = {"job_id": res.job_id, "started": res.started_at, "nodes": len(cluster.nodes)}
        rec["jobs"].append(job)
    ended = time.time()
    nodes = len(cluster.nodes)
    used = res.wall_s * nodes
    if getattr(res, "abandoned", False):  # the launcher lost the head and gave up; the job may still run there
        status = "lost"
    elif res.stopped:
        status = "stopped" if res.stopped.get("committed") else "failed"
        if res.stopped.get("step") is not None:  # none when rank 0's syncer ended a level-3 job
            rec["step"] = res.stopped["step"]
    elif res.exit_code == 0:
        status = "complete"
    else:
        status = "failed"
    lost = 0.0
    if status == "failed":
        last_commit = max((c.get("at", 0) for c in res.commits), default=0) or res.started_at
        lost = max(0.0, ended - max(last_commit, res.started_at)) * nodes
    for c in res.commits:
        rec["last_checkpoint"] = {"name": c["name"], "step": c["step"], "committed_at": c.get("at", ended)}
        rec["step"] = max(rec.get("step") or 0, c["step"])
    resumed = getattr(res, "resumed", None)
    job["first_step"] = int(resumed["step"]) if resumed else 0
    job["last_step"] = (int(res.stopped["step"]) if res.stopped and res.stopped.get("step") is not None
                        else max((c["step"] for c in res.commits), default=None))
    job.update({"ended": ended, "status": status, "exit_code": res.exit_code, "failure": res.failure,
                "node_seconds": round(used, 1), "node_seconds_lost": round(lost, 1)})
    if getattr(res, "stream", None):
        job["stream"] = res.stream
    rec["status"] = status
    rec["node_seconds_used"] = round(rec.get("node_seconds_used", 0) + used, 1)
    rec["node_seconds_lost"] = round(rec.get("node_seconds_lost", 0) + lost, 1)
    rec["lease_end"] = cluster.lease_end


def record_resume(run: str, job_id: str, breakdown: dict) -> None:
    """Keep a resume's downtime, phase by phase, with its job (`appliance ls RUN` shows it)."""
    with _updating(run):
        rec = load(run)
        job = next((j for j in (rec or {}).get("jobs", []) if j["job_id"] == job_id), None)
        if job is not None:
            job["resume_breakdown"] = breakdown
            save(rec)


def run_details(run: str) -> dict | None:
    """`appliance ls RUN`: the summary row and every job (steps, status, a resume's downtime)."""
    rec = load(run)
    if rec is None:
        return None
    return {**summarize(rec), "managed": bool(rec.get("managed")), "jobs": [
        {k: j.get(k) for k in ("job_id", "status", "nodes", "world_size", "first_step", "last_step", "started",
                               "ended", "exit_code", "failure", "resume_breakdown", "stream",
                               "node_seconds_lost")} for j in rec.get("jobs", [])]}


def running_on(cluster: str) -> list[dict]:
    """The runs whose newest job this machine started on ``cluster`` and saw no end of: [{run, job_id, started}]."""
    d = paths.home() / "runs"
    out = []
    for p in sorted(d.glob("*/run.json")) if d.exists() else []:
        rec = load(p.parent.name)
        if rec and rec.get("status") == "running" and rec.get("cluster") == cluster and rec.get("jobs"):
            job = rec["jobs"][-1]
            out.append({"run": rec["run"], "job_id": job.get("job_id"), "started": job.get("started")})
    return out


def list_runs() -> list[dict]:
    d = paths.home() / "runs"
    out = []
    for p in sorted(d.glob("*/run.json")) if d.exists() else []:
        rec = load(p.parent.name)
        if rec:
            out.append(summarize(rec))
    return out


def summarize(rec: dict) -> dict:
    """The row `appliance ls` shows."""
    now = time.time()
    last = rec.get("last_checkpoint") or {}
    age = now - last["committed_at"] if last.get("committed_at") else None
    left = None
    if rec.get("lease_end") and rec.get("status") in ("running", "stopped"):
        try:
            end = dt.datetime.fromisoformat(rec["lease_end"].replace("Z", ""))
            left = (end.replace(tzinfo=dt.timezone.utc).timestamp() - now) if end.tzinfo is None else \
                end.timestamp() - now
        except ValueError:
            left = None
    status = (rec.get("managed") and rec.get("managed_status")) or rec.get("status")
    if rec.get("managed") and status in GOING and rec.get("controller") and process_gone(rec["controller"]):
        status = "no controller"  # killed mid-run: `appliance run SPEC` again takes the run over
    return {"run": rec["run"], "status": status, "step": rec.get("step", 0),
            "last_checkpoint": last.get("name"), "checkpoint_age_s": None if age is None else round(age),
            "lease_left_s": None if left is None else round(left), "jobs": len(rec.get("jobs", [])),
            "node_hours_used": round(rec.get("node_seconds_used", 0) / 3600, 3),
            "node_hours_lost": round(rec.get("node_seconds_lost", 0) / 3600, 3)}
