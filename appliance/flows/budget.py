"""What a managed run has spent, what it may still spend, and when it should finish (issue 52 items 1 and 7).

Node-hours are what Chameleon charges for: a lease's nodes for its reserved time (1 SU = 1 node-hour on a base
node, more on GPU nodes: Chameleon's FAQ; ChameleonCloud/portal balance_service charges a lease's window x its hosts'
su_factor), from its start to its end, or to its
deletion when it is deleted early (assumed: the charge of a lease cut short is not public). The ``Ledger`` keeps
every lease the run has held, in the controller's state in the store, so a controller that takes the run over
counts what the ones before it spent. An overlap (lease.overlap) counts twice: both leases run through it.

``Budget.lease_seconds`` is the longest lease the run may book from a given start: the spec's lease.duration, cut
to the node-hours left (limits.node_hours, less what is spent and booked ahead) and to limits.deadline. A lease
shorter than ``FLOOR_S`` plus twice the stop margin is not booked (its boot, 10-20 minutes on Chameleon, would
take most of it): the run has reached its limit then, and ends with its checkpoint.
"""

from __future__ import annotations

import datetime as dt
import threading

from ..spec import Spec, deadline_of, duration_seconds

FLOOR_S = 1800  # the least lease worth booking, before the stop margins: a bare-metal boot takes 10-20 minutes


def _iso(t: dt.datetime) -> str:
    return t.isoformat(timespec="seconds") + "Z"


def _at(text: str) -> dt.datetime:
    return dt.datetime.fromisoformat(text.removesuffix("Z"))


class Ledger:
    """The leases a run holds or held: ``leases`` maps a lease id to {nodes, node_type, start, end, closed,
    closed_at} (dates in the cloud's UTC, ISO; ``end`` as Blazar had it, ``closed_at`` when the run deleted it or
    saw it gone; start and end None while a lease held is not read yet), the controller's state["leases"] (kept in
    the store with the timeline). Every lease the run asks for (leases.Asked, once Blazar made it), finds by its
    name (leases.reconcile, deleted or kept) or adopts (its cluster's lease: `appliance up` made it, or an earlier
    controller) is on it from its start to its deletion."""

    def __init__(self, leases: dict):
        self.leases = leases
        self._mu = threading.Lock()  # the controller's thread and the next cluster's (handover.Warm)

    def copy(self) -> dict:
        with self._mu:
            return {k: dict(v) for k, v in self.leases.items()}

    def track(self, info, nodes: int, node_type: str, site: str | None = None) -> None:
        """A lease of the run (a LeaseInfo), from now on counted with Blazar's dates; ``site``: its site when not
        the run's own. Tracked again, its dates are Blazar's now; one closed stays closed."""
        with self._mu:
            e = self.leases.setdefault(info.id, {"closed": False, "closed_at": None})
            e.update(nodes=int(nodes), node_type=node_type, start=_iso(info.start), end=_iso(info.end),
                     **({"site": site} if site else {}))

    def hold(self, lease_id: str, nodes: int, node_type: str, site: str | None = None) -> None:
        """A lease the run uses whose dates are not read yet (a lease it adopts: `appliance up` made it, or an
        earlier controller): on the ledger now, its dates from the next ``refresh``, so a failed read cannot leave
        it off."""
        with self._mu:
            if lease_id not in self.leases:
                self.leases[lease_id] = {"nodes": int(nodes), "node_type": node_type, "start": None, "end": None,
                                         "closed": False, "closed_at": None, **({"site": site} if site else {})}

    def close(self, lease_id: str, at: dt.datetime) -> None:
        """The run deleted the lease at ``at`` (the cloud's clock): counted to then."""
        with self._mu:
            e = self.leases.get(lease_id)
            if e is not None and not e["closed"]:
                start = _at(e["start"]) if e.get("start") else at
                e["closed"], e["closed_at"] = True, _iso(max(at, start))

    def refresh(self, cloud_at, now: dt.datetime) -> None:
        """Each open lease's dates as Blazar has them now (an extension moves its end; one held gets its dates);
        one that has gone is closed, counted to now at most (the first look after its deletion: the controller
        deletes its leases itself, and looks again right after). ``cloud_at(site)``: the client of a lease's site
        (None: the run's)."""
        with self._mu:
            open_ = [(lid, e.get("site")) for lid, e in self.leases.items() if not e["closed"]]
        seen = {lid: cloud_at(site).get_lease(lid) for lid, site in open_}  # not under the lock: the cloud is slow
        with self._mu:
            for lid, info in seen.items():
                e = self.leases[lid]
                if info is None or info.unusable:
                    start = _at(e["start"]) if e.get("start") else now
                    e["closed"], e["closed_at"] = True, _iso(max(now, start))
                else:
                    e["start"], e["end"] = _iso(info.start), _iso(info.end)

    def node_hours(self, now: dt.datetime) -> tuple[float, float]:
        """(spent, booked ahead): node-hours of the leases' time before now, and of their time still to come."""
        spent = ahead = 0.0
        for e in self.copy().values():
            if not e.get("start"):  # held, its dates not read yet: counted from the next refresh
                continue
            start, end, n = _at(e["start"]), _at(e["end"]), e["nodes"]
            until = min(end, _at(e["closed_at"])) if e.get("closed_at") else min(end, now)
            spent += max(0.0, (until - start).total_seconds()) * n / 3600
            if not e["closed"]:
                ahead += max(0.0, (end - max(start, now)).total_seconds()) * n / 3600
        return round(spent, 4), round(ahead, 4)


class Budget:
    """The spec's limits against the run's ledger."""

    def __init__(self, spec: Spec, ledger: Ledger):
        self.spec, self.ledger = spec, ledger
        self.deadline = deadline_of(spec)
        self.limited = self.deadline is not None or spec.limits.node_hours is not None

    def floor(self) -> int:
        return FLOOR_S + 2 * duration_seconds(self.spec.lease.stop_margin)

    def lease_seconds(self, start: dt.datetime, now: dt.datetime, nodes: int | None = None,
                      holding: str | None = None) -> tuple[int | None, str]:
        """The longest lease of ``nodes`` (default the spec's) the run may book from ``start`` (whole minutes, as
        Blazar takes dates), and what cut it: (None, why) when that is under the floor. ``holding``: a lease of
        the run whose time to come is not counted as booked (the one an extension would lengthen)."""
        n = nodes or self.spec.nodes.count
        length, why = duration_seconds(self.spec.lease.duration), ""
        if self.deadline is not None and (self.deadline - start).total_seconds() < length:
            length, why = int((self.deadline - start).total_seconds()), f"limits.deadline {self.spec.limits.deadline}"
        limit = self.spec.limits.node_hours
        if limit is not None:
            spent, ahead = self.ledger.node_hours(now)
            e = self.ledger.copy().get(holding or "")
            if e is not None and not e["closed"] and e.get("start"):
                ahead -= max(0.0, (_at(e["end"]) - max(_at(e["start"]), now)).total_seconds()) * e["nodes"] / 3600
            left_s = (limit - spent - ahead) * 3600 / n
            if left_s < length:
                length, why = int(left_s), (f"limits.node_hours {limit:g} ({spent + ahead:.1f} spent or booked, "
                                            f"{max(0.0, limit - spent - ahead):.1f} left)")
        length = length // 60 * 60
        if length < self.floor():
            return None, why or "lease.duration"
        return length, why

    def extension(self, lease_id: str, end: dt.datetime, now: dt.datetime, nodes: int) -> tuple[dt.timedelta | None, str]:
        """How far the run's lease ``lease_id`` ending at ``end`` may be extended: by lease.duration, cut by the
        limits (an extension shorter than the floor is not asked for)."""
        length, why = self.lease_seconds(end, now, nodes, holding=lease_id)
        return (dt.timedelta(seconds=length) if length else None), why

    def summary(self, now: dt.datetime) -> dict:
        spent, ahead = self.ledger.node_hours(now)
        return {"spent": spent, "booked": ahead, "limit": self.spec.limits.node_hours,
                "deadline": self.spec.limits.deadline}


def estimate(progress: dict, now_real: float) -> dict:
    """Steps done and left, and when the run should finish: from the newest commit's step and the training's total
    (steps_per_epoch x total epochs, in its checkpoint), at the pace of the run's jobs so far (steps per second of
    training, handovers not counted), plus one mean handover downtime per lease end still ahead."""
    step, total = progress.get("step"), progress.get("total_steps")
    out = {"step": step, "total_steps": total}
    rate = progress.get("steps") and progress.get("train_s") and progress["steps"] / progress["train_s"]
    if not (step is not None and total and rate):
        return out
    left_s = max(0, total - step) / rate
    ends = int(left_s // progress["lease_s"]) if progress.get("lease_s") else 0
    downtime = progress.get("downtime_s") or []
    left_s += ends * (sum(downtime) / len(downtime) if downtime else 0.0)
    out.update(steps_per_s=round(rate, 4), eta=round(now_real + left_s), lease_ends_ahead=ends)
    return out


def steps_made(res) -> int:
    """Steps a job made: from where it resumed (0 for a fresh job) to where it stopped (or its last commit, when
    the lease end took its nodes)."""
    stop = (res.stopped or {}).get("step")
    if stop is None and res.commits:
        stop = max(c["step"] for c in res.commits)
    start = (res.resumed or {}).get("step") or 0
    return max(0, int(stop) - int(start)) if stop is not None else 0


def newest_meta(ctx) -> dict:
    """The newest committed checkpoint's meta (its step, steps per epoch, epochs in all), or {}."""
    try:
        done = ctx.checkpoints.committed()
        return ctx.checkpoints.read_manifest(done[0])["meta"] if done else {}
    except Exception:  # noqa: BLE001 - the store did not answer: no estimate this time
        return {}
