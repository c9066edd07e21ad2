"""Loaded by every rank (it is first on the ranks' PYTHONPATH).

1. Make `keras` mean tf_keras. TensorFlow >= 2.16 installs Keras 3 as `keras`, but Horovod 0.28.1's Keras
   callbacks do `from keras import backend as K` and need Keras 2 (tf_keras). With TF_USE_LEGACY_KERAS=1 this
   aliases `keras` and `keras.*` to `tf_keras` lazily, on first import, so training scripts and Horovod's own
   examples run unmodified.
2. Once `tf_keras` is imported (by the script, by `tf.keras`, or by Horovod), hand it to the appliance's Keras
   hooks (`appliance/node/keras_fit.py`): random layers on checkpointable generators, resume mid-epoch in a plain
   `model.fit`, and with `checkpoint.url` set the appliance's callback added to `Model.fit` (checkpoint.auto).

3. In rank 0 of a job with checkpoint.url: the synced working directory (`appliance/node/filesync.py`, level 3).
4. Once `tensorflow` is imported: TensorFlow's autograph leaves Horovod's code as it is
   (`appliance/node/keras_fit.py` ``horovod_unconverted``): a rank's first step comes seconds of CPU sooner.

5. Which Keras: the launcher sets TF_USE_LEGACY_KERAS per job (train.keras in the spec: auto, 2 or 3). On a Keras 3
   job (TF_USE_LEGACY_KERAS not 1) `keras` is Keras 3, and once Horovod's Keras modules are imported their
   DistributedOptimizer averages a Keras 3 optimizer and their callbacks work on a Keras 3 model
   (`appliance/node/keras3.py`), and the appliance's checkpoints work as on tf_keras (`appliance/node/keras3_fit.py`:
   the callback added to `Model.fit` with checkpoint.url, the mid-epoch resume); on a Keras 2 job a Keras 3
   optimizer given to DistributedOptimizer is refused in one line (it would not be averaged).

Nothing of Keras is imported until something asks for keras or tf_keras.
"""

import importlib
import importlib.abc
import importlib.machinery
import importlib.util
import os
import sys


class _KerasAlias(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    def find_spec(self, fullname, path=None, target=None):
        if fullname == "keras" or fullname.startswith("keras."):
            return importlib.util.spec_from_loader(fullname, self)
        return None

    def create_module(self, spec):
        real = "tf_keras" + spec.name[len("keras"):]
        return importlib.import_module(real)

    def exec_module(self, module):
        pass


class _AfterImport(importlib.abc.MetaPathFinder):
    """Runs a hook once a module (here `tf_keras`, and `tensorflow`) has been executed, by wrapping the loader the
    other finders return for it; ``failed`` is the line said when the hook raises."""

    def __init__(self, name, hook, failed):
        self.name, self.hook, self.failed = name, hook, failed

    def find_spec(self, fullname, path=None, target=None):
        # called for probes too (TensorFlow's lazy `tf.keras` asks importlib.util.find_spec("tf_keras")), so it
        # stays in sys.meta_path until the module has really been executed
        if fullname != self.name:
            return None
        spec = importlib.machinery.PathFinder.find_spec(fullname, path)
        if spec is None or spec.loader is None:
            return spec
        loader, hook, finder, failed = spec.loader, self.hook, self, self.failed

        class _Loader(importlib.abc.Loader):
            def __getattr__(self, name):  # get_resource_reader, is_package, ...: the real loader's
                return getattr(loader, name)

            def create_module(self, spec):
                return loader.create_module(spec)

            def exec_module(self, module):
                loader.exec_module(module)
                if finder in sys.meta_path:
                    sys.meta_path.remove(finder)
                try:
                    hook(module)
                except Exception as e:  # never break the user's import
                    print(f"[appliance] {failed} ({type(e).__name__}: {e})", file=sys.stderr, flush=True)

        spec.loader = _Loader()
        return spec


def _keras_hooks(module):
    from appliance.node.keras_fit import on_tf_keras_import

    on_tf_keras_import(module)


def _horovod_hooks(keras3_job):
    def hook(module):
        from appliance.node.keras3 import patch_horovod

        patch_horovod(module, keras3_job)
    return hook


def _keras3_hooks(module):
    from appliance.node.keras3 import patch_keras
    from appliance.node.keras3_fit import on_keras3_import

    patch_keras(module)
    on_keras3_import(module)


def _tf_hooks(module):
    from appliance.node.keras_fit import horovod_unconverted

    horovod_unconverted()


if os.environ.get("HOROVOD_RANK") == "0" and os.environ.get("APPLIANCE_CKPT_URL") and \
        os.environ.get("APPLIANCE_CHECKPOINT_DIR") and importlib.util.find_spec("appliance") is not None:
    # level 3: rank 0's working directory synced to the store (restored first on a resume)
    from appliance.node.filesync import start_in_rank0

    start_in_rank0()

if os.environ.get("TF_USE_LEGACY_KERAS") == "1" and importlib.util.find_spec("tf_keras") is not None:
    sys.meta_path.insert(0, _KerasAlias())
    if importlib.util.find_spec("appliance") is not None:
        sys.meta_path.insert(0, _AfterImport("tf_keras", _keras_hooks, "the Keras hooks did not install; checkpoints "
                                             "of a plain Model.fit will not resume mid-epoch"))

if importlib.util.find_spec("appliance") is not None:
    _keras3_job = os.environ.get("TF_USE_LEGACY_KERAS") not in ("1", "true", "True")  # TensorFlow's own reading
    for _name in ("horovod.tensorflow", "horovod.tensorflow.keras", "horovod.keras"):
        sys.meta_path.insert(0, _AfterImport(_name, _horovod_hooks(_keras3_job),
                                             f"{_name}: the appliance's Keras 3 checks did not install"))
    if _keras3_job:
        sys.meta_path.insert(0, _AfterImport("keras", _keras3_hooks, "Keras 3: the appliance's checks before a "
                                             "train function (jit_compile, a LossScaleOptimizer) or its checkpoint "
                                             "hooks did not install"))

if "tensorflow" not in sys.modules and importlib.util.find_spec("appliance") is not None:
    sys.meta_path.insert(0, _AfterImport("tensorflow", _tf_hooks, "autograph converts Horovod's code as before"))
