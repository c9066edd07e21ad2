"""md5x8 (appliance/store/_md5lanes.c, as built here) on one core: 8 streams of the hasher's CHUNK buffers, 1 GiB a
try, 7 tries; GB/s of CPU time. The speed the stager's MD5 check of other tools' objects runs at on this machine.

    .venv/bin/python bench/results/stage-paired/pieces/md5x8_speed.py
"""
import os
import statistics
import time

from appliance.store import _md5lanes
from appliance.store.md5lanes import _IV as IV, CHUNK

bufs = [os.urandom(CHUNK) for _ in range(8)]
total = 1 << 30
res = []
for _ in range(7):
    jobs = list(zip([bytearray(IV) for _ in range(8)], bufs))
    t = time.process_time()
    for _ in range(total // (CHUNK * 8)):
        _md5lanes.update(jobs)
    res.append(total / (time.process_time() - t) / 1e9)
print("md5x8 GB/s median %.2f" % statistics.median(res), [round(x, 2) for x in res])
