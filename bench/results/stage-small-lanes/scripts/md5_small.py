"""CPU per 100 KB body: hashlib's MD5 against the lanes (store/md5lanes.py) with 1, 2, 4 and 8 bodies per call.
Run: .venv/bin/python bench/results/stage-small-lanes/scripts/md5_small.py (process time, 600 calls, best of 3)."""
import hashlib
import os
import time

from appliance.store import md5lanes as m

bodies = [memoryview(bytearray(os.urandom(100 * 1024))) for _ in range(8)]
N = 600


def best(fn, per):
    out = []
    for _ in range(3):
        t = time.process_time()
        for _ in range(N):
            fn()
        out.append((time.process_time() - t) / N / per * 1e6)
    return min(out)


print(f"hashlib: {best(lambda: hashlib.md5(bodies[0]).digest(), 1):.1f} us per body")
for k in (1, 2, 4, 8):
    def lanes(k=k):
        sts = [m._State(True) for _ in range(k)]
        m._hash([(s, b, len(b)) for s, b in zip(sts, bodies[:k])])
    print(f"lanes, {k} per call: {best(lanes, k):.1f} us per body")
