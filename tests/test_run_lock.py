"""The store-level lease on a run (store/runlock.py), fast tier against a file:// store: a second job of the run is
refused while the first renews its lock, a dead launcher's lock is taken over after its ttl, two takers at once
leave one winner, only the holder renews or releases it, a read that fails is never "no lock", and a job that lost
the lock commits and prunes nothing (issue 49, defect 4)."""

import json

import pytest

from appliance.store import runlock
from appliance.store.checkpoints import CheckpointStore, LockLost, StoreUnavailable
from appliance.store.runlock import RunLock, fence, fenced


def store(tmp_path) -> CheckpointStore:
    return CheckpointStore(f"file://{tmp_path / 'store'}/", "r", None)


def lock(tmp_path, job, clock, **kw):
    return RunLock(store(tmp_path), job, cluster=f"c-{job}", head="h", interval=10, ttl=30, now=lambda: clock[0], **kw)


def test_a_live_lock_refuses_a_second_job_and_a_stale_one_is_taken_over(tmp_path):
    clock = [1000.0]
    a, b = lock(tmp_path, "job-a", clock), lock(tmp_path, "job-b", clock)
    assert a.acquire(tmp_path) == (None, None) and a.held
    clock[0] += 25
    holder, _ = b.acquire(tmp_path)
    assert holder["job_id"] == "job-a" and holder["cluster"] == "c-job-a" and not b.held
    assert a.heartbeat(tmp_path)  # renewed: still alive 25 s later
    clock[0] += 25
    assert b.acquire(tmp_path)[0]["job_id"] == "job-a"
    clock[0] += 10  # 35 s since the last heartbeat: the launcher is dead
    holder, stale = b.acquire(tmp_path)
    assert holder is None and stale["job_id"] == "job-a" and b.held
    a.release()  # not a's any more: left alone
    assert b.read()["job_id"] == "job-b"
    b.release()
    assert b.read() is None


def test_two_takers_at_once_leave_one_winner(tmp_path):
    """The interleaving of the issue: read A, read B, write A, write B. Both saw no lock; both create generation 1;
    the store lets one create it."""
    clock = [1000.0]
    a, b = lock(tmp_path, "job-a", clock), lock(tmp_path, "job-b", clock)
    seen_by_b = b.current()  # B read before A wrote
    assert a.acquire(tmp_path) == (None, None)
    real, calls = b.current, []
    b.current = lambda: seen_by_b if not calls.append(1) and len(calls) == 1 else real()  # stale once, then real
    holder, _ = b.acquire(tmp_path)
    assert holder["job_id"] == "job-a" and not b.held and a.held
    assert RunLock(store(tmp_path), "x", cluster="", head="").read()["job_id"] == "job-a"


def test_a_lock_left_by_a_job_this_machine_knows_ended_is_taken_over_at_once(tmp_path):
    """The store was down when the job ended, so its launcher could not release the lock; this machine's run record
    says the job ended: an `appliance resume` right after need not wait for the ttl."""
    clock = [1000.0]
    a, b = lock(tmp_path, "job-a", clock), lock(tmp_path, "job-b", clock)
    a.acquire(tmp_path)
    assert b.acquire(tmp_path, ended=lambda jid: False)[0]["job_id"] == "job-a"
    holder, stale = b.acquire(tmp_path, ended=lambda jid: jid == "job-a")
    assert holder is None and stale["job_id"] == "job-a" and b.held


def test_a_lock_that_cannot_be_read_is_not_taken(tmp_path, monkeypatch):
    """RunLock.read() turned any error into "no lock", so acquire() wrote over a live holder."""
    clock = [1000.0]
    a, b = lock(tmp_path, "job-a", clock), lock(tmp_path, "job-b", clock)
    a.acquire(tmp_path)
    monkeypatch.setattr(runlock, "READ_WAIT", 0.0)

    def reset(name, write, **kw):
        raise ConnectionResetError("reset by peer")

    b.cs.store.get = reset
    with pytest.raises(StoreUnavailable):
        b.acquire(tmp_path)
    assert not b.held and a.read()["job_id"] == "job-a" and a.heartbeat(tmp_path)


def test_a_job_that_lost_the_lock_neither_renews_it_nor_commits_nor_prunes(tmp_path):
    clock = [1000.0]
    a, b = lock(tmp_path, "job-a", clock), lock(tmp_path, "job-b", clock)
    a.acquire(tmp_path)
    mine = fence(store(tmp_path), "job-a")
    local = tmp_path / "local" / "ckpt-000000010"
    local.mkdir(parents=True)
    (local / "state.data").write_bytes(b"s" * 100)
    mine.upload(local, {"step": 10})  # a's, while it holds the lock
    clock[0] += 60  # a's launcher and head node went quiet past the ttl; b takes over
    assert b.acquire(tmp_path)[0] is None and b.held
    before = json.loads((tmp_path / "store" / "r" / "lock" / f"{b.generation:09d}.json").read_text())
    assert a.heartbeat(tmp_path) is False and not a.held  # it does not write over b's
    assert json.loads((tmp_path / "store" / "r" / "lock" / f"{b.generation:09d}.json").read_text()) == before
    assert fenced(mine, "job-a") == "job-b" and fenced(mine, "job-b") is None
    with pytest.raises(LockLost, match="job job-b holds the run's lock"):
        mine.upload(local, {"step": 20})
    assert [c.step for c in mine.committed()] == [10]  # nothing of step 20 committed
    with pytest.raises(LockLost):
        mine.prune(keep=1)
    b.release()  # b ended: the run is free, but a, which lost it, stays fenced
    assert fenced(mine, "job-a") == "job-b"


def test_generations_only_grow_and_old_ones_are_cleaned(tmp_path):
    clock = [1000.0]
    for i, job in enumerate(("j1", "j2", "j3", "j4")):
        lk = lock(tmp_path, job, clock)
        assert lk.acquire(tmp_path)[0] is None and lk.generation == i + 1
        lk.release()
    assert lock(tmp_path, "x", clock).generations() == [4, 3]
    assert fenced(store(tmp_path), "j1") == "j4"


def test_a_job_without_a_lock_in_the_store_is_not_fenced(tmp_path):
    """A job whose launcher could not take the lock (the store was down then) commits as before."""
    assert fenced(store(tmp_path), "job-a") is None


def test_a_lock_whose_lease_is_over_holds_nothing_back(tmp_path):
    """Issue 52 item 5: `appliance train` killed with -9, the lease ended unattended (its servers deleted, the job
    gone): the first `appliance resume` was refused for up to the ttl by a lock renewed 115 s before. A lock names its
    job's lease, and a lease that is over (by the site's word) frees the run at once."""
    clock = [1000.0]
    a = lock(tmp_path, "job-a", clock, lease_id="lease-1")
    b = lock(tmp_path, "job-b", clock)
    a.acquire(tmp_path)
    assert a.read()["lease_id"] == "lease-1"
    clock[0] += 5  # renewed 5 s ago: alive by its heartbeat
    assert b.acquire(tmp_path, lease_over=lambda lid, site: False)[0]["job_id"] == "job-a"
    holder, stale = b.acquire(tmp_path, lease_over=lambda lid, site: lid == "lease-1")
    assert holder is None and stale["job_id"] == "job-a" and b.held
    # the head node's beat, which did not take the lock, keeps the launcher's lease id in every heartbeat
    head = lock(tmp_path, "job-b", clock)
    assert head.follow() and head.lease_id is None and head.heartbeat(tmp_path)
    c = lock(tmp_path, "job-c", clock, lease_id="lease-2")
    clock[0] += 60
    c.acquire(tmp_path)
    beat = lock(tmp_path, "job-c", clock)
    assert beat.follow() and beat.heartbeat(tmp_path) and beat.read()["lease_id"] == "lease-2"


def test_heartbeats_are_the_stores_time_so_a_machine_minutes_fast_takes_no_live_lock(tmp_path, monkeypatch):
    """Issue 60 item 11: heartbeats were written and judged by each machine's own clock, so a machine 300 s fast
    took a live lock. Both sides now read the store's clock (its Date header; here the store's ``clock``)."""
    import time as _time

    store_time = [5000.0]
    a_cs, b_cs = store(tmp_path), store(tmp_path)
    for cs in (a_cs, b_cs):
        cs.store.clock = lambda: store_time[0]
    a = RunLock(a_cs, "job-a", cluster="c-a", head="h", interval=10, ttl=30)
    b = RunLock(b_cs, "job-b", cluster="c-b", head="h", interval=10, ttl=30)
    assert a.acquire(tmp_path) == (None, None)
    assert a.read()["heartbeat"] == 5000.0  # the store's time, not this machine's
    real = _time.time
    monkeypatch.setattr(runlock.time, "time", lambda: real() + 300)  # B's machine runs 5 minutes fast
    store_time[0] += 20
    holder, _ = b.acquire(tmp_path)
    assert holder is not None and holder["job_id"] == "job-a" and not b.held and b.age(holder) == 20
    store_time[0] += 31
    assert b.acquire(tmp_path)[0] is None and b.held  # 31 s of the store's time since a's heartbeat: a is gone


def test_the_stores_clock_is_its_date_header():
    from appliance.store.base import date_header

    assert date_header("Wed, 02 Dec 2026 12:00:00 GMT") == 1796212800.0
    assert abs(date_header(None) - __import__("time").time()) < 5  # no header: this machine's clock


def test_a_lock_handed_a_renewed_store_reads_the_stores_clock_with_it(tmp_path):
    """The controller renews its store credentials when the store refuses them (flows/control.py) and hands the
    new store to its lock. The lock's clock (the store's Date header) was still read with the first store, so once
    the first token expired (a day on Chameleon) every heartbeat and the release were refused (401): the lock went
    stale under a live controller, and a run's end left it to expire."""
    from appliance.store.base import StoreRefused

    first = store(tmp_path)
    held = RunLock(first, "ctl", cluster="c", head="h")
    assert held.acquire(tmp_path) == (None, None)

    def expired():
        raise StoreRefused("Swift refused access to container 'ckpts' (401): the token may have expired")
    first.store.clock = expired
    held.cs = store(tmp_path)  # the renewed credentials' store
    assert held.heartbeat(tmp_path)
    assert held.read()["job_id"] == "ctl"
    held.release(tmp_path)
    assert held.read() is None and held.current()[1]["released"]


def test_taken_by_names_the_lock_that_took_the_run_even_one_written_over_the_holders_own_generation(tmp_path):
    """What a controller asks before each write (flows/control.py): None while the newest generation is its own;
    the taker's lock once another took it, a newer generation or (a store that ignores If-None-Match: RGW 16) the
    holder's own generation written over."""
    clock = [1000.0]
    a, b = lock(tmp_path, "job-a", clock), lock(tmp_path, "job-b", clock)
    a.acquire(tmp_path)
    assert a.taken_by() is None and a.lost_to is None
    over = {"job_id": "job-b", "heartbeat": clock[0]}  # b's write over a's generation, as RGW lets it land
    b.cs.put_text(f"lock/{a.generation:09d}.json", json.dumps(over), tmp_path)
    assert a.taken_by()["job_id"] == "job-b" and a.lost_to["job_id"] == "job-b"
    clock[0] += 60
    assert b.acquire(tmp_path)[0] is None and a.taken_by()["job_id"] == "job-b" and not a.heartbeat(tmp_path)
