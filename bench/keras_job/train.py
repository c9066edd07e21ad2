"""One job of `make bench-keras` (bench/keras_bench.py): the same Keras-2-style script, run on tf_keras
(TF_USE_LEGACY_KERAS=1: the ranks' shim makes `keras` mean tf_keras) or on Keras 3, 2 ranks through Horovod.

A small CNN on 8x8 digits-like inputs, Horovod's DistributedOptimizer, the broadcast callback; ``--warmup`` epochs
not timed (tracing, the first allreduces), then ``--epochs`` timed around ``model.fit``: by the wall clock, and by
the CPU seconds of every rank (summed: less sensitive to what else runs on the machine). Rank 0 prints
``APPLIANCE_RESULT {"keras": ..., "samples_per_s": ..., "samples_per_cpu_s": ...}``."""

import argparse
import json
import time

import keras
import numpy as np
import tensorflow as tf
import horovod.tensorflow as hvd_tf
import horovod.tensorflow.keras as hvd


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--epochs", type=int, default=3)
    ap.add_argument("--warmup", type=int, default=1)
    ap.add_argument("--steps", type=int, default=60)
    ap.add_argument("--batch-size", type=int, default=64)
    args = ap.parse_args()
    hvd.init()
    tf.config.threading.set_intra_op_parallelism_threads(1)
    tf.config.threading.set_inter_op_parallelism_threads(1)
    rng = np.random.default_rng(hvd.rank())
    n = args.steps * args.batch_size
    x = rng.random((n, 8, 8, 1), dtype=np.float32)
    y = rng.integers(0, 10, n)
    data = tf.data.Dataset.from_tensor_slices((x, y)).batch(args.batch_size).cache().repeat()
    model = keras.Sequential([
        keras.layers.Input(shape=(8, 8, 1)),
        keras.layers.Conv2D(32, 3, activation="relu"),
        keras.layers.Conv2D(64, 3, activation="relu"),
        keras.layers.Flatten(),
        keras.layers.Dense(128, activation="relu"),
        keras.layers.Dropout(0.25),
        keras.layers.Dense(10, activation="softmax"),
    ])
    opt = hvd.DistributedOptimizer(keras.optimizers.Adam(0.001 * hvd.size()))
    model.compile(loss="sparse_categorical_crossentropy", optimizer=opt)
    cbs = [hvd.callbacks.BroadcastGlobalVariablesCallback(0)]
    model.fit(data, steps_per_epoch=args.steps, epochs=args.warmup, callbacks=cbs, verbose=0)
    t0, c0 = time.perf_counter(), time.process_time()
    model.fit(data, steps_per_epoch=args.steps, epochs=args.epochs, verbose=0)
    seconds, cpu = time.perf_counter() - t0, time.process_time() - c0
    cpu = float(hvd_tf.allreduce(tf.constant(cpu, tf.float64), op=hvd_tf.Sum, name="bench.cpu").numpy())
    samples = args.epochs * args.steps * args.batch_size * hvd.size()
    if hvd.rank() == 0:
        print("APPLIANCE_RESULT " + json.dumps({"keras": keras.__version__, "seconds": round(seconds, 3),
                                                "cpu_seconds": round(cpu, 3), "samples_per_s": round(samples / seconds, 1),
                                                "samples_per_cpu_s": round(samples / cpu, 1)}), flush=True)


if __name__ == "__main__":
    main()
