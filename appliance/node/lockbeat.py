"""The head node renews the run's lock in the store for as long as the job runs (`python -m appliance.node.lockbeat`).

The launcher takes the run's lock (store/runlock.py) and renews it while it is connected; but a job outlives its
launcher (the job runs detached on the head node), and a lock nobody renews expires after its ttl, after which
`appliance resume --cluster OTHER` would start a second job of the run beside the first (issue 14). So the launcher
also starts this beat on the head node, detached like the job: every ``interval`` seconds it renews the lock if the
lock is still this job's (never one another job took over, never one already released), and it exits when the job
has ended (its exit status file exists, or its process is gone) or never started.
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
from ..store.checkpoints import open_run
from ..store.objects import StoreCreds
from ..store.runlock import RunLock

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
    launcher is gone frees its run when it ends, not a ttl later. Returns the number of heartbeats written."""
    started, written = clock(), 0
    while True:
        state = job_state(run_dir, job_id)
        if state == "ended" or (state == "starting" and clock() - started > START_WAIT):
            break
        try:
            if _ours(lock):
                lock.heartbeat(tempfile.gettempdir())
                written += 1
        except Exception as e:  # noqa: BLE001 - the store is down for a while: the ttl allows several misses
            print(f"lockbeat: {type(e).__name__}: {e}", file=sys.stderr, flush=True)
        wait(lock.interval)
    try:  # also undoes a heartbeat written just as the job ended and its launcher released the lock
        if _ours(lock):
            lock.release()
    except Exception as e:  # noqa: BLE001 - it expires a ttl after the last heartbeat
        print(f"lockbeat: could not release the lock: {type(e).__name__}: {e}", file=sys.stderr, flush=True)
    return written


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
    n = beat(lock, a.run_dir, a.job)
    print(f"lockbeat: job {a.job} ended; {n} heartbeat(s)", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
