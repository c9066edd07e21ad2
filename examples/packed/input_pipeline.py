"""A tf.data input pipeline over shards staged by `appliance stage` (made by `appliance data pack`).

    python input_pipeline.py $APPLIANCE_DATA_DIR      # prints how many samples each rank reads

Shards are split between Horovod ranks by index (rank r reads shards r, r+size, ...), so with
`dataset.mode: shard` each node stages exactly the shards its ranks read. Both layouts:
- tar (WebDataset): each sample is the members sharing a key (`0001.jpg`, `0001.cls`);
- tfrecord: one tf.train.Example per sample, `__key__` plus one bytes feature per extension.
"""

import json
import os
import sys

import tensorflow as tf

from appliance.node.stream import tar_samples  # (key, {ext: bytes}) of one WebDataset tar shard


def read_index(data_dir):
    with open(os.path.join(data_dir, "index.json")) as fh:
        return json.load(fh)


def dataset(data_dir, exts, rank=0, size=1):
    """A tf.data.Dataset of dicts {"__key__": key, ext: bytes, ...} for this rank's shards."""
    index = read_index(data_dir)
    mine = [os.path.join(data_dir, s["name"]) for s in index["shards"][rank::size]]
    if index["format"] == "tfrecord":
        spec = {"__key__": tf.io.FixedLenFeature([], tf.string)}
        spec.update({e: tf.io.FixedLenFeature([], tf.string) for e in exts})
        return tf.data.TFRecordDataset(mine).map(lambda r: tf.io.parse_single_example(r, spec))

    def gen():
        for path in mine:
            for key, parts in tar_samples(path):
                yield {"__key__": key, **{e: parts[e] for e in exts}}

    sig = {"__key__": tf.TensorSpec([], tf.string), **{e: tf.TensorSpec([], tf.string) for e in exts}}
    return tf.data.Dataset.from_generator(gen, output_signature=sig)


if __name__ == "__main__":
    data_dir = sys.argv[1] if len(sys.argv) > 1 else os.environ.get("APPLIANCE_DATA_DIR", ".")
    exts = sys.argv[2].split(",") if len(sys.argv) > 2 else ["bin"]
    rank, size = int(os.environ.get("HOROVOD_RANK", 0)), int(os.environ.get("HOROVOD_SIZE", 1))
    n = sum(1 for _ in dataset(data_dir, exts, rank, size))
    print(f"rank {rank}/{size}: {n} samples")
