"""Level 3 (docs/checkpoints.md), fast tier: the synced working directory against a file:// store.

Commit = manifest last; content-addressed objects uploaded once; only complete files; restore checked against
MD5s and never outside the directory; prune keeps the newest manifests that verify and what they name."""

import json
import os

import pytest

from appliance.node.filesync import Syncer
from appliance.store.filesync import FileSet, safe_rel


@pytest.fixture(autouse=True)
def quick(monkeypatch):
    """The syncer's poll and a final sync's quiet moment at a few ms (1 s each on a node): nothing here writes."""
    monkeypatch.setattr(Syncer, "poll_s", 0.01)
    monkeypatch.setattr(Syncer, "quiet_s", 0.01)


@pytest.fixture
def fs(tmp_path):
    return FileSet(f"file://{tmp_path / 'store'}/", "r", None)


def objects(fs):
    return sorted(o.name.rsplit("/", 1)[1] for o in fs.store.list(fs.prefix + "files/objects/"))


def test_only_complete_files_are_committed_and_unchanged_content_goes_up_once(tmp_path, fs, capsys):
    work = tmp_path / "work"
    work.mkdir()
    (work / "train.py").write_text("code")  # the code the launcher copied: never synced
    (work / "checkpoint-1.h5").write_bytes(b"a" * 1000)
    s = Syncer(work, fs, every_s=60, stop_file=None, exclude={"train.py"})
    assert s.sync() is None  # seen once: not yet known to be complete
    body = s.sync()
    assert body["seq"] == 1 and list(body["files"]) == ["checkpoint-1.h5"]
    assert json.loads(capsys.readouterr().out.split("APPLIANCE_FILES ", 1)[1])["files"] == 1
    (work / "logs").mkdir()
    (work / "logs" / "events").write_bytes(b"e" * 10)
    (work / "checkpoint-2.h5").write_bytes(b"a" * 1000)  # the same bytes as checkpoint-1: one object
    s.sync()
    body = s.sync()
    assert sorted(body["files"]) == ["checkpoint-1.h5", "checkpoint-2.h5", "logs/events"]
    assert len(objects(fs)) == 2
    assert s.sync() is None  # nothing changed: no new manifest
    assert fs.manifests() == [2, 1]


def test_a_file_being_written_keeps_its_last_committed_version(tmp_path, fs):
    work = tmp_path / "work"
    work.mkdir()
    f = work / "model.h5"
    f.write_bytes(b"v1")
    s = Syncer(work, fs, every_s=60, stop_file=None, exclude=set())
    s.sync()
    s.sync()
    f.write_bytes(b"v2-half")  # changes between two scans: not complete
    os.utime(f, ns=(1, 1))
    body = s.sync()
    assert body is None or body["files"]["model.h5"]["size"] == 2
    assert fs.newest_good()["files"]["model.h5"]["size"] == 2


def test_restore_puts_back_the_newest_good_files_and_nothing_outside(tmp_path, fs, said):
    work = tmp_path / "work"
    work.mkdir()
    (work / "checkpoint-3.h5").write_bytes(b"w" * 100)
    s = Syncer(work, fs, every_s=60, stop_file=None, exclude=set())
    s.sync(final=True)
    new = tmp_path / "new"
    new.mkdir()
    (new / "train.py").write_text("new code")
    r = Syncer(new, fs, every_s=60, stop_file=None, exclude={"train.py"})
    r.restore()
    assert (new / "checkpoint-3.h5").read_bytes() == b"w" * 100 and (new / "train.py").read_text() == "new code"
    assert r.sync() is None  # the restored files are what the store holds already
    assert not safe_rel("../x") and not safe_rel("/etc/passwd") and not safe_rel("a//b") and safe_rel("a/b.h5")
    # a corrupted newest manifest: the one before it is used
    (new / "checkpoint-4.h5").write_bytes(b"z")
    r.sync()
    r.sync()
    newest = fs.manifests()[0]
    path = tmp_path / "store" / "r" / "files" / f"manifest-{newest:09d}.json"
    path.write_text(path.read_text().replace('"size": 1', '"size": 2'))
    said.clear()
    assert fs.newest_good()["seq"] == newest - 1 and "digest" in said[0]


def test_prune_keeps_the_newest_good_manifests_and_their_objects(tmp_path, fs):
    work = tmp_path / "work"
    work.mkdir()
    s = Syncer(work, fs, every_s=60, stop_file=None, exclude=set(), keep=1)
    for i in range(3):
        (work / "ckpt.h5").write_bytes(bytes([i]) * 10)
        os.utime(work / "ckpt.h5", ns=(i + 10, i + 10))
        s.sync()
        s.sync()
    assert fs.manifests() == [3]
    assert objects(fs) == [f"{fs.newest_good()['files']['ckpt.h5']['md5']}-10"]


@pytest.mark.parametrize("end", [True, False])
def test_a_user_stop_ends_a_level3_job_once_its_files_are_committed(tmp_path, fs, monkeypatch, capsys, end):
    """A job nothing stops at a step (a custom loop: level 3 only). The first Ctrl-C to `appliance train` synced its
    working directory and left it running; a second Ctrl-C killed it. Now the stop request of a user's stop says
    `end: after-sync`, and rank 0's syncer ends the job (EXIT_STOPPED) once the files are committed, after saying
    so (Line.STOPPED, no step). The lease watchdog's stop asks no end: the job syncs and trains on."""
    import json
    import threading

    from appliance.node import filesync
    from appliance.protocol import EXIT_STOPPED, Line, parse

    work = tmp_path / "work"
    work.mkdir()
    (work / "checkpoint-3.h5").write_bytes(b"weights")
    stop = tmp_path / "STOP"
    stop.write_text(json.dumps({"reason": "Ctrl-C to appliance train", **({"end": "after-sync"} if end else {})}))
    s = Syncer(work, fs, every_s=3600, stop_file=stop, exclude=set())
    exits, synced = [], threading.Event()

    def fake_exit(code):
        exits.append(code)
        s.done.set()

    monkeypatch.setattr(filesync.os, "_exit", fake_exit)
    sync = s.sync
    s.sync = lambda **kw: (sync(**kw), synced.set())[0]
    t = threading.Thread(target=s.run)
    t.start()
    assert synced.wait(20)
    if not end:
        s.done.set()
    t.join(20)
    assert exits == ([EXIT_STOPPED] if end else [])
    assert fs.manifests() == [1]
    lines = [parse(x, (Line.STOPPED,)) for x in capsys.readouterr().out.splitlines()]
    stopped = [body for got in lines if got for _, body in [got]]
    assert stopped == ([{"step": None, "committed": True, "reason": "Ctrl-C to appliance train", "files": 1,
                         "checkpoint": "files/manifest-1", "seconds": 0}] if end else [])


def failing_reads(fs, match: str, times: int | None):
    """The store's GET of objects whose name holds ``match`` fails (a reset) ``times`` times, or always (None)."""
    real, left = fs.store.get, {"n": times}

    def get(name, write, **kw):
        if match in name and (left["n"] is None or left["n"] > 0):
            if left["n"] is not None:
                left["n"] -= 1
            raise ConnectionResetError("reset by peer")
        return real(name, write, **kw)

    fs.store.get = get
    fs.cs.store.get = get


def synced(tmp_path, fs, files: dict, keep: int = 2) -> Syncer:
    work = tmp_path / "work"
    work.mkdir(exist_ok=True)
    s = Syncer(work, fs, every_s=60, stop_file=None, exclude=set(), keep=keep)
    for i, (name, data) in enumerate(files.items()):
        (work / name).write_bytes(data)
        os.utime(work / name, ns=(i + 10, i + 10))
        s.sync()  # seen once, then the same: complete (no second of quiet to wait for)
        s.sync()
    return s


def test_a_manifest_read_that_fails_once_is_retried_and_the_files_come_back(tmp_path, fs):
    """Issue 49 defect 2, as reproduced there: one 503 on the manifest GET made the restore quietly find nothing;
    two syncs of the new job later its prune had deleted model-epoch-40.h5 from the store."""
    synced(tmp_path, fs, {"model-epoch-40.h5": b"m" * 100})
    failing_reads(fs, "manifest-", 1)
    new = tmp_path / "new"
    new.mkdir()
    r = Syncer(new, fs, every_s=60, stop_file=None, exclude=set())
    r.restore()
    assert (new / "model-epoch-40.h5").read_bytes() == b"m" * 100


def test_a_store_that_stays_down_fails_the_restore_and_deletes_nothing(tmp_path, fs, monkeypatch):
    from appliance.store import filesync
    from appliance.store.checkpoints import StoreUnavailable

    synced(tmp_path, fs, {"model-epoch-40.h5": b"m" * 100})
    before = objects(fs)
    monkeypatch.setattr(filesync, "READ_WAIT", 0.0)
    failing_reads(fs, "manifest-", None)
    new = tmp_path / "new"
    new.mkdir()
    r = Syncer(new, fs, every_s=60, stop_file=None, exclude=set())
    with pytest.raises(StoreUnavailable):
        r.restore()
    with pytest.raises(StoreUnavailable):
        fs.newest_good()
    assert objects(fs) == before and fs.manifests() == [1]


def test_prune_deletes_nothing_when_a_manifest_cannot_be_read(tmp_path, fs, monkeypatch):
    """Issue 49 defect 3: an unreadable manifest was skipped, then every object no readable manifest named was
    deleted: the newest sync's objects among them."""
    from appliance.store import filesync
    from appliance.store.checkpoints import StoreUnavailable

    synced(tmp_path, fs, {"a.h5": b"1" * 10, "b.h5": b"2" * 10})
    before = objects(fs)
    assert fs.manifests() == [2, 1] and len(before) == 2
    monkeypatch.setattr(filesync, "READ_WAIT", 0.0)
    failing_reads(fs, "manifest-000000002", None)
    with pytest.raises(StoreUnavailable):
        fs.prune(keep=1)
    assert objects(fs) == before and fs.manifests() == [2, 1]


def test_a_file_name_near_name_max_is_restored(tmp_path, fs):
    name = "m" * 250 + ".h5"  # 253 bytes: synced before, never restorable (the temp name added 25: ENAMETOOLONG)
    synced(tmp_path, fs, {name: b"x" * 10})
    new = tmp_path / "new"
    new.mkdir()
    Syncer(new, fs, every_s=60, stop_file=None, exclude=set()).restore()
    assert (new / name).read_bytes() == b"x" * 10
    assert [p.name for p in new.iterdir()] == [name]  # no temporary file left
