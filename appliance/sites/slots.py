"""When a lease can start: the earliest time at which enough hosts of a node type are free for a duration, from
Blazar's host list and host allocations (GET /v1/os-hosts and /v1/os-hosts/allocations: ChameleonCloud/blazar
blazar/api/v1/oshosts/v1_0.py). python-chi's `Node.next_free_timeslot` (chi/hardware.py) finds one host's next gap
the same way; a lease of N hosts needs N of them free over the same span."""

from __future__ import annotations

import datetime as dt

BLAZAR_ISO = "%Y-%m-%dT%H:%M:%S.%f"  # an allocation's dates (chi/hardware.py _parse_blazar_dt)


def _date(s: str) -> dt.datetime:
    try:
        return dt.datetime.strptime(s, BLAZAR_ISO)
    except ValueError:
        return dt.datetime.fromisoformat(s.replace("Z", "")).replace(tzinfo=None)


def earliest_slot(hosts: list[dict], allocations: list[dict], node_type: str, count: int, duration: dt.timedelta,
                  after: dt.datetime) -> dt.datetime | None:
    """The earliest start at or after ``after`` (naive UTC) at which ``count`` reservable hosts of ``node_type`` are
    all free for ``duration``; None when the site has fewer such hosts. A start is either ``after`` or the end of a
    reservation on one of them (the moment a host comes free), rounded up to Blazar's whole minutes."""
    ids = {str(h["id"]) for h in hosts if h.get("node_type") == node_type and h.get("reservable", True) is not False}
    if len(ids) < count:
        return None
    spans: dict[str, list[tuple[dt.datetime, dt.datetime]]] = {i: [] for i in ids}
    for a in allocations:
        if str(a.get("resource_id")) in spans:
            spans[str(a["resource_id"])] += [(_date(r["start_date"]), _date(r["end_date"]))
                                             for r in a.get("reservations") or []]
    ends = {e for held in spans.values() for _, e in held if e > after}
    for t in sorted({after} | ends):
        t = _minute_up(t)
        free = sum(all(e <= t or s >= t + duration for s, e in held) for held in spans.values())
        if free >= count:
            return t
    return None


def _minute_up(t: dt.datetime) -> dt.datetime:
    """Blazar's dates are whole minutes (blazar/manager/service.py LEASE_DATE_FORMAT)."""
    return t if (t.second, t.microsecond) == (0, 0) else t.replace(second=0, microsecond=0) + dt.timedelta(minutes=1)
