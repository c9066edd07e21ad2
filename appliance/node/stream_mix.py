"""A weighted mix of several packed datasets read as one stream (``dataset.streams``), in the spirit of MosaicML
Streaming's ``streams`` (streaming/base/stream.py: ``proportion``, ``repeat``, ``choose``), in an order that is a
function of the seed, the datasets and their weights alone, never of the world size.

- **A mix epoch** is ``weights[s]`` samples of each dataset ``s`` (``epoch_counts``: Streaming's three ways to say
  it, or each dataset's own size), its steps that total over the global batch.
- **Each share's places are dealt to the datasets** (``Mix.place``): a binary tree over the datasets splits each
  node's places between its two halves by their weights, each half's count the floor of its exact share: among
  any ``u`` places of a share, dataset ``s`` has ``u x weights[s] / total`` of them, give or take one per level of
  the tree, and exactly its weight in every ``total`` places. Every global batch holds each dataset's part
  (stratified, as Streaming's ``batching_method: stratified``), every rank's part of it too.
- **Each dataset is read in its own order** (stream_order.py ``Order``: its shards in a permutation of its seed
  and epoch, cut into the run's canonical shares, windows of shards mixed), at its own pace: a dataset weighted
  past its size is read again from its next epoch, every sample once before any twice; one weighted under it is
  read on from where the last mix epoch left it.
- **Its position**: the global step fixes every dataset's (``Mix.taken``); a checkpoint keeps each dataset's
  name, index fingerprint, weight and samples read (``record``), and a resume with another mix is one line.
"""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import json
from collections.abc import Sequence

from ..errors import ApplianceError
from .stream_order import Order, check_batches, check_record as check_order, record as order_record

KINDS = ("proportion", "repeat", "choose")  # Streaming's Stream arguments; at most one, the same for every dataset


def epoch_counts(kind: str | None, values: Sequence[float], sizes: Sequence[int]) -> list[int]:
    """Each dataset's samples in a mix epoch (``sizes``: each one's samples). ``kind`` None: its size (each dataset
    once an epoch); ``repeat``: its size times the value; ``choose``: the value; ``proportion``: the values'
    shares of the datasets' total size (an epoch as long as all of them once, as Streaming's default epoch_size),
    rounded by largest remainders so that they add up to it. Every dataset gets at least one sample."""
    if kind is None:
        out = list(sizes)
    elif kind == "repeat":
        out = [round(v * n) for v, n in zip(values, sizes)]
    elif kind == "choose":
        out = [int(v) for v in values]
    else:
        total, whole = sum(sizes), sum(values)
        exact = [v * total / whole for v in values]
        out = [int(x) for x in exact]
        for i in sorted(range(len(out)), key=lambda i: (out[i] - exact[i], i))[:total - sum(out)]:
            out[i] += 1
    return [max(1, int(x)) for x in out]


@functools.lru_cache(maxsize=16)
def _prefix(weights: tuple[int, ...]) -> tuple[int, ...]:
    out = [0]
    for w in weights:
        out.append(out[-1] + w)
    return tuple(out)


@dataclasses.dataclass(frozen=True)
class Mix:
    """Datasets read as one order: ``members`` (each one's ``Order``: its shards' sample counts, its own seed, the
    run's global batch, canonical shares and window) and ``weights`` (each one's samples in a mix epoch)."""

    members: tuple[Order, ...]
    weights: tuple[int, ...]
    seed: int

    @property
    def global_batch(self) -> int:
        return self.members[0].global_batch

    @property
    def shares(self) -> int:
        return self.members[0].shares

    @property
    def window(self) -> int:
        return self.members[0].window

    @property
    def total(self) -> int:
        return sum(self.weights)

    @property
    def steps_per_epoch(self) -> int:
        return self.total // self.global_batch

    def with_shares(self, shares: int) -> Mix:
        return dataclasses.replace(self, members=tuple(m.with_shares(shares) for m in self.members))

    def check(self, world: int) -> None:
        """Whole shares and rank parts of the global batch, a batch in a mix epoch, every dataset in every share."""
        check_batches(self, world, f"the mix's {self.total} sample(s) an epoch are", "larger weights")
        c = self.shares
        small = [s for s, m in enumerate(self.members) if m.total < c]
        if small:
            raise ApplianceError(f"dataset {small[0]} of the mix has {self.members[small[0]].total} sample(s), fewer "
                                 f"than the run's {c} canonical share(s)", "pack more samples into it, or leave it out")

    def _path(self, s: int) -> list[tuple[bool, int, int]]:
        """The tree's nodes above dataset ``s``, from the root: (``s`` in the left half, the left half's weight,
        the node's)."""
        p, lo, hi, out = _prefix(self.weights), 0, len(self.weights), []
        while hi - lo > 1:
            mid = (lo + hi) // 2
            out.append((s < mid, p[mid] - p[lo], p[hi] - p[lo]))
            lo, hi = (lo, mid) if s < mid else (mid, hi)
        return out

    def place(self, u: int) -> tuple[int, int]:
        """(dataset, its place in its own share) of a share's place ``u``."""
        p, lo, hi = _prefix(self.weights), 0, len(self.weights)
        while hi - lo > 1:
            mid = (lo + hi) // 2
            left, m = p[mid] - p[lo], p[hi] - p[lo]
            a = u * left // m  # the left half's places before u
            if (u + 1) * left // m > a:
                u, hi = a, mid
            else:
                u, lo = u - a, mid
        return lo, u

    def back(self, s: int, k: int) -> int:
        """The share's place of dataset ``s``'s place ``k`` (``place``'s inverse)."""
        for left_half, left, m in reversed(self._path(s)):
            k = -(-(k + 1) * m // left) - 1 if left_half else k * m // (m - left)
        return k

    def taken(self, s: int, u: int) -> int:
        """How many of a share's first ``u`` places are dataset ``s``'s."""
        for left_half, left, m in self._path(s):
            a = u * left // m
            u = a if left_half else u - a
        return u


def mix_of(counts: Sequence[tuple[int, ...]], weights: Sequence[int], seed: int, global_batch: int, shares: int,
           window: int) -> Mix:
    """The mix of datasets of shards of ``counts`` samples: dataset ``s`` in an order seeded by (seed, s)."""
    return Mix(tuple(Order(tuple(c), f"{seed}/{s}", global_batch, shares, window)  # type: ignore[arg-type]
                     for s, c in enumerate(counts)), tuple(weights), seed)


def mix_fingerprint(streams: list[dict]) -> str:
    rows = [[s["name"], s["index"], s["weight"]] for s in streams]
    return hashlib.sha256(json.dumps(rows).encode()).hexdigest()[:16]


def record(o: Order | Mix, index_fp: str, step: int, streams: list[dict] | None = None) -> dict:
    """The stream's part of a checkpoint at global step ``step``; a mix's (``streams``: each dataset's name,
    index fingerprint and weight) adds each dataset's samples read since the run's start and its epochs."""
    if not isinstance(o, Mix):
        return order_record(o, index_fp, step)
    rec = order_record(o, mix_fingerprint(streams or []), step)
    u = step * (o.global_batch // o.shares)  # each share's places read
    rec["streams"] = [{**st, "read": o.shares * o.taken(s, u),
                       "epochs": round(o.shares * o.taken(s, u) / o.members[s].total, 4)}
                      for s, st in enumerate(streams or [])]
    return rec


def _said(streams: list[dict] | None) -> str:
    if not streams:
        return "one packed dataset (dataset.source)"
    return f"a mix of {len(streams)} ({', '.join(s['name'] for s in streams)})"


def check_record(o: Order | Mix, index_fp: str, rec: dict, streams: list[dict] | None = None) -> None:
    """A resume reads on in the checkpoint's order or not at all: another mix (datasets, their order, packs or
    weights) is one line naming what differs, then stream_order.check_record's seed, batch, window."""
    was = rec.get("streams")
    fix = "resume with the checkpoint's dataset.source or dataset.streams, or start a new run"
    if "step" in rec and [s["name"] for s in streams or []] != [s.get("name") for s in was or []]:
        raise ApplianceError(f"the stream cannot resume: its data is {_said(streams)}, the checkpoint's is "
                             f"{_said(was)} (another order: it would continue at other samples)", fix)
    for now, then in zip(streams or [], was or []):
        for key, what in (("index", "packed dataset (index.json)"), ("weight", "samples a mix epoch")):
            if now[key] != then.get(key):
                raise ApplianceError(f"the stream cannot resume: dataset.streams {now['name']}'s {what} is "
                                     f"{now[key]}, the checkpoint's is {then.get(key)} (another order: it would "
                                     "continue at other samples)", fix)
    check_order(o, mix_fingerprint(streams) if streams else index_fp, rec)  # type: ignore[arg-type]
