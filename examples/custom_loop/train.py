"""A custom Horovod training loop (``hvd.DistributedGradientTape``, no ``model.fit``): nothing of the appliance in it.

It keeps its own checkpoints the way Horovod's examples do: rank 0 writes ``./checkpoint-{epoch}.h5`` after every
epoch, and at start every rank looks for the newest such file, rank 0's answer is broadcast, and rank 0 loads it
(horovod/examples/keras/keras_imagenet_resnet50.py's "resume from the newest file" idiom). With ``checkpoint.url``
in the spec the appliance gives it level 3 (docs/checkpoints.md): its working directory is synced to the store, so
these files outlive the lease, and `appliance resume` puts them back before the script starts.

Prints ``resuming from epoch E`` (rank 0) when it found a file, and ``done after epoch N`` at the end.
"""

import argparse
import os

import numpy as np
import tensorflow as tf
import horovod.tensorflow as hvd


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--epochs", type=int, default=50)
    ap.add_argument("--batch-size", type=int, default=32)
    args = ap.parse_args()

    hvd.init()
    tf.keras.utils.set_random_seed(3)
    from sklearn.datasets import load_digits

    d = load_digits()
    x = (d.data / 16.0).astype("float32")[hvd.rank()::hvd.size()]
    y = d.target.astype("int64")[hvd.rank()::hvd.size()]
    ds = tf.data.Dataset.from_tensor_slices((x, y)).shuffle(1000, seed=3).batch(args.batch_size)

    model = tf.keras.Sequential([tf.keras.layers.Input(shape=(64,)), tf.keras.layers.Dense(64, activation="relu"),
                                 tf.keras.layers.Dense(10)])
    opt = tf.keras.optimizers.SGD(0.01 * hvd.size())
    loss_fn = tf.keras.losses.SparseCategoricalCrossentropy(from_logits=True)

    resume_from_epoch = 0
    for e in range(args.epochs, 0, -1):
        if os.path.exists(f"checkpoint-{e}.h5"):
            resume_from_epoch = e
            break
    resume_from_epoch = int(hvd.broadcast(tf.constant(resume_from_epoch), 0, name="resume_from_epoch"))
    if resume_from_epoch and hvd.rank() == 0:
        model.load_weights(f"checkpoint-{resume_from_epoch}.h5")
        print(f"resuming from epoch {resume_from_epoch}", flush=True)

    @tf.function
    def step(xb, yb, first):
        with tf.GradientTape() as tape:
            loss = loss_fn(yb, model(xb, training=True))
        tape = hvd.DistributedGradientTape(tape)
        opt.apply_gradients(zip(tape.gradient(loss, model.trainable_variables), model.trainable_variables))
        if first:
            hvd.broadcast_variables(model.variables, root_rank=0)
            hvd.broadcast_variables(opt.variables(), root_rank=0)
        return loss

    first = True
    for epoch in range(resume_from_epoch, args.epochs):
        for xb, yb in ds:
            loss = step(xb, yb, first)
            first = False
        if hvd.rank() == 0:
            model.save_weights(f"checkpoint-{epoch + 1}.h5")
            print(f"epoch {epoch + 1}/{args.epochs} loss {float(loss):.4f}", flush=True)
    if hvd.rank() == 0:
        total = float(np.sum([np.sum(w) for w in model.get_weights()]))
        print(f"done after epoch {args.epochs}; sum of the weights {total:.6f}", flush=True)


if __name__ == "__main__":
    main()
