"""A managed run's leases asked for, in the store: every lease the run asks Blazar for is written to the run's
controller state (``state["asked"]``, by lease name) *before* Blazar is asked, and again with the answer (its id, or
the refusal). A lease costs SUs from the moment Blazar makes it, and a controller can be killed between the asking
and the answer, or its machine can go with the cluster records that name its leases: a controller that takes the
run over, on any machine, reads these entries and finds each lease again at its site by its name (Blazar lists
them; a lease made but never answered has no id on record). Each found is kept when a cluster record of this
machine uses it, or the run's current cluster in its state in the store does (runcluster.py: any machine with the
spec's key can rebuild it; the run's own cluster goes on, or goes, by the rules of managed.py), else deleted:
nobody would ever use it, and it would be paid for until its end. Nothing of another run is touched: only leases
under the names this run recorded, at the sites it recorded.
"""

from __future__ import annotations

import dataclasses
import datetime as dt

from .. import report
from ..cluster import find_cluster
from ..errors import ApplianceError
from ..provision import lifecycle
from .runcluster import leases_in_state

log = report.get(__name__)


class Asked:
    """``on_ask`` for lifecycle.up/book: each lease the run asks for, into the controller's state (written to the
    store before Blazar is asked: a write that fails stops the asking), and, once Blazar made it, into the run's
    ledger of node-hours (``track``: booked-ahead leases are counted from the moment they exist)."""

    def __init__(self, control, track=None):
        self.control, self.track = control, track

    def __call__(self, name: str, entry: dict, info) -> None:
        self.control.asked(name, entry)
        if info is not None and self.track is not None:
            self.track(info, entry.get("nodes") or 0, entry.get("node_type") or "", entry.get("site"))


def reconcile(ctx, control, ledger=None) -> list[str]:
    """The leases the run asked for that are still open at their site and that neither a cluster record of this
    machine nor the current cluster in the run's state uses, deleted; each entry found closed is marked so. Returns
    what was deleted (said, and on the timeline). A site that does not answer leaves its entries for the next
    controller (said). ``ledger``: the run's node-hours (budget.Ledger): each lease found is on it (one whose
    answer was lost never was), and one deleted is counted to its deletion."""
    asked = dict(control.state.get("asked") or {})
    gone, by_site = [], {}
    kept_ids, kept_names = leases_in_state(control)  # the run's current cluster, in its state
    for name, e in asked.items():
        if not e.get("closed") and not e.get("refused"):
            by_site.setdefault(e.get("site"), []).append(name)
    for site, names in by_site.items():
        try:
            cloud = ctx.at(site).cloud
            listed = [x for x in cloud.list_leases() if x.name in names]
        except ApplianceError as e:
            log.info(f"[run] warning: could not list the run's leases{f' at {site}' if site else ''} ({e.message}); "
                     "the next controller looks again")
            continue
        for name in names:
            mine = [x for x in listed if x.name == name and not x.ended]  # an ERROR lease keeps its hosts
            rec = find_cluster(asked[name].get("cluster") or "")
            used = {info.id for info in mine if info.id in kept_ids or info.name in kept_names or rec is not None and (
                rec.lease_id == info.id or not rec.lease_id and rec.site.lease_name == info.name)}
            for info in mine:
                if ledger is not None:  # on the run's ledger from its start, whatever its answer was
                    e = asked[name]
                    ledger.track(info, e.get("nodes") or info.hosts, e.get("node_type") or info.node_type or "",
                                 site if site != ctx.spec.site else None)
                if info.id in used:  # the record's lease, or the one its `up` asked for by name and will use
                    continue
                if _adopt(ctx, control, site, asked[name], info, listed):
                    used.add(info.id)
                    continue
                log.info(f"[run] lease {info.name} ({info.id}{f' at {site}' if site else ''}) was asked for by an "
                         "earlier controller of the run and nothing here uses it: deleting it")
                cloud.delete_lease(info.id)
                gone.append(info.id)
                if ledger is not None:
                    ledger.close(info.id, _now(cloud))
                control.record("lease deleted", lease_id=info.id, name=info.name, reason="left by an earlier controller")
            if not any(x.id in used for x in mine):
                control.asked(name, {**asked[name], "closed": True})
    if ledger is not None:
        control.update(leases=ledger.copy())
    return gone


def _now(cloud):
    """The cloud's clock, to count a lease deleted to its deletion; ours (UTC) when it does not answer."""
    try:
        return cloud.now()
    except Exception:  # noqa: BLE001 - a read after a delete that worked: the next refresh has it
        return dt.datetime.now(dt.timezone.utc).replace(tzinfo=None)


def _adopt(ctx, control, site: str | None, entry: dict, info, listed: list) -> bool:
    """A lease of the run's own cluster (RUN, or RUN_h: its next one) that an earlier controller made, on another
    machine or killed before it recorded it, that has started and not ended (one booked ahead, not started, is
    deleted: nothing here would wait for it), while the record here of that cluster is of a lease that is over (or
    there is none): it is the run's to go on on (recovery.Recovery.existing), so its record here becomes that lease
    (lifecycle.record_lease: `up` then uses the servers made on it), it goes on the run's ledger, and it is kept.
    ``listed``: the run's leases at the site. False: not adopted."""
    from .handover import other_name

    name, run = entry.get("cluster") or "", ctx.spec.name
    if name not in (run, other_name(run, run)) or getattr(info, "status", None) != "ACTIVE":
        return False
    where = ctx.at(site)
    now = where.cloud.now()
    running = {x.id for x in listed if not x.over(now)}
    if info.id not in running:
        return False
    rec = find_cluster(name)
    if rec is not None and not rec.lease_id and rec.site.lease_name:
        return False  # the record here is of a lease being asked for: that one is the cluster's
    if rec is not None and rec.lease_id and rec.lease_id not in running:  # one the run did not ask for (`up`)?
        try:
            theirs = next((x for x in listed if x.id == rec.lease_id), None) or where.cloud.get_lease(rec.lease_id)
        except ApplianceError as e:  # cannot tell which is the cluster's: neither goes, the next look decides
            log.info(f"[run] warning: lease {rec.lease_id} of cluster {name} could not be read ({e.message}); "
                     f"lease {info.name} is kept for now")
            return True
        if theirs is not None and not theirs.over(now):
            running.add(rec.lease_id)
    if rec is not None and rec.lease_id in running:
        return False  # the record here is of a lease that runs: that one is the cluster's
    try:
        if rec is not None:  # what is left of its cluster on the lease that is over (a floating IP) goes first
            lifecycle.down(name, where)
        lifecycle.record_lease(where, dataclasses.replace(ctx.spec, name=name, site=site or ctx.spec.site), info)
    except ApplianceError as e:  # looked at again by the next controller (or after the cloud's next outage)
        log.info(f"[run] warning: lease {info.name} ({info.id}) of cluster {name} is not taken on here ({e.message})")
        return True
    log.info(f"[run] lease {info.name} ({info.id}{f' at {site}' if site else ''}) of run {run}'s cluster {name}, made "
             "by an earlier controller, still runs: the run goes on with it")
    control.record("lease adopted", lease_id=info.id, name=info.name, cluster=name)
    if control.on_ask is not None:  # into the run's ledger of node-hours, with its asked entry answered
        control.on_ask(info.name, {**entry, "lease_id": info.id}, info)
    return True


def booked_for(ctx, control, cluster: str):
    """The lease an earlier controller of the run booked for its cluster ``cluster`` (its warm successor: asked for,
    answered, not closed), still open at its site: (its asked entry, the lease). None: none, or the site did not
    answer (the caller books as it would have). A controller on another machine has no record of it, only the
    run's state in the store."""
    found = []
    for name, e in (control.state.get("asked") or {}).items():
        if e.get("cluster") != cluster or e.get("closed") or e.get("refused") or not e.get("lease_id"):
            continue
        try:
            info = ctx.at(e.get("site")).cloud.get_lease(e["lease_id"])
        except ApplianceError as err:
            log.info(f"[run] warning: lease {name} ({e['lease_id']}) could not be read ({err.message})")
            return None
        if info is not None and not info.unusable and info.status not in GOING:
            found.append((e, info))
    return max(found, key=lambda x: x[1].end, default=None)  # an older lease of the name ends first


GOING = ("TERMINATING", "DELETING")  # Blazar's lease statuses on the way to TERMINATED, DELETED (blazar/status.py)
