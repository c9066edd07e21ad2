"""A/B of the stager's receive buffer (appliance/store/httpget.py BUF, one per thread): user and system time of
`appliance.node.stage_main` fetching 8 x 256 MiB put by our upload (the CRC-32 path) through S3 from one Ceph RGW
on 127.0.0.1, each buffer size in turn, in a rotated order each round.

    python bench/stage_buffer_ab.py [ROUNDS] [SIZES]    # default 6 1048576,524288,262144,131072
Writes bench/results/stage-buffer/buffer.{json,md}.
"""
import json, os, shutil, statistics, subprocess, sys, time
from pathlib import Path
ROOT = Path(__file__).resolve().parents[1]; sys.path.insert(0, str(ROOT))
from appliance.localcloud.rgw_server import RGWServer
from appliance.store.objects import StoreCreds, SwiftStore
work = Path("/var/tmp/appliance-bufab"); shutil.rmtree(work, ignore_errors=True); work.mkdir(parents=True)
sizes = [int(x) for x in sys.argv[2].split(",")] if len(sys.argv) > 2 else [1 << 20, 512 << 10, 256 << 10, 128 << 10]
sw = RGWServer(work / "rgw").start()
try:
    cr = sw.credentials()
    ours = SwiftStore("bours", StoreCreds(auth_url=sw.auth_url, user=sw.user, key=sw.key)); ours.ensure_container()
    big = work / "big.bin"
    for i in range(8):
        with open(big, "wb") as fh:
            for _ in range(256): fh.write(os.urandom(1 << 20))
        ours.put(f"large-{i:02d}.bin", big)
    big.unlink()
    s3 = StoreCreds(s3_endpoint=sw.s3_endpoint, s3_access_key=cr["s3_access_key"], s3_secret_key=cr["s3_secret_key"]).__dict__
    out = {b: [] for b in sizes}
    for rnd in range(int(sys.argv[1]) if len(sys.argv) > 1 else 6):
        for b in sizes[rnd % len(sizes):] + sizes[:rnd % len(sizes)]:
            dest = work / "dest"; shutil.rmtree(dest, ignore_errors=True); dest.mkdir(); os.sync()
            job = {"url": "s3://bours/", "dest": str(dest), "mode": "full", "rank": 0, "nodes": 1, "concurrency": 32, "creds": s3}
            code = (f"import appliance.store.httpget as h; h.BUF = {b}; import runpy; "
                    "runpy.run_module('appliance.node.stage_main', run_name='__main__')")
            r = subprocess.run(["/usr/bin/time", "-f", "TIME %U %S %e", sys.executable, "-P", "-c", code],
                               input=json.dumps(job), text=True, capture_output=True,
                               env={"PATH": "/usr/bin:/bin", "PYTHONPATH": str(ROOT), "HOME": "/root"})
            u, s, e = map(float, r.stderr.strip().splitlines()[-1].split()[1:])
            n = sum(1 for p in dest.iterdir() if p.is_file() and not p.name.startswith(".appliance"))
            out[b].append((u, s, e))
            print(json.dumps({"buf": b, "round": rnd, "user": u, "sys": s, "wall": e, "rc": r.returncode, "files": n}), flush=True)
    when = time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())
    cmd = "python bench/stage_buffer_ab.py " + " ".join(sys.argv[1:])
    l2 = [p for p in Path("/sys/devices/system/cpu/cpu0/cache").glob("index*") if (p / "level").read_text().strip() == "2"]
    l2s = (l2[0] / "size").read_text().strip() if l2 else "unknown"
    out_dir = ROOT / "bench/results/stage-buffer"
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / "buffer.json").write_text(json.dumps({"command": cmd, "when": when, "l2_per_core": l2s,
        "runs": {str(b): [dict(zip(("user", "sys", "wall"), x)) for x in v] for b, v in out.items()}}, indent=1))
    lines = [f"# The stager's receive buffer ({when}, {os.cpu_count()} cores, L2 {l2s} per core, `{cmd}`)", "",
             "8 x 256 MiB put by our upload (checked by CRC-32), through S3, one Ceph RGW on 127.0.0.1; medians of "
             f"{len(next(iter(out.values())))} rounds, the sizes in a rotated order.", "",
             "| buffer | user s | system s | wall s | system s, every round |", "|---|---|---|---|---|"]
    for b, v in out.items():
        lines.append(f"| {b >> 10} KiB | {statistics.median(x[0] for x in v):.2f} | {statistics.median(x[1] for x in v):.2f} | "
                     f"{statistics.median(x[2] for x in v):.2f} | {', '.join(str(x[1]) for x in sorted(v, key=lambda x: x[1]))} |")
    (out_dir / "buffer.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
finally:
    sw.stop(); shutil.rmtree(work, ignore_errors=True)
