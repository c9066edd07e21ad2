"""Keras 3 against tf_keras on the same model, in one run (`make bench-keras`; or
``.venv/bin/python bench/keras_bench.py [--rounds N]``).

The same script (bench/keras_job/train.py: a CNN, Horovod's DistributedOptimizer and broadcast callback), 2 ranks
through horovodrun on this machine in the ranks' environment (the appliance's start-up shim first on PYTHONPATH),
once with ``train.keras: 2`` (TF_USE_LEGACY_KERAS=1: tf_keras, Horovod's own optimizer) and once with
``train.keras: 3`` (Keras 3: the appliance's averaging optimizer, appliance/node/keras3.py), in interleaved rounds
(2, 3, 3, 2, ...; the first of each pair alternating) so that the machine's drift falls on both alike. Reported:
samples/s of the timed epochs per round (and samples per CPU-second of all ranks), the median of each, and Keras 3's
median relative to tf_keras' (goal: within 5%). Results: bench/results/keras.json, keras.md, keras.png (the command is in keras.md)."""

from __future__ import annotations

import argparse
import datetime as dt
import json
import os
import statistics
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from appliance.protocol import Line, parse, rank_environment  # noqa: E402

JOB = ROOT / "bench" / "keras_job"


def one(keras: str, args) -> dict:
    venv_bin = Path(sys.executable).parent
    env = rank_environment(path=f"{venv_bin}:/usr/bin:/bin", home=str(JOB), nic=None, extra={
        "PYTHONPATH": f"{ROOT / 'appliance' / 'node' / 'shim'}:{ROOT}", "APPLIANCE_KERAS": keras,
        "TF_USE_LEGACY_KERAS": "1" if keras == "2" else "0"})
    cmd = [str(venv_bin / "horovodrun"), "-np", str(args.ranks), "-H", f"localhost:{args.ranks}", "--gloo",
           "python", "train.py", "--epochs", str(args.epochs), "--steps", str(args.steps)]
    p = subprocess.run(cmd, cwd=JOB, env=env, capture_output=True, text=True, timeout=600)
    for line in (p.stdout + p.stderr).splitlines():
        got = parse(line.split(">:", 1)[-1], (Line.RESULT,))
        if got:
            return {**got[1], "keras": keras, "version": got[1]["keras"]}
    raise SystemExit(f"the Keras {keras} job failed (exit {p.returncode}): {(p.stdout + p.stderr)[-2000:]}")


def _median(results: list[dict], keras: str, key: str) -> float:
    return statistics.median(r[key] for r in results if r["keras"] == keras)


def report(results: list[dict], args, out: Path, command: str) -> None:
    med = {key: {k: _median(results, k, key) for k in ("2", "3")} for key in ("samples_per_s", "samples_per_cpu_s")}
    ratio = {key: m["3"] / m["2"] for key, m in med.items()}
    body = {"command": command, "when": dt.datetime.now(dt.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
            "cores": os.cpu_count(), "load_before": args.load, "ranks": args.ranks, "epochs": args.epochs,
            "steps": args.steps, "rounds": results, "median": med,
            "keras3_over_tf_keras": {k: round(v, 4) for k, v in ratio.items()},
            "within_5_percent": abs(ratio["samples_per_s"] - 1) <= 0.05}
    (out / "keras.json").write_text(json.dumps(body, indent=1) + "\n")
    rows = [f"| {i // 2 + 1} | {r['keras']} | {r['samples_per_s']:.0f} | {r['samples_per_cpu_s']:.0f} | "
            f"{r['seconds']:.2f} |" for i, r in enumerate(results)]
    m, q = med["samples_per_s"], med["samples_per_cpu_s"]
    (out / "keras.md").write_text("\n".join([
        f"# Keras 3 vs tf_keras, the same model (`{command}`, {body['when']}, {body['cores']} cores)", "",
        f"bench/keras_job/train.py on {args.ranks} ranks (horovodrun, Gloo, this machine), {args.epochs} timed epochs "
        f"of {args.steps} steps of 64 samples per rank after one untimed; tf_keras with Horovod's "
        "DistributedOptimizer, Keras 3 with the appliance's (one grouped allreduce in `apply`). Interleaved rounds. "
        f"The machine was shared (load average {args.load} before the run): samples per CPU-second (every rank's "
        "CPU summed) is the steadier of the two.", "",
        "| round | Keras | samples/s | samples/CPU-s | seconds |", "|---|---|---|---|---|", *rows, "",
        f"Median: tf_keras **{m['2']:.0f}** samples/s, Keras 3 **{m['3']:.0f}** samples/s: Keras 3 at "
        f"**{ratio['samples_per_s']:.1%}** of tf_keras (goal: within 5%: "
        f"{'met' if body['within_5_percent'] else 'not met'}). Per CPU-second: tf_keras {q['2']:.0f}, Keras 3 "
        f"{q['3']:.0f} ({ratio['samples_per_cpu_s']:.1%}).", ""]))
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return
    fig, axes = plt.subplots(1, 2, figsize=(9, 3.5))
    for ax, key, label in ((axes[0], "samples_per_s", "samples/s"), (axes[1], "samples_per_cpu_s",
                                                                     "samples per CPU-second")):
        for k, name in (("2", "tf_keras"), ("3", "Keras 3")):
            pts = [(i // 2 + 1, r[key]) for i, r in enumerate(results) if r["keras"] == k]
            ax.plot(*zip(*pts), "o-", label=f"{name} (median {med[key][k]:.0f})")
        ax.set_xlabel("round")
        ax.set_ylabel(label)
        ax.set_ylim(bottom=0)
        ax.legend(fontsize=8)
        ax.set_title(f"Keras 3 at {ratio[key]:.1%} of tf_keras", fontsize=10)
    fig.tight_layout()
    fig.savefig(out / "keras.png", dpi=100)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=6)
    ap.add_argument("--ranks", type=int, default=2)
    ap.add_argument("--epochs", type=int, default=5)
    ap.add_argument("--steps", type=int, default=100)
    ap.add_argument("--out", default=str(ROOT / "bench" / "results"))
    args = ap.parse_args()
    args.load = round(os.getloadavg()[0], 2)
    results = []
    for i in range(args.rounds):
        for keras in (("2", "3") if i % 2 == 0 else ("3", "2")):
            r = one(keras, args)
            results.append(r)
            print(f"round {i + 1}: Keras {keras} ({r['version']}): {r['samples_per_s']:.0f} samples/s, "
                  f"{r['samples_per_cpu_s']:.0f} per CPU-second", flush=True)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    report(results, args, out, "make bench-keras")
    print((out / "keras.md").read_text())


if __name__ == "__main__":
    main()
