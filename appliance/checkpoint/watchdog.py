"""The lease watchdog: acts before the lease end, while the job runs.

It runs beside the job in `appliance train` (on the head node when the CLI runs there, as with the Heat
template; on the user's machine otherwise) and polls the lease: Blazar's end date, read against the cloud's own
clock (HTTP Date, to a fraction of a second with `CloudClock`), converted to real seconds (the local cloud's clock
can run faster). Its last sleep ends at the moment to act. At ``end - margin`` it

1. extends the lease, when the spec says ``lease.extend: true`` and Chameleon's rules allow it (within 48 h
   of the end, at most 7 days added), and keeps watching. It extends earlier than it would stop, before the
   node-side watchdog's margin (``protocol.NODE_WATCH_MARGIN``, 10 min) as well, so that no node stops a job whose
   lease is about to be extended; if the extension is refused, the job runs on until the margin; otherwise
2. asks the job to stop: it writes ``$APPLIANCE_RUN_DIR/STOP`` on the head node with the reason and a deadline;
   rank 0 sees it after its current step, the ranks agree with one allreduce to stop after the same step, rank 0
   saves, uploads and commits before the deadline, and the job exits as "stopped, resumable" (exit 75).

The margin is measured, not guessed: ``max(lease.stop_margin, 3 x the slowest save+upload seen so far +
2 polls)``. Rank 0 also reads Chameleon's vendordata lease end on the node (node/checkpointer.py), so a run
whose launcher went away still stops in time; SIGTERM to `appliance train` or to any rank takes the same path.
"""

from __future__ import annotations

import datetime as dt
import threading
import time
from collections import deque
from collections.abc import Callable

from ..cluster import Cluster
from ..errors import ApplianceError
from ..protocol import NODE_WATCH_MARGIN
from ..sites import Site
from ..sites.lease import Lease
from ..spec import Spec, duration_seconds


EPOCH = dt.datetime(1970, 1, 1)


class CloudClock:
    """The cloud's time between reads of the lease. Each read carries the cloud's HTTP Date: whole seconds, stamped
    between our send and our receipt. So the cloud's clock at our monotonic time m is A + scale * m, with
    d - scale * received <= A < d + 1 - scale * sent for every read's Date d. The bounds narrow as reads land at
    different fractions of a second; only the last KEEP reads count, so our clock's drift against the cloud's over a
    week-long lease does not pile up, and a cloud clock that jumps (bounds that no longer meet) starts them over. The
    Date alone read the time left up to 1 s long, so the stop came up to 1 s after the margin."""

    KEEP = 8

    def __init__(self, scale: float, monotonic: Callable[[], float] = time.monotonic):
        self.scale, self.monotonic = scale, monotonic
        self.bounds: deque[tuple[float, float]] = deque(maxlen=self.KEEP)
        self.lo: float | None = None
        self.hi: float | None = None

    def read(self, date: dt.datetime, sent: float, received: float) -> dt.datetime:
        d = (date - EPOCH).total_seconds()
        self.bounds.append((d - self.scale * received, d + 1 - self.scale * sent))
        self.lo, self.hi = max(b[0] for b in self.bounds), min(b[1] for b in self.bounds)
        if self.lo >= self.hi:  # the cloud's clock jumped: this read alone
            self.bounds = deque([self.bounds[-1]], maxlen=self.KEEP)
            self.lo, self.hi = self.bounds[0]
        return self.now()

    def now(self) -> dt.datetime:
        return EPOCH + dt.timedelta(seconds=(self.lo + self.hi) / 2 + self.scale * self.monotonic())


class LeaseWatch:
    def __init__(self, spec: Spec, cluster: Cluster, request_stop: Callable[[dict], None],
                 say: Callable[[str], None], *, site: Site, poll: float | None = None,
                 on_extended: Callable[[dt.datetime], None] | None = None,
                 extend_by: Callable[[str, dt.datetime], tuple[dt.timedelta | None, str]] | None = None):
        self.spec, self.cluster, self.request_stop, self.say = spec, cluster, request_stop, say
        self.on_extended = on_extended  # the lease's new end: what the job's credentials must now outlive
        # how far it may extend the lease ending at a date, or (None, why not): a managed run's limits and handover
        self.extend_by = extend_by
        self.end_seen: dt.datetime | None = None  # the end of the last read: a later one is an extension
        self.site = site
        self.scale = site.time_scale()
        self.poll = poll if poll is not None else site.lease_poll
        self.clock = CloudClock(self.scale)
        self.floor = float(duration_seconds(spec.lease.stop_margin))
        self.commit_s: list[float] = []  # save+upload durations reported by rank 0
        self.done = threading.Event()
        self.stopped_at: float | None = None
        self.extended: list[str] = []
        self._thread = threading.Thread(target=self._run, name="lease-watch", daemon=True)

    def margin(self) -> float:
        return max(self.floor, 3 * max(self.commit_s or [0.0]) + 2 * self.poll)

    def extend_at(self) -> float:
        """Real seconds before the end at which `lease.extend` extends: ahead of every stop, the nodes' too."""
        return max(self.margin(), NODE_WATCH_MARGIN) + 2 * self.poll + 60.0

    def start(self) -> LeaseWatch:
        self._thread.start()
        return self

    def close(self) -> None:
        self.done.set()
        self._thread.join(timeout=5)

    def left(self) -> tuple[float, dt.datetime] | None:
        """(real seconds left, end) or None when the lease is gone: one read of the lease, whose answer carries the
        cloud's time as well."""
        sent = self.clock.monotonic()
        info, date = self.site.cloud.lease_at(self.cluster.lease_id)
        received = self.clock.monotonic()
        if info is None or info.unusable:
            return None
        return (info.end - self.clock.read(date, sent, received)).total_seconds() / self.scale, info.end

    def _run(self) -> None:
        first = True
        refused_for = None  # the end an extension was refused for: not asked again, the job stops at the margin
        while not self.done.is_set():
            try:
                got = self.left()
            except ApplianceError as e:
                self.say(f"[watchdog] could not read the lease ({e}); retrying")
                got = ()
            except Exception as e:  # the cloud API is down: keep trying, the vendordata path still runs
                self.say(f"[watchdog] could not read the lease ({type(e).__name__}); retrying")
                got = ()
            if got is None:
                self.say(f"[watchdog] lease {self.cluster.lease_id} is gone")
                return
            if got:
                left, end = got
                if self.end_seen is not None and end > self.end_seen:
                    self._extended_elsewhere(end)
                self.end_seen = end
                if first:
                    self.say(f"[watchdog] lease ends {end:%Y-%m-%d %H:%M} UTC, in {_human(left)} of real time; "
                             f"the job will stop {_human(self.margin())} before that")
                    first = False
                if self.spec.lease.extend and left <= self.extend_at() and refused_for != end:
                    if self._extend(end):
                        continue
                    refused_for = end
                if left <= self.margin():
                    deadline = time.time() + max(5.0, left - 2 * self.poll)
                    self.say(f"[watchdog] lease ends in {_human(left)}: asking the job to stop and checkpoint "
                             f"(margin {_human(self.margin())})")
                    self.stopped_at = time.time()
                    self.request_stop({"reason": f"lease {self.cluster.lease_id} ends {end:%Y-%m-%d %H:%M} UTC",
                                       "deadline": deadline})
                    return
                at = self.extend_at() if self.spec.lease.extend and refused_for != end else self.margin()
                # the next read at the moment to act, not up to one poll (or a halving step) after it: the end is
                # known, so the stop (or the extension) comes at the margin itself, to within one read of the lease
                wait = min(self.poll, max(0.0, left - at))
            else:
                wait = self.poll
            self.done.wait(wait)

    def _extend(self, end: dt.datetime) -> bool:
        # by the spec's duration, and never by less than keeps the new end clear of the next extension point
        by = dt.timedelta(seconds=max(duration_seconds(self.spec.lease.duration), 2 * self.extend_at() * self.scale))
        info, why = Lease(self.site.cloud, self.cluster.lease_id).extend(by, end, self.extend_by)
        if info is None:
            self.say(f"[watchdog] not extending the lease ({why}); the job will stop {_human(self.margin())} "
                     "before the end")
            return False
        self.say(f"[watchdog] extended lease {self.cluster.lease_id} to {info.end:%Y-%m-%d %H:%M} UTC")
        self.end_seen = info.end
        self._new_end(info.end)
        return True

    def _extended_elsewhere(self, end: dt.datetime) -> None:
        """The lease's end moved later by another hand (a managed run's controller, Horizon, `appliance lease
        extend`): the job's credentials are renewed for it as for the watchdog's own extension."""
        self.say(f"[watchdog] lease {self.cluster.lease_id} was extended to {end:%Y-%m-%d %H:%M} UTC")
        self._new_end(end)

    def _new_end(self, end: dt.datetime) -> None:
        self.extended.append(f"{end:%Y-%m-%d %H:%M}")
        self.cluster.lease_end = end.isoformat()
        if self.cluster.name:
            self.cluster.save()
        if self.on_extended is not None:
            try:
                self.on_extended(end)
            except Exception as e:  # noqa: BLE001 - the job runs on with the credential it has
                self.say(f"[watchdog] warning: the job's store credential was not renewed for the new end ({e})")


def _human(s: float) -> str:
    s = max(0, int(s))
    if s < 120:
        return f"{s}s"
    if s < 7200:
        return f"{s // 60}m{s % 60:02d}s"
    return f"{s // 3600}h{(s % 3600) // 60:02d}m"
