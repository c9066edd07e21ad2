"""User and system time apart (`/usr/bin/time`): our stager on 8 x 256 MiB put by another tool (checked by MD5)
and put as `appliance data upload` puts them (checked by their CRC-32: CRC_META in appliance/store/objects.py),
through both APIs, beside s5cmd and rclone s3, in a rotated order each round. One Ceph RGW on 127.0.0.1.

    python bench/stage_usersys.py [ROUNDS] [OUT_DIR]     # default 4, bench/results/stage-usersys
"""
import json, os, shutil, statistics, subprocess, sys, time
from pathlib import Path
ROOT = Path(__file__).resolve().parents[1]; sys.path.insert(0, str(ROOT))
from appliance.localcloud.rgw_server import RGWServer
from appliance.store.objects import StoreCreds, SwiftStore
import swiftclient
work = Path("/var/tmp/appliance-usersys")  # removed at the end; shutil.rmtree(work, ignore_errors=True); work.mkdir(parents=True)
tv = ROOT / "bench/.venv-tools"
sw = RGWServer(work / "rgw").start()
try:
    cr = sw.credentials()
    creds = StoreCreds(auth_url=sw.auth_url, user=sw.user, key=sw.key)
    conn = swiftclient.Connection(authurl=sw.auth_url, user=sw.user, key=sw.key, timeout=600, retries=0)
    conn.put_container("bplain"); ours = SwiftStore("bours", creds); ours.ensure_container()
    big = work / "big.bin"
    for i in range(8):
        with open(big, "wb") as fh:
            for _ in range(256): fh.write(os.urandom(1 << 20))
        with open(big, "rb") as fh:
            conn.put_object("bplain", f"large-{i:02d}.bin", fh, content_length=big.stat().st_size)
        ours.put(f"large-{i:02d}.bin", big)
    big.unlink()
    ak, sk = cr["s3_access_key"], cr["s3_secret_key"]
    env = {"PATH": f"{tv}/bin:/usr/bin:/bin", "HOME": "/root", "LANG": "C.UTF-8", "PYTHONPATH": str(ROOT)}
    def stager(cont, api, dest):
        c = creds.scoped().__dict__ if api == "swift" else StoreCreds(s3_endpoint=sw.s3_endpoint, s3_access_key=ak, s3_secret_key=sk).__dict__
        job = {"url": f"{api}://{cont}/", "dest": dest, "mode": "full", "rank": 0, "nodes": 1, "concurrency": 32, "creds": c}
        return [sys.executable, "-P", "-m", "appliance.node.stage_main"], json.dumps(job)
    runs = {
        "ours s3, other tool's (MD5)": lambda d: stager("bplain", "s3", d),
        "ours s3, data upload's (CRC)": lambda d: stager("bours", "s3", d),
        "ours swift, other tool's (MD5)": lambda d: stager("bplain", "swift", d),
        "ours swift, data upload's (CRC)": lambda d: stager("bours", "swift", d),
        "s5cmd": lambda d: ([f"{tv}/bin/s5cmd", "--endpoint-url", sw.s3_endpoint, "--numworkers", "32", "cp", "s3://bours/*", d + "/"], None),
        "rclone s3": lambda d: ([f"{tv}/bin/rclone", "copy", ":s3:bours", d, "--transfers", "32", "--checkers", "32"], None),
    }
    s3env = {"AWS_ACCESS_KEY_ID": ak, "AWS_SECRET_ACCESS_KEY": sk, "AWS_DEFAULT_REGION": "us-east-1",
             "RCLONE_S3_PROVIDER": "Other", "RCLONE_S3_ENDPOINT": sw.s3_endpoint, "RCLONE_S3_ACCESS_KEY_ID": ak,
             "RCLONE_S3_SECRET_ACCESS_KEY": sk, "RCLONE_S3_FORCE_PATH_STYLE": "true"}
    out = {k: [] for k in runs}
    names = list(runs)
    for rnd in range(int(sys.argv[1]) if len(sys.argv) > 1 else 3):
        for name in names[rnd % len(names):] + names[:rnd % len(names)]:
            dest = work / "dest"; shutil.rmtree(dest, ignore_errors=True); dest.mkdir(); os.sync()
            argv, stdin = runs[name](str(dest))
            r = subprocess.run(["/usr/bin/time", "-f", "TIME %U %S %e", *argv], input=stdin, text=True,
                               capture_output=True, env={**env, **s3env})
            u, s, e = map(float, r.stderr.strip().splitlines()[-1].split()[1:])
            n = sum(1 for p in dest.iterdir() if p.is_file() and not p.name.startswith(".appliance"))
            out[name].append((u, s, e, r.returncode, n))
            print(json.dumps({"tool": name, "round": rnd, "user": u, "sys": s, "wall": e, "rc": r.returncode, "files": n}), flush=True)
    out_dir = Path(sys.argv[2]) if len(sys.argv) > 2 else ROOT / "bench/results/stage-usersys"
    out_dir.mkdir(parents=True, exist_ok=True)
    when = time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())
    cmd = "python bench/stage_usersys.py " + " ".join(sys.argv[1:])
    (out_dir / "usersys.json").write_text(json.dumps({"command": cmd, "when": when, "machine": f"{os.cpu_count()} cores",
        "runs": {k: [dict(zip(("user", "sys", "wall", "rc", "files"), r)) for r in v] for k, v in out.items()}}, indent=1))
    lines = [f"# Stager user and system time ({when}, {os.cpu_count()} cores, `{cmd}`)", "",
             "8 x 256 MiB from one Ceph RGW on 127.0.0.1, concurrency 32, each tool under `/usr/bin/time`, "
             f"{len(next(iter(out.values())))} rounds in a rotated order. Ranges over the rounds; wall: the median too.", "",
             "| run | user s | system s | wall s | wall median s | all 8 files |", "|---|---|---|---|---|---|"]
    for k, v in out.items():
        u, s, e = ([r[i] for r in v] for i in range(3))
        lines.append(f"| {k} | {min(u)}-{max(u)} | {min(s)}-{max(s)} | {min(e)}-{max(e)} | "
                     f"{statistics.median(e):.2f} | {'yes' if all(r[3] == 0 and r[4] == 8 for r in v) else 'NO'} |")
    (out_dir / "usersys.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
finally:
    sw.stop(); shutil.rmtree(work, ignore_errors=True)
