"""`appliance run SPEC --plan` (flows/plan.py) against Chameleon's own rules, fast tier.

The expected figures were derived by hand from ChameleonCloud/hammers hammers/scripts/lease_stack_notifier.py
(``Project.get_coverage_by_node_type``, ``get_lease_stacking_violations``, ``get_high_end_hogging_violations``,
``Lease.add_host``, ``LeaseComplianceManager._update_leases``; its published test config's thresholds), not by
running it or our port (flows/notifier.py): each test's docstring shows the arithmetic. In days from the plan's
start (the fake cloud's clock), with leases of 7 days and 3 nodes of a node type with 8 hosts (su_factor 2):
- stacking: each lease counts one host, from max(now, its start) to its end; the window runs from the earliest
  start of the project's leases of the node type to the furthest end, at least now + 21; reported at >= 90%;
- hogging: every host of the leases ending within now + 21; reported when more than half of the node type's hosts.
"""

from __future__ import annotations

import dataclasses
import datetime as dt
import re
import typing

import pytest

from appliance import flows
from appliance.flows import plan
from fakes import FakeSite
from test_fake_site import spec_of

DAY = dt.timedelta(days=1)


def _plan(tmp_path, lease: str, node_type="gpu_local", count=3, run_for="30d", hosts=(8, 2.0), others=()):
    """The plan of run ``pl``; ``others``: the project's other leases, (name, start day, end day, nodes)."""
    site = FakeSite()
    site.cloud.hosts[node_type] = hosts
    t0 = site.cloud.clock
    for name, a, b, n in others:
        site.cloud.create_lease(name, node_type, n, (b - a) * DAY, start=t0 + a * DAY)
    spec = spec_of(tmp_path, "pl", nodes=count, lease=f"lease: {lease}\nnodes: {{count: {count}, node_type: "
                                                      f"{node_type}}}\n")
    return plan.make(flows.RunContext(spec, site), run_for)


def test_cold_successor_leases_hold_one_lease_at_a_time_and_the_last_is_released_when_training_ends(tmp_path):
    """Cold (no overlap): leases [0,7] [7,14] [14,21] [21,28] [28,35], the last released at 30. At each lease's
    start the notifier sees that lease alone: covered 7, window max(t+21, t+7) - t = 21: 7/21 = 33%. Hosts: 3 of 8,
    not more than half. Node-hours: 30 d x 24 x 3 = 2160 (4320 SUs); charged whole: 35 x 24 x 3 = 2520 (5040 SUs);
    at once: one lease, 7 x 24 x 3 = 504 node-hours (1008 SUs)."""
    p = _plan(tmp_path, "{duration: 7d}")
    assert (len(p["leases"]), p["path"], p["handover"]) == (5, "successor leases", "cold")
    assert p["leases"][-1]["released"] == "2026-12-23 12:00" and p["leases"][-1]["node_hours"] == 2 * 24 * 3
    assert (p["node_hours"], p["sus"], p["sus_needed"], p["peak_sus"], p["peak_leases"]) == (2160, 4320, 5040, 1008, 1)
    n = p["notifier"]
    assert p["notifier_coverage"] == pytest.approx(7 / 21, abs=1e-3) and n["coverage_at"] == "the run's start"
    assert (n["reserved"], n["hosts"], n["hogging_reported"]) == (3, 8, None)
    assert [f["rule"] for f in p["findings"]] == ["stacking"]  # the policy's own: 5 consecutive leases


def test_a_warm_successor_booked_late_is_seen_beside_the_current_lease_only_from_its_booking(tmp_path):
    """Warm, overlap 12h, book_ahead 1d: step 6.5; leases [0,7] [6.5,13.5] [13,20] [19.5,26.5] [26,33], booked at
    0, 5.5, 12, 18.5, 25. At 5.5 the run holds [0,7] and [6.5,13.5]: covered (7 - 5.5) + 7 = 8.5, window 26.5 - 0:
    32%; the worst is the start, 7/21 = 33%. Hogging at 5.5: 3 + 3 = 6 > 8 / 2: reported. Charged at once: two
    whole leases, 2 x 504 = 1008 node-hours (2016 SUs). Booked as the job starts (book_ahead 7d, the old way): at
    0 the run holds [0,7] and [6.5,13.5]: (7 + 7) / 21 = 67%."""
    p = _plan(tmp_path, "{duration: 7d, overlap: 12h, book_ahead: 1d}")
    assert [x["booked"] for x in p["leases"]] == ["2026-11-23 12:00", "2026-11-29 00:00", "2026-12-05 12:00",
                                                  "2026-12-12 00:00", "2026-12-18 12:00"]  # 0, 5.5, 12, 18.5, 25
    n = p["notifier"]
    assert p["notifier_coverage"] == pytest.approx(7 / 21, abs=1e-3)
    assert n["hogging_reported"] == {"at": "lease 2 booked", "reserved": 6, "hosts": 8}
    assert (p["peak_sus"], p["peak_leases"], p["peak_at"]) == (2016, 2, "lease 2 booked")
    assert p["node_hours"] == 4 * 504 + 4 * 24 * 3  # the last lease, [26,33], released at 30
    (hog,) = [f for f in p["findings"] if f["rule"] == "hogging"]
    assert "6 of the 8 gpu_local hosts reserved at once at lease 2 booked" in hog["line"]
    early = _plan(tmp_path, "{duration: 7d, overlap: 12h, book_ahead: 7d}")
    assert early["notifier_coverage"] == pytest.approx(14 / 21, abs=1e-3)
    assert early["notifier"]["coverage_at"] == "the run's start"


def test_the_extension_path_never_shows_a_lease_past_48_hours_and_7_days(tmp_path):
    """lease.extend, no overlap: one lease [0,7], extended by 7 days 11 minutes before each end (the job's watchdog:
    NODE_WATCH_MARGIN 600 s + 60 s). At 0: 7/21 = 33%. Right after the first extension, at t = 7 d - 11 min: covered
    14 d - t = 7 d + 11 min, window t + 21 d - 0 = 28 d - 11 min: 10091 / 40309 = 25%. The worst is 33%, not the
    100% of one 35-day lease. Charged at once at most: from t to 14 d, 3 x (168 + 11/60) = 504.55 node-hours."""
    p = _plan(tmp_path, "{duration: 7d, extend: true}")
    assert p["path"] == "extend" and len(p["leases"]) == 1 and p["leases"][0]["extensions"] == 4
    assert p["notifier_coverage"] == pytest.approx(7 / 21, abs=1e-3) and not p["findings"]
    assert p["peak_sus"] == pytest.approx(2 * 3 * (168 + 11 / 60), abs=0.1) and p["peak_at"] == "extension 1"
    assert (p["node_hours"], p["sus_needed"]) == (2160, 5040)  # held to 30 d; charged to the last end, 35 d
    moments = plan.moments(plan.leases(*_spec_now(tmp_path, "{duration: 7d, extend: true}"), 30 * 86400))
    t, what, [(seen, _)] = moments[1]
    assert what == "extension 1" and seen.end - t <= dt.timedelta(hours=48, days=7)
    p = _plan(tmp_path, "{duration: 7d, exemption: 'CHI ticket 12345'}")
    assert [f["ok"] for f in p["findings"]] == [True] and "CHI ticket 12345" in p["findings"][0]["line"]


def _spec_now(tmp_path, lease):
    spec = spec_of(tmp_path, "pl", nodes=3, lease=f"lease: {lease}\n")
    return spec, dt.datetime(2026, 11, 23, 12, 0)


def test_a_second_run_of_the_project_on_the_node_type_counts_and_is_reported(tmp_path):
    """The project's other run holds [-1,6] and has booked [5.5,12.5] (3 hosts each); this run is cold, [0,7] first,
    on a node type of 12 hosts. At 0: covered 7 + (6 - 0) + (12.5 - 5.5) = 20, window max(21, 12.5) - (-1) = 22:
    91% >= 90%, reported (the run alone: 33%). Hogging at 0: 3 + 3 + 3 = 9 > 12 / 2: reported. At 7 the other's
    first lease has ended: 7 + (12.5 - 7) = 12.5 over 28 - 5.5 = 22.5, 56%. This run's own earlier leases, named
    for it, are planned anew and not counted twice."""
    others = [("other-1122334455", -1, 6, 3), ("other_h-1122334456", 5.5, 12.5, 3), ("pl-1122334457", -1, 6, 3)]
    p = _plan(tmp_path, "{duration: 7d}", hosts=(12, 1.0), others=others)
    n = p["notifier"]
    assert p["notifier_coverage"] == pytest.approx(20 / 22, abs=1e-3)
    assert n["own_coverage"] == pytest.approx(1 / 3, abs=1e-3)
    assert n["other_leases"] == 2 and n["stacking_reported"]["at"] == "the run's start"
    assert n["hogging_reported"] == {"at": "the run's start", "reserved": 9, "hosts": 12}
    assert {f["rule"] for f in p["findings"]} == {"stacking", "notifier stacking", "hogging"}
    said = "\n".join(plan.lines(p))
    assert "with the project's 2 other lease(s) of gpu_local (GET /leases)" in said and "the run's own 33%" in said


def test_hogging_is_checked_on_every_node_type_unless_the_spec_narrows_it(tmp_path):
    """hammers' published config has high_end_node_types empty: a compute node type is checked as a GPU one is
    (Host.is_high_end is not what the check uses); lease.hogging_node_types narrows it; a node type of at most 4
    hosts is never checked (min_nodes_for_coverage)."""
    warm = "{duration: 2d, overlap: 30m}"
    p = _plan(tmp_path, warm, node_type="compute_local", run_for="4d", hosts=(10, 1.0))
    assert [f["rule"] for f in p["findings"]] == ["hogging"] and "6 of the 10" in p["findings"][0]["line"]
    assert not _plan(tmp_path, "{duration: 2d}", node_type="compute_local", run_for="4d", hosts=(10, 1.0))["findings"]
    narrowed = "{duration: 2d, overlap: 30m, hogging_node_types: [gpu_rtx_6000]}"
    p = _plan(tmp_path, narrowed, node_type="compute_local", run_for="4d", hosts=(10, 1.0))
    assert not p["findings"] and not p["notifier"]["hogging_checked"]
    assert "not in `lease.hogging_node_types`" in "\n".join(plan.lines(p))
    assert not _plan(tmp_path, warm, run_for="4d", hosts=(4, 1.0))["findings"]


def test_every_setting_the_advice_names_is_a_setting_of_the_spec(tmp_path):
    """The advice named "nodes.alternatives and a gap between leases": no setting makes a gap."""
    from appliance.spec import Spec

    def real(path: str) -> bool:
        tp = Spec
        for part in path.split("."):
            hints = typing.get_type_hints(tp)
            if part not in hints:
                return False
            tp = hints[part]
        return True

    others = [("other-1122334455", -1, 6, 3), ("other_h-1122334456", 5.5, 12.5, 3)]
    p = _plan(tmp_path, "{duration: 7d, overlap: 12h}", hosts=(12, 1.0), others=others)
    named = {m for f in p["findings"] for m in re.findall(r"`([a-z_]+\.[a-z_.]+)", f["line"])}
    assert {"lease.extend", "lease.exemption", "lease.book_ahead", "nodes.count", "lease.overlap"} <= named
    assert all(real(x) for x in named), named


def test_a_plan_without_a_credential_says_it_assumed_no_other_lease(tmp_path, monkeypatch):
    from appliance.errors import ApplianceError

    site = FakeSite()
    spec = spec_of(tmp_path, "pl", lease="lease: {duration: 1d}\n")

    def no_credential():
        raise ApplianceError("no OpenStack credentials")
    monkeypatch.setattr(type(site.cloud), "now", lambda self: no_credential())
    monkeypatch.setattr(FakeSite, "catalog", lambda self, nt, where: {
        "site": "CHI@UC", "hosts": 8, "su_factor": 1.0, "date": "2026-11-01", "table": "t", "hosts_from": "x",
        "su_factor_from": "y"}, raising=False)
    p = plan.make(flows.RunContext(spec, site), "3d")
    assert p["notifier"]["others_from"] == "assumed none"
    assert "the project's other leases not read (the site was not asked): none assumed" in "\n".join(plan.lines(p))


def test_a_leases_node_type_and_hosts_are_read_from_its_host_reservation():
    """GET /leases shows a user each lease's reservations, not its hosts: the node type is the one its
    resource_properties ask for (Blazar's grammar, an `and` too), the hosts its max."""
    from appliance.sites.openstack_api import LeaseInfo

    def lease(props, mx=3):
        return LeaseInfo.from_api({"id": "l", "name": "x", "status": "ACTIVE", "start_date": "2026-11-23 12:00",
                                   "end_date": "2026-11-24 12:00", "reservations": [
                                       {"id": "r", "resource_type": "physical:host", "min": 1, "max": mx,
                                        "resource_properties": props}]})
    assert (lease('["=", "$node_type", "gpu_v100"]').node_type, lease("[]").hosts) == ("gpu_v100", 3)
    assert lease('["and", ["=", "$gpu.gpu_count", "2"], ["==", "$node_type", "gpu_a100"]]').node_type == "gpu_a100"
    assert lease('["=", "$uid", "c9f98cc9"]').node_type is None and lease("not json").node_type is None
    assert lease("", mx="many").hosts == 0


# -- the run books as its plan says: the warm successor lease.book_ahead before its start -------------------------


def _warm(tmp_path, name, lease):
    import functools

    from appliance.flows.handover import Warm
    from appliance.provision import lifecycle
    from fakes import no_nodes

    site = FakeSite()
    spec = spec_of(tmp_path, name, lease=f"lease: {lease}\n")
    up = functools.partial(lifecycle.up, finish_nodes=no_nodes)
    current = up(site, spec)
    said = []
    w = Warm(flows.RunContext(spec, site), current, lambda ev, **kw: said.append(ev), None, 0.001, up=up)
    return site, spec, current, w, said


def _until(cond, n=20_000):
    import time

    for _ in range(n):
        if cond():
            return True
        time.sleep(0.001)
    return False


def test_the_next_lease_is_booked_when_the_plan_says_not_as_the_job_starts(tmp_path):
    """2 h leases, overlap 30m, book_ahead 1h: the plan books lease 2 at 0:30 (its start, 1:30, less 1 h); the run
    booked it as the job started (the portal charged both leases whole from then; the notifier counted both)."""
    from appliance.provision import lifecycle

    site, spec, current, w, said = _warm(tmp_path, "pc", "{duration: 2h, overlap: 30m}")
    printed = plan.make(flows.RunContext(spec, site), "3h")
    c, t0 = site.cloud, site.cloud.clock
    assert printed["leases"][1]["booked"] == f"{t0 + dt.timedelta(minutes=30):%Y-%m-%d %H:%M}"
    w.start()
    try:
        assert _until(lambda: len(c.verbs("get_lease")) > 5)  # it reads the current lease as it waits
        c.clock = t0 + dt.timedelta(minutes=29)
        assert _until(lambda: len(c.verbs("get_lease")) > 10)
        assert len(c.leases) == 1 and said == []  # a minute before: nothing booked
        c.clock = t0 + dt.timedelta(minutes=30)
        assert _until(lambda: len(c.leases) == 2)
        (nxt,) = [x for x in c.leases.values() if x.id != current.lease_id]
        assert (f"{nxt.start:%Y-%m-%d %H:%M}", f"{nxt.end:%Y-%m-%d %H:%M}") == \
            (printed["leases"][1]["start"], printed["leases"][1]["end"])
        assert _until(lambda: said) and said == ["next lease"]  # on the timeline once booked
    finally:
        w.abandon()
    lifecycle.down("pc", site=site)


def test_a_job_that_stops_before_the_booking_moment_has_its_next_lease_booked_then(tmp_path):
    """book_ahead 5m: due 35 min before the end; the job stopped 50 min before it (its stop margin grows with its
    commits): the next lease starts in 20 min, within overlap + stop_margin, so the handover books it now and
    waits for it rather than going cold."""
    import threading

    from appliance.provision import lifecycle

    site, spec, current, w, said = _warm(tmp_path, "pd", "{duration: 2h, overlap: 30m, book_ahead: 5m}")
    c = site.cloud
    c.clock = current.lease_end_at - dt.timedelta(minutes=50)
    w.start()
    assert _until(lambda: len(c.verbs("get_lease")) > 5) and len(c.leases) == 1
    got = {}
    t = threading.Thread(target=lambda: got.setdefault("cl", w.ready()), daemon=True)
    t.start()
    assert _until(lambda: len(c.leases) == 2)  # the clock stood still: booked because the handover came
    (nxt,) = [x for x in c.leases.values() if x.id != current.lease_id]
    assert nxt.start == current.lease_end_at - dt.timedelta(minutes=30)
    c.clock = nxt.start
    t.join(10)
    assert got["cl"] is not None and got["cl"].lease_id == nxt.id and said == ["next lease", "next cluster ready"]
    w.abandon()
    lifecycle.down("pd", site=site)


def test_when_the_current_lease_goes_before_the_booking_moment_nothing_is_booked_and_the_handover_is_cold(tmp_path):
    from appliance.provision import lifecycle

    site, spec, current, w, said = _warm(tmp_path, "pe", "{duration: 2h, overlap: 30m}")
    c = site.cloud
    w.start()
    assert _until(lambda: len(c.verbs("get_lease")) > 3)
    c.delete_lease(current.lease_id)  # Horizon, `appliance lease delete`: the job ends as at its lease end
    assert w.ready() is None and not c.verbs("create_lease")[1:]
    assert said[-1] in ("next cluster failed", "next lease abandoned")
    lifecycle.down("pe", site=site)
