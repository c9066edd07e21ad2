"""Experiment: small objects over https (and http) from Ceph RGW; ours vs rclone s3; user/sys; optional wrappers."""
import json, os, sys, shutil, subprocess, time, resource, argparse
from pathlib import Path
sys.path.insert(0, "/work/main"); sys.path.insert(0, "/work/main/bench")
import stage_bench as sb
from appliance.localcloud.rgw_server import RGWServer
from nodedisk import node_disk

ap = argparse.ArgumentParser()
ap.add_argument("--tls", action="store_true")
ap.add_argument("--small", type=int, default=4000)
ap.add_argument("--rounds", type=int, default=3)
ap.add_argument("--conc", type=int, default=32)
ap.add_argument("--baseline", default="")
ap.add_argument("--tools", default="appliance (s3),rclone s3")
ap.add_argument("--wrap", default="")  # e.g. "strace -c -f -o /tmp/exp/st.txt"
ap.add_argument("--envx", default="")  # KEY=VAL,KEY=VAL for ours
args = ap.parse_args()
work = Path("/var/tmp/appliance-exp"); work.mkdir(parents=True, exist_ok=True)
ns = argparse.Namespace(datasets="small", small=args.small, small_size=100*1024, large=0, large_size=0, work=str(work), upload_size=0)
sw = RGWServer(work / "rgw", memstore_bytes=sb.store_bytes(ns) if hasattr(sb, "store_bytes") else None, tls=args.tls).start()
os.environ.update(sb.ca_env(sw))
tv = Path("/work/main/bench/.venv-tools")
try:
    sb.seed(sw, ns)
    ts = sb.tools(sw, tv, args.conc, args.baseline)
    with node_disk(work, 3 << 30) as (root, fs):
        for r in range(args.rounds):
            for name in args.tools.split(","):
                dest = root / "dest"; shutil.rmtree(dest, ignore_errors=True); dest.mkdir(); os.sync()
                argv, env, stdin = ts[name](sw and "bsmall", str(dest))
                if args.envx and name.startswith("appliance"):
                    env = {**env, **dict(kv.split("=", 1) for kv in args.envx.split(","))}
                if args.wrap and r == args.rounds - 1:
                    argv = args.wrap.split() + argv
                b = os.times(); t = time.time(); rb = resource.getrusage(resource.RUSAGE_CHILDREN)
                p = subprocess.run(argv, env=env, input=stdin, capture_output=True, text=True)
                w = time.time() - t; a = os.times(); ra = resource.getrusage(resource.RUSAGE_CHILDREN)
                u, s = a.children_user - b.children_user, a.children_system - b.children_system
                got = sum(1 for p2 in dest.rglob("*") if p2.is_file() and not p2.name.startswith(".appliance"))
                print(f"{name:24s} r{r} rc={p.returncode} got={got} wall={w:.2f} user={u:.2f} sys={s:.2f} "
                      f"ms/obj={1000*(u+s)/args.small:.3f} obj/s={args.small/w:.0f} vcs/obj={(ra.ru_nvcsw-rb.ru_nvcsw)/args.small:.1f} ivcs/obj={(ra.ru_nivcsw-rb.ru_nivcsw)/args.small:.1f}", flush=True)
                if p.returncode: print(p.stderr[-600:])
finally:
    sw.stop()
