"""Keras 3 on the ranks: which Keras a job runs, and Horovod's Keras names made right for a Keras 3 model.

**Which Keras.** ``train.keras: auto | 2 | 3`` (appliance/spec.py ``keras_choice``) decides per job. ``auto`` reads
the code directory's Python files (an AST scan, nothing imported: :func:`keras3_uses`) and picks Keras 3 when they
use Keras-3-only API (``keras.ops``, ``keras.random``, ``keras.config``, ``keras.Variable``,
``keras.utils.PyDataset``, ``from keras import ops`` ...), tf_keras (Keras 2) otherwise. The launcher sets
``TF_USE_LEGACY_KERAS`` (1 or 0) and ``APPLIANCE_KERAS`` (2 or 3) for the ranks.

**A Keras 3 job.** Horovod 0.28.1's Keras module was written for Keras 2: given a Keras 3 optimizer,
``hvd.DistributedOptimizer`` returns a subclass whose Keras-2 hooks (``get_gradients``, ``_aggregate_gradients``)
Keras 3 never calls, so every rank trains on its own gradients and nothing says so; its broadcast callback calls
``optimizer.variables()`` (a list in Keras 3), after the first step. The start-up shim
(appliance/node/shim/sitecustomize.py) calls :func:`patch_horovod` once Horovod's Keras modules are imported, and
:func:`patch_keras` once Keras 3 is:

- ``DistributedOptimizer(opt)`` (``horovod.tensorflow.keras``, ``horovod.keras``, ``horovod.tensorflow``) given a
  Keras 3 optimizer returns it averaging (:func:`averaging`): its ``apply`` averages the gradients across the ranks
  with one ``grouped_allreduce`` before applying them (clipping, weight decay and the update see the averaged
  gradients, identical on every rank). It stays an instance of its own class (no subclass): a ``.keras`` file saved
  by the job records the plain optimizer, and ``keras.models.load_model`` loads it without Horovod. What cannot be
  done that way is refused in one line (:class:`Refused`): Adasum, ``backward_passes_per_step`` > 1,
  ``gradient_predivide_factor``, ``PartialDistributedOptimizer``.
- a ``LossScaleOptimizer`` averages before its finite check (so every rank takes the same branch; averaging inside
  the branch, where Keras calls the inner optimizer, is a collective on a rank-local condition: a hang). When Keras
  wraps the averaging optimizer itself (``mixed_float16``), the averaging moves to the wrapper before the first step.
- ``jit_compile`` (Keras 3's ``"auto"`` is True on a GPU machine): Horovod's ops have no XLA kernels, so a model
  whose optimizer averages is compiled without XLA, said in one line.
- ``callbacks.BroadcastGlobalVariablesCallback(root)`` broadcasts the model's weights (trainable and not) and the
  optimizer's variables at ``on_train_begin`` (Keras 3 has built both by then): before step 1. Not the
  ``SeedGenerator`` states in ``model.variables``: every rank keeps its own random stream (``broadcast_seeds=True``
  broadcasts them too). ``MetricAverageCallback``, ``LearningRateScheduleCallback`` and
  ``LearningRateWarmupCallback`` read and set ``optimizer.learning_rate``.

**A Keras 2 job** (tf_keras): a Keras 3 optimizer given to ``DistributedOptimizer`` is refused in one line (it would
not be averaged); ``train.keras: 3`` runs the job on Keras 3.
"""

from __future__ import annotations

import ast
import os
import sys
import types
from pathlib import Path

# ---------------------------------------------------------------------------------------------
# Which Keras a job's code needs (client side: no import of Keras, only the code's syntax)

# attribute paths under `keras` that tf_keras 2.18 does not have
KERAS3_ONLY = ("ops", "random", "config", "Variable", "tree", "distribution", "dtype_policies", "quantizers",
               "RematScope", "StatelessScope", "remat", "utils.PyDataset")
SCAN_SKIP = {".git", "__pycache__", ".venv", "venv", "site-packages", "node_modules"}
MAX_FILES, MAX_BYTES = 2000, 2_000_000


def _keras3_name(dotted: str) -> str | None:
    """``keras.ops.mean`` -> ``keras.ops``; None when the path is not Keras-3-only."""
    rest = dotted.split(".", 1)[1] if "." in dotted else ""
    for name in KERAS3_ONLY:
        if rest == name or rest.startswith(name + "."):
            return f"keras.{name}"
    return None


def source_keras3_uses(text: str, filename: str = "<source>") -> list[str]:
    """Where one Python source uses Keras-3-only API: ``["train.py:3 keras.ops", ...]`` (empty when none, or when
    the file does not parse)."""
    try:
        tree = ast.parse(text, filename)
    except (SyntaxError, ValueError):
        return []
    keras_names, tf_names = set(), set()  # local names bound to the keras module, to tensorflow
    found: list[str] = []

    def said(node, what):
        if what:
            found.append(f"{filename}:{node.lineno} {what}")

    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for a in node.names:
                if a.name == "keras" or a.name.startswith("keras."):
                    said(node, _keras3_name(a.name))
                    keras_names.add(a.asname or "keras")
                elif a.name == "tensorflow":
                    tf_names.add(a.asname or "tensorflow")
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            mod = node.module
            if mod == "tensorflow":
                keras_names.update(a.asname or a.name for a in node.names if a.name == "keras")
            elif mod.startswith("tensorflow.keras"):
                mod = mod[len("tensorflow."):]
            if mod == "keras" or mod.startswith("keras."):
                said(node, _keras3_name(mod))
                for a in node.names:
                    said(node, _keras3_name(f"{mod}.{a.name}"))
    for node in ast.walk(tree):
        if not isinstance(node, ast.Attribute):
            continue
        parts, cur = [], node
        while isinstance(cur, ast.Attribute):
            parts.append(cur.attr)
            cur = cur.value
        if not isinstance(cur, ast.Name):
            continue
        parts.reverse()
        if cur.id in keras_names:
            said(node, _keras3_name(".".join(["keras", *parts])))
        elif cur.id in tf_names and parts[:1] == ["keras"]:
            said(node, _keras3_name(".".join(parts)))
    return sorted(set(found), key=lambda x: (x.split(":")[0], int(x.split(":")[1].split()[0])))


def keras3_uses(code_dir: str | Path) -> list[str]:
    """Where the code directory's Python files use Keras-3-only API (paths relative to it)."""
    root = Path(code_dir)
    found: list[str] = []
    n = 0
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames[:] = sorted(d for d in dirnames if d not in SCAN_SKIP and not d.startswith("."))
        for f in sorted(filenames):
            if not f.endswith(".py"):
                continue
            n += 1
            if n > MAX_FILES:
                return found
            p = Path(dirpath) / f
            try:
                if p.stat().st_size > MAX_BYTES:
                    continue
                text = p.read_text(errors="replace")
            except OSError:
                continue
            found += source_keras3_uses(text, str(p.relative_to(root)))
    return found


# ---------------------------------------------------------------------------------------------
# On a rank


class Refused(ValueError):
    """A Keras 3 optimizer given to a path that would not average its gradients (one line)."""


def _say(line: str) -> None:
    """One line from rank 0 (each rank would say the same)."""
    if os.environ.get("HOROVOD_RANK", "0") == "0":
        print(f"[appliance] {line}", file=sys.stderr, flush=True)


def is_keras3_optimizer(obj) -> bool:
    """Whether ``obj`` is an optimizer of Keras 3 (not tf_keras, not a TF1 optimizer); imports nothing."""
    for cls in type(obj).__mro__:
        top = cls.__module__.split(".")[0]
        if top == "keras" and cls.__name__ == "BaseOptimizer":
            version = str(getattr(sys.modules.get("keras"), "__version__", "3"))
            return not version.startswith(("1.", "2."))
    return False


def _horovod():
    import horovod.tensorflow as hvd

    return hvd


def _is_averaging(opt) -> bool:
    return "apply" in getattr(opt, "__dict__", {}) and getattr(opt, "_appliance_averaging", None) is not None


def averaging(optimizer, *, compression=None, op=None, sparse_as_dense: bool = False, process_set=None):
    """``optimizer`` (a Keras 3 optimizer), its ``apply`` averaging the gradients across the ranks first. The same
    object is returned (its class unchanged, so it saves as itself)."""
    if _is_averaging(optimizer):
        return optimizer
    # a namespace, not a dict: Keras' attribute tracking would wrap a dict
    settings = types.SimpleNamespace(compression=compression, op=op, sparse_as_dense=sparse_as_dense,
                                     process_set=process_set)
    own_apply = type(optimizer).apply

    def apply(grads, trainable_variables=None):
        return own_apply(optimizer, average_gradients(list(grads), **vars(settings)), trainable_variables)

    optimizer._appliance_averaging = settings
    optimizer.apply = apply
    return optimizer


def _plain(optimizer):
    """Undo :func:`averaging` (the averaging moves to a LossScaleOptimizer around it)."""
    settings = optimizer._appliance_averaging
    del optimizer.apply
    optimizer._appliance_averaging = None
    return settings


AVERAGING_OFF = [False]  # a test's switch: the counter-check that unaveraged ranks end with different weights


def average_gradients(grads, *, compression=None, op=None, sparse_as_dense=False, process_set=None):
    """The gradients averaged across the ranks: the dense ones in one grouped allreduce (None stays None)."""
    if AVERAGING_OFF[0]:
        return grads
    import tensorflow as tf

    hvd = _horovod()
    kw = {"op": hvd.Average if op is None else op}
    if compression is not None:
        kw["compression"] = compression
    if process_set is not None:
        kw["process_set"] = process_set
    out = list(grads)
    dense: list[int] = []
    for i, g in enumerate(grads):
        if g is None:
            continue
        if isinstance(g, tf.IndexedSlices):
            if sparse_as_dense:
                out[i] = tf.convert_to_tensor(g)
                dense.append(i)
            else:  # Horovod allgathers slices
                out[i] = hvd.allreduce(g, name=f"appliance.grad.{i}", **kw)
            continue
        out[i] = tf.convert_to_tensor(g)
        dense.append(i)
    if dense:
        reduced = hvd.grouped_allreduce([out[i] for i in dense], **kw)
        for i, r in zip(dense, reduced):
            out[i] = r
    return out


def distributed_optimizer(optimizer, name=None, device_dense="", device_sparse="", compression=None,
                          sparse_as_dense=False, gradient_predivide_factor=1.0, op=None, backward_passes_per_step=1,
                          average_aggregated_gradients=False, num_groups=0, groups=None, process_set=None,
                          scale_local_gradients=True, **more):
    """Horovod's ``DistributedOptimizer`` for a Keras 3 optimizer: :func:`averaging`, or :class:`Refused`."""
    hvd = _horovod()
    if op is not None and op not in (hvd.Average, hvd.Sum):
        raise Refused("[appliance] DistributedOptimizer: only op=Average or Sum averages a Keras 3 optimizer's "
                      "gradients here (not Adasum)")
    if backward_passes_per_step != 1:
        raise Refused("[appliance] DistributedOptimizer: backward_passes_per_step > 1 is not done for a Keras 3 "
                      "optimizer; use the optimizer's own gradient_accumulation_steps")
    if gradient_predivide_factor != 1.0:
        raise Refused("[appliance] DistributedOptimizer: gradient_predivide_factor is not done for a Keras 3 "
                      "optimizer; leave it at 1.0")
    if more:
        raise Refused(f"[appliance] DistributedOptimizer: {', '.join(sorted(more))} is not an argument it takes")
    return averaging(optimizer, compression=compression, op=op, sparse_as_dense=sparse_as_dense,
                     process_set=process_set)


def _wrap_distributed(original, keras3_job: bool, where: str):
    def DistributedOptimizer(optimizer, *args, **kwargs):  # noqa: N802 - Horovod's name
        if is_keras3_optimizer(optimizer):
            if not keras3_job:
                raise Refused(f"[appliance] {where}.DistributedOptimizer: {type(optimizer).__name__} is a Keras 3 "
                              "optimizer on a job that runs tf_keras (Keras 2): Horovod would not average its "
                              "gradients; set train.keras: 3 in the spec")
            return distributed_optimizer(optimizer, *args, **kwargs)
        return original(optimizer, *args, **kwargs)

    DistributedOptimizer.__doc__ = original.__doc__
    DistributedOptimizer._appliance_original = original
    return DistributedOptimizer


def _refuse_partial(original, where):
    def PartialDistributedOptimizer(optimizer, *args, **kwargs):  # noqa: N802 - Horovod's name
        if is_keras3_optimizer(optimizer):
            raise Refused(f"[appliance] {where}.PartialDistributedOptimizer does not average a Keras 3 optimizer's "
                          "gradients; use DistributedOptimizer")
        return original(optimizer, *args, **kwargs)

    PartialDistributedOptimizer._appliance_original = original
    return PartialDistributedOptimizer


def patch_horovod(module, keras3_job: bool) -> None:
    """Horovod's module (``horovod.tensorflow``, ``horovod.tensorflow.keras`` or ``horovod.keras``) after its
    import: its DistributedOptimizer averages a Keras 3 optimizer (a Keras 3 job) or refuses it (a Keras 2 job);
    on a Keras 3 job its callbacks are the Keras 3 ones. Idempotent."""
    where = module.__name__
    dist = getattr(module, "DistributedOptimizer", None)
    if dist is not None and not hasattr(dist, "_appliance_original"):
        module.DistributedOptimizer = _wrap_distributed(dist, keras3_job, where)
    partial = getattr(module, "PartialDistributedOptimizer", None)
    if partial is not None and not hasattr(partial, "_appliance_original"):
        module.PartialDistributedOptimizer = _refuse_partial(partial, where)
    cbs = getattr(module, "callbacks", None)
    if keras3_job and cbs is not None and not getattr(cbs, "_appliance_keras3", False):
        from . import keras3_callbacks as k3

        for name in ("BroadcastGlobalVariablesCallback", "MetricAverageCallback", "LearningRateScheduleCallback",
                     "LearningRateWarmupCallback"):
            setattr(cbs, name, getattr(k3, name))
        cbs._appliance_keras3 = True


def _turn_off_jit(model) -> None:
    if model.jit_compile:
        model.jit_compile = False
        _say("jit_compile turned off for this model: its optimizer averages with Horovod's allreduce, which has no "
             "XLA kernel")


def before_training(model) -> None:
    """Before a train function is made: a LossScaleOptimizer around the averaging optimizer averages in its stead
    (before its finite check, not in the branch), and XLA is off for a model whose optimizer averages."""
    opt = getattr(model, "optimizer", None)
    if opt is None:
        return
    inner = getattr(opt, "inner_optimizer", None)
    if inner is not None and _is_averaging(inner) and not _is_averaging(opt):
        averaging(opt, **vars(_plain(inner)))
    if _is_averaging(opt):
        _turn_off_jit(model)


def patch_keras(keras) -> None:
    """Keras 3 after its import: ``Model.make_train_function`` calls :func:`before_training` first. Idempotent."""
    Model = keras.Model
    make = Model.make_train_function
    if getattr(make, "_appliance", False):
        return

    def make_train_function(self, *args, **kwargs):
        before_training(self)
        return make(self, *args, **kwargs)

    make_train_function._appliance = True
    make_train_function.__doc__ = make.__doc__
    Model.make_train_function = make_train_function
