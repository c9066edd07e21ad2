"""A periodic checkpoint save that the node's disk refuses (full, I/O error) used to kill rank 0 and with it the
run (issue 14, item 4). Now: said loudly, the partial directory cleaned, training goes on, retried next interval.
The Checkpointer's state is set up by hand here (no Horovod); the full save path runs in test_checkpoint.py."""

import errno
import time

import pytest

from appliance.node.checkpointer import Checkpointer


def ranks0(tmp_path, save):
    c = object.__new__(Checkpointer)
    c.rank, c.size, c.model, c.step, c.local_dir, c.save_failures = 0, 1, None, 40, tmp_path / "checkpoints", 0
    c._last_save = 0.0
    (c.local_dir / ".tmp-ckpt-000000040").mkdir(parents=True)
    (c.local_dir / ".tmp-ckpt-000000040" / "state.data").write_bytes(b"half")
    c.save = save
    c._gather_rng = lambda marks=None: [{}]  # the RNG states (TensorFlow's among them) are not what is tested here
    said = []
    c._log = said.append
    return c, said


def test_a_full_disk_does_not_end_the_run(tmp_path):
    def full(*a, **kw):
        raise OSError(errno.ENOSPC, "No space left on device")

    c, said = ranks0(tmp_path, full)
    c._periodic_save()  # no exception: training goes on
    assert c.save_failures == 1 and c._last_save > time.monotonic() - 5  # the next try is one interval away
    assert not list(c.local_dir.glob(".tmp-ckpt-*"))
    assert "CHECKPOINT NOT SAVED at step 40" in said[0] and "No space left" in said[0]


def test_tensorflows_own_io_errors_count_too(tmp_path):
    class ResourceExhaustedError(Exception):  # the shape of tf.errors.ResourceExhaustedError
        pass

    class OpError(Exception):
        pass

    err = type("ResourceExhaustedError", (ResourceExhaustedError, OpError), {})

    def full(*a, **kw):
        raise err("out of space writing state.data")

    c, said = ranks0(tmp_path, full)
    c._periodic_save()
    assert c.save_failures == 1


def test_a_bug_is_not_swallowed(tmp_path):
    def bug(*a, **kw):
        raise KeyError("x")

    c, _ = ranks0(tmp_path, bug)
    with pytest.raises(KeyError):
        c._periodic_save()
