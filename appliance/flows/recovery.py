"""A managed run's recovery strategy: the one path by which a managed run gets a cluster to train on (as SkyPilot's
managed jobs keep theirs, sky/jobs/recovery_strategy.py: the controller's loop only drives; the strategy returns
the next cluster), for its first job (new, or continued by `appliance run SPEC` again: after parking, a stop, the
controller's machine rebooted, a takeover), a restart, and each handover. In order:

1. a cluster of the run it has already and can train on now (``existing``: its record on this machine, RUN or
   RUN_h, its lease ACTIVE with more than twice lease.stop_margin left); at a handover, the run's other cluster is
   the next one below;
2. the next cluster made while the job trained (the warm handover, handover.Warm), when it is ready;
3. a new lease now (cold): of the spec's own node type at its site, then of each of nodes.alternatives (another
   node type, or another site: the checkpoints stay in the run's store), the first Blazar has the hosts for;
4. the earliest free slot of any choice within lease.wait, booked and waited for (handover.wait_for_slot);
5. none: the run parks with its committed checkpoint, holding no lease, and looks again every PARK_POLL until a
   slot appears, the run is cancelled, or its limits leave no lease.

Never the site's default cluster (the local cloud's bare testbed): a managed run trains on a lease of its own. A
new lease is asked for within the run's limits (managed._Run.new_lease: its duration cut to them, or none).
"""

from __future__ import annotations

import dataclasses
import time

from .. import report
from ..cluster import Cluster, find_cluster
from ..errors import ApplianceError, NoHosts, Unanswered, Unavailable, Unreachable
from ..provision import lifecycle
from ..spec import Alternative, duration_seconds
from . import handover
from .handover import choices_of, label, leased_as, other_name
from .leases import reconcile

log = report.get(__name__)

# seconds between looks while the cloud does not answer: the first, and the most (doubling in between)
CLOUD_WAIT = (15.0, 600.0)
# seconds waited in a row for a node of the run's cluster that does not answer SSH (errors.Unreachable) before the
# run ends on its error: a network blip or an sshd that drops connections is waited out; a node that stays away is one
# `appliance status` shows. Only the waits count (not a try's own minutes: a new lease's boot), and another error
# between two such tries starts the count again.
NODE_WAIT = 600.0


class Recovery:
    """The strategy of one managed run (``run``: managed._Run: its context, controller, limits and ledger)."""

    def __init__(self, run):
        self.run = run

    def next_cluster(self, phases: dict[str, float], made: Cluster | None = None, choice: Alternative | None = None,
                     ended: str | None = None) -> tuple[Cluster, str] | None:
        """The strategy below, through the control plane's bad hours: a step the cloud does not answer (Unavailable:
        a read still failing after keystoneauth's retries; Unanswered: a create whose answer was lost and could not
        be looked up) is not the run's end. The run waits with its checkpoint in status waiting ("cloud away" on the
        timeline, with the error), looks again after CLOUD_WAIT[0] seconds, doubling to CLOUD_WAIT[1], and goes on
        by itself once the cloud answers ("cloud back"), then deletes the leases it asked for meanwhile that nothing
        uses (leases.reconcile). A cancel ends the wait at once. Every step is asked again from the top: each is
        idempotent (a lease or cluster of the run's name is found, not made twice). ``ended``: the lease whose job
        ended with it (``ended_lease``); the lease, not its cluster's name, is passed over: a look again after a lost
        answer finds the record under that name holding the lease just asked for, which is used, not taken down and
        asked again."""
        return self.patiently(lambda: self._next(phases, made, choice, ended))

    def patiently(self, step):
        """``step()``, through the control plane's bad hours (next_cluster says how), and its result; None when the
        run is cancelled or its controller lost the run meanwhile. A managed run's resume goes through it whole too
        (managed._Run.resume): a staging whose store did not answer is a wait, then the resume again; so is a node
        that does not answer SSH (errors.Unreachable), for up to NODE_WAIT seconds, after which its error ends it."""
        c, away, delay, who = self.run.control, None, CLOUD_WAIT[0], "the cloud"
        node_waited = 0.0  # seconds waited in a row for a node that does not answer SSH (its tries not counted)
        while True:
            try:
                got = step()
            except (Unavailable, Unanswered, Unreachable) as e:
                if c.cancel is not None or c.lost:
                    return None
                pause = delay
                if isinstance(e, Unreachable):
                    if node_waited >= NODE_WAIT:
                        raise
                    pause = min(delay, NODE_WAIT - node_waited)
                    node_waited += pause
                else:
                    node_waited = 0.0
                if away is None:
                    away, who = time.monotonic(), "a node" if isinstance(e, Unreachable) else "the cloud"
                    log.info(f"[run] {who} does not answer ({e.message}): run {self.run.spec.name} waits with "
                             f"its checkpoint and asks again (`appliance cancel {self.run.spec.name}` ends the wait)")
                    c.waiting(error=e.message)
                c.changed.wait(pause)  # the next look, or at once on a cancel
                c.changed.clear()
                delay = min(2 * delay, CLOUD_WAIT[1])
                continue
            if away is not None:
                waited = round(time.monotonic() - away, 1)
                log.info(f"[run] {who} answers again after {waited:.0f} s: run {self.run.spec.name} goes on")
                c.record("cloud back", waited_s=waited)
                reconcile(self.run.ctx, c, self.run.ledger)
            return got

    def _next(self, phases: dict[str, float], made: Cluster | None, choice: Alternative | None,
              ended: str | None) -> tuple[Cluster, str] | None:
        """The cluster the run goes on on, and the node type its job runs as (the order above): ``made``, the one
        made while the job trained (booked for ``choice``: None, the spec's own); else one the run has
        (not the one on the lease ``ended``: its job just ended with it); else one on a new lease. Its lease and
        boot go into ``phases`` (the resume's downtime). None: the run is cancelled, parks, or has reached a limit
        (said)."""
        c = self.run.control
        if c.cancel is not None or c.lost:
            return None
        if made is not None:
            return made, (choice.node_type if choice is not None else self.run.spec.nodes.node_type)
        return self.existing(phases, ended) or self.cold(phases)

    def existing(self, phases: dict[str, float], ended: str | None = None) -> tuple[Cluster, str] | None:
        """The run's cluster whose lease runs longest, when it leaves more than twice lease.stop_margin (the job
        would stop at once on less), brought up again (lifecycle.up: the same lease, a server gone replaced); the
        run's other clusters go (a next cluster a killed controller made and never used, a lease that has ended).
        The one a Warm of the run makes now is left to it. None: none is usable."""
        run, spec = self.run, self.run.spec
        mine = (spec.name, other_name(spec.name, spec.name))
        warm = run.warm.name if run.warm is not None else None
        found = [(self.left(cl), cl) for n in dict.fromkeys((run.current, *mine))
                 if n and n != warm and (cl := find_cluster(n)) is not None and not (ended and cl.lease_id == ended)]
        got = None
        for left, cl in sorted(found, key=lambda x: -(x[0] or 0.0)):
            if got is None and (left or 0.0) > 2 * duration_seconds(spec.lease.stop_margin):
                got = self.again(cl, phases)
                if got is not None:
                    continue
            if left is not None and cl.name in mine:
                self.down(cl.name)
        return got

    @staticmethod
    def ended_lease(name: str | None) -> str | None:
        """The lease of the cluster recorded as ``name`` (whose job just ended with it), for next_cluster's
        ``ended``; None: none."""
        cl = find_cluster(name) if name else None
        return cl.lease_id if cl is not None else None

    def left(self, cl: Cluster) -> float | None:
        """Real seconds the run can train on ``cl`` from now (by the cloud's clock): its lease's time left while it
        is ACTIVE (servers or not: up makes them), else 0; a lease asked for whose id was never recorded counts as
        usable (up finds it by its name); None: not the run's cloud's, or the site cannot tell (not used, and not
        taken down)."""
        if cl.cloud != self.run.spec.cloud:
            return None
        if not cl.lease_id:  # asked for, its answer not recorded (a controller killed between Blazar's answer and
            # its record): up finds it by the name recorded before the ask (lifecycle._leased), or asks again
            return float("inf") if cl.site.lease_name else 0.0
        site = self.run.ctx.lease_site(cl)
        try:
            info, now = site.cloud.lease_at(cl.lease_id)
            return (info.end - now).total_seconds() / site.time_scale() if info and info.status == "ACTIVE" else 0.0
        except (Unavailable, Unanswered):  # not an answer: the strategy waits (next_cluster), it takes nothing down
            raise
        except Exception:  # noqa: BLE001
            return None

    def again(self, cl: Cluster, phases: dict[str, float]) -> tuple[Cluster, str] | None:
        """``cl`` up again under its name, on its lease, as the node type its lease was asked for (the run's
        ledger; the spec's own when it has none); None when its hosts are gone (NoHosts: said)."""
        run, spec = self.run, self.run.spec
        asked = (run.ledger.copy().get(cl.lease_id) if cl.lease_id else None) or \
            (run.control.state.get("asked") or {}).get(cl.site.lease_name or "") or {}
        a = Alternative(asked.get("node_type") or spec.nodes.node_type, cl.site.region or spec.site)
        at = dataclasses.replace(leased_as(spec, a), name=cl.name)
        if not cl.lease_id and not self._made(cl):  # its lease may not exist yet and be asked for now: within the
            # run's limits, as cold's (one Blazar made is on the ledger already: not held against them twice)
            if (kw := run.new_lease()) is None:
                return None
            if kw.get("lease_duration"):
                at = dataclasses.replace(at, lease=dataclasses.replace(at.lease, duration=kw["lease_duration"]))
        lease = cl.lease_id or cl.site.lease_name
        log.info(f"[run] run {spec.name} goes on on its cluster {cl.name}, on its lease {lease}")
        try:
            got = lifecycle.up(run.ctx.site_of(cl.name), at, timings=phases, on_ask=run.asking)
        except NoHosts as e:
            log.info(f"[run] cluster {cl.name} cannot be brought up again ({e.message}): a new lease instead")
            return None
        if got.lease_id:  # a lease the run adopts (`appliance up` made it, or an earlier controller): on its ledger
            run.adopt(got, a.node_type)
        return got, a.node_type

    def _made(self, cl: Cluster) -> bool:
        """Blazar has a usable lease under the name ``cl`` recorded before its ask (its answer was lost)."""
        site = self.run.ctx.site_of(cl.name)
        return any(x.name == cl.site.lease_name and not x.unusable for x in site.cloud.list_leases())

    def down(self, name: str) -> None:
        try:
            lifecycle.down(name, self.run.ctx.site_of(name))
        except ApplianceError as e:  # its lease ends by itself; `appliance down` takes what is left
            log.info(f"[run] warning: cluster {name} was not taken down ({e.message}): `appliance down {name}`")

    def cold(self, phases: dict[str, float]) -> tuple[Cluster, str] | None:
        run, spec = self.run, self.run.spec
        if (kw := run.new_lease()) is None:
            return None
        if find_cluster(spec.name) is not None:  # its lease has ended or is about to: its hosts are free for the new
            lifecycle.down(spec.name, run.ctx.site_of(spec.name))
        choices = choices_of(spec)
        for i, a in enumerate(choices):
            try:
                return self.up(a, phases, kw.get("lease_duration")), a.node_type
            except NoHosts as e:
                log.info(f"[run] no {spec.nodes.count} x {label(a)} free for the next lease ({e.message})"
                         + (f"; trying {label(choices[i + 1])}" if i + 1 < len(choices) else ""))
                run.control.record("no hosts", node_type=a.node_type, **({"site": a.site} if a.site else {}))
        a = self.wait_for_hosts(choices)
        return None if a is None else (self.up(a, phases), a.node_type)  # on the lease booked at the slot

    def up(self, a: Alternative, phases: dict[str, float], duration: str | None = None) -> Cluster:
        """The run's cluster on a lease of ``a`` (the one booked under the run's name, else a new one of
        ``duration``: None, the spec's), up: each lease asked for goes to the run's ledger first."""
        at = leased_as(self.run.spec, a)
        if duration is not None:  # new_lease's keyword: its duration cut to the run's limits
            at = dataclasses.replace(at, lease=dataclasses.replace(at.lease, duration=duration))
        return lifecycle.up(self.run.ctx.at(a.site), at, timings=phases, on_ask=self.run.asking)

    def wait_for_hosts(self, choices: list[Alternative]) -> Alternative | None:
        """No choice has hosts now: the earliest free slot within lease.wait, booked and waited for; without one
        the run parks with its checkpoint (status parked, no lease held) and looks again every PARK_POLL, until a
        slot appears, the run is cancelled, or its limits leave no lease (limits.deadline passes). Returns the
        choice whose lease has started, or None."""
        run, c, looked = self.run, self.run.control, 0
        while c.cancel is None and not c.lost:
            a = handover.wait_for_slot(run.ctx, c, choices, fit=lambda start: run.lease_length(start)[0],
                                       quiet=looked > 0)
            if a is not None or c.cancel is not None:
                run.parked = False
                return a
            if run.new_lease() is None:  # the limits leave no lease now: the run ends (said)
                run.parked = False
                return None
            run.parked, looked = True, looked + 1
            c.changed.wait(handover.PARK_POLL)  # the next look, or at once on a cancel
            c.changed.clear()
        return None
