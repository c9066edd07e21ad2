"""What a stream's cache saves the store (appliance/node/stream_reuse.py): the bytes each epoch fetches, as a share of
the dataset, for caches of several sizes on 1, 2 and 4 ranks, in one process without TensorFlow.

    .venv/bin/python bench/stream_cache_bench.py [--shards 64] [--epochs 6] [--shuffle 4]

A dataset of ``--shards`` tar shards of 4 samples (`appliance data pack`'s ``pack`` into a file:// store) is read
by every rank's ``Stream`` (appliance/node/stream.py, the store's GET over file://, the default fetchers and look
ahead) for ``--epochs`` epochs, each rank through a cache of a share of the dataset. Printed: one JSON line a
setting, with the bytes all ranks fetched in each epoch over the dataset's bytes (from the epochs' reports, which
the bench checks against the store's GETs)."""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from appliance.data.pack import pack  # noqa: E402
from appliance.node.stream import Stream, store_fetch  # noqa: E402
from appliance.store.objects import FileStore  # noqa: E402


def rank_epochs(index: dict, url: str, root: Path, *, rank: int, world: int, capacity: int, epochs: int,
                shuffle: int) -> tuple[list[int], int]:
    """One rank's bytes from the store in each epoch (its reports), and what its GETs fetched in all."""
    said: list[int] = []
    got = [0]
    sizes = {x["name"]: x["size"] for x in index["shards"]}
    inner = store_fetch(url, None, print)

    def fetch(name, dest):
        got[0] += sizes[name]
        return inner(name, dest)
    s = Stream(index, seed=7, rank=rank, world=world, batch_size=2, root=root, fetch=fetch, capacity=capacity,
               window=shuffle, on_epoch=lambda e, st, peak, wall: said.append(st.store_bytes))
    it = s.samples()
    for _ in range(epochs * s.per_epoch):
        next(it)
    it.close()
    return said, got[0]


def packed_store(tmp: Path, make, shard_size: int) -> tuple[dict, str]:
    """The files ``make(dir)`` writes, packed into a file:// store under ``tmp``: its index and URL."""
    src, store = tmp / "files", tmp / "store"
    src.mkdir()
    store.mkdir()
    make(src)
    return pack(src, FileStore(str(store)), "set", shard_size=shard_size), f"file://{store}/set/"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--shards", type=int, default=64)
    ap.add_argument("--epochs", type=int, default=6)
    ap.add_argument("--shuffle", type=int, default=4)
    args = ap.parse_args()
    def make(src: Path) -> None:
        for i in range(4 * args.shards):
            (src / f"{i:06d}.bin").write_bytes(os.urandom(4000))

    with tempfile.TemporaryDirectory(prefix="appliance-cachebench-") as tmp:
        index, url = packed_store(Path(tmp), make, 16000)
        total = sum(x["size"] for x in index["shards"])
        for world in (1, 2, 4):
            for share in (2.0, 1.0, 0.5, 0.25):
                per, gets = [0] * args.epochs, 0
                for r in range(world):
                    said, got = rank_epochs(index, url, Path(tmp) / f"c{world}-{share}-{r}",
                                            rank=r, world=world, capacity=int(share * total), epochs=args.epochs,
                                            shuffle=args.shuffle)
                    per = [a + b for a, b in zip(per, said)]
                    gets += got
                assert sum(per) <= gets <= sum(per) + world * share * total  # the rest: fetched ahead
                print(json.dumps({"ranks": world, "cache_per_rank": share, "shards": len(index["shards"]),
                                  "shuffle": args.shuffle,
                                  "store_per_epoch": [round(b / total, 2) for b in per]}), flush=True)


if __name__ == "__main__":
    main()
