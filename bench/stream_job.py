"""One reader of bench/stream_bench.py, run inside a testbed node's network namespace: it reads a packed dataset for
some epochs at a training's pace and prints what it measured as one JSON line.

  --mode stream   appliance/node/stream.py's Stream: shards fetched from the store through a bounded cache
  --mode local    the same shards, already on the node's disk, read in the same order (what staging gives)

Both go through the same tf.data input a Keras job gets (``Stream.dataset``: the samples of a Python generator,
batched, prefetched), so what is measured is what ``model.fit`` would wait for. The training's pace is a modelled
accelerator step: after every batch the reader waits ``--step-ms`` (a GPU step leaves the CPU free, so the wait is
a sleep here, not work). Input wait is the time spent getting the next batch from the dataset's iterator, as a
share of the steps' time; the start (until the first batch: the first shard's GET, tf.data's first fill) is
reported apart, as it is paid once a job. CPU is this process's own after TensorFlow's import (user + system,
tf.data's and the fetchers' threads included)."""

from __future__ import annotations

import argparse
import json
import resource
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from appliance.node.stream import Stream, store_fetch, tar_samples  # noqa: E402
from appliance.node.stream_data import sample_batches  # noqa: E402
from appliance.node.stream_order import WINDOW, Order, reads  # noqa: E402

EXTS = ["bin", "cls"]


def local_samples(index: dict, root: Path, seed: int, batch: int):
    """The stream's order (one rank, its default shuffle window) read from the staged shards."""
    order = Order(tuple(x["samples"] for x in index["shards"]), seed, batch, 1, WINDOW)
    held: dict[int, list] = {}
    for n, j, k, first, last in reads(order, 0, 1, 0):
        if first:
            held[n] = list(tar_samples(root / index["shards"][j]["name"]))
        yield held[n][k]
        if last:
            del held[n]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--mode", choices=("stream", "local"), required=True)
    ap.add_argument("--index", required=True, help="index.json (a local copy)")
    ap.add_argument("--url", help="stream: the packed dataset's URL")
    ap.add_argument("--creds", help="stream: a StoreCreds JSON file")
    ap.add_argument("--local-dir", help="local: the directory of the shards; stream: the cache's")
    ap.add_argument("--cache-bytes", type=int, default=0)
    ap.add_argument("--fetchers", type=int, default=0, help="stream: GETs at once (default: the stream's)")
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--step-ms", type=float, default=50.0)
    ap.add_argument("--epochs", type=int, default=2)
    args = ap.parse_args()
    import tensorflow as tf  # noqa: F401 - imported before the CPU is counted

    ru0 = resource.getrusage(resource.RUSAGE_SELF)  # after the imports: the reading's CPU only
    index = json.loads(Path(args.index).read_text())
    per_epoch = Order(tuple(x["samples"] for x in index["shards"]), 7, args.batch, 1).steps_per_epoch * args.batch
    stats = []
    if args.mode == "stream":
        s = Stream(index, seed=7, rank=0, world=1, batch_size=args.batch, root=Path(args.local_dir),
                   fetch=store_fetch(args.url, args.creds, lambda m: print(m, file=sys.stderr)),
                   capacity=args.cache_bytes, on_epoch=lambda e, st, peak, wall: stats.append({**st.__dict__, "peak": peak}))
        s.fetchers = args.fetchers or s.fetchers
        it = iter(s.dataset(EXTS))
    else:
        # the staged shards through the very pipeline Stream.dataset builds
        it = iter(sample_batches(lambda: local_samples(index, Path(args.local_dir), 7, args.batch), EXTS,
                                 args.batch))
    steps = args.epochs * per_epoch // args.batch
    wait = 0.0
    nbytes = 0
    t0 = time.monotonic()
    first = next(it)  # the pipeline's start: the first shard's GET (stream) or open (local), tf.data's first fill
    start = time.monotonic() - t0
    for step in range(steps):
        t = time.monotonic()
        batch = next(it) if step else first
        wait += time.monotonic() - t
        nbytes += sum(len(v) for e in EXTS for v in batch[e].numpy())
        time.sleep(args.step_ms / 1000)  # the modelled accelerator step (module docstring)
    wall = time.monotonic() - t0
    ru = resource.getrusage(resource.RUSAGE_SELF)
    print(json.dumps({"mode": args.mode, "steps": steps, "samples": steps * args.batch, "wall_s": wall,
                      "samples_per_s": steps * args.batch / wall, "start_s": start,
                      "input_wait": wait / (wall - start),  # of the steps' time, the start apart
                      "cpu_s": ru.ru_utime + ru.ru_stime - ru0.ru_utime - ru0.ru_stime, "bytes": nbytes, "epochs": stats}), flush=True)
    import os

    os._exit(0)  # the stream's fetcher may be in a GET of the next epoch: no need to wait for it


if __name__ == "__main__":
    main()
