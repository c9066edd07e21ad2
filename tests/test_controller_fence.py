"""A managed run's controller that lost its lock writes nothing more (issue 77 item 4, "fenced writes"): a laptop
suspended past the lock's ttl wakes with its heartbeat not yet due (time.monotonic does not count a suspend), and
wrote the run's state over the new controller's, its ledger entries gone, and booked a lease of its own. Before each
state write and each lease asked for, the controller reads the lock's newest generation from the store
(Control.fenced, RunLock.taken_by). Fast tier: a file:// store, the lock's clock a fake one."""

import json

import pytest

from appliance.errors import ApplianceError
from appliance.flows import control
from appliance.flows.leases import Asked
from appliance.provision import lifecycle
from appliance.store import runlock
from appliance.store.checkpoints import StoreUnavailable
from fakes import FakeSite
from test_fake_site import spec_of


@pytest.fixture
def run(tmp_path, monkeypatch):
    """(site, spec, a, b): controller ``a`` took the run, slept past its lock's ttl, and ``b`` took it over."""
    monkeypatch.delenv("APPLIANCE_CONTROLLER_LOCK_TTL", raising=False)
    spec = spec_of(tmp_path, "fz", lease=f"lease: {{duration: 2h}}\ncheckpoint: {{url: 'file://{tmp_path}/ck/'}}\n")
    clock, made = [1000.0], []

    def controller():
        c = control.Control(spec, None, poll=3600)  # its thread polls once an hour: the test does the rest
        c.lock.now = lambda: clock[0]  # the store's clock, as the lock reads it
        made.append(c)
        c.take()
        return c
    a = controller()
    clock[0] += a.lock.ttl + 1  # a's laptop sleeps; its heartbeat goes stale
    b = controller()
    yield FakeSite(), spec, a, b
    for c in made:
        c.close("stopped")


def state(tmp_path) -> str:
    return (tmp_path / "ck" / "fz" / "controller" / "state.json").read_text()


def test_a_controller_whose_lock_was_taken_over_writes_no_state_and_asks_for_no_lease(tmp_path, run, said):
    site, spec, a, b = run
    before = state(tmp_path)
    a.record("job end", job_id="late")  # a wakes: its next heartbeat is not due yet
    with pytest.raises(ApplianceError, match="another controller holds run fz now: this one asks for no lease"):
        lifecycle.book(site, spec, None, on_ask=Asked(a))
    a.parked(reason="no hosts")
    assert state(tmp_path) == before and not site.cloud.verbs("create_lease") and a.lost
    lines = [m for m in said if "another controller holds run fz" in m]
    assert len(lines) == 1 and b.id in lines[0] and f"on {b.lock.cluster}" in lines[0]


def test_the_holders_writes_go_through_and_the_old_controllers_do_not_erase_them(tmp_path, run):
    site, spec, a, b = run
    cl = lifecycle.book(site, spec, None, on_ask=Asked(b))
    b.record("next lease", lease_id=cl.lease_id)
    a.record("job end", job_id="late")  # it wrote its own state, without b's ledger entry, over b's
    a.close("failed")
    now = json.loads(state(tmp_path))
    assert now["asked"][cl.site.lease_name]["lease_id"] == cl.lease_id and not b.lost
    assert [v[0] for v in site.cloud.verbs("create_lease")] == [cl.site.lease_name]
    assert [e["event"] for e in now["events"]][-1] == "next lease" and now["controller"]["id"] == b.id


def test_a_lock_that_cannot_be_read_is_taken_neither_for_held_nor_for_lost(tmp_path, run, monkeypatch, said):
    site, spec, a, b = run
    monkeypatch.setattr(runlock, "READ_WAIT", 0.0)  # one failed read, and the store counts as down
    down, lister = [True], a.cs.store.list

    def listing(*args, **kw):
        if down[0]:
            raise ConnectionResetError("reset by peer")
        return lister(*args, **kw)
    monkeypatch.setattr(a.cs.store, "list", listing)
    before = state(tmp_path)
    a.record("job end", job_id="late")
    with pytest.raises(StoreUnavailable, match="list the run's lock"):
        lifecycle.book(site, spec, None, on_ask=Asked(a))
    assert state(tmp_path) == before and not site.cloud.verbs("create_lease") and not a.lost  # not held, not lost
    assert any("state is not written: could not read its lock" in m for m in said)
    assert not any("another controller holds" in m for m in said)
    down[0] = False  # the store answers again: now a finds it lost the run
    a.record("job end", job_id="late")
    assert a.lost and state(tmp_path) == before
