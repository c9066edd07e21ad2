"""The warm handover of a managed run (issue 52 item 3): while the job trains on the current lease, the next lease is
booked to start ``lease.overlap`` before the current one ends (an advance reservation, same node type and count),
and once it starts its cluster is brought up (servers booted, SSH, contextualized) and the dataset staged. It is
booked ``lease.book_ahead`` before its start, not as the job starts: Chameleon's portal charges a lease's whole
window when Blazar makes it, and its notifier counts every host of a lease that ends within 21 days, so a lease
booked days ahead holds twice the run's SUs and hosts for days (plan.py). The later, the more risk that its hosts
are taken first (then nodes.alternatives, else a cold handover). At the lease end the job stops with a checkpoint
as always; then only that checkpoint is staged on the waiting cluster and the job starts there: the boot is not in
the downtime. The old cluster goes meanwhile.

When Blazar refuses the booking (the hosts are taken then: NotEnoughHostsAvailable) or the next cluster fails, the
handover is cold (a new lease at the end, today's resume), and whatever was made for it goes. The two clusters of a
run take turns under two names, RUN and RUN_h (``other_name``; no run can be named RUN_h: run names are lower-case
letters, digits and '-'), so a run never takes another run's cluster for its own; the run's record names the current
one.

What the overlap costs: ``overlap`` x nodes node-hours per lease end (``overlap_cost``), said before the run starts.
"""

from __future__ import annotations

import dataclasses
import datetime as dt
import functools
import os
import threading
import time

from .. import report
from ..cluster import Cluster, find_cluster
from ..errors import ApplianceError, NoHosts, Unanswered, Unavailable
from ..provision import lifecycle
from ..sites.lease import Lease
from ..sites.openstack_api import EXTENSION_WINDOW
from ..spec import duration_seconds

log = report.get(__name__)


PARK_POLL = float(os.environ.get("APPLIANCE_PARK_POLL") or 600)  # a parked run looks for a free slot this often


def other_name(run: str, current: str | None) -> str:
    """The name of the run's next cluster: RUN_h while the current one is RUN, else RUN. Not a run's name (spec.py
    NAME_RE), so never another run's cluster: with RUN-h, a run named train-h had its cluster taken down by run train
    as a next cluster left by a killed controller."""
    return f"{run}_h" if current in (None, run) else run


def choices_of(spec) -> list:
    """What a run may lease, in order: the spec's own node type at its site, then each of nodes.alternatives."""
    from ..spec import Alternative

    return [Alternative(spec.nodes.node_type), *spec.nodes.alternatives]


def label(a) -> str:
    """An Alternative as said: ``gpu_v100``, or ``gpu_v100 at CHI@TACC``."""
    return a.node_type + (f" at {a.site}" if a.site else "")


def overlap_cost(spec) -> float:
    """Node-hours the overlap costs per lease end (both clusters leased through it)."""
    return duration_seconds(spec.lease.overlap) * spec.nodes.count / 3600


def leased_as(spec, a, seconds: int | None = None):
    """The spec a lease of the Alternative ``a`` is asked for: its node type, at its site (None: the spec's), for
    ``seconds`` (None: lease.duration)."""
    spec = dataclasses.replace(spec, site=a.site or spec.site,
                               nodes=dataclasses.replace(spec.nodes, node_type=a.node_type))
    if seconds is None:
        return spec
    return dataclasses.replace(spec, lease=dataclasses.replace(spec.lease, duration=f"{seconds // 60}m"))


class Warm:
    """The next cluster of a run, made while the job trains on ``current``. ``ctx``: the run's RunContext;
    ``record``: the controller's timeline (Control.record); ``stage``: flows.stage_to_nodes; ``up``: lifecycle.up
    (the fast tests pass one that boots nothing)."""

    def __init__(self, ctx, current: Cluster, record, stage, poll: float, up=lifecycle.up, plan=None):
        self.ctx, self.current, self.record, self.stage, self.poll = ctx, current, record, stage, poll
        self.up = up
        self.plan = plan  # the run's limits (managed._Run: lease_length, extend_by); None: none
        self.end = current.lease_end_at  # the current lease's end (later once extended)
        self.name = other_name(ctx.spec.name, current.name)
        self.spec = dataclasses.replace(ctx.spec, name=self.name)
        self.cluster: Cluster | None = None
        self.choice = None  # the Alternative its lease was booked for (the spec's own node type first)
        self.adopted: str | None = None  # the next lease an earlier controller booked, kept (_earlier_booking)
        self.phases: dict[str, float] = {}
        self.booked: tuple[str, object] | None = None  # the next lease booked: (its id, its site)
        self.waiting = False  # waiting for the moment to book (lease.book_ahead; with lease.extend, to extend first)
        self.away: str | None = None  # the cloud does not answer its making now: the error (_patiently)
        self._stop = threading.Event()
        self._hurry = threading.Event()  # the handover came before that moment: book now
        self._nudge = threading.Event()  # wakes that wait: stopped, or hurried
        self._done = threading.Event()  # _make has ended: the cluster made, or not
        self._wake = self._done  # set with it: what ready() waits on (a cancel sets the run's)
        self._thread = threading.Thread(target=self._make, name="appliance-next-cluster", daemon=True)

    def start(self) -> Warm:
        self._thread.start()
        return self

    def _start_date(self) -> dt.datetime | None:
        """The current lease's end less the overlap, by the cloud's clock; None (now) when that has passed."""
        start = self.end - dt.timedelta(seconds=duration_seconds(self.spec.lease.overlap))
        now = self.ctx.site.cloud.now()
        # Blazar dates are minutes (blazar/manager/service.py LEASE_DATE_FORMAT), and a start before now is refused
        return None if start <= now + dt.timedelta(minutes=1) else start

    def _make(self) -> None:
        spec = self.spec  # the next lease: the spec's first choice, else an alternative (_book)
        try:
            if find_cluster(self.name) is not None:  # left by a controller that was killed: it goes, then afresh
                lifecycle.down(self.name, self.ctx.site_of(self.name))
            else:  # booked by a controller on another machine (its state in the store): kept, or it goes; asked
                self._patiently(self._earlier_booking)  # again while the cloud does not answer, as the booking is
            if spec.lease.extend and self.plan is not None and self.adopted is None:  # kept: it was refused
                if not self._extend():
                    return  # stopped while it waited to extend
            elif not self._due():
                return  # stopped while it waited to book
            self._patiently(lambda: self._made(spec))
        except Exception as e:  # noqa: BLE001 - the handover is cold then; said, and on the timeline
            why = f"{type(e).__name__}: {e}" if not isinstance(e, ApplianceError) else str(e)
            log.info(f"[run] the next cluster was not made ({why}); the handover at the lease end will be cold")
            self.record("next cluster failed", cluster=self.name, error=why[:300])
        finally:
            self._done.set()
            self._wake.set()

    def _earlier_booking(self) -> None:
        """The next lease that a controller of the run on another machine booked before it was lost (found through
        the run's state; the hosts are its): kept as this cluster's lease when it is of one of the run's choices and
        starts when this one would ask (its cluster is then made on it, as on a lease booked here), else deleted
        before the booking (nothing would use it, and it holds the hosts the booking needs)."""
        found = getattr(self.plan, "earlier_booking", lambda name: None)(self.name)
        if found is None:
            return
        entry, info = found
        site = self.ctx.at(entry.get("site"))
        here = self.ctx.lease_site(self.current) or self.ctx.site
        try:  # the current lease's end as the cloud has it: the state's record predates an extension
            cur, now = here.cloud.lease_at(self.current.lease_id)
        except Exception:  # noqa: BLE001 - the record's end stands
            cur, now = None, here.cloud.now()
        if cur is not None and not cur.unusable:
            self.end = cur.end
        if info.end <= self.end:  # not a next lease: an older one of the name (the handovers alternate two names)
            return
        want = self.end - dt.timedelta(seconds=duration_seconds(self.spec.lease.overlap))
        slack = dt.timedelta(minutes=2)  # booked at ``want``, or once that had passed, when it was booked (started)
        choice = next((a for a in choices_of(self.spec) if a.node_type == entry.get("node_type")
                       and (a.site or self.spec.site) == entry.get("site")), None)
        if choice is not None and want - slack <= info.start <= max(want, now) + slack and info.end > self.end:
            lifecycle.record_lease(site, leased_as(self.spec, choice), info)
            self.choice, self.adopted = choice, info.id
            log.info(f"[run] the next lease {info.name} ({info.id}), booked by an earlier controller, is kept")
            self.record("lease adopted", lease_id=info.id, name=info.name, cluster=self.name)
            return
        log.info(f"[run] the next lease {info.name} ({info.id}), booked by an earlier controller for another start, "
                 "goes: it holds the hosts a booking needs")
        site.cloud.delete_lease(info.id)
        self.record("lease deleted", lease_id=info.id, name=info.name, reason="booked by an earlier controller")

    def _made(self, spec) -> None:
        """The next lease booked (once: asked again, it is found by its name), waited for, its cluster up and staged."""
        start = self._start_date()
        if self.plan is not None and self.adopted is None:  # an adopted lease is on the ledger: not counted twice
            length, why = self.plan.lease_length(start)
            if length is None:
                self.record("no next lease", cluster=self.name, reason=why)
                log.info(f"[run] no next lease is booked: the run has reached {why}")
                return
            spec = dataclasses.replace(spec, lease=dataclasses.replace(spec.lease, duration=f"{length // 60}m"))
        site, spec, booked = self._book(spec, start)
        if self.booked is None:
            self.record("next lease", cluster=self.name, lease_id=booked.lease_id, node_type=spec.nodes.node_type,
                        **({"site": self.choice.site} if self.choice.site else {}),
                        start=start.isoformat() + "Z" if start else "now")
        self.booked = (booked.lease_id, site)
        info = Lease(site.cloud, booked.lease_id).until_active(self._stop.is_set, lambda: self._stop.wait(self.poll))
        if self._stop.is_set():
            return
        if info is None or info.status != "ACTIVE":
            raise ApplianceError(f"the next lease {booked.lease_id} is {info.status if info else 'gone'}")
        cluster = self.up(site, spec, timings=self.phases)
        if spec.dataset is not None:
            self.stage(self.ctx, cluster, spec.dataset.source, spec.dataset.dest, mode=spec.dataset.mode)
        self.cluster = cluster
        self.record("next cluster ready", cluster=self.name, phases={k: round(v, 2) for k, v in self.phases.items()})
        log.info(f"[run] the next cluster {self.name} is up and staged: the handover will not wait for a boot")

    def _patiently(self, step) -> None:
        """``step()`` through the control plane's bad hours, as the recovery strategy's (recovery.CLOUD_WAIT): a
        step the cloud does not answer (Unavailable, Unanswered) is asked again from the top after a wait, each
        longer, until it is made or the Warm is abandoned; the wait is on the timeline ("cloud away", "cloud
        back"), and the handover that meets it waits in status waiting (ready). Every step finds what the one
        before made (the lease by its name, the servers by theirs), so nothing is made twice."""
        from .recovery import CLOUD_WAIT  # recovery imports this module

        since, delay = None, CLOUD_WAIT[0]
        while not self._stop.is_set():
            try:
                step()
            except (Unavailable, Unanswered) as e:
                if since is None:
                    since = time.monotonic()
                    log.info(f"[run] the cloud does not answer as the next cluster is made ({e.message}); asking "
                             "again")
                    self.record("cloud away", cluster=self.name, error=e.message[:300])
                self.away = e.message
                self._stop.wait(delay)
                delay = min(2 * delay, CLOUD_WAIT[1])
                continue
            if since is not None:
                self.away = None
                self.record("cloud back", cluster=self.name, waited_s=round(time.monotonic() - since, 1))
            return

    def _book(self, spec, start):
        """The next lease booked: of the spec's node type at its site, else (Blazar has not the hosts then: the
        run's own hosts are busy until the end it overlaps, and others are booked) of each of nodes.alternatives in
        order, another node type or site. Returns (its site, the spec it is booked for, its cluster record);
        NoHosts when none has the hosts."""
        choices = choices_of(spec)
        if self.choice is not None:  # its lease kept from an earlier controller (_earlier_booking): that one first
            choices = [self.choice, *[a for a in choices if a != self.choice]]
        for i, a in enumerate(choices):
            at = leased_as(spec, a)
            site = self.ctx.at(a.site)
            try:
                booked = lifecycle.book(site, at, start, on_ask=getattr(self.plan, "asking", None))
            except NoHosts as e:
                self.record("next lease refused", cluster=self.name, node_type=a.node_type, reason=e.message[:200],
                            **({"site": a.site} if a.site else {}))
                log.info(f"[run] no {spec.nodes.count} x {label(a)} free for the next lease"
                         + (f"; trying {label(choices[i + 1])}" if i + 1 < len(choices) else ""))
                continue
            self.choice = a
            return site, at, booked
        raise NoHosts(f"none of {', '.join(map(label, choices))} has {spec.nodes.count} hosts free for the next "
                      "lease")

    def _ahead(self, site) -> dt.timedelta:
        """How long before the current lease's end the next lease is booked (with lease.extend, the current one
        extended first): lease.overlap + lease.book_ahead, the latter at least 5 minutes and two polls (Blazar takes
        whole minutes and refuses a start in the past; the controller needs two polls to see the moment)."""
        lease = self.spec.lease
        return dt.timedelta(seconds=duration_seconds(lease.overlap) + max(
            float(duration_seconds(lease.book_ahead)), 300.0, 2 * self.poll * site.time_scale()))

    def _due(self, ahead: dt.timedelta | None = None) -> bool:
        """Waits until ``ahead`` (default _ahead) before the current lease's end by the cloud's clock, reading the
        lease as it goes (an extension moves the end; a lease gone early raises: the handover is cold) at half the
        time left at a time, within 1 and 20 polls (days of a lease, few reads; a read that fails is asked again at
        the next). True: due, or hurried (the handover has come); False: stopped meanwhile."""
        site, lid = self.ctx.lease_site(self.current) or self.ctx.site, self.current.lease_id
        ahead = ahead or self._ahead(site)
        while not self._stop.is_set():
            try:
                info, now = site.cloud.lease_at(lid)
            except Exception as e:  # noqa: BLE001 - the cloud did not answer: the last end stands, asked again
                log.info(f"[run] warning: could not read lease {lid} ({type(e).__name__}: {e}); asking again")
                info, now = None, None
            if now is not None and (info is None or info.unusable):
                raise ApplianceError(f"the current lease {lid} is {info.status if info else 'gone'}")
            if info is not None:
                self.end = info.end
            early = (self.end - ahead - now).total_seconds() / site.time_scale() if now is not None else self.poll
            if early <= 0 or self._hurry.is_set():
                self.waiting = False
                return True
            self.waiting = True
            self._nudge.wait(min(max(early / 2, self.poll), 20 * self.poll))
            self._nudge.clear()
        return False

    def _extend(self) -> bool:
        """lease.extend: the current lease is extended first, when the next lease would be booked (an extension
        needs no second cluster and no handover; within Chameleon's 48 h window); each extension moves the end, and
        the next try waits for it. Refused (Blazar: the hosts are reserved after the end, outside the 48 h window,
        the 7-day cap; or the run's limits), the next lease is booked. False: stopped meanwhile."""
        site, lid = self.ctx.lease_site(self.current) or self.ctx.site, self.current.lease_id
        ahead = min(self._ahead(site), EXTENSION_WINDOW - dt.timedelta(minutes=1))
        while self._due(ahead):
            if self._hurry.is_set():  # the handover has come: the next lease now, not an extension
                return True
            new, why = Lease(site.cloud, lid).extend(  # by the spec's duration, at most the run's limits allow
                dt.timedelta(seconds=duration_seconds(self.spec.lease.duration)), self.end,
                functools.partial(self.plan.extend_by, warm=True))
            if new is None:
                self.record("extend refused", lease_id=lid, reason=why[:300])
                log.info(f"[run] lease {lid} was not extended ({why}): the next lease is booked")
                return True
            self.end = new.end
            self.record("lease extended", lease_id=lid, end=new.end.isoformat() + "Z")
            log.info(f"[run] extended lease {lid} to {new.end:%Y-%m-%d %H:%M} UTC")
        return False

    def ready(self, control=None) -> Cluster | None:
        """The next cluster once it is made, or None: the handover is cold. It is waited for (its boot is shorter
        than a cold one from now) only while its lease starts soon (`far`); one not booked yet whose start is near
        is booked now (the job stopped before lease.book_ahead came); a lease that starts later (the current one
        went early: deleted in Horizon, `appliance lease delete`) is not waited for: the booking goes at once.
        ``control``: the run's controller: a cancel (its ``changed`` event) ends the wait at once, and the booking
        goes."""
        wake = self._wake = control.changed if control is not None else self._done
        said = False
        while not self._done.is_set():
            if control is not None and (control.cancel is not None or control.lost):
                self.abandon()
                return None
            if self.away is not None and control is not None and not said:  # the run waits for the cloud
                said = True
                control.waiting(error=self.away[:300], cluster=self.name)
            if (why := self.far()) is not None:
                self.record("next lease abandoned", cluster=self.name, reason=why)
                log.info(f"[run] {why}: not waited for; its booking goes, and the run goes on on a new lease now")
                self.abandon()
                return None
            if self.waiting:  # not booked yet, its start near: now
                self._hurry.set()
                self._nudge.set()
            wake.wait(self.poll)  # the next look at the lease's start, or at once: made, failed, or a cancel
            if wake is not self._done:
                wake.clear()
        return self.cluster

    def far(self) -> str | None:
        """Why the next lease is not worth waiting for, or None. It is waited for while it starts within
        lease.overlap + lease.stop_margin of now (of real time, by the cloud's clock): at a lease end the job stopped
        for, it starts at most lease.stop_margin ahead (the job stops stop_margin before the end, the next lease
        starts overlap before it), and once started its cluster boots meanwhile; a cloud that cannot tell is waited
        for. One not booked yet is judged by the start it would have (the current lease's end less the overlap)."""
        lease = self.spec.lease
        if self.booked is None and not self.waiting:  # being booked now
            return None
        try:
            if self.booked is None:  # its start to come: the current lease's end as last read, less the overlap
                site = self.ctx.lease_site(self.current) or self.ctx.site
                lid, start, now = None, self.end - dt.timedelta(seconds=duration_seconds(lease.overlap)), \
                    site.cloud.now()
            else:
                lid, site = self.booked
                info, now = site.cloud.lease_at(lid)
                if info is None or info.unusable:
                    return f"the next lease {lid} is {info.status if info else 'gone'}"
                start = info.start
            scale = site.time_scale()
        except Exception:  # noqa: BLE001 - cannot tell: the next look asks again
            return None
        ahead = (start - now).total_seconds() / scale  # real seconds
        if ahead <= duration_seconds(lease.overlap) / scale + duration_seconds(lease.stop_margin):
            return None
        what = f"the next lease {lid} starts" if lid else "the next lease, not booked yet, would start"
        return (f"{what} {start:%Y-%m-%d %H:%M} UTC, {ahead / 3600:.1f} h from now, past lease.overlap "
                f"{lease.overlap} + lease.stop_margin {lease.stop_margin} (the current lease ended early)")

    def abandon(self) -> None:
        """Stop making it; what was made goes (no lease or server of the run is left behind)."""
        self._stop.set()
        self._nudge.set()
        if self._thread.is_alive():
            self._thread.join()
        if find_cluster(self.name) is not None:
            lifecycle.down(self.name, self.ctx.site_of(self.name))


SLOT_TRIES = 3  # a slot taken between the allocations read and the booking is looked for again this often


def wait_for_slot(ctx, control, choices: list, fit=None, quiet: bool = False):
    """`_wait_for_slot`, looked for again when the slot it found was taken before it was booked (Blazar refuses the
    booking: NotEnoughHostsAvailable); None after SLOT_TRIES such refusals (the run parks and looks again later)."""
    for n in range(SLOT_TRIES):
        try:
            return _wait_for_slot(ctx, control, choices, fit, quiet or n > 0)
        except NoHosts as e:
            log.info(f"[run] the free slot was taken before it was booked ({e.message}); looking again")
            control.record("slot taken", reason=e.message[:300])
    return None


def _wait_for_slot(ctx, control, choices: list, fit=None, quiet: bool = False):
    """No choice (an Alternative: a node type, at the run's site or another) has hosts free now: the earliest slot
    of any (each site's Blazar host allocations: sites/slots.py), if it starts within lease.wait, is booked under
    the run's name and waited for. Returns the choice whose lease has started (`up` of the run goes on on it), or
    None: no slot within the wait, or the run was cancelled meanwhile (what was booked goes). ``fit(start)``: the
    longest lease the run's limits allow from then, in seconds (None: none); ``quiet``: a parked run's look again
    (no slot is not said again)."""
    spec = ctx.spec
    now = ctx.site.cloud.now()  # the sites' clocks agree (UTC)
    length = dt.timedelta(seconds=(fit(None) if fit else None) or duration_seconds(spec.lease.duration))
    slots = sorted((s, i) for i, a in enumerate(choices)  # (start, choice): the earliest, then the first choice
                   if (s := ctx.at(a.site).cloud.next_slot(a.node_type, spec.nodes.count, length, now)) is not None)
    limit = now + dt.timedelta(seconds=duration_seconds(spec.lease.wait))
    if not slots or slots[0][0] > limit:
        first = f"; the first is {label(choices[slots[0][1]])} at {slots[0][0]:%Y-%m-%d %H:%M} UTC" if slots else ""
        if not quiet:
            control.parked(reason=f"no slot within lease.wait {spec.lease.wait}{first}")
            log.info(f"[run] no {spec.nodes.count} x {' or '.join(map(label, choices))} free within lease.wait "
                     f"({spec.lease.wait}){first}: the run is parked with its checkpoint, holds no lease, and looks "
                     f"again every {PARK_POLL / 60:.0f} min (a longer lease.wait or more nodes.alternatives help; "
                     f"`appliance cancel {spec.name}` stops it)")
        return None
    start, a = slots[0][0], choices[slots[0][1]]
    nt, where = a.node_type, {"site": a.site} if a.site else {}
    fits = fit(start) if fit else None
    if fit and fits is None:
        if not quiet:
            control.parked(reason=f"the first slot, {label(a)} at {start:%Y-%m-%d %H:%M} UTC, is past the run's "
                                  "limits")
            log.info(f"[run] the first free slot, {spec.nodes.count} x {label(a)} at {start:%Y-%m-%d %H:%M} UTC, "
                     f"leaves no lease within the run's limits: the run is parked with its checkpoint and looks "
                     f"again every {PARK_POLL / 60:.0f} min (raise the limits in {spec.path}, then `appliance run` "
                     "again)")
        return None
    site = ctx.at(a.site)
    booked = lifecycle.book(site, leased_as(spec, a, fits or None), start if start > now + dt.timedelta(minutes=1)
                            else None,
                            on_ask=getattr(control, "on_ask", None))
    wait_s = max(0.0, (start - now).total_seconds())
    control.record("waiting for hosts", node_type=nt, **where, lease_id=booked.lease_id,
                   start=start.isoformat() + "Z", wait_s=round(wait_s))
    log.info(f"[run] the earliest {spec.nodes.count} x {label(a)} free: {start:%Y-%m-%d %H:%M} UTC, in "
             f"{wait_s / 60:.0f} min; booked (lease {booked.lease_id}), waiting for it")
    t0 = time.monotonic()
    info = Lease(site.cloud, booked.lease_id).until_active(lambda: control.cancel is not None,
                                                           lambda: control.changed.wait(control.poll))
    if control.cancel is not None or info is None or info.status != "ACTIVE":
        lifecycle.down(spec.name, site)
        return None
    control.record("hosts free", node_type=nt, **where, waited_s=round(time.monotonic() - t0, 1),
                   wait_s=round(wait_s))
    return a
