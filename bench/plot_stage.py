"""Plot bench/results/stage.json (run by stage_bench.py with the bench tools' Python, which has matplotlib)."""

import json
import sys

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

res = json.load(open(sys.argv[1]))
rows = [r for r in res["rows"] if r["dataset"] in ("small", "large")]
fig, axes = plt.subplots(1, 3, figsize=(15, 4.5))
small = [r for r in rows if r["dataset"] == "small"]
large = [r for r in rows if r["dataset"] == "large"]
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
fig.suptitle(f"Staging from a real Swift on 127.0.0.1 ({res['machine']}, {res['when']}); `make bench-stage`")
fig.tight_layout()
fig.savefig(sys.argv[2], dpi=110)
print("wrote", sys.argv[2])
