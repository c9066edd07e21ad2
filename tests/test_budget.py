"""A managed run's limits (limits.node_hours, limits.deadline), its node-hours and its estimated finish
(flows/budget.py), and extending before booking (handover.Warm with lease.extend), on the fake site."""

import datetime as dt
import time
from types import SimpleNamespace

import pytest

from appliance import flows
from appliance.errors import SpecError
from appliance.flows import budget, managed
from appliance.flows.handover import Warm
from appliance.provision import lifecycle
from appliance.sites.openstack import LeaseInfo
from fakes import FakeSite, fault
from test_fake_site import spec_of

T0 = dt.datetime(2026, 11, 23, 12, 0)


def _lease(lid, start_h, end_h, status="ACTIVE"):
    return LeaseInfo(lid, lid, status, T0 + dt.timedelta(hours=start_h), T0 + dt.timedelta(hours=end_h), None, None,
                     False)


class _Cloud:
    def __init__(self, *leases):
        self.leases = {x.id: x for x in leases}

    def get_lease(self, lid):
        return self.leases.get(lid)


def test_node_hours_count_each_lease_from_its_start_to_its_end_or_its_deletion():
    a, b = _lease("a", 0, 4), _lease("b", 3.5, 7.5, status="PENDING")  # b: the next lease, overlapping a by 30 min
    led = budget.Ledger({})
    led.track(a, 2, "compute_local")
    led.track(b, 2, "compute_local")
    now = T0 + dt.timedelta(hours=3)
    assert led.node_hours(now) == (6.0, 2 * 1 + 2 * 4)  # 3 h of a spent; 1 h of a and all of b ahead
    cloud = _Cloud(b)  # a deleted at 3:00 (the handover), b extended by an hour
    b.end += dt.timedelta(hours=1)
    led.refresh(lambda site: cloud, now)
    assert led.leases["a"]["closed"] and led.node_hours(now) == (6.0, 10.0)
    assert led.leases["a"]["end"] == "2026-11-23T16:00:00Z" and led.leases["a"]["closed_at"] == "2026-11-23T15:00:00Z"
    later = T0 + dt.timedelta(hours=6)
    assert led.node_hours(later) == (6.0 + 2 * 2.5, 2 * 2.5)  # a never again; the overlap counts both


def test_a_lease_is_cut_to_the_node_hours_left_and_to_the_deadline_and_none_under_the_floor(tmp_path):
    spec = spec_of(tmp_path, "bl", lease="lease: {duration: 6h, stop_margin: 5m}\n"
                                         "limits: {node_hours: 20, deadline: '2026-11-24 02:00'}\n")
    led = budget.Ledger({})
    b = budget.Budget(spec, led)
    assert b.lease_seconds(T0, T0) == (6 * 3600, "")  # 2 nodes x 6 h = 12 of 20
    led.track(_lease("a", 0, 6), 2, "compute_local")
    length, why = b.lease_seconds(T0 + dt.timedelta(hours=6), T0)
    assert length == 4 * 3600 and why.startswith("limits.node_hours 20 (12.0 spent or booked, 8.0 left)")
    length, why = b.lease_seconds(T0 + dt.timedelta(hours=11), T0, nodes=1)  # 1 node: 8 h, but the deadline at 02:00
    assert length == 3 * 3600 and why == "limits.deadline 2026-11-24 02:00"
    assert b.lease_seconds(T0 + dt.timedelta(hours=13, minutes=21), T0, nodes=1) == (None, "limits.deadline "
                                                                                      "2026-11-24 02:00")
    # extending the lease a: what a itself has still to run is not counted as booked against its extension
    by, _ = b.extension("a", T0 + dt.timedelta(hours=6), T0 + dt.timedelta(hours=5), 2)
    assert by == dt.timedelta(hours=5)  # 20 - 10 spent = 10 node-hours on 2 nodes


@pytest.mark.parametrize("limits,why", [("{node_hours: 0}", "limits.node_hours: must be a positive number"),
                                        ("{deadline: 'next friday'}", "limits.deadline: 'next friday' is not a date"),
                                        ("{hours: 3}", "limits.hours: unknown key")])
def test_bad_limits_are_one_line_with_the_fix(tmp_path, limits, why):
    with pytest.raises(SpecError, match=why):
        spec_of(tmp_path, "bb", lease=f"limits: {limits}\n")


def test_a_yaml_date_or_an_offset_deadline_is_read_as_utc(tmp_path):
    from appliance.spec import deadline_of

    assert deadline_of(spec_of(tmp_path, "bd", lease="limits: {deadline: 2026-12-24}\n")) == dt.datetime(2026, 12, 24)
    assert deadline_of(spec_of(tmp_path, "bd", lease="limits: {deadline: '2026-12-24T12:00+02:00'}\n")) \
        == dt.datetime(2026, 12, 24, 10, 0)


def _run(tmp_path, monkeypatch, name, lease):
    """A managed run's loop (_Run) on the fake site, with its controller's state in file:// (no job runs)."""
    from conftest import write_spec

    spec = flows.check(str(write_spec(tmp_path, "python x.py", code=tmp_path, name=name,
                                      extra=f"checkpoint: {{url: 'file://{tmp_path}/ck/'}}\n{lease}")))
    site = FakeSite()
    ctx = flows.RunContext(spec, site)
    control = managed.Control(spec, None)
    events = []
    monkeypatch.setattr(control, "record", lambda ev, **kw: events.append((ev, kw)))
    return managed._Run(ctx, control, 0, None), site.cloud, events


def test_a_run_at_its_node_hours_limit_books_no_lease_and_ends_with_its_checkpoint(tmp_path, monkeypatch, said):
    run, cloud, events = _run(tmp_path, monkeypatch, "bn", "lease: {duration: 4h}\nlimits: {node_hours: 9}\n")
    first = cloud.create_lease("bn-1", "compute_local", 2, dt.timedelta(hours=4))
    run.track(first.id, 2, "compute_local")  # 8 node-hours of 9: 30 min on 2 nodes, under the floor (40 min)
    cloud.clock = first.end
    assert run.new_lease() is None and run.recovery.cold({}) is None
    assert run.limited.startswith("limits.node_hours 9 (8.0 spent or booked, 1.0 left)")
    assert ("limit", {"reason": run.limited}) in events and not cloud.verbs("create_lease")[1:]
    assert any("has reached limits.node_hours 9" in m and "raise the limit" in m for m in said)
    assert run.control.state["node_hours"] == {"spent": 8.0, "booked": 0.0, "limit": 9.0, "deadline": None}


def test_a_lease_within_the_limits_is_asked_for_shorter(tmp_path, monkeypatch):
    run, cloud, _ = _run(tmp_path, monkeypatch, "bs", "lease: {duration: 4h}\nlimits: {node_hours: 14}\n")
    run.track(cloud.create_lease("bs-1", "compute_local", 2, dt.timedelta(hours=4)).id, 2, "compute_local")
    cloud.clock += dt.timedelta(hours=4)
    assert run.new_lease() == {"lease_duration": "180m"}  # 6 node-hours left on 2 nodes
    asked = []
    monkeypatch.setattr(lifecycle, "up", lambda site, spec, **kw: asked.append((spec.nodes.node_type,
                                                                                spec.lease.duration)))
    run.recovery.cold({})
    assert asked == [("compute_local", "180m")]


def _warm(tmp_path, name):
    """A Warm on the fake site, lease.extend on, whose plan sets no limit (2 h leases, extended by 2 h)."""
    import functools

    from appliance.provision import lifecycle
    from fakes import no_nodes

    site = FakeSite()
    spec = spec_of(tmp_path, name, lease="lease: {duration: 2h, overlap: 30m, extend: true}\n")
    up = functools.partial(lifecycle.up, finish_nodes=no_nodes)
    current = up(site, spec)
    events = []
    plan = SimpleNamespace(extend_by=lambda lid, end, warm: (dt.timedelta(days=7), ""),  # no limit: by duration
                           lease_length=lambda start: (7200, ""))
    w = Warm(flows.RunContext(spec, site), current, lambda ev, **kw: events.append((ev, kw)), None, 0.001, up=up,
             plan=plan)
    return w, site.cloud, current, events


def _until(cond):
    for _ in range(20_000):
        if cond():
            return True
        time.sleep(0.001)
    return False


def test_with_lease_extend_the_current_lease_is_extended_first_and_the_next_booked_once_refused(tmp_path):
    w, c, current, events = _warm(tmp_path, "bw")
    lease = c.leases[current.lease_id]
    end0 = lease.end
    w.start()
    try:
        assert _until(lambda: len(c.verbs("get_lease")) > 3)
        assert not c.verbs("extend_lease") and len(c.leases) == 1  # hours before the end: neither yet
        c.clock = end0 - dt.timedelta(minutes=35)  # shortly before the next lease would start
        assert _until(lambda: c.called["extend_lease"].is_set())
        assert lease.end == end0 + dt.timedelta(hours=2) and len(c.leases) == 1  # extended: nothing booked
        c.faults["extend_lease"] = fault("Not enough hosts available")  # another project's lease follows ours
        c.clock = lease.end - dt.timedelta(minutes=35)
        assert _until(lambda: len(c.leases) == 2)
        (nxt,) = [x for x in c.leases.values() if x.id != lease.id]
        assert nxt.start == lease.end - dt.timedelta(minutes=30)  # overlap before the end it could not extend
    finally:
        w.abandon()
    kinds = [ev for ev, _ in events]
    assert kinds[:3] == ["lease extended", "extend refused", "next lease"]
    assert "Not enough hosts" in events[1][1]["reason"]
    from appliance.provision import lifecycle

    lifecycle.down("bw", site=w.ctx.site)


def test_with_no_room_in_the_limits_the_warm_books_no_next_lease(tmp_path):
    import functools

    from appliance.provision import lifecycle
    from fakes import no_nodes

    site = FakeSite()
    spec = spec_of(tmp_path, "bx", lease="lease: {duration: 2h, overlap: 30m, book_ahead: 2h}\n")  # at once
    up = functools.partial(lifecycle.up, finish_nodes=no_nodes)
    current = up(site, spec)
    events = []
    plan = SimpleNamespace(lease_length=lambda start: (None, "limits.deadline 2026-11-23 14:00"))
    w = Warm(flows.RunContext(spec, site), current, lambda ev, **kw: events.append((ev, kw)), None, 0.001, up=up,
             plan=plan).start()
    assert w.ready() is None and len(site.cloud.leases) == 1
    assert events == [("no next lease", {"cluster": "bx_h", "reason": "limits.deadline 2026-11-23 14:00"})]
    lifecycle.down("bx", site=site)


def test_the_estimate_is_the_steps_left_at_the_pace_so_far_plus_a_downtime_per_lease_end_ahead():
    p = {"step": 400, "total_steps": 1000, "steps": 400, "train_s": 800.0, "lease_s": 500.0, "downtime_s": [8, 12]}
    e = budget.estimate(p, now_real=1000.0)
    # 600 steps at 0.5/s = 1200 s of training: 2 lease ends of 500 s ahead, 10 s each
    assert e == {"step": 400, "total_steps": 1000, "steps_per_s": 0.5, "eta": 1000 + 1200 + 20, "lease_ends_ahead": 2}
    assert budget.estimate({"step": 400}, 0.0) == {"step": 400, "total_steps": None}  # no total known: no guess
