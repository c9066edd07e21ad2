"""What Chameleon runs beside Blazar and Nova that a managed run meets: SU enforcement by its portal's balance
service, and the hammer that deletes leases nobody uses. Both follow public code; what is not public is said.

SU enforcement (ChameleonCloud/portal ``balance_service/enforcement/usage_enforcement.py``, reached through Blazar's
``ExternalServiceFilter``, ChameleonCloud/blazar ``blazar/enforcement/filters/external_service_filter.py``):
- a new lease is charged at its creation for its whole window: hours x the sum of its hosts' ``su_factor``
  (``_evaluate_lease``, ``_total_su_factor``; a host's ``su_factor`` is an extra capability, default 1.0:
  ``DEFAULT_SU_FACTOR``; floating IPs are free: ``__get_billrate``);
- it is refused when the project's balance would go below zero: the portal answers 403 with
  "Reservation for project X would spend N SUs, only M left" (``check_usage_against_allocation``), which Blazar's
  filter raises as ``ExternalServiceFilterException`` (HTTP 400, ``blazar/enforcement/exceptions.py``) with that
  message; an extension is refused as "Reservation update would spend N more SUs, only M left"
  (``check_usage_against_allocation_update``);
- a lease deleted stops its charge then (an unstarted one costs nothing: ``stop_charging``).
The balance here is one number per project (``cloud start --su-budget``; none: no enforcement, as a project whose
allocation the portal does not limit). Chameleon's real balances, member budgets and allocation expiry (its own
messages) are not simulated.

The unutilized-lease reaper (ChameleonCloud/hammers ``hammers/scripts/unutilized_lease_reaper.py``): an ACTIVE lease
none of whose nodes is provisioned and none of whose nodes changed provision state since its start
(``inviolation_filter``: here, no server was ever placed on its hosts) is deleted 9 h after its start
(``DEFAULT_GRACE_HOURS``; the warning at ``DEFAULT_WARN_HOURS``, 6, is mail, not simulated). Time is the cloud's
clock.
"""

from __future__ import annotations

from .state import ApiError, HostReservation, Lease

REAP_AFTER_S = 9 * 3600  # hammers' unutilized_lease_reaper.py default grace, in cloud seconds
DEFAULT_SU_FACTOR = 1.0  # usage_enforcement.py DEFAULT_SU_FACTOR
PROJECT = "CHI-local"  # the charge code the portal names in its refusal (Chameleon's look like CHI-123456)


class Portal:
    def __init__(self, cloud, su_budget: float | None = None):
        self.cloud = cloud
        self.su_budget = su_budget  # None: not enforced
        self.charges: dict[str, tuple[float, float, float]] = {}  # lease id -> (rate SU/h, start, charged until)

    # -- SUs ----------------------------------------------------------------------------------------

    def rate(self, host_ids) -> float:
        caps = {h.id: h.capabilities for h in self.cloud.hosts}
        return sum(float(caps.get(h, {}).get("su_factor") or DEFAULT_SU_FACTOR) for h in host_ids)

    def used(self) -> float:
        return sum(rate * max(0.0, until - start) / 3600 for rate, start, until in self.charges.values())

    def left(self) -> float | None:
        return None if self.su_budget is None else self.su_budget - self.used()

    def charge(self, lease: Lease) -> None:
        """A new lease: charged for its whole window, or refused (the caller has not stored it yet)."""
        rate = self.rate(lease.hosts())
        amount = rate * (lease.end - lease.start) / 3600
        left = self.left()
        if left is not None and left - amount < 0:
            raise ApiError(400, f"Reservation for project {PROJECT} would spend {amount:.2f} SUs, only {left:.2f} "
                                "left", "ExternalServiceFilterException")
        self.charges[lease.id] = (rate, lease.start, lease.end)

    def charge_update(self, lease: Lease, new_end: float) -> None:
        """An extension to ``new_end``: the difference charged, or refused."""
        rate, start, until = self.charges.get(lease.id, (self.rate(lease.hosts()), lease.start, lease.end))
        more = rate * (new_end - until) / 3600
        left = self.left()
        if left is not None and more > left:
            raise ApiError(400, f"Reservation update would spend {more:.2f} more SUs, only {left:.2f} left",
                           "ExternalServiceFilterException")
        self.charges[lease.id] = (rate, start, new_end)

    def stop_charging(self, lease: Lease, now: float) -> None:
        """A lease ended or deleted: charged up to now (not past its end; an unstarted one, nothing)."""
        if lease.id in self.charges:
            rate, start, until = self.charges[lease.id]
            self.charges[lease.id] = (rate, start, max(start, min(until, now)))

    # -- the reaper ---------------------------------------------------------------------------------

    def unused(self, now: float) -> list[Lease]:
        """ACTIVE leases with host reservations on which no server was ever launched, REAP_AFTER_S after their
        start: what the reaper deletes."""
        c = self.cloud
        launched = {s.lease for s in c.servers.values() if s.host}  # a node was deployed for it
        return [x for x in c.leases.values() if x.status == "ACTIVE" and now - x.start >= REAP_AFTER_S
                and x.id not in launched and any(isinstance(r, HostReservation) for r in x.reservations)]
