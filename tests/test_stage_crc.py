"""Objects our uploads wrote carry their CRC-32 in user metadata, bound to their ETag (store/hashes.py CRC_META), and
the stager checks their bytes by it instead of by an MD5: 10-15 GB/s (zlib-ng) against 0.65 on this machine, and a
large object's ranges are checked as they arrive and combined, none read back. Fast tier, with the in-memory store
(tests/fakes.py); against the real Swift and Ceph RGW in test_stage.py::test_our_uploads_are_checked_by_crc."""

import hashlib
import os
import random
import types
import zlib

import pytest

import appliance.node.fetch as sm
from appliance.errors import ApplianceError
from appliance.node.stage import stage
import appliance.store.objects as objects
from appliance.store.objects import CRC_META, Crc32, crc32_combine, crc_from, crc_meta, large_object_etags
from fakes import DictStore


def test_crc32_combine_is_the_crc_of_the_two_together():
    rnd = random.Random(7)
    for _ in range(300):
        a = rnd.randbytes(rnd.randrange(0, 3000))
        b = rnd.randbytes(rnd.choice([0, 1, 2, 3, 8, rnd.randrange(0, 70000)]))
        assert crc32_combine(zlib.crc32(a), zlib.crc32(b), len(b)) == zlib.crc32(a + b), (len(a), len(b))


def test_the_crc_is_zlib_ngs_and_gives_zlibs_values():
    """The lock installs zlib-ng, 3-5x zlib's CRC-32 here (bench/crc_speed.py of ac0d90f, in git), and the values must be zlib's:
    objects uploaded with one are checked with the other (a node without zlib-ng falls back to zlib)."""
    assert objects._crc32.__module__.startswith("zlib_ng"), objects._crc32.__module__
    rnd = random.Random(3)
    data = rnd.randbytes(3 << 20)
    for _ in range(200):  # odd lengths, odd starts (unaligned for the folding), chained as the stager chains
        a = rnd.randrange(0, len(data))
        b = min(len(data), a + rnd.choice([0, 1, 15, 16, 63, 64, 65, 4095, rnd.randrange(0, 1 << 20)]))
        c = Crc32()
        c.update(memoryview(data)[a:b])
        c.update(data[b:b + 100])
        assert c.value == zlib.crc32(data[a:b + 100]), (a, b)


@pytest.mark.parametrize("size", [0, 1, 1023, 1024, 1025, 5000])
def test_an_uploads_crc_comes_from_the_reads_of_its_md5s(tmp_path, size):
    data = os.urandom(size)
    f = tmp_path / "f"
    f.write_bytes(data)
    for whole in (True, False):
        assert large_object_etags(f, 1024, whole=whole)["crc32"] == zlib.crc32(data)


def test_the_crc_is_trusted_only_for_the_etag_it_was_written_for():
    etag = "0123456789abcdef0123456789abcdef"
    v = crc_meta(0xDEADBEEF, f'"{etag}"')
    assert v == f"deadbeef {etag}"
    assert crc_from({f"x-object-meta-{CRC_META}": v}, etag) == 0xDEADBEEF  # Swift's name for it
    assert crc_from({f"x-amz-meta-{CRC_META}": v}, f'"{etag}"') == 0xDEADBEEF  # S3's
    assert crc_from({f"x-amz-meta-{CRC_META}": v}, "f" * 32) is None  # written for other bytes
    both = crc_meta(7, "a" * 32, "b" * 32 + "-3")  # a file in parts: its SLO and its multipart ETag
    assert crc_from({f"x-amz-meta-{CRC_META}": both}, "b" * 32 + "-3") == crc_from({f"x-amz-meta-{CRC_META}": both}, "a" * 32) == 7
    for bad in ("deadbeef", "xyz12345 " + etag, "", " ", "deadbee " + etag, "DEADBEEF " + etag):
        assert crc_from({f"x-amz-meta-{CRC_META}": bad}, etag) is None
    assert crc_from({}, etag) is None


def uploaded(objects: dict[str, bytes]) -> DictStore:
    """A store holding ``objects`` as our uploads leave them: each with its CRC_META."""
    st = DictStore(objects)
    for name, data in objects.items():
        st.meta[name] = {f"x-object-meta-{CRC_META}": crc_meta(zlib.crc32(data), hashlib.md5(data).hexdigest())}
    return st


@pytest.fixture
def md5s(monkeypatch):
    """How many MD5s the stager starts (hashlib's)."""
    made = []

    def md5(*a):
        made.append(1)
        return hashlib.md5(*a)

    monkeypatch.setattr(sm, "hashlib", types.SimpleNamespace(md5=md5, sha256=hashlib.sha256))
    return made


@pytest.fixture
def small_ranges(monkeypatch):
    """Large objects from 64 KiB, fetched as 16 KiB ranges: the ranged path with small data."""
    monkeypatch.setattr(sm, "LARGE", 64 << 10)
    monkeypatch.setattr(sm, "RANGE", 16 << 10)
    monkeypatch.setattr(sm, "MAX_RANGE", 32 << 10)


DATA = {"d/small.bin": os.urandom(5000), "d/big.bin": os.urandom((200 << 10) + 17)}


def test_our_uploads_are_checked_by_their_crc_not_an_md5(tmp_path, md5s, small_ranges):
    st = uploaded(DATA)
    res = stage(st, "d/", tmp_path / "d", concurrency=4)
    assert res.files_fetched == 2 and res.corrupt_refetched == 0 and res.size_only == []
    assert {n: (tmp_path / "d" / n[2:]).read_bytes() for n in DATA} == DATA
    assert md5s == []  # before: an MD5 of every byte
    assert sum(1 for g in st.gets if g[0] == "d/big.bin") == 13  # ranges, each checked as it arrives
    assert st.heads == ["d/big.bin"]  # a large object's CRC is asked before its ranges; a small one's comes with it


def test_a_damaged_byte_fails_the_crc_and_is_fetched_again(tmp_path, md5s, small_ranges):
    st = uploaded(DATA)
    st.damage = {"d/small.bin": 1, "d/big.bin": 1}
    res = stage(st, "d/", tmp_path / "d", concurrency=4)
    assert res.corrupt_refetched == 2 and res.files_fetched == 2
    assert {n: (tmp_path / "d" / n[2:]).read_bytes() for n in DATA} == DATA
    assert md5s == []


def test_a_crc_written_for_other_bytes_is_not_used(tmp_path, md5s, small_ranges):
    """An object replaced with its old metadata kept: its CRC_META names the old ETag, so the bytes are checked by
    their MD5 against the store's ETag, as any other object's."""
    st = uploaded(DATA)
    old = {n: os.urandom(len(d)) for n, d in DATA.items()}
    for name, data in old.items():
        st.meta[name] = {f"x-object-meta-{CRC_META}": crc_meta(zlib.crc32(data), hashlib.md5(data).hexdigest())}
    res = stage(st, "d/", tmp_path / "d", concurrency=4)
    assert res.files_fetched == 2 and res.corrupt_refetched == 0
    assert {n: (tmp_path / "d" / n[2:]).read_bytes() for n in DATA} == DATA
    assert len(md5s) >= 2


def test_a_crc_that_does_not_match_its_own_etags_bytes_fails_loudly(tmp_path, small_ranges):
    """Metadata edited by hand to a wrong CRC for the current ETag: never staged as a success."""
    st = uploaded({"d/small.bin": DATA["d/small.bin"]})
    st.meta["d/small.bin"] = {f"x-object-meta-{CRC_META}": crc_meta(1, hashlib.md5(DATA["d/small.bin"]).hexdigest())}
    with pytest.raises(ApplianceError, match="checksum mismatch"):
        stage(st, "d/", tmp_path / "d", retries=1)
    assert not (tmp_path / "d" / "small.bin").exists()
