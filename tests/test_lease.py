"""sites/lease.py: the one wait until a lease is ACTIVE (a managed run's slot and next lease, `up`'s wait_lease) and
the one way the appliance extends a lease (the watchdog, a managed run's next-lease maker), against a scripted
cloud: what each returns for each answer Blazar can give."""

import datetime as dt

import pytest

from appliance.errors import ApplianceError
from appliance.sites.lease import Lease
from appliance.sites.openstack import OpenStackCloud
from appliance.sites.openstack_api import LeaseInfo
from fakes import fault

T0 = dt.datetime(2026, 1, 5, 12, 0)


def info(status="PENDING", **kw) -> LeaseInfo:
    return LeaseInfo(id="L", name="run", status=status, start=T0, end=T0 + dt.timedelta(hours=4),
                     reservation_id="R", fip_reservation_id=None, degraded=kw.pop("degraded", False), **kw)


class Scripted:
    """get_lease answers in turn (the last one again); extend_lease moves the end or raises ``refuse``."""

    def __init__(self, *answers, refuse=None):
        self.answers, self.reads, self.refuse, self.extended = list(answers), 0, refuse, []

    def get_lease(self, lease_id):
        self.reads += 1
        return self.answers[min(self.reads, len(self.answers)) - 1]

    def extend_lease(self, lease_id, *, by=None, to=None):
        if self.refuse is not None:
            raise self.refuse
        self.extended.append(by)
        return info("ACTIVE") if by is None else LeaseInfo(**{**info("ACTIVE").__dict__, "end": T0 + by})


@pytest.mark.parametrize("last", [info("ACTIVE"), info("ERROR"), info("TERMINATED"), None])
def test_until_active_returns_at_active_or_when_it_can_no_longer_start(last):
    c = Scripted(info(), info(), last)
    pauses = []
    assert Lease(c, "L").until_active(lambda: False, lambda: pauses.append(1)) == last
    assert c.reads == 3 and len(pauses) == 2


def test_until_active_stops_when_asked_and_hears_each_read():
    c, seen = Scripted(info()), []
    n = iter(range(10))
    got = Lease(c, "L").until_active(lambda: next(n) >= 4, lambda: None, seen.append)
    assert got.status == "PENDING" and c.reads == 5 and len(seen) == 5


def test_extend_caps_by_the_limit_and_says_why_not():
    c = Scripted(info("ACTIVE"))
    new, why = Lease(c, "L").extend(dt.timedelta(hours=6), T0, lambda lid, end: (dt.timedelta(hours=2), ""))
    assert new.end == T0 + dt.timedelta(hours=2) and why == "" and c.extended == [dt.timedelta(hours=2)]
    assert Lease(c, "L").extend(dt.timedelta(hours=6), T0, lambda lid, end: (None, "limits.node_hours 10")) \
        == (None, "limits.node_hours 10")
    assert len(c.extended) == 1  # the limit's refusal asks nothing of Blazar
    refused = Scripted(info("ACTIVE"), refuse=fault("Blazar: not enough hosts available"))
    assert Lease(refused, "L").extend(dt.timedelta(hours=1), T0) == (None, "Blazar: not enough hosts available")


def wait(*answers, timeout=60.0):
    c = OpenStackCloud.__new__(OpenStackCloud)  # only get_lease is used: answered in turn
    s = Scripted(*answers)
    c.get_lease = s.get_lease
    return c.wait_lease("L", timeout=timeout, poll=0)


def test_wait_lease_fails_fast_with_one_line_for_each_way_a_lease_cannot_start(monkeypatch):
    assert wait(info(), info("ACTIVE", degraded=True)).status == "ACTIVE"  # degraded alone: a note
    for answers, line in [((info(), info("ERROR")), r"is in ERROR"),
                          ((info(), None), r"disappeared while waiting"),
                          ((info("TERMINATED"),), r"has ended \(TERMINATED\)"),
                          ((info("PENDING", missing_resources=True),), r"missing a reserved host.*reallocate")]:
        with pytest.raises(ApplianceError, match=line):
            wait(*answers)
    with pytest.raises(ApplianceError, match=r"not ACTIVE after 0s \(status PENDING"):
        wait(info(), timeout=0.0)
