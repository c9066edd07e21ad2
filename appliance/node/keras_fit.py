"""The appliance inside a plain ``model.fit(...)``: resume at (epoch, batch) and skip consumed data, no loop changes.

Three small hooks into tf_keras 2.18 (the version the lock pins), installed in every rank by the start-up shim
(`appliance/node/shim/sitecustomize.py`) right after ``tf_keras`` is imported, and by the callback itself:

- **Random layers draw from a checkpointable generator.** ``tf_keras.backend._USE_GENERATOR_FOR_RNG`` (what
  ``tf.keras.backend.experimental.enable_tf_random_generator()`` sets) makes Dropout, GaussianNoise, the random
  preprocessing layers etc. draw from a ``tf.random.Generator`` per layer, whose state the checkpoint saves per
  rank. The default ("legacy") draws from stateful op kernels whose state no checkpoint can hold.
  ``APPLIANCE_KERAS_RNG=legacy`` keeps Keras' default.
- **The data handler is reachable.** ``DataHandler.__init__`` leaves itself on the model (``_appliance_data``), so the
  callback can build an unbuilt model from the dataset's element spec before restoring into it.
- **Consumed batches are skipped.** Keras resumes mid-epoch through ``Model._training_state`` (what
  ``BackupAndRestore`` uses: tf_keras/src/engine/training.py ``_maybe_load_initial_counters_from_ckpt`` sets
  ``DataHandler._initial_step``), but it only shortens the epoch: the iterator still starts at the epoch's first
  batch. ``DataHandler.enumerate_epochs`` is wrapped to replay what the uninterrupted run consumed: for data whose
  iterator Keras re-creates each epoch (a finite ``tf.data.Dataset`` without ``steps_per_epoch``), one iterator
  creation per earlier epoch (a seeded ``shuffle(..., reshuffle_each_iteration=True)`` advances its seed per
  iterator) and then ``batch`` elements; for data read through one iterator (``.repeat()`` with ``steps_per_epoch``,
  NumPy arrays, which Keras turns into one dataset of all epochs) ``epoch * steps_per_epoch + batch`` elements.
  The skipped batches go through the input pipeline, not through training. A stream (``dataset.mode: stream``,
  appliance/node/stream.py) is not replayed: it starts at the position itself, so no shard is fetched twice.

- **A fit's input iterators are let go off the main thread.** Deleting a ``tf.data`` iterator joins its autotuning
  thread (``RootDataset::Iterator``'s destructor waits for ``Model::OptimizeLoop``), which in TensorFlow 2.18 often
  sleeps out its optimisation period first: ``fit`` returned 0-2.1 s after its last callback, in C++, with nothing
  in any Python profile (gdb and py-spy stacks, 2026-11-25). A loop of one ``fit`` per epoch lost that much per
  epoch, and a stop asked for in that time waited for it (issue 16 goal 3: the maximum deadline -> commit); so did
  every epoch of a ``fit`` whose iterator Keras makes anew each epoch. ``DataHandler.enumerate_epochs`` hands each
  iterator it is done with (an epoch's, when the next is made; the last, when ``fit`` leaves its epoch loop) to a
  thread of its own, which waits until it holds the last reference (``fit`` lets go of it as it returns) and
  deletes it while the main thread goes on: the destructor waits without the GIL. That thread is not a daemon, so
  a process that ends right after waits for it rather than tearing TensorFlow down under it.

- **Keras' slowness check counts the user's callbacks, not the appliance's.** ``CallbackList`` times the batch hooks
  of the first 5 batches of each ``fit`` and warns when they take longer than the batches ("Callback method
  `on_train_batch_end` is slow compared to the batch time"; tf_keras/src/callbacks.py ``_call_batch_end_hook``). The
  appliance's callback spends its intended cost there (a checkpoint's save at its step, the first steps' collective
  stop checks: measured by `make bench-ckpt`), and a script of one ``fit`` per epoch met the check again at every
  epoch: the warning came from the appliance, not from the script. ``CallbackList._call_batch_hook_helper`` is
  wrapped to take the appliance callback's own seconds (``own_time``) out of what Keras counts, and the one
  broadcast of Horovod's ``BroadcastGlobalVariablesCallback`` (the job's start-up sync of the initial weights, at
  the end of its first batch: ~50 ms across two nodes, against batches of 10 ms, so every Horovod script met the
  warning once); every other callback's still count, Horovod's included once its broadcast is done.

- **Autolog** (level 2, ``checkpoint.auto``): ``Model.fit`` gets the appliance's callback appended when the call has
  none, once per process (the first ``fit``).
"""

from __future__ import annotations

import functools
import gc
import os
import sys
import threading
import time

from ..protocol import Env

_STATE = {"data": False, "fit": False, "auto_used": False, "auto_said": False, "beside_said": False, "timing": False}
_OWN = [0.0]  # seconds the appliance's callback has spent in batch hooks, in this process


def own_time(seconds: float) -> None:
    """The appliance's callback spent ``seconds`` in a batch hook (its save, its stop check)."""
    _OWN[0] += seconds


def install_timing_hook() -> None:
    """Keras' slowness check without the appliance callback's own seconds (the module docstring; idempotent)."""
    if _STATE["timing"]:
        return
    from tf_keras.src import callbacks

    helper = callbacks.CallbackList._call_batch_hook_helper

    @functools.wraps(helper)
    def _call_batch_hook_helper(self, hook_name, batch, logs):
        if getattr(self, "_check_timing", False):  # the batches Keras times (its broadcast is in the first)
            for cb in self.callbacks:
                _time_broadcast(cb)
        before = _OWN[0]
        helper(self, hook_name, batch, logs)
        times = getattr(self, "_hook_times", {}).get(hook_name)
        if _OWN[0] > before and getattr(self, "_check_timing", False) and times:
            times[-1] = max(0.0, times[-1] - (_OWN[0] - before))

    callbacks.CallbackList._call_batch_hook_helper = _call_batch_hook_helper
    _STATE["timing"] = True


def _time_broadcast(cb) -> None:
    """Horovod's broadcast callback (horovod/_keras/callbacks.py ``BroadcastGlobalVariablesCallbackImpl``: one
    broadcast in ``on_batch_end``, then ``broadcast_done``) counts that broadcast as the appliance's own seconds."""
    if getattr(cb, "broadcast_done", None) is not False or "horovod" not in type(cb).__module__ \
            or "on_batch_end" in vars(cb):
        return
    inner = cb.on_batch_end

    def on_batch_end(batch, logs=None):
        if cb.broadcast_done:
            return inner(batch, logs)
        t0 = time.perf_counter()
        try:
            return inner(batch, logs)
        finally:
            own_time(time.perf_counter() - t0)

    cb.on_batch_end = on_batch_end


def rng_to_generator(backend_module) -> None:
    """Make tf_keras' random layers use tf.random.Generator (unless APPLIANCE_KERAS_RNG=legacy)."""
    if os.environ.get(Env.KERAS_RNG, "generator") != "legacy":
        backend_module._USE_GENERATOR_FOR_RNG = True


def install_data_hooks() -> None:
    """Wrap DataHandler (idempotent)."""
    if _STATE["data"]:
        return
    from tf_keras.src.engine import data_adapter

    cls = data_adapter.DataHandler
    init, enumerate_epochs = cls.__init__, cls.enumerate_epochs

    @functools.wraps(init)
    def __init__(self, *args, **kwargs):
        init(self, *args, **kwargs)
        if self._model is not None:
            self._model._appliance_data = self

    @functools.wraps(enumerate_epochs)
    def _enumerate_epochs(self):
        current = None
        try:
            for e, iterator in _planned_epochs(self):
                if current is not None and current is not iterator:
                    _let_go(current)  # the epoch before's: Keras made a new one
                current = iterator
                del iterator
                yield e, current
        finally:  # the epoch loop ended, or fit left it (a break, an error)
            if current is not None:
                _let_go(current)
                del current

    def _planned_epochs(self):
        plan = getattr(self._model, "_appliance_skip", None) if self._model is not None else None
        if plan is None:
            yield from enumerate_epochs(self)
            return
        self._model._appliance_skip = None
        epoch, batch, say, rec = (*plan, None)[:4]
        at = _stream_plan(self, epoch, batch, rec)
        if at is not None:  # a stream (dataset.mode: stream) starts at the position itself: nothing fetched twice
            say(f"the stream continues at epoch {epoch}, batch {batch} (global step {at.step}: data epoch "
                f"{at.epoch}, sample {at.sample}); nothing is read again")
            yield from enumerate_epochs(self)
            return
        if self._adapter.should_recreate_iterator():
            for _ in range(epoch):  # the iterators the earlier epochs made: seeded reshuffles advance per iterator
                iter(self._dataset)
            skip = batch
        else:
            skip = epoch * int(self._inferred_steps or 0) + batch
        first = True
        for e, iterator in enumerate_epochs(self):
            if first:
                first = False
                done = _skip(iterator, skip)
                say(f"skipped the {done} batch(es) the run had already trained on (epoch {epoch}, batch {batch})"
                    + ("" if done == skip else f"; the data ran out after {done} of {skip}"))
            yield e, iterator

    cls.__init__ = __init__
    cls.enumerate_epochs = _enumerate_epochs
    _STATE["data"] = True
    install_timing_hook()


def _stream_plan(handler, epoch: int, batch: int, rec: dict | None):
    """The stream the fit trains on (its dataset: ``handler._dataset``) positioned at (epoch, batch), or None
    without a stream; a checkpoint of another order stops the rank with one line."""
    from ..errors import ApplianceError
    from .stream import take_plan

    try:
        return take_plan(epoch, batch, rec, data=getattr(handler, "_dataset", None),
                         steps_per_epoch=int(getattr(handler, "_inferred_steps", 0) or 0) or None)
    except ApplianceError as e:
        print(f"[appliance] error: {e}", file=sys.stderr, flush=True)
        raise SystemExit(1) from None


def training_stream(model):
    """The stream (dataset.mode: stream) the model's fit trains on, or None: its DataHandler's dataset is one a
    stream made (or the first stream opened)."""
    from .stream import training_stream as pick

    return pick(getattr(getattr(model, "_appliance_data", None), "_dataset", None))


LET_GO_WAIT = 10.0  # seconds a let-go iterator waits for its last other holder before it is simply dropped


def _let_go(iterator) -> None:
    """Delete ``iterator`` on a thread of its own once nothing else holds it (the module docstring says why). The
    caller drops its own reference right after."""
    box = [iterator]

    def run():
        it = box.pop()
        deadline, pause = time.monotonic() + LET_GO_WAIT, 0.001
        main = threading.main_thread()
        # 2: ``it`` and getrefcount's argument. The main thread gone: the interpreter is ending, stop waiting.
        while sys.getrefcount(it) > 2 and time.monotonic() < deadline and main.is_alive():
            time.sleep(pause)  # fit returns within milliseconds of leaving its epoch loop
            pause = min(pause * 2, 0.05)
        del it  # the destructor's wait, here and not on the main thread

    threading.Thread(target=run, name="appliance-iterator", daemon=False).start()


def _skip(iterator, n: int) -> int:
    """Up to ``n`` batches taken off ``iterator`` (fewer where the data ends): how many."""
    done = 0
    try:
        for _ in range(n):
            next(iterator)
            done += 1
    except StopIteration:
        pass
    except Exception as e:  # TensorFlow's OutOfRangeError: the dataset ended (its name: TensorFlow not imported here)
        if type(e).__name__ != "OutOfRangeError":
            raise
    return done


def build_from_data(model) -> bool:
    """Build an unbuilt model from its fit data's element spec (True if built)."""
    if model.built:
        return True
    handler = getattr(model, "_appliance_data", None)
    if handler is None:
        return False
    try:
        spec = handler._dataset.element_spec
        x = spec[0] if isinstance(spec, tuple) else spec
        import tensorflow as tf

        shapes = tf.nest.map_structure(lambda s: s.shape, x)
        model.build(shapes)
    except Exception:
        return False
    return bool(model.built)


class ResumeAt:
    """Stands in for Keras' WorkerTrainingState on ``Model._training_state``: fit starts at (epoch, batch)."""

    def __init__(self, epoch: int, batch: int):
        self.epoch, self.batch = epoch, batch

    def maybe_load_initial_counters_from_ckpt(self, steps_per_epoch, initial_epoch, mode=None):
        return self.epoch, self.batch


def install_autolog(model_class=None) -> None:
    """Level 2: every process's first ``Model.fit`` without the appliance's callback gets it (idempotent).
    ``model_class``: Keras 3's ``keras.Model`` (appliance/node/keras3_fit.py); tf_keras' by default."""
    if _STATE["fit"]:
        return
    if model_class is None:
        from tf_keras.src.engine import training

        model_class = training.Model
    fit = model_class.fit

    @functools.wraps(fit)
    def _fit(self, *args, **kwargs):
        args, kwargs = _with_callback(args, kwargs)
        return fit(self, *args, **kwargs)

    model_class.fit = _fit
    _STATE["fit"] = True


_CALLBACKS_POS = 5  # Model.fit(x, y, batch_size, epochs, verbose, callbacks, ...): tf_keras' and Keras 3's


def _say_once(flag: str, message: str) -> None:
    if not _STATE[flag]:
        _STATE[flag] = True
        print(f"[appliance] {message}", file=sys.stderr, flush=True)


def _with_callback(args: tuple, kwargs: dict) -> tuple[tuple, dict]:
    from . import checkpointer
    from .checkpointer import ApplianceCallback

    if len(args) > _CALLBACKS_POS:
        cbs = args[_CALLBACKS_POS]
    else:
        cbs = kwargs.get("callbacks")
    listed = list(getattr(cbs, "callbacks", cbs) or [])
    if any(isinstance(c, ApplianceCallback) for c in listed):
        return args, kwargs
    if checkpointer.made_by_script():
        # The script checkpoints with its own Checkpointer (its loop, or its callback in other fits). A second one
        # here would restore a resumed run's checkpoint into this fit and commit this fit's state (a warm-up's
        # weights, its data position) into the run as its newest checkpoint.
        _say_once("beside_said", "a Model.fit without the script's Checkpointer callback: not checkpointed (the "
                  "script's own Checkpointer is the run's; pass its .callback to checkpoint this fit too)")
        return args, kwargs
    if _STATE["auto_used"]:
        _say_once("auto_said", "another Model.fit in this process: checkpoint.auto protects only the first one; "
                  "for several, pass appliance.checkpoint.keras.callback() to each (docs/checkpoints.md)")
        return args, kwargs
    if cbs is not None and not isinstance(cbs, (list, tuple)):
        return args, kwargs  # a CallbackList the script built itself: left alone
    _STATE["auto_used"] = True
    new = listed + [checkpointer.auto_callback()]
    if len(args) > _CALLBACKS_POS:
        args = args[:_CALLBACKS_POS] + (new,) + args[_CALLBACKS_POS + 1:]
    else:
        kwargs = {**kwargs, "callbacks": new}
    return args, kwargs


def on_tf_keras_import(module) -> None:
    """Called by the start-up shim once ``tf_keras`` is imported in a rank."""
    from tf_keras.src import backend

    rng_to_generator(backend)
    install_data_hooks()
    if os.environ.get(Env.CKPT_URL) and os.environ.get(Env.CKPT_AUTO, "1") != "0":
        install_autolog()
    freeze_imports()


def horovod_unconverted() -> None:
    """TensorFlow's autograph leaves Horovod's code unconverted, as it leaves TensorFlow's and Keras' own
    (tensorflow/python/autograph/core/config.py ``CONVERSION_RULES``, to which this adds ``DoNotConvert("horovod")``,
    as TensorFlow's own converter_testing.py adds its rules). Horovod's allreduce is traced inside a
    ``tf.function`` of its own (horovod/tensorflow/util.py ``_make_subgraph``), and autograph converted it and
    everything it calls at each trace (a ``model.fit`` traces twice): a digits rank's start and first epoch took
    10.0 s of CPU here, 7.6 s without (docs/train.md), with the same weights to the bit. Horovod's code needs no
    conversion: it runs unconverted in TF1 graph mode (the same function, outside ``tf.function``) and branches on
    tensors with ``tf.cond`` itself (horovod/tensorflow/gradient_aggregation.py).
    ``APPLIANCE_HOROVOD_AUTOGRAPH=convert`` keeps TensorFlow's default."""
    if os.environ.get(Env.HOROVOD_AUTOGRAPH) == "convert":
        return
    from tensorflow.python.autograph.core import config

    if not any(isinstance(r, config.DoNotConvert) and r.matches("horovod") for r in config.CONVERSION_RULES):
        config.CONVERSION_RULES = (config.DoNotConvert("horovod"), *config.CONVERSION_RULES)


def freeze_imports() -> None:
    """TensorFlow and Keras leave ~380,000 objects to Python's garbage collector at import, and each of its full
    collections walks them all again (0.28 s of CPU here); the garbage of a Keras training loop asks for one every
    few seconds. They live as long as the rank does: they go to the collector's permanent generation
    (``gc.freeze``, https://docs.python.org/3/library/gc.html#gc.freeze), and what the script makes from here on is
    collected as before. A digits rank spends 15% less CPU with it (docs/train.md)."""
    gc.freeze()
