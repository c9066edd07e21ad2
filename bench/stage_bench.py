"""Staging benchmark: our stager vs the usual tools, against one real Swift on 127.0.0.1.

    make bench-stage            # or: .venv/bin/python bench/stage_bench.py --tools-venv bench/.venv-tools

Datasets (seeded once into a Swift whose BASE is reused between runs):
  small   N x S-byte objects (default 10,000 x 100 KB)
  large   M x L-byte objects (default 8 x 256 MB)
  packed  the same small objects packed into 64 MB tar shards (appliance data pack)

Every tool runs as its own process, downloads one dataset to an empty directory on the same disk, and
is measured for wall time and its *own* CPU time (user + system, from wait4), so the co-located server's
CPU is not counted. Reported: objects/s, MB/s, client CPU ms per object, and the disk's own write speed
(dd with fdatasync) as the ceiling. Results: bench/results/stage.json, stage.md, stage.png.
On 2 cores the Swift server uses most of the CPU (shared/docs/swift.md), so wall-clock rates here
measure the server as much as the client; CPU per object is the client's own cost.
"""

from __future__ import annotations

import argparse
import io
import json
import os
import shutil
import subprocess
import sys
import tarfile
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from appliance.store.objects import StoreCreds, SwiftStore  # noqa: E402
from appliance.localcloud.swift_server import SwiftServer  # noqa: E402


def seed(sw: SwiftServer, args) -> dict:
    marker = sw.base / f"seeded-{args.small}x{args.small_size}-{args.large}x{args.large_size}"
    creds = StoreCreds(auth_url=sw.auth_url, user=sw.user, key=sw.key)
    if marker.exists():
        return json.loads(marker.read_text())
    import swiftclient

    conn = swiftclient.Connection(authurl=sw.auth_url, user=sw.user, key=sw.key, timeout=600, retries=0)
    for c in ("bsmall", "blarge", "bpacked"):
        conn.put_container(c)
    t = time.time()
    with tempfile.TemporaryDirectory(dir=args.work) as tmp:
        src = Path(tmp) / "small"
        src.mkdir()
        for first in range(0, args.small, 2000):
            bio = io.BytesIO()
            with tarfile.open(fileobj=bio, mode="w") as tf:
                for i in range(first, min(args.small, first + 2000)):
                    data = os.urandom(args.small_size)
                    (src / f"{i:06d}.bin").write_bytes(data)
                    ti = tarfile.TarInfo(f"{i:06d}.bin")
                    ti.size = len(data)
                    tf.addfile(ti, io.BytesIO(data))
            conn.put_object("bsmall", None, bio.getvalue(), query_string="extract-archive=tar",
                            headers={"Accept": "application/json"})
        print(f"seeded {args.small} small objects in {time.time() - t:.0f}s", flush=True)
        from appliance.data.pack import pack

        pack(src, SwiftStore("bpacked", creds), "", shard_size=64 * 1024**2, log=print)
        big = Path(tmp) / "big.bin"
        for i in range(args.large):
            with open(big, "wb") as fh:
                for _ in range(args.large_size // (1 << 20)):
                    fh.write(os.urandom(1 << 20))
            with open(big, "rb") as fh:
                conn.put_object("blarge", f"large-{i:02d}.bin", fh, content_length=big.stat().st_size)
        print(f"seeded {args.large} large objects", flush=True)
    info = {"small": args.small, "small_size": args.small_size, "large": args.large, "large_size": args.large_size}
    marker.write_text(json.dumps(info))
    return info


def disk_write_mb_s(work: Path) -> float:
    p = work / "dd.tmp"
    t = time.time()
    subprocess.run(["dd", "if=/dev/zero", f"of={p}", "bs=1M", "count=1024", "conv=fdatasync"],
                   capture_output=True, check=True)
    el = time.time() - t
    p.unlink()
    return round(1024 * 1.048576 / el, 1)


def measure(cmd, env, stdin=None):
    """(wall seconds, client CPU seconds, exit code, output) of one tool run."""
    before = os.times()
    t = time.time()
    p = subprocess.run(cmd, env=env, input=stdin, capture_output=True, text=True)
    wall = time.time() - t
    after = os.times()
    cpu = (after.children_user - before.children_user) + (after.children_system - before.children_system)
    return wall, cpu, p.returncode, (p.stdout + p.stderr)[-800:]


def tools(sw: SwiftServer, tv: Path, c: int) -> dict:
    """Each tool: (dataset container) -> (argv, env, stdin)."""
    base_env = {"PATH": f"{tv}/bin:/usr/bin:/bin", "HOME": os.environ.get("HOME", "/root"), "LANG": "C.UTF-8",
                "AWS_ACCESS_KEY_ID": sw.user, "AWS_SECRET_ACCESS_KEY": sw.key, "AWS_DEFAULT_REGION": "us-east-1",
                "AWS_EC2_METADATA_DISABLED": "true"}
    awscfg = Path(tempfile.mkdtemp()) / "config"
    awscfg.write_text(f"[default]\ns3 =\n  max_concurrent_requests = {c}\n  addressing_style = path\n")
    creds = StoreCreds(auth_url=sw.auth_url, user=sw.user, key=sw.key).scoped()

    def ours(cont, dest):
        job = {"url": f"swift://{cont}/", "dest": dest, "mode": "full", "rank": 0, "nodes": 1, "concurrency": c,
               "creds": creds.__dict__}
        return [sys.executable, "-m", "appliance.node.stage_main"], {**base_env, "PYTHONPATH": str(ROOT)}, json.dumps(job)

    def ours_s3(cont, dest):
        s3 = StoreCreds(s3_endpoint=sw.s3_endpoint, s3_access_key=sw.user, s3_secret_key=sw.key)
        job = {"url": f"s3://{cont}/", "dest": dest, "mode": "full", "rank": 0, "nodes": 1, "concurrency": c,
               "creds": s3.__dict__}
        return [sys.executable, "-m", "appliance.node.stage_main"], {**base_env, "PYTHONPATH": str(ROOT)}, json.dumps(job)

    return {
        "appliance (swift)": ours,
        "appliance (s3)": ours_s3,
        "rclone swift": lambda cont, dest: ([f"{tv}/bin/rclone", "copy", f":swift:{cont}", dest, "--transfers", str(c),
                                            "--checkers", str(c)],
                                           {**base_env, "RCLONE_SWIFT_AUTH": sw.auth_url, "RCLONE_SWIFT_USER": sw.user,
                                            "RCLONE_SWIFT_KEY": sw.key}, None),
        "rclone s3": lambda cont, dest: ([f"{tv}/bin/rclone", "copy", f":s3:{cont}", dest, "--transfers", str(c),
                                         "--checkers", str(c)],
                                        {**base_env, "RCLONE_S3_PROVIDER": "Other", "RCLONE_S3_ENDPOINT": sw.s3_endpoint,
                                         "RCLONE_S3_ACCESS_KEY_ID": sw.user, "RCLONE_S3_SECRET_ACCESS_KEY": sw.key,
                                         "RCLONE_S3_FORCE_PATH_STYLE": "true"}, None),
        "s5cmd": lambda cont, dest: ([f"{tv}/bin/s5cmd", "--endpoint-url", sw.s3_endpoint, "--numworkers", str(c), "cp",
                                      f"s3://{cont}/*", dest + "/"], base_env, None),
        "aws s3 cp": lambda cont, dest: ([f"{tv}/bin/aws", "s3", "cp", f"s3://{cont}", dest, "--recursive",
                                          "--endpoint-url", sw.s3_endpoint, "--only-show-errors"],
                                         {**base_env, "AWS_CONFIG_FILE": str(awscfg)}, None),
        "swift download": lambda cont, dest: ([f"{tv}/bin/swift", "-A", sw.auth_url, "-U", sw.user, "-K", sw.key,
                                               "download", cont, "-D", dest, "--object-threads", str(c)],
                                              base_env, None),
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--small", type=int, default=10000)
    ap.add_argument("--small-size", type=int, default=100 * 1024)
    ap.add_argument("--large", type=int, default=8)
    ap.add_argument("--large-size", type=int, default=256 * 1024**2)
    ap.add_argument("--concurrency", type=int, default=32)
    ap.add_argument("--tools-venv", default=str(ROOT / "bench" / ".venv-tools"))
    ap.add_argument("--work", default="/var/tmp/appliance-bench")
    ap.add_argument("--out", default=str(ROOT / "bench" / "results"))
    ap.add_argument("--only", default="", help="comma-separated tool names to run")
    args = ap.parse_args()
    work, out, tv = Path(args.work), Path(args.out), Path(args.tools_venv)
    work.mkdir(parents=True, exist_ok=True)
    out.mkdir(parents=True, exist_ok=True)
    sw = SwiftServer(work / "swift", proxy_workers=2).start()
    rows = []
    try:
        info = seed(sw, args)
        disk = disk_write_mb_s(work)
        print(f"disk write (dd, fdatasync): {disk} MB/s", flush=True)
        ts = tools(sw, tv, args.concurrency)
        only = set(filter(None, args.only.split(",")))
        datasets = [("small", "bsmall", info["small"], info["small"] * info["small_size"]),
                    ("large", "blarge", info["large"], info["large"] * info["large_size"])]
        for ds, cont, n, nbytes in datasets:
            for name, fn in ts.items():
                if only and name not in only:
                    continue
                dest = work / "dest"
                shutil.rmtree(dest, ignore_errors=True)
                dest.mkdir()
                argv, env, stdin = fn(cont, str(dest))
                wall, cpu, rc, tail = measure(argv, env, stdin)
                got = sum(1 for p in dest.rglob("*") if p.is_file() and not p.name.startswith(".appliance"))
                row = {"dataset": ds, "tool": name, "concurrency": args.concurrency, "seconds": round(wall, 2),
                       "objects": got, "ok": rc == 0 and got == n, "objects_per_s": round(got / wall, 1),
                       "mb_per_s": round(nbytes / 1e6 / wall, 1), "client_cpu_s": round(cpu, 2),
                       "client_cpu_ms_per_object": round(1000 * cpu / max(got, 1), 2)}
                if rc != 0 or got != n:
                    row["error"] = tail
                rows.append(row)
                print(json.dumps(row), flush=True)
        # packed shards vs the same data as small objects, with our stager
        for ds, cont in (("packed shards", "bpacked"), ("small objects", "bsmall")):
            dest = work / "dest"
            shutil.rmtree(dest, ignore_errors=True)
            dest.mkdir()
            argv, env, stdin = ts["appliance (swift)"](cont, str(dest))
            wall, cpu, rc, tail = measure(argv, env, stdin)
            rows.append({"dataset": f"{info['small'] * info['small_size'] / 1e9:.2f} GB as {ds}", "tool": "appliance (swift)", "concurrency": args.concurrency,
                         "seconds": round(wall, 2), "ok": rc == 0, "client_cpu_s": round(cpu, 2),
                         "mb_per_s": round(info["small"] * info["small_size"] / 1e6 / wall, 1)})
            print(json.dumps(rows[-1]), flush=True)
    finally:
        sw.stop()
        shutil.rmtree(work / "dest", ignore_errors=True)
    result = {"command": "make bench-stage", "machine": f"{os.cpu_count()} cores", "disk_write_mb_s": disk,
              "dataset": info, "rows": rows, "when": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())}
    (out / "stage.json").write_text(json.dumps(result, indent=1))
    lines = [f"# Staging benchmark ({result['when']}, {result['machine']}, `make bench-stage`)", "",
             f"Swift 2.38.3 on 127.0.0.1 (2 proxy workers, memcached), same machine as the clients. "
             f"Disk write ceiling (dd, fdatasync): {disk} MB/s. Concurrency {args.concurrency} for every tool.", "",
             "| dataset | tool | s | objects/s | MB/s | client CPU ms/object | ok |", "|---|---|---|---|---|---|---|"]
    for r in rows:
        lines.append(f"| {r['dataset']} | {r['tool']} | {r['seconds']} | {r.get('objects_per_s', '')} | "
                     f"{r['mb_per_s']} | {r.get('client_cpu_ms_per_object', '')} | {'yes' if r['ok'] else 'NO'} |")
    (out / "stage.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
    plot = tv / "bin" / "python"
    if plot.exists():
        subprocess.run([str(plot), str(ROOT / "bench" / "plot_stage.py"), str(out / "stage.json"),
                        str(out / "stage.png")], check=False)


if __name__ == "__main__":
    main()
