"""A managed run's node-hours ledger (flows/budget.py Ledger), fast tier: every lease the run asks for or adopts is
on it from its start to its deletion, whatever became of Blazar's answer or of the first read of its dates."""

from __future__ import annotations

import datetime as dt
import functools
import threading

from appliance import flows
from appliance.errors import Unavailable
from appliance.flows import managed
from appliance.flows.budget import Ledger
from appliance.flows.leases import reconcile
from appliance.provision import lifecycle
from conftest import write_spec
from fakes import FakeSite, no_nodes

HOUR = dt.timedelta(hours=1)


def _run_spec(tmp_path, monkeypatch, name):
    monkeypatch.setenv("APPLIANCE_CONTROLLER_LOCK_INTERVAL", "0.02")
    spec = flows.check(str(write_spec(tmp_path, "python x.py", code=tmp_path, name=name,
                                      extra=f"checkpoint: {{url: 'file://{tmp_path}/ck/'}}\n")))
    return spec, managed.Control(spec, None, poll=0.005)


def test_a_lease_found_by_its_name_and_deleted_by_reconcile_is_on_the_ledger_to_its_deletion(tmp_path, monkeypatch):
    """Blazar made the lease and its answer was lost (the controller was killed, or a 504): the asked entry has no
    id, so nothing ever put it on the ledger; the run went on on another lease, and reconcile found the first by its
    name and deleted it: 2 nodes x 30 min, paid for, and missing from limits.node_hours."""
    spec, control = _run_spec(tmp_path, monkeypatch, "lr")
    site = FakeSite()
    c, t0 = site.cloud, site.cloud.clock
    control.asked("lr-1123120000", {"cluster": "lr", "site": None, "node_type": "compute_local", "nodes": 2})
    made = c.create_lease("lr-1123120000", "compute_local", 2, 2 * HOUR)  # ... and its answer lost
    c.clock = t0 + HOUR / 4
    functools.partial(lifecycle.up, finish_nodes=no_nodes)(site, spec)  # the run went on on a lease of its own
    c.clock = t0 + HOUR / 2
    ledger = Ledger({})
    assert reconcile(flows.RunContext(spec, site), control, ledger) == [made.id]
    e = ledger.copy()[made.id]
    assert (e["nodes"], e["node_type"], e["closed"]) == (2, "compute_local", True)
    assert e["closed_at"] == "2026-11-23T12:30:00Z"
    c.clock = t0 + 5 * HOUR
    assert ledger.node_hours(c.clock) == (1.0, 0.0)  # to its deletion, not to its end nor to now
    assert control.state["leases"][made.id]["closed"]  # into the run's state (a takeover counts it)


def test_a_lease_the_run_adopts_is_on_the_ledger_though_the_first_read_of_its_dates_fails(tmp_path, monkeypatch):
    """`appliance up` first, then `appliance run`: the run goes on on that cluster (recovery.again), a lease it did
    not ask for. It was counted only at the job's start, by one read in a thread of its own; one Blazar error there
    left it off the ledger for good."""
    spec, control = _run_spec(tmp_path, monkeypatch, "la")
    site = FakeSite()
    c, t0 = site.cloud, site.cloud.clock
    up = functools.partial(lifecycle.up, finish_nodes=no_nodes)
    own = up(site, spec)  # `appliance up`: no ledger, no asked entry
    monkeypatch.setattr(lifecycle, "up", up)
    read, failed = c.get_lease, []

    def get_lease(lid):  # the read beside the strategy fails once (Blazar 503 after keystoneauth's retries)
        if threading.current_thread() is not threading.main_thread() and not failed:
            failed.append(lid)
            raise Unavailable("Blazar is not answering (HTTP 503, asked again with back-off)")
        return read(lid)
    c.get_lease = get_lease
    run = managed._Run(flows.RunContext(spec, site), control, 0, None)
    cl, _ = run.recovery.next_cluster({})
    run.settle()
    assert cl.lease_id == own.lease_id and failed == [own.lease_id]
    assert run.ledger.copy()[own.lease_id]["start"] is None  # held: on the ledger, its dates not read yet
    c.clock = t0 + HOUR
    run.account()  # the next look (a job's end, a booking) reads them
    assert run.ledger.node_hours(c.clock) == (2.0, 6.0)  # 2 nodes: 1 h spent, 3 h of its 4 h to come
    c.clock = t0 + 1.5 * HOUR
    lifecycle.down("la", site=site)
    run.close_ledger()  # the run's end: what it deleted, closed
    assert run.ledger.node_hours(c.clock + HOUR) == (3.0, 0.0)
    assert control.state["leases"][own.lease_id]["closed"]
