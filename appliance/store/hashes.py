"""What the stores check bytes with: MD5s per part (the ETags Swift and S3 give a file in parts), a CRC-32 bound
to the ETag in the object's metadata, and a streamed slice of a file. hashlib and zlib-ng do the hashing."""

from __future__ import annotations

import base64
import functools
import hashlib
import os
import re
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from ..errors import ApplianceError
from .. import report

log = report.get(__name__)
try:  # zlib-ng's CRC-32: zlib's function (the same values), folded with PCLMULQDQ/VPCLMULQDQ where the CPU has them.
    # 9.9 GB/s on one core here against zlib's 3.5 (bench/crc_speed.py of ac0d90f, in git; 14.8 and 2.8 in another run). It lets go
    # of the GIL as zlib does.
    from zlib_ng.zlib_ng import crc32 as _crc32
except ImportError:  # not in the lock's venv (a node set up by hand): zlib's, slower, same values
    from zlib import crc32 as _crc32

EMPTY_MD5 = "d41d8cd98f00b204e9800998ecf8427e"  # Ceph RGW lists an SLO with this hash and the manifest's length
# The object's CRC-32, in its user metadata, for the stager to check its bytes with instead of an MD5 (15x the
# speed: 9.9 GB/s against 0.65 here with zlib-ng, 3.5 with zlib; and ranges combine: crc32_combine). Written by our
# uploads from the same read of the file that gave the MD5s the store's ETag is checked against, and bound to that
# ETag: "<crc32 hex> <etag>..." (a file in parts: the ETags either API lists it with). A stager trusts it only while
# the object's ETag is that one, so bytes that changed after the hashing (a file rewritten during its upload; an
# object replaced, metadata copied) are checked by their MD5 as before. Swift's X-Object-Meta-* and S3's
# x-amz-meta-* are one set of metadata in Ceph RGW and in Swift's s3api.
CRC_META = "appliance-crc32"

def _b64(md5_hex: str) -> str:
    """An MD5 as the Content-MD5 header carries it."""
    return base64.b64encode(bytes.fromhex(md5_hex)).decode()


def _damaged(what: str, want: str, got: str | None) -> ApplianceError:
    """An upload whose bytes at the store are not the file's (damaged on the way, or the file changed after it was
    hashed): retried by the checkpoint uploader, one line for `data upload`."""
    return ApplianceError(
        f"{what} did not arrive as the file's bytes: the store "
        + (f"made ETag {got.strip(chr(34))} of them, the file's is {want}" if got else
           f"refused them, as they did not match the file's MD5 {want}; it keeps what it held"),
        "upload it again; a file must not change while it is being uploaded")


def _crc_header(prefix: str, md5s: dict | None, etag: str | None) -> dict:
    """The CRC_META header (``prefix``: Swift's X-Object-Meta-; boto3's Metadata takes the bare key) for an upload
    whose store ETag will be ``etag`` (and, for a file in parts, its ETag through the other API), when ``md5s``
    (large_object_etags) has the content's CRC-32."""
    if not md5s or md5s.get("crc32") is None or not etag:
        return {}
    # OpenStack Swift's s3api shows an SLO not uploaded through S3 with its ETag and "-N"
    # (swift/common/middleware/s3api/s3response.py)
    others = [md5s[k] for k in ("swift", "s3") if md5s.get(k)] + ([md5s["swift"] + "-N"] if md5s.get("swift") else [])
    return {prefix + CRC_META: crc_meta(md5s["crc32"], etag, *[e for e in others if e != etag])}


class _Slice:
    """At most ``n`` bytes of an open file from where it stands, read in chunks (a segment streamed, never held in
    memory); seekable within them (botocore reads an S3 part once to sign its SHA-256 over http, then rewinds)."""

    def __init__(self, fh, n: int):
        self.fh, self.left, self.n, self.start = fh, n, n, fh.tell()

    def seek(self, pos: int, whence: int = 0) -> int:
        pos = max(0, min(self.n, pos + (0, self.n - self.left, self.n)[whence]))
        self.fh.seek(self.start + pos)
        self.left = self.n - pos
        return pos

    def tell(self) -> int:
        return self.n - self.left

    def read(self, size: int = -1) -> bytes:  # a file's read(): the rest when no size is given
        if self.left <= 0:
            return b""
        data = self.fh.read(min(size if size is not None and size >= 0 else self.left, self.left))
        self.left -= len(data)
        return data


HASH_THREADS = max(1, min(8, os.cpu_count() or 1))  # hashlib lets go of the GIL: parts hash on every core


def large_object_etags(p: Path, part_size: int, *, whole: bool = True) -> dict:
    """What a store reports for a file uploaded in parts of ``part_size``: ``md5`` of the content, and for a file
    larger than one part ``parts`` (each part's MD5), ``swift`` (a Static Large Object's ETag: the MD5 of its
    segments' hex MD5s, concatenated; swift/common/middleware/slo.py) and ``s3`` (a multipart upload's ETag: the
    MD5 of the parts' binary MD5s, then "-" and the part count). The parts are hashed in parallel with hashlib, a
    part per thread on every core (positioned reads of the page cache). An MD5 cannot be split, so the whole file's
    is one more pass, in order, beside them; ``whole=False`` leaves it out of a file in parts (the parts' MD5s cover
    every byte). ``crc32``: the content's CRC-32, from the same reads as the parts' MD5s (CRC_META)."""
    fd = os.open(p, os.O_RDONLY)
    try:
        size = os.fstat(fd).st_size
        if size <= part_size:
            crc = Crc32()
            one = md5_range(fd, 0, size, crc=crc)
            return {"md5": one.hexdigest(), "parts": [one.hexdigest()] if size else [], "crc32": crc.value}
        ranges = [(a, min(part_size, size - a)) for a in range(0, size, part_size)]
        crcs = [Crc32() for _ in ranges]
        with ThreadPoolExecutor(min(HASH_THREADS, len(ranges) + whole)) as pool:
            full = pool.submit(md5_range, fd, 0, size) if whole else None
            digests = list(pool.map(lambda r, c: md5_range(fd, r[0], r[1], crc=c).digest(), ranges, crcs))
            out = {"md5": full.result().hexdigest()} if full is not None else {}
    finally:
        os.close(fd)
    crc = 0
    for c in crcs:
        crc = crc32_combine(crc, c.value, c.size)
    return {**out, "parts": [d.hex() for d in digests], "crc32": crc,
            "swift": hashlib.md5("".join(d.hex() for d in digests).encode()).hexdigest(),
            "s3": hashlib.md5(b"".join(digests)).hexdigest() + f"-{len(digests)}"}


def parts_match(p: Path, part_size: int, parts: list[str]) -> bool:
    """Whether the file's parts of ``part_size`` have these MD5s (a manifest's record of a file in parts)."""
    got = large_object_etags(p, part_size, whole=False)
    return got["parts"] == list(parts)


def segmented(headers: dict) -> bool:
    """An answer whose body is a Swift large object's segments joined (an SLO or a DLO): its ETag is not the MD5 of
    the body, and the segments' MD5s check it (SwiftStore.slo_segments)."""
    return str(headers.get("x-static-large-object", "")).lower() == "true" or bool(headers.get("x-object-manifest"))


def slo_etag(segments: list[dict]) -> str:
    """An SLO's ETag, from its segments: the MD5 of their MD5s (hex) joined (Swift and Ceph RGW alike)."""
    return hashlib.md5("".join(s["hash"] for s in segments).encode()).hexdigest()


def md5_range(fd: int, start: int, n: int, h=None, crc: Crc32 | None = None):
    """Feed bytes start..start+n of the open file ``fd`` to ``h`` (a new MD5 if None), and to ``crc`` if given,
    and return ``h``: one reused 4 MiB buffer, positioned reads (threads may share the fd). Raises OSError if the
    file is shorter."""
    h = hashlib.md5() if h is None else h
    buf = memoryview(bytearray(min(max(n, 1), 4 << 20)))
    pos, end = start, start + n
    while pos < end:
        k = os.preadv(fd, [buf[:min(len(buf), end - pos)]], pos)
        if not k:
            raise OSError(f"the file ends at byte {pos}, before {end}")
        h.update(buf[:k])
        if crc is not None:
            crc.update(buf[:k])
        pos += k
    return h


class Crc32:
    """zlib's CRC-32 (the one of gzip and S3's x-amz-checksum-crc32) with hashlib's ``update``, computed by
    zlib-ng (``_crc32``). Both let go of the GIL for all but small buffers, as hashlib does."""

    def __init__(self):
        self.value, self.size = 0, 0

    def update(self, data) -> None:
        self.value = _crc32(data, self.value)
        self.size += len(data)


def _gf2_times(mat: tuple[int, ...], vec: int) -> int:
    out, i = 0, 0
    while vec:
        if vec & 1:
            out ^= mat[i]
        vec >>= 1
        i += 1
    return out


@functools.lru_cache(maxsize=64)
def _zeros_operator(n: int) -> tuple[int, ...]:
    """The 32x32 GF(2) matrix that turns the CRC of A into the CRC of A followed by ``n`` zero bytes (zlib's
    crc32_combine, zlib/crc32.c: the operator for one zero bit, squared up to n's bits). Cached: the stager's
    ranges have a few lengths."""
    one_bit = (0xEDB88320,) + tuple(1 << k for k in range(31))
    op = tuple(_gf2_times(one_bit, one_bit[k]) for k in range(32))  # 2 zero bits
    op = tuple(_gf2_times(op, op[k]) for k in range(32))  # 4
    op = tuple(_gf2_times(op, op[k]) for k in range(32))  # 8: one zero byte
    out = None
    while n:
        if n & 1:
            out = op if out is None else tuple(_gf2_times(op, out[k]) for k in range(32))
        n >>= 1
        if n:
            op = tuple(_gf2_times(op, op[k]) for k in range(32))
    return out


def crc32_combine(crc1: int, crc2: int, len2: int) -> int:
    """The CRC-32 of A + B from CRC(A), CRC(B) and B's length (zlib's crc32_combine; Python's zlib has none)."""
    if len2 <= 0:
        return crc1
    return _gf2_times(_zeros_operator(len2), crc1) ^ crc2


def crc_meta(crc: int, *etags: str) -> str:
    """The CRC_META value for content of this CRC-32 that the store will list with one of ``etags``."""
    return " ".join([f"{crc:08x}", *(e.strip('"') for e in etags if e)])


def crc_from(headers: dict, etag: str) -> int | None:
    """The CRC-32 an object's headers (lower-case names; Swift's or S3's) carry in CRC_META, when it was written
    for ``etag`` (the listing's: the size staged is the listing's too); None when there is none, it is malformed,
    or it was written for other bytes. It may name several ETags: a file in parts is listed with its SLO ETag
    through the Swift API and its multipart ETag through S3 (OpenStack Swift's s3api), both made of the same parts'
    MD5s."""
    words = str(headers.get(f"x-object-meta-{CRC_META}") or headers.get(f"x-amz-meta-{CRC_META}") or "").split()
    if len(words) < 2 or not re.fullmatch(r"[0-9a-f]{8}", words[0]):
        return None
    return int(words[0], 16) if etag and etag.strip('"') in words[1:] else None


def md5_file(p: Path) -> str:
    fd = os.open(p, os.O_RDONLY)
    try:
        return md5_range(fd, 0, os.fstat(fd).st_size).hexdigest()
    finally:
        os.close(fd)
