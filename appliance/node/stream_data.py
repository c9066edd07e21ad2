"""What a script trains on from a stream (appliance/node/stream.py): tf.data datasets of its samples, in its order.

- ``sample_elements``: one element a sample (``{"__key__": key, ext: bytes, ...}``), after ``map_fn`` when given.
  The map runs on ``num_parallel_calls`` samples at once (tf.data's threads: JPEG decoding and augmentation on
  several cores; AUTOTUNE by default) with the order kept (``deterministic=True``: element n is the stream's sample
  n whatever the parallelism), so a resume, positioned by the global step, still reads exactly the samples after
  it. A map whose randomness a resume should repeat draws it from stateless ops seeded by the element (its key).
- ``sample_batches``: those elements in batches of the rank's batch size, prefetched (``Stream.dataset``).
- ``shuffle()`` on either is refused in one line (the stream mixes its samples itself, in an order a resume
  continues; tf.data's buffer is in no checkpoint), and so is ``batch()`` of the elements by another size than the
  stream's (a step is the rank's batch size of samples: the resume position counts them).

TensorFlow is imported when a dataset is made, not with this module."""

from __future__ import annotations

import sys
from collections.abc import Callable, Iterator

from ..errors import ApplianceError

AUTOTUNE = -1  # tf.data.AUTOTUNE: tf.data sizes the map's parallelism to the cores it may use

Samples = Callable[[], Iterator[tuple[str, dict[str, bytes]]]]


def refuse_shuffle(ds):
    """``ds.shuffle(...)`` on a stream's dataset: one line, not a shuffle. The stream shuffles its samples itself
    (dataset.shuffle); tf.data's buffer would hold samples no checkpoint keeps, so a resume would read another
    order."""
    def shuffle(*args, **kwargs):
        raise ApplianceError("a stream's dataset is not shuffled by tf.data: the stream mixes its samples itself "
                             "(dataset.shuffle in the spec), in an order a resume continues exactly",
                             "remove .shuffle(); set dataset.shuffle (shards mixed at once) for more mixing")
    ds.shuffle = shuffle
    return ds


def keep_batch_size(ds, batch_size: int):
    """``ds.batch(n)`` on a stream's elements: only by the stream's batch size (one line otherwise): Keras' steps
    are the resume position, and a step must be the stream's ``batch_size`` samples for it to say which come
    next."""
    inner = ds.batch

    def batch(n, *args, **kwargs):
        if isinstance(n, int) and n != batch_size:
            raise ApplianceError(f"a stream's elements are batched by its batch size ({batch_size}), not {n}: a "
                                 "resume counts steps of that many samples",
                                 f"use .batch(stream.batch_size), or open_stream({n}) (the global batch is it x "
                                 "the ranks)")
        return inner(n, *args, **kwargs)
    ds.batch = batch
    return ds


def sample_elements(samples: Samples, exts: list[str], map_fn=None, num_parallel_calls: int | None = AUTOTUNE,
                    count: int | None = None):
    """A ``tf.data.Dataset`` of what ``samples()`` yields, one dict ``{"__key__": key, ext: bytes, ...}`` a sample,
    in its order; after ``map_fn`` (as ``Dataset.map`` takes it) on ``num_parallel_calls`` samples at once (None:
    one at a time), the order kept. ``count``: how many ``samples()`` yields (a validation pass's), told to tf.data
    so that Keras knows a pass's steps."""
    import tensorflow as tf

    sig = {"__key__": tf.TensorSpec([], tf.string), **{e: tf.TensorSpec([], tf.string) for e in exts}}

    def gen():
        try:
            for key, parts in samples():
                missing = [e for e in exts if e not in parts]
                if missing:
                    raise ApplianceError(f"sample {key} has no {', '.join(missing)} part in the packed dataset",
                                         f"read the parts it has: {', '.join(sorted(parts))}")
                yield {"__key__": key, **{e: parts[e] for e in exts}}
        except ApplianceError as e:  # said in one line before TensorFlow wraps it in its own error
            print(f"[appliance] error: {e}", file=sys.stderr, flush=True)
            raise

    ds = tf.data.Dataset.from_generator(gen, output_signature=sig)
    if map_fn is not None and num_parallel_calls is None:
        ds = ds.map(map_fn)
    elif map_fn is not None:  # deterministic: the stream's order, however many samples are mapped at once
        ds = ds.map(map_fn, num_parallel_calls=num_parallel_calls, deterministic=True)
    return ds if count is None else ds.apply(tf.data.experimental.assert_cardinality(count))


def sample_batches(samples: Samples, exts: list[str], batch_size: int, map_fn=None,
                   num_parallel_calls: int | None = AUTOTUNE, count: int | None = None):
    """``sample_elements`` in batches of ``batch_size``, prefetched: the next batches are read while the step runs
    (the order and the resume position are the stream's, whatever tf.data has read ahead)."""
    ds = sample_elements(samples, exts, map_fn, num_parallel_calls, count)
    return refuse_shuffle(ds.batch(batch_size, drop_remainder=True).prefetch(AUTOTUNE))
