"""S3 multipart objects: what their ETag says, and the part sizes to check it with.

A multipart upload's ETag is ``MD5(MD5(part 1) + ... + MD5(part N))-N`` (binary MD5s): the MD5 of the bytes is
not in it, and checking it needs the size of every part. A store that answers ``partNumber`` (AWS, OpenStack
Swift's s3api, Ceph RGW from Reef on) says them (``Store.part_sizes``); Ceph RGW 16 (Pacific) ignores it and sends
the whole object. Then the part size is taken from the tools that upload: each picks its part size from the
file's size by a fixed rule, and the one whose parts give the object's ETag is right. A wrong guess cannot give
the ETag by chance (it is an MD5 over every byte), so trying several is safe; it only costs hashing the file
again, from the page cache, and only when the first guess is wrong.
"""

from __future__ import annotations

import hashlib
import re
from collections.abc import Iterable

from .objects import MAX_OBJECT

MiB = 1024**2
MIN_PART = 5 * MiB  # S3's smallest part (all but the last)
MAX_PARTS = 10_000  # S3's most parts in one upload
_MULTIPART = re.compile(r"^[0-9a-f]{32}-([1-9][0-9]*)$")


def part_count(etag: str) -> int | None:
    """N for a multipart ETag (``<md5>-N``), None for any other."""
    m = _MULTIPART.match(etag.strip('"'))
    return int(m.group(1)) if m else None


def multipart_etag(digests: Iterable[bytes]) -> str:
    """The ETag of a multipart upload whose parts have these (binary) MD5s."""
    ds = list(digests)
    return hashlib.md5(b"".join(ds)).hexdigest() + f"-{len(ds)}"


def layout(size: int, part: int) -> list[int]:
    """Part sizes of ``size`` bytes uploaded in parts of ``part`` bytes."""
    if size <= part:
        return [size]
    n = -(-size // part)
    return [part] * (n - 1) + [size - (n - 1) * part]


def _doubled(start: int, size: int) -> int:
    """``start``, doubled until ``size`` fits in MAX_PARTS parts."""
    p = start
    while -(-size // p) > MAX_PARTS:
        p *= 2
    return p


def s3transfer_part(chunk: int, size: int) -> int:
    """The part size boto3 (s3transfer) uploads ``size`` bytes in when asked for parts of ``chunk``: doubled while
    the file needs more than 10,000 parts, then held between 5 MiB and 5 GiB (boto/s3transfer s3transfer/utils.py
    ChunksizeAdjuster; a test holds it to the installed s3transfer)."""
    return min(MAX_OBJECT, max(MIN_PART, _doubled(chunk, size)))


def _multiple(size: int, unit: int) -> int:
    """The smallest multiple of ``unit`` that holds ``size`` in MAX_PARTS parts."""
    return max(unit, -(-(-(-size // MAX_PARTS)) // unit) * unit)


def guesses(size: int, n: int) -> list[int]:
    """Part sizes the common upload tools would have used for an object of ``size`` bytes in ``n`` parts, most
    used first; only those that give exactly ``n`` parts (one part: the object's size)."""
    if n == 1:
        return [size]
    rules = [
        # s3transfer (boto3, `aws s3 cp`): multipart_chunksize 8 MiB, doubled while the file needs more than
        # 10,000 parts (boto/s3transfer s3transfer/utils.py ChunksizeAdjuster, manager.py TransferConfig)
        s3transfer_part(8 * MiB, size),
        # s5cmd: --part-size 50 MiB (peak/s5cmd command/cp.go; `s5cmd cp --help`)
        50 * MiB,
        # rclone: --s3-chunk-size 5 MiB, grown for files over 10,000 chunks (`rclone help flags`)
        _doubled(5 * MiB, size), max(5 * MiB, -(-(-(-size // MAX_PARTS)) // MiB) * MiB),
        # minio-go (mc): the smallest multiple of its minPartSize (16 MiB in v7; 64 and 5 MiB before) that fits
        # 10,000 parts (minio/minio-go api-put-object-common.go optimalPartInfo)
        _multiple(size, 16 * MiB), _multiple(size, 64 * MiB), _multiple(size, 5 * MiB),
        # appliance: `data upload` (5 GiB parts) and checkpoints (128 MiB, or size/1000: store/checkpoints.py)
        MAX_OBJECT, max(128 * MiB, -(-size // 1000)),
        # the size split evenly, rounded up to a MiB
        -(-(-(-size // n)) // MiB) * MiB,
    ]
    out: list[int] = []
    for p in rules:
        if p > 0 and max(1, -(-size // p)) == n and p not in out:
            out.append(p)
    return out
