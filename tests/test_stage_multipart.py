"""S3 multipart objects (ETag `<md5>-N`) are verified by their parts' MD5s, in the fast tier with an in-memory
store (tests/fakes.py). Before, the stager checked only their size and counted them as verified: a byte damaged on
the way was staged and reported as a success. The same runs against a real Swift (which answers partNumber) and a
real Ceph RGW 16 (which does not) in test_stage.py::test_s3_multipart_objects_are_verified."""

import hashlib
import os

import pytest

from appliance.node.fetch import MAX_RANGE, _gets, _split
from appliance.node.stage import stage
from appliance.store.parts import MiB, guesses, layout, multipart_etag, part_count
from fakes import DictStore


def mp_etag(data: bytes, part: int) -> str:
    return multipart_etag(hashlib.md5(data[a:a + part]).digest() for a in range(0, len(data), part))


DATA = os.urandom(20 * MiB + 123)


def test_etag_and_rules():
    assert part_count('"' + "a" * 32 + '-3"') == 3 and part_count("a" * 32) is None and part_count("x-3") is None
    assert layout(20 * MiB + 123, 8 * MiB) == [8 * MiB, 8 * MiB, 4 * MiB + 123]
    assert guesses(20 * MiB + 123, 3) == [8 * MiB, 7 * MiB]  # s3transfer's 8 MiB, then the even split
    assert guesses(256 * MiB, 32) == [8 * MiB]
    # s3transfer doubles its 8 MiB until the file fits in 10,000 parts (ChunksizeAdjuster): 100 GiB in 16 MiB
    assert guesses(100 * 1024**3, 6400)[0] == 16 * MiB
    assert guesses(123, 1) == [123] and layout(0, 0) == [0]


@pytest.mark.parametrize("part", [8 * MiB, 7 * MiB])
def test_a_multipart_object_is_verified_by_its_parts(tmp_path, part):
    st = DictStore({"d/big.bin": DATA}, etags={"d/big.bin": mp_etag(DATA, part)})
    res = stage(st, "d/", tmp_path / "out")
    assert (tmp_path / "out" / "big.bin").read_bytes() == DATA
    assert res.size_only == [] and res.corrupt_refetched == 0 and res.files_fetched == 1
    # the 3 parts of the first rule share one GET (up to MAX_RANGE bytes), each part's MD5 taken as its bytes pass
    assert len([g for g in st.gets if g[0] == "d/big.bin"]) == 1


def test_small_groups_share_gets_and_a_large_one_is_ranges():
    """8 MiB parts of a 256 MiB object were 32 GETs of a part each: they are 8 GETs of 32 MiB (MAX_RANGE), or one
    of the whole object where ``one_get`` allows; a group above ``one_get`` is still RANGE-sized GETs, and a GET's
    bytes reach each group's stream in order, split at the groups' edges."""
    each, gets = _gets([8 * MiB] * 32, MAX_RANGE)
    assert each == [[(a, 8 * MiB)] for a in range(0, 256 * MiB, 8 * MiB)]
    assert [(a, k) for a, k, _ in gets] == [(a, MAX_RANGE) for a in range(0, 256 * MiB, MAX_RANGE)]
    assert gets[1][2] == [(4, 0, 8 * MiB), (5, 0, 8 * MiB), (6, 0, 8 * MiB), (7, 0, 8 * MiB)]
    assert [(a, k) for a, k, _ in _gets([8 * MiB] * 32, 256 * MiB)[1]] == [(0, 256 * MiB)]
    each, gets = _gets([5, 0, 3, 100, 4], 10)  # 100 > one_get: RANGE pieces (here one, RANGE being 16 MiB)
    assert each == [[(0, 5)], [(5, 0)], [(5, 3)], [(8, 100)], [(108, 4)]]
    assert gets == [(0, 8, [(0, 0, 5), (2, 0, 3)]), (8, 100, [(3, 0, 100)]), (108, 4, [(4, 0, 4)])]

    import hashlib

    hashes = [hashlib.md5() for _ in range(4)]
    each = [[(0, 5)], [(5, 0)], [(5, 3)], [(8, 2), (10, 2)]]  # group 3 in two pieces: hashed from the file later
    sink = _split(hashes, each, [(0, 0, 5), (1, 0, 0), (2, 0, 3), (3, 0, 2)])
    for chunk in (b"abc", b"defg", b"hij", b"past the end"):
        sink(memoryview(chunk))
    assert [h.digest() for h in hashes] == [hashlib.md5(b) .digest() for b in (b"abcde", b"", b"fgh", b"")]


@pytest.mark.parametrize("told", [False, True])
def test_a_damaged_multipart_transfer_is_fetched_again(tmp_path, told):
    st = DictStore({"d/big.bin": DATA}, etags={"d/big.bin": mp_etag(DATA, 8 * MiB)},
                   parts={"d/big.bin": layout(len(DATA), 8 * MiB)} if told else None)
    st.damage["d/big.bin"] = 1
    res = stage(st, "d/", tmp_path / "out")
    assert (tmp_path / "out" / "big.bin").read_bytes() == DATA
    assert res.corrupt_refetched == 1 and res.size_only == []


def test_parts_of_a_size_no_rule_gives(tmp_path):
    """6.5 MiB parts: the store says them (Swift, AWS, RGW from Reef on) and the object is verified; a store that
    does not (RGW 16) leaves it checked by size only, said so, after a second fetch gave the same bytes."""
    part = 6 * MiB + MiB // 2
    etag = mp_etag(DATA, part)
    st = DictStore({"d/big.bin": DATA}, etags={"d/big.bin": etag}, parts={"d/big.bin": layout(len(DATA), part)})
    res = stage(st, "d/", tmp_path / "a")
    assert res.size_only == [] and (tmp_path / "a" / "big.bin").read_bytes() == DATA
    st = DictStore({"d/big.bin": DATA}, etags={"d/big.bin": etag})
    res = stage(st, "d/", tmp_path / "b")
    assert res.size_only == ["d/big.bin"] and res.corrupt_refetched == 0
    assert (tmp_path / "b" / "big.bin").read_bytes() == DATA
    # damaged the first time: the two fetches differ, a third agrees with the second
    st = DictStore({"d/big.bin": DATA}, etags={"d/big.bin": etag})
    st.damage["d/big.bin"] = 1
    res = stage(st, "d/", tmp_path / "c")
    assert res.size_only == ["d/big.bin"] and res.corrupt_refetched == 1
    assert (tmp_path / "c" / "big.bin").read_bytes() == DATA


def test_wrong_bytes_under_the_stores_own_part_sizes_are_never_staged(tmp_path):
    bad = bytearray(DATA)
    bad[5] ^= 1
    st = DictStore({"d/big.bin": bytes(bad)}, etags={"d/big.bin": mp_etag(DATA, 8 * MiB)},
                   parts={"d/big.bin": layout(len(DATA), 8 * MiB)})
    with pytest.raises(Exception, match="checksum mismatch"):
        stage(st, "d/", tmp_path / "out", retries=1)
    assert not (tmp_path / "out" / "big.bin").exists()


def test_s3transfers_part_size_is_the_installed_s3transfers():
    """The rule `data upload` re-runs and the stager's first guess use, held to boto3's own ChunksizeAdjuster:
    a file of 60 GB in 5 MiB parts would need 11,444; s3transfer doubles to 10 MiB, and a re-run that expected 5
    MiB parts sent the whole file again."""
    from s3transfer.utils import ChunksizeAdjuster

    from appliance.store.parts import s3transfer_part

    adj = ChunksizeAdjuster()
    for chunk in (1, 5 * MiB, 8 * MiB, 64 * MiB, 5 * 1024**3, 6 * 1024**3):
        for size in (1, 5 * MiB, 60 * 10**9, 100 * 1024**3, 5 * 1024**4):
            assert s3transfer_part(chunk, size) == adj.adjust_chunksize(chunk, size), (chunk, size)
