"""sites/slots.py: the earliest start at which a lease's hosts are free, from Blazar's hosts and allocations."""

import datetime as dt

from appliance.sites.slots import earliest_slot

T = dt.datetime(2026, 12, 1, 10, 0)
HOSTS = [{"id": str(i), "node_type": "gpu" if i > 4 else "cpu"} for i in range(1, 7)]


def held(host, start_h, end_h):
    fmt = lambda h: (T + dt.timedelta(hours=h)).strftime("%Y-%m-%dT%H:%M:%S.%f")  # noqa: E731
    return {"resource_id": host, "reservations": [{"id": "r", "lease_id": "l", "start_date": fmt(start_h),
                                                   "end_date": fmt(end_h)}]}


def test_free_now_is_now():
    assert earliest_slot(HOSTS, [], "cpu", 4, dt.timedelta(hours=2), T) == T


def test_the_first_moment_enough_hosts_are_free_for_the_whole_duration():
    allocs = [held("1", 0, 3), held("2", 0, 1), held("3", 2, 5)]  # host 4 is free throughout
    two_h = dt.timedelta(hours=2)
    assert earliest_slot(HOSTS, allocs, "cpu", 2, two_h, T) == T  # 3 (until its 2 h) and 4
    assert earliest_slot(HOSTS, allocs, "cpu", 3, two_h, T) == T + dt.timedelta(hours=3)  # 1, 2 and 4 from 3 h
    assert earliest_slot(HOSTS, allocs, "cpu", 4, two_h, T) == T + dt.timedelta(hours=5)  # all, once 3 is free


def test_starts_are_whole_minutes_and_too_few_hosts_is_none():
    odd = T + dt.timedelta(seconds=90)
    assert earliest_slot(HOSTS, [], "gpu", 2, dt.timedelta(hours=1), odd) == T + dt.timedelta(minutes=2)
    assert earliest_slot(HOSTS, [], "gpu", 3, dt.timedelta(hours=1), T) is None
    assert earliest_slot(HOSTS, [], "fpga", 1, dt.timedelta(hours=1), T) is None
