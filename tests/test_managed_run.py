"""`appliance run SPEC` (flows.run_managed), the loop's decisions in the fast tier: what follows a job that ended
for its lease, one that failed, one its user stopped. The jobs are stand-ins; the e2e tier runs the loop for real
across a lease end (tests/test_lease_end.py::test_a_managed_run_goes_on_across_the_lease_end_bit_exactly)."""

import json
import os
import threading
import time
from types import SimpleNamespace

import pytest

from appliance import flows
from appliance.checkpoint import runs
from appliance.flows import control, handover, managed, takeover
from appliance.protocol import EXIT_STOPPED
from appliance.provision import lifecycle
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
    spec = write_spec(tmp_path, "python x.py", code=tmp_path, name="mr",
                      extra=f"checkpoint: {{url: 'file://{tmp_path}/ck/'}}\n")
    asked = []

    def use(first, *resumes):
        todo = list(resumes)
        monkeypatch.setattr(managed._Run, "first_job", first if callable(first) else lambda self: first)

        def resume(run, **kw):
            assert run == "mr" and kw.pop("control") is not None
            assert kw.pop("on_ask") is not None  # every lease a resume asks for goes to the run's ledger first
            assert "spec_path" not in kw and kw["spec"].name == "mr"  # the spec as read at the start, not again
            assert kw.pop("ctx").spec is kw["spec"]  # and the run's one context
            if "acquire" in kw:  # a handover: the recovery strategy's cluster, and the node type its job runs as
                got = kw.pop("acquire")({})
                kw["cluster"] = got and (got[0].name, got[1])
            asked.append(kw)
            return todo.pop(0)

        monkeypatch.setattr(flows.steps, "resume", resume)
        monkeypatch.setattr(lifecycle, "up", lambda site, spec, **kw: SimpleNamespace(name=spec.name))
        return flows.run_managed(str(spec), max_restarts=1), asked
    return use


def test_each_lease_end_continues_on_a_new_lease_until_the_job_finishes(scripted, said):
    stop = {"step": 40, "reason": "lease end (vendordata)", "committed": True}
    cut = _job(1, lease_end=True, failure="the lease ended at 2026-12-01 10:00 UTC before the job finished")
    res, asked = scripted(_job(EXIT_STOPPED, lease_end=True, stopped=stop), cut, _job(0))
    assert res.exit_code == 0
    assert [kw["cluster"] for kw in asked] == [("mr", "compute_local")] * 2  # each on a new lease of its own
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
    # from the newest commit, on the cluster the recovery strategy returns: the same while its lease runs (none
    # is recorded here: a new lease)
    assert len(asked) == 1 and asked[0]["cluster"] == ("mr", "compute_local")
    assert any("restart 1 of 1" in m for m in said)


def test_a_lease_end_between_two_failures_starts_the_count_again(scripted):
    crash = dict(failure="rank 1 on b exited with status 3")
    stop = {"step": 40, "reason": "lease end (vendordata)", "committed": True}
    res, asked = scripted(_job(3, **crash), _job(EXIT_STOPPED, lease_end=True, stopped=stop), _job(3, **crash),
                          _job(0))
    assert res.exit_code == 0 and len(asked) == 3 and all("cluster" in kw for kw in asked)  # each by the strategy


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
    assert not managed._has_committed_work(ctx)  # no container yet: a new run
    monkeypatch.setattr(CheckpointStore, "committed", lambda self: ["ckpt-000000040"])
    assert managed._has_committed_work(flows.RunContext(spec, open_site("local")))

    def down(self):
        raise ConnectionError("[Errno 111] Connection refused")

    monkeypatch.setattr(CheckpointStore, "committed", down)
    with pytest.raises(ConnectionError):  # a store that does not answer is not "no work"
        managed._has_committed_work(flows.RunContext(spec, open_site("local")))


def test_run_of_a_bad_spec_is_one_line_and_exit_2(tmp_path):
    from click.testing import CliRunner

    from appliance.cli import main

    bad = tmp_path / "bad.yaml"
    bad.write_text("name: Bad Name\ntrain: {code: ., command: python x.py}\n")
    r = CliRunner().invoke(main, ["run", str(bad)])
    assert r.exit_code == 2, r.output
    assert len(r.output.strip().splitlines()) == 1 and r.output.startswith("error: ") and "name" in r.output


# -- the controller: one per run, its state and cancel in the store (managed.Control) ----------------------


def _spec(tmp_path, name="mc"):
    return flows.check(str(write_spec(tmp_path, "python x.py", code=tmp_path, name=name,
                                      extra=f"checkpoint: {{url: 'file://{tmp_path}/ck/'}}\n")))


class _Ctx:  # what the controller's job hook reads of a JobContext
    def __init__(self, spec, job_id="j1"):
        from appliance.cluster import Cluster, Node

        self.spec, self.job_id, self.restore = spec, job_id, None
        self.cluster = Cluster(name=spec.name, cloud="local", lease_id="L1", lease_end="2026-12-01T10:00:00",
                               nodes=[Node("n1", "10.0.0.1", "10.0.0.1", "/w"), Node("n2", "10.0.0.2", None, "/w")])


def test_a_second_controller_of_a_run_is_refused_and_a_dead_ones_lock_is_taken_over_at_once(tmp_path, monkeypatch):
    spec = _spec(tmp_path)
    first = managed.Control(spec, None)
    first.take()
    with pytest.raises(flows.ApplianceError, match="already has a controller") as e:
        managed.Control(spec, None).take()
    assert "appliance cancel mc" in e.value.fix
    # the first controller's process is gone (kill -9): on its own machine its lock is not waited on
    monkeypatch.setattr(control, "gone_here", lambda cid: cid == first.id)
    third = managed.Control(spec, None)
    third.take()
    kinds = [(e["event"], e.get("took_over")) for e in third.state["events"]]
    assert kinds == [("controller", None), ("controller", first.id)]  # the timeline goes on across controllers
    first._done.set()
    third._done.set()


def test_cancel_reaches_the_live_controller_and_stops_its_job_and_not_a_later_controller(tmp_path, monkeypatch, said):
    spec = _spec(tmp_path)
    c = managed.Control(spec, None, poll=3600)  # the test looks for the request itself (no timing)
    c.take()
    runs.mark_managed(spec)
    stops = []
    hook = c.hook(stops.append)
    hook.started(_Ctx(spec))
    c._look_for_cancel()
    assert c.cancel is None and not stops  # nothing asked yet
    d = flows.cancel_run("mc")
    assert d["controller"] == c.id
    c._look_for_cancel()
    assert stops == ["appliance cancel"] and c.cancel["controller"] == c.id
    assert any("cancel of run mc asked" in m for m in said)
    c.close("cancelled")
    # the request was this controller's: the next one (`appliance run SPEC` to continue) does not obey it
    nxt = managed.Control(spec, None, poll=3600)
    nxt.take()
    nxt._look_for_cancel()
    assert nxt.cancel is None
    nxt.close("finished")
    with pytest.raises(flows.ApplianceError, match="no live controller"):
        flows.cancel_run("mc")


def test_the_timeline_shows_each_job_its_lease_and_how_it_ended(tmp_path, monkeypatch):
    from click.testing import CliRunner

    from appliance.cli import main
    from appliance.flows import credential

    spec = _spec(tmp_path)
    monkeypatch.setenv(credential.EXPIRES_ENV, "2027-01-28 07:23")  # a controller with a credential of its own
    c = managed.Control(spec, None, poll=3600)
    c.take()
    runs.mark_managed(spec)
    hook, job = c.hook(lambda reason: None), _Ctx(spec)
    ended = JobResult(job_id="j1", exit_code=75, world_size=2, rank_hosts=["n1", "n2"], lease_end=True,
                      stopped={"step": 242, "reason": "lease end (vendordata)", "committed": True})
    for h in (hook, runs.RunRecords()):  # the controller's hook, and the run record's (flows.run_job adds both)
        h.started(job)
        h.finish(ended)
    c.record("downtime", job_id="j2", breakdown={"lease": 1.5, "boot": 6.0, "total": 10.4})
    c.update(node_hours={"spent": 8.25, "booked": 4.0, "limit": 20.0, "deadline": "2026-12-24 12:00"},
             estimate={"step": 242, "total_steps": 1000, "steps_per_s": 0.5, "eta": 1796000000, "lease_ends_ahead": 2})
    c.record("lease extended", lease_id="L1", end="2026-12-01T14:00:00Z")
    r = CliRunner().invoke(main, ["ls", "mc"])
    assert r.exit_code == 0, r.output
    assert "managed run mc: running; controller alive on" in r.output
    assert "its credential expires 2027-01-28 07:23 UTC" in r.output
    assert "job j1 started on 2 compute_local at local (n1, n2), lease L1 ends 2026-12-01 10:00" in r.output
    assert "job j1 ended at step 242, for the lease end" in r.output
    assert "handover: 10.4s to the first step: lease 1.5s, boot 6.0s" in r.output
    assert "leased node-hours: 8.2 spent, 4.0 booked ahead, limit 20 (7.8 left); deadline 2026-12-24 12:00 UTC" in r.output
    assert "steps: 242 of 1000 (24%); at 0.50 steps/s it should finish about 2026-11-30 " in r.output
    assert "2 lease end(s) ahead" in r.output and "lease L1 extended to 2026-12-01T14:00" in r.output
    # the list shows the run by its controller's word: its job stopped for the lease end, the run goes on
    assert runs.load("mc")["status"] == "stopped"
    assert [r["status"] for r in runs.list_runs() if r["run"] == "mc"] == ["running"]
    from appliance.cli import format_progress

    assert format_progress({"estimate": {"step": 1000, "total_steps": 1000, "steps_per_s": 0.5, "eta": 1}}) == [
        "  steps: 1000 of 1000 (100%), done"]
    c.close("finished")
    r = CliRunner().invoke(main, ["ls", "mc", "--json"])
    tl = json.loads(r.output)["timeline"]
    assert tl["status"] == "finished" and not tl["controller_alive"]
    assert [r["status"] for r in runs.list_runs() if r["run"] == "mc"] == ["finished"]
    assert [e["event"] for e in tl["events"]] == ["controller", "job", "job end", "downtime", "lease extended", "end"]
    assert tl["node_hours"]["limit"] == 20.0 and tl["estimate"]["total_steps"] == 1000


def test_a_detached_controller_that_cannot_start_says_why_in_one_line(tmp_path, monkeypatch):
    """`appliance run SPEC` starts the controller in a process of its own and returns once it holds the run; when it
    cannot (here: another controller holds it), the command fails with the controller's own line."""
    from appliance.flows import credential

    made = []
    monkeypatch.setattr(credential, "make", lambda ctx, where: made.append(where) or {})  # no cloud here
    spec = _spec(tmp_path)
    holder = managed.Control(spec, None)
    holder.take()
    # refused before anything is made: the live controller's credential file is not touched (issue 60 item 8)
    theirs = runs.record_dir("mc") / "controller-cloud-20261202000000-1.yaml"
    theirs.parent.mkdir(parents=True, exist_ok=True)
    theirs.write_text("clouds: {}\n")
    with pytest.raises(flows.ApplianceError, match="^run mc already has a controller"):
        flows.start_managed(spec.path)
    assert not made and theirs.read_text() == "clouds: {}\n"
    # a controller that starts and then cannot take the run (here: this process's check took the holder for gone)
    monkeypatch.setattr(managed, "gone_here", lambda cid: True)
    with pytest.raises(flows.ApplianceError, match="did not start: run mc already has a controller") as e:
        flows.start_managed(spec.path)
    assert "controller.log" in e.value.fix and made
    holder.close("finished")


def test_a_managed_run_needs_a_checkpoint_url(tmp_path):
    with pytest.raises(flows.SpecError, match="no checkpoint.url"):
        flows.run_managed(str(write_spec(tmp_path, "python x.py", code=tmp_path, name="nourl")))


def test_a_controller_started_while_a_job_of_the_run_runs_waits_for_it_then_goes_on(tmp_path, monkeypatch, said):
    """The controller was killed (the laptop slept) and the job went on, detached on its head node: `appliance run
    SPEC` again waits for that job to end (by the run's lock) instead of failing on it, then takes the run on."""
    spec = _spec(tmp_path, "mw")
    monkeypatch.setenv("APPLIANCE_CONTROLLER_POLL", "0.01")
    held = {"job_id": "mw-1", "cluster": "mw", "heartbeat": 0}
    looks = [held, held, None]
    monkeypatch.setattr(takeover, "live_job", lambda ctx: looks.pop(0))
    monkeypatch.setattr(managed, "_has_committed_work", lambda ctx: True)
    monkeypatch.setattr(flows.steps, "resume", lambda run, **kw: _job(0))
    res = flows.run_managed(spec.path)
    assert res.exit_code == 0 and looks == []
    assert sum("job mw-1 of run mw still runs on cluster mw" in m and "waiting for it to end" in m for m in said) == 1


def test_a_cancel_while_waiting_for_such_a_job_asks_it_to_stop_and_starts_nothing(tmp_path, monkeypatch):
    from appliance.train import headjob

    spec = _spec(tmp_path, "mx")
    c = managed.Control(spec, None, poll=0.01)
    c.take()
    c.cancelled({"controller": c.id, "by": "elsewhere"})
    asked = []
    monkeypatch.setattr(takeover, "find_cluster", lambda name: f"cluster {name}")
    monkeypatch.setattr(headjob, "ask_to_stop", lambda cl, run, reason: asked.append((cl, run, reason)))
    looks = [{"job_id": "mx-1", "cluster": "mx"}] * 3 + [None]
    monkeypatch.setattr(takeover, "live_job", lambda ctx: looks.pop(0))
    monkeypatch.setattr(flows.steps, "resume", lambda run, **kw: pytest.fail("a cancelled run starts nothing"))
    assert managed._Run(flows.RunContext(spec, open_site("local")), c, 0, None).first_job() is None
    assert asked == [("cluster mx", "mx", "appliance cancel")]  # once, though the job took three looks to end
    c.close("cancelled")


def test_a_killed_controller_not_yet_reaped_counts_as_gone():
    """kill -9 leaves the controller a zombie until init reaps it (it was reparented when `appliance run` returned):
    `appliance run SPEC` again right after must take the run over, not be refused by the zombie's pid."""
    import socket
    import subprocess

    p = subprocess.Popen(["true"])
    try:
        state = lambda: open(f"/proc/{p.pid}/stat").read().rsplit(")", 1)[1].split()[0]  # noqa: E731
        for _ in range(1000):  # `true` exits at once; its parent (this test) has not reaped it
            if state() == "Z":
                break
            time.sleep(0.01)
        assert state() == "Z"
        assert managed.gone_here(f"{socket.gethostname()}:{p.pid}:1")
        assert not managed.gone_here(f"{socket.gethostname()}:{os.getpid()}:1")  # this process runs
        assert not managed.gone_here(f"another-host:{p.pid}:1")  # another machine's: its lock's ttl decides
    finally:
        p.wait()


# -- the warm handover (flows/handover.py) ---------------------------------------------------------------------


def _warm_site(tmp_path, overlap="30m", name="mh"):
    from fakes import FakeSite
    from test_fake_site import spec_of

    site = FakeSite()
    spec = spec_of(tmp_path, name, lease=f"lease: {{duration: 2h, overlap: {overlap}, book_ahead: 2h}}\n")  # at once
    return site, spec


def test_the_next_lease_is_booked_overlap_before_the_end_and_its_cluster_made_once_it_starts(tmp_path):
    import datetime as dt
    import functools

    from appliance.flows.handover import Warm
    from appliance.provision import lifecycle
    from fakes import no_nodes

    site, spec = _warm_site(tmp_path)
    up = functools.partial(lifecycle.up, finish_nodes=no_nodes)
    current = up(site, spec)
    said = []
    w = Warm(flows.RunContext(spec, site), current, lambda ev, **kw: said.append((ev, kw)), None, 0.001, up=up).start()
    c = site.cloud
    booked = lambda: [x for x in c.leases.values() if x.id != current.lease_id]  # noqa: E731
    for _ in range(10_000):  # the thread books it, then waits for its start
        if booked():
            break
        time.sleep(0.001)
    (nxt,) = booked()
    assert nxt.status == "PENDING" and nxt.start == current.lease_end_at - dt.timedelta(minutes=30)
    assert nxt.end - nxt.start == dt.timedelta(hours=2) and not c.verbs("create_server")[2:]
    c.clock = nxt.start  # Blazar starts it: the cluster is made on it, under the run's other name
    cl = w.ready()
    assert cl.name == "mh_h" and cl.lease_id == nxt.id and len(c.verbs("create_server")) == 4
    assert [ev for ev, _ in said] == ["next lease", "next cluster ready"]
    w.abandon()  # not used (the run finished first): it goes, lease and servers
    assert find_cluster_named("mh_h") is None and c.verbs("delete_lease")[-1] == (nxt.id,)
    lifecycle.down("mh", site=site)


def test_the_run_books_the_leases_its_plan_printed(tmp_path):
    """Issue 60 item 4: `appliance run --plan` prints the leases the run expects; the run follows it. The plan of a
    run of two leases with a warm handover, made before anything is booked, against what the run books: its first
    lease, then the next one (warm, overlap before the first's end), by node type, node count, start and end."""
    import functools

    from appliance.flows import plan
    from appliance.flows.handover import Warm
    from appliance.provision import lifecycle
    from fakes import no_nodes

    site, spec = _warm_site(tmp_path, name="pb")
    printed = plan.make(flows.RunContext(spec, site), "3h")
    assert printed["path"] == "successor leases" and len(printed["leases"]) == 2
    up = functools.partial(lifecycle.up, finish_nodes=no_nodes)
    current = up(site, spec)
    w = Warm(flows.RunContext(spec, site), current, lambda ev, **kw: None, None, 0.001, up=up).start()
    c = site.cloud
    booked = lambda: [x for x in c.leases.values() if x.id != current.lease_id]  # noqa: E731
    for _ in range(10_000):  # the thread books it
        if booked():
            break
        time.sleep(0.001)
    first = c.leases[current.lease_id]
    minute = lambda t: f"{t:%Y-%m-%d %H:%M}"  # noqa: E731 - the plan's resolution
    assert [(minute(x.start), minute(x.end)) for x in (first, *booked())] == \
        [(p["start"], p["end"]) for p in printed["leases"]]
    assert [a[1:] for a in c.verbs("create_lease")] == [(spec.nodes.node_type, spec.nodes.count)] * 2
    w.abandon()
    lifecycle.down("pb", site=site)


@pytest.mark.parametrize("same_start", [True, False])
def test_the_next_lease_a_controller_on_another_machine_booked_is_kept_or_goes_before_the_booking(tmp_path,
                                                                                                  same_start):
    """A controller that took the run over from another machine has no record of the next lease the lost one
    booked (only the run's state in the store): booked for the start this one would ask, it is kept and the
    cluster made on it (its hosts are the run's: a second booking would find none); booked for another start, it
    goes before the booking."""
    import datetime as dt
    import functools

    from appliance.flows.handover import Warm
    from appliance.provision import lifecycle
    from fakes import no_nodes

    site, spec = _warm_site(tmp_path, name="mk")
    up = functools.partial(lifecycle.up, finish_nodes=no_nodes)
    current = up(site, spec)
    c = site.cloud
    start = current.lease_end_at - dt.timedelta(minutes=30 if same_start else 50)
    earlier = c.create_lease("mk_h-earlier", spec.nodes.node_type, spec.nodes.count, dt.timedelta(hours=2),
                             start=start)
    entry = {"cluster": "mk_h", "site": spec.site, "node_type": spec.nodes.node_type, "lease_id": earlier.id}
    plan = SimpleNamespace(earlier_booking=lambda name: (entry, c.get_lease(earlier.id)) if name == "mk_h" else None,
                           lease_length=lambda start: (7200, ""), asking=None)
    said = []
    w = Warm(flows.RunContext(spec, site), current, lambda ev, **kw: said.append((ev, kw)), None, 0.001, up=up,
             plan=plan).start()
    for _ in range(10_000):  # the thread keeps it, or deletes it and books
        if said:
            break
        time.sleep(0.001)
    c.clock = start + dt.timedelta(minutes=31)  # Blazar starts them
    cl = w.ready()
    kinds = [ev for ev, _ in said]
    if same_start:
        assert kinds == ["lease adopted", "next lease", "next cluster ready"] and cl.lease_id == earlier.id
        assert len(c.verbs("create_lease")) == 2  # the current one and the earlier controller's: none asked here
    else:
        assert kinds == ["lease deleted", "next lease", "next cluster ready"] and cl.lease_id != earlier.id
        assert c.verbs("delete_lease")[-1] == (earlier.id,) and len(c.verbs("create_lease")) == 3
    w.abandon()
    lifecycle.down("mk", site=site)


def _lost_controllers_booking(tmp_path, start_of, length=lambda start: (7200, ""), extended=None):
    """A Warm made by a controller that took the run over, and the next lease the lost one booked for mk_h from
    ``start_of(the current lease's end as recorded)``; ``extended``: the current lease extended by it meanwhile (the
    run's state has the end before): its cloud, spec, site, `up`, current cluster, plan and the lease (``earlier``)."""
    import datetime as dt
    import functools

    from fakes import no_nodes

    site, spec = _warm_site(tmp_path, name="mk")
    up = functools.partial(lifecycle.up, finish_nodes=no_nodes)
    current, c = up(site, spec), site.cloud
    if extended:
        c.extend_lease(current.lease_id, by=extended)
    earlier = c.create_lease("mk_h-earlier", spec.nodes.node_type, spec.nodes.count, dt.timedelta(hours=2),
                             start=start_of(current.lease_end_at))
    entry = {"cluster": "mk_h", "site": spec.site, "node_type": spec.nodes.node_type, "lease_id": earlier.id}
    plan = SimpleNamespace(earlier_booking=lambda name: (entry, c.get_lease(earlier.id)) if name == "mk_h" else None,
                           lease_length=length, asking=None)
    return SimpleNamespace(c=c, earlier=earlier, spec=spec, site=site, up=up, current=current, plan=plan)


def _warm_of(m, events: int = 1):
    """The Warm of a takeover (``m``: _lost_controllers_booking), once it has said ``events`` events."""
    from appliance.flows.handover import Warm

    said: list = []
    w = Warm(flows.RunContext(m.spec, m.site), m.current, lambda ev, **kw: said.append((ev, kw)), None, 0.001,
             up=m.up, plan=m.plan).start()
    for _ in range(10_000):
        if len(said) >= events:
            break
        time.sleep(0.001)
    return w, said


@pytest.mark.parametrize("into", [10, 25])
def test_a_next_lease_the_lost_controller_booked_that_has_started_is_kept(tmp_path, into):
    """The takeover comes ``into`` minutes into the overlap: the next lease the lost controller booked has started
    (its cluster may be up on it already): it is the run's next lease, kept."""
    import datetime as dt

    made = _lost_controllers_booking(tmp_path, lambda end: end - dt.timedelta(minutes=30))
    made.c.clock = made.earlier.start + dt.timedelta(minutes=into)
    w, said = _warm_of(made)
    w.abandon()
    lifecycle.down("mk", site=made.site)
    assert said[0] == ("lease adopted", {"lease_id": made.earlier.id, "name": made.earlier.name, "cluster": "mk_h"})


def test_the_lost_controllers_booking_is_judged_by_the_current_leases_end_as_the_cloud_has_it(tmp_path):
    """The current lease was extended after the run's state recorded its cluster (the follower's record has the
    end before): the lost controller booked the next lease at the new end less the overlap, which is kept."""
    import datetime as dt

    made = _lost_controllers_booking(tmp_path, lambda end: end + dt.timedelta(hours=2) - dt.timedelta(minutes=30),
                                     extended=dt.timedelta(hours=2))
    w, said = _warm_of(made)
    w.abandon()
    lifecycle.down("mk", site=made.site)
    assert said[0][0] == "lease adopted", said


def test_a_cloud_that_does_not_answer_the_lost_controllers_booking_is_asked_again(tmp_path, monkeypatch):
    """The takeover's look for the lost controller's next lease meets a 503 (then a timeout): it is asked again
    after a wait, as the booking is, and the lease is kept: the handover stays warm (a booking beside it would find
    its hosts taken by that very lease)."""
    import datetime as dt

    from appliance.errors import Unanswered, Unavailable
    from appliance.flows import recovery

    monkeypatch.setattr(recovery, "CLOUD_WAIT", (0.001, 0.002))
    made = _lost_controllers_booking(tmp_path, lambda end: end - dt.timedelta(minutes=30))
    answers = [Unavailable("503 Service Unavailable from Blazar"), Unanswered("read timed out")]
    found = made.plan.earlier_booking

    def flaky(name):
        if answers:
            raise answers.pop(0)
        return found(name)

    made.plan.earlier_booking = flaky
    w, said = _warm_of(made, 3)
    w.abandon()
    lifecycle.down("mk", site=made.site)
    assert [ev for ev, _ in said][:3] == ["cloud away", "lease adopted", "cloud back"], said
    assert not answers


def test_an_adopted_next_lease_is_not_counted_against_the_runs_limits_twice(tmp_path):
    """limits.node_hours: the adopted lease is on the run's ledger already (booked ahead), so what the limits leave
    for a next lease is what is left after it; it was booked within them, and is used."""
    import datetime as dt

    made = _lost_controllers_booking(tmp_path, lambda end: end - dt.timedelta(minutes=30),
                                     length=lambda start: (None, "limits.node_hours 8.5 (8.0 spent or booked)"))
    w, said = _warm_of(made, 2)
    made.c.clock = made.earlier.start + dt.timedelta(minutes=1)
    cl = w.ready()
    w.abandon()
    lifecycle.down("mk", site=made.site)
    assert [ev for ev, _ in said] == ["lease adopted", "next lease", "next cluster ready"]
    assert cl.lease_id == made.earlier.id


def find_cluster_named(name):
    from appliance.cluster import find_cluster

    return find_cluster(name)


def test_a_refused_booking_leaves_nothing_and_the_handover_is_cold(tmp_path):
    import functools

    from appliance.flows.handover import Warm
    from appliance.provision import lifecycle
    from fakes import fault, no_nodes

    site, spec = _warm_site(tmp_path, name="mi")
    up = functools.partial(lifecycle.up, finish_nodes=no_nodes)
    current = up(site, spec)
    site.cloud.faults["create_lease"] = fault("Not enough hosts available")
    said = []
    w = Warm(flows.RunContext(spec, site), current, lambda ev, **kw: said.append((ev, kw)), None, 0.001, up=up).start()
    assert w.ready() is None
    assert said[-1][0] == "next cluster failed" and "Not enough hosts" in said[-1][1]["error"]
    assert find_cluster_named("mi_h") is None and len(site.cloud.leases) == 1
    lifecycle.down("mi", site=site)


def _handover_with(monkeypatch, scripted, ready: bool):
    """The run's first job ends with its lease while a stand-in Warm made (``ready``) or failed to make the next
    cluster; returns (result, resumes asked, clusters taken down, whether the Warm was abandoned)."""
    from types import SimpleNamespace

    from appliance.provision import lifecycle

    downs, abandoned = [], []
    monkeypatch.setattr(lifecycle, "down", lambda name, site=None: downs.append(name))
    monkeypatch.setattr(managed, "find_cluster", lambda name: SimpleNamespace(name=name))

    class StandIn:  # a Warm whose cluster is up and staged, or whose booking Blazar refused
        def __init__(self, ctx, current, record, stage, poll, plan=None):
            self.name = f"{ctx.spec.name}_h"
            self.choice = None  # booked for the spec's own node type

        def start(self):
            return self

        def ready(self, control=None):
            return SimpleNamespace(name=self.name) if ready else None

        def abandon(self):
            abandoned.append(True)

    monkeypatch.setattr(managed, "Warm", StandIn)
    monkeypatch.setattr(managed, "duration_seconds", lambda v: 1800)
    stop = {"step": 40, "reason": "lease end (vendordata)", "committed": True}
    first = _job(EXIT_STOPPED, lease_end=True, stopped=stop)

    def first_job(self):
        self.job_started(SimpleNamespace(name="mr", lease_id="L1", lease_end_at=object()))
        return first

    res, asked = scripted(first_job, _job(0))
    return res, asked, downs, bool(abandoned)


def test_at_the_lease_end_the_run_goes_on_on_the_warm_cluster_and_the_old_one_goes(scripted, monkeypatch, said):
    """The handover's decisions: a next cluster that is ready is resumed on by name (no new lease); the old cluster
    goes; the downtime is on the timeline as warm. One that is not (None) falls back to a new lease."""
    res, asked, downs, _ = _handover_with(monkeypatch, scripted, ready=True)
    assert res.exit_code == 0 and [{k: v for k, v in kw.items() if k not in ("spec", "out")} for kw in asked] \
        == [{"cluster": ("mr_h", "compute_local")}] and downs[0] == "mr"  # then, finished, the run's cluster goes
    assert any("goes on on mr_h, up and staged already" in m for m in said)


def test_with_no_next_cluster_ready_the_handover_is_cold_and_what_was_made_goes(scripted, monkeypatch, said):
    res, asked, _, abandoned = _handover_with(monkeypatch, scripted, ready=False)
    assert res.exit_code == 0 and [kw.get("cluster") for kw in asked] == [("mr", "compute_local")] and abandoned
    assert any("goes on on a new lease" in m for m in said)


def test_jobs_stopped_for_their_lease_end_at_once_twice_in_a_row_end_the_run_with_the_fix(scripted, said):
    """A lease shorter than the stop margin plus the job's start: each job is stopped as it starts, and a new lease
    follows each; the run would take lease after lease (found with the handover benchmark's 60x clock)."""
    def stopped_at(step, resumed):
        res = _job(EXIT_STOPPED, lease_end=True, stopped={"step": step, "reason": "lease end", "committed": True})
        res.resumed = {"step": resumed} if resumed is not None else None
        return res

    res, asked = scripted(stopped_at(1, None), stopped_at(2, 1), stopped_at(3, 2))
    assert res.exit_code == EXIT_STOPPED and len(asked) == 1  # one new lease, then the run stops
    assert any("stopped for its lease end after 1 step(s)" in m and "lease.duration" in m for m in said)


def test_the_specs_notify_command_hears_each_handover_and_the_end(tmp_path, monkeypatch):
    got = tmp_path / "events.jsonl"
    spec = write_spec(tmp_path, "python x.py", code=tmp_path, name="mn",
                      extra=f"checkpoint: {{url: 'file://{tmp_path}/ck/'}}\n"
                            f"notify: \"cat >> {got}; echo \\\" $APPLIANCE_EVENT\\\" >> {got}\"\n")
    stop = {"step": 40, "reason": "lease end (vendordata)", "committed": True}
    first = _job(EXIT_STOPPED, lease_end=True, stopped=stop)
    resumed = _job(0)
    resumed.resume_breakdown = {"total": 9.9}
    monkeypatch.setattr(managed._Run, "first_job", lambda self: first)
    monkeypatch.setattr(flows.steps, "resume", lambda run, **kw: resumed)
    assert flows.run_managed(str(spec)).exit_code == 0
    lines = got.read_text().splitlines()
    events = [json.loads(x.rsplit(" ", 1)[0]) for x in lines]
    assert [(e["event"], e["run"]) for e in events] == [("downtime", "mn"), ("end", "mn")]
    assert events[0]["breakdown"] == {"total": 9.9} and events[1]["status"] == "finished"
    assert [x.rsplit(" ", 1)[1] for x in lines] == ["downtime", "end"]  # the event's name in APPLIANCE_EVENT


# -- hosts taken at a lease end: the alternatives, the next free slot, parking --------------------------------


def _lease_end_job():
    return _job(EXIT_STOPPED, lease_end=True, stopped={"step": 40, "reason": "lease end (vendordata)",
                                                        "committed": True})


@pytest.fixture
def no_hosts_for(tmp_path, monkeypatch):
    """run_managed of a spec on compute_local with nodes.alternatives [gpu_local], whose resumes on a new lease are
    refused for want of hosts for the node types given; returns (result, the node types asked for in order, the
    node types a slot was looked for among)."""
    from appliance.errors import NoHosts

    from appliance.flows.handover import label

    spec = tmp_path / "ma.yaml"

    def run(refused: set, slot=None, park_poll: float = 0.0, alternatives: str = "[gpu_local]"):
        spec.write_text(f"name: ma\ncloud: local\ntrain: {{code: {tmp_path}, command: python x.py}}\n"
                        f"checkpoint: {{url: 'file://{tmp_path}/ck/'}}\n"
                        f"nodes: {{count: 2, node_type: compute_local, alternatives: {alternatives}}}\n")
        asked, looked, booked = [], [], []
        monkeypatch.setattr(managed._Run, "first_job", lambda self: _lease_end_job())

        def up(site, spec, **kw):  # (node type [at site], on a new lease: not on the one booked at a slot)
            nt = spec.nodes.node_type + (f" at {spec.site}" if spec.site else "")
            asked.append((nt, not booked))
            if nt in refused and not booked:
                raise NoHosts(f"not enough hosts available for 2 x {nt}")
            return SimpleNamespace(name=spec.name)
        monkeypatch.setattr(lifecycle, "up", up)
        monkeypatch.setattr(flows.steps, "resume", lambda run, **kw: kw["acquire"]({}) and _job(0))
        slots = iter(slot if isinstance(slot, list) else [slot])

        def wait_for_slot(ctx, control, choices, fit, quiet):
            looked.append([label(a) for a in choices])
            got = next(slots)
            if got == "cancel":  # `appliance cancel` while the run is parked, between two looks
                threading.Thread(target=control.cancelled, args=({"by": "elsewhere"},)).start()
                return None
            booked.extend([got] if got else [])
            return got and next(a for a in choices if label(a) == got)
        monkeypatch.setattr(handover, "wait_for_slot", wait_for_slot)
        monkeypatch.setattr(handover, "PARK_POLL", park_poll)
        return flows.run_managed(str(spec)), asked, looked
    return run


def test_hosts_taken_at_a_lease_end_fail_over_to_the_alternative(no_hosts_for, said):
    res, asked, looked = no_hosts_for({"compute_local"})
    assert res.exit_code == 0 and asked == [("compute_local", True), ("gpu_local", True)] and not looked
    assert any("no 2 x compute_local free" in m and "trying gpu_local" in m for m in said)


def test_hosts_taken_fail_over_to_an_alternative_at_another_site_then_wait_for_either(no_hosts_for, said):
    """nodes.alternatives may name another site (CHI@TACC for a run at CHI@UC): its lease is asked there; with no
    hosts at either, the earliest slot of any choice, at any site, is booked."""
    other = "[{node_type: gpu_local, site: CHI@local2}]"
    res, asked, looked = no_hosts_for({"compute_local"}, alternatives=other)
    assert res.exit_code == 0 and asked == [("compute_local", True), ("gpu_local at CHI@local2", True)]
    assert any("no 2 x compute_local free" in m and "trying gpu_local at CHI@local2" in m for m in said)
    res, asked, looked = no_hosts_for({"compute_local", "gpu_local at CHI@local2"}, slot="gpu_local at CHI@local2",
                                      alternatives=other)
    assert looked == [["compute_local", "gpu_local at CHI@local2"]]
    assert res.exit_code == 0 and asked[-1] == ("gpu_local at CHI@local2", False)


def test_with_none_free_now_the_run_waits_for_the_earliest_slot_then_goes_on_there(no_hosts_for):
    res, asked, looked = no_hosts_for({"compute_local", "gpu_local"}, slot="gpu_local")
    assert looked == [["compute_local", "gpu_local"]]
    assert res.exit_code == 0 and asked[-1] == ("gpu_local", False)  # the lease booked at the slot, now started


def test_with_no_slot_within_lease_wait_the_run_parks_then_goes_on_when_one_appears(no_hosts_for):
    """Parked: no lease held, its checkpoint committed; it looks again every PARK_POLL and goes on by itself once a
    slot within lease.wait appears (another project's reservation was cancelled, the wait got shorter)."""
    res, asked, looked = no_hosts_for({"compute_local", "gpu_local"}, slot=[None, None, "gpu_local"])
    assert res.exit_code == 0 and len(looked) == 3 and asked[-1] == ("gpu_local", False)
    tl = managed.read_timeline(managed._control_of("ma", None, "local", None))
    assert tl["status"] == "finished"
    assert [e["node_type"] for e in tl["events"] if e["event"] == "no hosts"] == ["compute_local", "gpu_local"]


def test_a_parked_run_is_cancelled_without_waiting_for_its_next_look(no_hosts_for):
    res, asked, looked = no_hosts_for({"compute_local", "gpu_local"}, slot=["cancel"], park_poll=3600.0)
    assert res is None and len(looked) == 1  # not looked again: the cancel ended the wait for the next look
    tl = managed.read_timeline(managed._control_of("ma", None, "local", None))
    assert tl["status"] == "cancelled"


def test_wait_for_slot_books_the_earliest_slot_and_measures_the_wait(tmp_path, monkeypatch):
    import datetime as dt

    from appliance.flows.handover import wait_for_slot
    from appliance.spec import Alternative
    from fakes import FakeSite
    from test_fake_site import spec_of

    site = FakeSite()
    spec = spec_of(tmp_path, "mz", lease="lease: {duration: 2h, wait: 6h}\n")
    c = site.cloud
    slots = {"compute_local": c.clock + dt.timedelta(hours=5), "b": c.clock + dt.timedelta(hours=3)}  # b: another
    c.next_slot = lambda nt, count, length, after: slots[nt]
    reads = []
    get = c.get_lease

    def clock_moves(lid):  # the cloud's clock reaches the slot while the controller waits
        reads.append(lid)
        if len(reads) == 2:
            c.clock = slots["b"]
        return get(lid)
    c.get_lease = clock_moves
    import threading
    from types import SimpleNamespace

    events = []
    control = SimpleNamespace(cancel=None, changed=threading.Event(), poll=0.001,
                              record=lambda ev, **kw: events.append((ev, kw)),
                              parked=lambda ev="parked", **kw: events.append((ev, kw)))
    choices = [Alternative("compute_local"), Alternative("b")]
    assert wait_for_slot(flows.RunContext(spec, site), control, choices) == choices[1]
    (lease,) = c.leases.values()
    assert lease.start == slots["b"] and find_cluster_named("mz").lease_id == lease.id  # booked under the run's name
    waiting = dict(events)["waiting for hosts"]
    assert waiting["node_type"] == "b" and waiting["wait_s"] == 3 * 3600
    assert dict(events)["hosts free"]["waited_s"] >= 0
    slots["b"] = c.clock + dt.timedelta(hours=7)  # past lease.wait: none is booked
    slots["compute_local"] = c.clock + dt.timedelta(hours=8)
    assert wait_for_slot(flows.RunContext(spec, site), control, choices) is None
    assert events[-1][0] == "parked" and "within lease.wait 6h" in events[-1][1]["reason"]


def test_a_store_that_does_not_answer_as_a_controller_starts_is_an_error_not_an_empty_timeline(tmp_path, monkeypatch):
    """The new controller reads the run's timeline before it writes its own first event over it: when that read
    fails, it stops there (the timeline so far is kept), it does not start one afresh."""
    from appliance.store.checkpoints import CheckpointStore, StoreUnavailable

    spec = _spec(tmp_path, "ms")
    first = managed.Control(spec, None)
    first.take()
    first.record("job", job_id="j1")
    first.close("stopped")
    real = CheckpointStore.read_json

    def down_for_state(self, rel):
        if rel == "state.json":
            raise ConnectionError("[Errno 111] Connection refused")
        return real(self, rel)
    monkeypatch.setattr(CheckpointStore, "read_json", down_for_state)
    monkeypatch.setattr(control, "retrying", lambda fn, **kw: (_ for _ in ()).throw(StoreUnavailable("store down")))
    with pytest.raises(StoreUnavailable):
        managed.Control(spec, None).take()
    monkeypatch.setattr(CheckpointStore, "read_json", real)
    events = [e["event"] for e in json.loads((tmp_path / "ck" / "ms" / "controller" / "state.json").read_text())["events"]]
    assert events == ["controller", "job", "end"]


def test_the_newest_jobs_output_is_read_from_the_store_on_any_machine_and_followed_to_its_end(tmp_path, monkeypatch):
    """`appliance logs RUN --url URL`: the controller ships the newest job's output (its last LOG_TAIL bytes, from
    a whole line) to the store each poll; another machine shows its last lines, then follows it, each line once,
    until the timeline says the job ended."""
    spec = _spec(tmp_path, "ml")
    c = control.Control(spec, None, poll=3600)
    c.take()
    runs.mark_managed(spec)
    copy = runs.record_dir("ml") / "ml-20261129T050240-1.log"
    copy.write_text("".join(f"[0|n1] line {i}\n" for i in range(50)))
    monkeypatch.setattr(control, "LOG_TAIL", 200)  # the store keeps the last ~200 bytes: lines 37-49
    c.ship_log()
    url = f"file://{tmp_path}/ck/"
    shown = []
    assert managed.store_logs("ml", url=url, lines=3, out=shown.append) == "ml-20261129T050240-1"
    assert shown[1:] == ["[0|n1] line 47", "[0|n1] line 48", "[0|n1] line 49"]

    def meanwhile(_):  # the job writes on (a partial last line too), the controller ships it, then the job ends
        with copy.open("a") as f:
            f.write("[0|n1] line 50\n[0|n1] line 51\n[0|n1] li")
        c.ship_log()
        c.record("job end", job_id="ml-20261129T050240-1", exit_code=0)
    monkeypatch.setattr(managed.time, "sleep", meanwhile)
    shown.clear()
    managed.store_logs("ml", url=url, lines=0, follow=True, out=shown.append)
    first = int(shown[1].rsplit(" ", 1)[1])
    assert 30 < first < 49 and shown[1:] == [f"[0|n1] line {i}" for i in range(first, 52)] + [
        "[appliance] job ml-20261129T050240-1 ended (exit 0)"]
    c.close("finished")


def test_a_handovers_downtime_is_on_the_timeline_as_soon_as_the_new_jobs_first_step_is_done(tmp_path, monkeypatch):
    """Not when that job ends, a lease later: the timeline and the notify hook hear of each handover while the new
    job trains. A restart after a failure is no handover: no downtime for it."""
    spec = _spec(tmp_path, "md")
    stop = {"step": 40, "reason": "lease end (vendordata)", "committed": True}
    monkeypatch.setattr(managed._Run, "first_job", lambda self: _job(EXIT_STOPPED, lease_end=True, stopped=stop))
    seen, todo = [], [_job(3, failure="rank 1 exited with status 3"), _job(0)]

    def resume(run, **kw):  # the job: its first step done, then (later) its end
        c = kw["control"]
        c.job_id = f"next{len(seen)}"
        c.first_step({"total": 7.5, "stage checkpoint": 0.4})
        seen.append([e["event"] for e in c.state["events"]])
        res = todo.pop(0)
        res.resume_breakdown = {"total": 7.5, "stage checkpoint": 0.4}
        return res
    monkeypatch.setattr(flows.steps, "resume", resume)
    assert flows.run_managed(spec.path, max_restarts=1).exit_code == 0
    assert seen[0][-2:] == ["handover", "downtime"] and "downtime" not in seen[1][len(seen[0]):]
    tl = managed.read_timeline(managed._control_of("md", None, "local", None))
    downs = [e for e in tl["events"] if e["event"] == "downtime"]
    assert len(downs) == 1 and downs[0]["job_id"] == "next0" and not downs[0]["warm"]


@pytest.mark.parametrize("keep", [False, True])
def test_a_finished_run_releases_its_cluster_and_lease_unless_the_spec_keeps_them(tmp_path, monkeypatch, said, keep):
    """Nobody is attached when a managed run finishes: its nodes would be paid for, idle, until the lease's end
    (days on Chameleon). They go, said; lease.keep_when_done keeps them (what else is on their disks)."""
    from types import SimpleNamespace

    from appliance.provision import lifecycle

    spec = write_spec(tmp_path, "python x.py", code=tmp_path, name="mf",
                      extra=f"checkpoint: {{url: 'file://{tmp_path}/ck/'}}\n"
                            + ("lease: {keep_when_done: true}\n" if keep else ""))
    downs = []
    monkeypatch.setattr(lifecycle, "down", lambda name, site=None: downs.append(name))
    monkeypatch.setattr(managed, "find_cluster", lambda name: SimpleNamespace(name=name) if name == "mf" else None)

    def first_job(self):
        self.job_started(SimpleNamespace(name="mf", lease_id=None, lease_end_at=None))
        return _job(0)
    monkeypatch.setattr(managed._Run, "first_job", first_job)
    assert flows.run_managed(str(spec)).exit_code == 0
    assert downs == ([] if keep else ["mf"])
    assert any("finished: its cluster mf and its lease go" in m for m in said) != keep
