"""Which shards a stream's cache (appliance/node/stream.py ``ShardCache``) keeps after they are read: the reading
order is known ahead (appliance/node/stream_order.py: every epoch's order is a function of the run's settings), so
a shard read is kept while there is room, and when a fetch needs room the kept shard read again last goes first
(Belady's rule, by reuse distance). A cache that holds the rank's whole dataset fetches each shard once; one that
holds part of it fetches about the rest each epoch.

``Reuse`` is the cache's view of the future: the visits (a shard read from its first sample to its last in a
window) in reading order, taken by the cache's dispatcher one by one, looked ahead ``horizon`` visits when it must
choose what to delete; a shard with no visit within the horizon counts as read again after all the others."""

from __future__ import annotations

import heapq
from collections import deque
from collections.abc import Iterable

FAR = 1 << 62  # a shard not read within the horizon
NEVER = FAR + 1  # a shard the (finite) reading order never reads again


class Reuse:
    """The visits' shards (each {name, size, ...}) in reading order: a list (all known) or an endless iterator
    (looked ahead ``horizon`` visits when the cache must choose), and the shards the cache keeps for a later visit,
    the farthest read again first out."""

    def __init__(self, source: Iterable[dict], horizon: int | None = None):
        self._source = iter(source)
        self.horizon = horizon if horizon is not None else (len(source) if isinstance(source, list) else 0)
        self._read: deque[dict] = deque()  # visits read from the source ahead (``read_ahead``), not pulled yet
        self._dry = False  # the source is done
        self._ahead: dict[int, dict] = {}  # visits pulled from the source, not taken yet
        self._uses: dict[str, deque[int]] = {}  # shard name -> its visits pulled, not taken yet
        self.pulled = self.taken = 0
        self.ended = False  # the source has no more visits
        self.kept: dict[str, int] = {}  # shards kept for a later visit: name -> size
        self.kept_bytes = 0
        self._heap: list[tuple[int, str]] = []  # (-next visit, name) of kept shards (stale entries checked on pop)
        if isinstance(source, list):
            self._pull(len(source))

    def read_ahead(self, upto: int) -> None:
        """The source read up to visit ``upto`` (what takes time: computing the order), without changing what the
        cache sees: the dispatcher calls it outside the cache's lock, ``take`` and ``evict`` then pull from it."""
        while self.pulled + len(self._read) < upto and not self._dry:
            s = next(self._source, None)
            if s is None:
                self._dry = True
            else:
                self._read.append(s)

    def _pull(self, upto: int) -> None:
        self.read_ahead(upto)
        while self.pulled < upto and self._read:
            s = self._read.popleft()
            self._ahead[self.pulled] = s
            self._uses.setdefault(s["name"], deque()).append(self.pulled)
            self.pulled += 1
        self.ended = self._dry and not self._read

    def take(self) -> tuple[int, dict] | None:
        """The next visit (its number and shard) for the dispatcher; None once the source is done."""
        i = self.taken
        self._pull(i + 1)
        if i not in self._ahead:
            return None
        s = self._ahead.pop(i)
        uses = self._uses[s["name"]]
        uses.popleft()
        if not uses:
            del self._uses[s["name"]]
        self.taken += 1
        return i, s

    def next_visit(self, name: str) -> int:
        uses = self._uses.get(name)
        return uses[0] if uses else (NEVER if self.ended else FAR)

    def keep(self, name: str, size: int) -> bool:
        """The shard's last open visit ended: kept for its next one (True), or never read again (False: delete)."""
        nxt = self.next_visit(name)
        if nxt == NEVER:
            return False
        self.kept[name] = size
        self.kept_bytes += size
        heapq.heappush(self._heap, (-nxt, name))
        if len(self._heap) > 2 * len(self.kept) + 64:  # stale entries: the heap anew
            self._heap = [(-self.next_visit(n), n) for n in self.kept]
            heapq.heapify(self._heap)
        return True

    def reuse(self, name: str) -> bool:
        """A visit of a shard the cache holds: no longer a candidate to delete; True when it was kept."""
        size = self.kept.pop(name, None)
        self.kept_bytes -= size or 0
        return size is not None

    def evict(self, need: int) -> list[tuple[str, int]]:
        """Kept shards (name, size) to delete for ``need`` bytes (the caller checked they hold enough), the one read
        again last first, after looking ahead ``horizon`` visits."""
        self._pull(self.taken + self.horizon)
        out, freed = [], 0
        while freed < need and self._heap:
            key, name = heapq.heappop(self._heap)
            if name not in self.kept:
                continue  # read again since (or already out): a stale entry
            nxt = self.next_visit(name)
            if nxt != -key:  # the look ahead found its next visit (or the source ended): its place now
                heapq.heappush(self._heap, (-nxt, name))
                continue
            out.append((name, self.kept.pop(name)))
            freed += out[-1][1]
        self.kept_bytes -= freed
        return out
