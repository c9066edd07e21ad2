"""Our stager with its page-cache writes cut into pieces of CHUNK bytes, beside itself (512 KiB: a receive buffer
per pwrite) and s5cmd, on one Ceph RGW over https, into the bench's fresh ext4 (bench/nodedisk.py).

    python bench/results/stage-write-size/chunks.py ROUNDS CHUNK[,CHUNK...] [--code CHECKOUT] [--strace-s5cmd]

8 x 256 MiB put by boto3 in one PUT each (plain: their MD5 checks them) and 8 more as `appliance data upload`
puts them (ours: CRC-32), staged through S3 at 32 parallel transfers by `appliance.node.stage_main` from CHECKOUT
(default: this one) with its page-cache writes in pieces of CHUNK bytes (from 2026-11-28, heldio.WRITE_PIECE: one
C call per receive buffer, the GIL released once; in a checkout without it, httpget.pwrite_all replaced by a loop of
os.pwrite of CHUNK bytes each, the GIL released around each), and by s5cmd; in a rotated order each round, the page cache dropped before each
run. Prints each run and the medians (wall, CPU, user, system s). --strace-s5cmd first counts s5cmd's writes by
size; --warm G writes and frees G GiB of tmpfs before each run of the odd rounds.
"""

import argparse
import collections
import json
import os
import re
import shutil
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

HERE = Path(__file__).resolve()
ROOT = HERE.parents[3]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))

import stage_bench as sb  # noqa: E402
from nodedisk import node_disk  # noqa: E402
from appliance.localcloud.rgw_server import RGWServer  # noqa: E402
from appliance.store.objects import StoreCreds, SwiftStore  # noqa: E402

WRAP = """import os, sys
sys.modules.setdefault("keystoneclient", None)
from appliance.store import heldio, httpget
CH = int(os.environ["APPLIANCE_WRITE_CHUNK"])
def pwrite_all(fd, view, pos):
    for i in range(0, len(view), CH):
        v, d = view[i:i + CH], 0
        while d < len(v):
            d += os.pwrite(fd, v[d:], pos + i + d)
if hasattr(heldio, "WRITE_PIECE"):  # the stager's own pieces, one C call per buffer, the GIL released once
    heldio.WRITE_PIECE = CH
else:
    httpget.pwrite_all = pwrite_all
from appliance.node import stage_main
sys.exit(stage_main.main())
"""


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("rounds", type=int)
    ap.add_argument("chunks", help="comma-separated bytes; 0: the stager as it is")
    ap.add_argument("--code", default=str(ROOT))
    ap.add_argument("--strace-s5cmd", action="store_true")
    ap.add_argument("--warm", type=int, default=0, help="GiB of tmpfs written and freed before every other run "
                                                        "(odd rounds): this VM's memory backed by its host again")
    ap.add_argument("--datasets", default="plain,ours")
    ap.add_argument("--work", default="/var/tmp/appliance-write-size")
    args = ap.parse_args()
    work = Path(args.work)
    shutil.rmtree(work, ignore_errors=True)
    work.mkdir(parents=True)
    sw = RGWServer(work / "rgw", tls=True).start()
    os.environ.update(sb.ca_env(sw))
    try:
        c = sw.credentials()
        ak, sk = c["s3_access_key"], c["s3_secret_key"]
        for cont in ("plain", "ours"):
            SwiftStore(cont, StoreCreds(auth_url=sw.auth_url, user=sw.user, key=sw.key)).ensure_container()
        big = work / "big"
        big.write_bytes(os.urandom(256 << 20))
        from boto3.s3.transfer import TransferConfig

        ours = SwiftStore("ours", StoreCreds(auth_url=sw.auth_url, user=sw.user, key=sw.key))
        for i in range(8):
            sb.multipart_client(sw).upload_file(str(big), "plain", f"o{i}", Config=TransferConfig(
                multipart_threshold=5 << 30, multipart_chunksize=5 << 30))
            ours.put(f"o{i}", big)
        big.unlink()
        s3 = StoreCreds(s3_endpoint=sw.s3_endpoint, s3_access_key=ak, s3_secret_key=sk)
        env5 = {**os.environ, "AWS_ACCESS_KEY_ID": ak, "AWS_SECRET_ACCESS_KEY": sk, "AWS_DEFAULT_REGION": "us-east-1"}
        s5 = str(ROOT / "bench/.venv-tools/bin/s5cmd")
        chunks = [int(x) for x in args.chunks.split(",")]
        with node_disk(work, 5 << 30) as (root, what):
            print(f"destination: {what}", flush=True)

            def run(tool, cont, strace=None, warm=False):
                dest = tempfile.mkdtemp(dir=root)
                os.sync()
                Path("/proc/sys/vm/drop_caches").write_text("1")
                if warm:
                    subprocess.run(f"dd if=/dev/zero of=/dev/shm/appliance-warm bs=1M count={args.warm << 10} "
                                   "status=none; rm /dev/shm/appliance-warm", shell=True, check=True)
                if tool == "s5cmd":
                    cmd, env, stdin = [s5, "--endpoint-url", sw.s3_endpoint, "--numworkers", "32", "cp",
                                       f"s3://{cont}/*", dest + "/"], env5, None
                    if strace:
                        cmd = ["strace", "-f", "-e", "trace=write,pwrite64", "-o", strace] + cmd
                else:
                    job = {"url": f"s3://{cont}/", "dest": dest, "mode": "full", "rank": 0, "nodes": 1,
                           "concurrency": 32, "creds": s3.__dict__}
                    env, stdin = {**os.environ, "PYTHONPATH": args.code}, json.dumps(job)
                    cmd = [sys.executable, "-P", "-m", "appliance.node.stage_main"] if tool == 0 else \
                        [sys.executable, "-P", "-c", WRAP]
                    if tool:
                        env["APPLIANCE_WRITE_CHUNK"] = str(tool)
                wall, cpu, rc, tail, user = sb.measure(cmd, env, stdin)
                if rc:
                    raise SystemExit(f"{tool}: rc {rc}: {tail}")
                shutil.rmtree(dest)
                return wall, cpu, user

            if args.strace_s5cmd:
                log = work / "s5cmd.strace"
                run("s5cmd", "plain", strace=str(log))
                sizes = collections.Counter(int(m.group(1)) for m in re.finditer(r"= (\d+)\n", log.read_text())
                                            if int(m.group(1)) > 100)
                print("s5cmd's writes over 100 bytes, by size (bytes: count):",
                      ", ".join(f"{k}: {v}" for k, v in sizes.most_common(8)), flush=True)
            tools = ["s5cmd", *chunks]
            name = {t: ("s5cmd" if t == "s5cmd" else "ours as it is" if t == 0 else
                        f"ours, {t >> 10} KiB writes") for t in tools}
            for cont in args.datasets.split(","):
                runs = collections.defaultdict(list)
                for r in range(args.rounds):
                    warm = bool(args.warm and r % 2)
                    for t in tools[r % len(tools):] + tools[:r % len(tools)]:
                        wall, cpu, user = run(t, cont, warm=warm)
                        runs[(t, warm) if args.warm else t].append((wall, cpu, user))
                        print(f"{cont} round {r}{' (memory warmed)' if warm else ''}: {name[t]}: wall {wall:.2f} cpu {cpu:.2f} user {user:.2f} "
                              f"system {cpu - user:.2f}", flush=True)
                print(f"{cont} objects, medians (wall / CPU / user / system s):")
                for k, rs in runs.items():
                    t = k[0] if args.warm else k
                    m = [statistics.median(x[i] for x in rs) for i in range(3)]
                    print(f"  {name[t]}{', memory warmed' if args.warm and k[1] else ''} ({len(rs)} runs): "
                          f"{m[0]:.2f} / {m[1]:.2f} / {m[2]:.2f} / "
                          f"{statistics.median(x[1] - x[2] for x in rs):.2f}", flush=True)
    finally:
        sw.stop()
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
