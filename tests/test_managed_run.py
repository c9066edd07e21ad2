"""`appliance run SPEC` (flows.run_managed), the loop's decisions in the fast tier: what follows a job that ended
for its lease, one that failed, one its user stopped. The jobs are stand-ins; the e2e tier runs the loop for real
across a lease end (tests/test_checkpoint.py::test_a_managed_run_goes_on_across_the_lease_end_bit_exactly)."""

import pytest

from appliance import flows
from appliance.protocol import EXIT_STOPPED
from appliance.sites import open_site
from appliance.train.launch import JobResult
from conftest import write_spec


def _job(rc=0, *, lease_end=False, stopped=None, failure=None, n=[0]):  # noqa: B006 - a counter for job ids
    n[0] += 1
    return JobResult(job_id=f"j{n[0]}", exit_code=rc, world_size=2, rank_hosts=["a", "b"], failure=failure,
                     stopped=stopped, lease_end=lease_end)


@pytest.fixture
def scripted(tmp_path, monkeypatch):
    """run_managed with its first job and every resume answered from a script: ``use(first, *resumes)``; returns
    the resumes' keyword arguments as they were asked for."""
    spec = write_spec(tmp_path, "python x.py", code=tmp_path, name="mr")
    asked = []

    def use(first, *resumes):
        todo = list(resumes)
        monkeypatch.setattr(flows, "_first_job", lambda ctx, out: first)

        def resume(run, **kw):
            assert run == "mr"
            asked.append(kw)
            return todo.pop(0)

        monkeypatch.setattr(flows, "resume", resume)
        return flows.run_managed(str(spec), max_restarts=1), asked
    return use


def test_each_lease_end_continues_on_a_new_lease_until_the_job_finishes(scripted, said):
    stop = {"step": 40, "reason": "lease end (vendordata)", "committed": True}
    cut = _job(1, lease_end=True, failure="the lease ended at 2026-12-01 10:00 UTC before the job finished")
    res, asked = scripted(_job(EXIT_STOPPED, lease_end=True, stopped=stop), cut, _job(0))
    assert res.exit_code == 0
    assert [kw["new_lease"] for kw in asked] == [True, True]
    assert sum("goes on on a new lease" in m for m in said) == 2


def test_a_users_stop_ends_the_run_there(scripted, said):
    stop = {"step": 40, "reason": "SIGTERM to appliance train", "committed": True}
    res, asked = scripted(_job(EXIT_STOPPED, stopped=stop))
    assert res.exit_code == EXIT_STOPPED and not asked
    assert any("stops here" in m and "appliance run" in m for m in said)


def test_a_failed_job_is_resumed_max_restarts_times_in_a_row_then_fails_the_run(scripted, said):
    crash = dict(failure="rank 1 on b exited with status 3")
    res, asked = scripted(_job(3, **crash), _job(3, **crash))
    assert res.exit_code == 3 and res.failure == crash["failure"]
    assert len(asked) == 1 and not asked[0].get("new_lease")  # on the same cluster, from the newest commit
    assert any("restart 1 of 1" in m for m in said)


def test_a_lease_end_between_two_failures_starts_the_count_again(scripted):
    crash = dict(failure="rank 1 on b exited with status 3")
    stop = {"step": 40, "reason": "lease end (vendordata)", "committed": True}
    res, asked = scripted(_job(3, **crash), _job(EXIT_STOPPED, lease_end=True, stopped=stop), _job(3, **crash),
                          _job(0))
    assert res.exit_code == 0 and [bool(kw.get("new_lease")) for kw in asked] == [False, True, False]


def test_a_run_that_had_finished_is_not_run_again(scripted):
    res, asked = scripted(None)
    assert res is None and not asked


def test_committed_work_is_resumed_not_started_over(tmp_path, monkeypatch):
    """`appliance run SPEC` again, after its controller went away: the run's committed checkpoints are resumed (a
    fresh job over them would be refused)."""
    from appliance.store.checkpoints import CheckpointStore

    spec = flows.check(str(write_spec(tmp_path, "python x.py", code=tmp_path, name="mr2",
                                      extra=f"checkpoint: {{url: 'file://{tmp_path}/ck/'}}\n")))
    ctx = flows.RunContext(spec, open_site("local"))
    assert not flows._has_committed_work(ctx)  # no container yet: a new run
    monkeypatch.setattr(CheckpointStore, "committed", lambda self: ["ckpt-000000040"])
    assert flows._has_committed_work(flows.RunContext(spec, open_site("local")))

    def down(self):
        raise ConnectionError("[Errno 111] Connection refused")

    monkeypatch.setattr(CheckpointStore, "committed", down)
    with pytest.raises(ConnectionError):  # a store that does not answer is not "no work"
        flows._has_committed_work(flows.RunContext(spec, open_site("local")))


def test_run_of_a_bad_spec_is_one_line_and_exit_2(tmp_path):
    from click.testing import CliRunner

    from appliance.cli import main

    bad = tmp_path / "bad.yaml"
    bad.write_text("name: Bad Name\ntrain: {code: ., command: python x.py}\n")
    r = CliRunner().invoke(main, ["run", str(bad)])
    assert r.exit_code == 2, r.output
    assert len(r.output.strip().splitlines()) == 1 and r.output.startswith("error: ") and "name" in r.output
