"""Horovod's Keras MNIST example (horovod/horovod examples/tensorflow2/tensorflow2_keras_mnist.py), written in
Keras 3: ``import keras``, a loss in ``keras.ops``, a layer drawing from ``keras.random.SeedGenerator``, AdamW, rank
0's ``ModelCheckpoint("best.keras")``; scikit-learn's bundled 8x8 digits instead of the MNIST download, so that it
runs offline (or the same images from ``digits.npz`` beside it, as examples/digits/make_dataset.py writes them).

Nothing of the appliance is in it. `appliance check` reads its Keras 3 API and runs it on Keras 3 (train.keras:
auto); Horovod's names (DistributedOptimizer, the broadcast, metric-average and warm-up callbacks) work on it as
on tf_keras; with ``checkpoint.url`` in the spec it is protected as any Keras script (docs/train.md).

Every rank prints ``weights sha256 <hex> after <N> optimizer steps (rank R)`` at the end.
"""

import argparse
import hashlib
import os

import keras
import numpy as np
import tensorflow as tf
import horovod.tensorflow.keras as hvd

from model import build, smoothed_crossentropy


def digits():
    if os.path.exists("digits.npz"):
        with np.load("digits.npz") as z:
            return z["x"].reshape(-1, 8, 8, 1).astype("float32"), z["y"].astype("int64")
    from sklearn.datasets import load_digits

    d = load_digits()
    return (d.images[..., np.newaxis] / 16.0).astype("float32"), d.target.astype("int64")


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--epochs", type=int, default=8)
    ap.add_argument("--batch-size", type=int, default=32)
    ap.add_argument("--seed", type=int, default=7)
    args = ap.parse_args()

    hvd.init()
    keras.utils.set_random_seed(args.seed + hvd.rank())  # each rank its own streams; the broadcast aligns weights
    tf.config.experimental.enable_op_determinism()
    tf.config.threading.set_intra_op_parallelism_threads(1)
    tf.config.threading.set_inter_op_parallelism_threads(1)

    images, labels = digits()
    x, y = images[hvd.rank()::hvd.size()], labels[hvd.rank()::hvd.size()]
    steps = len(x) // args.batch_size
    data = tf.data.Dataset.from_tensor_slices((x, y)).repeat().shuffle(500, seed=args.seed).batch(args.batch_size)

    model = build(seed=1000 + hvd.rank())
    lr = 0.001 * hvd.size()  # the learning rate scaled to the ranks, warmed up below
    opt = hvd.DistributedOptimizer(keras.optimizers.AdamW(lr, weight_decay=1e-4))
    model.compile(loss=smoothed_crossentropy, optimizer=opt, metrics=["accuracy"])

    callbacks = [
        hvd.callbacks.BroadcastGlobalVariablesCallback(0),
        hvd.callbacks.MetricAverageCallback(),
        hvd.callbacks.LearningRateWarmupCallback(initial_lr=lr, warmup_epochs=2, verbose=1),
    ]
    if hvd.rank() == 0:  # one writer
        callbacks.append(keras.callbacks.ModelCheckpoint("best.keras", monitor="loss", save_best_only=True))
    model.fit(data, steps_per_epoch=steps, epochs=args.epochs, callbacks=callbacks,
              verbose=1 if hvd.rank() == 0 else 0)

    h = hashlib.sha256()
    for w in model.get_weights():
        h.update(np.ascontiguousarray(w).tobytes())
    print(f"weights sha256 {h.hexdigest()} after {int(opt.iterations.numpy())} optimizer steps (rank {hvd.rank()})",
          flush=True)


if __name__ == "__main__":
    main()
