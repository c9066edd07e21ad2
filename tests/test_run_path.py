"""One path to the next cluster (issue 77 item 2), in the fast tier: a managed run's first job, new or continued,
takes its cluster from the recovery strategy (flows/recovery.py) as a handover does, and never the site's default
cluster; a handover waits for the warm cluster only while its lease starts soon (handover.Warm.ready)."""

import datetime as dt
import functools
import threading
from types import SimpleNamespace

import pytest

from appliance import flows
from appliance.flows import managed
from appliance.provision import lifecycle
from appliance.train.launch import JobResult
from conftest import write_spec
from fakes import FakeSite, no_nodes

DONE = 30  # seconds a run of these tests is given to end: each ends at once, unless it waits for a lease (fails)


def _job(rc=0, *, lease_end=False, n=[0]):  # noqa: B006 - a counter for job ids
    n[0] += 1
    stopped = {"step": 40, "reason": "lease end (vendordata)", "committed": True} if lease_end else None
    return JobResult(job_id=f"p{n[0]}", exit_code=rc, world_size=2, rank_hosts=["a", "b"], lease_end=lease_end,
                     stopped=stopped)


# -- the current lease gone early: the warm booking starts hours ahead ------------------------------------------------


@pytest.fixture
def warm_run(tmp_path, monkeypatch):
    """run_managed on the fake site (its clock stands still) of a run with 2 h leases and lease.overlap 30m, whose
    first job, on the run's cluster, starts the next cluster's booking (handover.Warm) and ends with its lease once
    that is booked; ``meanwhile(site, current, control)`` runs before it ends. Returns (whether the run ended within
    DONE seconds, its result, the clusters its resumes were given, the site, its first cluster, its controller, the
    next lease booked)."""
    def run(name: str, meanwhile):
        site = FakeSite()
        spec = flows.check(str(write_spec(tmp_path, "python x.py", code=tmp_path, name=name,
                                          extra=f"checkpoint: {{url: 'file://{tmp_path}/ck/'}}\n"
                                                "lease: {duration: 2h, overlap: 30m}\n")))
        current = lifecycle.up(site, spec, finish_nodes=no_nodes)
        monkeypatch.setattr(flows.steps.RunContext, "of", classmethod(lambda cls, s: cls(s, site)))
        monkeypatch.setenv("APPLIANCE_CONTROLLER_POLL", "0.05")
        booked, book, resumed, got = threading.Event(), lifecycle.book, [], {}

        def booking(*a, **k):
            cl = book(*a, **k)
            got["next"] = cl.lease_id
            booked.set()
            return cl
        monkeypatch.setattr(lifecycle, "book", booking)
        monkeypatch.setattr(lifecycle, "up", lambda site, spec, **kw: SimpleNamespace(name=spec.name))

        def first_job(self):
            got["control"] = self.control
            self.job_started(current, spec)  # its next cluster is booked meanwhile (lease.overlap)
            assert booked.wait(DONE)
            meanwhile(site, current, self.control)
            return _job(3, lease_end=True)
        monkeypatch.setattr(managed._Run, "first_job", first_job)
        monkeypatch.setattr(flows.steps, "resume", lambda run, **kw: resumed.append(kw["acquire"]({})) or _job(0))
        t = threading.Thread(target=lambda: got.setdefault("res", flows.run_managed(str(spec.path))), daemon=True)
        t.start()
        t.join(DONE)  # a bound, not a wait: the run ends at once, or has waited for the next lease (the failure)
        return not t.is_alive(), got.get("res"), resumed, site, current, got["control"], got["next"]
    return run


def test_when_the_current_lease_goes_early_the_handover_is_cold_at_once_not_at_the_next_leases_start(warm_run):
    """The next lease starts overlap before the current one's end, 1.5 h ahead here; the current one is deleted
    (Horizon, `appliance lease delete`): the run went into Warm.ready and waited for the next lease's start, status
    running, nothing training."""
    def gone_early(site, current, control):
        site.cloud.delete_lease(current.lease_id)

    ended, res, resumed, site, current, control, nxt = warm_run("pw", gone_early)
    assert ended and res.exit_code == 0
    assert [(cl.name, nt) for cl, nt in resumed] == [("pw", "compute_local")]  # cold: a new lease now
    assert (nxt,) in site.cloud.verbs("delete_lease")  # the booking went
    events = [e["event"] for e in control.state["events"]]
    assert "next lease abandoned" in events and events.index("handover") < events.index("next lease abandoned")


def test_a_cancel_while_the_handover_waits_for_the_next_lease_ends_the_run_at_once(warm_run):
    """The next lease starts in 10 minutes (within overlap + stop_margin: waited for); `appliance cancel` then
    stops the run at once: nothing more is leased, and the booking goes."""
    def near_then_cancel(site, current, control):
        site.cloud.clock = current.lease_end_at - dt.timedelta(minutes=40)
        lease_at = site.cloud.lease_at

        def read(lid):  # the handover looks at the next lease's start: the cancel comes as it waits
            if control.state["status"] == "handover" and control.cancel is None:
                threading.Thread(target=control.cancelled, args=({"by": "elsewhere"},)).start()
            return lease_at(lid)
        site.cloud.lease_at = read

    ended, res, resumed, site, current, control, nxt = warm_run("px", near_then_cancel)
    assert ended and control.state["status"] == "cancelled" and resumed == []
    assert (nxt,) in site.cloud.verbs("delete_lease") and (current.lease_id,) in site.cloud.verbs("delete_lease")


def test_the_warm_cluster_is_waited_for_while_its_lease_starts_within_overlap_and_stop_margin(tmp_path):
    from appliance.flows.handover import Warm
    from test_fake_site import spec_of

    site = FakeSite()
    spec = spec_of(tmp_path, "py", lease="lease: {duration: 2h, overlap: 30m, stop_margin: 5m}\n")
    current = lifecycle.up(site, spec, finish_nodes=no_nodes)
    w = Warm(flows.RunContext(spec, site), current, lambda ev, **kw: None, None, 0.001,
             up=functools.partial(lifecycle.up, finish_nodes=no_nodes))
    w.booked = (current.lease_id, site)  # a lease that starts now (the fake's clock): due
    assert w.far() is None
    start = site.cloud.clock
    site.cloud.clock = start - dt.timedelta(hours=2)  # 2 h ahead: past 35 min
    assert "past lease.overlap 30m + lease.stop_margin 5m" in w.far()
    site.cloud.clock = start - dt.timedelta(minutes=35)
    assert w.far() is None
    lifecycle.down("py", site=site)
