"""A lease on a run, in the object store beside its checkpoints: ``URL/RUN/LOCK.json``.

Two jobs of one run would share its checkpoints (each pruning the other's) and its synced files. The head node's
own lock (train/launch.py ``check_run_free``) catches two jobs on one cluster; this one catches two clusters (two
leases, two machines running `appliance train`). The lock holds the job id, its cluster and head node, and a
heartbeat the launcher renews every ``interval`` seconds while the job runs. A job is refused while another job's
heartbeat is younger than its ``ttl``; a lock whose heartbeat is older (the launcher died) is taken over, and said
so. Object stores have no compare-and-swap that Swift, S3 and RGW all offer, so a taker writes and reads back: of two
launchers that write at the same moment, the one that reads another's job id back gives way.
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable

from .checkpoints import CheckpointStore

LOCK = "LOCK.json"
INTERVAL = 60.0  # seconds between heartbeats
TTL = 300.0  # a heartbeat older than this is a dead launcher's


class RunLock:
    def __init__(self, cs: CheckpointStore, job_id: str, *, cluster: str, head: str, interval: float = INTERVAL,
                 ttl: float = TTL, now: Callable[[], float] = time.time):
        self.cs, self.job_id, self.cluster, self.head = cs, job_id, cluster, head
        self.interval, self.ttl, self.now = interval, ttl, now
        self.held = False

    def read(self) -> dict | None:
        try:
            return self.cs.read_json(LOCK)
        except Exception:  # noqa: BLE001 - absent (or unreadable, which a taker overwrites)
            return None

    def _write(self, tmp_dir) -> None:
        body = {"job_id": self.job_id, "cluster": self.cluster, "head": self.head, "heartbeat": self.now(),
                "ttl": self.ttl}
        self.cs.put_text(LOCK, json.dumps(body, sort_keys=True), tmp_dir)

    def acquire(self, tmp_dir, ended: Callable[[str], bool] = lambda job_id: False) -> tuple[dict | None, dict | None]:
        """(holder, taken_over): ``holder`` is the live lock of another job (the job must not start), else None and
        the lock is ours; ``taken_over`` is the stale lock we replaced, if any. ``ended(job_id)``: this machine knows
        that job has ended (its run record says so: its launcher could not delete the lock, the store being down)."""
        old = self.read()
        if old and old.get("job_id") != self.job_id and self.alive(old, ended):
            return old, None
        self._write(tmp_dir)
        back = self.read()
        if back is None or back.get("job_id") != self.job_id:  # another launcher wrote at the same moment
            return back or old, None
        self.held = True
        stale = old if old and old.get("job_id") != self.job_id else None
        return None, stale

    def alive(self, lock: dict, ended: Callable[[str], bool] = lambda job_id: False) -> bool:
        """A lock whose job has not ended (as far as ``ended`` knows) and renewed it within its ttl."""
        return not ended(str(lock.get("job_id"))) and \
            self.now() - float(lock.get("heartbeat", 0)) < float(lock.get("ttl", self.ttl))

    def heartbeat(self, tmp_dir) -> None:
        if self.held:
            self._write(tmp_dir)

    def release(self) -> None:
        """Delete the lock if it is still ours."""
        if not self.held:
            return
        cur = self.read()
        if cur is None or cur.get("job_id") == self.job_id:
            self.cs.store.delete(self.cs.prefix + LOCK)
        self.held = False
