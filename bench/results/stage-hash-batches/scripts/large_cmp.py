import json, os, sys, shutil, subprocess, time, resource, argparse
from pathlib import Path
sys.path.insert(0, "/work/main"); sys.path.insert(0, "/work/main/bench")
import stage_bench as sb
from appliance.localcloud.rgw_server import RGWServer
from appliance.store.objects import StoreCreds
from nodedisk import node_disk
roots = sys.argv[1].split(","); rounds = int(sys.argv[2]); WRAP = sys.argv[3].split() if len(sys.argv) > 3 else []; DS = os.environ.get("DS", "large-ours")
work = Path("/var/tmp/appliance-exp"); work.mkdir(parents=True, exist_ok=True)
ns = argparse.Namespace(datasets=DS, small=0, small_size=0, large=8, large_size=256 << 20, work=str(work), upload_size=0)
sw = RGWServer(work / "rgw2", memstore_bytes=sb.store_bytes(ns), tls=True).start()
os.environ.update(sb.ca_env(sw))
tv = Path("/work/main/bench/.venv-tools")
try:
    sb.seed_ours(sw, ns) if DS == "large-ours" else sb.seed(sw, ns)
    BUCKET = {"large-ours": "bours", "large": "blarge", "multipart": "bmulti"}[DS]
    base_env, ak, sk = sb.tool_env(sw, tv)
    with node_disk(work, 4 << 30) as (root, fs):
        for r in range(rounds):
            for rt in roots[r % len(roots):] + roots[:r % len(roots)]:
                cmd = [sys.executable, "-P", "-m", "appliance.node.stage_main"]; env = {**base_env, "PYTHONPATH": rt}
                if rt == "s5cmd":
                    cmd = [f"{tv}/bin/s5cmd", "--endpoint-url", sw.s3_endpoint, "--numworkers", "32", "cp", f"s3://{BUCKET}/*", None]; env = base_env
                dest = root / "dest"; shutil.rmtree(dest, ignore_errors=True); dest.mkdir(); os.sync()
                s3 = StoreCreds(s3_endpoint=sw.s3_endpoint, s3_access_key=ak, s3_secret_key=sk)
                job = {"url": f"s3://{BUCKET}/", "dest": str(dest), "mode": "full", "rank": 0, "nodes": 1, "concurrency": 32, "creds": s3.__dict__}
                b = os.times(); t = time.time(); rb = resource.getrusage(resource.RUSAGE_CHILDREN)
                cmd = [str(dest) + "/" if c is None else c for c in cmd]
                p = subprocess.run(WRAP + cmd, env=env, input=json.dumps(job), capture_output=True, text=True)
                w = time.time() - t; a = os.times(); ra = resource.getrusage(resource.RUSAGE_CHILDREN)
                print("".join(l + "\n" for l in p.stderr.splitlines() if l.startswith("HASHSTATS")), end=""); print(f"{rt:14s} r{r} rc={p.returncode} wall={w:.2f} user={a.children_user-b.children_user:.2f} sys={a.children_system-b.children_system:.2f} vcs={ra.ru_nvcsw-rb.ru_nvcsw} ivcs={ra.ru_nivcsw-rb.ru_nivcsw}", flush=True)
finally:
    sw.stop()
