"""Chameleon's lease-stacking notifier, computed as its code computes it: ChameleonCloud/hammers
``hammers/scripts/lease_stack_notifier.py`` (Apache-2.0; its ``LeaseComplianceManager``, ``Project``, ``Lease`` and
``Host``), re-implemented here from reading it, for the leases of one project and one node type. ``run --plan``
(plan.py) asks it about the leases a run will hold at each moment, with the project's other leases.

What the notifier does, per project and node type, at the moment it runs (``DATETIME_NOW``):
- it reads every lease (``LeaseComplianceManager._update_leases``) but those TERMINATED, ERROR or DELETING, with the
  hosts allocated to each (``_update_from_allocations``);
- **stacking** (``Project.get_coverage_by_node_type``, ``get_lease_stacking_violations``): each lease counts one
  host per node type (``Lease.add_host`` marks a second host of a node type the lease has already as not counted;
  ``Project._host_in_overlapping_reservation`` never undoes that for a lease of one node type: it always meets the
  lease itself or a lease of that node type first), for its time from now (or its start, if later) to its end. The
  window is from the earliest start of the project's leases of the node type (a lease that began days ago counts
  its start) to the furthest end, at least now + ``minimum_lease_window_days``
  (``Project.furthest_end_date_by_node_type``'s default). A window shorter than that is not checked; covered time
  over the window at or above ``lease_coverage_threshold`` is reported;
- **hogging** (``Project.get_high_end_hogging_violations``): every host of the leases that end between now and now
  + the window counts; a node type of at most ``min_nodes_for_coverage`` hosts at the site is not checked, nor one
  missing from ``high_end_node_types`` when that list is not empty; more than
  ``high_end_node_coverage_threshold`` of the node type's hosts is reported.

The thresholds are those of its published test config (``hammers/scripts/tests/lease-stacking-test-config.json``):
production's are not public. Its ``high_end_node_types`` there is empty, so every node type is checked for hogging;
``lease.hogging_node_types`` in the spec narrows it (``Host.is_high_end``'s gpu/storage/fpga test is not what the
check uses).
"""

from __future__ import annotations

import dataclasses
import datetime as dt

DAY = 86400
COVERAGE = 0.9  # lease_coverage_threshold
WINDOW_S = 21 * DAY  # minimum_lease_window_days
HOG_SHARE = 0.5  # high_end_node_coverage_threshold
HOG_MIN_NODES = 4  # min_nodes_for_coverage: a node type of at most this many hosts is not checked
SKIPPED = ("terminated", "error", "deleting")  # LeaseComplianceManager._update_leases


@dataclasses.dataclass(frozen=True)
class Seen:
    """A lease as the notifier reads it: Blazar's dates and status, its node type and how many hosts it holds."""

    start: dt.datetime
    end: dt.datetime
    node_type: str
    hosts: int
    status: str = "ACTIVE"


def read(leases: list[Seen], node_type: str) -> list[Seen]:
    """The leases of ``node_type`` the notifier reads (not ended, in error or being deleted) and that hold a host."""
    return [x for x in leases if x.node_type == node_type and x.hosts > 0 and x.status.lower() not in SKIPPED]


def stacking(leases: list[Seen], node_type: str, now: dt.datetime) -> dict | None:
    """The notifier's stacking figure for the project's ``leases`` at ``now``: {coverage (a share), covered_days,
    window_days, reported}; None when it does not check (no lease, or a window shorter than WINDOW_S)."""
    mine = read(leases, node_type)
    if not mine:
        return None
    covered = sum((x.end - max(now, x.start)).total_seconds() for x in mine)  # one host per lease
    furthest = max([now + dt.timedelta(seconds=WINDOW_S), *(x.end for x in mine)])
    window = (furthest - min(x.start for x in mine)).total_seconds()
    if window < WINDOW_S:
        return None
    share = covered / window
    return {"coverage": share, "covered_days": covered / DAY, "window_days": window / DAY,
            "reported": share >= COVERAGE}


def hogging(leases: list[Seen], node_type: str, now: dt.datetime, site_hosts: int | None,
            narrowed: tuple[str, ...] = ()) -> dict:
    """The notifier's hogging figure at ``now``: {reserved (hosts of the leases ending within the window), hosts
    (the node type's at the site), checked, reported}. ``narrowed``: its high_end_node_types (empty: every type)."""
    end_by = now + dt.timedelta(seconds=WINDOW_S)
    reserved = sum(x.hosts for x in read(leases, node_type) if now <= x.end <= end_by)
    checked = (not narrowed or node_type in narrowed) and site_hosts is not None and site_hosts > HOG_MIN_NODES
    return {"reserved": reserved, "hosts": site_hosts, "checked": checked,
            "reported": bool(checked and reserved > HOG_SHARE * site_hosts)}
