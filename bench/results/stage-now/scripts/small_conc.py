"""Small objects over https from Ceph RGW at several concurrencies, every tool at every one in each round (rotated):
which thread count suits which tool on this machine. Usage: small_conc.py --tls --conc 8,16,32 --rounds 2"""
import argparse, os, resource, shutil, sys
from pathlib import Path
sys.path.insert(0, "/work/main"); sys.path.insert(0, "/work/main/bench")
import stage_bench as sb
from appliance.localcloud.rgw_server import RGWServer
from nodedisk import node_disk

ap = argparse.ArgumentParser()
ap.add_argument("--tls", action="store_true")
ap.add_argument("--small", type=int, default=4000)
ap.add_argument("--rounds", type=int, default=2)
ap.add_argument("--conc", default="8,16,32")
ap.add_argument("--tools", default="appliance (s3),rclone s3,s5cmd")
args = ap.parse_args()
work = Path("/var/tmp/appliance-exp"); work.mkdir(parents=True, exist_ok=True)
ns = argparse.Namespace(datasets="small", small=args.small, small_size=100 * 1024, large=0, large_size=0,
                        work=str(work), upload_size=0)
sw = RGWServer(work / "rgw", memstore_bytes=sb.store_bytes(ns), tls=args.tls).start()
os.environ.update(sb.ca_env(sw))
tv = Path("/work/main/bench/.venv-tools")
try:
    sb.seed(sw, ns)
    runs = [(int(c), t) for c in args.conc.split(",") for t in args.tools.split(",")]
    tools = {int(c): sb.tools(sw, tv, int(c)) for c in args.conc.split(",")}
    with node_disk(work, 3 << 30) as (root, fs):
        for r in range(args.rounds):
            for c, name in runs[r % len(runs):] + runs[:r % len(runs)]:
                dest = root / "dest"; shutil.rmtree(dest, ignore_errors=True); dest.mkdir(); os.sync()
                argv, env, stdin = tools[c][name]("bsmall", str(dest))
                rb = resource.getrusage(resource.RUSAGE_CHILDREN)  # the benchmark's own measure, plus the switches
                w, cpu, rc, out, u = sb.measure(argv, env, stdin)
                vcs = resource.getrusage(resource.RUSAGE_CHILDREN).ru_nvcsw - rb.ru_nvcsw
                got = sum(1 for q in dest.rglob("*") if q.is_file() and not q.name.startswith(".appliance"))
                print(f"conc={c:<3d} {name:16s} r{r} rc={rc} got={got} wall={w:.2f} user={u:.2f} sys={cpu - u:.2f} "
                      f"ms/obj={1000 * cpu / args.small:.3f} obj/s={args.small / w:.0f} "
                      f"vcs/obj={vcs / args.small:.1f}", flush=True)
                if rc:
                    print(out[-600:])
finally:
    sw.stop()
