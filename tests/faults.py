"""The fault matrix of issue 49: one transient store error injected at each store call of commit, prune, restore,
lock acquire and heartbeat, level 2 (checkpoints) and level 3 (synced files). After each run, with the store well
again, nothing committed is lost or written over, nothing wrong was reported as success, and a failure is an
ApplianceError (one line) or a store error the caller retries (never "not there").

``matrix(store_for, faults, root)`` runs every scenario for every position of the fault (or every other one),
each in a run of its own (``store_for(run)``: a CheckpointStore of that run); ``faults.arm(k)`` makes the k-th store
call from now fail (``arm(None)``: count only), ``faults.disarm()`` stops failing and counting, ``faults.counted`` is
how many calls were counted. The fast tier drives it with a file:// store whose calls raise
(tests/test_no_overwrite.py), the e2e tier through an HTTP proxy answering 503 or closing the connection, on Swift
and Ceph RGW, through both APIs (tests/test_store_guarantees.py)."""

from __future__ import annotations

import hashlib
import tempfile
from collections.abc import Callable
from pathlib import Path

from appliance.node.filesync import Syncer
from appliance.store.checkpoints import CheckpointStore
from appliance.store.filesync import FileSet
from appliance.store.runlock import RunLock, fence


def _ckpt(root: Path, step: int) -> Path:
    d = Path(tempfile.mkdtemp(dir=root)) / f"ckpt-{step:09d}"
    d.mkdir()
    (d / "state.data").write_bytes(hashlib.sha256(str(step).encode()).digest() * 100)
    (d / "meta.json").write_text(f'{{"step": {step}}}')
    return d


def _commit(cs: CheckpointStore, root: Path, step: int) -> None:
    cs.upload(_ckpt(root, step), {"step": step})
    cs.prune(keep=1)


def _attempt(fn: Callable) -> tuple[bool, BaseException | None]:
    """(done, the error): an ApplianceError (one line), or the store's own error that the caller says in one line
    and retries at its next round (a prune's listing: a reset, swiftclient's, botocore's or httpget's 5xx)."""
    try:
        fn()
        return True, None
    except AssertionError:
        raise
    except Exception as e:  # noqa: BLE001
        return False, e


def scenario_commit(make, faults, root: Path, k: int | None) -> str:
    """A committed checkpoint (step 10), then commit step 20 and prune with keep=1."""
    cs = make()
    _commit(cs, root, 10)
    faults.arm(k)
    ok, err = _attempt(lambda: _commit(cs, root, 20))
    faults.disarm()
    good, problems = make().newest_good()
    assert good is not None, f"fault at call {k}: nothing verifies any more ({problems}; {err})"
    if ok:
        assert good.step == 20, f"fault at call {k}: the commit said success, the newest good is {good.name}"
    assert good.step in (10, 20)
    return "ok" if ok else type(err).__name__


def scenario_lock(make, faults, root: Path, k: int | None) -> str:
    """Job a holds the lock; job b tries while it is alive (refused), a renews it, then a goes quiet past the ttl
    and b takes it over: at every step one holder, and the one that lost it is fenced."""
    cs = make()
    clock = [1000.0]
    a = RunLock(cs, "job-a", cluster="a", head="ha", ttl=30, now=lambda: clock[0])
    b = RunLock(make(), "job-b", cluster="b", head="hb", ttl=30, now=lambda: clock[0])
    assert a.acquire(root)[0] is None
    faults.arm(k)
    refused = _attempt(lambda: b.acquire(root))
    beat = _attempt(lambda: a.heartbeat(root))
    clock[0] += 60
    took = _attempt(lambda: b.acquire(root))
    faults.disarm()
    assert refused[0] is False or not b.held or took[0], f"fault at call {k}: b took a live lock"
    holder = RunLock(make(), "x", cluster="", head="").read()
    assert holder is not None and holder["job_id"] in ("job-a", "job-b"), (k, holder)
    believers = [lk.job_id for lk in (a, b) if lk.held and lk.heartbeat(root)]
    assert believers in ([], [holder["job_id"]]), f"fault at call {k}: {believers} believe they hold it"
    fenced_out = fence(make(), "job-a" if holder["job_id"] == "job-b" else "job-b")
    assert fenced_out.fence() == holder["job_id"]
    return "ok" if beat[0] and took[0] else "failed once"


def scenario_files(make, faults, root: Path, k: int | None) -> str:
    """Level 3: a synced manifest, then a sync with a new file and prune with keep=1; then a restore."""
    cs = make()
    fs = FileSet.of(cs)
    work = Path(tempfile.mkdtemp(dir=root))
    s = Syncer(work, fs, every_s=60, stop_file=None, exclude=set(), keep=1)
    (work / "model-epoch-10.h5").write_bytes(b"a" * 300)
    s.sync(), s.sync()
    (work / "model-epoch-20.h5").write_bytes(b"b" * 300)
    s.sync()
    faults.arm(k)
    body = s.sync()  # the syncer says a failure in one line and returns None
    new = Path(tempfile.mkdtemp(dir=root))
    restored = _attempt(lambda: Syncer(new, fs, every_s=60, stop_file=None, exclude=set()).restore())
    faults.disarm()
    good = fs.newest_good()
    assert good is not None, f"fault at call {k}: no synced manifest verifies"
    if body is not None:
        assert "model-epoch-20.h5" in good["files"], f"fault at call {k}: the sync said committed, then lost"
    assert "model-epoch-10.h5" in good["files"]
    if restored[0]:
        assert (new / "model-epoch-10.h5").read_bytes() == b"a" * 300, f"fault at call {k}: restored wrong bytes"
    return "ok" if body is not None and restored[0] else "failed once"


SCENARIOS = {"commit": scenario_commit, "lock": scenario_lock, "files": scenario_files}


def matrix(store_for: Callable[[str], CheckpointStore], faults, root: Path, *, first: int = 1,
           every: int = 1) -> dict[str, list[str]]:
    """Every scenario once without a fault (to count its store calls), then once with a fault at each call (at
    calls ``first``, ``first + every``, ...), each time in a run of its own (``store_for(run)``: that run's
    CheckpointStore, a new one at each call)."""
    out = {}
    for name, run in SCENARIOS.items():
        run(lambda: store_for(f"{name}-clean"), faults, root, None)
        n = faults.counted
        assert n > 0, f"{name}: no store call counted"
        out[name] = [run(lambda k=k: store_for(f"{name}-{k}"), faults, root, k) for k in range(first, n + 1, every)]
    return out


class CallFaults:
    """Faults for in-process stores: every store ``make`` wraps counts its calls, and the armed one raises a reset."""

    METHODS = ("list", "get", "put", "create", "delete")

    def __init__(self):
        self.counted, self.at, self.on = 0, None, False
        self.failed: list[str] = []

    def arm(self, k: int | None) -> None:
        self.counted, self.at, self.on = 0, k, True

    def disarm(self) -> None:
        self.at, self.on = None, False

    def wrap(self, cs: CheckpointStore) -> CheckpointStore:
        for m in self.METHODS:
            real = getattr(cs.store, m)

            def call(*a, _real=real, _m=m, **kw):
                if self.on:
                    self.counted += 1
                    if self.counted == self.at:
                        self.failed.append(_m)
                        raise ConnectionResetError(f"injected at call {self.at} ({_m})")
                got = _real(*a, **kw)
                return list(got) if _m == "list" else got  # a listing's generator fails where it is drawn
            setattr(cs.store, m, call)
        return cs
