"""The appliance's checkpoints on a Keras 3 job: what appliance/node/keras_fit.py does for tf_keras, for Keras 3.

The Checkpointer (appliance/node/checkpointer.py) and its commit protocol, store layout, stop and resume are the
same for both Kerases; what differs is here:

- **The state's format.** ``tf.train.Checkpoint(model=...)`` of a Keras 3 model holds only what its optimizer tracks
  (the trainable variables: no BatchNormalization statistics), so a Keras 3 checkpoint's ``state/`` is Keras 3's own
  ``model.save_weights`` file (every layer's variables and the model's optimizer's), read back with
  ``model.load_weights``; an optimizer that is not the model's (a custom loop's) goes beside it in NumPy's format.
- **Random states.** Keras 3's random layers (Dropout, GaussianNoise, ...) and a script's own layers draw from
  ``keras.random.SeedGenerator`` states (:func:`seed_generators`), variables ``save_weights`` leaves out. The
  Checkpointer saves each rank's, with its other RNG states, and gives each rank its own back: bit-exact, per rank.
- **Mid-epoch resume in a plain ``model.fit``.** Keras 3 starts a fit at ``model._initial_epoch`` (its own
  BackupAndRestore sets it; keras/src/backend/tensorflow/trainer.py ``fit``) and has no batch to start at:
  ``EpochIterator._enumerate_iterator`` (keras/src/trainers/epoch_iterator.py) is wrapped so that the resumed fit's
  first epoch replays the input pipeline as the interrupted one consumed it (the earlier epochs' iterators made
  again, so seeded reshuffles advance as before; with ``steps_per_epoch`` the one iterator Keras keeps across epochs
  skips their batches) and skips the batches already trained on; the steps Keras reports start at that batch.
- **Autolog** (``checkpoint.auto``): ``keras.Model.fit`` gets the appliance's callback as tf_keras' does
  (appliance/node/keras_fit.py ``_with_callback``: the first ``fit`` of the process).
"""

from __future__ import annotations

import functools
import os
import sys

from ..protocol import Env

_STATE: dict = {"iter": False, "plan": None}
WEIGHTS = "state.weights.h5"
OPTIMIZER = "optimizer.npz"


def is_keras3_model(obj) -> bool:
    """Whether ``obj`` is a Keras 3 layer or model (not tf_keras'); imports nothing."""
    for cls in type(obj).__mro__:
        if cls.__module__.split(".")[0] == "keras" and cls.__name__ == "Layer":
            version = str(getattr(sys.modules.get("keras"), "__version__", "3"))
            return not version.startswith(("1.", "2."))
    return False


def seed_generators(model) -> list:
    """The ``keras.random.SeedGenerator`` of every layer of the model (its own included), in layer order."""
    out, seen = [], set()
    for layer in model._flatten_layers(include_self=True):
        for g in getattr(layer, "_seed_generators", None) or []:
            if id(g) not in seen:
                seen.add(id(g))
                out.append(g)
    return out


class KerasState:
    """A Keras 3 model's (and its optimizer's) variables in a checkpoint directory, in Keras 3's format."""

    def __init__(self, model, optimizer):
        self.model, self.optimizer = model, optimizer

    def _own_optimizer(self) -> bool:
        return self.optimizer is not None and self.optimizer is not getattr(self.model, "optimizer", None)

    def write(self, d) -> None:
        import numpy as np

        self.model.save_weights(os.path.join(d, WEIGHTS))
        if self._own_optimizer():
            np.savez(os.path.join(d, OPTIMIZER), *[np.asarray(v.numpy()) for v in self.optimizer.variables])

    def read(self, d) -> None:
        import numpy as np

        opt = getattr(self.model, "optimizer", None)
        for o in (opt, self.optimizer):
            if o is not None and not o.built:
                o.build(self.model.trainable_variables)
        self.model.load_weights(os.path.join(d, WEIGHTS))
        if self._own_optimizer():
            with np.load(os.path.join(d, OPTIMIZER)) as z:
                values = [z[f"arr_{i}"] for i in range(len(z.files))]
            if len(values) != len(self.optimizer.variables):
                raise ValueError(f"the checkpoint's optimizer has {len(values)} variables, this one "
                                 f"{len(self.optimizer.variables)}")
            for v, x in zip(self.optimizer.variables, values):
                v.assign(x)


def resume_at(model, epoch: int, batch: int, say) -> None:
    """The next ``fit`` of ``model`` starts at (epoch, batch): the batches before it skipped in the input."""
    install_epoch_hook()
    model._initial_epoch = epoch or None
    _STATE["plan"] = (epoch, batch, say)


def end_fit(model) -> None:
    """The fit ended: nothing of the resume is left for the next one."""
    _STATE["plan"] = None
    if getattr(model, "_initial_epoch", None) is not None:
        model._initial_epoch = None


def install_epoch_hook() -> None:
    """Wrap ``EpochIterator._enumerate_iterator`` (the module docstring; idempotent)."""
    if _STATE["iter"]:
        return
    from keras.src.trainers import epoch_iterator

    cls = epoch_iterator.EpochIterator
    enumerate_iterator = cls._enumerate_iterator

    @functools.wraps(enumerate_iterator)
    def _enumerate_iterator(self):
        plan, _STATE["plan"] = _STATE["plan"], None
        if plan is None:
            yield from enumerate_iterator(self)
            return
        yield from _resumed(self, enumerate_iterator, *plan)

    cls._enumerate_iterator = _enumerate_iterator
    _STATE["iter"] = True


def _resumed(self, enumerate_iterator, epoch: int, batch: int, say):
    """The resumed fit's first epoch: the input as the interrupted fit left it, at ``batch``."""
    from .keras_fit import _skip

    spe = self.steps_per_epoch
    done = 0
    if spe:  # Keras keeps one iterator across epochs: the earlier epochs' batches come off it first
        self._current_iterator = iter(self._get_iterator())
        done = _skip(self._current_iterator, epoch * spe)
        self._steps_seen = done
    else:  # a new iterator each epoch: the earlier epochs' made again (a seeded reshuffle advances per iterator)
        for _ in range(epoch):
            iter(self._get_iterator())
    steps = enumerate_iterator(self)
    skipped = 0
    for _ in range(batch):
        try:
            _, _, iterator = next(steps)
        except StopIteration:
            break
        skipped += _skip(iterator, self.steps_per_execution)
    want = (epoch * spe if spe else 0) + batch
    say(f"skipped the {done + skipped} batch(es) the run had already trained on (epoch {epoch}, batch {batch})"
        + ("" if done + skipped == want else f"; the data ran out after {done + skipped} of {want}"))
    yield from steps


def on_keras3_import(keras) -> None:
    """Called by the start-up shim once Keras 3 is imported in a rank of a Keras 3 job."""
    from . import keras_fit

    install_epoch_hook()
    if os.environ.get(Env.CKPT_URL) and os.environ.get(Env.CKPT_AUTO, "1") != "0":
        keras_fit.install_autolog(keras.Model)
    keras_fit.freeze_imports()
