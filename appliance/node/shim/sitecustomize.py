"""Loaded by every rank (it is first on the ranks' PYTHONPATH): make `keras` mean tf_keras.

TensorFlow >= 2.16 installs Keras 3 as `keras`, but Horovod 0.28.1's Keras callbacks do
`from keras import backend as K` and need Keras 2 (tf_keras). With TF_USE_LEGACY_KERAS=1 this
aliases `keras` and `keras.*` to `tf_keras` lazily, on first import, so training scripts and
Horovod's own examples run unmodified. Nothing is imported until something asks for keras.
"""

import importlib
import importlib.abc
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


if os.environ.get("TF_USE_LEGACY_KERAS") == "1" and importlib.util.find_spec("tf_keras") is not None:
    sys.meta_path.insert(0, _KerasAlias())
