"""A controller that takes a managed run over (flows/takeover.py), fast tier: a job whose launcher, a controller of
this machine, was killed after it took the run's lock and before the job started is taken over at once, not after
the lock's ttl (300 s of paid, idle lease); a job that runs on, or a head that cannot be asked, is waited for; a
handover the killed controller began is finished with its downtime on the timeline. The kill points the e2e fault
matrix uses (appliance/killpoints.py). The e2e tier kills a controller at those points across a real handover
(tests/test_lease_end.py::test_a_controller_killed_mid_handover_is_started_again_and_leaves_no_orphan_lease)."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import tempfile

import pytest

from appliance import flows
from appliance.checkpoint import runs
from appliance.checkpoint.job import JobCheckpoints, live_job
from appliance.flows import managed, takeover
from appliance.sites import open_site
from appliance.store.runlock import RunLock
from appliance.train import headjob
from conftest import write_spec


def _spec(tmp_path, name="tk"):
    return flows.check(str(write_spec(tmp_path, "python x.py", code=tmp_path, name=name,
                                      extra=f"checkpoint: {{url: 'file://{tmp_path}/ck/'}}\n")))


def _gone_controller() -> str:
    """The id of a controller of this machine whose process has ended (as `kill -9` leaves it, once reaped)."""
    p = subprocess.Popen([sys.executable, "-c", "pass"])
    p.wait()
    return f"{socket.gethostname()}:{p.pid}:0.abc:{runs.machine_tag()}"


@pytest.fixture
def locked(tmp_path, monkeypatch):
    """A run whose lock a job holds (renewed now), launched by ``launcher``; the head answers ``head["runs"]``.
    Each test's run has a name of its own (the machine's run records live as long as the session)."""
    spec = _spec(tmp_path, f"tk{os.urandom(3).hex()}")
    ctx = flows.RunContext(spec, open_site("local"))
    control = managed.Control(spec, None, poll=0.01)
    control.take()
    head = {"runs": False, "asked": 0, "ended": None}

    def job_runs(cluster, run):
        head["asked"] += 1
        return head["runs"]

    monkeypatch.setattr(headjob, "job_runs", job_runs)
    monkeypatch.setattr(headjob, "job_end", lambda cluster, run, job_id: head["ended"])
    monkeypatch.setattr(takeover, "find_cluster", lambda name: type("Cl", (), {"name": name})())
    monkeypatch.setattr(takeover, "_withdraw_job_creds", lambda ctx, job_id: head.setdefault("withdrawn", job_id))

    def lock(launcher: str | None):
        ctx.checkpoints.ensure_container()
        held, _ = RunLock(ctx.checkpoints, f"{spec.name}-1", cluster="tk", head="n0", launcher=launcher).acquire(
            tempfile.gettempdir())
        assert held is None
        return live_job(spec, ctx.checkpoints, ctx.site)
    yield spec, ctx, control, head, lock
    control.close("finished")


def test_a_job_its_killed_controller_locked_and_never_started_is_taken_over_at_once(locked, monkeypatch, said):
    spec, ctx, control, head, lock = locked
    job = lock(_gone_controller())
    assert job is not None and job["launcher"]  # the launcher's id is in the run's lock
    looks = []

    def look(ctx):
        looks.append(1)
        if len(looks) > 20:
            pytest.fail("waited for the lock of a job that never started, as for one that runs")
        return real(ctx)
    real = takeover.live_job
    monkeypatch.setattr(takeover, "live_job", look)
    takeover.wait_for_live_job(ctx, control)  # returns at once: no ttl waited out
    assert head["asked"] == 1
    assert live_job(spec, ctx.checkpoints, ctx.site) is None  # ended, as far as this machine knows
    events = [e["event"] for e in control.state["events"]]
    assert "job not started" in events and "waiting" not in events
    assert [j["status"] for j in runs.load(spec.name)["jobs"]] == ["not started"]
    assert head["withdrawn"] == f"{spec.name}-1"  # its store credential goes
    assert any("never started" in m and "taking the run over now" in m for m in said)
    # the next job takes its lock over (ended here), and says so
    taker = RunLock(ctx.checkpoints, "tk-2", cluster="tk", head="n0")
    holder, stale = taker.acquire(tempfile.gettempdir(), ended=lambda jid: runs.load(spec.name) and any(
        j["job_id"] == jid and j["status"] == "not started" for j in runs.load(spec.name)["jobs"]))
    assert holder is None and stale["job_id"] == f"{spec.name}-1"


@pytest.mark.parametrize("case", ["runs on its head", "head does not answer", "launcher alive", "no launcher",
                                  "ended on its head"])
def test_a_job_that_may_run_is_waited_for(locked, monkeypatch, case):
    """A job that runs (its launcher died, it goes on detached), a head that cannot be asked, a launcher that is not
    known gone (another machine's, or alive), a job `appliance train` launched, a job that ran to its end with no
    launcher (its exit status on the head; its lock is still there until the head's beat releases it): the lock
    decides, as before, and nothing is marked "not started"."""
    spec, ctx, control, head, lock = locked
    head["runs"] = {"runs on its head": True, "head does not answer": None}.get(case, False)
    head["ended"] = {"rc": 0, "stopped": None, "resumed": None} if case == "ended on its head" else None
    launcher = {"launcher alive": control.id.replace(control.id.split(":")[1], "1", 1), "no launcher": None}.get(
        case, _gone_controller())
    job = lock(launcher)
    looks = [job, job, None]  # the job ends at the third look
    monkeypatch.setattr(takeover, "live_job", lambda ctx: looks.pop(0))
    takeover.wait_for_live_job(ctx, control)
    assert looks == []
    events = [e["event"] for e in control.state["events"]]
    assert "waiting" in events and "job not started" not in events
    assert (runs.load(spec.name) or {}).get("jobs", []) == []


def test_the_store_credential_of_a_job_that_never_started_is_deleted_and_nothing_else():
    deleted = []

    class Cloud:
        def list_app_creds(self):
            return [{"id": "1", "name": "appliance-r-r-7-0a1b2c"}, {"id": "2", "name": "appliance-r-r-70-0a1b2c"},
                    {"id": "3", "name": "appliance-run-r-x"}, {"id": "4", "name": "appliance-r2-r-7-0a1b2c"},
                    {"id": "5", "name": "appliance-r-r-7"}]

        def delete_app_cred(self, cred_id):
            deleted.append(cred_id)
    ctx = type("Ctx", (), {"spec": type("S", (), {"name": "r"})(), "site": type("Si", (), {"cloud": Cloud()})()})()
    takeover._withdraw_job_creds(ctx, "r-7")
    assert deleted == ["1"]


def test_the_launcher_id_is_kept_by_the_heads_heartbeat_and_written_by_a_managed_runs_job(tmp_path):
    spec = _spec(tmp_path)
    ctx = flows.RunContext(spec, open_site("local"))
    ctx.checkpoints.ensure_container()
    RunLock(ctx.checkpoints, "tk-1", cluster="tk", head="n0", launcher="host:1:2.x:t").acquire(tempfile.gettempdir())
    beat = RunLock(ctx.checkpoints, "tk-1", cluster="tk", head="n0")  # node/lockbeat.py: it learns the lock
    assert beat.follow() and beat.heartbeat(tempfile.gettempdir())
    assert beat.read()["launcher"] == "host:1:2.x:t"
    assert JobCheckpoints(ctx.site, launcher="host:1:2.x:t").launcher == "host:1:2.x:t"


@pytest.mark.parametrize("events,expected", [
    (["controller", "job", "job end", "handover"], {"warm": False, "takeover": True}),
    (["job end", "handover", "controller", "job not started", "controller"], {"warm": False, "takeover": True}),
    (["handover", "job", "downtime"], None),  # finished by the one before
    (["handover", "job"], None),  # its job started: it is followed, not resumed
    (["controller"], None),
])
def test_a_handover_the_killed_controller_began_is_finished_with_its_downtime(events, expected):
    c = type("C", (), {"state": {"events": [{"event": e} for e in events]}})()
    assert takeover.unfinished_handover(c) == expected


def test_a_kill_point_kills_the_process_the_nth_time_only_when_asked():
    code = ("from appliance import killpoints as k\n"
            "k.here('job-lock'); print('one', flush=True); k.here('lease-made'); k.here('job-lock'); print('two')")
    run = lambda at: subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,  # noqa: E731
                                    env={"PATH": "/usr/bin:/bin", **({"APPLIANCE_KILL_AT": at} if at else {})})
    assert run(None).stdout.split() == ["one", "two"]
    killed = run("job-lock:2")
    assert killed.returncode == -9 and killed.stdout.split() == ["one"]
    assert run("lease-made").returncode == -9
    assert run("lease-asked,job-started").stdout.split() == ["one", "two"]


def test_a_job_its_gone_controller_launched_that_runs_on_is_followed_and_its_next_cluster_made(locked, monkeypatch,
                                                                                              said):
    """The controller was killed while its job trains (the laptop slept, the lab server rebooted): the job goes on,
    detached on its head node. The next controller follows it (its next cluster made meanwhile: on_follow) instead
    of only waiting, so its lease end is handed over warm."""
    spec, ctx, control, head, lock = locked
    head["runs"] = True
    job = lock(_gone_controller())
    looks = [job, job, job, None]
    monkeypatch.setattr(takeover, "live_job", lambda ctx: looks.pop(0))
    follows = []
    got = takeover.wait_for_live_job(ctx, control, on_follow=follows.append)
    assert looks == [] and head["asked"] == 1  # its head asked once, not at every look
    assert got["job_id"] == job["job_id"] and follows == [got["cluster"]]
    events = [e["event"] for e in control.state["events"]]
    assert "following" in events and "waiting" not in events and "job not started" not in events
    assert control.state["status"] == "running"


STOP = {"step": 250, "committed": True, "reason": "lease end (node watchdog)"}
RESUMED = {"step": 100, "epoch": 4, "batch": 12}


@pytest.mark.parametrize("left,end,handed_over", [
    (30.0, {"rc": 0, "stopped": STOP, "resumed": RESUMED}, "lease end"),  # stopped by the nodes' watchdog
    (0.0, None, "lease end"),  # the end took its nodes: the newest commit is where it stopped
    (0.0, None, "lease end, the job before on another machine"),  # where it began: by the run's timeline
    (None, None, None),  # the cloud cannot say: a resume
    (3600.0, {"rc": 0, "stopped": {**STOP, "reason": "SIGTERM"}, "resumed": RESUMED}, None),  # a user's stop
    (30.0, {"rc": 1, "stopped": None, "resumed": RESUMED}, None),  # it failed
    (3600.0, {"rc": 0, "stopped": None, "resumed": RESUMED}, "done"),  # it finished
])
def test_a_followed_job_that_ended_with_its_lease_is_handed_over_as_its_launcher_would(tmp_path, monkeypatch, left,
                                                                                        end, handed_over):
    """Rank 0's stop report (its ranks exit 0 after it) with its lease ending within twice lease.stop_margin, or its
    lease over: the job's end is recorded as its launcher would have (the timeline, the run's record: stopped at
    the reported step, or the newest commit) and the loop hands it over. Exit 0 with no stop report: it finished,
    and so did the run. Otherwise (a user's stop, a failure, nothing known): the run resumes, as after any
    takeover."""
    from appliance.cluster import Cluster, Node

    spec = flows.check(str(write_spec(tmp_path, "python x.py", code=tmp_path, name=f"tf{os.urandom(3).hex()}",
                                      extra=f"checkpoint: {{url: 'file://{tmp_path}/ck/'}}\n"
                                            "lease: {stop_margin: 60s}\n")))
    ctx = flows.RunContext(spec, open_site("local"))
    control = managed.Control(spec, None, poll=0.01)
    control.take()
    cl = Cluster(name=spec.name, cloud="local", lease_id="L1", lease_end="2026-12-01T10:00:00",
                 nodes=[Node("n1", "10.0.0.1", "10.0.0.1", "/w"), Node("n2", "10.0.0.2", None, "/w")])
    elsewhere = handed_over == "lease end, the job before on another machine"
    if elsewhere:  # this machine's record has an older job only (it ran the run before another machine took it
        # over), the run's timeline the job before this one
        runs.job_started(spec, cl, f"{spec.name}-0")
        control.record("job end", job_id=f"{spec.name}-1", exit_code=75, lease_end=True, step=100)
        control.record("job", job_id=f"{spec.name}-2", restore=True)
        handed_over = "lease end"
    else:
        runs.job_started(spec, cl, f"{spec.name}-1")
    runs.job_started(spec, cl, f"{spec.name}-2")
    rec = runs.load(spec.name)
    rec["jobs"][0].update(status="stopped", last_step=50 if elsewhere else 100)
    runs.save(rec)
    monkeypatch.setattr(takeover, "lease_left", lambda ctx, cluster: left)
    monkeypatch.setattr(takeover, "newest_commit", lambda ctx: ("ckpt-000000250", 250))
    monkeypatch.setattr(headjob, "job_end", lambda cl, run, job_id: end)
    monkeypatch.setattr(ctx.site, "time_scale", lambda: 1.0)  # no local cloud here: its clock runs as ours
    monkeypatch.setattr(managed._Run, "account", lambda self: None)  # nor its leases to count
    run = managed._Run(ctx, control, 0, None)
    control.record("downtime", job_id=f"{spec.name}-2", warm=True, breakdown={"total": 7.5})  # its launcher's
    res = run.followed_end(f"{spec.name}-2", cl)
    run.settle()
    control.close("finished")
    job = runs.load(spec.name)["jobs"][-1]
    if handed_over is None:
        assert res is None and job["status"] == "running"
        return
    if handed_over == "done":
        assert res.exit_code == 0 and not res.lease_end and job["status"] == "complete"
        assert runs.load(spec.name)["last_checkpoint"]["name"] == "ckpt-000000250"
        return
    assert res.lease_end and res.stopped["committed"] and res.stopped["step"] == 250
    assert job["status"] == "stopped" and job["last_step"] == 250
    assert job["resume_breakdown"] == {"total": 7.5}  # its resume's downtime, from the timeline
    if end is not None:  # what rank 0 reported: where it resumed from, why it stopped
        assert res.resumed == RESUMED and job["first_step"] == 100 and res.stopped["reason"] == STOP["reason"]
    else:  # the head gone with the lease: it resumed where the job before it stopped
        assert res.resumed == {"step": 100} and job["first_step"] == 100
    assert control.state["progress"]["steps"] == 150  # its steps in the run's pace
    ends = [e for e in control.state["events"] if e["event"] == "job end" and e["job_id"] == f"{spec.name}-2"]
    assert len(ends) == 1 and ends[0]["lease_end"] and ends[0]["followed"] and ends[0]["step"] == 250


def test_how_a_detached_job_ended_is_read_from_its_files_on_the_head():
    said = ('0\n[0]<stdout>:APPLIANCE_RESUMED {"step": 5, "epoch": 0, "batch": 5}\n'
            '[0]<stdout>:APPLIANCE_STOPPED {"step": 9, "committed": true, "reason": "lease end"}\n')
    assert headjob.parse_end(said) == {"rc": 0, "resumed": {"step": 5, "epoch": 0, "batch": 5},
                                       "stopped": {"step": 9, "committed": True, "reason": "lease end"}}
    assert headjob.parse_end("1\n") == {"rc": 1, "stopped": None, "resumed": None}
    assert headjob.parse_end("") is None  # no .rc file: it has not ended


def test_appliance_runs_shows_what_a_takeover_found():
    from appliance.cli.views import format_timeline

    ev = [{"at": 0, "event": "following", "job_id": "r-2", "cluster": "r_h"},
          {"at": 1, "event": "job not started", "job_id": "r-3", "cluster": "r"},
          {"at": 2, "event": "downtime", "takeover": True, "warm": False, "breakdown": {"total": 9.0}}]
    lines = format_timeline({"run": "r", "status": "running", "events": ev})
    assert "job r-2 on r_h runs on, its controller gone: followed to its end" in lines[1]
    assert "job r-3 on r never started (its controller was killed): taken over" in lines[2]
    assert "handover (finished by a takeover): " in lines[3]


def test_a_job_began_where_the_job_just_before_it_ended_by_the_timeline():
    ev = [{"event": "job", "job_id": "r-1", "restore": False},
          {"event": "job end", "job_id": "r-1", "step": 100, "end_committed": True},
          {"event": "job", "job_id": "r-2", "restore": True},  # its end never recorded (its controller was lost)
          {"event": "job", "job_id": "r-3", "restore": True}]
    assert [managed._began_at(ev, f"r-{i}") for i in (1, 2, 3)] == [None, 100, None]
