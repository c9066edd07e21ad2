"""Reading a packed dataset (`appliance data pack`: shards + index.json) while it is fetched, through a bounded
cache on the node's local disk: the part of `dataset.mode: stream` that does not depend on TensorFlow.

- **The order** (appliance/node/stream_order.py): each step's global batch is a function of the run's seed, global
  batch, canonical shares (the first job's world size), shuffle window and index alone, never of the world size;
  samples are mixed across a window of shards; every sample of an epoch is read once. Rank r of w reads its part
  of each global batch.
- **The position** (``Position``) is the global step; a stream started at a step yields exactly the samples an
  uninterrupted one would have yielded after it, on any world size with the same global batch. A checkpoint keeps
  it with what fixes the order (``Stream.record``); a resume in another order is refused in one line.
- **The cache** (``ShardCache``) fetches the rank's shards in reading order ahead of the reader into a directory,
  never holding more than its capacity (it waits for the reader to release one), keeps the shards read while
  it has room for them (the one read again last goes first: stream_reuse.py), verifies each shard's MD5 from
  index.json before the reader may open it (a shard that does not match is fetched again, never read), and counts
  what the reader waited for. A shard the store does not have is one error naming it; a shard whose fetches are
  exhausted stops the reader at its next sample, whichever shard it is at (the GETs: stream_fetch.py).
"""

from __future__ import annotations

import dataclasses
import hashlib
import os
import queue
import random
import sys
import tarfile
import tempfile
import threading
import time
from collections.abc import Callable, Iterable, Iterator
from pathlib import Path

from ..errors import ApplianceError
from .stream_data import AUTOTUNE, keep_batch_size, refuse_shuffle, sample_batches, sample_elements
from .stream_order import WINDOW, Order, check_record, fingerprint, kept_batch, reads, record, shares_read
from .stream_fetch import store_fetch
from .stream_reuse import Reuse

FETCH_TRIES = 3  # a shard whose bytes do not match its MD5 is fetched this many times before the job stops
# GETs in flight per rank (rclone's default --transfers is 4): one TCP stream's rate is not the link's, and each
# GET's first byte waits a round trip; the cache's capacity bounds them too
FETCHERS = 4
# the cache looks this many times the dataset's shards ahead in a rank's reading order to choose what to keep: 2
# epochs on one share, more when a rank reads fewer of the shares (a shard not read within it goes first)
HORIZON = 2


@dataclasses.dataclass(frozen=True)
class Position:
    """Where the run's stream is: ``step`` global batches read since the run's start, which put it ``sample``
    samples into data epoch ``epoch`` (``step`` x the global batch = ``epoch`` x the dataset's samples +
    ``sample``)."""

    step: int = 0
    epoch: int = 0
    sample: int = 0


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


def tar_samples(path: Path) -> Iterator[tuple[str, dict[str, bytes]]]:
    """(key, {extension: bytes}) of a WebDataset tar shard, in order (members sharing a key are one sample)."""
    key, parts = None, {}
    with tarfile.open(path) as tf_:
        for m in tf_:
            if not m.isfile():
                continue
            d, _, base = m.name.rpartition("/")
            stem, _, ext = base.partition(".")
            k = f"{d}/{stem}" if d else stem
            if key is not None and k != key:
                yield key, parts
                parts = {}
            key = k
            parts[ext] = tf_.extractfile(m).read()
    if key is not None:
        yield key, parts


class _Shard:
    """A shard in the cache, its samples read in any order: the tar's members indexed once, each sample's read
    on demand (``tar_samples``'s grouping: members sharing a key are one sample)."""

    def __init__(self, path: Path):
        self.tar = tarfile.open(path)
        self.samples: list[tuple[str, list]] = []
        for m in self.tar:
            if not m.isfile():
                continue
            d, _, base = m.name.rpartition("/")
            stem, _, ext = base.partition(".")
            key = f"{d}/{stem}" if d else stem
            if not self.samples or self.samples[-1][0] != key:
                self.samples.append((key, []))
            self.samples[-1][1].append((ext, m))

    def sample(self, k: int) -> tuple[str, dict[str, bytes]]:
        key, members = self.samples[k]
        return key, {ext: self.tar.extractfile(m).read() for ext, m in members}

    def close(self) -> None:
        self.tar.close()


# ---------------------------------------------------------------------------------------------
# The job's stream: what a script reads (``open_stream``), and how a resume positions it

class Stream:
    """Rank ``rank``'s samples, step after step, from ``start`` (appliance/node/stream_order.py: the order):
    ``samples()`` is one pass over all epochs (Keras reads it through one iterator, ``steps_per_epoch`` batches an
    epoch). The shards are fetched ahead into one ``ShardCache`` of ``capacity`` bytes, kept while it has room;
    ``on_epoch`` hears each Keras epoch's cache counts, the cache's peak in it and its seconds (from its first
    sample asked for to its last). ``shares``: the run's canonical shares (default: this world size; a resume takes
    the checkpoint's); ``window``: shards whose samples are mixed at once (0: none)."""

    def __init__(self, index: dict, *, seed: int, rank: int, world: int, batch_size: int, root: Path, fetch: Fetch,
                 capacity: int, window: int = WINDOW, shares: int | None = None,
                 on_epoch: Callable[[int, CacheStats, int, float], None] | None = None):
        if index.get("format") != "tar":
            raise ApplianceError(f"stream mode reads tar shards; this dataset is {index.get('format')!r}",
                                 "pack it with `appliance data pack --format tar`")
        self.index, self.seed, self.rank, self.world = index, seed, rank, world
        self.batch_size, self.root, self.fetch, self.capacity = batch_size, Path(root), fetch, capacity
        self.fingerprint = fingerprint(index)
        self._set_order(Order(tuple(s["samples"] for s in index["shards"]), seed, batch_size * world,
                              shares or world, window))
        self.start = Position()
        self.on_epoch = on_epoch
        self.peak = 0  # the most bytes any epoch's cache held at once
        self.fetchers = FETCHERS
        self.datasets: list = []  # what ``dataset()`` made: the fit that reads one of them trains on this stream
        self.cache: ShardCache | None = None  # the cache of the last ``samples()``

    def _set_order(self, order: Order) -> None:
        order.check(self.world)
        held = shares_read(order, self.rank, self.world) * max(order.window, 1)
        big = max(s["size"] for s in self.index["shards"])
        if held * big > self.capacity:
            raise ApplianceError(f"the stream cache ({self.capacity:,} bytes a rank) cannot hold the {held} shard(s) "
                                 f"of {big:,} bytes the shuffle keeps at once (dataset.shuffle {order.window} x "
                                 f"{held // max(order.window, 1)} share(s) a rank)",
                                 "give dataset.cache more room, or set a smaller dataset.shuffle")
        self.order = order
        self.steps_per_epoch = order.steps_per_epoch
        self.per_epoch = self.steps_per_epoch * self.batch_size  # this rank's samples in a Keras epoch

    def start_at(self, epoch: int, batch: int, steps_per_epoch: int | None = None) -> Position:
        """Where a resume at (epoch, batch) of ``steps_per_epoch`` (the stream's by default) continues: the next
        global batch; a batch past the epoch's end is the next epoch's first."""
        spe = steps_per_epoch or self.steps_per_epoch
        step = epoch * spe + min(batch, spe)
        n = step * self.order.global_batch
        self.start = Position(step, n // self.order.total, n % self.order.total)
        return self.start

    def record(self, epoch: int, batch: int, steps_per_epoch: int | None = None) -> dict:
        """What a checkpoint at (epoch, batch) keeps of the stream: the position and what fixes the order."""
        spe = steps_per_epoch or self.steps_per_epoch
        return record(self.order, self.fingerprint, epoch * spe + min(batch, spe))

    def resume(self, epoch: int, batch: int, rec: dict | None, steps_per_epoch: int | None = None) -> Position:
        """A resume at (epoch, batch) of a checkpoint whose stream record is ``rec``: refused in one line when its
        order is not this one (seed, global batch, shuffle window, dataset), on the run's canonical shares."""
        if rec:
            check_record(self.order, self.fingerprint, rec)
            self._set_order(dataclasses.replace(self.order, shares=int(rec.get("shares") or self.order.shares)))
        at = self.start_at(epoch, batch, steps_per_epoch)
        if rec and "step" in rec and int(rec["step"]) != at.step:
            raise ApplianceError(f"the stream cannot resume: the checkpoint is at its step {rec['step']}, epoch "
                                 f"{epoch} batch {batch} is step {at.step} (another steps_per_epoch)",
                                 "give model.fit steps_per_epoch=stream.steps_per_epoch, as the first job did")
        return at

    def samples(self) -> Iterator[tuple[str, dict[str, bytes]]]:
        """Samples from ``start`` on, through one cache whose fetcher runs ahead in reading order, across epoch
        ends; a shard read is kept while the cache has room for it, the one read again last deleted first (the
        order looked ahead ``HORIZON`` x the dataset's shards)."""
        shards, step = self.index["shards"], self.start.step
        plan = lambda: reads(self.order, self.rank, self.world, step)  # noqa: E731
        cache = ShardCache((shards[j] for _, j, _, first, _ in plan() if first), self.root, self.fetch,
                           self.capacity, self.fetchers, horizon=HORIZON * len(shards),
                           ahead=2 * shares_read(self.order, self.rank, self.world) * max(self.order.window, 1)
                           + self.fetchers)  # this window's shards and the next's, and a GET per fetcher
        self.cache = cache
        held: dict[int, _Shard] = {}
        epoch, done = divmod(step, self.steps_per_epoch)
        done, said, t0 = done * self.batch_size, CacheStats(), None
        try:
            for n, _, k, first, last in plan():
                t0 = t0 or time.monotonic()
                cache.raise_failed()
                if first:
                    held[n] = _Shard(cache.get(n))
                sample = held[n].sample(k)
                if last:
                    held.pop(n).close()
                    cache.release(n)
                done += 1
                if done == self.per_epoch:  # said before its last sample is given: Keras may not ask on
                    said = self._said(epoch, cache, said, t0)
                    epoch, done, t0 = epoch + 1, 0, None
                yield sample
        finally:
            for h in held.values():
                h.close()
            cache.close()

    def _said(self, epoch: int, cache: ShardCache, said: CacheStats, t0: float) -> CacheStats:
        now = dataclasses.replace(cache.stats)
        self.peak = max(self.peak, cache.peak)
        if self.on_epoch:
            self.on_epoch(epoch, CacheStats(**{f.name: getattr(now, f.name) - getattr(said, f.name)
                                               for f in dataclasses.fields(CacheStats)}), cache.peak,
                          time.monotonic() - t0)
        cache.peak = cache.held
        return now

    def dataset(self, exts: list[str], map_fn=None, num_parallel_calls: int | None = AUTOTUNE):
        """A ``tf.data.Dataset`` of batches (``batch_size``, every epoch ``steps_per_epoch`` of them, then the next
        epoch's) of dicts ``{"__key__": key, ext: bytes, ...}``, after ``map_fn`` when given (as ``Dataset.map``
        takes it, on ``num_parallel_calls`` samples at once, the order kept: appliance/node/stream_data.py). Give
        ``model.fit`` ``steps_per_epoch=stream.steps_per_epoch``."""
        ds = sample_batches(self.samples, exts, self.batch_size, map_fn, num_parallel_calls)
        self.datasets.append(ds)
        return ds

    def elements(self, exts: list[str], map_fn=None, num_parallel_calls: int | None = AUTOTUNE):
        """The same samples one element each, for a script's own tf.data pipeline: ``map_fn`` as in ``dataset``;
        batch them by ``batch_size`` (another size is refused: a resume counts steps of it); ``shuffle()`` is
        refused."""
        ds = keep_batch_size(refuse_shuffle(sample_elements(self.samples, exts, map_fn, num_parallel_calls)),
                             self.batch_size)
        self.datasets.append(ds)
        return ds


_ACTIVE: list[Stream] = []  # the process's streams, in the order opened
_TRAINING: list[Stream] = []  # the one a fit trains on (``training_stream``): a resume positions it, a save records it


def training_stream(data=None) -> Stream | None:
    """The stream a fit of ``data`` trains on: the one whose ``dataset()`` is ``data``, else (a dataset mapped
    further) the first opened; never another one a validation reads. None when the process has no stream."""
    mine = [s for s in _ACTIVE if any(d is data for d in s.datasets)] if data is not None else []
    pick = (mine or _ACTIVE[:1] or [None])[0]
    _TRAINING[:] = [pick] if pick is not None else []
    return pick


def take_plan(epoch: int, batch: int, rec: dict | None = None, *, data=None,
              steps_per_epoch: int | None = None) -> Position | None:
    """A Keras resume at (epoch, batch): the stream the fit of ``data`` trains on starts there itself (nothing is
    read twice), once the checkpoint's record ``rec`` shows the same order; None when the process has no stream
    (Keras' own skip then replays the consumed batches)."""
    s = training_stream(data) if data is not None or not _TRAINING else _TRAINING[0]
    return s.resume(epoch, batch, rec, steps_per_epoch) if s is not None else None


def stream_record(epoch: int, batch: int, steps_per_epoch: int | None = None) -> dict | None:
    """What a checkpoint at (epoch, batch) keeps of the training stream; None without one."""
    s = _TRAINING[0] if _TRAINING else (_ACTIVE[0] if _ACTIVE else None)
    return s.record(epoch, batch, steps_per_epoch) if s is not None else None


def open_stream(batch_size: int, *, seed: int = 0, url: str | None = None, shares: int | None = None) -> Stream:
    """This rank's stream of the job's packed dataset (``dataset.mode: stream``: the launcher set where it is, the
    credentials file, the cache and the shuffle window in the environment). ``seed`` fixes the order of every
    epoch: keep it across a run's resumes, with the global batch (``batch_size`` x ranks; a resume under
    ``checkpoint.resize: batch`` keeps the checkpoint's: ``stream.batch_size`` is then its share on this world
    size). ``shares``: the run's canonical shares (default: the first job's world size; a resume keeps the
    checkpoint's). What keeps it from starting (no index, a cache smaller than the shuffle holds) is one line and
    exit status 1, not a traceback."""
    try:
        return _open_stream(batch_size, seed, url, shares)
    except ApplianceError as e:
        print(f"[appliance] error: {e}", file=sys.stderr, flush=True)
        raise SystemExit(1) from None


def _resumed_batch(batch_size: int, rank: int, world: int, env, index_fp: str) -> int:
    """The per-rank batch of a resume under ``checkpoint.resize: batch``: the staged checkpoint's global batch over
    this world size (stream_order.kept_batch), said by rank 0 when it is not the script's; a stream of another
    dataset than the checkpoint's (a validation stream) keeps the script's batch."""
    import json

    from ..protocol import Env

    meta = Path(env.get(Env.RESTORE) or "") / "meta.json"
    if env.get(Env.CKPT_RESIZE) != "batch" or not env.get(Env.RESTORE) or not meta.is_file():
        return batch_size
    rec = json.loads(meta.read_text()).get("stream") or {}
    kept = kept_batch(rec, batch_size, world) if rec.get("index") in (None, index_fp) else batch_size
    if kept != batch_size and rank == 0:
        print(f"[appliance] the stream keeps the run's global batch of {kept * world} (checkpoint.resize: batch): "
              f"{kept} a rank on {world} rank(s), not {batch_size}", file=sys.stderr, flush=True)
    return kept


def _open_stream(batch_size: int, seed: int, url: str | None, shares: int | None) -> Stream:
    import atexit
    import json
    import shutil

    from ..protocol import Env, Line, emit

    env = os.environ
    url = url or env.get(Env.STREAM_URL)
    if not url:
        raise ApplianceError("no stream: the job's spec has no dataset in mode stream",
                             "set dataset: {source: swift://..., mode: stream} in the spec")
    rank, world = int(env.get("HOROVOD_RANK", 0)), int(env.get("HOROVOD_SIZE", 1))
    local_rank, local = int(env.get("HOROVOD_LOCAL_RANK", 0)), max(1, int(env.get("HOROVOD_LOCAL_SIZE", 1)))
    sizes: dict[str, int] = {}  # each shard's, once index.json is read: its GETs' deadline
    fetch = store_fetch(url, env.get(Env.STREAM_CREDS), lambda m: print(m, file=sys.stderr, flush=True), rank=rank,
                        sizes=sizes)  # every rank says its waits on the store
    root = Path(env.get(Env.STREAM_CACHE) or Path(env.get(Env.DATA_DIR) or ".") / ".stream-cache") / f"rank-{local_rank}"
    shutil.rmtree(root, ignore_errors=True)  # a killed job's shards: the cache is this job's alone
    root.mkdir(parents=True, exist_ok=True)
    atexit.register(shutil.rmtree, root, True)  # and what the job fetched ahead goes with it
    node_bytes = int(env.get(Env.STREAM_CACHE_BYTES) or 0) or shutil.disk_usage(root).free // 2
    with tempfile.TemporaryDirectory(dir=root) as tmp:
        index_path = Path(tmp) / "index.json"
        try:
            fetch("index.json", index_path)
        except FileNotFoundError:
            raise ApplianceError(f"{url} has no index.json: not a packed dataset",
                                 f"pack it: `appliance data pack DIR {url}`") from None
        index = json.loads(index_path.read_text())
    sizes.update((x["name"], x["size"]) for x in index.get("shards", []))

    dataset_bytes = sum(x["size"] for x in index.get("shards", ()))

    def on_epoch(epoch: int, st: CacheStats, peak: int, wall_s: float) -> None:
        # for the launcher (data/stream.py says rank 0's, keeps every rank's bytes from the store in the record);
        # the rank in the line: horovodrun may glue it to another rank's open progress bar
        emit(Line.STREAM, {"rank": rank, "epoch": epoch, "read": st.ready + st.stalls, "ready": st.ready, "stalls": st.stalls,
                           "waited_s": round(st.waited_s, 3), "refetched": st.refetched, "peak": peak,
                           "capacity": node_bytes // local, "wall_s": round(wall_s, 3),
                           "store_bytes": st.store_bytes, "kept": st.kept, "dataset_bytes": dataset_bytes})

    big = max(index["shards"], key=lambda x: x["size"]) if index.get("shards") else None
    if big is not None and big["size"] > node_bytes // local:
        raise ApplianceError(f"the stream cache ({node_bytes // local:,} bytes for each of the node's {local} rank(s)) "
                             f"cannot hold shard {big['name']} ({big['size']:,} bytes)",
                             "give dataset.cache room for a few shards per rank, or pack smaller shards")
    window = int(env[Env.STREAM_SHUFFLE]) if env.get(Env.STREAM_SHUFFLE) else WINDOW
    batch_size = _resumed_batch(batch_size, rank, world, env, fingerprint(index))
    s = Stream(index, seed=seed, rank=rank, world=world, batch_size=batch_size, root=root, fetch=fetch,
               capacity=node_bytes // local, window=window, shares=shares, on_epoch=on_epoch)
    _ACTIVE.append(s)
    return s
