"""A stream's parallel map against a sequential one (appliance/node/stream_data.py): JPEG decode + resize, the map
most image training runs, in one process on this machine's cores.

    .venv/bin/python bench/stream_map_bench.py [--images 1024] [--batch 64] [--epochs 2]

N JPEGs of 500x375 (an average ImageNet photo's size; a gradient plus noise, quality 90) are packed into tar shards
in a file:// store (`appliance data pack`'s ``pack``) and read through appliance/node/stream.py's ``Stream`` (1
rank, the store's GET over file://, a cache that holds the dataset) as ``stream.elements(["jpg", "cls"],
map_fn=decode_resize, num_parallel_calls=P).batch(B)``, P = None (one at a time), 2 and AUTOTUNE, each for
``--epochs`` epochs. Every variant must yield the same keys in the same order (the order-keeping map), or the
bench fails. Printed: one JSON line a variant, images/s from the first batch on (the start, the first shard's
fetch and tf.data's first fill, apart) and the process's CPU seconds per image (TensorFlow's threads included)."""

from __future__ import annotations

import argparse
import json
import os
import resource
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from appliance.node.stream import Stream, store_fetch  # noqa: E402
from stream_cache_bench import packed_store  # noqa: E402 - bench/, beside this script


def make_jpegs(d: Path, n: int) -> None:
    import numpy as np
    import tensorflow as tf

    rng = np.random.default_rng(7)
    ramp = np.linspace(0, 200, 500, dtype=np.float32)[None, :, None]
    for i in range(n):
        img = np.clip(ramp + rng.normal(0, 20, (375, 500, 3)), 0, 255).astype(np.uint8)
        (d / f"{i:06d}.jpg").write_bytes(tf.io.encode_jpeg(img, quality=90).numpy())
        (d / f"{i:06d}.cls").write_text(str(i % 10))


def decode_resize(e):
    import tensorflow as tf

    img = tf.image.resize(tf.io.decode_jpeg(e["jpg"], channels=3), (224, 224))
    return e["__key__"], tf.cast(img, tf.uint8), tf.strings.to_number(e["cls"], tf.int64)


def read(index: dict, url: str, cache: Path, parallel, batch: int, epochs: int) -> tuple[dict, list[bytes]]:
    s = Stream(index, seed=7, rank=0, world=1, batch_size=batch, root=cache, fetch=store_fetch(url, None, print),
               capacity=2 * sum(x["size"] for x in index["shards"]))
    it = iter(s.elements(["jpg", "cls"], map_fn=decode_resize, num_parallel_calls=parallel).batch(batch))
    keys = list(next(it)[0].numpy())  # the start: the first shard's GET, tf.data's first fill
    ru0, t0 = resource.getrusage(resource.RUSAGE_SELF), time.monotonic()
    for _ in range(epochs * s.steps_per_epoch - 1):
        keys += list(next(it)[0].numpy())
    wall, ru = time.monotonic() - t0, resource.getrusage(resource.RUSAGE_SELF)
    n = (epochs * s.steps_per_epoch - 1) * batch
    cpu = ru.ru_utime + ru.ru_stime - ru0.ru_utime - ru0.ru_stime
    return {"num_parallel_calls": "AUTOTUNE" if parallel == -1 else parallel, "images": n,
            "images_per_s": round(n / wall, 1), "cpu_ms_per_image": round(1000 * cpu / n, 2),
            "cores": os.cpu_count()}, keys


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--images", type=int, default=1024)
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--epochs", type=int, default=2)
    args = ap.parse_args()
    with tempfile.TemporaryDirectory(prefix="appliance-mapbench-") as tmp:
        index, url = packed_store(Path(tmp), lambda src: make_jpegs(src, args.images), 4 * 1024**2)
        orders = []
        for k, parallel in enumerate((None, 2, -1)):
            row, keys = read(index, url, Path(tmp) / f"cache{k}", parallel, args.batch, args.epochs)
            orders.append(keys)
            print(json.dumps(row), flush=True)
        if any(o != orders[0] for o in orders):
            sys.exit("the parallel map changed the order")
        print(json.dumps({"same_order": True, "shards": len(index["shards"])}), flush=True)
    os._exit(0)  # a stream's fetcher may be in a GET of the next epoch: no need to wait for it


if __name__ == "__main__":
    main()
