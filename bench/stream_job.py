"""The ranks of one reader of bench/stream_bench.py, run inside a testbed node's network namespace: ``--ranks``
processes (as a Horovod job on the node: each the stream's rank r of size w, its share of every step) read a
packed dataset for some epochs at a training's pace; one JSON line with what each rank measured is printed.

  --mode stream   appliance/node/stream.py's Stream: shards fetched from the store through a bounded cache
  --mode local    the same tar shards, staged on the node's disk, read in the stream's order (what staging gives)
  --mode tfdata   plain tf.data over the same samples packed as TFRecord on the node's disk (TFRecordDataset,
                  parallel reads, the rank's files: every w-th), no appliance code

``--map none`` (synthetic samples: .bin + .cls) batches the raw bytes; ``--map jpeg`` (.jpg + .cls) decodes and
augments every sample in a parallel map (``augment``: decode_jpeg, a random crop and flip seeded by the sample's
key, resize to 224x224; ``num_parallel_calls`` AUTOTUNE, the order kept), the same map in every mode. stream and
local go through the pipeline a script gets (``Stream.elements`` / ``sample_elements``, then ``batch`` and
``prefetch``). The training's pace is a modelled accelerator step: after every batch each rank waits at a barrier
for the others (Horovod's allreduce: a step starts when every rank has its batch), then sleeps ``--step-ms`` (a
GPU step leaves the CPU free). The start (until every rank has its first batch: the first shards' GETs, tf.data's
first fill) is reported apart, as it is paid once a job. What is measured is the steps after the first quarter
(tf.data's buffers, filled while a rank waited for the others' start, drained by then when input is short):
samples/s; input wait, a rank's time from asking for its batch to the step's start (its own wait and the
others'), as a share of that time; CPU, each rank process's own (user + system, tf.data's and the fetchers'
threads included) per sample."""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import multiprocessing.connection
import os
import resource
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from appliance.node.stream import Stream, _Shard, store_fetch  # noqa: E402
from appliance.node.stream_data import AUTOTUNE, sample_elements  # noqa: E402
from appliance.node.stream_order import WINDOW, Order, reads  # noqa: E402

SIZE = 224  # the map's output: what an ImageNet model takes


def augment(e: dict):
    """decode_jpeg, a random square crop of 4/5 of the shorter side, a random flip and a resize to SIZE, drawn
    from stateless ops seeded by the sample's key (a resume repeats them): (image float32, class)."""
    import tensorflow as tf

    seed = tf.stack([tf.strings.to_hash_bucket_fast(e["__key__"], 1 << 30), tf.constant(7, tf.int64)])
    img = tf.io.decode_jpeg(e["jpg"], channels=3)
    side = tf.minimum(tf.shape(img)[0], tf.shape(img)[1]) * 4 // 5
    img = tf.image.stateless_random_crop(img, tf.stack([side, side, 3]), seed)
    img = tf.image.stateless_random_flip_left_right(img, seed)
    return tf.image.resize(img, (SIZE, SIZE)), tf.strings.to_number(e["cls"], tf.int64)


def local_samples(index: dict, root: Path, order: Order, rank: int, world: int):
    """The stream's order (rank ``rank`` of ``world``) read from the staged shards."""
    held: dict[int, _Shard] = {}
    for n, j, k, first, last in reads(order, rank, world, 0):
        if first:
            held[n] = _Shard(root / index["shards"][j]["name"])
        yield held[n].sample(k)
        if last:
            held.pop(n).close()


def tfrecord_elements(root: Path, exts: list[str], rank: int, world: int):
    """Plain tf.data over the TFRecord shards under ``root`` (`appliance data pack --format tfrecord`: a
    tf.train.Example a sample, ``__key__`` and a bytes feature per extension): the rank's files, endlessly."""
    import tensorflow as tf

    files = sorted(str(p) for p in root.rglob("*.tfrecord"))[rank::world]
    spec = {k: tf.io.FixedLenFeature([], tf.string) for k in ["__key__", *exts]}
    return (tf.data.TFRecordDataset(files, num_parallel_reads=AUTOTUNE).repeat()
            .map(lambda x: tf.io.parse_single_example(x, spec), num_parallel_calls=AUTOTUNE))


def pipeline(args, rank: int, order: Order, stats: list):
    """The rank's batches: its elements (by mode), the map, batched by the rank's batch, prefetched."""
    index = json.loads(Path(args.index).read_text())
    exts = ["jpg", "cls"] if args.map == "jpeg" else ["bin", "cls"]
    if args.mode == "stream":
        s = Stream(index, seed=7, rank=rank, world=args.ranks, batch_size=args.batch,
                   root=Path(args.local_dir) / f"rank-{rank}", capacity=args.cache_bytes, window=args.window,
                   fetch=store_fetch(args.url, args.creds, lambda m: print(m, file=sys.stderr), rank=rank),
                   on_epoch=lambda e, st, peak, wall: stats.append({**st.__dict__, "peak": peak}))
        s.fetchers = args.fetchers or s.fetchers
        ds = s.elements(exts)  # the map below, as a script adds it (order kept: deterministic by default)
    elif args.mode == "local":
        ds = sample_elements(lambda: local_samples(index, Path(args.local_dir), order, rank, args.ranks), exts)
    else:
        ds = tfrecord_elements(Path(args.local_dir), exts, rank, args.ranks)
    if args.map == "jpeg":
        ds = ds.map(augment, num_parallel_calls=AUTOTUNE)
    return ds.batch(args.batch, drop_remainder=True).prefetch(AUTOTUNE)


def rank_main(args, rank: int, barrier, results) -> None:
    import tensorflow  # noqa: F401 - imported before the pipeline is built

    counts = tuple(x["samples"] for x in json.loads(Path(args.index).read_text())["shards"])
    order = Order(counts, 7, args.batch * args.ranks, args.ranks, args.window)
    stats: list = []
    it = iter(pipeline(args, rank, order, stats))
    steps = args.epochs * order.steps_per_epoch
    barrier.wait()  # every rank's pipeline built: the job starts
    t0 = time.monotonic()
    first = next(it)  # the pipeline's start: the first shards' GETs (stream) or opens, tf.data's first fill
    barrier.wait()  # every rank has its first batch: the job's start is over
    start = time.monotonic() - t0
    warm = steps // 4  # steps not measured: tf.data's buffers, filled while a rank waited for the others' start
    wait = slept = 0.0
    nbytes = 0
    for step in range(steps):
        if step == warm:
            ts, ru0, wait = time.monotonic(), resource.getrusage(resource.RUSAGE_SELF), 0.0
        t = time.monotonic()
        batch = next(it) if step else first
        barrier.wait()  # the step's allreduce: every rank has its batch
        t1 = time.monotonic()
        wait += t1 - t
        if args.map == "none" and step >= warm:
            nbytes += sum(len(v) for v in batch["bin"].numpy())
        time.sleep(args.step_ms / 1000)  # the modelled accelerator step (module docstring)
        slept += time.monotonic() - t1
    end = time.monotonic()
    wall = end - ts  # the measured steps' time
    ru = resource.getrusage(resource.RUSAGE_SELF)
    n = (steps - warm) * args.batch
    results.put({"rank": rank, "steps": steps, "read": steps * args.batch, "samples": n, "wall_s": wall,
                 "start_s": start, "total_s": end - t0, "samples_per_s": n / wall, "input_wait": wait / wall,
                 "slept_s": slept, "cpu_s": ru.ru_utime + ru.ru_stime - ru0.ru_utime - ru0.ru_stime, "bytes": nbytes,
                 "epochs": stats})
    results.close()
    results.join_thread()
    os._exit(0)  # the stream's fetcher may be in a GET of the next epoch: no need to wait for it


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--mode", choices=("stream", "local", "tfdata"), required=True)
    ap.add_argument("--index", required=True, help="the tar shards' index.json (a local copy)")
    ap.add_argument("--url", help="stream: the packed dataset's URL")
    ap.add_argument("--creds", help="stream: a StoreCreds JSON file")
    ap.add_argument("--local-dir", help="local, tfdata: the directory of the shards; stream: the caches'")
    ap.add_argument("--cache-bytes", type=int, default=0, help="stream: each rank's cache")
    ap.add_argument("--fetchers", type=int, default=0, help="stream: GETs at once (default: the stream's)")
    ap.add_argument("--window", type=int, default=WINDOW, help="dataset.shuffle: shards mixed at once")
    ap.add_argument("--map", choices=("none", "jpeg"), default="none")
    ap.add_argument("--ranks", type=int, default=1)
    ap.add_argument("--batch", type=int, default=32, help="per rank")
    ap.add_argument("--step-ms", type=float, default=50.0)
    ap.add_argument("--epochs", type=int, default=2)
    args = ap.parse_args()
    ctx = mp.get_context("spawn")  # TensorFlow in each rank, imported there
    barrier, results = ctx.Barrier(args.ranks), ctx.Queue()
    procs = [ctx.Process(target=rank_main, args=(args, r, barrier, results)) for r in range(args.ranks)]
    for p in procs:
        p.start()
    rows, left = [], {p.sentinel: p for p in procs}
    while left:
        for s in mp.connection.wait(list(left)):
            p = left.pop(s)
            p.join()
            if p.exitcode != 0:
                barrier.abort()  # the others stop at their next step
                for p in left.values():
                    p.join()
                sys.exit(f"stream_job: a rank of --mode {args.mode} failed (its error is above)")
    rows = sorted((results.get() for _ in procs), key=lambda r: r["rank"])
    wall = max(r["wall_s"] for r in rows)
    print(json.dumps({"mode": args.mode, "ranks": rows, "samples": sum(r["samples"] for r in rows),
                      "read": sum(r["read"] for r in rows),
                      "samples_per_s": sum(r["samples"] for r in rows) / wall, "wall_s": wall,
                      "total_s": max(r["total_s"] for r in rows),
                      "start_s": max(r["start_s"] for r in rows), "input_wait": max(r["input_wait"] for r in rows),
                      "cpu_s": sum(r["cpu_s"] for r in rows), "bytes": sum(r["bytes"] for r in rows)}), flush=True)


if __name__ == "__main__":
    main()
