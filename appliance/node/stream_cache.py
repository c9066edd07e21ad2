"""A stream's shard cache (appliance/node/stream.py): the shards a rank reads, fetched ahead of its reader into a
directory on the node's local disk, never more than its capacity at once (a full cache waits for the reader), each
verified against index.json's MD5 before the reader may open it (a shard that does not match is fetched again,
never read), kept after it is read while there is room (the one read again last goes first: stream_reuse.py). A
shard the store does not have is one error naming it; a shard whose fetches are exhausted stops the reader at its
next sample, whichever shard it is at (the GETs: stream_fetch.py)."""

from __future__ import annotations

import dataclasses
import hashlib
import queue
import threading
import time
from collections.abc import Callable, Iterable
from pathlib import Path

from ..errors import ApplianceError
from .stream_reuse import Reuse

FETCH_TRIES = 3  # a shard whose bytes do not match its MD5 is fetched this many times before the job stops
# GETs in flight per rank (rclone's default --transfers is 4): one TCP stream's rate is not the link's, and each
# GET's first byte waits a round trip; the cache's capacity bounds them too
FETCHERS = 4


@dataclasses.dataclass
class CacheStats:
    fetched: int = 0  # shards fetched and verified
    refetched: int = 0  # fetched again after an MD5 mismatch
    ready: int = 0  # shards that were in the cache when the reader asked (hits)
    stalls: int = 0  # shards the reader waited for
    waited_s: float = 0.0  # the reader's time waiting for shards
    store_bytes: int = 0  # bytes fetched from the store for the visits the reader opened
    kept: int = 0  # visits read from a shard the cache had kept since an earlier one (nothing fetched)


# (shard name, where to write it) -> the MD5 of the bytes written, or None (the cache then reads them back): the
# store's GET, retried by its caller
Fetch = Callable[[str, Path], "str | None"]


def _too_big(s: dict, capacity: int) -> ApplianceError:
    return ApplianceError(f"shard {s['name']} ({s['size']} bytes) is larger than the stream cache ({capacity} bytes)",
                          "give dataset.cache more room, or pack smaller shards")


class ShardCache:
    """The shards ``shards`` (in reading order, each {name, size, md5} from index.json, one per visit: a shard read
    from its first sample to its last in a window; a list, or an endless iterator: a stream's epochs one after the
    other) fetched ahead into ``root``, at most ``capacity`` bytes at a time and up to ``fetchers`` GETs at once:
    one thread takes the visits in reading order and hands each whose shard the cache does not hold to the next
    free fetcher. ``get(i)`` waits for the i-th visit's shard and returns its path; ``release(i)`` ends the visit:
    its shard is kept for a later visit while there is room, the one read again last deleted first when a fetch
    needs room (appliance/node/stream_reuse.py, looking ``horizon`` visits ahead), and deleted at once when never
    read again; a kept shard is deleted only for a visit at most ``ahead`` visits past the reader's (fetching far
    ahead would trade kept shards for ones read later). ``close()`` stops the fetching and deletes what the cache
    holds."""

    def __init__(self, shards: Iterable[dict], root: Path, fetch: Fetch, capacity: int, fetchers: int = FETCHERS,
                 horizon: int | None = None, ahead: int | None = None):
        if isinstance(shards, list) and shards and max(s["size"] for s in shards) > capacity:
            raise _too_big(max(shards, key=lambda s: s["size"]), capacity)
        self.future, self.root, self.fetch, self.capacity = Reuse(shards, horizon), Path(root), fetch, capacity
        self.shards: dict[int, dict] = {}  # the i-th visit's shard, from its dispatch to its release
        self.root.mkdir(parents=True, exist_ok=True)
        self.stats = CacheStats()
        self.held = 0  # bytes of the shards in the cache: being fetched, read, or kept for a later visit
        self.peak = 0
        self.pending = 0  # bytes of the visits dispatched and not released: how far the fetching runs ahead
        self._pins: dict[str, int] = {}  # each shard in the cache -> its visits dispatched and not released
        self._ready: dict[str, Path] = {}  # the shards fetched and verified
        self._failed: dict[str, BaseException] = {}
        self._fresh: set[int] = set()  # the visits whose shard was fetched for them (not kept from an earlier one)
        self._files: dict[str, int] = {}  # shard name -> its number in the cache's file names
        self._full = False  # the cache half full: the source is read ``horizon`` visits ahead from now on
        self.ahead = ahead  # how many visits past the reader's a fetch may be to delete a kept shard for it
        self._reading = -1  # the last visit the reader asked for
        self._error: BaseException | None = None  # the dispatcher's: no shard from ``_next`` on will come
        self._next = 0  # visits dispatched so far
        self._busy = 0  # fetchers in a GET
        self._todo: queue.SimpleQueue[int | None] = queue.SimpleQueue()
        self._cv = threading.Condition()
        self._stop = False
        self._fetchers = max(1, fetchers)
        self._threads = [threading.Thread(target=self._run, name="appliance-stream-dispatch", daemon=True)]
        self._threads += [threading.Thread(target=self._work, name=f"appliance-stream-fetch-{k}", daemon=True)
                          for k in range(self._fetchers)]
        for t in self._threads:
            t.start()

    def _path(self, i: int) -> Path:
        name = self.shards[i]["name"]
        return self.root / f"{self._files.setdefault(name, len(self._files)):06d}-{Path(name).name}"

    def _fetch_verified(self, i: int) -> Path:
        s, path = self.shards[i], self._path(i)
        for attempt in range(FETCH_TRIES):
            tmp = path.with_name(path.name + ".part")
            try:
                md5 = self.fetch(s["name"], tmp)
            except FileNotFoundError:
                raise ApplianceError(f"shard {s['name']} is in index.json but not in the store",
                                     "pack the dataset again (`appliance data pack`), or restore the shard") from None
            if md5 is None:  # a fetch that did not hash the bytes it wrote: read them back
                h = hashlib.md5(usedforsecurity=False)
                with open(tmp, "rb") as fh:
                    for block in iter(lambda: fh.read(1 << 20), b""):
                        h.update(block)
                md5 = h.hexdigest()
            if md5 == s["md5"] and tmp.stat().st_size == s["size"]:
                tmp.replace(path)
                return path
            tmp.unlink(missing_ok=True)
            with self._cv:
                self.stats.refetched += 1
        raise ApplianceError(f"shard {s['name']}: its bytes did not match index.json's MD5 in {FETCH_TRIES} fetches",
                             "pack the dataset again (`appliance data pack`); nothing of this shard was read")

    def _run(self) -> None:
        """The dispatcher: each visit in reading order gets the shard the cache holds, or room and a free fetcher."""
        future = self.future
        try:
            while True:  # the source read outside the lock (computing the order takes time)
                future.read_ahead(future.taken + 1 + (future.horizon if self._full else 0))
                with self._cv:
                    got = future.take()
                    if got is None:
                        return
                    i, s = got
                    if s["size"] > self.capacity:
                        raise _too_big(s, self.capacity)
                    self.shards[i] = s
                    while not self._room(i, s):
                        if self._stop or self._failed:
                            return
                        self._cv.wait()  # a full cache waits for the reader to release a shard
                    if self._stop or self._failed:
                        return
                    future.reuse(s["name"])  # kept for this visit: no longer one to delete
                    self.pending += s["size"]
                    self._next = i + 1
                    fetch = s["name"] not in self._pins
                    self._pins[s["name"]] = self._pins.get(s["name"], 0) + 1
                    if fetch:
                        self._fresh.add(i)
                        self.held += s["size"]
                        self.peak = max(self.peak, self.held)
                        self._busy += 1
                        self._full = self._full or 2 * self.held > self.capacity
                    else:
                        self._cv.notify_all()  # a reader may wait for this visit: its shard is here
                if fetch:
                    self._todo.put(i)
        except BaseException as e:  # noqa: BLE001 - handed to the reader, which raises it
            with self._cv:
                self._error = e
                self._cv.notify_all()

    def _room(self, i: int, s: dict) -> bool:
        """Whether visit ``i`` (of shard ``s``) may be dispatched now (under the lock): within the run-ahead, and
        its shard held, or a fetcher free and room made by deleting kept shards, the one read again last first."""
        if self._stop or self._failed or self.pending + s["size"] > self.capacity:
            return False
        if s["name"] in self._pins:
            return True
        need = self.held + s["size"] - self.capacity
        if self._busy >= self._fetchers or need > self.future.kept_bytes or (
                need > 0 and self.ahead is not None and i > self._reading + self.ahead):
            return False  # a kept shard is deleted only for a visit the reader will soon open
        if need > 0:
            for name, size in self.future.evict(need):
                del self._pins[name]
                self._ready.pop(name).unlink(missing_ok=True)
                self.held -= size
        return True

    def _work(self) -> None:
        """A fetcher: the shards the dispatcher hands it, one GET at a time."""
        while (i := self._todo.get()) is not None:
            try:
                path, err = self._fetch_verified(i), None
            except BaseException as e:  # noqa: BLE001 - handed to the readers of this shard
                path, err = None, e
            with self._cv:
                self._busy -= 1
                name = self.shards[i]["name"]
                if self._stop and path is not None:
                    path.unlink(missing_ok=True)  # fetched after close(): nobody will read it
                elif path is not None:
                    self._ready[name] = path
                    self.stats.fetched += 1
                else:
                    self._failed[name] = err  # type: ignore[assignment]
                self._cv.notify_all()

    def get(self, i: int) -> Path:
        t0 = time.monotonic()
        with self._cv:
            self._reading = max(self._reading, i)
            self._cv.notify_all()  # the dispatcher may wait for the reader to come closer
            name = self.shards[i]["name"] if i < self._next else None
            if name in self._ready:
                self.stats.ready += 1
            else:
                self.stats.stalls += 1
                while not self._arrived(i):
                    self._cv.wait()
                self.stats.waited_s += time.monotonic() - t0
                name = self.shards[i]["name"] if i < self._next else None
                if name not in self._ready:  # this shard's fetches, or another's, are exhausted
                    failed = self._failed.get(name) or next(iter(self._failed.values()), None)
                    raise failed or self._error  # type: ignore[misc]
            if i in self._fresh:
                self._fresh.discard(i)
                self.stats.store_bytes += self.shards[i]["size"]
            else:
                self.stats.kept += 1
            return self._ready[name]

    def _arrived(self, i: int) -> bool:
        """Its shard is here, or a shard's fetches are exhausted (whichever it is: the wait ends, the job stops)."""
        if self._failed:
            return True
        if i >= self._next:
            return self._error is not None
        return self.shards[i]["name"] in self._ready

    def raise_failed(self) -> None:
        """The first shard whose fetches are exhausted (missing, not matching its MD5, the store away past its
        deadline), raised now: the job stops at the reader's next sample, not when it reaches that shard."""
        if self._failed:
            with self._cv:
                raise next(iter(self._failed.values()))

    def release(self, i: int) -> None:
        """The i-th visit is read: its shard kept for a later visit, or deleted when never read again."""
        with self._cv:
            s = self.shards.pop(i, None)
            if s is None:
                return
            name = s["name"]
            self.pending -= s["size"]
            self._pins[name] -= 1
            if self._pins[name] == 0 and (self._stop or not self.future.keep(name, s["size"])):
                del self._pins[name]
                self._ready.pop(name).unlink(missing_ok=True)
                self.held -= s["size"]
            self._cv.notify_all()

    def close(self) -> None:
        with self._cv:
            self._stop = True
            self._cv.notify_all()
        for _ in range(self._fetchers):
            self._todo.put(None)
        self._threads[0].join(timeout=30)  # the fetchers may be in a GET: they delete what they finish after this
        with self._cv:
            for path in self._ready.values():
                path.unlink(missing_ok=True)
            self._ready.clear()

