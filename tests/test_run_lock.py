"""The store-level lease on a run (store/runlock.py), fast tier against a file:// store: a second job of the run is
refused while the first renews its lock, a dead launcher's lock is taken over after its ttl, two takers at once
leave one winner, and only the holder releases it."""

from appliance.store.checkpoints import CheckpointStore
from appliance.store.runlock import RunLock


def lock(tmp_path, job, clock, **kw):
    return RunLock(CheckpointStore(f"file://{tmp_path / 'store'}/", "r", None), job, cluster=f"c-{job}", head="h",
                   interval=10, ttl=30, now=lambda: clock[0], **kw)


def test_a_live_lock_refuses_a_second_job_and_a_stale_one_is_taken_over(tmp_path):
    clock = [1000.0]
    a, b = lock(tmp_path, "job-a", clock), lock(tmp_path, "job-b", clock)
    assert a.acquire(tmp_path) == (None, None) and a.held
    clock[0] += 25
    holder, _ = b.acquire(tmp_path)
    assert holder["job_id"] == "job-a" and holder["cluster"] == "c-job-a" and not b.held
    a.heartbeat(tmp_path)  # renewed: still alive 25 s later
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
    clock = [1000.0]
    a, b = lock(tmp_path, "job-a", clock), lock(tmp_path, "job-b", clock)
    orig = a._write

    def racing_write(tmp_dir):  # b writes between a's write and a's read-back
        orig(tmp_dir)
        b._write(tmp_dir)

    a._write = racing_write
    holder, _ = a.acquire(tmp_path)
    assert holder["job_id"] == "job-b" and not a.held


def test_a_lock_left_by_a_job_this_machine_knows_ended_is_taken_over_at_once(tmp_path):
    """The store was down when the job ended, so its launcher could not delete the lock; this machine's run record
    says the job ended: an `appliance resume` right after need not wait for the ttl."""
    clock = [1000.0]
    a, b = lock(tmp_path, "job-a", clock), lock(tmp_path, "job-b", clock)
    a.acquire(tmp_path)
    assert b.acquire(tmp_path, ended=lambda jid: False)[0]["job_id"] == "job-a"
    holder, stale = b.acquire(tmp_path, ended=lambda jid: jid == "job-a")
    assert holder is None and stale["job_id"] == "job-a" and b.held
