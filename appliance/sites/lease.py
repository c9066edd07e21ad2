"""One lease at its site: what it is now, the one wait until it is ACTIVE, and the one way the appliance extends a
lease. The lease watchdog beside a job (checkpoint/watchdog.py: at its extension point before the stop), a managed
run's next-lease maker (flows/handover.py: before it books the next lease), a managed run's wait for a free slot
and `up`'s wait for a new lease all go through it; when and by how much to extend stays theirs.

What a lease's status means is LeaseInfo's (openstack_api.py: ended, unusable, over); Chameleon's rules for an
extension (within 48 h of the end, at most 7 days past it) are the cloud's ``extend_lease``.
"""

from __future__ import annotations

import datetime as dt
from collections.abc import Callable

from ..errors import ApplianceError
from .openstack_api import LeaseInfo

# (lease id, its current end) -> (the most it may be extended by, or None; why not): a managed run's limits
Limit = Callable[[str, dt.datetime], tuple[dt.timedelta | None, str]]


class Lease:
    """A lease of the run by its id, at the site whose cloud (``cloud``: a Site's ``cloud``) holds it."""

    def __init__(self, cloud, lease_id: str):
        self.cloud, self.id = cloud, lease_id

    def info(self) -> LeaseInfo | None:
        """Blazar's record of it now (None: gone)."""
        return self.cloud.get_lease(self.id)

    def until_active(self, stopped: Callable[[], bool], pause: Callable[[], object],
                     seen: Callable[[LeaseInfo | None], None] | None = None) -> LeaseInfo | None:
        """Polled until ACTIVE; returned as last seen when it can no longer start (gone: None; ERROR, ended) or once
        ``stopped()`` (asked after each read: its status then whatever it was). ``pause()`` waits between reads;
        ``seen(info)`` hears each read (and may raise: a lease that lost a host)."""
        while True:
            info = self.info()
            if seen is not None:
                seen(info)
            if info is None or info.unusable or info.status == "ACTIVE" or stopped():
                return info
            pause()

    def extend(self, by: dt.timedelta, end: dt.datetime, limit: Limit | None = None) -> tuple[LeaseInfo | None, str]:
        """Extended by ``by``, at most what ``limit(id, end)`` allows (``end``: its end as last read). Returns (its
        record with the new end, "") or (None, why not: the limit, or the cloud's refusal in one line: Chameleon's
        48 h window or 7-day cap, hosts reserved after the end by another lease)."""
        if limit is not None:
            most, why = limit(self.id, end)
            if most is None:
                return None, why
            by = min(by, most)
        try:
            return self.cloud.extend_lease(self.id, by=by), ""
        except ApplianceError as e:
            return None, e.message
