"""The CRC-32 the stager checks our uploads' objects with (CRC_META, appliance/store/objects.py): zlib's against
zlib-ng's (the same function and values, folded with carry-less multiplies), and MD5 beside them, on one core; then
the stager itself with each (user and system time of `appliance.node.stage_main` fetching 8 x 256 MiB put by our
upload, through S3 from one Ceph RGW on 127.0.0.1, the two in a rotated order each round).

    python bench/crc_speed.py [ROUNDS]     # default 6
Writes bench/results/crc/crc.{json,md}. BENCH_OBJECTS and BENCH_MIB change the 8 x 256 MiB.
"""

import hashlib
import os
import sys
import time
import zlib
from pathlib import Path

from stage_usersys import OBJECTS, SIZE_MIB, rates_and_variants_report, stager_variants  # bench/ (this folder)

from zlib_ng import zlib_ng


def one_core_rate(update, buf: memoryview, total: int = 1 << 30, tries: int = 5) -> float:
    """GB/s of ``update(buf)`` over ``total`` bytes, best of ``tries`` (CPU time): the buffer is the stager's
    receive buffer's size, so it is read from the cache, as the stager's is."""
    best = float("inf")
    for _ in range(tries):
        t = time.process_time()
        for _ in range(total // len(buf)):
            update(buf)
        best = min(best, time.process_time() - t)
    return total / best / 1e9


def main() -> None:
    rounds = int(sys.argv[1]) if len(sys.argv) > 1 else 6
    from appliance.store.httpget import BUF

    buf = memoryview(os.urandom(BUF))
    assert zlib.crc32(buf) == zlib_ng.crc32(buf)
    state = {"zlib": 0, "zlib-ng": 0}

    def crc(name, f):
        def update(b):
            state[name] = f(b, state[name])
        return update

    rates = {"zlib crc32": one_core_rate(crc("zlib", zlib.crc32), buf),
             "zlib-ng crc32": one_core_rate(crc("zlib-ng", zlib_ng.crc32), buf),
             "md5 (hashlib, OpenSSL)": one_core_rate(hashlib.md5().update, buf)}
    print(rates, flush=True)
    variants = {"zlib": "import zlib, appliance.store.objects as o; o._crc32 = zlib.crc32",
                "zlib-ng": "import appliance.store.objects as o; assert 'zlib_ng' in o._crc32.__module__"}
    out = stager_variants(variants, rounds, Path("/var/tmp/appliance-crc"))
    rates_and_variants_report(
        "crc_speed.py", "crc", "The stager's CRC-32: zlib and zlib-ng",
        f"One core, a {BUF >> 10} KiB buffer (the stager's) hashed over 1 GiB, best of 5:", "function", rates,
        f"The stager, {OBJECTS} x {SIZE_MIB} MiB put by our upload (checked by CRC-32), through S3, one Ceph RGW on "
        f"127.0.0.1, concurrency 32; medians of {rounds} rounds, the two in a rotated order:", "CRC-32 by", out)


if __name__ == "__main__":
    main()
