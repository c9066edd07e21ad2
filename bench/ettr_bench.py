"""A managed run's effective training time ratio (ETTR) over four leases, cold and warm, with Chameleon's bare-metal
boot modelled.

`make bench-ettr` runs it. A local cloud of its own (a temporary APPLIANCE_HOME) whose clock runs 60 times real time
and whose servers take 15 real seconds to boot (15 minutes of the cloud's time), as bench/handover_bench.py. The
digits run (`appliance run`, its controller in this process) goes through three lease ends, so four leases: cold
(lease.overlap 0s) and warm (its next cluster made while the job trains). At each lease the clock jumps, after the
job's first commit there, to 6 hours before the lease's end, then (warm: once the next cluster is up) to 9 minutes
before it: the job stops with a commit and the handover follows. After the fourth job's first commit the run is
cancelled (its training to the end would only add training time here).

Measured, on this machine: each handover's downtime by phase (the timeline's "downtime" events) and the run's first
start (the controller's start to the first job's first step), the jobs' training and each commit's stall of the
training (rank 0's save_s: the upload runs beside the training), and the steps lost (0 expected). The run's own ETTR
on the controller's clock is reported too, but the clock jumps make its leases minutes long, so it says little.

Modelled, with 7-day leases: a boot is 15 minutes (its measured seconds less the 15 s simulated boot, times 60, for
the wait for the hosts' cleaning in it, as handover_bench.py); a checkpoint is committed every CKPT_EVERY of training
at the measured stall each. Cold: each next lease starts at the handover, so each job after the first trains
LEASE - stop_margin - its handover's downtime, and the leases follow each other (the run's time per lease is LEASE).
Warm: the next lease starts lease.overlap (OVERLAP) before the end and its cluster
is up by then: a job trains LEASE - OVERLAP - downtime, in a period of LEASE - OVERLAP. ETTR = training less the
checkpoint stalls, over the run's time from its start to its fourth lease's end.

    python bench/ettr_bench.py [OUT_DIR]      # default bench/results
"""

from __future__ import annotations

import datetime as dt
import json
import os
import sys
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from handover_bench import (BOOT_S, CLEAN_S, ROOT, SCALE, _reader, bench_cloud, spec_text,  # noqa: E402
                            to_lease_end, wait_for)

CMD = "make bench-ettr  # python bench/ettr_bench.py bench/results"
LEASES = 4
LEASE = 7 * 24 * 3600.0  # a Chameleon lease at its longest
OVERLAP = 30 * 60.0  # the warm handover's overlap modelled: the boot (15 min) and the staging fit in it
STOP_MARGIN = 20.0  # lease.stop_margin of the runs (handover_bench.spec_text), seconds
CKPT_EVERY = 3600.0  # a commit every hour of training, modelled
BOOT_FULL = 15 * 60.0


def one(name: str, overlap: str, work: Path) -> dict:
    """One managed run through LEASES - 1 lease ends: its timeline, its jobs' results, its ETTR as measured."""
    from appliance import flows, sites
    from appliance.cluster import find_cluster
    from appliance.flows import ettr, managed
    from appliance.store.checkpoints import CheckpointStore

    spec_path = work / f"{name}.yaml"
    spec_path.write_text(spec_text(name, overlap, epochs=400))  # more than 4 leases of training: it never ends
    site = sites.open_site("local")
    cs = CheckpointStore("swift://checkpoints/", name, site.store_creds())
    jobs: list = []
    real_run_job = flows.steps.run_job

    def run_job(*a, **k):  # each job's result: its commits (save_s: the training's stall) and its wall time
        res = real_run_job(*a, **k)
        jobs.append(res)
        return res
    flows.steps.run_job = run_job
    result: dict = {}
    t = threading.Thread(target=lambda: result.update(res=flows.run_managed(str(spec_path), out=lambda line: None)),
                         daemon=True)
    t.start()
    try:
        reader = wait_for("the controller", lambda: _reader(managed, name))
        events = lambda kind: [e for e in (managed.read_timeline(reader) or {}).get("events", [])  # noqa: E731
                               if e["event"] == kind]
        for i in range(LEASES):
            before = newest_step(cs)  # the commit the job resumes from (its stop's, at the handover before it)
            wait_for(f"job {i + 1}", lambda: len(events("job")) > i)
            wait_for(f"job {i + 1}'s first commit", lambda: newest_step(cs) > before)
            if i == LEASES - 1:
                break
            to_lease_end(site, find_cluster(events("job")[-1]["cluster"]), overlap != "0s",
                         lambda: len(events("next cluster ready") + events("next cluster failed")) > i)
            wait_for(f"handover {i + 1}'s downtime", lambda: len(events("downtime")) > i, timeout=900)
        managed.cancel(name)
        t.join(timeout=600)
    finally:
        flows.steps.run_job = real_run_job
    tl = managed.read_timeline(reader) or {}
    for cluster in (name, f"{name}_h"):
        flows.down(cluster)
    return {"overlap": overlap, "timeline": tl.get("events", []), "measured_ettr": ettr.ettr(tl),
            "jobs": [{"job_id": r.job_id, "exit_code": r.exit_code, "wall_s": round(r.wall_s or 0.0, 2),
                      "resumed_step": (r.resumed or {}).get("step"), "stopped_step": (r.stopped or {}).get("step"),
                      "commits": [{k: c.get(k) for k in ("step", "save_s", "upload_s", "bytes")}
                                  for c in r.commits]} for r in jobs]}


def newest_step(cs) -> int:
    """The step of the run's newest commit (0: none yet)."""
    try:
        newest = cs.committed()
    except FileNotFoundError:  # no container yet
        return 0
    return newest[0].step if newest else 0


def boot_scaled(b: dict) -> float:
    """A downtime breakdown's total with its boot at 15 minutes (and the cleaning wait in it at its length)."""
    boot = b.get("boot") or 0.0
    return b["total"] - boot + (BOOT_FULL + max(0.0, boot - BOOT_S) * SCALE if boot else 0.0)


def model(run: dict, warm: bool) -> dict:
    """The run's ETTR with LEASES leases of 7 days (see the module's docstring), from what it measured."""
    events = run["timeline"]
    downs = [e["breakdown"] for e in events if e["event"] == "downtime"]
    d = [boot_scaled(b) for b in downs]
    first_ctl = next(e["at"] for e in events if e["event"] == "controller")
    first_job = run["jobs"][0]
    # the first start: the controller's start to the first job's first step (its boot at 15 min: the run's first
    # `up` boots its servers as a cold handover's does; its boot is the up's, measured as the first downtime's)
    first_step = next((e.get("first_step_at") for e in events if e["event"] == "job end"), None) or first_ctl
    s_measured = first_step - first_ctl
    s = s_measured - BOOT_S + BOOT_FULL
    saves = [c["save_s"] for j in run["jobs"] for c in j["commits"] if c.get("save_s") is not None]
    stall = sum(saves) / len(saves) if saves else 0.0
    lost = sum(max(0, (j["stopped_step"] or 0) - (run["jobs"][i + 1]["resumed_step"] or 0))
               for i, j in enumerate(run["jobs"][:-1]) if j["stopped_step"] is not None)
    train = LEASE - STOP_MARGIN - s  # the first lease
    period = s + train
    for h in range(LEASES - 1):
        dh = d[h] if h < len(d) else (d[-1] if d else 0.0)
        if warm:  # the next lease started OVERLAP before the end, its cluster up: the job starts D after the stop
            job, span = LEASE - OVERLAP - dh, LEASE - OVERLAP
        else:  # the next lease starts at the stop: the downtime is in it
            job, span = LEASE - STOP_MARGIN - dh, LEASE
        train += job
        period += span
    ckpt = train / CKPT_EVERY * stall
    useful = train - ckpt
    return {"ettr": round(useful / period, 5), "run_days": round(period / 86400, 3), "train_s": round(train),
            "downtime_s": [round(x, 1) for x in d], "first_start_s": round(s, 1),
            "first_start_measured_s": round(s_measured, 1), "checkpoint_stall_s": round(stall, 3),
            "checkpoint_s": round(ckpt, 1), "commits": len(saves), "steps_lost": lost, "first_job_wall_s":
            first_job["wall_s"]}


def main() -> int:
    out = Path(sys.argv[1] if len(sys.argv) > 1 else ROOT / "bench" / "results")
    t0 = time.monotonic()
    with bench_cloud("appliance-ettr-") as work:
        cold = one("ettr-cold", "0s", work)
        warm = one("ettr-warm", "359m", work)
    write(out, cold, warm, time.monotonic() - t0)
    return 0 if len([e for e in warm["timeline"] if e["event"] == "downtime"]) == LEASES - 1 else 1


def write(out: Path, cold: dict, warm: dict, wall: float) -> None:
    out.mkdir(parents=True, exist_ok=True)
    when = dt.datetime.now(dt.timezone.utc).strftime("%Y-%m-%d %H:%M UTC")
    mc, mw = model(cold, False), model(warm, True)
    data = {"command": CMD, "measured": when, "cores": os.cpu_count(), "wall_s": round(wall), "time_scale": SCALE,
            "boot_real_s": BOOT_S, "clean_real_s": CLEAN_S, "leases": LEASES, "lease_s": LEASE, "overlap_s": OVERLAP,
            "stop_margin_s": STOP_MARGIN, "ckpt_every_s": CKPT_EVERY, "cold": {**cold, "model": mc},
            "warm": {**warm, "model": mw}}
    (out / "ettr.json").write_text(json.dumps(data, indent=1) + "\n")
    rows = [f"| handover {i + 1} downtime (s, boot at 15 min) | {_v(mc['downtime_s'], i)} | {_v(mw['downtime_s'], i)} |"
            for i in range(LEASES - 1)]
    md = [f"# ETTR of a 4-lease managed run, cold and warm (`{CMD}`, {when}, {os.cpu_count()} cores, the local "
          "cloud)", "",
          f"The digits run (2 nodes) through {LEASES - 1} lease ends on the local cloud (clock {SCALE:g}x, a "
          f"{BOOT_S:g}-s boot: 15 minutes of its clock; the clock jumps to each lease's end), cold (lease.overlap 0s) "
          "and warm. Measured here: each handover's downtime by phase, the run's first start, each commit's stall of "
          "the training (rank 0's save; the upload runs beside the training), the steps lost. Modelled with "
          f"{LEASES} leases of 7 days: the boot at 15 minutes, the warm overlap {OVERLAP / 60:.0f} min, a commit "
          f"every {CKPT_EVERY / 3600:g} h of training (bench/ettr_bench.py says how).", "",
          "| | cold | warm |", "|---|---|---|",
          f"| first start (s, boot at 15 min) | {mc['first_start_s']:.0f} | {mw['first_start_s']:.0f} |", *rows,
          f"| checkpoint stall per commit (s) | {mc['checkpoint_stall_s']:.3f} | {mw['checkpoint_stall_s']:.3f} |",
          f"| steps lost | {mc['steps_lost']} | {mw['steps_lost']} |",
          f"| run time, 4 x 7-day leases (days) | {mc['run_days']:.2f} | {mw['run_days']:.2f} |",
          f"| **ETTR, 7-day leases** | **{mc['ettr']:.4f}** | **{mw['ettr']:.4f}** |",
          f"| ETTR of the bench's own run (its leases minutes long) | {_e(cold)} | {_e(warm)} |", "",
          f"Goal: >= 0.97 warm with 7-day leases: **{'met' if mw['ettr'] >= 0.97 else 'not met'}** "
          f"({mw['ettr']:.4f}). The bench took {wall / 60:.1f} min.", ""]
    (out / "ettr.md").write_text("\n".join(md))
    _plot(out / "ettr.png", mc, mw)
    print("\n".join(md))


def _v(xs: list, i: int) -> str:
    return f"{xs[i]:.1f}" if i < len(xs) else "-"


def _e(run: dict) -> str:
    m = run.get("measured_ettr") or {}
    return f"{m['ettr']:.3f}" if m.get("ettr") is not None else "-"


def _plot(path: Path, mc: dict, mw: dict) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(8, 2.8))
    most = max(m["first_start_s"] + sum(m["downtime_s"]) + m["checkpoint_s"] for m in (mc, mw)) / 3600
    ax.set_xlim(0, most * 1.45)
    for y, (label, m) in enumerate((("warm", mw), ("cold", mc))):
        run_s = m["run_days"] * 86400
        parts = [("first start", m["first_start_s"]), ("handovers", sum(m["downtime_s"])),
                 ("checkpoint stalls", m["checkpoint_s"])]
        x = 0.0
        for i, (k, v) in enumerate(parts):
            ax.barh(y, v / 3600, left=x, color=plt.get_cmap("tab10").colors[i + 1], label=k if y == 0 else None)
            x += v / 3600
        ax.text(x + 0.1, y, f"ETTR {m['ettr']:.4f} of {run_s / 86400:.1f} days", va="center", fontsize=8)
    ax.set_yticks([0, 1], ["warm", "cold"])
    ax.set_xlabel("hours not training over 4 x 7-day leases (modelled from the measured parts)")
    ax.legend(fontsize=7, loc="lower right")
    fig.tight_layout()
    fig.savefig(path, dpi=110)


if __name__ == "__main__":
    sys.exit(main())
