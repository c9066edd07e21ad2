"""The MD5 the stager checks other tools' objects by (their ETag): hashlib's, one stream per core, against the lanes
of appliance/store/_md5lanes.c (8 streams in one AVX2 register, 16 in two) on one core; then the stager itself on 8
x 256 MiB put by plain swiftclient (no CRC_META: checked by MD5), and on 8 put by boto3 as multipart uploads (checked
by their parts' MD5s), through S3 from one Ceph RGW on 127.0.0.1: the code before
the lanes (a worktree of BASE, MD5s in each GET's thread), the hasher with hashlib, the hasher with the lanes, in a
rotated order each round.

    python bench/md5_lanes.py BASE_WORKTREE [ROUNDS]     # default 6; e.g. git worktree add /tmp/wt-old f0881b5
Writes bench/results/md5/md5.{json,md}. BENCH_OBJECTS and BENCH_MIB change the 8 x 256 MiB.
"""

import hashlib
import os
import subprocess
import sys
import time
from pathlib import Path

from stage_usersys import OBJECTS, SIZE_MIB, rates_and_variants_report, stager_variants  # bench/ (this folder)

from appliance.store import md5lanes


def one_core_rates(total: int = 1 << 30, tries: int = 5) -> dict[str, float]:
    """GB/s of one core (CPU time, best of ``tries``) over ``total`` bytes: hashlib on one stream, and the lanes
    on 8 streams of CHUNK-sized buffers (what the hasher hands them)."""
    bufs = [memoryview(os.urandom(md5lanes.CHUNK)) for _ in range(16)]
    rates = {}
    best = float("inf")
    for _ in range(tries):
        h, t = hashlib.md5(), time.process_time()
        for _ in range(total // len(bufs[0])):
            h.update(bufs[0])
        best = min(best, time.process_time() - t)
    rates["hashlib (OpenSSL), 1 stream"] = total / best / 1e9
    if md5lanes._md5lanes is not None and md5lanes.LANES > 1:
        for width in (16, 8, 1):
            states = [bytearray(md5lanes._IV) for _ in range(width)]
            jobs = list(zip(states, bufs[:width]))
            best = float("inf")
            for _ in range(tries):
                t = time.process_time()
                for _ in range(total // (len(bufs[0]) * width)):
                    md5lanes._md5lanes.update(jobs)
                best = min(best, time.process_time() - t)
            rates[f"lanes, {width} stream{'s' if width > 1 else ''}"] = total / best / 1e9
    return rates


def main() -> None:
    base = Path(sys.argv[1])
    rounds = int(sys.argv[2]) if len(sys.argv) > 2 else 6
    commit = subprocess.run(["git", "-C", str(base), "rev-parse", "--short", "HEAD"], capture_output=True,
                            text=True, check=True).stdout.strip()
    rates = one_core_rates()
    print(rates, flush=True)
    variants = {f"before ({commit}): hashlib in each GET's thread": f"import sys; sys.path.insert(0, {str(base)!r})",
                "hasher, hashlib": "import appliance.store.md5lanes as m; m.LANES = 1",
                "hasher, lanes": "import appliance.store.md5lanes as m; assert m.LANES > 1"}
    out = {}
    for container, what in (("bplain", "plain objects (ETag: the MD5)"),
                            ("bmulti", "multipart objects (8 MiB parts: the parts' MD5s)")):
        runs = stager_variants(variants, rounds, Path("/var/tmp/appliance-md5"), container=container)
        out.update({f"{what}: {v}": rs for v, rs in runs.items()})
    rates_and_variants_report(
        "md5_lanes.py", "md5", "The stager's MD5: hashlib and the lanes",
        f"One core, {md5lanes.CHUNK >> 10} KiB buffers (the hasher's) hashed over 1 GiB, best of 5:", "MD5 by", rates,
        f"The stager, {OBJECTS} x {SIZE_MIB} MiB put by plain swiftclient, then {OBJECTS} x {SIZE_MIB} MiB put by "
        "boto3's upload_file at its defaults (`aws s3 cp`'s), through S3, one Ceph RGW on 127.0.0.1, concurrency 32; "
        f"medians of {rounds} rounds, in a rotated order:", "objects: MD5s", out)


if __name__ == "__main__":
    main()
