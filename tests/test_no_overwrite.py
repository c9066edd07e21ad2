"""Nothing committed is written over (issue 49, defect 1), fast tier on a file:// store.

Checkpoints were named by step alone and ``upload()`` wrote ``meta.json`` first: a second save of one step (a
periodic save at the last step, then ``close()``'s; a stop right after a save) rewrote a committed checkpoint in
place, and until its new manifest landed the committed one failed verification. The rule now: an upload goes to a
name no object of the store has (``ckpt-<step>.<n>`` after the first save of a step)."""

import json
import threading
from pathlib import Path

import pytest

from appliance.store.checkpoints import MANIFEST, CheckpointStore, StoreUnavailable, ckpt_key


def local_ckpt(root: Path, step: int, fill: int, name: str | None = None) -> Path:
    d = root / (name or f"ckpt-{step:09d}")
    d.mkdir(parents=True)
    (d / "state.data").write_bytes(bytes([fill]) * 4000)
    (d / "meta.json").write_text(json.dumps({"step": step, "fill": fill}))
    return d


def files_of(store_root: Path, name: str) -> dict:
    d = store_root / "run" / name
    return {p.relative_to(d).as_posix(): p.read_bytes() for p in sorted(d.rglob("*")) if p.is_file()}


@pytest.fixture
def cs(tmp_path):
    return CheckpointStore(f"file://{tmp_path / 'store'}/", "run", None)


def test_an_interrupted_resave_of_a_committed_step_leaves_it_committed(tmp_path, cs):
    """Reproduced in the issue with keep=1: an interrupted re-upload of ckpt-200 left newest_good() = None."""
    cs.upload(local_ckpt(tmp_path / "a", 200, 1), {"step": 200})
    cs.prune(keep=1)
    before = files_of(tmp_path / "store", "ckpt-000000200")

    def die(i):
        raise StoreUnavailable("the store went away mid-upload")

    with pytest.raises(StoreUnavailable):
        cs.upload(local_ckpt(tmp_path / "b", 200, 2), {"step": 200}, fault=die)
    good, problems = cs.newest_good()
    assert good is not None and good.name == "ckpt-000000200", problems
    assert files_of(tmp_path / "store", "ckpt-000000200") == before  # not a byte of it touched


def test_two_saves_of_one_step_are_both_committed_and_the_later_one_is_newest(tmp_path, cs):
    first = cs.upload(local_ckpt(tmp_path / "a", 200, 1), {"step": 200})
    before = files_of(tmp_path / "store", "ckpt-000000200")
    second = cs.upload(local_ckpt(tmp_path / "b", 200, 2), {"step": 200, "complete": True})
    assert (first["name"], second["name"]) == ("ckpt-000000200", "ckpt-000000200.1")
    assert files_of(tmp_path / "store", "ckpt-000000200") == before
    good, _ = cs.newest_good()
    assert good.name == "ckpt-000000200.1" and cs.read_manifest(good)["meta"]["complete"] is True
    assert [c.name for c in cs.committed()] == ["ckpt-000000200.1", "ckpt-000000200"]
    cs.upload(local_ckpt(tmp_path / "c", 210, 3), {"step": 210})
    cs.prune(keep=2)  # the older save of step 200 goes once two newer ones are committed
    assert [c.name for c in cs.committed()] == ["ckpt-000000210", "ckpt-000000200.1"]


def test_a_partial_upload_of_a_step_is_not_reused(tmp_path, cs):
    """A killed uploader's partial ckpt-300 (no manifest): the next save of 300 goes to a name of its own, and the
    partial goes with the next prune."""
    cs.upload(local_ckpt(tmp_path / "a", 290, 1), {"step": 290})
    part = local_ckpt(tmp_path / "p", 300, 9)
    cs.store.put(cs.prefix + "ckpt-000000300/state.data", part / "state.data")
    m = cs.upload(local_ckpt(tmp_path / "b", 300, 2), {"step": 300})
    assert m["name"] == "ckpt-000000300.1"
    cs.prune(keep=2)
    assert not (tmp_path / "store" / "run" / "ckpt-000000300").exists()
    assert (tmp_path / "store" / "run" / "ckpt-000000300.1" / MANIFEST).exists()


def test_a_listing_that_fails_is_not_read_as_no_save_there(tmp_path, cs):
    cs.upload(local_ckpt(tmp_path / "a", 200, 1), {"step": 200})
    before = files_of(tmp_path / "store", "ckpt-000000200")
    real = cs.store.list

    def flaky(prefix=""):
        raise ConnectionResetError("reset by peer")

    cs.store.list = flaky
    with pytest.raises(StoreUnavailable):
        cs.upload(local_ckpt(tmp_path / "b", 200, 2), {"step": 200}, until=0)
    cs.store.list = real
    assert files_of(tmp_path / "store", "ckpt-000000200") == before


def test_save_order_of_names():
    assert ckpt_key("ckpt-000000200") < ckpt_key("ckpt-000000200.1") < ckpt_key("ckpt-000000200.10") \
        < ckpt_key("ckpt-000000201")
    assert ckpt_key("ckpt-000000200.x") is None and ckpt_key(".tmp-ckpt-000000200") is None


def test_a_resave_on_the_node_never_replaces_the_directory_being_uploaded(tmp_path):
    """save() used to rmtree the directory of the same step, which the uploader may still have been reading: one
    commit could mix files of two saves."""
    from appliance.node.checkpointer import Checkpointer

    ck = Checkpointer.__new__(Checkpointer)  # only the local naming and pruning: no model, no Horovod
    ck.local_dir = tmp_path / "checkpoints"
    ck.url = "file:///x/"
    ck._cv, ck._pending, ck._last_commit_local = threading.Condition(), None, None
    first = local_ckpt(ck.local_dir, 200, 1)
    ck._uploading = first
    second = ck._local_name(200)
    assert second.name == "ckpt-000000200.1" and first.exists()
    local_ckpt(ck.local_dir, 200, 2, name=second.name)
    ck._pending = second
    ck._prune_local()
    assert first.exists() and second.exists()  # one uploading, one waiting: both stay
    ck._uploading, ck._pending, ck._last_commit_local = None, None, second.name
    ck._prune_local()
    assert not first.exists() and second.exists()


def test_the_fault_matrix_on_a_directory_store(tmp_path, monkeypatch):
    """A reset at each store call of commit + prune, lock take + heartbeat, sync + prune + restore (tests/faults.py):
    nothing committed lost or written over, nothing wrong said as success. The same on Swift and Ceph RGW, through
    both APIs, with 503s and resets from an HTTP proxy: tests/test_store_guarantees.py."""
    from types import SimpleNamespace

    from appliance.store import checkpoints
    from faults import CallFaults, matrix

    import time as real_time

    monkeypatch.setattr(checkpoints, "time", SimpleNamespace(time=real_time.time, sleep=lambda s: None))
    faults = CallFaults()
    got = matrix(lambda run: faults.wrap(CheckpointStore(f"file://{tmp_path / 'store'}/", run, None)), faults,
                 tmp_path)
    assert all(len(v) >= 4 for v in got.values()), got
    assert any(r != "ok" for v in got.values() for r in v), got  # the faults did land
    assert len(faults.failed) == sum(len(v) for v in got.values())


def test_a_manifest_naming_a_path_outside_the_checkpoint_is_refused_at_download(tmp_path, cs):
    """Issue 49: download() joined the manifest's keys into paths without the check the stager and the file sync
    make: a manifest naming ../../x wrote outside the destination."""
    from appliance.errors import ApplianceError
    from appliance.store.checkpoints import manifest_digest

    m = cs.upload(local_ckpt(tmp_path / "a", 10, 1), {"step": 10})
    m["files"] = {"../../../outside": m["files"]["state.data"]}
    m["digest"] = manifest_digest(m)
    (tmp_path / "store" / "run" / "ckpt-000000010" / MANIFEST).write_text(json.dumps(m))
    good = cs.committed()[0]
    with pytest.raises(ApplianceError, match="outside the checkpoint"):
        cs.download(good, tmp_path / "dest" / "a" / "b")
    assert not (tmp_path / "outside").exists() and not (tmp_path / "dest" / "outside").exists()
