"""Keras 3 on the ranks (appliance/node/keras3.py): which Keras a job runs, Horovod's Keras names averaging a Keras 3
optimizer, and never a silent wrong result (a Keras 3 optimizer that would not be averaged is refused)."""

import json
import subprocess
import sys
import textwrap
import types
from pathlib import Path

import pytest

from appliance.cluster import Cluster, Node
from appliance.errors import SpecError
from appliance.node import keras3
from appliance.protocol import rank_environment
from appliance.spec import keras_choice, keras_line, parse_spec
from appliance.train.launch import horovodrun_command
from conftest import ROOT

# ---------------------------------------------------------------------------------------------
# auto: the code's syntax, nothing imported


@pytest.mark.parametrize("source, found", [
    ("import keras\nx = keras.ops.mean(y)\n", ["t.py:2 keras.ops"]),
    ("from keras import ops\n", ["t.py:1 keras.ops"]),
    ("from keras import layers, random\n", ["t.py:1 keras.random"]),
    ("import keras.ops as K\n", ["t.py:1 keras.ops"]),
    ("from keras.utils import PyDataset\n", ["t.py:1 keras.utils.PyDataset"]),
    ("import keras as k\nclass D(k.utils.PyDataset): pass\n", ["t.py:2 keras.utils.PyDataset"]),
    ("import keras\nkeras.config.set_dtype_policy('mixed_float16')\n", ["t.py:2 keras.config"]),
    ("import keras\nv = keras.Variable(1.0)\n", ["t.py:2 keras.Variable"]),
    ("import tensorflow as tf\nz = tf.keras.ops.sum(x)\n", ["t.py:2 keras.ops"]),
    ("from tensorflow import keras\ng = keras.random.SeedGenerator(1)\n", ["t.py:2 keras.random"]),
    # Keras-2-style scripts (the examples): tf_keras runs them, as before
    ("import keras\nm = keras.Sequential([keras.layers.Dense(1)])\nm.compile(keras.optimizers.Adam(), 'mse')\n",
     []),
    ("import tensorflow as tf\nimport horovod.tensorflow.keras as hvd\nm = tf.keras.Model()\n", []),
    ("ops = 1\nrandom.seed(ops)\nimport numpy.random\n", []),
    ("this is not python(\n", []),
])
def test_auto_finds_keras3_only_api_in_a_source(source, found):
    assert keras3.source_keras3_uses(source, "t.py") == found


def test_auto_reads_the_code_directorys_python_files(tmp_path):
    (tmp_path / "train.py").write_text("import keras\nmodel = keras.Sequential()\n")
    assert keras3.keras3_uses(tmp_path) == []
    (tmp_path / "lib").mkdir()
    (tmp_path / "lib" / "losses.py").write_text("from keras import ops\n")
    (tmp_path / ".venv").mkdir()
    (tmp_path / ".venv" / "x.py").write_text("import keras\nkeras.ops.sum(1)\n")  # not the job's code
    assert keras3.keras3_uses(tmp_path) == ["lib/losses.py:1 keras.ops"]


def test_the_examples_stay_on_tf_keras_but_the_keras3_one():
    for d in (ROOT / "examples").iterdir():
        if d.is_dir() and d.name != "keras3_digits":
            assert keras3.keras3_uses(d) == [], d
    assert keras3.keras3_uses(ROOT / "examples" / "keras3_digits")[0] == "model.py:9 keras.ops"


# ---------------------------------------------------------------------------------------------
# train.keras: per job, said at its start and by `appliance check`


def _spec(tmp_path, source="import keras\n", **train):
    (tmp_path / "code").mkdir(exist_ok=True)
    (tmp_path / "code" / "train.py").write_text(source)
    return parse_spec({"name": "k", "train": {"code": "code", "command": "python train.py", **train}},
                      path=str(tmp_path / "k.yaml"))


KERAS3_SOURCE = "import keras\nfrom keras import ops\n"


@pytest.mark.parametrize("train, source, runs, why", [
    ({}, "import keras\n", "2", "train.keras: auto, no Keras-3-only API in the code"),
    ({}, KERAS3_SOURCE, "3", "train.keras: auto, train.py:2 keras.ops is Keras 3 API"),
    ({"keras": 3}, "import keras\n", "3", "train.keras: 3"),
    ({"keras": "2"}, KERAS3_SOURCE, "2", "train.keras: 2"),
    # train.keras wins over train.env's TF_USE_LEGACY_KERAS, and says so
    ({"keras": 3, "env": {"TF_USE_LEGACY_KERAS": "1"}}, "", "3", "train.keras: 3, over train.env TF_USE_LEGACY_KERAS=1"),
    ({"keras": 2, "env": {"TF_USE_LEGACY_KERAS": "0"}}, "", "2", "train.keras: 2, over train.env TF_USE_LEGACY_KERAS=0"),
    ({"env": {"TF_USE_LEGACY_KERAS": "0"}}, "", "3", "train.keras: auto, train.env TF_USE_LEGACY_KERAS=0"),
])
def test_which_keras_a_job_runs(tmp_path, train, source, runs, why):
    spec = _spec(tmp_path, source, **train)
    assert keras_choice(spec) == (runs, why)
    assert keras_line(spec) == f"Keras {runs}{' (tf_keras)' if runs == '2' else ''}: {why}"
    cl = Cluster(name="c", cloud="testbed", python="/venv/bin/python", nodes=[
        Node(name="node1", private_ip="10.0.0.1", address="10.0.0.1", workdir="/mnt/local")])
    _, env = horovodrun_command(cl, spec, job_id="j1", nic="eth0", pkg_dir="/pkg")
    assert env["TF_USE_LEGACY_KERAS"] == ("1" if runs == "2" else "0") and env["APPLIANCE_KERAS"] == runs


@pytest.mark.parametrize("value", ["4", "auto3", True, "keras3"])
def test_train_keras_is_auto_2_or_3(tmp_path, value):
    with pytest.raises(SpecError, match="train.keras: expected auto, 2 or 3"):
        _spec(tmp_path, keras=value)
    assert _spec(tmp_path).train.keras == "auto"


def test_appliance_check_says_which_keras(tmp_path):
    from click.testing import CliRunner

    from appliance.cli import main

    _spec(tmp_path, KERAS3_SOURCE)
    (tmp_path / "k.yaml").write_text("name: k\ntrain: {code: code, command: python train.py}\n")
    r = CliRunner().invoke(main, ["check", str(tmp_path / "k.yaml")])
    assert r.exit_code == 0, r.output
    assert r.stdout.endswith(" rank(s); Keras 3: train.keras: auto, train.py:2 keras.ops is Keras 3 API\n")
    r = CliRunner().invoke(main, ["check", "--json", str(tmp_path / "k.yaml")])
    assert json.loads(r.stdout)["keras"] == {"runs": "3", "why": "train.keras: auto, train.py:2 keras.ops is Keras 3 API"}
    r = CliRunner().invoke(main, ["check", str(ROOT / "examples" / "digits.yaml")])
    assert r.stdout.endswith("; Keras 2 (tf_keras): train.keras: auto, no Keras-3-only API in the code\n")


# ---------------------------------------------------------------------------------------------
# Horovod's DistributedOptimizer: a Keras 3 optimizer is averaged (a Keras 3 job) or refused (a Keras 2 job)


def _fake_classes():
    base = type("BaseOptimizer", (), {"__module__": "keras.src.optimizers.base_optimizer"})
    adamw = type("AdamW", (base,), {"__module__": "keras.src.optimizers.adamw"})
    legacy = type("Adam", (), {"__module__": "tf_keras.src.optimizers.adam"})
    return adamw, legacy


def _fake_horovod(name):
    called = []
    mod = types.ModuleType(name)
    mod.DistributedOptimizer = lambda opt, *a, **kw: called.append(opt) or ("horovod's", opt)
    mod.PartialDistributedOptimizer = lambda opt, *a, **kw: ("partial", opt)
    return mod, called


def test_a_keras3_optimizer_on_the_tf_keras_path_is_refused_in_one_line(monkeypatch):
    monkeypatch.delitem(sys.modules, "keras", raising=False)
    adamw, legacy = _fake_classes()
    for name in ("horovod.tensorflow.keras", "horovod.tensorflow", "horovod.keras"):
        mod, called = _fake_horovod(name)
        keras3.patch_horovod(mod, keras3_job=False)
        keras3.patch_horovod(mod, keras3_job=False)  # idempotent
        with pytest.raises(keras3.Refused) as e:
            mod.DistributedOptimizer(adamw())
        msg = str(e.value)
        assert "\n" not in msg and msg.startswith(f"[appliance] {name}.DistributedOptimizer: AdamW is a Keras 3 ")
        assert "would not average" in msg and "train.keras: 3" in msg
        with pytest.raises(keras3.Refused):
            mod.PartialDistributedOptimizer(adamw())
        opt = legacy()
        assert mod.DistributedOptimizer(opt, name="x") == ("horovod's", opt) and called == [opt]  # tf_keras: as before


def test_a_keras3_optimizer_on_a_keras3_job_goes_to_the_averaging_optimizer(monkeypatch):
    adamw, legacy = _fake_classes()
    mod, called = _fake_horovod("horovod.tensorflow.keras")
    routed = []
    monkeypatch.setattr(keras3, "distributed_optimizer", lambda opt, *a, **kw: routed.append((opt, kw)) or opt)
    keras3.patch_horovod(mod, keras3_job=True)
    opt = adamw()
    assert mod.DistributedOptimizer(opt, compression="c") is opt and routed == [(opt, {"compression": "c"})]
    assert called == []
    assert keras3.is_keras3_optimizer(opt) and not keras3.is_keras3_optimizer(legacy())
    monkeypatch.setitem(sys.modules, "keras", types.SimpleNamespace(__version__="2.15.0"))  # Keras 2's own `keras`
    assert not keras3.is_keras3_optimizer(opt)


# ---------------------------------------------------------------------------------------------
# 2 ranks on this machine, a Keras 3 script (slow: TensorFlow and horovodrun)

SCRIPT = textwrap.dedent('''
    import hashlib, json, os
    import numpy as np
    import keras
    from keras import ops
    import horovod.tensorflow.keras as hvd

    hvd.init()
    if os.environ.get("NOAVG"):  # the counter-check: nothing averaged
        import appliance.node.keras3 as k3
        k3.AVERAGING_OFF[0] = True
    if os.environ.get("MIXED"):
        keras.mixed_precision.set_global_policy("mixed_float16")
    keras.utils.set_random_seed(1234 + hvd.rank())  # the ranks start apart: the broadcast makes them equal


    @keras.saving.register_keras_serializable("t")
    class Noisy(keras.layers.Layer):
        def __init__(self, **kw):
            super().__init__(**kw)
            self.seed = keras.random.SeedGenerator(7 + hvd.rank())

        def call(self, x, training=False):
            if training:
                return x + 0.01 * keras.random.normal(ops.shape(x), seed=self.seed, dtype=x.dtype)
            return x


    @keras.saving.register_keras_serializable("t")
    def loss(y_true, y_pred):
        return ops.mean(ops.square(ops.cast(y_true, "float32") - ops.cast(y_pred, "float32")))


    rng = np.random.default_rng(hvd.rank())
    x = rng.normal(size=(64, 8)).astype("float32")
    y = (x @ np.arange(8, dtype="float32").reshape(8, 1) / 10.0).astype("float32")
    model = keras.Sequential([keras.Input((8,)), keras.layers.Dense(16, activation="relu"), Noisy(),
                              keras.layers.Dropout(0.3), keras.layers.Dense(1)])
    model.compile(optimizer=hvd.DistributedOptimizer(keras.optimizers.AdamW(0.02)), loss=loss, jit_compile=True)
    cbs = [hvd.callbacks.BroadcastGlobalVariablesCallback(0), hvd.callbacks.MetricAverageCallback(),
           hvd.callbacks.LearningRateWarmupCallback(initial_lr=0.02, warmup_epochs=1)]
    model.fit(x, y, batch_size=16, epochs=2, callbacks=cbs, verbose=0)
    seeds = [v for v in model.variables if "seed_generator" in v.path]
    w = b"".join(np.ascontiguousarray(v).tobytes() for v in model.get_weights())
    print("APPLIANCE_RESULT " + json.dumps({
        "weights": hashlib.sha256(w).hexdigest(), "jit": bool(model.jit_compile),
        "optimizer": type(model.optimizer).__name__, "seeds": [np.asarray(s).tolist() for s in seeds]}), flush=True)
''')


def two_ranks(tmp_path: Path, **env) -> tuple[dict[int, dict], str]:
    (tmp_path / "train.py").write_text(SCRIPT)
    venv_bin = Path(sys.executable).parent
    ranks_env = rank_environment(path=f"{venv_bin}:/usr/bin:/bin", home=str(tmp_path), nic=None, extra={
        "PYTHONPATH": f"{ROOT / 'appliance' / 'node' / 'shim'}:{ROOT}", "TF_USE_LEGACY_KERAS": "0",
        "APPLIANCE_KERAS": "3", **env})
    p = subprocess.run([str(venv_bin / "horovodrun"), "-np", "2", "-H", "localhost:2", "--gloo", "python",
                        "train.py"], cwd=tmp_path, env=ranks_env, capture_output=True, text=True, timeout=240)
    out = p.stdout + p.stderr
    assert p.returncode == 0, out[-3000:]
    results = {}
    for line in out.splitlines():
        if "APPLIANCE_RESULT " in line:
            rank = int(line.split("]", 1)[0].lstrip("["))
            results[rank] = json.loads(line.split("APPLIANCE_RESULT ", 1)[1])
    assert sorted(results) == [0, 1], out[-3000:]
    return results, out


@pytest.fixture(scope="module")
def averaged(tmp_path_factory):
    """(A .keras file such a job saves loads without Horovod: tests/test_lease_end.py, examples/keras3_digits.)"""
    d = tmp_path_factory.mktemp("keras3")
    return d, *two_ranks(d)


@pytest.mark.slow
def test_a_keras3_script_on_two_ranks_ends_with_equal_weights(averaged):
    _, res, out = averaged
    assert res[0]["weights"] == res[1]["weights"]
    assert res[0]["optimizer"] == "AdamW"
    # jit_compile=True, turned off in one line (rank 0's): Horovod's allreduce has no XLA kernel
    assert not res[0]["jit"] and not res[1]["jit"]
    said = [x for x in out.splitlines() if "[appliance] jit_compile turned off" in x]
    assert len(said) == 1 and said[0].startswith("[0]<stderr>:"), said
    # each rank's SeedGenerator kept its own stream (seeded 7 + rank): not broadcast
    assert res[0]["seeds"] != res[1]["seeds"]


@pytest.mark.slow
def test_without_the_averaging_the_ranks_weights_differ(tmp_path):
    res, _ = two_ranks(tmp_path, NOAVG="1")
    assert res[0]["weights"] != res[1]["weights"]


@pytest.mark.slow
def test_mixed_float16_averages_before_the_loss_scale_optimizers_finite_check(tmp_path):
    """Keras wraps the averaging optimizer in a LossScaleOptimizer (mixed_float16): the averaging moves to the
    wrapper, out of its branch on a rank-local finite check."""
    res, _ = two_ranks(tmp_path, MIXED="1")
    assert res[0]["optimizer"] == "LossScaleOptimizer"
    assert res[0]["weights"] == res[1]["weights"]
