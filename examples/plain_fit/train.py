"""An ordinary Keras + Horovod training script: nothing of the appliance in it.

Written the way Horovod's Keras examples are (hvd.init, DistributedOptimizer, the broadcast and metric-averaging
callbacks, a learning-rate warm-up callback, rank 0's ModelCheckpoint and progress bar, ``model.fit``), on
scikit-learn's bundled 8x8 digits so that it runs offline (or the same images from ``digits.npz`` beside it, as
examples/digits/make_dataset.py writes them). With ``checkpoint.url`` in the spec, `appliance train`
protects it without a change (level 2, docs/checkpoints.md): the ranks' start-up shim adds the appliance's callback
to ``model.fit``, which stops every rank after the same step before the lease end, commits, and resumes mid-epoch.

``--data`` picks the input form (all three resume exactly):
  tfdata  a finite tf.data pipeline with a seeded shuffle, re-iterated each epoch (the default)
  repeat  ``.repeat().shuffle(seed).batch()`` with ``steps_per_epoch``, as Horovod's MNIST example
  numpy   NumPy arrays, Keras shuffling them each epoch

Rank 0 prints one line ``weights sha256 <hex> after <N> optimizer steps`` at the end.
"""

import argparse
import hashlib
import os

import numpy as np
import tensorflow as tf
import horovod.tensorflow.keras as hvd


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--epochs", type=int, default=6)
    ap.add_argument("--batch-size", type=int, default=32)
    ap.add_argument("--data", choices=("tfdata", "repeat", "numpy"), default="tfdata")
    ap.add_argument("--seed", type=int, default=7)
    args = ap.parse_args()

    hvd.init()
    tf.keras.utils.set_random_seed(args.seed)
    tf.config.experimental.enable_op_determinism()
    tf.config.threading.set_intra_op_parallelism_threads(1)
    tf.config.threading.set_inter_op_parallelism_threads(1)

    if os.path.exists("digits.npz"):
        with np.load("digits.npz") as z:
            images, labels = z["x"].reshape(-1, 8, 8, 1), z["y"]
    else:
        from sklearn.datasets import load_digits

        d = load_digits()
        images, labels = (d.images[..., np.newaxis] / 16.0).astype("float32"), d.target.astype("int64")
    x = images[hvd.rank()::hvd.size()]
    y = labels[hvd.rank()::hvd.size()]
    steps = len(x) // args.batch_size

    model = tf.keras.Sequential([
        tf.keras.layers.Input(shape=(8, 8, 1)),
        tf.keras.layers.Conv2D(16, 3, activation="relu"),
        tf.keras.layers.BatchNormalization(),
        tf.keras.layers.Dropout(0.25),
        tf.keras.layers.Flatten(),
        tf.keras.layers.Dense(64, activation="relu"),
        tf.keras.layers.Dropout(0.5),
        tf.keras.layers.Dense(10, activation="softmax"),
    ])
    lr = 0.001 * hvd.size()
    opt = hvd.DistributedOptimizer(tf.keras.optimizers.Adam(lr))
    model.compile(loss="sparse_categorical_crossentropy", optimizer=opt, metrics=["accuracy"])
    callbacks = [
        hvd.callbacks.BroadcastGlobalVariablesCallback(0),
        hvd.callbacks.MetricAverageCallback(),
        hvd.callbacks.LearningRateWarmupCallback(initial_lr=lr, warmup_epochs=2, verbose=0),
    ]
    if hvd.rank() == 0:
        callbacks.append(tf.keras.callbacks.ModelCheckpoint("./checkpoint-{epoch}.h5"))
    verbose = 1 if hvd.rank() == 0 else 0

    if args.data == "numpy":
        model.fit(x, y, batch_size=args.batch_size, epochs=args.epochs, callbacks=callbacks, verbose=verbose)
    else:
        ds = tf.data.Dataset.from_tensor_slices((x, y))
        if args.data == "repeat":
            ds = ds.repeat().shuffle(500, seed=args.seed).batch(args.batch_size)
            model.fit(ds, steps_per_epoch=steps, epochs=args.epochs, callbacks=callbacks, verbose=verbose)
        else:
            ds = ds.shuffle(500, seed=args.seed).batch(args.batch_size, drop_remainder=True)
            model.fit(ds, epochs=args.epochs, callbacks=callbacks, verbose=verbose)

    if hvd.rank() == 0:
        h = hashlib.sha256()
        for w in model.get_weights():
            h.update(np.ascontiguousarray(w).tobytes())
        print(f"weights sha256 {h.hexdigest()} after {int(opt.iterations.numpy())} optimizer steps", flush=True)


if __name__ == "__main__":
    main()
