"""Staging benchmark: our stager vs the usual tools, against one real Swift on 127.0.0.1.

    make bench-stage            # or: .venv/bin/python bench/stage_bench.py --tools-venv bench/.venv-tools

Datasets (seeded once into a Swift whose BASE is reused between runs):
  small   N x S-byte objects (default 10,000 x 100 KB)
  large   M x L-byte objects (default 8 x 256 MB)
  packed  the same small objects packed into 64 MB tar shards (appliance data pack)

Every tool runs as its own process, downloads one dataset to an empty directory on a fresh ext4 with a journal,
formatted as `appliance up` formats a node's disk (bench/nodedisk.py: this machine's own root file system has no
journal, which makes every new file slower after many were deleted), and is measured for wall time and its
*own* CPU time (user + system, from wait4), so the co-located server's CPU is not counted. Reported: objects/s,
MB/s, client CPU ms per object, and the disk's own write speed (dd with fdatasync) as the ceiling. Results: bench/results/stage.json, stage.md, stage.png.
On 2 cores the Swift server uses most of the CPU (measured: the proxy and object servers are Python), so wall-clock rates here
measure the server as much as the client; CPU per object is the client's own cost.
"""

from __future__ import annotations

import argparse
import io
import json
import os
import shlex
import shutil
import signal
import statistics
import subprocess
import sys
import tarfile
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from appliance.store.objects import StoreCreds, SwiftStore  # noqa: E402
from appliance.localcloud.rgw_server import RGWServer  # noqa: E402
from appliance.localcloud.swift_server import SwiftServer  # noqa: E402
from nodedisk import node_disk  # noqa: E402


# large: 8 x 256 MB as plain objects; large-ours: 8 others of that size as `appliance data upload` puts them (with
# their CRC-32, which our stager checks instead of an MD5: CRC_META in appliance/store/hashes.py); multipart: the
# same as `aws s3 cp` uploads them (ETag <md5>-32, checked part by part); medium: 256 x 8 MiB as plain objects
# (between the stager's small bodies and its ranged GETs: files of a few MB, images, audio, shards); upload: one 1.6 GB
# file up; packed: 1 GB of small files as 64 MB shards
ALL_DATASETS = "small,large,large-ours,multipart,medium,upload,packed"


def multipart_client(sw):
    import boto3
    from botocore.config import Config

    cr = sw.credentials()
    # no CRC32 trailer (botocore's default since 1.36, sent aws-chunked over https), which RGWs before Squid refuse
    return boto3.client("s3", endpoint_url=sw.s3_endpoint, aws_access_key_id=cr["s3_access_key"],
                        aws_secret_access_key=cr["s3_secret_key"], region_name="us-east-1",
                        config=Config(request_checksum_calculation="when_required"))


def seed(sw, args) -> dict:
    """Put the wanted datasets' objects: ``bsmall`` and ``bpacked`` (small, packed), ``blarge`` (large), ``bmulti``
    (multipart), ``bmedium`` (medium). Only what ``--datasets`` asks for: a Ceph RGW keeps them in its OSD's memory
    (memstore). A Swift keeps its disk between runs, so a group seeded before (its marker file) is not seeded
    again."""
    wanted = set(args.datasets.split(","))
    creds = StoreCreds(auth_url=sw.auth_url, user=sw.user, key=sw.key)
    import swiftclient

    conn = swiftclient.Connection(authurl=sw.auth_url, user=sw.user, key=sw.key, timeout=600, retries=0)
    for c in ("bsmall", "blarge", "bpacked", "bmulti", "bmedium"):
        conn.put_container(c)

    def todo(group: str, n: int, size: int) -> Path | None:
        marker = sw.base / f"seeded-{group}-{n}x{size}"
        return None if marker.exists() and sw.kind == "swift" else marker

    t = time.time()
    with tempfile.TemporaryDirectory(dir=args.work) as tmp:
        marker = todo("small", args.small, args.small_size) if wanted & {"small", "packed"} else None
        if marker:
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
            from appliance import report
            from appliance.data.pack import pack

            with report.to(print):
                pack(src, SwiftStore("bpacked", creds), "", shard_size=64 * 1024**2)
            marker.write_text("")
        plain = todo("large", args.large, args.large_size) if "large" in wanted else None
        multi = todo("multipart", args.large, args.large_size) if "multipart" in wanted else None
        if plain or multi:
            big = Path(tmp) / "big.bin"
            for i in range(args.large):
                with open(big, "wb") as fh:
                    for _ in range(args.large_size // (1 << 20)):
                        fh.write(os.urandom(1 << 20))
                if plain:
                    with open(big, "rb") as fh:
                        conn.put_object("blarge", f"large-{i:02d}.bin", fh, content_length=big.stat().st_size)
                if multi:  # the same objects as `aws s3 cp` uploads them
                    from boto3.s3.transfer import TransferConfig  # its defaults: parts of 8 MiB above 8 MiB

                    multipart_client(sw).upload_file(str(big), "bmulti", f"large-{i:02d}.bin", Config=TransferConfig(
                        multipart_threshold=8 * 1024**2, multipart_chunksize=8 * 1024**2))
            for m in (plain, multi):
                if m:
                    m.write_text("")
            print(f"seeded {args.large} large objects", flush=True)
        marker = todo("medium", args.medium, args.medium_size) if "medium" in wanted else None
        if marker:
            block = os.urandom(args.medium_size)  # each object its own bytes: a counter in its first 8
            for i in range(args.medium):
                conn.put_object("bmedium", f"medium-{i:04d}.bin", i.to_bytes(8, "little") + block[8:])
            marker.write_text("")
            print(f"seeded {args.medium} medium objects", flush=True)
    return {"small": args.small, "small_size": args.small_size, "large": args.large, "large_size": args.large_size,
            "medium": args.medium, "medium_size": args.medium_size}


def store_bytes(args) -> int:
    """What the wanted datasets put in the store, half again and 1 GiB more: a Ceph RGW's memstore cap
    (RGWServer ``memstore_bytes``, whose user quota is 3/4 of it: past that, writes are refused)."""
    wanted = set(args.datasets.split(","))
    small = 2 * args.small * args.small_size if wanted & {"small", "packed"} else 0  # bsmall and bpacked
    large = sum(args.large * args.large_size for d in ("large", "large-ours", "multipart") if d in wanted)
    up = args.upload_size if "upload" in wanted else 0
    medium = args.medium * args.medium_size if "medium" in wanted else 0
    return (small + large + medium + up) * 3 // 2 + (1 << 30)


def memory_problem(need: int, meminfo: str, headroom: int = 4 << 30) -> str | None:
    """Why a memstore of ``need`` bytes does not fit this machine (/proc/meminfo's MemAvailable, less ``headroom``
    for the stager, the peers and the page cache the runs read through), or None. Past it the kernel kills the OSD
    mid-run and every later store call waits on a store that is gone."""
    kib = {k: int(v.split()[0]) for k, v in (line.split(":", 1) for line in meminfo.splitlines() if ":" in line)}
    avail = kib.get("MemAvailable", kib.get("MemTotal", 0)) * 1024
    if need + headroom <= avail:
        return None
    return (f"the Ceph RGW store would hold up to {need / 2**30:.1f} GiB in memory (memstore) and this machine has "
            f"{avail / 2**30:.1f} GiB available ({headroom >> 30} GiB of it kept for the runs)")


def seed_ours(sw, args) -> None:
    """The large-ours dataset: ``args.large`` objects of ``args.large_size`` random bytes, put as `appliance data
    upload` puts them (SwiftStore.put: one PUT each, its ETag checked, its CRC_META written)."""
    store = SwiftStore("bours", StoreCreds(auth_url=sw.auth_url, user=sw.user, key=sw.key))
    store.ensure_container()
    have = {o.name for o in store.list() if o.size == args.large_size}
    with tempfile.TemporaryDirectory(dir=args.work) as tmp:
        big = Path(tmp) / "big.bin"
        for i in range(args.large):
            if f"large-{i:02d}.bin" in have:
                continue
            with open(big, "wb") as fh:
                for _ in range(args.large_size // (1 << 20)):
                    fh.write(os.urandom(1 << 20))
            store.put(f"large-{i:02d}.bin", big)
    print(f"seeded {args.large} large objects as `appliance data upload` puts them", flush=True)


def _category(dataset: str) -> str:
    return "upload" if dataset.startswith("upload") else "packed" if " as " in dataset else dataset


def disk_write_mb_s(work: Path) -> float:
    p = work / "dd.tmp"
    t = time.time()
    subprocess.run(["dd", "if=/dev/zero", f"of={p}", "bs=1M", "count=1024", "conv=fdatasync"],
                   capture_output=True, check=True)
    el = time.time() - t
    p.unlink()
    return round(1024 * 1.048576 / el, 1)


def measure(cmd, env, stdin=None):
    """(wall seconds, client CPU seconds, exit code, output, of the CPU seconds those in user space) of one tool
    run. User space is what a tool's own work costs (TLS, hashing, its language's runtime); the rest is the kernel's
    (the socket, the page cache), which swung from 0.8x to 1.6x s5cmd's between two runs of the same code here."""
    before = os.times()
    t = time.time()
    p = subprocess.run(cmd, env=env, input=stdin, capture_output=True, text=True)
    wall = time.time() - t
    after = os.times()
    user = after.children_user - before.children_user
    cpu = user + (after.children_system - before.children_system)
    return wall, cpu, p.returncode, (p.stdout + p.stderr)[-800:], user


def ca_env(sw) -> dict:
    """With an https store (``--tls``), the variables through which every tool trusts its certificate: requests'
    (swiftclient, `swift`, our stager's listings), OpenSSL's and Go's (our stager's GETs, s5cmd, rclone), botocore's."""
    ca = getattr(sw, "ca_file", None)
    return {v: str(ca) for v in ("REQUESTS_CA_BUNDLE", "SSL_CERT_FILE", "AWS_CA_BUNDLE")} if ca else {}


def tool_env(sw, tv: Path) -> tuple[dict, str, str]:
    """(the environment every tool runs with, the store's S3 access key, its secret)."""
    cr = sw.credentials()
    ak, sk = cr["s3_access_key"], cr["s3_secret_key"]
    return ({"PATH": f"{tv}/bin:/usr/bin:/bin", "HOME": os.environ.get("HOME", "/root"), "LANG": "C.UTF-8",
             "AWS_ACCESS_KEY_ID": ak, "AWS_SECRET_ACCESS_KEY": sk, "AWS_DEFAULT_REGION": "us-east-1",
             "AWS_EC2_METADATA_DISABLED": "true", **ca_env(sw)}, ak, sk)


def tools(sw, tv: Path, c: int, baseline: str = "") -> dict:
    """Each tool: (dataset container) -> (argv, env, stdin). With ``baseline`` (other checkouts, comma-separated),
    our stager from each too, as "appliance (...) at REV": a change measured beside what it replaces, in one run."""
    base_env, ak, sk = tool_env(sw, tv)
    awscfg = Path(sw.base) / "aws-config"  # in the store's directory under --work, not a new /tmp dir per run
    awscfg.write_text(f"[default]\ns3 =\n  max_concurrent_requests = {c}\n  addressing_style = path\n")
    creds = StoreCreds(auth_url=sw.auth_url, user=sw.user, key=sw.key).scoped()

    def ours(cont, dest, root=ROOT):  # -P: PYTHONPATH picks the checkout
        job = {"url": f"swift://{cont}/", "dest": dest, "mode": "full", "rank": 0, "nodes": 1, "concurrency": c,
               "creds": creds.__dict__}
        return [sys.executable, "-P", "-m", "appliance.node.stage_main"], {**base_env, "PYTHONPATH": str(root)}, \
            json.dumps(job)

    def ours_s3(cont, dest, root=ROOT):
        s3 = StoreCreds(s3_endpoint=sw.s3_endpoint, s3_access_key=ak, s3_secret_key=sk)
        job = {"url": f"s3://{cont}/", "dest": dest, "mode": "full", "rank": 0, "nodes": 1, "concurrency": c,
               "creds": s3.__dict__}
        return [sys.executable, "-P", "-m", "appliance.node.stage_main"], {**base_env, "PYTHONPATH": str(root)}, \
            json.dumps(job)

    before = {}
    for old in [Path(b).resolve() for b in baseline.split(",") if b]:
        rev = subprocess.run(["git", "-C", str(old), "rev-parse", "--short", "HEAD"], capture_output=True,
                             text=True).stdout.strip() or old.name
        before |= {f"appliance (swift) at {rev}": lambda cont, dest, old=old: ours(cont, dest, old),
                   f"appliance (s3) at {rev}": lambda cont, dest, old=old: ours_s3(cont, dest, old)}
    return {
        "appliance (swift)": ours,
        "appliance (s3)": ours_s3,
        **before,
        # the A/B of quick ACKs (appliance/store/tcp.py): only with --only, where latency is the limit
        "appliance (swift) without quick ACKs": lambda cont, dest: (lambda a, e, i: (a, {**e, "APPLIANCE_QUICKACK": "0"},
                                                                                 i))(*ours(cont, dest)),
        "rclone swift": lambda cont, dest: ([f"{tv}/bin/rclone", "copy", f":swift:{cont}", dest, "--transfers", str(c),
                                            "--checkers", str(c)],
                                           {**base_env, "RCLONE_SWIFT_AUTH": sw.auth_url, "RCLONE_SWIFT_USER": sw.user,
                                            "RCLONE_SWIFT_KEY": sw.key}, None),
        "rclone s3": lambda cont, dest: ([f"{tv}/bin/rclone", "copy", f":s3:{cont}", dest, "--transfers", str(c),
                                         "--checkers", str(c)],
                                        {**base_env, "RCLONE_S3_PROVIDER": "Other", "RCLONE_S3_ENDPOINT": sw.s3_endpoint,
                                         "RCLONE_S3_ACCESS_KEY_ID": ak, "RCLONE_S3_SECRET_ACCESS_KEY": sk,
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


UPLOAD_JOB = """
import json, sys
from pathlib import Path
from appliance.store.checkpoints import CheckpointStore
from appliance.store.objects import StoreCreds
job = json.loads(sys.stdin.read())
cs = CheckpointStore(job["url"], "bench", StoreCreds(**job["creds"]))
cs.ensure_container()
m = cs.upload(Path(job["dir"]), {"step": 1})
print(json.dumps({k: v["size"] for k, v in m["files"].items()}))
"""


def upload_tools(sw, tv: Path, baseline: str = "") -> dict:
    """Each tool: (the local directory with one big file, the container) -> (argv, env, stdin). Ours is the
    checkpoint commit itself (CheckpointStore.upload: ETags computed, parts in parallel, verified, manifest)."""
    env, ak, sk = tool_env(sw, tv)
    env["PYTHONPATH"] = str(ROOT)
    swift_creds = StoreCreds(auth_url=sw.auth_url, user=sw.user, key=sw.key).scoped().__dict__
    s3_creds = StoreCreds(s3_endpoint=sw.s3_endpoint, s3_access_key=ak, s3_secret_key=sk).__dict__

    def ours(scheme, creds, env=env):
        return lambda d, cont: ([sys.executable, "-P", "-c", UPLOAD_JOB], env,  # -P: PYTHONPATH picks the checkout
                                json.dumps({"url": f"{scheme}://{cont}/", "dir": str(d), "creds": creds}))

    one = {**env, "APPLIANCE_SEGMENT_BYTES": str(5 * 1024**3)}  # the commit as it was: a file up to 5 GiB in one PUT
    before = {}
    for b in [b for b in baseline.split(",") if b]:  # the same commit from other checkouts (a change measured
        old = {**env, "PYTHONPATH": str(Path(b).resolve())}  # against what it replaces, in one run)
        rev = subprocess.run(["git", "-C", b, "rev-parse", "--short", "HEAD"], capture_output=True,
                             text=True).stdout.strip() or Path(b).name
        before |= {f"appliance checkpoint (swift) at {rev}": ours("swift", swift_creds, old),
                   f"appliance checkpoint (s3) at {rev}": ours("s3", s3_creds, old)}
    return {
        "appliance checkpoint (swift)": ours("swift", swift_creds),
        "appliance checkpoint (swift, one PUT)": ours("swift", swift_creds, one),
        "appliance checkpoint (s3)": ours("s3", s3_creds),
        **before,
        "s5cmd": lambda d, cont: ([f"{tv}/bin/s5cmd", "--endpoint-url", sw.s3_endpoint, "cp", f"{d}/state.data",
                                   f"s3://{cont}/s5cmd/state.data"], env, None),
        "rclone s3": lambda d, cont: ([f"{tv}/bin/rclone", "copy", str(d), f":s3:{cont}/rclone"],
                                      {**env, "RCLONE_S3_PROVIDER": "Other", "RCLONE_S3_ENDPOINT": sw.s3_endpoint,
                                       "RCLONE_S3_ACCESS_KEY_ID": ak, "RCLONE_S3_SECRET_ACCESS_KEY": sk,
                                       "RCLONE_S3_FORCE_PATH_STYLE": "true"}, None),
        "swift upload (SLO)": lambda d, cont: ([f"{tv}/bin/swift", "-A", sw.auth_url, "-U", sw.user, "-K", sw.key,
                                               "upload", cont, f"{d}/state.data", "--object-name", "swift/state.data",
                                               "--use-slo", "-S", str(128 * 1024**2), "--segment-threads", "8"],
                                              env, None),
    }


def empty(sw, cont: str) -> None:
    """Delete what the upload runs put (the containers of the object and its segments); RGW frees the space
    only when its garbage collector runs, so run it now (memstore keeps everything in memory)."""
    import swiftclient

    conn = swiftclient.Connection(authurl=sw.auth_url, user=sw.user, key=sw.key, retries=2)
    for c in (cont, f"{cont}_segments", f"{cont}+segments"):
        try:
            for o in conn.get_container(c, full_listing=True)[1]:
                conn.delete_object(c, o["name"])
        except swiftclient.ClientException:
            pass
    if sw.kind == "rgw":
        sw._ceph("radosgw-admin", "-n", "client.admin", "gc", "process", "--include-all", timeout=600)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--small", type=int, default=10000)
    ap.add_argument("--small-size", type=int, default=100 * 1024)
    ap.add_argument("--large", type=int, default=8)
    ap.add_argument("--large-size", type=int, default=256 * 1024**2)
    ap.add_argument("--medium", type=int, default=256)
    ap.add_argument("--medium-size", type=int, default=8 * 1024**2)
    ap.add_argument("--concurrency", type=int, default=32)
    ap.add_argument("--tools-venv", default=str(ROOT / "bench" / ".venv-tools"))
    ap.add_argument("--work", default="/var/tmp/appliance-bench")
    ap.add_argument("--out", default=str(ROOT / "bench" / "results"))
    ap.add_argument("--only", default="", help="comma-separated tool names to run")
    ap.add_argument("--repeat", type=int, default=3, help="rounds; each row is the median of its runs")
    ap.add_argument("--warm", type=int, default=0, metavar="GIB",
                    help="before each run, write and free GIB GiB of tmpfs (/dev/shm): memory this VM had given back "
                         "to its host is its own again, so a tool's page-cache writes do not pay for that "
                         "(bench/results/stage-write-size)")
    ap.add_argument("--datasets", default=ALL_DATASETS,
                    help="comma-separated: small, large, large-ours (large objects as `appliance data upload` puts "
                         "them), multipart (the large objects as `aws s3 cp` uploads them), medium (--medium objects "
                         "of --medium-size), upload (a checkpoint-sized "
                         "file up), packed")
    ap.add_argument("--upload-size", type=int, default=1536 * 1024**2, help="bytes of the upload dataset's file")
    ap.add_argument("--baseline", default="", help="other checkouts of this repository, comma-separated (e.g. a git "
                    "worktree of the commit before a change): every dataset runs their stagers too and the upload "
                    "rows their checkpoint commit, as '... at REV'")
    ap.add_argument("--cores", default="", help="comma-separated core counts: each tool (of --only) runs pinned "
                    "to that many cores too (taskset -c 0-K-1), as 'TOOL [K cores]'")
    ap.add_argument("--tmpfs", action="store_true", help="the destination on /dev/shm: the disk is not the limit")
    ap.add_argument("--store", choices=("swift", "rgw"), default="swift",
                    help="the server: OpenStack Swift 2.38 (proxy + s3api) or Ceph RGW (what Chameleon runs)")
    ap.add_argument("--tls", action="store_true",
                    help="with --store rgw: the RGW serves https only, as Chameleon's store does (a certificate made "
                         "for the run, which every tool is told to trust); results in stage-rgw-https.*")
    args = ap.parse_args()
    if args.tls and args.store != "rgw":
        ap.error("--tls needs --store rgw")
    # a TERM, or an INT (which a shell's background job ignores), ends the run through its finally blocks: the
    # store's processes and the loop-mounted disk go with it, not only this process
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    signal.signal(signal.SIGINT, signal.default_int_handler)
    work, out, tv = Path(args.work), Path(args.out), Path(args.tools_venv)
    work.mkdir(parents=True, exist_ok=True)
    out.mkdir(parents=True, exist_ok=True)
    why = memory_problem(store_bytes(args), Path("/proc/meminfo").read_text()) if args.store == "rgw" else None
    if why:
        sys.exit(f"bench-stage: {why} (fix: fewer or smaller datasets, e.g. ARGS='--datasets small,large "
                 f"--large-size {64 << 20}', or STORE=swift, which keeps them on disk)")
    sw = (SwiftServer(work / "swift", proxy_workers=2) if args.store == "swift" else
          RGWServer(work / "rgw", memstore_bytes=store_bytes(args), tls=args.tls)).start()
    os.environ.update(ca_env(sw))  # the seeding's clients (swiftclient, boto3, SwiftStore) trust it too
    # the largest dataset half again (the stager keeps 256 MiB free), and room for the 1 GiB of the dd ceiling
    disk_bytes = max(args.small * args.small_size, args.large * args.large_size,
                     args.medium * args.medium_size) * 3 // 2 + (2 << 30)
    fs = "the work directory's file system"
    try:
        info = seed(sw, args)
        if "large-ours" in args.datasets.split(","):
            seed_ours(sw, args)
        with node_disk(work, disk_bytes) as (disk_root, fs):
            disk = disk_write_mb_s(disk_root)
            print(f"destination: {fs}", flush=True)
            rows = run_datasets(sw, args, info, disk_root, tv, disk)
    finally:
        sw.stop()
    write_results(args, out, tv, rows, info, disk, "tmpfs (/dev/shm, --tmpfs)" if args.tmpfs else fs)


def warm_memory(gib: int, shm: Path = Path("/dev/shm")) -> None:
    """Write ``gib`` GiB of zeros to a tmpfs file and free them. This VM gives free memory back to its host (free
    page reporting: /sys/module/page_reporting), and the first touch of such a page costs a fault in the host, which
    the guest counts as the system time of whatever touched it: our stager's 512 KiB page-cache writes (large
    folios) paid 5.2-7.6 s of system time per 2 GiB, s5cmd's 16 KiB ones 2.5-3.5 in 5 rounds of 6, and ours 1.8-4.0 s
    (median 2.9) after this (bench/results/stage-write-size). A bare-metal node has no such cost."""
    f = shm / f"appliance-warm-{os.getpid()}"
    try:
        with open(f, "wb") as fh:
            block = bytes(1 << 20)
            for _ in range(gib << 10):
                fh.write(block)
    finally:
        f.unlink(missing_ok=True)


def run_datasets(sw, args, info: dict, disk_root: Path, tv: Path, disk: float) -> list[dict]:
    """Every wanted dataset's rows: each tool ``--repeat`` times into ``disk_root/dest``, in a rotated order."""
    work = Path(args.work)
    rows: list[dict] = []
    print(f"disk write (dd, fdatasync): {disk} MB/s", flush=True)
    ts = tools(sw, tv, args.concurrency, args.baseline)
    only = set(filter(None, args.only.split(",")))
    if args.cores:  # each tool (of --only) on 1..k cores as well: how its rate grows with the node's cores
        for k in map(int, args.cores.split(",")):
            for name in [t for t in list(ts) if (t in only or not only) and "core" not in t]:
                ts[f"{name} [{k} core{'s' if k > 1 else ''}]"] = (
                    lambda cont, dest, f=ts[name], k=k: (lambda a, e, i: (["taskset", "-c", f"0-{k - 1}", *a], e, i))(
                        *f(cont, dest)))
                if only:
                    only.add(f"{name} [{k} core{'s' if k > 1 else ''}]")
        if only:
            only = {t for t in only if "core" in t}
    datasets = [("small", "bsmall", info["small"], info["small"] * info["small_size"]),
                ("large", "blarge", info["large"], info["large"] * info["large_size"]),
                ("large-ours", "bours", info["large"], info["large"] * info["large_size"]),
                ("multipart", "bmulti", info["large"], info["large"] * info["large_size"]),
                ("medium", "bmedium", info["medium"], info["medium"] * info["medium_size"])]
    wanted = set(args.datasets.split(","))
    for ds, cont, n, nbytes in [d for d in datasets if d[0] in wanted]:
        names = [t for t in ts if t in only] if only else [t for t in ts if "without quick ACKs" not in t]
        runs: dict[str, list] = {t: [] for t in names}
        for rep in range(args.repeat):  # each round in a rotated order: no tool always runs first
            for name in names[rep % len(names):] + names[:rep % len(names)]:
                dest = (Path("/dev/shm") if args.tmpfs else disk_root) / "appliance-bench-dest"
                shutil.rmtree(dest, ignore_errors=True)
                dest.mkdir()
                os.sync()  # the last run's dirty pages are written before this one starts
                if args.warm:
                    warm_memory(args.warm)
                argv, env, stdin = ts[name](cont, str(dest))
                wall, cpu, rc, tail, user = measure(argv, env, stdin)
                got = sum(1 for p in dest.rglob("*") if p.is_file() and not p.name.startswith(".appliance"))
                runs[name].append((wall, cpu, rc, got, tail, user))
                print(json.dumps({"dataset": ds, "tool": name, "round": rep, "seconds": round(wall, 2),
                                  "client_cpu_s": round(cpu, 2), "client_user_s": round(user, 2), "objects": got,
                                  "rc": rc}), flush=True)
        for name in names:
            rs = runs[name]
            wall = statistics.median(r[0] for r in rs)
            cpu = statistics.median(r[1] for r in rs)
            user = statistics.median(r[5] for r in rs)
            got = min(r[3] for r in rs)
            ok = all(r[2] == 0 and r[3] == n for r in rs)
            row = {"dataset": ds, "tool": name, "concurrency": args.concurrency, "seconds": round(wall, 2),
                   "objects": got, "ok": ok, "objects_per_s": round(n / wall, 1),
                   "mb_per_s": round(nbytes / 1e6 / wall, 1), "client_cpu_s": round(cpu, 2),
                   "client_cpu_ms_per_object": round(1000 * cpu / n, 2),
                   "client_user_ms_per_object": round(1000 * user / n, 2), "repeats": len(rs),
                   "runs_s": [round(r[0], 2) for r in rs], "runs_cpu_s": [round(r[1], 2) for r in rs],
                   "runs_user_s": [round(r[5], 2) for r in rs]}
            if not ok:
                row["error"] = next(r[4] for r in rs if r[2] != 0 or r[3] != n)
            rows.append(row)
            print(json.dumps(row), flush=True)
    shutil.rmtree(Path("/dev/shm") / "appliance-bench-dest", ignore_errors=True)
    if "upload" in wanted:  # a large checkpoint file up to the store: our commit vs the peers' uploads
        src = work / "upload-src"
        src.mkdir(exist_ok=True)
        f = src / "state.data"
        if not f.exists() or f.stat().st_size != args.upload_size:
            with open(f, "wb") as fh:
                for _ in range(args.upload_size // (1 << 20)):
                    fh.write(os.urandom(1 << 20))
        uts = upload_tools(sw, tv, args.baseline)
        names = [t for t in uts if not only or t in only]
        runs = {t: [] for t in names}
        import swiftclient

        swiftclient.Connection(authurl=sw.auth_url, user=sw.user, key=sw.key).put_container("bupload")
        for rep in range(args.repeat):
            for name in names[rep % len(names):] + names[:rep % len(names)]:
                os.sync()
                argv, env, stdin = uts[name](src, "bupload")
                wall, cpu, rc, tail, _ = measure(argv, env, stdin)
                runs[name].append((wall, cpu, rc, tail))
                print(json.dumps({"dataset": "upload", "tool": name, "round": rep, "seconds": round(wall, 2),
                                  "client_cpu_s": round(cpu, 2), "rc": rc}), flush=True)
                empty(sw, "bupload")
        for name in names:
            rs = runs[name]
            wall, cpu = statistics.median(r[0] for r in rs), statistics.median(r[1] for r in rs)
            ok = all(r[2] == 0 for r in rs)
            row = {"dataset": f"upload {args.upload_size / 1e9:.2f} GB", "tool": name, "seconds": round(wall, 2),
                   "ok": ok, "mb_per_s": round(args.upload_size / 1e6 / wall, 1), "client_cpu_s": round(cpu, 2),
                   "objects": 1, "client_cpu_ms_per_object": round(1000 * cpu, 2), "repeats": len(rs),
                   "runs_s": [round(r[0], 2) for r in rs]}
            if not ok:
                row["error"] = next(r[3] for r in rs if r[2] != 0)
            rows.append(row)
            print(json.dumps(row), flush=True)
    # packed shards vs the same data as small objects, with our stager
    for ds, cont in (("packed shards", "bpacked"), ("small objects", "bsmall")) if "packed" in wanted else ():
        dest = disk_root / "dest"
        shutil.rmtree(dest, ignore_errors=True)
        dest.mkdir()
        argv, env, stdin = ts["appliance (swift)"](cont, str(dest))
        wall, cpu, rc, tail, _ = measure(argv, env, stdin)
        rows.append({"dataset": f"{info['small'] * info['small_size'] / 1e9:.2f} GB as {ds}", "tool": "appliance (swift)", "concurrency": args.concurrency,
                     "seconds": round(wall, 2), "ok": rc == 0, "client_cpu_s": round(cpu, 2),
                     "mb_per_s": round(info["small"] * info["small_size"] / 1e6 / wall, 1)})
        print(json.dumps(rows[-1]), flush=True)
    return rows


def write_results(args, out: Path, tv: Path, rows: list[dict], info: dict, disk: float, fs: str) -> None:
    """bench/results/stage[-rgw[-https]].{json,md,png}: this run's rows, and a partial run's (--datasets) others
    kept."""
    stem = "stage" if args.store == "swift" else "stage-rgw-https" if args.tls else "stage-rgw"
    command = "make bench-stage" + ("" if args.store == "swift" else " STORE=rgw") + (" TLS=1" if args.tls else "")
    server = ("Swift 2.38.3 on 127.0.0.1 (2 proxy workers, memcached)" if args.store == "swift" else
              "Ceph RGW (radosgw beast, one memstore OSD) on 127.0.0.1" + (", https only (TLS 1.3, a "
                                                                          "certificate made for the run)"
                                                                          if args.tls else ""))
    prev = out / f"{stem}.json"
    if prev.exists() and set(args.datasets.split(",")) != set(ALL_DATASETS.split(",")):
        # a partial run (--datasets): the other datasets' rows of the last run stay, marked with their own date
        old = json.loads(prev.read_text())
        for r in old.get("rows", []):
            if _category(r["dataset"]) not in args.datasets.split(","):
                rows.append({**r, "measured": r.get("measured", old.get("when"))})
    mine = [a for a in sys.argv[1:] if a not in ("--tools-venv", args.tools_venv, "--store", args.store, "--tls")]
    if mine:  # not what make runs: the whole command, so that the table can be made again
        command += f" (this run: python bench/stage_bench.py {shlex.join(sys.argv[1:])})"
    order = ALL_DATASETS.split(",")
    rows.sort(key=lambda r: order.index(_category(r["dataset"])) if _category(r["dataset"]) in order else 9)
    result = {"command": command, "store": args.store, "machine": f"{os.cpu_count()} cores", "disk_write_mb_s": disk,
              "destination": fs,
              "dataset": info, "rows": rows, "when": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())}
    (out / f"{stem}.json").write_text(json.dumps(result, indent=1))
    lines = [f"# Staging benchmark ({result['when']}, {result['machine']}, `{command}`)", "",
             f"{server}, same machine as the clients. "
             f"Destination: {fs}. Disk write ceiling (dd, fdatasync): {disk} MB/s. "
             f"Concurrency {args.concurrency} for every tool; "
             + (f"each row is the median of {args.repeat} runs, the tools in a rotated order each round."
                if args.repeat > 1 else "each row is one run.")
             + (f" Before each run {args.warm} GiB of tmpfs were written and freed (`--warm`: this VM's memory its "
                "own again, as a bare-metal node's is)." if args.warm else ""), "",
             "Client CPU: user and system time of the tool's processes; \"of it user\": the part in user space "
             "(TLS, hashing, the tool's own code), the rest being the kernel's (socket, page cache).", "",
             "| dataset | tool | s | objects/s | MB/s | client CPU ms/object | of it user | ok |",
             "|---|---|---|---|---|---|---|---|"]
    for r in rows:
        lines.append(f"| {r['dataset']} | {r['tool']} | {r['seconds']} | {r.get('objects_per_s', '')} | "
                     f"{r['mb_per_s']} | {r.get('client_cpu_ms_per_object', '')} | "
                     f"{r.get('client_user_ms_per_object', '')} | {'yes' if r['ok'] else 'NO'} |"
                     + (f" (measured {r['measured']})" if r.get("measured") else ""))
    (out / f"{stem}.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
    plot = tv / "bin" / "python"
    if plot.exists():
        subprocess.run([str(plot), str(ROOT / "bench" / "plot_stage.py"), str(out / f"{stem}.json"),
                        str(out / f"{stem}.png")], check=False)


if __name__ == "__main__":
    main()
