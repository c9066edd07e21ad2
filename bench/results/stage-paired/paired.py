"""Our stager against s5cmd round by round, from a stage_bench.py result (its json: each tool's runs in round order).

    python bench/results/stage-paired/paired.py RESULT.json [--against s5cmd]

For each dataset and each of our rows: the ratio of s5cmd's wall time to ours in each round (above 1: we were
faster; issue 16's goal 1 is >= 1) and of our client CPU to s5cmd's (at most 1: goal 1), their medians over the
rounds, and in how many rounds each goal held. Tools in a round ran one after another, in a rotated order.
"""

import argparse
import json
import statistics


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("result")
    ap.add_argument("--against", default="s5cmd")
    args = ap.parse_args()
    d = json.load(open(args.result))
    rows = {(r["dataset"], r["tool"]): r for r in d["rows"]}
    print(f"{args.result} ({d['when']}): per round, {args.against}'s wall time / ours (speed) and our CPU / its CPU")
    print()
    print("| dataset | ours | speed, each round | median | rounds >= 1 | CPU, each round | median | rounds <= 1 |")
    print("|---|---|---|---|---|---|---|---|")
    for (ds, tool), r in rows.items():
        peer = rows.get((ds, args.against))
        if tool == args.against or peer is None or not tool.startswith("appliance"):
            continue
        speed = [p / o for p, o in zip(peer["runs_s"], r["runs_s"])]
        cpu = [o / p for o, p in zip(r["runs_cpu_s"], peer["runs_cpu_s"])]
        print(f"| {ds} | {tool} | {' '.join(f'{x:.2f}' for x in speed)} | {statistics.median(speed):.2f} | "
              f"{sum(x >= 1 for x in speed)} of {len(speed)} | {' '.join(f'{x:.2f}' for x in cpu)} | "
              f"{statistics.median(cpu):.2f} | {sum(x <= 1 for x in cpu)} of {len(cpu)} |")


if __name__ == "__main__":
    main()
