"""The training job `make bench-ckpt` runs: an MLP on synthetic data, tf.keras + Horovod, deterministic.

--mode plain      no appliance code at all (Horovod only): the baseline step rate
--mode stopcheck  the Checkpointer without a checkpoint URL: only the per-step collective stop check
--mode ckpt       the Checkpointer with the spec's checkpoint URL: async save + upload every N steps
--hidden sets the model size (parameters ~ 2 * hidden^2), so the checkpoint size and step time scale with it.
Every rank prints one APPLIANCE_RESULT line: steps done, seconds in the training loop, and whether it stopped.
"""

import argparse
import json
import os
import time

import numpy as np
import tensorflow as tf
import horovod.tensorflow.keras as hvd


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--mode", choices=["plain", "stopcheck", "ckpt"], default="ckpt")
    ap.add_argument("--hidden", type=int, default=512)
    ap.add_argument("--epochs", type=int, default=4)
    ap.add_argument("--steps-per-epoch", type=int, default=50)
    ap.add_argument("--batch-size", type=int, default=64)
    ap.add_argument("--seed", type=int, default=7)
    args = ap.parse_args()

    hvd.init()
    rank, size = hvd.rank(), hvd.size()
    tf.keras.utils.set_random_seed(args.seed)
    tf.config.experimental.enable_op_determinism()
    n = args.steps_per_epoch * args.batch_size * size
    rng = np.random.RandomState(args.seed)
    x = rng.rand(n, 256).astype("float32")
    y = (x.sum(axis=1) * 7).astype("int64") % 10

    ckpt = None
    if args.mode != "plain":
        from appliance.checkpoint.keras import Checkpointer

        ckpt = Checkpointer(seed=args.seed, batch_size=args.batch_size, exit_on_stop=False,
                            url=None if args.mode == "stopcheck" else os.environ.get("APPLIANCE_CKPT_URL"))
    init = tf.keras.initializers.GlorotUniform(seed=args.seed)
    model = tf.keras.Sequential([
        tf.keras.layers.Input(shape=(256,)),
        tf.keras.layers.Dense(args.hidden, activation="relu", kernel_initializer=init),
        tf.keras.layers.Dense(args.hidden, activation="relu", kernel_initializer=init),
        tf.keras.layers.Dense(10, kernel_initializer=init),
    ])
    opt = hvd.DistributedOptimizer(tf.keras.optimizers.Adam(1e-3 * size))
    model.compile(optimizer=opt, loss=tf.keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    callbacks = [hvd.callbacks.BroadcastGlobalVariablesCallback(0)]
    steps = args.steps_per_epoch
    bs = args.batch_size

    def data(epoch, first):
        perm = np.random.RandomState(args.seed + epoch).permutation(n)
        mine = perm[rank::size][: steps * bs][first * bs:]
        return x[mine], y[mine]

    # one untimed epoch-sized warm-up fit (graph tracing), then the timed loop
    wx, wy = data(0, 0)
    model.fit(wx[: 2 * bs], wy[: 2 * bs], batch_size=bs, epochs=1, verbose=0, shuffle=False)
    t0 = time.perf_counter()
    done = 0
    if ckpt is None:
        for epoch in range(args.epochs):
            ex, ey = data(epoch, 0)
            model.fit(ex, ey, batch_size=bs, epochs=epoch + 1, initial_epoch=epoch, shuffle=False, verbose=0,
                      callbacks=callbacks)
            done += steps
    else:
        for epoch, first in ckpt.epochs(model, args.epochs, steps):
            ex, ey = data(epoch, first)
            model.fit(ex, ey, batch_size=bs, epochs=epoch + 1, initial_epoch=epoch, shuffle=False, verbose=0,
                      callbacks=callbacks + [ckpt.callback])
        done = ckpt.step
    wall = time.perf_counter() - t0
    stopped = bool(ckpt and ckpt.stopped)
    if ckpt is not None and not stopped:
        ckpt.close()
    params = int(sum(np.prod(w.shape) for w in model.get_weights()))
    print("APPLIANCE_RESULT " + json.dumps({"rank": rank, "size": size, "mode": args.mode, "steps": done,
                                            "seconds": round(wall, 4), "stopped": stopped, "params": params}),
          flush=True)


if __name__ == "__main__":
    main()
