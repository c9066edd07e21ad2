"""Our stager through the Swift API, beside the same at another checkout and through S3, on one Ceph RGW over https.

    python bench/results/stage-swift-token/ab.py N SIZE --baseline WORKTREE [--rounds R] [--put ours|plain|multipart]
        [--each-api | --keystone]

N objects of SIZE random bytes, put as `appliance data upload` puts them (SwiftStore.put: CRC_META; or --put),
staged by `appliance.node.stage_main` at 32 parallel transfers with v1 auth (what bench/stage_bench.py gives it)
through the Swift API from this checkout and from WORKTREE, and with the RGW's S3 keys through S3, in that order
each round; with --each-api, through S3 and through the Swift API each from this checkout and from WORKTREE. With
--keystone, on the local cloud instead, as Chameleon's nodes stage a swift:// URL (OS_CLOUD only): an application
credential of the job's own, a token from its Keystone, the store from the catalog, its Ceph RGW (http) validating
the token with Keystone; through the Swift API from this checkout and from WORKTREE (bench/results/stage-swift-auth).
Before each run the last one's pages are written and the page cache dropped. Prints one line per run and the
medians; each run's CPU is the stager process's (stage_bench.measure).
"""

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[3]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))

import stage_bench as sb  # noqa: E402
from appliance.localcloud.rgw_server import RGWServer  # noqa: E402
from appliance.store.objects import StoreCreds, SwiftStore  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("n", type=int)
    ap.add_argument("size", type=int)
    ap.add_argument("--baseline", required=True, help="a worktree of the commit before (its extensions built)")
    ap.add_argument("--rounds", type=int, default=10)
    ap.add_argument("--put", choices=("ours", "plain", "multipart"), default="ours",
                    help="how the objects are put: as `appliance data upload` does (CRC_META), by boto3 in one PUT "
                         "(their MD5 is all that checks them), or by boto3 in 8 MiB parts as `aws s3 cp`")
    ap.add_argument("--each-api", action="store_true", help="both APIs at both checkouts (bench/results/tls-read-ahead)")
    ap.add_argument("--keystone", action="store_true", help="the local cloud's Keystone and Ceph RGW, an application "
                                                            "credential (bench/results/stage-swift-auth)")
    ap.add_argument("--work", default="/var/tmp/appliance-swift-token")
    args = ap.parse_args()
    work = Path(args.work)
    shutil.rmtree(work, ignore_errors=True)
    work.mkdir(parents=True)
    rev = subprocess.run(["git", "-C", args.baseline, "rev-parse", "--short", "HEAD"], capture_output=True,
                         text=True).stdout.strip()
    if args.keystone:
        return keystone(args, rev, work)
    sw = RGWServer(work / "rgw", tls=True).start()
    os.environ.update(sb.ca_env(sw))
    try:
        c = sw.credentials()
        SwiftStore("one", StoreCreds(auth_url=sw.auth_url, user=sw.user, key=sw.key)).ensure_container()
        st = SwiftStore("one", StoreCreds(auth_url=sw.auth_url, user=sw.user, key=sw.key))
        big = work / "big"
        big.write_bytes(os.urandom(args.size))
        for i in range(args.n):
            if args.put == "ours":
                st.put(f"o{i}", big)
            else:
                from boto3.s3.transfer import TransferConfig

                part = 8 << 20 if args.put == "multipart" else 5 << 30
                sb.multipart_client(sw).upload_file(str(big), "one", f"o{i}", Config=TransferConfig(
                    multipart_threshold=part, multipart_chunksize=part))
        swift = StoreCreds(auth_url=sw.auth_url, user=sw.user, key=sw.key).scoped()
        s3 = StoreCreds(s3_endpoint=sw.s3_endpoint, s3_access_key=c["s3_access_key"],
                        s3_secret_key=c["s3_secret_key"])
        tools = [("swift", "swift://one/", swift, ROOT), (f"swift at {rev}", "swift://one/", swift, args.baseline),
                 ("s3", "s3://one/", s3, ROOT)]
        if args.each_api:
            tools = [("s3", "s3://one/", s3, ROOT), (f"s3 at {rev}", "s3://one/", s3, args.baseline), *tools[:2]]
        alternate(tools, args, work, args.put)
    finally:
        sw.stop()
        shutil.rmtree(work, ignore_errors=True)


def alternate(tools: list, args, work: Path, what: str) -> None:
    """Each (name, URL, creds, checkout) of ``tools`` in turn, ``args.rounds`` times; each run's line, the medians."""
    runs: dict[str, list] = {t[0]: [] for t in tools}
    for _ in range(args.rounds):
        for name, url, creds, root in tools:
            dest = tempfile.mkdtemp(dir=work)
            os.sync()
            Path("/proc/sys/vm/drop_caches").write_text("1")
            job = {"url": url, "dest": dest, "mode": "full", "rank": 0, "nodes": 1, "concurrency": 32,
                   "creds": creds.__dict__}
            env = {**os.environ, "PYTHONPATH": str(root)}
            wall, cpu, rc, tail, user = sb.measure([sys.executable, "-P", "-m", "appliance.node.stage_main"],
                                                   env, json.dumps(job))
            if rc:
                raise SystemExit(f"{name}: rc {rc}: {tail}")
            runs[name].append((wall, cpu, user))
            print(f"{name}: wall {wall:.3f} s, cpu {cpu:.3f} s, user {user:.3f} s", flush=True)
            shutil.rmtree(dest)
    print(f"medians of {args.rounds}, {args.n} x {args.size} bytes ({what}):")
    for name, rs in runs.items():
        print(f"  {name}: wall {statistics.median(r[0] for r in rs):.3f} s, "
              f"cpu {statistics.median(r[1] for r in rs):.3f} s, user {statistics.median(r[2] for r in rs):.3f} s")


def keystone(args, rev: str, work: Path) -> None:
    """--keystone: the objects in the local cloud's store, staged with an application credential of their own."""
    from appliance import localcloud, sites

    for var in ("ST_AUTH", "ST_USER", "ST_KEY", "AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY"):
        os.environ.pop(var, None)
    localcloud.start()
    withdraw = None
    try:
        site = sites.open_site("local")
        creds = site.store_creds()
        assert creds.token and not creds.user, "not the Keystone path"
        store = SwiftStore("ksab", creds)
        store.ensure_container()
        f = work / "obj"
        f.write_bytes(os.urandom(args.size))
        for i in range(args.n):
            store.put(f"o{i}", f)
        node, withdraw = site.job_store_creds("swift://ksab/", name="ksab", lease_end=None)
        assert node.app_cred
        alternate([("swift", "swift://ksab/", node, ROOT), (f"swift at {rev}", "swift://ksab/", node, args.baseline)],
                  args, work, "ours, a Keystone application credential")
    finally:
        if withdraw is not None:
            withdraw()
        localcloud.stop()
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
