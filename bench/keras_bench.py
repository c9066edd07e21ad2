"""Keras 3 against tf_keras on the same model, in one run (`make bench-keras`; or
``.venv/bin/python bench/keras_bench.py [--rounds N]``).

The same script (bench/keras_job/train.py: a CNN, Horovod's DistributedOptimizer and broadcast callback), 2 ranks
through horovodrun on this machine in the ranks' environment (the appliance's start-up shim first on PYTHONPATH),
once with ``train.keras: 2`` (TF_USE_LEGACY_KERAS=1: tf_keras, Horovod's own optimizer) and once with
``train.keras: 3`` (Keras 3: the appliance's averaging optimizer, appliance/node/keras3.py), in interleaved rounds
(2, 3, 2, 3, ...; the first of each pair alternating) so that the machine's drift falls on both alike. Reported:
samples/s of the timed epochs per round, the median of each, and Keras 3's median relative to tf_keras' (goal:
within 5%). Results: bench/results/keras.json, keras.md, keras.png (the command is in keras.md)."""

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
            return {"keras": keras, **got[1]}
    raise SystemExit(f"the Keras {keras} job failed (exit {p.returncode}): {(p.stdout + p.stderr)[-2000:]}")


def report(results: list[dict], args, out: Path, command: str) -> None:
    med = {k: statistics.median(r["samples_per_s"] for r in results if r["keras"] == k) for k in ("2", "3")}
    ratio = med["3"] / med["2"]
    body = {"command": command, "when": dt.datetime.now(dt.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
            "cores": os.cpu_count(), "ranks": args.ranks, "epochs": args.epochs, "steps": args.steps,
            "rounds": results, "median_samples_per_s": med, "keras3_over_tf_keras": round(ratio, 4),
            "within_5_percent": abs(ratio - 1) <= 0.05}
    (out / "keras.json").write_text(json.dumps(body, indent=1) + "\n")
    rows = [f"| {i // 2 + 1} | {r['keras']} | {r['samples_per_s']:.0f} | {r['seconds']:.2f} |"
            for i, r in enumerate(results)]
    (out / "keras.md").write_text("\n".join([
        f"# Keras 3 vs tf_keras, the same model (`{command}`, {body['when']}, {body['cores']} cores)", "",
        f"bench/keras_job/train.py on {args.ranks} ranks (horovodrun, Gloo, this machine), {args.epochs} timed epochs "
        f"of {args.steps} steps of 64 samples per rank after one untimed; tf_keras with Horovod's "
        "DistributedOptimizer, Keras 3 with the appliance's (one grouped allreduce in `apply`). Interleaved rounds.",
        "", "| round | Keras | samples/s | seconds |", "|---|---|---|---|", *rows, "",
        f"Median: tf_keras **{med['2']:.0f}** samples/s, Keras 3 **{med['3']:.0f}** samples/s: Keras 3 at "
        f"**{ratio:.1%}** of tf_keras (goal: within 5%: {'met' if body['within_5_percent'] else 'not met'}).", ""]))
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return
    fig, ax = plt.subplots(figsize=(6, 3.5))
    for k, label in (("2", "tf_keras"), ("3", "Keras 3")):
        pts = [(i // 2 + 1, r["samples_per_s"]) for i, r in enumerate(results) if r["keras"] == k]
        ax.plot(*zip(*pts), "o-", label=f"{label} (median {med[k]:.0f})")
    ax.set_xlabel("round")
    ax.set_ylabel("samples/s (2 ranks)")
    ax.set_ylim(bottom=0)
    ax.legend()
    ax.set_title(f"Keras 3 at {ratio:.1%} of tf_keras")
    fig.tight_layout()
    fig.savefig(out / "keras.png", dpi=100)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--ranks", type=int, default=2)
    ap.add_argument("--epochs", type=int, default=3)
    ap.add_argument("--steps", type=int, default=60)
    ap.add_argument("--out", default=str(ROOT / "bench" / "results"))
    args = ap.parse_args()
    results = []
    for i in range(args.rounds):
        for keras in (("2", "3") if i % 2 == 0 else ("3", "2")):
            r = one(keras, args)
            results.append(r)
            print(f"round {i + 1}: Keras {keras} ({r['keras']}): {r['samples_per_s']:.0f} samples/s", flush=True)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    report(results, args, out, "make bench-keras")
    print((out / "keras.md").read_text())


if __name__ == "__main__":
    main()
