"""Reading a packed dataset (`appliance data pack`: shards + index.json) while it is fetched, through a bounded
cache on the node's local disk: the part of `dataset.mode: stream` that does not depend on TensorFlow.

- **The order** (appliance/node/stream_order.py): each step's global batch is a function of the run's seed, global
  batch, canonical shares (the first job's world size), shuffle window and index alone, never of the world size;
  samples are mixed across a window of shards; every sample of an epoch is read once. Rank r of w reads its part
  of each global batch. A mix of several packed datasets (``dataset.streams``) is one order too: each global
  batch takes from each dataset its weight's part, each dataset read in its own order.
- **The position** (``Position``) is the global step; a stream started at a step yields exactly the samples an
  uninterrupted one would have yielded after it, on any world size with the same global batch. A checkpoint keeps
  it with what fixes the order (``Stream.record``); a resume in another order is refused in one line.
- **The cache** (appliance/node/stream_cache.py ``ShardCache``) fetches the rank's shards in reading order ahead of
  the reader, verified, within its capacity, kept while it has room.
- **A validation stream** (``open_validation``) reads the same samples every pass, beside the training stream,
  with a cache of its own: it never moves the training stream's position.
"""

from __future__ import annotations

import dataclasses
import os
import sys
import tarfile
import tempfile
import time
from collections.abc import Callable, Iterator
from pathlib import Path

from ..errors import ApplianceError
from .stream_cache import FETCHERS, CacheStats, Fetch, ShardCache
from .stream_data import AUTOTUNE, keep_batch_size, refuse_shuffle, sample_batches, sample_elements
from .stream_fetch import store_fetch
from .stream_mix import Mix, check_record, mix_fingerprint, mix_of, record
from .stream_order import WINDOW, Order, fingerprint, kept_batch, passes, reads, shares_read

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

@dataclasses.dataclass(frozen=True)
class Member:
    """One packed dataset of a mix (``dataset.streams``): its name (in the lines, its shards' names in the cache,
    the checkpoint's record), its index.json, and its samples in a mix epoch (stream_mix.epoch_counts)."""

    name: str
    index: dict
    weight: int


class Stream:
    """Rank ``rank``'s samples, step after step, from ``start`` (appliance/node/stream_order.py: the order), of one
    packed dataset (``index``) or a weighted mix of several (a list of ``Member``: stream_mix.py; ``fetch`` then
    gets each shard as ``NAME/shard``): ``samples()`` is one pass over all epochs (Keras reads it through one
    iterator, ``steps_per_epoch`` batches an epoch). The shards are fetched ahead into one ``ShardCache`` of
    ``capacity`` bytes, kept while it has room; ``on_epoch`` hears each Keras epoch's cache counts, the cache's peak
    in it and its seconds (from its first sample asked for to its last). ``shares``: the run's canonical shares
    (default: this world size; a resume takes the checkpoint's); ``window``: shards whose samples are mixed at once
    (0: none). ``passes``: a validation stream's, whose ``samples()`` is the same pass every time (the first
    ``steps_per_epoch`` global batches), its cache kept from one pass to the next."""

    def __init__(self, index: dict | list[Member], *, seed: int, rank: int, world: int, batch_size: int, root: Path,
                 fetch: Fetch, capacity: int, window: int = WINDOW, shares: int | None = None,
                 on_epoch: Callable[[int, CacheStats, int, float], None] | None = None, passes: bool = False):
        members = index if isinstance(index, list) else None
        for m in members or [Member("", index, 0)]:  # type: ignore[arg-type]
            if m.index.get("format") != "tar":
                raise ApplianceError(f"stream mode reads tar shards; {m.name or 'this dataset'} is "
                                     f"{m.index.get('format')!r}", "pack it with `appliance data pack --format tar`")
        self.seed, self.rank, self.world, self.passes = seed, rank, world, passes
        self.batch_size, self.root, self.fetch, self.capacity = batch_size, Path(root), fetch, capacity
        if members:
            self.index = {"format": "tar", "shards": [{**s, "name": f"{m.name}/{s['name']}"}
                                                      for m in members for s in m.index["shards"]]}
            self.streams = [{"name": m.name, "index": fingerprint(m.index), "weight": m.weight} for m in members]
            self.biggest = [max(s["size"] for s in m.index["shards"]) for m in members]
            order = mix_of([tuple(s["samples"] for s in m.index["shards"]) for m in members],
                           [m.weight for m in members], seed, batch_size * world, shares or world, window)
        else:
            self.index, self.streams = index, None  # type: ignore[assignment]
            self.biggest = [max(s["size"] for s in index["shards"])]  # type: ignore[index]
            order = Order(tuple(s["samples"] for s in index["shards"]), seed, batch_size * world,  # type: ignore[index]
                          shares or world, window)
        self.fingerprint = fingerprint(self.index)
        self._set_order(order)
        self.start = Position()
        self.on_epoch = on_epoch
        self.peak = 0  # the most bytes any epoch's cache held at once
        self.fetchers = FETCHERS
        self.datasets: list = []  # what ``dataset()`` made: the fit that reads one of them trains on this stream
        self.cache: ShardCache | None = None  # the cache of the last ``samples()``
        self._reader: Iterator | None = None  # a validation stream's reader between two passes

    def _set_order(self, order: Order | Mix) -> None:
        order.check(self.world)
        held = shares_read(order, self.rank, self.world) * max(order.window, 1)
        if held * sum(self.biggest) > self.capacity:
            mix = f" x {len(self.biggest)} datasets" if len(self.biggest) > 1 else ""
            raise ApplianceError(f"the stream cache ({self.capacity:,} bytes a rank) cannot hold the "
                                 f"{held * len(self.biggest)} shard(s) of up to {max(self.biggest):,} bytes the "
                                 f"shuffle keeps at once (dataset.shuffle {order.window} x "
                                 f"{held // max(order.window, 1)} share(s) a rank{mix})",
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
        """What a checkpoint at (epoch, batch) keeps of the stream: the position and what fixes the order (a mix:
        each dataset's identity, weight and samples read)."""
        spe = steps_per_epoch or self.steps_per_epoch
        return record(self.order, self.fingerprint, epoch * spe + min(batch, spe), self.streams)

    def resume(self, epoch: int, batch: int, rec: dict | None, steps_per_epoch: int | None = None) -> Position:
        """A resume at (epoch, batch) of a checkpoint whose stream record is ``rec``: refused in one line when its
        order is not this one (seed, global batch, shuffle window, dataset or mix), on the run's canonical shares."""
        if rec:
            check_record(self.order, self.fingerprint, rec, self.streams)
            self._set_order(self.order.with_shares(int(rec.get("shares") or self.order.shares)))
        at = self.start_at(epoch, batch, steps_per_epoch)
        if rec and "step" in rec and int(rec["step"]) != at.step:
            raise ApplianceError(f"the stream cannot resume: the checkpoint is at its step {rec['step']}, epoch "
                                 f"{epoch} batch {batch} is step {at.step} (another steps_per_epoch)",
                                 "give model.fit steps_per_epoch=stream.steps_per_epoch, as the first job did")
        return at

    def samples(self) -> Iterator[tuple[str, dict[str, bytes]]]:
        """Samples from ``start`` on, through one cache whose fetcher runs ahead in reading order, across epoch
        ends; a shard read is kept while the cache has room for it, the one read again last deleted first (the
        order looked ahead ``HORIZON`` x the dataset's shards). A validation stream's: one pass (``_one_pass``)."""
        if self.passes:
            return self._one_pass()
        step = self.start.step
        return self._read(lambda: reads(self.order, self.rank, self.world, step), step)

    def _one_pass(self) -> Iterator[tuple[str, dict[str, bytes]]]:
        """The pass's ``per_epoch`` samples, from the reader the last pass left at its end (its cache holds what it
        kept), or a new one; a pass not read to its end takes its reader (and cache) with it."""
        reader, self._reader = self._reader, None
        reader = reader or self._read(lambda: passes(self.order, self.rank, self.world), 0)
        n = 0
        try:
            while n < self.per_epoch:
                n += 1
                yield next(reader)
        finally:
            if n == self.per_epoch and self._reader is None:
                self._reader = reader
            else:
                reader.close()

    def _read(self, plan: Callable[[], Iterator], step: int) -> Iterator[tuple[str, dict[str, bytes]]]:
        shards = self.index["shards"]
        cache = ShardCache((shards[j] for _, j, _, first, _ in plan() if first), self.root, self.fetch,
                           self.capacity, self.fetchers, horizon=HORIZON * len(shards),
                           ahead=2 * shares_read(self.order, self.rank, self.world) * max(self.order.window, 1)
                           * len(self.biggest) + self.fetchers)  # this window's shards and the next's, a GET a fetcher
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
        ``model.fit`` ``steps_per_epoch=stream.steps_per_epoch``. A validation stream's: one pass, of
        ``steps_per_epoch`` batches (its cardinality), each time it is iterated."""
        ds = sample_batches(self.samples, exts, self.batch_size, map_fn, num_parallel_calls,
                            self.per_epoch if self.passes else None)  # a validation pass: Keras knows its steps
        self.datasets.append(ds)
        return ds

    def elements(self, exts: list[str], map_fn=None, num_parallel_calls: int | None = AUTOTUNE):
        """The same samples one element each, for a script's own tf.data pipeline: ``map_fn`` as in ``dataset``;
        batch them by ``batch_size`` (another size is refused: a resume counts steps of it); ``shuffle()`` is
        refused."""
        ds = keep_batch_size(refuse_shuffle(sample_elements(self.samples, exts, map_fn, num_parallel_calls,
                                                            self.per_epoch if self.passes else None)), self.batch_size)
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
    """This rank's stream of the job's training data (``dataset.mode: stream``: one packed dataset,
    ``dataset.source``, or a weighted mix, ``dataset.streams``; the launcher set where they are, the credentials
    files, the cache and the shuffle window in the environment; ``url``: one packed dataset of your own choosing).
    ``seed`` fixes the order of every epoch: keep it across a run's resumes, with the global batch (``batch_size``
    x ranks; a resume under ``checkpoint.resize: batch`` keeps the checkpoint's: ``stream.batch_size`` is then its
    share on this world size). ``shares``: the run's canonical shares (default: the first job's world size; a
    resume keeps the checkpoint's). What keeps it from starting (no index, a cache smaller than the shuffle holds)
    is one line and exit status 1, not a traceback."""
    return _one_line(lambda: _open(batch_size, seed, url, shares, validation=False))


def open_validation(batch_size: int) -> Stream:
    """This rank's validation stream (``dataset.validation``): the same samples in the same order every pass (the
    first ``steps_per_epoch`` global batches of ``batch_size`` x ranks, no sample shuffle), through a cache of its
    own that keeps what it can from one pass to the next; it never moves the training stream, and a resume does
    not position it. ``model.fit(..., validation_data=val.dataset(...))`` evaluates one pass each epoch."""
    return _one_line(lambda: _open(batch_size, 0, None, None, validation=True))


def _one_line(make: Callable[[], Stream]) -> Stream:
    try:
        return make()
    except ApplianceError as e:
        print(f"[appliance] error: {e}", file=sys.stderr, flush=True)
        raise SystemExit(1) from None


def _sources(env, url: str | None, validation: bool) -> tuple[list[dict], bool]:
    """The packed datasets the stream reads ({name, url, creds, weight}), and whether they are a mix."""
    import json

    from ..protocol import Env

    if validation:
        v = json.loads(env.get(Env.STREAM_VALIDATION) or "null")
        if not v:
            raise ApplianceError("no validation stream: the job's spec has no dataset.validation",
                                 "add dataset.validation: {source: swift://...} to the spec")
        return [{**v, "name": "validation"}], False
    if url or not env.get(Env.STREAMS):
        url = url or env.get(Env.STREAM_URL)
        if not url:
            raise ApplianceError("no stream: the job's spec has no dataset in mode stream",
                                 "set dataset: {source: swift://..., mode: stream} in the spec")
        return [{"name": "", "url": url, "creds": env.get(Env.STREAM_CREDS)}], False
    return json.loads(env[Env.STREAMS]), True


def _node_cache(env, root: Path, validation: bool) -> int:
    """The node's cache for this stream: dataset.cache (default half the free disk), of which a validation stream
    takes dataset.validation.cache (default: its dataset's size, up to a quarter) and the training stream the rest."""
    import json
    import shutil

    from ..protocol import Env

    node = int(env.get(Env.STREAM_CACHE_BYTES) or 0) or shutil.disk_usage(root).free // 2
    v = json.loads(env.get(Env.STREAM_VALIDATION) or "null")
    val = int(v.get("cache") or 0) or min(int(v.get("bytes") or 0), node // 4) if v else 0
    if val >= node:
        raise ApplianceError(f"the validation stream's cache ({val:,} bytes a node) leaves none of the node's "
                             f"{node:,} to the training stream", "give dataset.validation.cache less, or "
                             "dataset.cache more")
    return val if validation else node - val


def _index(fetch: Fetch, url: str, root: Path) -> dict:
    import json

    with tempfile.TemporaryDirectory(dir=root) as tmp:
        index_path = Path(tmp) / "index.json"
        try:
            fetch("index.json", index_path)
        except FileNotFoundError:
            raise ApplianceError(f"{url} has no index.json: not a packed dataset",
                                 f"pack it: `appliance data pack DIR {url}`") from None
        return json.loads(index_path.read_text())


def _members(sources: list[dict], rank: int, root: Path, capacity: int, local: int) -> tuple[list[Member], dict]:
    """Each source's index.json (as a ``Member``) and its fetch, refused in one line when a shard of it is larger
    than a rank's part of the cache."""
    members, fetches = [], {}
    say = lambda m: print(m, file=sys.stderr, flush=True)  # noqa: E731 - every rank says its waits on the store
    for src in sources:
        sizes: dict[str, int] = {}  # each shard's, once index.json is read: its GETs' deadline
        fetches[src["name"]] = store_fetch(src["url"], src.get("creds"), say, rank=rank, sizes=sizes)
        members.append(Member(src["name"], _index(fetches[src["name"]], src["url"], root), int(src.get("weight") or 0)))
        sizes.update((x["name"], x["size"]) for x in members[-1].index.get("shards", []))
        big = max(members[-1].index.get("shards") or [{"size": 0}], key=lambda x: x["size"])
        if big["size"] > capacity:
            raise ApplianceError(f"the stream cache ({capacity:,} bytes for each of the node's {local} rank(s)) "
                                 f"cannot hold shard {big['name']} ({big['size']:,} bytes)",
                                 "give dataset.cache room for a few shards per rank, or pack smaller shards")
    return members, fetches


def _resumed_batch(batch_size: int, rank: int, world: int, env, index_fp: str) -> int:
    """The per-rank batch of a resume under ``checkpoint.resize: batch``: the staged checkpoint's global batch over
    this world size (stream_order.kept_batch), said by rank 0 when it is not the script's; a stream of another
    dataset than the checkpoint's keeps the script's batch."""
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


def _open(batch_size: int, seed: int, url: str | None, shares: int | None, *, validation: bool) -> Stream:
    import atexit
    import shutil

    from ..protocol import Env, Line, emit

    env = os.environ
    sources, mixed = _sources(env, url, validation)
    rank, world = int(env.get("HOROVOD_RANK", 0)), int(env.get("HOROVOD_SIZE", 1))
    local_rank, local = int(env.get("HOROVOD_LOCAL_RANK", 0)), max(1, int(env.get("HOROVOD_LOCAL_SIZE", 1)))
    base = Path(env.get(Env.STREAM_CACHE) or Path(env.get(Env.DATA_DIR) or ".") / ".stream-cache")
    root = base / f"{'validation-' if validation else ''}rank-{local_rank}"
    shutil.rmtree(root, ignore_errors=True)  # a killed job's shards: the cache is this job's alone
    root.mkdir(parents=True, exist_ok=True)
    atexit.register(shutil.rmtree, root, True)  # and what the job fetched ahead goes with it
    node_bytes = _node_cache(env, root, validation)
    members, fetches = _members(sources, rank, root, node_bytes // local, local)
    dataset_bytes = sum(x["size"] for m in members for x in m.index.get("shards", ()))

    def on_epoch(epoch: int, st: CacheStats, peak: int, wall_s: float) -> None:
        # for the launcher (data/stream.py says rank 0's, keeps every rank's bytes from the store in the record);
        # the rank in the line: horovodrun may glue it to another rank's open progress bar
        emit(Line.STREAM, {"rank": rank, "epoch": epoch, "read": st.ready + st.stalls, "ready": st.ready, "stalls": st.stalls,
                           "waited_s": round(st.waited_s, 3), "refetched": st.refetched, "peak": peak,
                           "capacity": node_bytes // local, "wall_s": round(wall_s, 3),
                           "store_bytes": st.store_bytes, "kept": st.kept, "dataset_bytes": dataset_bytes})

    def by_member(name: str, dest: Path):
        member, _, shard = name.partition("/")
        return fetches[member](shard, dest)

    window = 0 if validation else int(env[Env.STREAM_SHUFFLE]) if env.get(Env.STREAM_SHUFFLE) else WINDOW
    if not validation:  # the checkpoint's dataset (a mix: the mix's fingerprint, as its record has it)
        fp = mix_fingerprint([{"name": m.name, "index": fingerprint(m.index), "weight": m.weight} for m in members]) \
            if mixed else fingerprint(members[0].index)
        batch_size = _resumed_batch(batch_size, rank, world, env, fp)
    s = Stream(members if mixed else members[0].index, seed=seed, rank=rank, world=world, batch_size=batch_size,
               root=root, fetch=by_member if mixed else fetches[sources[0]["name"]], capacity=node_bytes // local,
               window=window, shares=shares, on_epoch=None if validation else on_epoch, passes=validation)
    if not validation:
        _ACTIVE.append(s)
    return s
