"""Plot bench/results/stage*.json (run by stage_bench.py with the bench tools' Python, which has matplotlib)."""

import json
import sys

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

res = json.load(open(sys.argv[1]))
rows = res["rows"]
small = [r for r in rows if r["dataset"] == "small"]
large = [r for r in rows if r["dataset"] == "large"]
ours = [r for r in rows if r["dataset"] == "large-ours"]
multi = [r for r in rows if r["dataset"] == "multipart"]
medium = [r for r in rows if r["dataset"] == "medium"]
upload = [r for r in rows if r["dataset"].startswith("upload")]
panels = 3 + bool(ours) + bool(multi) + bool(medium) + bool(upload)
fig, axes = plt.subplots(1, panels, figsize=(5 * panels, 4.5))
axes[0].barh([r["tool"] for r in small], [r["objects_per_s"] for r in small], color="tab:blue")
axes[0].set_xlabel("objects/s (higher is better)")
axes[0].set_title(f"{res['dataset']['small']} x {res['dataset']['small_size'] // 1024} KB")
axes[1].barh([r["tool"] for r in small], [r["client_cpu_ms_per_object"] for r in small], color="tab:orange")
axes[1].set_xlabel("client CPU ms per object (lower is better)")
axes[1].set_title("client cost, small objects")
axes[2].barh([r["tool"] for r in large], [r["mb_per_s"] for r in large], color="tab:green")
axes[2].axvline(res["disk_write_mb_s"], color="k", ls="--", label=f"disk write {res['disk_write_mb_s']} MB/s")
axes[2].set_xlabel("MB/s (higher is better)")
axes[2].set_title(f"{res['dataset']['large']} x {res['dataset']['large_size'] // 2**20} MB")
axes[2].legend(loc="lower right")
nxt = 3
if ours:
    axes[nxt].barh([r["tool"] for r in ours], [r["mb_per_s"] for r in ours], color="tab:cyan")
    axes[nxt].axvline(res["disk_write_mb_s"], color="k", ls="--")
    axes[nxt].set_xlabel("MB/s (higher is better)")
    axes[nxt].set_title("the same size, put by `appliance data upload`\n(our stager checks their CRC-32)")
    nxt += 1
if multi:
    axes[nxt].barh([r["tool"] + ("" if r["ok"] else " (FAILED)") for r in multi], [r["mb_per_s"] for r in multi],
                   color=["tab:olive" if r["ok"] else "tab:red" for r in multi])
    axes[nxt].axvline(res["disk_write_mb_s"], color="k", ls="--")
    axes[nxt].set_xlabel("MB/s (higher is better)")
    axes[nxt].set_title("the same, uploaded as `aws s3 cp` does (8 MiB parts)")
    nxt += 1
if medium:
    axes[nxt].barh([r["tool"] for r in medium], [r["mb_per_s"] for r in medium], color="tab:brown")
    axes[nxt].axvline(res["disk_write_mb_s"], color="k", ls="--")
    axes[nxt].set_xlabel("MB/s (higher is better)")
    axes[nxt].set_title(f"{res['dataset']['medium']} x {res['dataset']['medium_size'] // 2**20} MB")
    nxt += 1
if upload:
    axes[nxt].barh([r["tool"] for r in upload], [r["mb_per_s"] for r in upload], color="tab:purple")
    axes[nxt].set_xlabel("MB/s (higher is better)")
    axes[nxt].set_title(f"up: {upload[0]['dataset']}")
store = {"rgw": "Ceph RGW", "swift": "Swift"}.get(res.get("store", "swift"), res.get("store"))
fig.suptitle(f"Staging from a real {store} on 127.0.0.1 ({res['machine']}, {res['when']}); `{res['command']}`")
fig.tight_layout()
fig.savefig(sys.argv[2], dpi=110)
print("wrote", sys.argv[2])
