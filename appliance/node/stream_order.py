"""The order a stream (appliance/node/stream.py) reads a packed dataset in: which sample each rank reads at each
step, a function of the run's settings alone (``Order``: the shards' sample counts, the seed, the global batch,
the canonical shares, the shuffle window), never of the world size.

- **An epoch's order** (``share_order``): the shards in a permutation of (seed, epoch), their samples one after
  the other, cut into ``shares`` canonical shares of N // shares or N // shares + 1 samples (a shard may straddle
  two); each share cut into windows of ``window`` shards whose samples are permuted together, seeded by (seed,
  epoch, share, window). ``window`` 0: no sample shuffle (each shard's samples in pack order).
- **Global batches**: each share is an endless sequence (its epoch 0, then its epoch 1, ...); step i's global
  batch of B samples is, share after share, each share's samples i*B/C .. (i+1)*B/C - 1. So every sample of every
  epoch is read once and none twice, an uneven last shard included: an epoch's remainder that does not fill a
  batch opens the next batch, which reads on into the next epoch.
- **A rank's part**: rank r of w reads positions r*B/w .. (r+1)*B/w - 1 of each global batch. The global batches do
  not depend on w: a resume on another world size with the same global batch reads the same batches.
- **What a rank holds** (``reads``): a shard of a window is a *visit*, numbered in the order the rank first reads
  it (the cache fetches in that order) and done after the rank's last sample of it in the window (the cache
  deletes it then): at most ``window`` shards per share the rank reads at once.
- **A mix** (appliance/node/stream_mix.py ``Mix``): each share's places are dealt to several datasets by weight,
  each dataset read in its own order (an ``Order`` of its own); ``reads`` and ``global_batch`` take either. An
  ``Order`` is a mix of one: ``members`` itself, ``place`` and ``back`` the identity.
- **A pass** (``passes``): the same samples every time, for a validation stream.
"""

from __future__ import annotations

import bisect
import dataclasses
import functools
import hashlib
import itertools
import json
import random
from collections.abc import Iterator

from ..errors import ApplianceError

WINDOW = 16  # shards whose samples are mixed at once (dataset.shuffle's default): 16 x 64 MB shards = 1 GB a share


def epoch_order(seed: int, epoch: int, n_shards: int) -> list[int]:
    """The shards' order in ``epoch``: the same for a seed and an epoch whatever the world size."""
    order = list(range(n_shards))
    random.Random(f"appliance-stream:{seed}:{epoch}").shuffle(order)  # str seeds hash with SHA-512: stable
    return order


def fingerprint(index: dict) -> str:
    """index.json's shards (names, MD5s, sample counts), hashed: another pack of the dataset is another order."""
    rows = [[s["name"], s.get("md5", ""), s["samples"]] for s in index["shards"]]
    return hashlib.sha256(json.dumps(rows).encode()).hexdigest()[:16]


@dataclasses.dataclass(frozen=True)
class Order:
    counts: tuple[int, ...]  # samples of each shard, in index.json's order
    seed: int
    global_batch: int
    shares: int  # canonical shares: fixed at the run's first job
    window: int = WINDOW

    @property
    def total(self) -> int:
        return _starts(self.counts)[-1]

    @property
    def steps_per_epoch(self) -> int:
        return self.total // self.global_batch

    def share_size(self, c: int) -> int:
        return (c + 1) * self.total // self.shares - c * self.total // self.shares

    @property
    def members(self) -> tuple[Order, ...]:
        return (self,)

    def place(self, u: int) -> tuple[int, int]:
        """(dataset, its place) of a share's place ``u``: one dataset, its own places."""
        return 0, u

    def back(self, s: int, k: int) -> int:
        return k

    def with_shares(self, shares: int) -> Order:
        return dataclasses.replace(self, shares=shares)

    def check(self, world: int) -> None:
        check_batches(self, world, f"the dataset's {self.total} sample(s) are", "more data")


def check_batches(o, world: int, what: str, fix: str) -> None:
    """What an order (an ``Order`` or a ``Mix``) and ``world`` ranks need: whole shares and rank parts of the
    global batch, a batch an epoch (``what``: the epoch's samples, said; ``fix``: how to get more)."""
    b, c = o.global_batch, o.shares
    if b % c or b % world:
        raise ApplianceError(f"the stream's global batch {b} does not split into {c} canonical share(s) and "
                             f"{world} rank(s) evenly", "use a global batch that both divide")
    if o.steps_per_epoch == 0:
        raise ApplianceError(f"{what} less than one global batch of {b}", f"a smaller batch, or {fix}")


@functools.lru_cache(maxsize=4)
def _starts(counts: tuple[int, ...]) -> list[int]:
    """Each shard's first global sample id, and the total last."""
    out = [0]
    for n in counts:
        out.append(out[-1] + n)
    return out


def shard_of(starts: list[int], gid: int) -> tuple[int, int]:
    """(shard, sample in the shard) of global sample id ``gid`` (``starts``: ``_starts`` of the counts)."""
    j = bisect.bisect_right(starts, gid) - 1
    return j, gid - starts[j]


def _pieces(o: Order, c: int, epoch: int) -> list[tuple[int, int, int]]:
    """Share ``c``'s part of ``epoch``'s shard order: (shard, first sample, end) of each shard in it."""
    lo, hi = c * o.total // o.shares, (c + 1) * o.total // o.shares
    out, pos = [], 0
    for j in epoch_order(o.seed, epoch, len(o.counts)):
        a, b = max(lo, pos), min(hi, pos + o.counts[j])
        if a < b:
            out.append((j, a - pos, b - pos))
        pos += o.counts[j]
        if pos >= hi:
            break
    return out


@functools.lru_cache(maxsize=64)
def share_order(o: Order, c: int, epoch: int) -> tuple[list[int], list[int]]:
    """Share ``c``'s samples in ``epoch`` (global sample ids, in reading order) and its windows' bounds (offsets into
    that list, 0 first and the share's size last)."""
    starts, pieces, k = _starts(o.counts), _pieces(o, c, epoch), max(o.window, 1)
    ids, bounds = [], [0]
    for w in range(0, len(pieces), k):
        block = [starts[j] + i for j, a, b in pieces[w:w + k] for i in range(a, b)]
        if o.window:
            random.Random(f"appliance-stream:{o.seed}:{epoch}:{c}:{w // k}").shuffle(block)
        ids += block
        bounds.append(len(ids))
    return ids, bounds


def rank_slots(o: Order, rank: int, world: int) -> list[tuple[int, int]]:
    """Rank ``rank``'s positions in each global batch, as (share, place in the share's part of the batch)."""
    b, per = o.global_batch // o.shares, o.global_batch // world
    return [(p // b, p % b) for p in range(rank * per, (rank + 1) * per)]


def shares_read(o: Order, rank: int, world: int) -> int:
    return len({c for c, _ in rank_slots(o, rank, world)})


def global_batch(o, step: int) -> list[int]:
    """The global sample ids of step ``step``'s global batch (what every world size reads at that step) of an
    ``Order`` or a ``Mix`` (its datasets' samples numbered one after the other)."""
    b, offs = o.global_batch // o.shares, _offsets([m.total for m in o.members])
    return [offs[s] + _sample_at(o.members[s], c, t) for c in range(o.shares) for q in range(b)
            for s, t in (o.place(step * b + q),)]


def _offsets(sizes: list[int]) -> list[int]:
    out = [0]
    for n in sizes[:-1]:
        out.append(out[-1] + n)
    return out


def _sample_at(o: Order, c: int, t: int) -> int:
    epoch, u = divmod(t, o.share_size(c))
    return share_order(o, c, epoch)[0][u]


@dataclasses.dataclass
class _Window:
    ids: list[int]  # its epoch's share order
    base: int  # the share place of that epoch's first sample
    end: int  # the first share place past the window
    visits: dict[int, list]  # shard -> [visit number or None, the rank's samples of it left]


def _enter(o, s: int, c: int, t: int, mine: set[int], starts: list[int]) -> _Window:
    """Dataset ``s``'s share ``c``'s window holding its place ``t``, with the rank's reads of each shard in it from
    ``t`` on (the places of the mix ``o`` it is at: ``o.back``)."""
    m = o.members[s]
    b, size = o.global_batch // o.shares, m.share_size(c)
    epoch, u = divmod(t, size)
    ids, bounds = share_order(m, c, epoch)
    w = bisect.bisect_right(bounds, u) - 1
    base = epoch * size
    visits: dict[int, list] = {}
    back = o.back
    for x in range(t, base + bounds[w + 1]):
        if back(s, x) % b in mine:
            j = shard_of(starts, ids[x - base])[0]
            visits.setdefault(j, [None, 0])[1] += 1
    return _Window(ids, base, base + bounds[w + 1], visits)


def reads(o, rank: int, world: int, step: int) -> Iterator[tuple[int, int, int, bool, bool]]:
    """(visit, shard, sample in the shard, first of the visit, last of it) for each sample rank ``rank`` of
    ``world`` reads, from global step ``step`` on, endlessly, of an ``Order`` or a ``Mix`` (its datasets' shards
    numbered one after the other)."""
    b, slots = o.global_batch // o.shares, rank_slots(o, rank, world)
    starts = [_starts(m.counts) for m in o.members]
    firsts = _offsets([len(m.counts) for m in o.members])
    mine = {c: {q for cc, q in slots if cc == c} for c, _ in slots}
    current: dict[tuple[int, int], _Window] = {}
    visits, i = 0, step
    while True:
        for c, q in slots:
            s, t = o.place(i * b + q)
            win = current.get((s, c))
            if win is None or t >= win.end:
                win = current[(s, c)] = _enter(o, s, c, t, mine[c], starts[s])
            j, k = shard_of(starts[s], win.ids[t - win.base])
            v = win.visits[j]
            first = v[0] is None
            if first:
                v[0], visits = visits, visits + 1
            v[1] -= 1
            yield v[0], firsts[s] + j, k, first, v[1] == 0
        i += 1


def passes(o, rank: int, world: int) -> Iterator[tuple[int, int, int, bool, bool]]:
    """``reads`` of the rank's samples of the first ``o.steps_per_epoch`` global batches, again and again (a
    validation stream's passes): each visit ends within its pass, and the next pass's visits come after it."""
    one = list(itertools.islice(reads(o, rank, world, 0), o.steps_per_epoch * o.global_batch // world))
    ends = {v: i for i, (v, *_rest) in enumerate(one)}
    n = len(ends)
    for r in itertools.count():
        for i, (v, j, k, first, _) in enumerate(one):
            yield r * n + v, j, k, first, ends[v] == i


# ---------------------------------------------------------------------------------------------
# What a checkpoint keeps of the stream, and what a resume must match

CHECKED = (("seed", "seed"), ("global_batch", "global batch"), ("window", "dataset.shuffle window"),
           ("index", "packed dataset (index.json)"))


def record(o: Order, index_fp: str, step: int) -> dict:
    """The stream's part of a checkpoint at global step ``step``: the position and what fixes the order."""
    n = step * o.global_batch
    return {"step": step, "epoch": n // o.total, "sample": n % o.total, "seed": o.seed,
            "global_batch": o.global_batch, "shares": o.shares, "window": o.window, "index": index_fp}


def kept_batch(rec: dict | None, batch_size: int, world: int) -> int:
    """A resume's per-rank batch under ``checkpoint.resize: batch``: the global batch of the checkpoint's stream
    record ``rec`` over ``world`` ranks, so the run's global batches go on, on any world size that divides it
    (``batch_size``, the script's, when the checkpoint has no stream); one line when ``world`` does not."""
    g = int((rec or {}).get("global_batch") or 0)
    if not g or g == batch_size * world:
        return batch_size
    if g % world:
        raise ApplianceError(f"checkpoint.resize: batch keeps the stream's global batch {g}, which {world} rank(s) "
                             "cannot split evenly", "resume on a number of ranks that divides it")
    return g // world


def check_record(o: Order, index_fp: str, rec: dict) -> None:
    """A resume reads on in the checkpoint's order or not at all: one line naming what differs."""
    now = {"seed": o.seed, "global_batch": o.global_batch, "window": o.window, "index": index_fp}
    for key, what in CHECKED:
        if key in rec and rec[key] != now[key]:
            raise ApplianceError(f"the stream cannot resume: its {what} is {now[key]}, the checkpoint's is "
                                 f"{rec[key]} (another order: it would continue at other samples)",
                                 f"resume with the checkpoint's {what}, or start a new run"
                                 + (" (checkpoint.resize: batch keeps it on another world size)"
                                    if key == "global_batch" else ""))
