"""Digits: a tf.keras model trained data-parallel with Horovod, offline.

The data is scikit-learn's bundled 8x8 digits (1,797 images, no network), or ``digits.npz`` from
the staged dataset directory when one is given (``--data`` or $APPLIANCE_DATA_DIR).

Horovod as its docs prescribe: DistributedOptimizer, broadcast of rank 0's initial state, the
learning rate scaled by the number of ranks with a warm-up, metric averaging, and data sharded
by rank: each epoch's permutation comes from (seed, epoch) and rank r takes perm[r::size], so a
run is reproducible for a given seed and world size.

Checkpoints (appliance.checkpoint.keras.Checkpointer): with ``checkpoint.url`` in the spec, rank 0
commits the full state every N steps / M minutes; before the lease ends every rank stops after the
same step, and `appliance resume digits` continues bit-exactly (the warm-up is a function of the
optimizer's step counter, which the checkpoint restores).

Run with ``appliance train examples/digits.yaml``; each rank prints one APPLIANCE_RESULT line.
"""

import argparse
import hashlib
import json
import os
import socket
import time

import numpy as np
import tensorflow as tf
import horovod.tensorflow as hvd_tf
import horovod.tensorflow.keras as hvd

from appliance.checkpoint.keras import Checkpointer


def load_data(data_dir, seed):
    path = os.path.join(data_dir, "digits.npz") if data_dir else ""
    if path and os.path.exists(path):
        with np.load(path) as z:
            x, y, source = z["x"].astype("float32"), z["y"].astype("int64"), path
    else:
        from sklearn.datasets import load_digits

        d = load_digits()
        x, y, source = (d.data / 16.0).astype("float32"), d.target.astype("int64"), "sklearn load_digits"
    order = np.random.RandomState(seed).permutation(len(x))
    n_val = len(x) // 5
    val, tr = order[:n_val], order[n_val:]
    return (x[tr], y[tr]), (x[val], y[val]), source


def build_model(seed):
    init = tf.keras.initializers.GlorotUniform(seed=seed)
    return tf.keras.Sequential([
        tf.keras.layers.Input(shape=(64,)),
        tf.keras.layers.Dense(128, activation="relu", kernel_initializer=init),
        tf.keras.layers.Dense(64, activation="relu", kernel_initializer=init),
        tf.keras.layers.Dense(10, activation="softmax", kernel_initializer=init),
    ])


def weights_digest(model):
    h = hashlib.sha256()
    for w in model.get_weights():
        h.update(np.ascontiguousarray(w).tobytes())
    return h.hexdigest()


@tf.keras.utils.register_keras_serializable(package="digits")
class Warmup(tf.keras.optimizers.schedules.LearningRateSchedule):
    """Linear warm-up to ``lr`` over ``steps`` optimizer steps, then constant. A function of the optimizer's
    step counter, which checkpoints restore, so a resumed run gets exactly the same learning rates."""

    def __init__(self, lr, steps):
        self.lr, self.steps = float(lr), max(1, int(steps))

    def __call__(self, step):
        frac = tf.minimum(1.0, (tf.cast(step, tf.float32) + 1.0) / self.steps)
        return self.lr / hvd.size() + (self.lr - self.lr / hvd.size()) * frac

    def get_config(self):
        return {"lr": self.lr, "steps": self.steps}


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--epochs", type=int, default=30)
    ap.add_argument("--batch-size", type=int, default=32, help="per rank")
    ap.add_argument("--lr", type=float, default=0.002, help="base learning rate, scaled by the number of ranks")
    ap.add_argument("--warmup-epochs", type=int, default=2)
    ap.add_argument("--seed", type=int, default=1234)
    ap.add_argument("--data", default=os.environ.get("APPLIANCE_DATA_DIR", ""))
    ap.add_argument("--save-weights", default="", help="rank 0 writes the final weights here (.npz)")
    args = ap.parse_args()

    hvd.init()
    rank, size = hvd.rank(), hvd.size()
    tf.keras.utils.set_random_seed(args.seed)
    tf.config.experimental.enable_op_determinism()
    tf.config.threading.set_intra_op_parallelism_threads(1)
    tf.config.threading.set_inter_op_parallelism_threads(1)

    # checkpoints, restore, and the collective stop before the lease end (settings from the spec)
    ckpt = Checkpointer(seed=args.seed, batch_size=args.batch_size)
    bs = ckpt.batch_size  # differs from --batch-size only after a resize with checkpoint.resize: batch

    (x_tr, y_tr), (x_val, y_val), source = load_data(args.data, args.seed)
    per_rank = len(x_tr) // size
    steps = per_rank // bs
    if rank == 0:
        print(f"digits: {len(x_tr)} train / {len(x_val)} val images from {source}; "
              f"{size} rank(s) x {bs} per step, {steps} steps per epoch", flush=True)

    model = build_model(args.seed)
    lr = args.lr * ckpt.lr_scale  # the number of ranks (Horovod's rule), kept across a resize if the spec says
    opt = hvd.DistributedOptimizer(tf.keras.optimizers.Adam(learning_rate=Warmup(lr, args.warmup_epochs * steps)))
    model.compile(optimizer=opt, loss="sparse_categorical_crossentropy", metrics=["accuracy"])
    # every rank starts from rank 0's weights: broadcast once here, not in a callback at the end of the first batch,
    # where Keras times it against a batch of this small model and warns that the callbacks are slow
    hvd_tf.broadcast_variables(model.variables, root_rank=0)
    callbacks = [
        hvd.callbacks.MetricAverageCallback(),
        ckpt.callback,
    ]

    # tf.data datasets, not NumPy arrays, into the per-epoch fit: for arrays Keras builds and traces an input
    # pipeline of its own at every fit call, which cost this small model a quarter of its CPU (docs/resume.md)
    val = tf.data.Dataset.from_tensor_slices((x_val, y_val)).batch(bs)
    t0 = time.time()
    for epoch, first in ckpt.epochs(model, args.epochs, steps):
        perm = np.random.RandomState(args.seed + epoch).permutation(len(x_tr))
        mine = perm[rank::size][: steps * bs][first * bs:]  # this rank's share, minus what is already done
        hist = model.fit(tf.data.Dataset.from_tensor_slices((x_tr[mine], y_tr[mine])).batch(bs),
                         epochs=epoch + 1, initial_epoch=epoch, verbose=0, callbacks=callbacks,
                         validation_data=val)
        if rank == 0 and not ckpt.stopped:
            h = {k: v[-1] for k, v in hist.history.items()}
            print(f"epoch {epoch + 1}/{args.epochs} loss={h['loss']:.4f} acc={h['accuracy']:.4f} "
                  f"val_acc={h['val_accuracy']:.4f}", flush=True)
    ckpt.close()

    val_loss, val_acc = model.evaluate(x_val, y_val, verbose=0)
    digest = weights_digest(model)
    if rank == 0 and args.save_weights:
        np.savez(args.save_weights, *model.get_weights())
    result = {"rank": rank, "size": size, "hostname": socket.gethostname(), "epochs": args.epochs,
              "steps": ckpt.step, "val_accuracy": round(float(val_acc), 4), "val_loss": round(float(val_loss), 4),
              "weights_sha256": digest, "train_seconds": round(time.time() - t0, 2)}
    print("APPLIANCE_RESULT " + json.dumps(result), flush=True)


if __name__ == "__main__":
    main()
