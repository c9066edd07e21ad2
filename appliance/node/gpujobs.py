"""The jobs `appliance doctor --gpu` runs, each in a process of its own: ``python gpujobs.py KIND [options]``.

A script that stands alone (the standard library at import, TensorFlow and Horovod inside each job), so the node
doctor runs it with the venv's Python and the cluster check copies it to the nodes as a job's code. Every job ends
with one ``APPLIANCE_RESULT {json}`` line (an ``error`` in it when the job failed); the doctor
(appliance/node/gpudoctor.py) judges it.

- ``nccl``: hvd.allreduce (sum) and hvd.broadcast of tensors on this rank's GPU, called directly (DistributedOptimizer
  skips the allreduce at size 1, horovod/tensorflow/__init__.py ``_allreduce_cond``), then the libnccl files
  /proc/self/maps shows and the version the mapped one reports. One rank without horovodrun, or every rank under it. ``--allow-cpu``: CPU tensors (Gloo)
  where there is no GPU, to test the job itself.
- ``train``: op determinism on, a small convnet, N steps uninterrupted (its weights saved), then from the same
  initial weights K steps and a tf.train.Checkpoint of model and optimizer.
- ``resume``: in a new process, that checkpoint restored and steps K..N-1 run; its weights against the
  uninterrupted run's (np.array_equal); the final checkpoint and predictions saved for ``cpu-restore``.
- ``cpu-restore``: run with CUDA_VISIBLE_DEVICES="": the final checkpoint loaded on the CPU, its predictions
  against those made on the device.
"""

import argparse
import json
import os
import socket
import sys
import threading

RESULT = "APPLIANCE_RESULT"  # appliance.protocol.Line.RESULT (this file imports nothing of the appliance)
SHAPE, CLASSES, BATCH = (12, 12, 3), 10, 16


def emit(out: dict) -> None:
    print(f"{RESULT} {json.dumps(out, sort_keys=True)}", flush=True)


def limit(seconds: float) -> None:
    """End this process after ``seconds`` whatever it is doing (a collective that never completes)."""
    def stop():
        emit({"error": f"timed out after {seconds:.0f} s", "host": socket.gethostname()})
        os._exit(124)
    t = threading.Timer(seconds, stop)
    t.daemon = True
    t.start()


def nccl_libs() -> list[str]:
    """The distinct libnccl files mapped into this process."""
    with open("/proc/self/maps") as fh:
        return sorted({line.split(None, 5)[5].strip() for line in fh
                       if len(line.split(None, 5)) == 6 and "libnccl" in line.split(None, 5)[5]})


def nccl_version(lib: str) -> str | None:
    """The version the mapped libnccl says (ncclGetVersion: major * 10000 + minor * 100 + patch since NCCL 2.9)."""
    import ctypes

    try:
        v = ctypes.c_int()
        if ctypes.CDLL(lib).ncclGetVersion(ctypes.byref(v)) != 0:
            return None
    except (OSError, AttributeError):
        return None
    return f"{v.value // 10000}.{v.value // 100 % 100}.{v.value % 100}"


def nccl(a) -> int:
    import tensorflow as tf
    import horovod.tensorflow as hvd

    hvd.init()
    out = {"rank": hvd.rank(), "size": hvd.size(), "local_rank": hvd.local_rank(), "host": socket.gethostname()}
    gpus = tf.config.list_physical_devices("GPU")
    if not gpus and not a.allow_cpu:
        emit({**out, "error": "TensorFlow sees no GPU"})
        return 1
    if gpus:
        i = hvd.local_rank() % len(gpus)
        tf.config.set_visible_devices(gpus[i], "GPU")
        details = tf.config.experimental.get_device_details(gpus[i])
        out.update(gpu_index=i, gpu=details.get("device_name"), shared_gpu=hvd.local_size() > len(gpus),
                   compute_capability=details.get("compute_capability"))
    with tf.device("/GPU:0" if gpus else "/CPU:0"):
        s = hvd.allreduce(tf.fill([4], float(hvd.rank() + 1)), op=hvd.Sum, name="doctor_allreduce")
        b = hvd.broadcast(tf.fill([4], float(hvd.rank() * 10 + 7)), root_rank=0, name="doctor_broadcast")
        out.update(sum=s.numpy().tolist(), broadcast=b.numpy().tolist(), device=s.device, broadcast_device=b.device)
    out["nccl_libs"] = nccl_libs()
    out["nccl_version"] = nccl_version(out["nccl_libs"][0]) if len(out["nccl_libs"]) == 1 else None
    emit(out)
    return 0


# -- bit-exact resume -----------------------------------------------------------------------------------------------

def _stack(seed: int):
    """TensorFlow with op determinism and every seed set, and Keras 2 (tf_keras, as the ranks use it)."""
    os.environ.setdefault("TF_USE_LEGACY_KERAS", "1")
    import tensorflow as tf
    try:
        import tf_keras as keras
    except ImportError:
        keras = tf.keras
    keras.utils.set_random_seed(seed)  # Python's, NumPy's and TensorFlow's
    tf.config.experimental.enable_op_determinism()
    return tf, keras


def _data(steps: int, seed: int):
    """Every step's batch, from the seed alone: a resumed process gets the same batches."""
    import numpy as np

    rs = np.random.RandomState(seed)
    x = rs.uniform(-1, 1, (steps, BATCH) + SHAPE).astype("float32")
    return x, rs.randint(0, CLASSES, (steps, BATCH)).astype("int64")


def _probe_input():
    import numpy as np

    return np.random.RandomState(12345).uniform(-1, 1, (32,) + SHAPE).astype("float32")


INJECT = {  # an op added to every step, for the tests and by hand: under op determinism TensorFlow refuses it on
    # every device ("Timestamp cannot be called when determinism is enabled"), as it refuses an op that has no
    # deterministic GPU kernel
    "none": None,
    "timestamp": lambda tf, logits: tf.cast(tf.timestamp(), logits.dtype),
}


def _model(tf, keras, inject: str = "none"):
    L = keras.layers
    model = keras.Sequential([L.Input(SHAPE), L.Conv2D(8, 3, activation="relu"), L.Conv2D(8, 3, activation="relu"),
                              L.Flatten(), L.Dense(16, activation="relu"), L.Dense(CLASSES)])
    opt = keras.optimizers.Adam(1e-2)
    loss_fn = keras.losses.SparseCategoricalCrossentropy(from_logits=True)
    extra = INJECT[inject]

    @tf.function
    def step(x, y):
        with tf.GradientTape() as tape:
            logits = model(x, training=True)
            loss = loss_fn(y, logits)
            if extra is not None:
                loss += 0.0 * extra(tf, logits)
        grads = tape.gradient(loss, model.trainable_variables)
        opt.apply_gradients(zip(grads, model.trainable_variables))
        return loss
    return model, opt, step


def _ckpt(tf, model, opt, step_no: int):
    return tf.train.Checkpoint(model=model, optimizer=opt, step=tf.Variable(step_no, dtype=tf.int64))


def _device(tf) -> str:
    gpus = tf.config.list_physical_devices("GPU")
    if not gpus:
        return "CPU"
    return tf.config.experimental.get_device_details(gpus[0]).get("device_name") or "GPU"


def train(a) -> int:
    import numpy as np

    tf, keras = _stack(a.seed)
    x, y = _data(a.steps, a.seed)
    model, opt, step = _model(tf, keras, a.inject)
    initial = model.get_weights()
    for i in range(a.steps):
        step(x[i], y[i])
    np.savez(os.path.join(a.dir, "full.npz"), *model.get_weights())
    model2, opt2, step2 = _model(tf, keras, a.inject)
    model2.set_weights(initial)
    for i in range(a.split):
        step2(x[i], y[i])
    _ckpt(tf, model2, opt2, a.split).write(os.path.join(a.dir, "ckpt-split"))
    emit({"device": _device(tf), "steps": a.steps, "split": a.split})
    return 0


def resume(a) -> int:
    import numpy as np

    tf, keras = _stack(a.seed)
    x, y = _data(a.steps, a.seed)
    model, opt, step = _model(tf, keras, a.inject)
    opt.build(model.trainable_variables)
    ck = _ckpt(tf, model, opt, 0)
    ck.read(os.path.join(a.dir, "ckpt-split")).assert_existing_objects_matched()
    start = int(ck.step.numpy())
    for i in range(start, a.steps):
        step(x[i], y[i])
    ck.step.assign(a.steps)
    ck.write(os.path.join(a.dir, "ckpt-final"))
    full = np.load(os.path.join(a.dir, "full.npz"))
    got = model.get_weights()
    want = [full[f"arr_{i}"] for i in range(len(got))]
    names = [v.name for v in model.weights]
    differ = [n for n, g, w in zip(names, got, want) if not np.array_equal(g, w)]
    diff = max(float(np.max(np.abs(g - w))) for g, w in zip(got, want))
    tf.config.experimental.enable_tensor_float_32_execution(False)  # predictions to compare with the CPU's
    np.save(os.path.join(a.dir, "predictions.npy"), model(_probe_input(), training=False).numpy())
    emit({"device": _device(tf), "steps": a.steps, "split": start, "variables": len(got), "differ": differ,
          "max_abs_diff": diff})
    return 0


def cpu_restore(a) -> int:
    import numpy as np

    tf, keras = _stack(a.seed)
    model, opt, _ = _model(tf, keras)
    opt.build(model.trainable_variables)
    _ckpt(tf, model, opt, 0).read(os.path.join(a.dir, "ckpt-final")).assert_existing_objects_matched()
    want = np.load(os.path.join(a.dir, "predictions.npy"))
    got = model(_probe_input(), training=False).numpy()
    emit({"device": _device(tf), "gpus_visible": len(tf.config.list_physical_devices("GPU")),
          "max_abs_diff": float(np.max(np.abs(got - want))), "scale": float(np.max(np.abs(want)))})
    return 0


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("kind", choices=["nccl", "train", "resume", "cpu-restore"])
    ap.add_argument("--allow-cpu", action="store_true", help="nccl: CPU tensors where there is no GPU")
    ap.add_argument("--dir", help="train/resume/cpu-restore: where the checkpoints and weights go")
    ap.add_argument("--steps", type=int, default=8)
    ap.add_argument("--split", type=int, default=3)
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--inject", choices=sorted(INJECT), default="none")
    ap.add_argument("--limit", type=float, default=600, help="end the job after this many seconds")
    a = ap.parse_args(argv)
    limit(a.limit)
    job = {"nccl": nccl, "train": train, "resume": resume, "cpu-restore": cpu_restore}[a.kind]
    try:
        return job(a)
    except Exception as e:  # noqa: BLE001 - the doctor reports it on one line
        emit({"error": f"{type(e).__name__}: {e}", "host": socket.gethostname()})
        return 1


if __name__ == "__main__":
    sys.exit(main())
