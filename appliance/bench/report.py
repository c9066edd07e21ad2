"""The benchmark's outputs: bench.json, bench.md (the tables) and two PNG plots (img/s vs batch; speedup vs
nodes with the ideal line)."""

from __future__ import annotations

import json
from pathlib import Path


def table(rep: dict) -> list[str]:
    """The throughput and scaling table, as Markdown lines."""
    lines = ["| model | batch/rank | nodes | ranks | samples/s (measured) | speedup | efficiency | allreduce share "
             "| per-rank spread | step ms (w/o allreduce) |",
             "|---|---|---|---|---|---|---|---|---|---|"]
    for s in sorted(rep["scaling"], key=lambda s: (s["model"], s["batch"], s["nodes"])):
        sp = f"{s['speedup']:.2f}x" if s["speedup"] is not None else "-"
        eff = f"{s['efficiency']:.2f}" if s["efficiency"] is not None else "-"
        share = "-" if s["allreduce_share"] is None else f"{100 * s['allreduce_share']:.0f}%"
        local = "-" if s["local_step_ms"] is None else f"{s['local_step_ms']:.1f}"
        lines.append(f"| {s['model']} | {s['batch']} | {s['nodes']} | {s['ranks']} | {s['aggregate']:.1f} | {sp} | "
                     f"{eff} | {share} | {100 * s['per_rank_spread']:.1f}% | {s['step_ms']:.1f} ({local}) |")
    return lines


def overhead_lines(o: dict) -> list[str]:
    return ["| path | samples/s (best of %d) | runs | wall s (launch to exit) |" % o["repeats"],
            "|---|---|---|---|",
            f"| `appliance train` | {o['best']['appliance']} | {', '.join(map(str, o['samples_per_s']['appliance']))} | "
            f"{', '.join(map(str, o['wall_s']['appliance']))} |",
            f"| bare `horovodrun` | {o['best']['bare']} | {', '.join(map(str, o['samples_per_s']['bare']))} | "
            f"{', '.join(map(str, o['wall_s']['bare']))} |",
            "",
            f"ratio appliance / bare: **{o['ratio']}** (goal >= {o['goal']}; median of the per-round ratios "
            f"{o['ratio_median_of_rounds']}); {o['model']}, batch {o['batch']}, {o['steps']} steps, {o['ranks']} "
            f"rank(s) on {o['nodes']} node(s).", "", o["note"] + "."]


def markdown(rep: dict) -> str:
    cfg = rep["config"]
    lines = ["# Training benchmark", "", f"Command: `{rep['command']}`", "",
             f"Device: {rep['device']}. Cluster: {rep['cluster']} ({rep['cloud']}). Models: {', '.join(cfg['models'])}; "
             f"batch sizes per rank: {', '.join(map(str, cfg['batch_sizes']))}; nodes: "
             f"{', '.join(map(str, cfg['nodes']))}; {cfg['steps']} measured steps after {cfg['warmup']} warm-up; "
             f"{cfg['precision']}.", ""]
    if rep.get("note"):
        lines += [f"**{rep['note']}**", ""]
    lines += table(rep) + [""]
    lines += [f"- {k}: {v}" for k, v in rep["definitions"].items()]
    if rep.get("overhead"):
        lines += ["", "## Launch overhead: `appliance train` vs bare `horovodrun`", ""] + overhead_lines(rep["overhead"])
    if rep.get("plots"):
        lines += ["", "Plots: " + ", ".join(f"`{Path(p).name}`" for p in rep["plots"])]
    return "\n".join(lines) + "\n"


def plots(rep: dict, out_dir: Path) -> list[str]:
    """bench-throughput.png (samples/s vs batch, one line per model and node count) and bench-scaling.png
    (speedup vs nodes for every model and batch, with the ideal line). [] when matplotlib is missing."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return []
    models = list(dict.fromkeys(s["model"] for s in rep["scaling"]))
    nodes = sorted({s["nodes"] for s in rep["scaling"]})
    written = []
    fig, axes = plt.subplots(1, len(models), figsize=(5 * len(models), 4), squeeze=False)
    for ax, m in zip(axes[0], models):
        for n in nodes:
            pts = sorted((s["batch"], s["aggregate"]) for s in rep["scaling"] if s["model"] == m and s["nodes"] == n)
            ax.plot([p[0] for p in pts], [p[1] for p in pts], marker="o", label=f"{n} node(s)")
        ax.set_xscale("log", base=2)
        bs = sorted({s["batch"] for s in rep["scaling"] if s["model"] == m})
        ax.set_xticks(bs, [str(b) for b in bs])
        ax.minorticks_off()
        ax.set_xlabel("batch size per rank")
        ax.set_ylabel("samples/s (measured aggregate)")
        ax.set_title(m)
        ax.legend()
    fig.suptitle(f"throughput vs batch: {rep['device']}" + (" (CPU testbed: the path, not the hardware)"
                                                             if rep.get("note") else ""))
    fig.tight_layout()
    p = out_dir / "bench-throughput.png"
    fig.savefig(p, dpi=100)
    plt.close(fig)
    written.append(str(p))
    if len(nodes) > 1:
        fig, ax = plt.subplots(figsize=(6, 4.5))
        base = min(nodes)
        ax.plot(nodes, [n / base for n in nodes], "k--", label="ideal (linear)")
        for m in models:
            for b in sorted({s["batch"] for s in rep["scaling"] if s["model"] == m}):
                pts = sorted((s["nodes"], s["speedup"]) for s in rep["scaling"] if s["model"] == m and s["batch"] == b)
                ax.plot([p[0] for p in pts], [p[1] for p in pts], marker="o", label=f"{m}, batch {b}")
        ax.set_xlabel("nodes")
        ax.set_ylabel(f"speedup over {base} node(s)")
        ax.set_xticks(nodes)
        ax.set_title("speedup vs nodes")
        ax.legend(fontsize=8)
        fig.tight_layout()
        p = out_dir / "bench-scaling.png"
        fig.savefig(p, dpi=100)
        plt.close(fig)
        written.append(str(p))
    return written


def write(rep: dict, out_dir: Path) -> None:
    """bench.json, bench.md and the plots into out_dir (rep gains "plots")."""
    out_dir.mkdir(parents=True, exist_ok=True)
    rep["plots"] = plots(rep, out_dir)
    (out_dir / "bench.json").write_text(json.dumps(rep, indent=1) + "\n")
    (out_dir / "bench.md").write_text(markdown(rep))
