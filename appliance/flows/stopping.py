"""`appliance cancel RUN` from any machine (issue 77): the job stops with a checkpoint, whoever launched it.

The cancel writes a stop request for the job that holds the run's lock (store/stopask.py), beside the cancel
request to the controller; the head node's beat (node/lockbeat.py) turns it into the job's STOP file within
STOP_POLL seconds and answers it. The controller that holds the run (``enforce``, on the cancel) writes the request
too when none is there for that job, and waits for the answer or the job's end for two of the job lock's
heartbeats from the job's start; a job that does not answer in that time (its head cut off from the store, a node
image without the beat's check) has its lease deleted, with one line saying which steps are lost: it would train on,
billed, to its lease's end.
"""

from __future__ import annotations

import os
import socket
import time
from collections.abc import Callable

from .. import report
from ..store import stopask
from ..store.checkpoints import CheckpointStore
from ..store.runlock import INTERVAL, RunLock
from . import takeover

log = report.get(__name__)


def bound() -> float:
    """Seconds a job is given to answer a stop request: two heartbeats of its lock."""
    return 2 * float(os.environ.get("APPLIANCE_RUN_LOCK_INTERVAL") or INTERVAL)


def ask(cs: CheckpointStore, by: str | None = None) -> str | None:
    """The stop request for the job that holds the run's lock now (``cs``: the run's store). Returns its id (None:
    no job holds the run)."""
    job = RunLock(cs, "", cluster="", head="").read()
    if job is None:
        return None
    stopask.ask(cs, str(job.get("job_id")), by or socket.gethostname())
    return str(job.get("job_id"))


def enforce(ctx, control, *, limit: float | None = None, poll: float | None = None,
            wait: Callable[[float], bool] | None = None, now: Callable[[], float] = time.monotonic) -> str:
    """After a cancel: the job that holds the run's lock is asked to stop (the request in the store, unless one is
    there for it), and given ``limit`` (bound()) from its start to answer; then its lease is deleted (said: the
    steps after its last commit are lost). Returns "none" (no job), "answered", "ended", "not started" (a lock with
    no word of a start, not this controller's), "closed" (the controller ended first) or "deleted". The store not
    answering is said once and asked again each ``poll``; the time it is away is not the job's (it could not read
    the request either). ``wait(seconds)``: True once the controller is closed."""
    cs, limit = ctx.checkpoints, limit if limit is not None else bound()
    poll, wait = poll if poll is not None else stopask.STOP_POLL / 3, wait or control.wait_closed
    lock = RunLock(cs, "", cluster="", head="")
    look = _Looks(control, wait, poll, now)

    def request():
        job = lock.read()
        if job is not None and stopask.asked(cs, str(job.get("job_id"))) is None:
            stopask.ask(cs, str(job.get("job_id")), f"the controller of run {control.run}")
        return job

    ok, job = look(request)
    if not ok:
        return "closed"
    if job is None:
        return "none"
    jid = str(job.get("job_id"))
    since = now()
    while True:
        ok, (cur, answer) = look(lambda: _lock_and_answer(lock, cs, jid))
        if not ok:
            return "closed"
        since += look.away  # the store's time away, not the job's
        if cur is None or cur.get("job_id") != jid:
            return "ended"
        if (answer or {}).get("answered"):
            return "answered"
        if not cur.get("started"):
            if cur.get("launcher") != control.id:  # never started by a dead launcher (takeover.py), or a job
                return "not started"                # `appliance train` launched (no word of a start): not ours to end
            since = now()  # being set up by this controller: stopped at its start (control's hook)
        elif now() - since >= limit:
            return drop(ctx, control, cur, limit)
        if wait(poll):
            return "closed"


def _lock_and_answer(lock: RunLock, cs: CheckpointStore, jid: str) -> tuple[dict | None, dict | None]:
    cur = lock.read()
    return cur, (stopask.asked(cs, jid) if cur is not None and cur.get("job_id") == jid else None)


class _Looks:
    """``look(fn)``: (True, fn()) once the store answers, the seconds it was away in ``away``; (False, (None, None))
    once the controller is closed meanwhile. A failure (any client's: swiftclient, keystoneauth, requests, not only
    the appliance's) is said once for the whole cancel and asked again every ``poll``: the enforcer's thread lives on."""

    def __init__(self, control, wait: Callable[[float], bool], poll: float, now: Callable[[], float]):
        self.control, self.wait, self.poll, self.now = control, wait, poll, now
        self.said, self.away = False, 0.0

    def __call__(self, fn):
        self.away = 0.0
        while True:
            t0 = self.now()
            try:
                return True, fn()
            except Exception as e:  # noqa: BLE001 - the store away: looked at again
                if not self.said:
                    self.said = True
                    log.info(f"[run] warning: cannot read run {self.control.run}'s lock for its cancel "
                             f"({type(e).__name__}: {e}); looking again every {self.poll:.0f}s")
                closed = self.wait(self.poll)
                self.away += self.now() - t0  # the failed try and the wait after it
                if closed:
                    return False, (None, None)


def drop(ctx, control, job: dict, limit: float) -> str:
    """The lease of a job that did not answer the stop request within ``limit`` seconds, deleted; one line says
    which steps are lost (those after the run's newest commit)."""
    jid, lease_id = job.get("job_id"), job.get("lease_id")
    _, step = takeover.newest_commit(ctx)
    lost = f"its steps after step {step}, the run's last commit, are lost" if step is not None else \
        "all its steps are lost (the run has no commit)"
    if not lease_id:
        log.info(f"[run] warning: job {jid} did not answer the stop within {limit:.0f}s and its lock names no "
                 f"lease to delete: it trains on until its lease ends ({lost} then)")
        return "unanswered"
    log.info(f"[run] job {jid} did not answer the stop within {limit:.0f}s (two of its lock's heartbeats): its lease "
             f"{lease_id} is deleted now; {lost}")
    ctx.at(job.get("lease_site")).cloud.delete_lease(str(lease_id))
    control.record("lease deleted", lease_id=lease_id, job_id=jid, reason="the job did not answer the cancel",
                   last_commit=step)
    return "deleted"
