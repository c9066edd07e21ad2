"""A managed run's recovery strategy: where the run goes on once its job has ended with its lease (as SkyPilot's
managed jobs keep theirs, sky/jobs/recovery_strategy.py: the controller's loop only drives; the strategy returns
the next cluster). In order:

1. the next cluster made while the job trained (the warm handover, handover.Warm), when it is ready;
2. a new lease now (cold): of the spec's own node type at its site, then of each of nodes.alternatives (another
   node type, or another site: the checkpoints stay in the run's store), the first Blazar has the hosts for;
3. the earliest free slot of any choice within lease.wait, booked and waited for (handover.wait_for_slot);
4. none: the run parks with its committed checkpoint, holding no lease, and looks again every PARK_POLL until a
   slot appears, the run is cancelled, or its limits leave no lease.

A new lease is asked for within the run's limits (managed._Run.new_lease: its duration cut to them, or none).
"""

from __future__ import annotations

import dataclasses

from .. import report
from ..cluster import Cluster, find_cluster
from ..errors import NoHosts
from ..provision import lifecycle
from ..spec import Alternative
from . import handover
from .handover import choices_of, label, leased_as

log = report.get(__name__)


class Recovery:
    """The strategy of one managed run (``run``: managed._Run: its context, controller, limits and ledger)."""

    def __init__(self, run):
        self.run = run

    def next_cluster(self, made: Cluster | None, choice: Alternative | None,
                     phases: dict[str, float]) -> tuple[Cluster, str] | None:
        """The cluster the run goes on on, and the node type its job runs as: ``made``, the one made while the job
        trained (booked for ``choice``: None, the spec's own); else one on a new lease, whose lease and boot go into
        ``phases`` (the resume's downtime). None: the run parks, or has reached a limit (both said)."""
        if made is not None:
            return made, (choice.node_type if choice is not None else self.run.spec.nodes.node_type)
        return self.cold(phases)

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
