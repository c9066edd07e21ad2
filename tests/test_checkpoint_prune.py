"""Pruning never loses the newest checkpoint that verifies (issue 14, item 1), on a file:// store (fast tier; the
commit protocol itself runs against a real Swift in test_checkpoint.py)."""

import json
from pathlib import Path

from appliance.store.checkpoints import CheckpointStore


def commit(cs: CheckpointStore, root: Path, step: int) -> None:
    d = root / f"ckpt-{step:09d}"
    d.mkdir(parents=True)
    (d / "state.data").write_bytes(bytes([step % 256]) * 4000)
    (d / "meta.json").write_text(json.dumps({"step": step}))
    cs.upload(d, {"step": step})


def corrupt(store_root: Path, step: int) -> None:
    p = store_root / "run" / f"ckpt-{step:09d}" / "state.data"
    p.write_bytes(b"\0" * p.stat().st_size)  # same size, other bytes


def store_with(tmp_path: Path, steps, bad=()) -> CheckpointStore:
    """A run's store with these checkpoints committed, then ``bad`` ones corrupted."""
    cs = CheckpointStore(f"file://{tmp_path / 'store'}/", "run", None)
    for step in steps:
        commit(cs, tmp_path / "local", step)
    for step in bad:
        corrupt(tmp_path / "store", step)
    return cs


def test_prune_after_a_fallback_keeps_the_newest_good_checkpoint(tmp_path, said):
    """Reproduced: commit 300 and 400, corrupt 400, resume falls back to 300, commit 310 and 320 with keep: 1.
    Before the fix only the corrupt 400 remained and newest_good() found nothing."""
    cs = store_with(tmp_path, (300, 400), bad=(400,))
    said.clear()
    for step in (310, 320):
        commit(cs, tmp_path / "local", step)
        cs.prune(keep=1)
    good, problems = cs.newest_good()
    assert good is not None and good.step == 320, problems
    assert any("ckpt-000000400" in m and "does not count" in m for m in said), said


def test_a_checkpoint_that_fails_verification_holds_no_slot(tmp_path):
    cs = store_with(tmp_path, (10, 20, 30), bad=(30,))
    cs.prune(keep=2)
    # the two newest that verify are kept; the corrupt one is set aside, not counted
    assert [c.step for c in cs.committed()] == [30, 20, 10]
    commit(cs, tmp_path / "local", 40)
    cs.prune(keep=2)
    steps = [c.step for c in cs.committed()]
    assert 40 in steps and 20 in steps and 10 not in steps
    assert cs.newest_good()[0].step == 40


def test_prune_keeps_the_newest_good_even_if_every_newer_one_is_bad(tmp_path):
    cs = store_with(tmp_path, (1, 2, 3), bad=(2, 3))
    cs.prune(keep=1)
    assert cs.newest_good()[0].step == 1


def test_prune_lists_the_store_once_and_reads_only_new_manifests(tmp_path):
    """It runs after every commit, in the uploader's thread: a slow prune delays the next upload (seen in the e2e
    tier: a checkpoint superseded before it was uploaded)."""
    cs = store_with(tmp_path, (10, 20, 30))
    cs.prune(keep=2)
    calls = {"list": 0, "get": 0}
    real_list, real_get = cs.store.list, cs.store.get

    def counting_list(prefix=""):
        calls["list"] += 1
        return real_list(prefix)

    def counting_get(name, write, **kw):
        calls["get"] += 1
        return real_get(name, write, **kw)

    cs.store.list, cs.store.get = counting_list, counting_get
    commit(cs, tmp_path / "local", 40)
    calls.update(list=0, get=0)
    cs.prune(keep=2)
    assert calls == {"list": 1, "get": 1}  # the new checkpoint's manifest; the others were read before
    assert [c.step for c in cs.committed()] == [40, 30]
