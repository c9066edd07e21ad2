"""`make bench-ckpt`: what checkpointing costs, and what a lease end costs.

On the local cloud (2 nodes, a real Swift, the lease watchdog), with bench/ckpt_job/ckpt_job.py (MLP, synthetic data):
1. overhead: steps/s with async checkpoint + upload every N steps / steps/s with no appliance code (goal
   >= 0.98); also with only the collective stop check. Best of --repeats interleaved runs per cell (the
   run-to-run spread is reported too).
2. deadline -> commit: at a random moment the cloud's clock jumps to LEAD_S before the deadline, the moment the lease's
   time left reaches the watchdog's margin (from then on the job must stop). The watchdog learns the end at its next
   poll, as it knows a real lease's end from the start; we time from the deadline to the watchdog's stop request and
   on to rank 0's committed checkpoint (the STOP file written, the step in flight + the stop check + save + upload +
   verify).
3. steps lost at the lease end over --trials random end times: the last step any rank ran minus the step
   of the newest committed checkpoint in the store (goal 0). After each trial the lease is extended.
Results: bench/results/ckpt.json, ckpt.md, ckpt.png.
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import random
import re
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from appliance import localcloud  # noqa: E402
from appliance.store.checkpoints import CheckpointStore  # noqa: E402
from appliance import flows, report, sites  # noqa: E402
from appliance.errors import ApplianceError  # noqa: E402
from appliance.sites import load_spec  # noqa: E402
from appliance.flows import run_job as train  # noqa: E402


STOP_MARGIN_S = 20  # lease.stop_margin; the watchdog's margin is max(this, 3 x the slowest commit + 2 polls)
LEAD_S = 3.0  # the clock jumps to this long (real seconds) before the deadline: more than one watchdog poll


def write_spec(d: Path, name: str, command: str, every: int | None) -> str:
    lines = [f"name: {name}", "cloud: local", "nodes: {count: 2, node_type: compute_local, slots: 1}",
             "image: appliance-cpu", f"lease: {{duration: 1d, stop_margin: {STOP_MARGIN_S}s}}", "train:",
             f"  code: {ROOT / 'bench' / 'ckpt_job'}", f"  command: {command}"]
    if every:
        lines.append(f"checkpoint: {{url: swift://bench-ckpt/, every_steps: {every}, keep: 2}}")
    p = d / f"{name}-{abs(hash(command)) % 10**6}-{every}.yaml"
    p.write_text("\n".join(lines) + "\n")
    return str(p)


def lease_left(cluster) -> float:
    """Cloud seconds left, against the local cloud's own clock to the microsecond (its HTTP Date has whole seconds,
    which would place the benchmark's deadline up to 1 s late)."""
    prof = sites.for_cluster(cluster)
    now = dt.datetime.strptime(localcloud.admin("GET", "/clock")["now"], "%Y-%m-%dT%H:%M:%S.%f")
    return (prof.cloud.get_lease(cluster.lease_id).end - now).total_seconds()


def run(spec_path: str, cluster, out=None):
    spec = load_spec(spec_path)
    if spec.checkpoint.url:  # every job starts the run over at step 0: remove the last job's checkpoints first
        flows.data_remove(f"{spec.checkpoint.url.rstrip('/')}/{spec.name}/", cloud="local")
    res = train(spec, cluster, out=out or (lambda line: None))
    return res


def overhead(d: Path, cluster, hidden: int, every: int, repeats: int, epochs: int) -> dict:
    rates: dict[str, list[float]] = {"plain": [], "stopcheck": [], "ckpt": []}
    ckpt_bytes = None
    for _ in range(repeats):
        for mode in rates:
            cmd = f"python ckpt_job.py --mode {mode} --hidden {hidden} --epochs {epochs}"
            res = run(write_spec(d, "bench", cmd, every if mode == "ckpt" else None), cluster)
            assert res.exit_code == 0, res.failure
            r0 = res.results[0]
            rates[mode].append(r0["steps"] / r0["seconds"])
            if mode == "ckpt" and res.commits:
                ckpt_bytes = res.commits[-1]["bytes"]
                params = r0["params"]
    # best of the runs: on this 2-core machine other processes (the co-located object store, the launcher) only ever
    # slow a run down, so the fastest run of each mode is the least disturbed measurement of it
    best = {m: max(v) for m, v in rates.items()}
    return {"hidden": hidden, "params": params, "checkpoint_bytes": ckpt_bytes, "every_steps": every,
            "steps_per_s": {m: round(v, 2) for m, v in best.items()},
            "runs": {m: [round(x, 2) for x in v] for m, v in rates.items()},
            "spread": {m: round((max(v) - min(v)) / max(v), 3) for m, v in rates.items()},
            "ratio_ckpt": round(best["ckpt"] / best["plain"], 4),
            "ratio_stopcheck": round(best["stopcheck"] / best["plain"], 4)}


def lease_trial(d: Path, cluster, hidden: int, every: int, store: CheckpointStore, rng: random.Random) -> dict:
    cmd = f"python ckpt_job.py --mode ckpt --hidden {hidden} --epochs 40"
    marks: dict[str, float] = {}
    started = threading.Event()

    def out(line: str) -> None:
        if "[checkpoint] training: step" in line:  # the job is training (TensorFlow's start is not timed)
            started.set()
        if "[watchdog] lease ends in" in line and "asking the job to stop" in line:
            marks["stop_request"] = time.time()
            m = re.search(r"\(margin ([^)]*)\)", line)
            marks["margin"] = m.group(1) if m else None
        if "[appliance] stop request on the head node" in line:
            marks["stop_written"] = time.time()
        if "[checkpoint] stopped after step" in line:
            marks["committed"] = time.time()

    delay = rng.uniform(0, 10)  # after the job's first step
    scale = sites.for_cluster(cluster).time_scale()

    def jump():
        started.wait(120)
        time.sleep(delay)  # the arbitrary moment: a benchmark may wait, a test may not
        # to LEAD_S before the margin (in the cloud's seconds) before the end: the deadline is LEAD_S from now
        seconds = lease_left(cluster) - (STOP_MARGIN_S + LEAD_S) * scale
        marks["jump"] = time.time()
        localcloud.admin("POST", "/advance", {"seconds": seconds})
        marks["deadline"] = marks["jump"] + LEAD_S

    t = threading.Thread(target=jump, daemon=True)
    t.start()
    res = run(write_spec(d, "bench", cmd, every), cluster, out=out)
    t.join()
    st = res.stopped or {}
    last_run = max(r["steps"] for r in res.results.values()) if res.results else None
    # the checkpoint this job committed when it stopped, as the store has it (the run's older checkpoints, from
    # the overhead runs or earlier trials, are not this trial's)
    newest = next((c.step for c in store.committed() if c.name == st.get("checkpoint")), None)
    return {"delay_s": round(delay, 2), "exit_code": res.exit_code, "stop_step": st.get("step"),
            "committed": st.get("committed"), "last_step_run": last_run, "newest_committed": newest,
            "steps_lost": None if last_run is None or newest is None else last_run - newest,
            "same_step_all_ranks": len({r["steps"] for r in res.results.values()}) == 1,
            "deadline_to_commit_s": round(marks["committed"] - marks["deadline"], 3) if "committed" in marks else None,
            "deadline_to_stop_request_s": round(marks["stop_request"] - marks["deadline"], 3)
            if "stop_request" in marks else None,
            "stop_request_to_commit_s": round(marks["committed"] - marks["stop_request"], 3)
            if "committed" in marks and "stop_request" in marks else None,
            "stop_request_to_decided_s": round(st["decided_at"] - marks["stop_request"], 3)
            if st.get("decided_at") and "stop_request" in marks else None,
            "decided_to_commit_s": round(marks["committed"] - st["decided_at"], 3)
            if st.get("decided_at") and "committed" in marks else None,
            "decided_to_reported_s": round(st["reported_at"] - st["decided_at"], 3)
            if st.get("decided_at") and st.get("reported_at") else None,
            "reported_to_launcher_s": round(marks["committed"] - st["reported_at"], 3)
            if st.get("reported_at") and "committed" in marks else None,
            "stop_reason": st.get("reason"),
            "margin": marks.get("margin"), "checkpoint_bytes": res.commits[-1]["bytes"] if res.commits else None,
            "rank0_stop_to_commit_s": st.get("seconds"),
            # the stop's parts, one after the other (None where a mark is missing)
            "parts_s": _parts(dict(marks, **{k: st.get(k) for k in (
                "decided_at", "finish_at", "last_rank_at", "gathered_at", "saved_at", "reported_at")})),
            "uploading_at_stop": st.get("uploading_at_stop")}


PARTS = [("stop_request", "stop_written"), ("stop_written", "decided_at"), ("decided_at", "finish_at"),
         ("finish_at", "last_rank_at"), ("last_rank_at", "gathered_at"), ("gathered_at", "saved_at"),
         ("saved_at", "reported_at"), ("reported_at", "committed")]


def _parts(m: dict) -> dict:
    """Each consecutive pair of marks: the seconds between them (the launcher's and the node's clocks are one
    machine's here)."""
    return {f"{a}->{b}": round(m[b] - m[a], 3) if m.get(a) and m.get(b) else None for a, b in PARTS}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--trials", type=int, default=20)
    ap.add_argument("--every", type=int, default=250)
    ap.add_argument("--hidden", type=int, nargs="+", default=[512, 1536])
    ap.add_argument("--epochs", type=int, default=20)
    ap.add_argument("--skip-overhead", action="store_true", help="only the lease-end trials (keeps the last overhead)")
    ap.add_argument("--out", default=str(ROOT / "bench" / "results"))
    ap.add_argument("--tools-venv", default=str(ROOT / "bench" / ".venv-tools"))
    args = ap.parse_args()
    rng = random.Random(20261122)
    d = Path(tempfile.mkdtemp(prefix="bench-ckpt-"))
    localcloud.start()
    base = write_spec(d, "bench", "python ckpt_job.py", None)
    cluster = flows.up(base)
    store = CheckpointStore("swift://bench-ckpt/", "bench", sites.open_site("local").store_creds())
    result = {"command": "make bench-ckpt" if not args.skip_overhead else
              "make bench-ckpt for the overhead; the trials: python bench/ckpt_bench.py --skip-overhead",
              "machine": "2 cores, the local cloud's Ceph RGW (through its Swift API, swift://bench-ckpt/) on the same "
                         "machine + 2 netns nodes",
              "overhead": [], "trials": []}
    try:
        if not args.skip_overhead:  # what one collective stop check costs (bench/ckpt_job/stopcheck_cost.py)
            lines: list[str] = []
            res = run(write_spec(d, "bench", "python stopcheck_cost.py", None), cluster, out=lines.append)
            got = [ln.split("STOPCHECK_COST ", 1)[1] for ln in lines if "STOPCHECK_COST " in ln]
            assert res.exit_code == 0 and got, res.failure
            result["stopcheck_cost"] = json.loads(got[-1])
            print(f"stop check: {result['stopcheck_cost']}", flush=True)
        for h in [] if args.skip_overhead else args.hidden:
            print(f"overhead, hidden {h}", flush=True)
            result["overhead"].append(overhead(d, cluster, h, args.every, args.repeats, args.epochs))
            print(json.dumps(result["overhead"][-1]), flush=True)
        for i in range(args.trials):
            h = args.hidden[i % len(args.hidden)]
            tr = lease_trial(d, cluster, h, 200, store, rng)
            tr["hidden"] = h
            result["trials"].append(tr)
            print(f"trial {i + 1}/{args.trials}: {json.dumps(tr)}", flush=True)
            try:  # the next trial gets a fresh day of lease
                sites.for_cluster(cluster).cloud.extend_lease(
                    cluster.lease_id, by=dt.timedelta(days=1))
            except ApplianceError as e:  # the job's teardown outlasted the 30 s left: the lease ended, re-lease
                print(f"({e}; a new lease for the next trial)", flush=True)
                cluster = flows.up(base)
    finally:
        flows.down("bench")
    prev = Path(args.out) / "ckpt.json"
    if prev.exists():  # a partial re-run (--trials 0, or --hidden ...) keeps the other half of the last results
        old = json.loads(prev.read_text())
        if not result["trials"]:
            result["trials"] = old.get("trials", [])
        if not result["overhead"]:
            result["overhead"] = old.get("overhead", [])
            result.setdefault("stopcheck_cost", old.get("stopcheck_cost"))
    trials = result["trials"]
    lost = [t["steps_lost"] for t in trials if t["steps_lost"] is not None]
    result["summary"] = {
        "ratio_ckpt": {o["hidden"]: o["ratio_ckpt"] for o in result["overhead"]},
        "ratio_stopcheck": {o["hidden"]: o["ratio_stopcheck"] for o in result["overhead"]},
        "trials": len(trials), "stopped_and_committed": sum(1 for t in trials if t["committed"]),
        "steps_lost_max": max(lost) if lost else None, "steps_lost_total": sum(lost) if lost else None,
        **{k: {h: sorted(t[k] for t in trials if t["hidden"] == h and t.get(k) is not None)
               for h in sorted({t["hidden"] for t in trials})}
           for k in ("deadline_to_commit_s", "deadline_to_stop_request_s", "stop_request_to_commit_s",
                     "stop_request_to_decided_s", "decided_to_commit_s", "decided_to_reported_s",
                     "reported_to_launcher_s", "rank0_stop_to_commit_s")},
        "parts_s": {h: {f"{a}->{b}": sorted(t["parts_s"][f"{a}->{b}"] for t in trials if t["hidden"] == h
                                            and (t.get("parts_s") or {}).get(f"{a}->{b}") is not None)
                        for a, b in PARTS}
                    for h in sorted({t["hidden"] for t in trials})},
    }
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "ckpt.json").write_text(json.dumps(result, indent=1))
    (out / "ckpt.md").write_text(render(result))
    plot = Path(args.tools_venv) / "bin" / "python"
    if plot.exists():
        subprocess.run([str(plot), str(ROOT / "bench" / "plot_ckpt.py"), str(out / "ckpt.json"),
                        str(out / "ckpt.png")], check=False)
    print((out / "ckpt.md").read_text())
    return 0


def render(r: dict) -> str:
    s = r["summary"]
    lines = ["# Checkpoint benchmark", "", f"Command: {r['command']}.", "",
             f"Machine: {r['machine']}. Job: bench/ckpt_job/ckpt_job.py (MLP, synthetic data, 2 ranks).", "",
             "## Step rate with checkpoints / without (goal >= 0.98)", "",
             "Best of the interleaved runs of each mode; `spread` is (max - min) / max over a mode's runs.", "",
             "| hidden | params | checkpoint | every | plain steps/s | stop check only | async ckpt+upload | "
             "ratio ckpt | ratio stop check | spread (plain/stop/ckpt) |", "|---|---|---|---|---|---|---|---|---|---|"]
    for o in r["overhead"]:
        sp = o["steps_per_s"]
        lines.append(f"| {o['hidden']} | {o['params']:,} | {(o['checkpoint_bytes'] or 0) / 1e6:.1f} MB | "
                     f"{o['every_steps']} | {sp['plain']} | {sp['stopcheck']} | {sp['ckpt']} | "
                     f"**{o['ratio_ckpt']}** | {o['ratio_stopcheck']} | "
                     f"{' / '.join(str(o.get('spread', {}).get(m, '-')) for m in ('plain', 'stopcheck', 'ckpt'))} |")
    sc = r.get("stopcheck_cost")
    if sc:
        lines += ["", f"One collective stop check (bench/ckpt_job/stopcheck_cost.py, {sc['calls']} calls on 2 nodes): "
                  f"mean {sc['mean_ms']} ms, p50 {sc['p50_ms']}, p90 {sc['p90_ms']}, p99 {sc['p99_ms']} ms. The "
                  "Checkpointer checks every 0.5 s (APPLIANCE_STOP_CHECK_SECONDS): "
                  f"{sc['mean_ms'] / 500 * 100:.2f}% of the time at that mean."]
    lines += ["", "## Lease end: deadline signal -> committed checkpoint, steps lost (goal 0)", "",
              f"{s['trials']} trials at random moments; {s['stopped_and_committed']} stopped with a committed "
              f"checkpoint; steps lost: max **{s['steps_lost_max']}**, total {s['steps_lost_total']}.", "",
              "The deadline is the moment the lease's time left reaches the watchdog's margin. At a random moment the "
              f"cloud's clock jumps to {LEAD_S:g} s before it, so the watchdog learns the end at its next poll, as it "
              "knows a real lease's end from the start. Each cell: min / median / max seconds (negative: before the "
              "deadline).", "",
              "| hidden | deadline -> commit | deadline -> stop request (watchdog) | stop request -> commit "
              "| stop request -> the ranks agree (STOP written, next stop check) "
              "| agreed -> rank 0 reports the commit | of which save + upload + verify | rank 0's line -> "
              "the launcher |", "|---|---|---|---|---|---|---|---|"]

    def cell(v):
        return f"{v[0]:.2f} / {statistics.median(v):.2f} / {v[-1]:.2f}" if v else "-"

    for h, v in s["deadline_to_commit_s"].items():
        lines.append(f"| {h} | {cell(v)} | {cell(s.get('deadline_to_stop_request_s', {}).get(h))} | "
                     f"{cell(s.get('stop_request_to_commit_s', {}).get(h))} | "
                     f"{cell(s.get('stop_request_to_decided_s', {}).get(h))} | "
                     f"{cell(s.get('decided_to_reported_s', {}).get(h))} | "
                     f"{cell(s.get('rank0_stop_to_commit_s', {}).get(h))} | "
                     f"{cell(s.get('reported_to_launcher_s', {}).get(h))} |")
    parts = s.get("parts_s") or {}
    if any(any(v.values()) for v in parts.values()):
        names = {"stop_request->stop_written": "STOP file written (SSH)",
                 "stop_written->decided_at": "-> the ranks agree (next stop check)",
                 "decided_at->finish_at": "-> rank 0 starts the stop's save",
                 "finish_at->last_rank_at": "-> the last rank there too",
                 "last_rank_at->gathered_at": "-> RNG states gathered",
                 "gathered_at->saved_at": "-> saved on the node",
                 "saved_at->reported_at": "-> uploaded, verified, committed",
                 "reported_at->committed": "-> the launcher sees it"}
        lines += ["", "Where the stop's time goes, one part after the other (min / median / max seconds; the marks are "
                  "the launcher's lines and rank 0's STOPPED line, every rank's arrival at the stop's gather):", "",
                  "| hidden | " + " | ".join(names[f"{a}->{b}"] for a, b in PARTS) + " |",
                  "|---|" + "---|" * len(PARTS)]
        for h, v in parts.items():
            lines.append(f"| {h} | " + " | ".join(cell(v.get(f"{a}->{b}")) for a, b in PARTS) + " |")
    other = [t for t in r["trials"] if t.get("stop_reason") and not re.match(r"lease \S+ ends ", t["stop_reason"])]
    if other:
        lines += ["", "Trials the node stopped by another path first: " + "; ".join(
            f"hidden {t['hidden']}, step {t['stop_step']}: {t['stop_reason']}" for t in other) + "."]
    lines += ["", "The watchdog polls the lease every 0.5 s on the local cloud (`site.lease_poll`; 60 s on Chameleon) "
              "and sleeps until the margin once it is within a poll; the cloud's time is its HTTP Date (whole seconds) "
              "placed between reads by `CloudClock`. Stop request -> commit: the launcher writes the STOP file on the "
              "head node, rank 0 reads it at the next collective stop check (every 0.5 s), every rank stops after the "
              "same step, rank 0 saves, uploads and verifies.", ""]
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    with report.to(lambda m: print(m, flush=True)):  # what the appliance's steps say (up, down), as it goes
        sys.exit(main())
