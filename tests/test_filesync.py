"""Level 3 (docs/checkpoints.md), fast tier: the synced working directory against a file:// store.

Commit = manifest last; content-addressed objects uploaded once; only complete files; restore checked against
MD5s and never outside the directory; prune keeps the newest manifests that verify and what they name."""

import json
import os

import pytest

from appliance.node.filesync import Syncer
from appliance.store.filesync import FileSet, safe_rel


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


def test_restore_puts_back_the_newest_good_files_and_nothing_outside(tmp_path, fs):
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
    said = []
    assert fs.newest_good(log=said.append)["seq"] == newest - 1 and "digest" in said[0]


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
