"""Reading a packed dataset (`appliance data pack`: shards + index.json) while it is fetched, through a bounded
cache on the node's local disk: the part of `dataset.mode: stream` that does not depend on TensorFlow.

- **The order** of an epoch is a function of the seed and the epoch alone (``epoch_order``): a permutation of the
  shards, the same on every rank and every machine; rank r of w reads every w-th of it (``rank_share``), so the
  ranks together read each shard of the epoch once (the tail that does not divide evenly is left out of that epoch,
  as Horovod needs the same step count on every rank).
- **The position** (``Position``: epoch, shards done, samples into the current shard) is a few integers; a reader
  started at a position yields exactly the samples an uninterrupted reader would have yielded after it.
- **The cache** (``ShardCache``) fetches the rank's shards in reading order ahead of the reader into a directory,
  never holding more than its capacity (it waits for the reader to release one), verifies each shard's MD5 from
  index.json before the reader may open it (a shard that does not match is fetched again, never read), and counts
  what the reader waited for. A shard the store does not have is one error naming it.
"""

from __future__ import annotations

import dataclasses
import hashlib
import random
import tarfile
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path

from ..errors import ApplianceError

FETCH_TRIES = 3  # a shard whose bytes do not match its MD5 is fetched this many times before the job stops


def epoch_order(seed: int, epoch: int, n_shards: int) -> list[int]:
    """The shards' reading order in ``epoch``: the same for a seed and an epoch whatever the world size."""
    order = list(range(n_shards))
    random.Random(f"appliance-stream:{seed}:{epoch}").shuffle(order)  # str seeds hash with SHA-512: stable
    return order


def rank_share(order: list[int], rank: int, world: int) -> list[int]:
    """Rank ``rank``'s shards of an epoch's order: every ``world``-th, from the rank's own; the same count on every
    rank (the remainder of the order is not read in that epoch)."""
    usable = len(order) - len(order) % world
    return order[rank:usable:world]


@dataclasses.dataclass(frozen=True)
class Position:
    """Where a rank's reader is: ``shards`` of its share of ``epoch`` read whole, ``samples`` into the next."""

    epoch: int = 0
    shards: int = 0
    samples: int = 0

    def as_dict(self) -> dict:
        return dataclasses.asdict(self)

    @classmethod
    def of(cls, d: dict | None) -> Position:
        return cls(**{k: int(v) for k, v in (d or {}).items() if k in ("epoch", "shards", "samples")})


@dataclasses.dataclass
class CacheStats:
    fetched: int = 0  # shards fetched and verified
    refetched: int = 0  # fetched again after an MD5 mismatch
    ready: int = 0  # shards that were in the cache when the reader asked (hits)
    stalls: int = 0  # shards the reader waited for
    waited_s: float = 0.0  # the reader's time waiting for shards


Fetch = Callable[[str, Path], None]  # (shard name, where to write it): the store's get, retried by its caller


class ShardCache:
    """The shards ``names`` (in reading order, each {name, size, md5} from index.json) fetched ahead into ``root``
    by one thread, at most ``capacity`` bytes at a time. ``get(i)`` waits for the i-th and returns its path;
    ``release(i)`` deletes it. ``close()`` stops the fetcher."""

    def __init__(self, shards: list[dict], root: Path, fetch: Fetch, capacity: int):
        if shards and max(s["size"] for s in shards) > capacity:
            big = max(shards, key=lambda s: s["size"])
            raise ApplianceError(f"shard {big['name']} ({big['size']} bytes) is larger than the stream cache "
                                 f"({capacity} bytes)", "give dataset.cache more room, or pack smaller shards")
        self.shards, self.root, self.fetch, self.capacity = shards, Path(root), fetch, capacity
        self.root.mkdir(parents=True, exist_ok=True)
        self.stats = CacheStats()
        self.held = 0  # bytes of fetched, not yet released shards
        self.peak = 0
        self._done: dict[int, Path] = {}
        self._error: BaseException | None = None
        self._cv = threading.Condition()
        self._stop = False
        self._thread = threading.Thread(target=self._run, name="appliance-stream-fetch", daemon=True)
        self._thread.start()

    def _path(self, i: int) -> Path:
        return self.root / f"{i:06d}-{Path(self.shards[i]['name']).name}"

    def _fetch_verified(self, i: int) -> Path:
        s, path = self.shards[i], self._path(i)
        for attempt in range(FETCH_TRIES):
            tmp = path.with_name(path.name + ".part")
            try:
                self.fetch(s["name"], tmp)
            except FileNotFoundError:
                raise ApplianceError(f"shard {s['name']} is in index.json but not in the store",
                                     "pack the dataset again (`appliance data pack`), or restore the shard") from None
            h = hashlib.md5(usedforsecurity=False)
            with open(tmp, "rb") as fh:
                for block in iter(lambda: fh.read(1 << 20), b""):
                    h.update(block)
            if h.hexdigest() == s["md5"] and tmp.stat().st_size == s["size"]:
                tmp.replace(path)
                return path
            tmp.unlink(missing_ok=True)
            self.stats.refetched += 1
        raise ApplianceError(f"shard {s['name']}: its bytes did not match index.json's MD5 in {FETCH_TRIES} fetches",
                             "pack the dataset again (`appliance data pack`); nothing of this shard was read")

    def _run(self) -> None:
        try:
            for i, s in enumerate(self.shards):
                with self._cv:
                    while not self._stop and self.held + s["size"] > self.capacity:
                        self._cv.wait()  # a full cache waits for the reader to release a shard
                    if self._stop:
                        return
                    self.held += s["size"]
                    self.peak = max(self.peak, self.held)
                path = self._fetch_verified(i)
                with self._cv:
                    self._done[i] = path
                    self.stats.fetched += 1
                    self._cv.notify_all()
        except BaseException as e:  # noqa: BLE001 - handed to the reader, which raises it
            with self._cv:
                self._error = e
                self._cv.notify_all()

    def get(self, i: int) -> Path:
        t0 = time.monotonic()
        with self._cv:
            if i in self._done:
                self.stats.ready += 1
                return self._done[i]
            self.stats.stalls += 1
            while i not in self._done and self._error is None:
                self._cv.wait()
            self.stats.waited_s += time.monotonic() - t0
            if i not in self._done:
                raise self._error  # type: ignore[misc]
            return self._done[i]

    def release(self, i: int) -> None:
        with self._cv:
            path = self._done.pop(i, None)
            if path is not None:
                path.unlink(missing_ok=True)
                self.held -= self.shards[i]["size"]
                self._cv.notify_all()

    def close(self) -> None:
        with self._cv:
            self._stop = True
            self._cv.notify_all()
        self._thread.join(timeout=30)
        for i in list(self._done):
            self.release(i)


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


def position_of(index: dict, *, seed: int, rank: int, world: int, epoch: int, consumed: int) -> Position:
    """The position after ``consumed`` samples of rank ``rank``'s share of ``epoch``: what a checkpoint after step S
    of the epoch resumes from, with ``consumed`` = S x the rank's batch size. Training keeps only its step (the
    Checkpointer's epoch and batch): the order is the seed's, so the samples behind it are known."""
    shards = index["shards"]
    mine = rank_share(epoch_order(seed, epoch, len(shards)), rank, world)
    left = consumed
    for done, j in enumerate(mine):
        count = shards[j]["samples"]
        if left < count:
            return Position(epoch, done, left)
        left -= count
    if left:
        raise ApplianceError(f"{consumed} samples into epoch {epoch} is past rank {rank}'s share of it",
                             "the checkpoint is of another dataset, seed or world size")
    return Position(epoch + 1, 0, 0)


def _after(epoch: int, done: int, samples: int, count: int, share: int) -> Position:
    """The position after a sample, normalized: a shard read whole is done, an epoch read whole is the next's start
    (a resume there fetches nothing it has read)."""
    if samples < count:
        return Position(epoch, done, samples)
    return Position(epoch + 1, 0, 0) if done + 1 == share else Position(epoch, done + 1, 0)


def read_epochs(index: dict, *, seed: int, rank: int, world: int, start: Position, epochs: int, root: Path,
                fetch: Fetch, capacity: int, on_stats: Callable[[CacheStats], None] | None = None) \
        -> Iterator[tuple[Position, str, dict[str, bytes]]]:
    """Rank ``rank``'s samples from ``start`` to the end of epoch ``epochs - 1``, each with the position after it
    (what a checkpoint taken after this sample records). Tar shards only."""
    if index.get("format") != "tar":
        raise ApplianceError(f"stream mode reads tar shards; this dataset is {index.get('format')!r}",
                             "pack it with `appliance data pack --format tar`")
    shards = index["shards"]
    for epoch in range(start.epoch, epochs):
        mine = rank_share(epoch_order(seed, epoch, len(shards)), rank, world)
        first = start.shards if epoch == start.epoch else 0
        cache = ShardCache([shards[j] for j in mine[first:]], root / f"epoch-{epoch}", fetch, capacity)
        try:
            for n in range(len(mine) - first):
                done = first + n
                skip = start.samples if (epoch == start.epoch and n == 0) else 0
                path = cache.get(n)
                count = shards[mine[done]]["samples"]
                for k, (key, parts) in enumerate(tar_samples(path)):
                    if k < skip:
                        continue
                    yield _after(epoch, done, k + 1, count, len(mine)), key, parts
                cache.release(n)
            if on_stats:
                on_stats(cache.stats)
        finally:
            cache.close()
