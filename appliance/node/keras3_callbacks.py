"""Horovod's Keras callbacks for a Keras 3 model (appliance/node/keras3.py puts them in place of Horovod's own in
``horovod.tensorflow.keras.callbacks`` and ``horovod.keras.callbacks`` on a Keras 3 job; same names, same
arguments). Imported only on a rank that runs Keras 3."""

from __future__ import annotations

import horovod.tensorflow as hvd
import keras
import tensorflow as tf
from horovod._keras import callbacks as _impl


def _value(x) -> float:
    return float(keras.ops.convert_to_numpy(x))


def broadcast(variables, root_rank: int) -> None:
    """Each variable set to root_rank's value (in a fixed order: every rank lists them the same way)."""
    for i, v in enumerate(variables):
        v.assign(hvd.broadcast(tf.convert_to_tensor(v), root_rank, name=f"appliance.bcast.{i}"))


class BroadcastGlobalVariablesCallback(keras.callbacks.Callback):
    """Rank ``root_rank``'s model weights (trainable and non-trainable) and optimizer variables on every rank, at
    ``on_train_begin``: before the first step. Not the model's SeedGenerator states (each rank keeps its own random
    stream) unless ``broadcast_seeds=True``; not the variables given to ``register_local_var``."""

    def __init__(self, root_rank=0, device="", broadcast_seeds=False):
        super().__init__()
        self.root_rank, self.device, self.broadcast_seeds = root_rank, device, broadcast_seeds
        self.broadcast_done = False
        self._local_vars = set()

    def register_local_var(self, var):
        self._local_vars.add(id(var))

    def _variables(self):
        model = self.model
        found = list(model.weights)
        if self.broadcast_seeds:
            found += [v for v in model.variables if "seed_generator" in v.path]
        opt = model.optimizer
        if opt is not None:
            if not opt.built:
                opt.build(model.trainable_variables)
            found += list(opt.variables)
        seen, out = set(), []
        for v in found:
            if id(v) not in seen and id(v) not in self._local_vars:
                seen.add(id(v))
                out.append(v)
        return out

    def on_train_begin(self, logs=None):
        if self.broadcast_done:
            return
        with tf.device(self.device):
            broadcast(self._variables(), self.root_rank)
        self.broadcast_done = True


class MetricAverageCallback(keras.callbacks.Callback):
    """The epoch's logged metrics averaged over the ranks (in name order), for the callbacks after it."""

    def __init__(self, device=""):
        super().__init__()
        self.device = device

    def on_epoch_end(self, epoch, logs=None):
        if not logs:
            return
        with tf.device(self.device):
            for name in sorted(logs):
                value = logs[name]
                try:
                    t = tf.constant(_value(value), dtype=tf.float64)
                except (TypeError, ValueError):
                    continue
                logs[name] = float(hvd.allreduce(t, op=hvd.Average, name=f"appliance.metric.{name}").numpy())


class _LearningRate:
    """Horovod's schedule logic with Keras 3's ``optimizer.learning_rate`` (Keras 2's ``lr`` is gone; momentum is a
    Python number in Keras 3, traced into the step: no momentum correction)."""

    def _adjust_learning_rate(self, epoch):
        self.model.optimizer.learning_rate = self.initial_lr * self.multiplier(epoch)

    def _restore_momentum_if_needed(self):
        pass

    def on_train_begin(self, logs=None):
        if self.initial_lr is None:
            self.initial_lr = _value(self.model.optimizer.learning_rate)
        if not self.staircase and not self.steps_per_epoch:
            self.steps_per_epoch = self._autodetect_steps_per_epoch()

    def on_epoch_end(self, epoch, logs=None):
        if logs is not None:
            logs["lr"] = _value(self.model.optimizer.learning_rate)


class LearningRateScheduleCallback(_LearningRate, _impl.LearningRateScheduleCallbackImpl, keras.callbacks.Callback):
    def __init__(self, initial_lr, multiplier, start_epoch=0, end_epoch=None, staircase=True,
                 momentum_correction=True, steps_per_epoch=None):
        super().__init__(None, initial_lr, multiplier, start_epoch, end_epoch, staircase, momentum_correction,
                         steps_per_epoch)


class LearningRateWarmupCallback(_LearningRate, _impl.LearningRateWarmupCallbackImpl, keras.callbacks.Callback):
    def __init__(self, initial_lr, warmup_epochs=5, momentum_correction=True, steps_per_epoch=None, verbose=0):
        super().__init__(None, initial_lr, warmup_epochs, momentum_correction, steps_per_epoch, verbose)

    def on_epoch_end(self, epoch, logs=None):
        _LearningRate.on_epoch_end(self, epoch, logs)
        if epoch == self.end_epoch - 1 and self.verbose > 0 and hvd.rank() == 0:
            print("\nEpoch %d: finished gradual learning rate warmup to %g." %
                  (epoch + 1, _value(self.model.optimizer.learning_rate)))
