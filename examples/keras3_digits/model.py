"""The model of examples/keras3_digits, in Keras 3 (no Horovod here: a laptop loads ``best.keras`` with this module
imported and nothing else of the job's)::

    import keras, model            # registers Jitter and smoothed_crossentropy
    m = keras.models.load_model("best.keras")
"""

import keras
from keras import ops

CLASSES = 10


@keras.saving.register_keras_serializable("keras3_digits")
class Jitter(keras.layers.Layer):
    """Gaussian noise on the features while training, drawn from a ``keras.random.SeedGenerator`` of its own."""

    def __init__(self, stddev=0.05, seed=None, **kwargs):
        super().__init__(**kwargs)
        self.stddev, self.seed = stddev, seed
        self.generator = keras.random.SeedGenerator(seed)

    def call(self, x, training=False):
        if not training:
            return x
        return x + self.stddev * keras.random.normal(ops.shape(x), seed=self.generator, dtype=x.dtype)

    def get_config(self):
        return {**super().get_config(), "stddev": self.stddev, "seed": self.seed}


@keras.saving.register_keras_serializable("keras3_digits")
def smoothed_crossentropy(y_true, y_pred, smoothing=0.1):
    """Cross-entropy against labels smoothed towards uniform, in ``keras.ops``."""
    labels = ops.one_hot(ops.cast(ops.reshape(y_true, (-1,)), "int32"), CLASSES)
    labels = labels * (1.0 - smoothing) + smoothing / CLASSES
    return -ops.sum(labels * ops.log(ops.clip(y_pred, 1e-7, 1.0)), axis=-1)


def build(seed: int) -> keras.Model:
    return keras.Sequential([
        keras.Input(shape=(8, 8, 1)),
        keras.layers.Conv2D(16, 3, activation="relu"),
        keras.layers.Conv2D(32, 3, activation="relu"),
        keras.layers.MaxPooling2D(2),
        keras.layers.Dropout(0.25),
        keras.layers.Flatten(),
        keras.layers.Dense(64, activation="relu"),
        Jitter(0.05, seed=seed),
        keras.layers.Dropout(0.5),
        keras.layers.Dense(CLASSES, activation="softmax"),
    ])
