"""A lease on a run, in the object store beside its checkpoints: ``URL/RUN/lock/<generation>.json``.

Two jobs of one run would share its checkpoints (each pruning the other's) and its synced files. The head node's
own lock (train/headjob.py ``check_run_free``) catches two jobs on one cluster; this one catches two clusters (two
leases, two machines running `appliance train`). A lock holds the job id, its cluster and head node, and a
heartbeat renewed every ``interval`` seconds while the job runs. A job is refused while another job's heartbeat is
younger than its ``ttl``; a lock whose heartbeat is older (its job's launcher and head node are gone) is taken over,
and said so.

The rules:
- **taking** the lock creates the next generation's object with a create-only write (``Store.create``:
  ``If-None-Match: *`` on Swift and S3, link(2) on a directory), so of two takers exactly one wins, and reads it
  back. Ceph RGW 16.2's Swift API ignores ``If-None-Match`` on PUT (measured: tests/test_store_guarantees.py; newer
  Ceph reads it, src/rgw/rgw_rest_swift.cc): there two takers of one instant may both write, the later write stands,
  and the earlier taker finds another job's id in its generation at its next heartbeat or commit and stops there;
- **the holder** is the job of the newest generation; a heartbeat rewrites only the job's own generation (no other
  writer has that name), and only while no newer generation exists;
- **a job that lost the lock** (a newer generation is another job's) commits and prunes nothing: ``fenced`` is asked
  before every checkpoint commit and prune (node/checkpointer.py) and synced-files commit (node/filesync.py); a
  managed run's controller asks ``taken_by`` before each write of its state and each lease it asks for;
- **release** marks the job's generation released instead of deleting it: generations only grow, so a job that lost
  the lock can never read it as its own again. The generations older than the one before the taker's are deleted.
- a read that fails is retried and then raised (StoreUnavailable), never taken for "no lock";
- **one clock**: a heartbeat is the store's time when it was written (``Store.clock``, its Date header), and a
  lock's age is the store's time now minus it, so a machine whose clock is minutes fast neither takes a live lock
  nor keeps a dead one (the machines that write and judge heartbeats are the launcher, the head node and the
  controller, on any host).
"""

from __future__ import annotations

import json
import re
import time
from collections.abc import Callable

from .checkpoints import CheckpointStore, retrying

LOCK = "lock/"
GENERATION = re.compile(r"^lock/(\d{9,})\.json$")
INTERVAL = 60.0  # seconds between heartbeats
TTL = 300.0  # a heartbeat older than this is a dead launcher's
READ_WAIT = 60.0  # seconds a failing read of the lock is retried before the store counts as down


class RunLock:
    def __init__(self, cs: CheckpointStore, job_id: str, *, cluster: str, head: str, interval: float = INTERVAL,
                 ttl: float = TTL, now: Callable[[], float] | None = None, lease_id: str | None = None,
                 lease_site: str | None = None, launcher: str | None = None):
        self.cs, self.job_id, self.cluster, self.head = cs, job_id, cluster, head
        self.interval, self.ttl = interval, ttl
        # the store's clock through ``self.cs`` as it is at each read: a controller hands its lock a new store when
        # it renews its credentials (flows/control.py), and the first one's token expires
        self.now = now or (lambda: retrying(self.cs.store.clock, what="read the store's clock",
                                            until=time.time() + READ_WAIT))
        self.lease_id = lease_id  # the job's lease: once it is over, its servers are gone and so is the job
        self.lease_site = lease_site  # its site, when not the run's own (Blazar's lease ids are per site)
        # the managed run's controller that launched the job (its id, host:pid:...): a controller that takes the run
        # over can tell a job its dead predecessor locked and never started (flows/managed.py)
        self.launcher = launcher
        # the job was launched (its launcher's word once it started it, and the head node's beat's): a lock without
        # it whose launcher is a dead controller locked a job that never started (flows/takeover.py)
        self.started = False
        self.held = False
        self.generation = 0  # ours, while held
        self.lost_to: dict | None = None  # the lock that took the run from this holder, once seen (taken_by)

    @staticmethod
    def _rel(gen: int) -> str:
        return f"{LOCK}{gen:09d}.json"

    def _name(self, gen: int) -> str:
        return self.cs.prefix + self._rel(gen)

    def generations(self) -> list[int]:
        """Every generation in the store, newest first (a store with no container yet: none)."""
        def listed():
            try:
                return list(self.cs.store.list(self.cs.prefix + LOCK))
            except FileNotFoundError:
                return []
        gens = [int(m.group(1)) for o in retrying(listed, what="list the run's lock", until=time.time() + READ_WAIT)
                if (m := GENERATION.match(o.name[len(self.cs.prefix):]))]
        return sorted(gens, reverse=True)

    def current(self) -> tuple[int, dict] | None:
        """(generation, body) of the newest generation; None when the run has none. A generation deleted between
        the listing and its read (a taker's cleanup) is listed again; a body that is not JSON counts as a lock
        with no heartbeat (stale)."""
        for _ in range(3):
            gens = self.generations()
            if not gens:
                return None
            try:
                return gens[0], retrying(lambda: self.cs.read_json(self._rel(gens[0])),
                                         what="read the run's lock", until=time.time() + READ_WAIT)
            except FileNotFoundError:
                continue
            except json.JSONDecodeError:
                return gens[0], {"heartbeat": 0}
        return None

    def read(self) -> dict | None:
        """The lock of the job that holds the run, None when no job does (none ever did, or the last released it)."""
        cur = self.current()
        return None if cur is None or cur[1].get("released") else cur[1]

    def _body(self, released: bool = False) -> bytes:
        body = {"job_id": self.job_id, "cluster": self.cluster, "head": self.head, "heartbeat": self.now(),
                "ttl": self.ttl, **({"lease_id": self.lease_id} if self.lease_id else {}),
                **({"lease_site": self.lease_site} if self.lease_site else {}),
                **({"launcher": self.launcher} if self.launcher else {}),
                **({"started": True} if self.started else {}),
                **({"released": True} if released else {})}
        return json.dumps(body, sort_keys=True).encode()

    def _rewrite(self, tmp_dir, released: bool = False) -> None:
        self.cs.put_text(self._rel(self.generation), self._body(released).decode(), tmp_dir)

    def acquire(self, tmp_dir, ended: Callable[[str], bool] = lambda job_id: False,
                lease_over: Callable[[str, str | None], bool] = lambda lease_id, site: False) -> tuple[dict | None, dict | None]:
        """(holder, taken_over): ``holder`` is the live lock of another job (the job must not start), else None and
        the lock is ours; ``taken_over`` is the stale lock we replaced, if any. ``ended(job_id)``: this machine knows
        that job has ended (its run record says so: its launcher could not release the lock, the store being down)."""
        cur = self.current()
        old = cur[1] if cur else None
        if old and old.get("job_id") != self.job_id and self.alive(old, ended, lease_over):
            return old, None
        gen = cur[0] + 1 if cur else 1
        made = lambda: self.cs.store.create(self._name(gen), self._body())  # noqa: E731
        try:
            won = made()
        except FileNotFoundError:  # no container yet: make it, then create
            self.cs.ensure_container()
            won = made()
        # read back: another taker created this generation first (the store said 412), or wrote over ours (a
        # store that ignores If-None-Match: RGW 16's Swift API)
        back = self.current()
        if not won or back is None or back[0] != gen or back[1].get("job_id") != self.job_id:
            return (back[1] if back else None) or old, None
        self.held, self.generation = True, gen
        for g in self.generations():
            if g < gen - 1:  # keep the one we replaced (a late reader finds it), delete the rest
                try:
                    self.cs.store.delete(self._name(g))
                except Exception:  # noqa: BLE001 - the next taker deletes it
                    pass
        stale = old if old and old.get("job_id") != self.job_id and not old.get("released") else None
        return None, stale

    def alive(self, lock: dict, ended: Callable[[str], bool] = lambda job_id: False,
              lease_over: Callable[[str, str | None], bool] = lambda lease_id, site: False) -> bool:
        """A lock not released, whose job has not ended (as far as ``ended`` knows), whose lease is not over (as far
        as ``lease_over`` knows: at a lease end every server is deleted, so its job is gone; issue 52) and that was
        renewed within its ttl."""
        return not lock.get("released") and not ended(str(lock.get("job_id"))) and \
            not (lock.get("lease_id") and lease_over(str(lock["lease_id"]), lock.get("lease_site"))) and \
            self.age(lock) < float(lock.get("ttl", self.ttl))

    def age(self, lock: dict) -> float:
        """Seconds since ``lock``'s last heartbeat, by the store's clock."""
        return self.now() - float(lock.get("heartbeat", 0))

    def follow(self) -> bool:
        """Whether the run's newest generation is this job's (the head node's beat, which did not take the lock
        itself, learns its generation here)."""
        cur = self.current()
        self.held = cur is not None and cur[1].get("job_id") == self.job_id and not cur[1].get("released")
        self.generation = cur[0] if self.held else 0
        if self.held:
            self.lease_id = self.lease_id or cur[1].get("lease_id")  # the launcher's word, kept in each heartbeat
            self.lease_site = self.lease_site or cur[1].get("lease_site")
            self.launcher = self.launcher or cur[1].get("launcher")
            self.started = self.started or bool(cur[1].get("started"))
        return self.held

    def taken_by(self) -> dict | None:
        """None while the run's newest generation is this holder's own, live one; else the lock that holds the run
        instead (remembered in ``lost_to``; ``{}`` when the run has none left). What a holder asks before each write
        that only the holder may make (a controller's state and leases: flows/control.py). Its cost: one listing of
        ``lock/`` and one GET of the newest generation (a few hundred bytes); the body is read, not only the name,
        because a store that ignores If-None-Match (RGW 16) lets a taker write over this holder's own generation.
        A read that fails raises StoreUnavailable: neither held nor lost."""
        cur = self.current()
        if cur is not None and cur[0] == self.generation and cur[1].get("job_id") == self.job_id \
                and not cur[1].get("released"):
            return None
        self.lost_to = cur[1] if cur else {}
        return self.lost_to

    def heartbeat(self, tmp_dir) -> bool:
        """Renew the lock if it is still ours: False (and no write) once a newer generation exists."""
        if not self.held:
            return False
        if self.taken_by() is not None:
            self.held = False
            return False
        self._rewrite(tmp_dir)
        return True

    def release(self, tmp_dir=None) -> None:
        """Mark our generation released, if it is still the newest (a newer one is another job's: left alone)."""
        if not self.held:
            return
        cur = self.current()
        if cur is not None and cur[0] == self.generation and cur[1].get("job_id") == self.job_id:
            import tempfile

            self._rewrite(tmp_dir or tempfile.gettempdir(), released=True)
        self.held = False


def fenced(cs: CheckpointStore, job_id: str) -> str | None:
    """The job that holds the run instead of ``job_id`` (this job lost the lock: it must commit and prune nothing),
    else None (the lock is this job's, or the run has none: a job whose launcher could not take it). A store that
    does not answer raises StoreUnavailable: the commit waits for it, as it would for its own writes."""
    cur = RunLock(cs, job_id, cluster="", head="").current()
    if cur is None or cur[1].get("job_id") == job_id and not cur[1].get("released"):
        return None
    return str(cur[1].get("job_id") or "another job")


def fence(cs: CheckpointStore, job_id: str | None) -> CheckpointStore:
    """``cs`` with its commits and prunes fenced by the run's lock for job ``job_id`` (none without a job id)."""
    if job_id:
        cs.fence = lambda: fenced(cs, job_id)
    return cs
