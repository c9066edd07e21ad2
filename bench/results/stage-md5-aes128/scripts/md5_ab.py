"""md5x8 before and after, side by side on one core: 8 streams of 256 KiB buffers (the hasher's CHUNK), 1 GiB a try,
7 tries each in turn; GB/s of CPU time. Each directory holds a _md5lanes .so built from one commit's source:

    mkdir -p /tmp/md5ab/old /tmp/md5ab/new
    git show 333f573:appliance/store/_md5lanes.c > /tmp/md5ab/old/_md5lanes.c; cp appliance/store/_md5lanes.c /tmp/md5ab/new/
    for v in old new; do gcc -O3 -shared -fPIC $(python3.11-config --includes) \
        -o /tmp/md5ab/$v/_md5lanes.cpython-311-x86_64-linux-gnu.so /tmp/md5ab/$v/_md5lanes.c; done
    .venv/bin/python bench/results/stage-md5-aes128/scripts/md5_ab.py
"""
import importlib.util, os, time

from appliance.store.md5lanes import _IV as IV, CHUNK  # MD5's initial state and the hasher's buffer, as the stager
def load(d):
    spec = importlib.util.spec_from_file_location("_md5lanes", [os.path.join(d, f) for f in os.listdir(d) if f.endswith(".so")][0])
    m = importlib.util.module_from_spec(spec); spec.loader.exec_module(m); return m
mods = {v: load(f"/tmp/md5ab/{v}") for v in ("old", "new")}
bufs = [os.urandom(CHUNK) for _ in range(8)]
# correctness: one block-aligned buffer each, compare states
for v, m in mods.items():
    st = [bytearray(IV) for _ in range(8)]; m.update(list(zip(st, bufs)))
    print(v, "states", [bytes(s).hex()[:8] for s in st][:3])
total = 1 << 30
res = {v: [] for v in mods}
for r in range(7):
    for v, m in mods.items():
        st = [bytearray(IV) for _ in range(8)]; jobs = list(zip(st, bufs))
        t = time.process_time()
        for _ in range(total // (len(bufs[0]) * 8)): m.update(jobs)
        res[v].append(total / (time.process_time() - t) / 1e9)
for v in res: print(v, "GB/s best %.2f median %.2f" % (max(res[v]), sorted(res[v])[3]), [round(x, 2) for x in res[v]])
