"""The run's metrics as one curve across stops and resumes: a PNG of loss and accuracy over the global step.

The metrics CSV (``step, epoch, metric, value, time``) travels inside every checkpoint (node/checkpointer.py) and
is continued by each resumed job, so the newest committed checkpoint holds the whole run on one step axis. The
run record's jobs mark where each job (each lease, when the lease ended) began and stopped.
"""

from __future__ import annotations

import csv
import io
from pathlib import Path


def read_metrics(text: str) -> dict[str, list[tuple[int, float]]]:
    """metric name -> [(step, value)], in file order."""
    out: dict[str, list[tuple[int, float]]] = {}
    for row in csv.DictReader(io.StringIO(text)):
        try:
            out.setdefault(row["metric"], []).append((int(row["step"]), float(row["value"])))
        except (KeyError, TypeError, ValueError):
            continue
    return out


def step_axis_problems(series: dict[str, list[tuple[int, float]]]) -> list[str]:
    """Where a metric's step axis goes backwards (a restart) instead of continuing."""
    bad = []
    for name, pts in series.items():
        steps = [s for s, _ in pts]
        back = [(a, b) for a, b in zip(steps, steps[1:]) if b < a]
        if back:
            bad.append(f"{name}: step {back[0][0]} is followed by {back[0][1]}")
    return bad


def plot(series: dict[str, list[tuple[int, float]]], jobs: list[dict], path: Path, title: str) -> Path:
    """Loss and accuracy (per step, epoch ends as dots) over the global step; a dashed line where each job after
    the first resumed, labelled with why the one before it stopped."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    panels = [k for k in ("loss", "accuracy") if f"step/{k}" in series or f"epoch/{k}" in series]
    panels = panels or sorted({k.split("/", 1)[-1] for k in series})[:2]
    fig, axes = plt.subplots(len(panels) or 1, 1, figsize=(9, 3.2 * max(1, len(panels))), sharex=True,
                             squeeze=False)
    for ax, k in zip(axes[:, 0], panels):
        if f"step/{k}" in series:
            s, v = zip(*series[f"step/{k}"])
            ax.plot(s, v, lw=1, label=f"{k} (every stop check)")
        if f"epoch/{k}" in series:
            s, v = zip(*series[f"epoch/{k}"])
            ax.plot(s, v, "o", ms=4, label=f"{k} (epoch end)")
        for j in jobs[1:]:
            if j.get("first_step") is not None:
                ax.axvline(j["first_step"], ls="--", color="grey", lw=1)
        ax.set_ylabel(k)
        ax.grid(alpha=0.3)
        ax.legend(loc="best", fontsize=8)
    top = axes[0, 0]
    for i, j in enumerate(jobs[1:], start=2):
        if j.get("first_step") is not None:
            top.annotate(f"job {i} resumed", (j["first_step"], 1), xycoords=("data", "axes fraction"),
                         rotation=90, va="top", ha="right", fontsize=7, color="grey")
    axes[-1, 0].set_xlabel("global step")
    fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path
