"""Stream mode against its peers in one run: reading a packed dataset from the store while training
(``dataset.mode: stream``) vs reading the same shards from the node's local disk after staging them.

    make bench-stream                          # or: .venv/bin/python bench/stream_bench.py [ARGS]
    make bench-stream ARGS=--synthetic         # the synthetic part

Both parts run on a 1-node testbed (a network namespace: its own veth, so its link can be shaped with Linux tc,
a token bucket on the bridge's side of the node's veth) with a store on the testbed's bridge, and read through
bench/stream_job.py (inside the node's namespace) at a training's pace: a modelled accelerator step of
``--step-ms`` after every batch.

- **The default** (bench/stream_decode.py): JPEGs packed with `appliance data pack` into the local cloud's Ceph
  RGW, read by 2 ranks through ``stream.elements()`` with a parallel map that decodes and augments them, beside the
  same shards on local disk and plain tf.data over TFRecord shards, at the highest demand local disk feeds on this
  machine (found by the bench), the link shaped to 1.2x that demand. bench/results/stream-decode.{json,md,png}.
- **``--synthetic``**: N samples of S random bytes (no decoding) in OpenStack Swift, 1 rank, the step
  ``--step-ms`` (50 ms) setting the demand, the link at multiples of it (``--rates``). At each rate: ``stream``
  (through a cache of ``--cache-shards`` shards, the stream's GETs in flight at once and one at a time, the shard
  order only: ``--window 0``), ``stage`` (the node's stager, appliance/node/stage_main.py, fetching the whole
  dataset first: its wall time and CPU) and ``local`` (the staged shards from disk in the same order). Reported:
  stream's samples/s relative to local, its input wait, the reader's CPU seconds per GB against the stager's.
  bench/results/stream.{json,md,png}.

The command is in each result's .md. On this 2-core machine the store's server shares the cores with the readers;
the ratios, not the absolute rates, are what carries over to a Chameleon node (24-48 cores, 10-25 GbE)."""

from __future__ import annotations

import argparse
import json
import os
import random
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from appliance import testbed  # noqa: E402
from appliance.data.pack import pack  # noqa: E402
from appliance.localcloud.swift_server import SwiftServer  # noqa: E402
from appliance.node.stream import FETCHERS  # noqa: E402
from appliance.node.stream_order import WINDOW  # noqa: E402
from appliance.store.objects import StoreCreds, open_store  # noqa: E402

TB = "bs"
URL = "swift://streambench/set/"


def make_samples(d: Path, n: int, size: int) -> None:
    rnd = random.Random(7)
    d.mkdir(parents=True, exist_ok=True)
    for i in range(n):
        (d / f"{i:06d}.bin").write_bytes(rnd.randbytes(size))
        (d / f"{i:06d}.cls").write_text(str(i % 10))


def shape(veth: str, rate_bps: float | None) -> None:
    """A token bucket on the bridge's side of the node's veth: what enters the node (the GETs' bodies)."""
    subprocess.run(["tc", "qdisc", "del", "dev", veth, "root"], capture_output=True)
    if rate_bps:
        subprocess.run(["tc", "qdisc", "add", "dev", veth, "root", "tbf", "rate", f"{int(rate_bps * 8)}bit",
                        "burst", "256kb", "latency", "200ms"], check=True)


def in_node(ns: str, args: list[str]) -> str:
    """The stdout of a command in the node's network namespace."""
    p = subprocess.run(["ip", "netns", "exec", ns, *args], capture_output=True, cwd=ROOT)
    if p.returncode != 0:
        raise SystemExit(f"stream_bench: {' '.join(args[:3])} failed: {p.stderr.decode()[-800:]}")
    return p.stdout.decode()


def stage(ns: str, sw, dest: Path, url: str = URL) -> dict:
    """The node's stager, as `appliance stage` runs it (the job on stdin), timed with its own CPU (wait4)."""
    shutil.rmtree(dest, ignore_errors=True)
    job = {"url": url, "dest": str(dest), "mode": "full", "rank": 0, "nodes": 1,
           "creds": {"auth_url": sw.auth_url, "user": sw.user, "key": sw.key}}
    t0 = time.monotonic()
    p = subprocess.Popen(["ip", "netns", "exec", ns, sys.executable, "-m", "appliance.node.stage_main"],
                         stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE, cwd=ROOT)
    p.stdin.write(json.dumps(job).encode())
    p.stdin.close()
    out = p.stdout.read()
    _, status, ru = os.wait4(p.pid, 0)
    if status != 0:
        raise SystemExit(f"stream_bench: the stager failed: {out.decode()[-800:]}")
    return {"wall_s": time.monotonic() - t0, "cpu_s": ru.ru_utime + ru.ru_stime}


def read(ns: str, mode: str, work: Path, args, extra: list[str]) -> dict:
    out = in_node(ns, [sys.executable, str(ROOT / "bench" / "stream_job.py"), "--mode", mode,
                             "--index", str(work / "index.json"), "--batch", str(args.batch),
                             "--step-ms", str(args.step_ms), "--epochs", str(args.epochs),
                             "--window", str(args.window), *extra])
    return json.loads(out.strip().splitlines()[-1])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--synthetic", action="store_true", help="the synthetic part (Swift, 1 rank, no decoding)")
    ap.add_argument("--images", type=int, default=3000, help="JPEGs (default part)")
    ap.add_argument("--ranks", type=int, default=2, help="ranks on the node (default part)")
    ap.add_argument("--samples", type=int, default=2000, help="synthetic samples")
    ap.add_argument("--sample-bytes", type=int, default=32 * 1024, help="synthetic sample size")
    ap.add_argument("--shard-bytes", type=int, default=2 * 1024**2)
    ap.add_argument("--batch", type=int, default=32, help="per rank")
    ap.add_argument("--step-ms", type=float, default=None,
                    help="the modelled step (synthetic: 50; default part: found, see --wait-goal)")
    ap.add_argument("--wait-goal", type=float, default=0.05, help="local disk's input wait at the demand found")
    ap.add_argument("--search-factor", type=float, default=1.1, help="the step's growth between tries")
    ap.add_argument("--search-tries", type=int, default=8)
    ap.add_argument("--probe-epochs", type=int, default=1, help="epochs of each try of the demand's search")
    ap.add_argument("--rounds", type=int, default=2, help="default part: rounds of the readers in turn")
    ap.add_argument("--epochs", type=int, default=None, help="epochs of each reader (synthetic: 4, default part: 2)")
    ap.add_argument("--window", type=int, default=None,
                    help="dataset.shuffle (synthetic: 0, the shard order only; default part: the stream's 16)")
    ap.add_argument("--cache-shards", type=int, default=None,
                    help="each rank's stream cache, in shards (synthetic: 4; default part: 2 x window + 4, the "
                         "window read and the next with a GET per fetcher)")
    ap.add_argument("--rates", default=None, help="link rates as multiples of the demand (0: unshaped; synthetic: "
                    "0.6,1.2,2,0, default part: 1.2,0)")
    ap.add_argument("--out", default=str(ROOT / "bench" / "results"))
    args = ap.parse_args()
    if args.synthetic:
        defaults = {"step_ms": 50.0, "epochs": 4, "window": 0, "cache_shards": 4, "rates": "0.6,1.2,2,0"}
    else:
        window = WINDOW if args.window is None else args.window
        defaults = {"epochs": 2, "window": window, "cache_shards": 2 * max(window, 1) + FETCHERS, "rates": "1.2,0"}
    for k, v in defaults.items():
        if getattr(args, k) is None:
            setattr(args, k, v)
    if not args.synthetic:
        from stream_decode import run_decode

        return run_decode(args)
    if os.geteuid() != 0:
        raise SystemExit("stream_bench: needs root (a network namespace and tc); run it as make deploy does")
    work = Path(tempfile.mkdtemp(prefix="appliance-stream-bench-"))
    tb = testbed.up(TB, nodes=1)
    node = tb.nodes[0]
    sw = SwiftServer(work / "swift", bind_ip=tb.host_ip).start()
    try:
        rows, info = run(args, work, tb, node, sw)
    finally:
        shape(node.veth, None)
        sw.stop()
        testbed.down(TB)
        shutil.rmtree(work, ignore_errors=True)  # the samples, the packed copy and the store's objects
    write(args, Path(args.out), rows, info)


def run(args, work: Path, tb, node, sw) -> tuple[list[dict], dict]:
    make_samples(work / "files", args.samples, args.sample_bytes)
    creds = StoreCreds(auth_url=sw.auth_url, user=sw.user, key=sw.key)
    store, prefix = open_store(URL, creds)
    store.ensure_container()
    index = pack(work / "files", store, prefix, shard_size=args.shard_bytes)
    (work / "index.json").write_text(json.dumps(index))
    (work / "creds.json").write_text(json.dumps(creds.__dict__))
    total = sum(s["size"] for s in index["shards"])
    per_sample = total / index["samples"]
    demand = args.batch * per_sample / (args.step_ms / 1000)  # bytes/s the training takes in
    cache = args.cache_shards * max(s["size"] for s in index["shards"])
    info = {"samples": index["samples"], "shards": len(index["shards"]), "bytes": total, "demand_Bps": demand,
            "cache_bytes": cache, "batch": args.batch, "step_ms": args.step_ms, "epochs": args.epochs,
            "cores": os.cpu_count()}
    print(f"stream_bench: {index['samples']} samples in {len(index['shards'])} shards ({total / 1e6:.0f} MB); "
          f"the training takes {demand / 1e6:.1f} MB/s; cache {cache / 1e6:.1f} MB", flush=True)
    staged = Path(node.disk) / "bench-staged"
    rows = []
    for mult in [float(x) for x in args.rates.split(",")]:
        rate = demand * mult if mult else None
        shape(node.veth, rate)
        st = stage(node.netns, sw, staged)
        local = read(node.netns, "local", work, args, ["--local-dir", str(staged)])
        streamed = ["--url", URL, "--creds", str(work / "creds.json"),
                    "--local-dir", str(Path(node.disk) / "bench-cache"), "--cache-bytes", str(cache)]
        sm = read(node.netns, "stream", work, args, streamed)
        one = read(node.netns, "stream", work, args, [*streamed, "--fetchers", "1"])
        row = {"link": f"{mult:g}x demand" if mult else "unshaped", "link_MBps": rate / 1e6 if rate else None,
               "stage_s": st["wall_s"], "stage_cpu_s_per_GB": st["cpu_s"] / (total / 1e9),
               "local_samples_per_s": local["samples_per_s"], "local_input_wait": local["input_wait"],
               "stream_samples_per_s": sm["samples_per_s"], "stream_input_wait": sm["input_wait"],
               "local_start_s": local["start_s"], "stream_start_s": sm["start_s"],
               "stream_vs_local": sm["samples_per_s"] / local["samples_per_s"],
               "stream_1_fetcher_vs_local": one["samples_per_s"] / local["samples_per_s"],
               "stream_1_fetcher_input_wait": one["input_wait"],
               "stream_cpu_s_per_GB": sm["cpu_s"] / (sm["bytes"] / 1e9),
               "local_cpu_s_per_GB": local["cpu_s"] / (local["bytes"] / 1e9),
               "stream_stalls": sum(e["stalls"] for e in sm["ranks"][0]["epochs"]),
               "stream_cache_peak": max((e["peak"] for e in sm["ranks"][0]["epochs"]), default=0),
               "stream_wall_s": sm["total_s"], "stage_then_local_wall_s": st["wall_s"] + local["total_s"]}
        rows.append(row)
        print(f"  {row['link']:>16}: stream {row['stream_samples_per_s']:.0f} samples/s = "
              f"{row['stream_vs_local']:.2f}x local ({row['local_samples_per_s']:.0f}), input wait "
              f"{row['stream_input_wait']:.1%} (local {row['local_input_wait']:.1%}); stage {row['stage_s']:.1f}s; CPU s/GB "
              f"stream {row['stream_cpu_s_per_GB']:.2f}, local {row['local_cpu_s_per_GB']:.2f}, stager "
              f"{row['stage_cpu_s_per_GB']:.2f}", flush=True)
    return rows, info


def write(args, out: Path, rows: list[dict], info: dict) -> None:
    out.mkdir(parents=True, exist_ok=True)
    cmd = "make bench-stream ARGS=--synthetic  # .venv/bin/python bench/stream_bench.py " + " ".join(sys.argv[1:])
    (out / "stream.json").write_text(json.dumps({"command": cmd, "info": info, "rows": rows}, indent=1) + "\n")
    lines = ["# Stream mode vs local disk", "", f"`{cmd}`", "",
             f"{info['samples']} samples in {info['shards']} tar shards ({info['bytes'] / 1e6:.0f} MB), batch "
             f"{info['batch']}, a modelled step of {info['step_ms']:g} ms: the training takes "
             f"{info['demand_Bps'] / 1e6:.1f} MB/s. {info['epochs']} epochs; the stream's cache "
             f"{info['cache_bytes'] / 1e6:.1f} MB. One node (a network namespace), OpenStack Swift on its bridge, "
             f"the link into the node limited by tc; {info['cores']} cores.", "",
             "Input wait: the share of the steps' time spent waiting for the next batch; start: the seconds until "
             "the first batch (paid once a job).", "",
             "| link into the node | stream samples/s | local disk samples/s | stream / local | input wait: stream | "
             "input wait: local | start (s): stream / local | one GET at a time: stream / local, input wait | "
             "stage (s) | stage, then read (s) | stream (s) | CPU s/GB: stream (fetch + read) | "
             "CPU s/GB: local read | CPU s/GB: stager |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        link = r["link"] + (f" ({r['link_MBps']:.1f} MB/s)" if r["link_MBps"] else "")
        lines.append(f"| {link} | {r['stream_samples_per_s']:.0f} | {r['local_samples_per_s']:.0f} | "
                     f"{r['stream_vs_local']:.2f} | {r['stream_input_wait']:.1%} | {r['local_input_wait']:.1%} | "
                     f"{r['stream_start_s']:.2f} / {r['local_start_s']:.2f} | "
                     f"{r['stream_1_fetcher_vs_local']:.2f}, {r['stream_1_fetcher_input_wait']:.1%} | "
                     f"{r['stage_s']:.1f} | {r['stage_then_local_wall_s']:.1f} | {r['stream_wall_s']:.1f} | "
                     f"{r['stream_cpu_s_per_GB']:.2f} | {r['local_cpu_s_per_GB']:.2f} | {r['stage_cpu_s_per_GB']:.2f} |")
    save(out, "stream", lines, lambda plt: plot(plt, rows, info))


def save(out: Path, stem: str, lines: list[str], draw) -> None:
    """out/stem.md (``lines``) and out/stem.png (the figure ``draw(plt)`` returns, matplotlib's Agg backend)."""
    import matplotlib

    (out / f"{stem}.md").write_text("\n".join(lines) + "\n")
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig = draw(plt)
    fig.tight_layout()
    fig.savefig(out / f"{stem}.png", dpi=110)
    print(f"stream_bench: results in {out}/{stem}.md", flush=True)


def plot(plt, rows: list[dict], info: dict):
    labels = [r["link"] for r in rows]
    fig, (a, b) = plt.subplots(1, 2, figsize=(11, 4.2))
    x = range(len(rows))
    a.bar([i - 0.2 for i in x], [r["local_samples_per_s"] for r in rows], 0.4, label="local disk (staged)")
    a.bar([i + 0.2 for i in x], [r["stream_samples_per_s"] for r in rows], 0.4, label="stream")
    a.set_xticks(list(x), labels)
    a.set_ylabel("samples/s")
    a.set_title("Training pace: stream vs local disk")
    a.legend(loc="lower right")
    b.bar([i - 0.2 for i in x], [r["stage_then_local_wall_s"] for r in rows], 0.4, label="stage, then train")
    b.bar([i + 0.2 for i in x], [r["stream_wall_s"] for r in rows], 0.4, label="stream while training")
    b.set_xticks(list(x), labels)
    b.set_ylabel("seconds")
    b.set_title(f"{info['epochs']} epochs of {info['bytes'] / 1e6:.0f} MB, from the store")
    b.legend()
    return fig


if __name__ == "__main__":
    main()
