"""Small and medium objects: each checked by hashlib as its bytes pass, in its GET's thread; a damaged one fetched
again; one damaged on every try fails the stage and keeps the rest. In the fast tier with an in-memory store
(tests/fakes.py); the same stager stages from a real Swift and Ceph RGW in test_stage.py."""

import json
import os

import pytest

from appliance.errors import ApplianceError
from appliance.node import fetch as sm
from appliance.node.stage import MANIFEST, stage
from fakes import DictStore


def objects(n: int) -> dict[str, bytes]:
    return {f"d/{i:03d}.bin": os.urandom(1 + i * 20_011 % (300 << 10)) for i in range(n)}


def medium(n: int) -> dict[str, bytes]:
    """Objects of a few MB under LARGE (images, audio, shards)."""
    return {f"d/m{i:02d}.bin": os.urandom((1 << 20) + 1 + i * 70_001) for i in range(n)}


def test_small_objects_are_staged_verified_and_recorded(tmp_path):
    data = objects(32)
    st = DictStore(data)
    res = stage(st, "d/", tmp_path / "out", concurrency=4)
    assert res.files_fetched == 32 and res.corrupt_refetched == 0 and res.retries == 0
    assert {n: (tmp_path / "out" / n[2:]).read_bytes() for n in data} == data
    assert set(json.loads((tmp_path / "out" / MANIFEST).read_text())) == set(data)
    assert not (tmp_path / "out" / ".appliance-staging").exists()
    assert sorted(g[0] for g in st.gets) == sorted(data)  # one GET each, read once: checked as it passed


def stage_damaged_once(tmp_path, data: dict[str, bytes], name: str, concurrency: int) -> tuple:
    """``name``'s first GET arrives with byte 0 flipped (its check should fail, and the second GET be right):
    (objects refetched as corrupt, retries, files fetched, the staged files' bytes, GETs of ``name``)."""
    st = DictStore(data)
    st.damage[name] = 1
    res = stage(st, "d/", tmp_path / "out", concurrency=concurrency)
    return (res.corrupt_refetched, res.retries, res.files_fetched,
            {n: (tmp_path / "out" / n[2:]).read_bytes() for n in data}, [g[0] for g in st.gets].count(name))


@pytest.mark.parametrize("kind", ["small", "medium"])
def test_an_object_damaged_on_the_way_is_fetched_again(tmp_path, kind):
    data = objects(16) if kind == "small" else medium(6)
    name = sorted(data)[3]
    assert stage_damaged_once(tmp_path, data, name, 4) == (1, 1, len(data), data, 2)


@pytest.mark.parametrize("kind", ["small", "medium"])
def test_an_object_damaged_on_every_try_fails_the_stage_and_keeps_the_rest(tmp_path, kind):
    """The last try's mismatch is the stage's error, one line; the objects verified before it stay staged and
    recorded, so a second run fetches only what is missing."""
    data = objects(8) if kind == "small" else medium(4)
    bad = sorted(data)[1]
    st = DictStore(data)
    st.damage[bad] = 2
    with pytest.raises(ApplianceError, match=rf"could not fetch '{bad}' after 2 tries \(checksum mismatch\)"):
        stage(st, "d/", tmp_path / "out", concurrency=2, retries=1)
    kept = json.loads((tmp_path / "out" / MANIFEST).read_text())
    assert sorted(kept) == sorted(n for n in data if n != bad)
    res = stage(st, "d/", tmp_path / "out")
    assert res.files_fetched == 1 and res.files_skipped == len(data) - 1
    assert {n: (tmp_path / "out" / n[2:]).read_bytes() for n in data} == data


def test_a_large_object_in_ranges_is_hashed_from_the_file_once_they_are_in(tmp_path, monkeypatch):
    """An MD5 cannot be split: a single large object fetched as parallel ranges is hashed from the page cache once
    they are all written; a damaged range fails it and it is fetched again."""
    monkeypatch.setattr(sm, "LARGE", 64 << 10)
    monkeypatch.setattr(sm, "RANGE", 16 << 10)
    monkeypatch.setattr(sm, "MAX_RANGE", 32 << 10)
    data = {"d/big.bin": os.urandom((200 << 10) + 17)}
    st = DictStore(data)
    st.damage["d/big.bin"] = 1
    res = stage(st, "d/", tmp_path / "out", concurrency=4)
    assert res.corrupt_refetched == 1 and res.files_fetched == 1
    assert (tmp_path / "out" / "big.bin").read_bytes() == data["d/big.bin"]
    assert len(st.gets) == 2 * 13  # 13 ranges, twice


def test_processes_share_the_objects_and_the_parent_records_them(tmp_path):
    """Forked processes (node/fetch.py) each take every k-th object; what each placed and checked comes back to the
    stage: the files, the manifest, the counts (a damaged object's refetch included)."""
    data = objects(200)
    st = DictStore(data)
    st.damage["d/007.bin"] = 1
    seen = []
    res = stage(st, "d/", tmp_path / "out", concurrency=4, processes=3, progress=seen.append)
    assert res.files_fetched == 200 and res.corrupt_refetched == 1 and res.retries == 1
    assert res.bytes_fetched == sum(map(len, data.values()))
    assert {n: (tmp_path / "out" / n[2:]).read_bytes() for n in data} == data
    assert set(json.loads((tmp_path / "out" / MANIFEST).read_text())) == set(data)
    # the children's progress, summed: every byte that came, the damaged try's too
    assert seen[-1]["files"] == 200 and seen[-1]["bytes"] == res.bytes_fetched + len(data["d/007.bin"])
    assert not (tmp_path / "out" / ".appliance-staging").exists()
    assert stage(st, "d/", tmp_path / "out", processes=3).files_skipped == 200


def test_a_process_that_fails_stops_the_stage_in_one_line_and_keeps_what_was_placed(tmp_path):
    data = objects(120)
    st = DictStore(data)
    st.damage["d/050.bin"] = 5
    with pytest.raises(ApplianceError, match=r"could not fetch 'd/050.bin' after 2 tries \(checksum mismatch\)"):
        stage(st, "d/", tmp_path / "out", concurrency=4, processes=2, retries=1)
    kept = json.loads((tmp_path / "out" / MANIFEST).read_text())
    assert "d/050.bin" not in kept and all((tmp_path / "out" / n[2:]).read_bytes() == data[n] for n in kept)
    st.damage.clear()
    res = stage(st, "d/", tmp_path / "out", processes=2)
    assert res.files_fetched + res.files_skipped == 120 and res.files_skipped == len(kept)


def test_the_number_of_processes_follows_the_cores_and_the_objects(monkeypatch):
    monkeypatch.delenv("APPLIANCE_STAGE_PROCESSES", raising=False)
    assert sm.processes(10, cores=48) == 1  # a few objects: not worth a process
    assert sm.processes(640, cores=48) == 10 and sm.processes(100_000, cores=48) == sm.MOST_PROCESSES
    assert sm.processes(100_000, cores=2) == 2
    monkeypatch.setenv("APPLIANCE_STAGE_PROCESSES", "3")
    assert sm.processes(10, cores=48) == 3
