"""What the first read of a staged dataset costs after each stager: 8 x 256 MiB from one Ceph RGW over https
(through S3) staged by the stager at ROOT_A and ROOT_B in turn, then every file read once (1 MiB reads, as a
training input pipeline's first epoch would), wall and system time of the read. The stager before O_DIRECT leaves
the bytes in the page cache (as long as memory allows), the one after writes them past it.

    python bench/results/stage-direct/scripts/read_after.py ROOT_A,ROOT_B ROUNDS
"""
import argparse
import json
import os
import resource
import shutil
import subprocess
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve()
sys.path.insert(0, str(HERE.parents[4]))
sys.path.insert(0, str(HERE.parents[3]))
import stage_bench as sb  # noqa: E402
from nodedisk import node_disk  # noqa: E402

from appliance.localcloud.rgw_server import RGWServer  # noqa: E402
from appliance.store.objects import StoreCreds  # noqa: E402


def read_all(dest: Path) -> tuple[float, float]:
    r0, t0 = resource.getrusage(resource.RUSAGE_SELF), time.monotonic()
    buf = bytearray(1 << 20)
    for p in sorted(dest.glob("*.bin")):
        with open(p, "rb", buffering=0) as f:
            while f.readinto(buf):
                pass
    return time.monotonic() - t0, resource.getrusage(resource.RUSAGE_SELF).ru_stime - r0.ru_stime


def main() -> None:
    roots, rounds = sys.argv[1].split(","), int(sys.argv[2])
    print(f"# python bench/results/stage-direct/scripts/read_after.py {sys.argv[1]} {rounds}  "
          f"({time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())})")
    work = Path("/var/tmp/appliance-readafter")
    ns = argparse.Namespace(datasets="large", small=0, small_size=0, large=8, large_size=256 << 20, work=str(work),
                            upload_size=0)
    sw = RGWServer(work / "rgw", memstore_bytes=sb.store_bytes(ns), tls=True).start()
    os.environ.update(sb.ca_env(sw))
    try:
        sb.seed(sw, ns)
        env, ak, sk = sb.tool_env(sw, Path(HERE.parents[3] / ".venv-tools"))
        creds = StoreCreds(s3_endpoint=sw.s3_endpoint, s3_access_key=ak, s3_secret_key=sk)
        with node_disk(work, 4 << 30) as (root, fs):
            print(f"# on {fs}")
            print("| stager | stage s | first read s | its system s |")
            print("|---|---|---|---|")
            for r in range(rounds):
                for rt in roots[r % len(roots):] + roots[:r % len(roots)]:
                    dest = root / "dest"
                    shutil.rmtree(dest, ignore_errors=True)
                    dest.mkdir()
                    os.sync()
                    job = {"url": "s3://blarge/", "dest": str(dest), "mode": "full", "rank": 0, "nodes": 1,
                           "concurrency": 32, "creds": creds.__dict__}
                    t = time.monotonic()
                    p = subprocess.run([sys.executable, "-P", "-m", "appliance.node.stage_main"],
                                       env={**env, "PYTHONPATH": rt}, input=json.dumps(job), capture_output=True,
                                       text=True)
                    staged = time.monotonic() - t
                    assert p.returncode == 0, p.stderr[-500:]
                    w, s = read_all(dest)
                    print(f"| {rt} | {staged:.2f} | {w:.2f} | {s:.2f} |", flush=True)
    finally:
        sw.stop()


if __name__ == "__main__":
    main()
