"""Small objects' MD5s, taken 8 at a time in the lanes after their GETs (store/md5lanes.py, ``Bodies``), while the
threads that fetched them go on: in the fast tier with an in-memory store (tests/fakes.py). The same stager stages
small objects from a real Swift and Ceph RGW in test_stage.py (a damaged one fetched again, resume after a kill)."""

import hashlib
import json
import os
import threading
import zlib

import pytest

from appliance.errors import ApplianceError
from appliance.node import stage as sm
from appliance.node.stage import MANIFEST, stage
from appliance.store import md5lanes
from appliance.store.objects import CRC_META, crc_meta
from fakes import DictStore

pytestmark = pytest.mark.skipif(md5lanes.LANES == 1, reason="the lanes are not built or the CPU has no AVX2")


class Made(list):
    flush = 0.01  # how long a batch waits for its 8th body (0.02 s in a stage)


@pytest.fixture
def bodies(monkeypatch):
    """The stage's Bodies, kept for the test."""
    made = Made()

    class Kept(md5lanes.Bodies):
        def __init__(self, **kw):
            super().__init__(flush=made.flush, **kw)
            made.append(self)

    monkeypatch.setattr(sm, "Bodies", Kept)
    return made


def objects(n: int) -> dict[str, bytes]:
    return {f"d/{i:03d}.bin": os.urandom(1 + i * 20_011 % (300 << 10)) for i in range(n)}


def test_small_objects_are_hashed_sixteen_in_one_call_while_their_threads_fetch_on(tmp_path, bodies):
    """Each small object's MD5 was taken by hashlib in its GET's thread (155 microseconds for 100 KB here; 41 in a
    call of 8 lanes). 32 objects through 4 threads: two calls of 16. A thread that waited for its object's verdict
    would leave at most 4 bodies waiting, and each call would wait its 5 s for the rest."""
    bodies.flush = 5.0
    data = objects(32)
    st = DictStore(data)
    res = stage(st, "d/", tmp_path / "out", concurrency=4)
    assert res.files_fetched == 32 and res.corrupt_refetched == 0 and res.retries == 0
    assert {n: (tmp_path / "out" / n[2:]).read_bytes() for n in data} == data
    assert bodies[0].batches == {md5lanes.LANES: 32 // md5lanes.LANES} and not bodies[0].errors
    assert set(json.loads((tmp_path / "out" / MANIFEST).read_text())) == set(data)
    assert not (tmp_path / "out" / ".appliance-staging").exists()


def stage_damaged_once(tmp_path, data: dict[str, bytes], name: str, concurrency: int) -> tuple:
    """``name``'s first GET arrives with byte 0 flipped (its verdict should put it back, and the second GET be
    right): (objects refetched as corrupt, retries, files fetched, the staged files' bytes, GETs of ``name``)."""
    st = DictStore(data)
    st.damage[name] = 1
    res = stage(st, "d/", tmp_path / "out", concurrency=concurrency)
    return (res.corrupt_refetched, res.retries, res.files_fetched,
            {n: (tmp_path / "out" / n[2:]).read_bytes() for n in data}, [g[0] for g in st.gets].count(name))


def test_a_small_object_damaged_on_the_way_is_fetched_again_on_its_verdict(tmp_path, bodies):
    data = objects(16)
    assert stage_damaged_once(tmp_path, data, "d/005.bin", 4) == (1, 1, len(data), data, 2)


def test_a_small_object_damaged_on_every_try_fails_the_stage_and_keeps_the_rest(tmp_path, bodies):
    """The last try's verdict is the stage's error, one line; the objects verified before it stay staged and
    recorded, so a second run fetches only what is missing."""
    data = objects(8)
    st = DictStore(data)
    st.damage["d/002.bin"] = 2
    with pytest.raises(ApplianceError, match=r"could not fetch 'd/002.bin' after 2 tries \(checksum mismatch\)"):
        stage(st, "d/", tmp_path / "out", concurrency=4, retries=1)
    kept = json.loads((tmp_path / "out" / MANIFEST).read_text())
    assert sorted(kept) == sorted(n for n in data if n != "d/002.bin")
    res = stage(st, "d/", tmp_path / "out")
    assert res.files_fetched == 1 and res.files_skipped == 7
    assert {n: (tmp_path / "out" / n[2:]).read_bytes() for n in data} == data


@pytest.fixture
def hashers(monkeypatch):
    """The stage's Hasher, kept for the test, with the streams it was given."""
    made = []

    class Kept(md5lanes.Hasher):
        def __init__(self, *a, **kw):
            super().__init__(*a, **kw)
            self.sizes = []
            made.append(self)

        def streams(self, fd, groups, **kw):
            self.sizes += [sum(k for _, k in g) for g in groups]
            return super().streams(fd, groups, **kw)

    monkeypatch.setattr(sm, "Hasher", Kept)
    return made


def medium(n: int) -> dict[str, bytes]:
    """Objects over SMALL and under LARGE (a few MB: images, audio, shards)."""
    return {f"d/m{i:02d}.bin": os.urandom(sm.SMALL + 1 + i * 70_001) for i in range(n)}


def test_our_uploads_are_checked_by_crc_in_their_own_threads_and_a_larger_one_goes_to_the_hasher(tmp_path, bodies,
                                                                                                 hashers):
    """A CRC-32 (our uploads) costs a fifth of an MD5 and is taken as the bytes pass: neither lanes nor hasher. A
    small object another tool put goes to the bodies (a copy, 8 in a call); one over SMALL, whose copy would cost
    more memory than the lanes save, to the hasher (read from the page cache, as a large object's)."""
    data = {"d/big.bin": os.urandom(sm.SMALL + 1), "d/ours.bin": os.urandom(5000), "d/other.bin": os.urandom(5000),
            "d/ours-big.bin": os.urandom(sm.SMALL + 7)}
    st = DictStore(data)
    for name in ("d/ours.bin", "d/ours-big.bin"):
        b = data[name]
        st.meta[name] = {f"x-object-meta-{CRC_META}": crc_meta(zlib.crc32(b), hashlib.md5(b).hexdigest())}
    res = stage(st, "d/", tmp_path / "out", concurrency=4)
    assert res.files_fetched == 4 and res.corrupt_refetched == 0
    assert {n: (tmp_path / "out" / n[2:]).read_bytes() for n in data} == data
    assert sum(k * v for k, v in bodies[0].batches.items()) == 1  # d/other.bin only
    assert hashers[0].sizes == [sm.SMALL + 1]  # d/big.bin only


def test_objects_of_a_few_mb_are_hashed_in_the_lanes_while_their_threads_fetch_on(tmp_path, bodies, hashers,
                                                                                  monkeypatch):
    """An object over SMALL and under LARGE was hashed by hashlib in its GET's thread: one core's MD5 (0.65 GB/s
    here; the lanes take 8 streams at 3.2 GB/s). The hasher takes it now, and its thread goes on to the next object
    as soon as the bytes are written; the verdict places it later. Here no hashing call may start before every GET
    has returned: 12 objects through 3 threads, so a thread that waited for its object's verdict would wait for
    ever (here: until the test gives up and lets hashing start, then fails)."""
    data = medium(12)
    st = DictStore(data)
    let_hash, all_got = threading.Event(), []
    real = md5lanes._hash

    def gated(batch):
        let_hash.wait(30)
        return real(batch)

    def watch():
        all_got.append(all(st.got[n].wait(30) for n in data))
        let_hash.set()

    monkeypatch.setattr(md5lanes, "_hash", gated)
    watcher = threading.Thread(target=watch)
    watcher.start()
    try:
        res = stage(st, "d/", tmp_path / "out", concurrency=3)
    finally:
        let_hash.set()
        watcher.join()
    assert all_got == [True]
    assert res.files_fetched == 12 and res.corrupt_refetched == 0 and res.retries == 0
    assert {n: (tmp_path / "out" / n[2:]).read_bytes() for n in data} == data
    assert sorted(hashers[0].sizes) == sorted(len(b) for b in data.values())
    assert sum(hashers[0].batches.values()) and not hashers[0].errors
    assert set(json.loads((tmp_path / "out" / MANIFEST).read_text())) == set(data)
    assert not (tmp_path / "out" / ".appliance-staging").exists()


def test_an_object_of_a_few_mb_damaged_on_the_way_is_fetched_again_on_its_verdict(tmp_path, bodies, hashers):
    data = medium(6)
    assert stage_damaged_once(tmp_path, data, "d/m03.bin", 3) == (1, 1, len(data), data, 2)


def test_an_object_of_a_few_mb_damaged_on_every_try_fails_the_stage_and_keeps_the_rest(tmp_path, bodies, hashers):
    data = medium(4)
    st = DictStore(data)
    st.damage["d/m01.bin"] = 2
    with pytest.raises(ApplianceError, match=r"could not fetch 'd/m01.bin' after 2 tries \(checksum mismatch\)"):
        stage(st, "d/", tmp_path / "out", concurrency=2, retries=1)
    assert sorted(json.loads((tmp_path / "out" / MANIFEST).read_text())) == sorted(n for n in data if n != "d/m01.bin")
    res = stage(st, "d/", tmp_path / "out")
    assert res.files_fetched == 1 and res.files_skipped == 3
    assert {n: (tmp_path / "out" / n[2:]).read_bytes() for n in data} == data


def test_the_page_cache_room_is_memavailable_or_the_cgroups_less(tmp_path):
    """What decides whether a stage writes past the page cache: MemAvailable, or what the process's memory cgroup
    leaves (v2 memory.max - memory.current; v1 memory.limit_in_bytes - memory.usage_in_bytes), the less of them."""
    proc, cg = tmp_path / "proc", tmp_path / "cgroup"
    (proc / "self").mkdir(parents=True)
    (proc / "meminfo").write_text("MemTotal:       24000000 kB\nMemAvailable:   20000000 kB\n")
    (proc / "self" / "cgroup").write_text("0::/user.slice/job\n")
    assert sm.page_cache_room(proc, cg) == 20000000 * 1024  # no cgroup files there: the kernel's figure
    (cg / "user.slice" / "job").mkdir(parents=True)
    (cg / "user.slice" / "job" / "memory.max").write_text("max\n")
    (cg / "user.slice" / "job" / "memory.current").write_text("1000\n")
    assert sm.page_cache_room(proc, cg) == 20000000 * 1024  # no limit
    (cg / "user.slice" / "job" / "memory.max").write_text(f"{1 << 30}\n")
    assert sm.page_cache_room(proc, cg) == (1 << 30) - 1000
    (proc / "self" / "cgroup").write_text("4:memory:/process_api/x\n1:cpu:/\n")  # v1
    (cg / "memory" / "process_api" / "x").mkdir(parents=True)
    (cg / "memory" / "process_api" / "x" / "memory.limit_in_bytes").write_text("9223372036854771712\n")
    (cg / "memory" / "process_api" / "x" / "memory.usage_in_bytes").write_text("5\n")
    assert sm.page_cache_room(proc, cg) == 20000000 * 1024  # v1's "no limit"
    (cg / "memory" / "process_api" / "x" / "memory.limit_in_bytes").write_text(f"{2 << 30}\n")
    assert sm.page_cache_room(proc, cg) == (2 << 30) - 5
    assert sm.page_cache_room(tmp_path / "none", cg) is None
    assert sm.page_cache_room() is not None  # this machine's
    assert not sm.writes_past_the_page_cache(10 << 30, 24 << 30) and sm.writes_past_the_page_cache(13 << 30, 24 << 30)
    assert not sm.writes_past_the_page_cache(1 << 40, None)  # unknown: as before, through the page cache
