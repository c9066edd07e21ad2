"""Plot bench/results/ckpt.json (run by ckpt_bench.py with the bench tools' Python, which has matplotlib)."""

import json
import sys

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

res = json.load(open(sys.argv[1]))
fig, axes = plt.subplots(1, 3, figsize=(15, 4.5))
ov = res["overhead"]
labels = [f"hidden {o['hidden']}\n{(o['checkpoint_bytes'] or 0) / 1e6:.1f} MB ckpt" for o in ov]
x = range(len(ov))
axes[0].bar([i - 0.2 for i in x], [o["ratio_stopcheck"] for o in ov], 0.4, label="stop check only")
axes[0].bar([i + 0.2 for i in x], [o["ratio_ckpt"] for o in ov], 0.4, label=f"async ckpt+upload")
axes[0].axhline(0.98, color="k", ls="--", label="goal 0.98")
axes[0].set_xticks(list(x), labels)
axes[0].set_ylim(0.8, 1.05)
axes[0].set_ylabel("steps/s relative to plain Horovod")
axes[0].legend(loc="lower right")
axes[0].set_title("checkpointing overhead")
tr = res["trials"]
for h in sorted({t["hidden"] for t in tr}):
    v = [t["deadline_to_commit_s"] for t in tr if t["hidden"] == h and t["deadline_to_commit_s"] is not None]
    axes[1].plot(sorted(v), marker="o", ls="", label=f"hidden {h}")
axes[1].set_ylabel("seconds")
axes[1].set_xlabel("trial (sorted)")
axes[1].set_title("deadline -> committed checkpoint")
axes[1].legend()
lost = [t["steps_lost"] for t in tr]
axes[2].plot([i for i, v in enumerate(lost) if v is not None], [v for v in lost if v is not None], "o",
             color="tab:green", label="steps lost")  # points: a bar of height 0 does not show
axes[2].plot([i for i, v in enumerate(lost) if v is None], [-0.5 for v in lost if v is None], "x", color="tab:red",
             label="not committed / unknown")
axes[2].legend(loc="upper right")
axes[2].set_xlabel("trial (random lease-end moment)")
axes[2].set_ylabel("steps lost (goal 0)")
axes[2].set_ylim(-1, max(5, max((t["steps_lost"] or 0) for t in tr) + 1))
axes[2].set_title(f"steps lost at the lease end, {len(tr)} trials")
fig.suptitle(f"`make bench-ckpt` ({res['machine']})")
fig.tight_layout()
fig.savefig(sys.argv[2], dpi=110)
print("wrote", sys.argv[2])
