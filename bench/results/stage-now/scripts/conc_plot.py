"""concurrency.txt -> the medians per (concurrency, tool) and concurrency.png. Usage: conc_plot.py concurrency.txt"""
import re, statistics as st, sys
from collections import defaultdict
import matplotlib
matplotlib.use("Agg")
import matplotlib.pyplot as plt

rows = defaultdict(list)
for line in open(sys.argv[1]):
    m = re.match(r"conc=(\d+)\s+(.+?)\s+r\d+ rc=0 .* ms/obj=([\d.]+) obj/s=(\d+)", line)
    if m:
        rows[(int(m[1]), m[2])].append((float(m[4]), float(m[3])))
tools = sorted({t for _, t in rows})
concs = sorted({c for c, _ in rows})
print("| concurrency | " + " | ".join(f"{t}: objects/s (ms/object)" for t in tools) + " |")
print("|---" * (len(tools) + 1) + "|")
for c in concs:
    print(f"| {c} | " + " | ".join(f"{st.median(o for o, _ in rows[c, t]):.0f} ({st.median(m for _, m in rows[c, t]):.2f})"
                                   for t in tools) + " |")
fig, ax = plt.subplots(figsize=(6, 4))
for t in tools:
    ax.plot(concs, [st.median(o for o, _ in rows[c, t]) for c in concs], marker="o", label=t)
ax.set_xlabel("concurrency (parallel transfers)"); ax.set_ylabel("objects/s (median)"); ax.set_xticks(concs)
ax.set_title("100 KB objects from Ceph RGW over https, 2 cores"); ax.legend(); ax.grid(alpha=0.3)
fig.tight_layout(); fig.savefig(sys.argv[1].rsplit(".", 1)[0] + ".png", dpi=100)
