"""A Keras + Horovod script that trains on a packed dataset streamed from the object store (``dataset.mode:
stream``): the shards are fetched while it trains, through a bounded cache on each node's disk, so the dataset
need not fit there.

    python make_dataset.py digits-files/          # one sample = 0001.x (8x8 float32) + 0001.y (its label)
    appliance data pack digits-files/ swift://digits-packed/v1/ --shard-size 65536
    appliance train stream.yaml                   # dataset: {source: swift://digits-packed/v1/, mode: stream}

The appliance's part is two lines: ``open_stream`` (this rank's share of every epoch, in an order fixed by the
seed) and ``model.fit(..., steps_per_epoch=stream.steps_per_epoch)``; ``stream.elements`` is a tf.data dataset of
its samples for the script's own pipeline (here: decoded in parallel, the order kept, then batched). A resume continues at the exact next sample:
nothing is fetched twice. Rank 0 prints ``weights sha256 <hex> after <N> optimizer steps`` at the end.
"""

import argparse
import hashlib

import numpy as np
import tensorflow as tf
import horovod.tensorflow.keras as hvd

from appliance.node.stream import open_stream


def decode(sample):
    x = tf.reshape(tf.io.decode_raw(sample["x"], tf.float32), (8, 8, 1))
    y = tf.strings.to_number(sample["y"], tf.int64)
    return x, y


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--epochs", type=int, default=3)
    ap.add_argument("--batch-size", type=int, default=32)
    ap.add_argument("--seed", type=int, default=7)
    args = ap.parse_args()

    hvd.init()
    tf.keras.utils.set_random_seed(args.seed)
    tf.config.experimental.enable_op_determinism()
    tf.config.threading.set_intra_op_parallelism_threads(1)
    tf.config.threading.set_inter_op_parallelism_threads(1)

    stream = open_stream(args.batch_size, seed=args.seed)
    # one element a sample, decoded on several cores in the stream's order; batches of the stream's batch size
    # (stream.dataset(["x", "y"], map_fn=decode) gives the same batches in one call)
    data = (stream.elements(["x", "y"], map_fn=decode, num_parallel_calls=tf.data.AUTOTUNE)
            .batch(stream.batch_size, drop_remainder=True).prefetch(tf.data.AUTOTUNE))

    model = tf.keras.Sequential([
        tf.keras.layers.Input(shape=(8, 8, 1)),
        tf.keras.layers.Conv2D(16, 3, activation="relu"),
        tf.keras.layers.Dropout(0.25),
        tf.keras.layers.Flatten(),
        tf.keras.layers.Dense(64, activation="relu"),
        tf.keras.layers.Dense(10, activation="softmax"),
    ])
    opt = hvd.DistributedOptimizer(tf.keras.optimizers.Adam(0.001 * hvd.size()))
    model.compile(loss="sparse_categorical_crossentropy", optimizer=opt, metrics=["accuracy"])
    callbacks = [hvd.callbacks.BroadcastGlobalVariablesCallback(0), hvd.callbacks.MetricAverageCallback()]
    model.fit(data, steps_per_epoch=stream.steps_per_epoch, epochs=args.epochs, callbacks=callbacks,
              verbose=1 if hvd.rank() == 0 else 0)

    if hvd.rank() == 0:
        h = hashlib.sha256()
        for w in model.get_weights():
            h.update(np.ascontiguousarray(w).tobytes())
        print(f"weights sha256 {h.hexdigest()} after {int(opt.iterations.numpy())} optimizer steps", flush=True)


if __name__ == "__main__":
    main()
