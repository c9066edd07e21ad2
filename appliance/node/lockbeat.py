"""The head node renews the run's lock in the store for as long as the job runs (`python -m appliance.node.lockbeat`).

The launcher takes the run's lock (store/runlock.py) and renews it while it is connected; but a job outlives its
launcher (the job runs detached on the head node), and a lock nobody renews expires after its ttl, after which
`appliance resume --cluster OTHER` would start a second job of the run beside the first (issue 14). So the launcher
also starts this beat on the head node, detached like the job: every ``interval`` seconds it renews the lock if the
lock is still this job's (never one another job took over, never one already released), and it exits when the job
has ended (its exit status file exists, or its process is gone) or never started. Every STOP_POLL seconds (or each
interval, when shorter) it also looks for a stop request for the job in the store (store/stopask.py: `appliance
cancel RUN` from any machine) and writes the job's STOP file as the node watchdog does, so any job stops with a
checkpoint whoever launched it, custom training loops included.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from pathlib import Path

from ..protocol import job_files
from ..store import stopask
from ..store.checkpoints import open_run
from ..store.objects import StoreCreds
from ..store.runlock import RunLock
from .watchdog import request_stop

START_WAIT = 120.0  # seconds to wait for the job's PID file before deciding it never started


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def job_state(run_dir: str, job_id: str) -> str:
    """"running", "ended" or "starting" (no PID file yet)."""
    _, rc, pid_file = job_files(run_dir, job_id)
    if Path(rc).exists():
        return "ended"
    try:
        pid = int(Path(pid_file).read_text().strip())
    except (OSError, ValueError):
        return "starting"
    return "running" if _alive(pid) else "ended"


def beat(lock: RunLock, run_dir: str, job_id: str, *, wait=time.sleep, clock=time.monotonic) -> int:
    """Renew ``lock`` while the job runs, and release it (if still this job's) when the job has ended: a job whose
    launcher is gone frees its run when it ends, not a ttl later; between two heartbeats, look for a stop request
    (check_stop). Returns the number of heartbeats written."""
    started, written, last = clock(), 0, float("-inf")
    while True:
        state = job_state(run_dir, job_id)
        if state == "ended" or (state == "starting" and clock() - started > START_WAIT):
            break
        try:
            if clock() - last >= lock.interval:
                last = clock()
                if _ours(lock):
                    lock.heartbeat(tempfile.gettempdir())
                    written += 1
            check_stop(lock, run_dir, job_id)
        except Exception as e:  # noqa: BLE001 - the store is down for a while: the ttl allows several misses
            print(f"lockbeat: {type(e).__name__}: {e}", file=sys.stderr, flush=True)
        wait(min(lock.interval, stopask.STOP_POLL))
    try:  # also undoes a heartbeat written just as the job ended and its launcher released the lock
        if _ours(lock):
            lock.release()
    except Exception as e:  # noqa: BLE001 - it expires a ttl after the last heartbeat
        print(f"lockbeat: could not release the lock: {type(e).__name__}: {e}", file=sys.stderr, flush=True)
    return written


def check_stop(lock: RunLock, run_dir: str, job_id: str) -> bool:
    """A stop request for this job in the store, not answered yet (store/stopask.py): the job's STOP file written
    as the node watchdog writes it (rank 0 stops every rank after the same step and commits), and the request
    answered. True when it answered one. A store that does not answer raises (the next look asks again)."""
    req = stopask.asked(lock.cs, job_id)
    if req is None or req.get("answered"):
        return False
    why = request_stop(run_dir, {os.getuid()}, {"reason": str(req.get("reason") or "appliance cancel"),
                                                "deadline": time.time() + 600})
    if why is not None and why != "a stop was already asked for":
        print(f"lockbeat: could not write the job's STOP file in {run_dir}: {why}", file=sys.stderr, flush=True)
        return False
    stopask.answer(lock.cs, req, lock.now())
    print(f"lockbeat: stop asked by {req.get('by')} ({req.get('reason')}): the job's STOP file is written", flush=True)
    return True


def _ours(lock: RunLock) -> bool:
    return lock.follow()


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--url", required=True)
    ap.add_argument("--run", required=True)
    ap.add_argument("--job", required=True)
    ap.add_argument("--run-dir", required=True)
    ap.add_argument("--cluster", default="?")
    ap.add_argument("--head", default="?")
    ap.add_argument("--creds", help="the job's 0600 store-credentials file (never the secret itself)")
    ap.add_argument("--interval", type=float, required=True)
    ap.add_argument("--ttl", type=float, required=True)
    a = ap.parse_args(argv)
    creds = StoreCreds(**json.loads(Path(a.creds).read_text())) if a.creds else None
    lock = RunLock(open_run(a.url, a.run, creds), a.job, cluster=a.cluster, head=a.head, interval=a.interval,
                   ttl=a.ttl)
    lock.started = True  # the job was launched: a controller that takes the run over follows it (flows/takeover.py)
    n = beat(lock, a.run_dir, a.job)
    print(f"lockbeat: job {a.job} ended; {n} heartbeat(s)", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
