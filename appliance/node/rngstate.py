"""What a checkpoint keeps of a rank besides its weights: its random states, and the model's state in the format of
the Keras that runs it (appliance/node/checkpointer.py saves and restores through these)."""

from __future__ import annotations

import random

import numpy as np

from .keras3_fit import KerasState, is_keras3_model, seed_generators


def rng_state() -> dict:
    import tensorflow as tf

    v, st, g = random.getstate()
    n = np.random.get_state()
    out = {"python": [v, list(st), g], "numpy": [n[0], n[1].tolist(), int(n[2]), int(n[3]), float(n[4])]}
    try:  # refused under op determinism unless the script set a global generator itself
        out["tf_global"] = tf.random.get_global_generator().state.numpy().tolist()
    except RuntimeError:
        pass
    return out


def set_rng_state(s: dict) -> None:
    import tensorflow as tf

    v, st, g = s["python"]
    random.setstate((v, tuple(st), g))
    n = s["numpy"]
    np.random.set_state((n[0], np.array(n[1], dtype=np.uint32), n[2], n[3], n[4]))
    if "tf_global" in s:
        tf.random.get_global_generator().state.assign(np.array(s["tf_global"], dtype=np.int64))


def layer_generators(model) -> list:
    """The random state of every random layer (Dropout, GaussianNoise, RandomFlip, a layer's own SeedGenerator), in
    layer order: each has a ``state`` variable.

    On tf_keras, the tf.random.Generator of each random layer: they exist when tf_keras draws layer randomness from
    generators (the ranks' default, appliance/node/keras_fit.py) and are not in ``model.variables`` nor in a
    ``tf.train.Checkpoint`` of the model (a layer without weights is not tracked). On Keras 3, each layer's
    ``keras.random.SeedGenerator`` (appliance/node/keras3_fit.py), which ``save_weights`` leaves out. Either way the
    checkpoint saves their states itself, per rank."""
    if model is None:
        return []
    if is_keras3_model(model):
        return seed_generators(model)
    out = []
    for layer in model._flatten_layers(include_self=False):
        g = getattr(getattr(layer, "_random_generator", None), "_generator", None)
        if g is not None and hasattr(g, "state"):
            out.append(g)
    return out


def generator_states(model) -> list:
    return [np.asarray(g.state.numpy()).tolist() for g in layer_generators(model)]


def set_generator_states(gens: list, states: list) -> None:
    for g, st in zip(gens, states):
        g.state.assign(np.array(st, dtype=np.asarray(g.state.numpy()).dtype))


class TFState:
    """A tf_keras model's and optimizer's variables: a ``tf.train.Checkpoint`` (``state.*`` files)."""

    def __init__(self, model, optimizer):
        import tensorflow as tf

        self.ckpt = tf.train.Checkpoint(model=model, optimizer=optimizer)
        self.model, self.optimizer = model, optimizer

    def write(self, d) -> None:
        self.ckpt.write(f"{d}/state")

    def read(self, d) -> None:
        if hasattr(self.optimizer, "build"):
            self.optimizer.build(self.model.trainable_variables)
        self.ckpt.read(f"{d}/state").assert_existing_objects_matched()


def model_state(model, optimizer):
    """How this model's state is written into a checkpoint and read back: Keras 3's format or TensorFlow's."""
    return KerasState(model, optimizer) if is_keras3_model(model) else TFState(model, optimizer)


def keras_of(model) -> str:
    """"3" for a Keras 3 model, "2" for a tf_keras one (a checkpoint's ``keras``)."""
    return "3" if is_keras3_model(model) else "2"
