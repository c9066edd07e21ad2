"""Synthetic-data training benchmark, one Horovod rank (run by `appliance bench`, or by hand with horovodrun).

    horovodrun -np 2 -H node1:1,node2:1 python synthetic.py --models cnn,mlp --batch-sizes 16,32

For every (model, batch size) cell, every rank:
1. builds the model (tf.keras via tf_keras: ResNet-50, a small CNN or an MLP) on random data that lives
   on the device (no input pipeline in the measurement), and broadcasts rank 0's weights;
2. runs ``--warmup`` steps (graph tracing, allocator, Gloo/NCCL buffers), not measured;
3. barrier, then ``--steps`` training steps (DistributedGradientTape: gradients allreduced, then applied),
   then barrier. The aggregate throughput is *measured*: all ranks' samples / the wall time between the
   two barriers (the slowest rank sets it), not per-rank rate x ranks;
4. runs ``--steps`` local steps with the same model and data but no allreduce: the step time without
   communication. allreduce share = 1 - local step time / distributed step time (the part of a step that
   communication adds, i.e. what overlap did not hide).
Rank 0 gathers every rank's numbers and prints one ``APPLIANCE_RESULT {json}`` line; the others print a
short one (rank, hostname), so the launcher sees that every rank ran.
"""

import argparse
import json
import os
import socket
import sys
import time

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import numpy as np  # noqa: E402
import tensorflow as tf  # noqa: E402
import horovod  # noqa: E402
import horovod.tensorflow as hvd  # noqa: E402
import tf_keras as keras  # noqa: E402  Keras 2: Horovod 0.28.1 does not support Keras 3 optimizers

MODELS = ("resnet50", "cnn", "mlp")


def build(name: str, image_size: int, classes: int):
    """(model, input shape) for one of MODELS."""
    if name == "resnet50":
        shape = (image_size, image_size, 3)
        return keras.applications.ResNet50(weights=None, input_shape=shape, classes=classes,
                                           classifier_activation=None), shape
    if name == "cnn":  # CIFAR-sized convnet: 2 conv blocks + dense, ~0.5 M parameters
        shape = (32, 32, 3)
        L = keras.layers
        return keras.Sequential([
            L.Input(shape=shape),
            L.Conv2D(32, 3, padding="same", activation="relu"), L.Conv2D(32, 3, padding="same", activation="relu"),
            L.MaxPooling2D(),
            L.Conv2D(64, 3, padding="same", activation="relu"), L.Conv2D(64, 3, padding="same", activation="relu"),
            L.MaxPooling2D(),
            L.Flatten(), L.Dense(128, activation="relu"), L.Dense(classes),
        ]), shape
    if name == "mlp":  # MNIST-sized MLP, ~0.7 M parameters: little compute per byte allreduced
        shape = (784,)
        L = keras.layers
        return keras.Sequential([L.Input(shape=shape), L.Dense(512, activation="relu"),
                                 L.Dense(512, activation="relu"), L.Dense(classes)]), shape
    raise SystemExit(f"unknown model {name!r} (choose from {', '.join(MODELS)})")


def pick_gpu(gpus: list, local_rank: int, local_size: int) -> tuple[object, str | None]:
    """This rank's GPU, ``gpus[local_rank % len(gpus)]``, and a note when the node runs more ranks than it has GPUs
    (ranks then share a GPU: each gets a part of its throughput, and NCCL refuses a GPU that two ranks of one job
    share unless each rank has its own NCCL_HOSTID)."""
    gpu = gpus[local_rank % len(gpus)]
    if local_size <= len(gpus):
        return gpu, None
    return gpu, (f"note: {local_size} ranks share {len(gpus)} GPU(s) on {socket.gethostname()}; local rank "
                 f"{local_rank} uses GPU {local_rank % len(gpus)}")


def barrier():
    hvd.allreduce(tf.constant(0.0), name="appliance_bench_barrier").numpy()


def run_cell(model_name: str, batch: int, args, device: str) -> dict:
    classes = 1000 if model_name == "resnet50" else 10
    keras.backend.clear_session()
    tf.random.set_seed(args.seed)
    model, shape = build(model_name, args.image_size, classes)
    opt = keras.optimizers.SGD(0.01 * hvd.size(), momentum=0.9)
    if args.precision == "mixed":
        opt = keras.mixed_precision.LossScaleOptimizer(opt)
    loss_fn = keras.losses.SparseCategoricalCrossentropy(from_logits=True)
    x = tf.random.uniform((batch,) + shape)
    y = tf.random.uniform((batch,), maxval=classes, dtype=tf.int64)

    def loss_of(training_model):
        logits = training_model(x, training=True)
        return loss_fn(y, tf.cast(logits, tf.float32))

    def apply(tape, loss):
        if args.precision == "mixed":
            grads = tape.gradient(opt.get_scaled_loss(loss), model.trainable_variables)
            grads = opt.get_unscaled_gradients(grads)
        else:
            grads = tape.gradient(loss, model.trainable_variables)
        opt.apply_gradients(zip(grads, model.trainable_variables))

    @tf.function
    def dist_step():
        with tf.GradientTape() as tape:
            loss = loss_of(model)
        tape = hvd.DistributedGradientTape(tape)
        apply(tape, loss)
        return loss

    @tf.function
    def local_step():
        with tf.GradientTape() as tape:
            loss = loss_of(model)
        apply(tape, loss)
        return loss

    def timed(step, n):
        t0 = time.perf_counter()
        loss = None
        for _ in range(n):
            loss = step()
        loss.numpy()  # wait for the device
        return time.perf_counter() - t0

    dist_step()  # first step traces; then rank 0's state everywhere
    hvd.broadcast_variables(model.variables, root_rank=0)
    hvd.broadcast_variables(opt.variables(), root_rank=0)
    timed(dist_step, args.warmup)
    barrier()
    t0 = time.perf_counter()
    own = timed(dist_step, args.steps)
    barrier()
    wall = time.perf_counter() - t0
    if args.no_local:
        local = float("nan")
    else:
        timed(local_step, min(args.warmup, 2))  # trace the local step
        barrier()
        local = timed(local_step, args.steps)
    mine = np.array([own, wall, local], dtype=np.float64)
    every = hvd.allgather(tf.constant(mine[None, :]), name=f"appliance_bench_{model_name}_{batch}").numpy()
    own_s, wall_s, local_s = every[:, 0], every[:, 1], every[:, 2]
    samples = args.steps * batch
    step_s = own_s / args.steps
    local_step_s = local_s / args.steps
    per_rank = samples / own_s
    params = int(sum(np.prod(v.shape) for v in model.trainable_variables))
    return {
        "model": model_name, "batch": batch, "precision": args.precision, "device": device,
        "params": params, "grad_mb": round(params * 4 / 1e6, 2),
        "steps": args.steps, "warmup": args.warmup, "ranks": hvd.size(),
        "aggregate": hvd.size() * samples / float(wall_s.max()),  # measured: all samples / slowest wall time
        "per_rank": [round(float(v), 3) for v in per_rank],
        "per_rank_spread": float((per_rank.max() - per_rank.min()) / per_rank.mean()),
        "step_ms": float(step_s.mean() * 1e3),
        "local_step_ms": None if args.no_local else float(local_step_s.mean() * 1e3),
        "allreduce_share": None if args.no_local else float(max(0.0, 1.0 - local_step_s.mean() / step_s.mean())),
        "wall_s": float(wall_s.max()),
    }


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--models", default="cnn,mlp", help=f"comma-separated: {', '.join(MODELS)}")
    ap.add_argument("--batch-sizes", default="16,32", help="per-rank batch sizes, comma-separated")
    ap.add_argument("--steps", type=int, default=20, help="measured steps per cell")
    ap.add_argument("--warmup", type=int, default=5, help="unmeasured steps per cell")
    ap.add_argument("--precision", choices=["fp32", "mixed"], default="fp32", help="mixed: float16 on GPUs only")
    ap.add_argument("--image-size", type=int, default=224, help="ResNet-50 input size")
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--no-local", action="store_true", help="skip the steps without allreduce (no allreduce share)")
    args = ap.parse_args()

    hvd.init()
    gpus = tf.config.list_physical_devices("GPU")
    shared = bool(gpus) and hvd.local_size() > len(gpus)
    if gpus:
        gpu, note = pick_gpu(gpus, hvd.local_rank(), hvd.local_size())
        if note:
            print(note, flush=True)
        tf.config.experimental.set_memory_growth(gpu, True)
        tf.config.set_visible_devices(gpu, "GPU")
        device = tf.config.experimental.get_device_details(gpu).get("device_name", "GPU")
    else:
        device = f"CPU ({os.cpu_count()} cores visible)"
    if args.precision == "mixed":
        if not gpus:
            if hvd.rank() == 0:
                print("error: --precision mixed needs GPUs (float16 on a CPU is slower, not faster)", flush=True)
            return 2
        keras.mixed_precision.set_global_policy("mixed_float16")

    cells = []
    for model_name in [m.strip() for m in args.models.split(",") if m.strip()]:
        for batch in [int(b) for b in args.batch_sizes.split(",") if b.strip()]:
            c = run_cell(model_name, batch, args, device)
            cells.append(c)
            if hvd.rank() == 0:
                local = "" if args.no_local else f" ({c['local_step_ms']:.1f} ms without allreduce)"
                print(f"{c['model']:<9} batch {c['batch']:>4}: {c['aggregate']:10.1f} samples/s on {c['ranks']} "
                      f"rank(s), step {c['step_ms']:.1f} ms{local}, spread {100 * c['per_rank_spread']:.1f}%",
                      flush=True)
    me = {"rank": hvd.rank(), "size": hvd.size(), "hostname": socket.gethostname()}
    hosts = hvd.allgather_object(me["hostname"])
    if hvd.rank() == 0:
        me.update({"bench": cells, "hosts": hosts, "device": device, "shared_gpu": shared, "tensorflow": tf.__version__,
                   "horovod": horovod.__version__,
                   "nccl": bool(hvd.nccl_built()), "gloo": bool(hvd.gloo_built())})
    print("APPLIANCE_RESULT " + json.dumps(me), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
