"""bench/stream_bench.py's default part: JPEG training input on 2 ranks, streamed from the local cloud's Ceph RGW,
beside the same shards on local disk and plain tf.data, at the highest demand local disk feeds on this machine.

1. N JPEGs (640x480, ~150 KB: a gradient under noise, quality 90) are packed with `appliance data pack` into tar
   shards in a Ceph RGW (appliance/localcloud/rgw_server.py, the local cloud's store) on the testbed's bridge, and
   into TFRecord shards of the same size on the node's disk; the node's stager stages the tar shards to its disk.
2. The demand: local disk read unpaced (no step) gives its rate; then the modelled step is lengthened from that
   rate's by ``--search-factor`` until local disk's input wait is at most ``--wait-goal``: the highest demand
   this machine feeds from its disk, stated relative to the unpaced rate.
3. At that step, in one run: ``local`` (the staged tar shards, the stream's order and pipeline), ``stream`` (the
   RGW, the node's link shaped by tc to each of ``--rates`` x the demand; 0: unshaped) and ``tfdata`` (plain
   tf.data over the TFRecord shards), each for ``--epochs`` epochs on ``--ranks`` ranks (bench/stream_job.py: the
   map, the barrier per step, what is measured).

Reported: samples/s relative to local disk, input wait, CPU s per image (the ranks' processes; for stream, also the
store's daemons: radosgw, ceph-osd, ceph-mon, on this machine's cores). bench/results/stream-decode.{json,md,png}."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from stream_bench import ROOT, TB, in_node, save, shape, stage

from appliance import testbed
from appliance.localcloud.rgw_server import RGWServer, installed

URL = "swift://streambench/jpeg/"
SIZE = (480, 640)  # height, width: ~150 KB at quality 90 with this noise


def make_jpegs(d: Path, n: int) -> None:
    """``n`` JPEGs and their classes: a random gradient under a random window of one noise field (distinct
    bytes, 116-181 KB), and ``i % 10``."""
    import numpy as np
    import tensorflow as tf

    rng = np.random.default_rng(7)
    h, w = SIZE
    noise = rng.normal(0, 1, (2 * h, 2 * w, 3)).astype(np.float32)
    d.mkdir(parents=True, exist_ok=True)
    for i in range(n):
        y, x = rng.integers(0, h), rng.integers(0, w)
        ramp = np.linspace(rng.uniform(0, 100), rng.uniform(100, 255), w, dtype=np.float32)[None, :, None]
        img = np.clip(ramp + noise[y:y + h, x:x + w] * rng.uniform(12, 28), 0, 255).astype(np.uint8)
        (d / f"{i:06d}.jpg").write_bytes(tf.io.encode_jpeg(img, quality=90).numpy())
        (d / f"{i:06d}.cls").write_text(str(i % 10))


def data_pack(src: Path, url: str, shard_bytes: int, env: dict, fmt: str = "tar") -> dict:
    """`appliance data pack SRC URL` as a user runs it: the index it printed."""
    p = subprocess.run([sys.executable, "-m", "appliance.cli", "data", "pack", str(src), url, "--shard-size",
                        str(shard_bytes), "--format", fmt, "--cloud", "local", "--json"],
                       capture_output=True, text=True, env={**os.environ, **env}, cwd=ROOT)
    if p.returncode != 0:
        raise SystemExit(f"stream_bench: appliance data pack {url} failed: {p.stderr.strip()[-600:]}")
    return json.loads(p.stdout)


def cpu_ticks(pids) -> int:
    """User + system clock ticks of the processes ``pids`` so far (/proc/PID/stat)."""
    total = 0
    for pid in pids:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
        total += int(fields[11]) + int(fields[12])
    return total


def find_step(probe, first_ms: float, goal: float, factor: float, tries: int) -> tuple[float, list]:
    """The shortest step, from ``first_ms`` up by ``factor``, whose input wait ``probe(step_ms)`` is at most
    ``goal``, and every (step, wait) tried; none in ``tries``: one line, exit status 1."""
    tried, step = [], first_ms
    for _ in range(tries):
        wait = probe(step)
        tried.append((step, wait))
        if wait <= goal:
            return step, tried
        step *= factor
    raise SystemExit(f"stream_bench: local disk's input wait stayed above {goal:.0%} up to a step of "
                     f"{tried[-1][0]:.0f} ms ({', '.join(f'{w:.1%}' for _, w in tried)}): the machine is busy with "
                     "other work (run it again when it is not, or give --step-ms)")


def run_decode(args) -> None:
    if os.geteuid() != 0:
        raise SystemExit("stream_bench: needs root (a network namespace and tc); run it as make deploy does")
    if not installed():
        raise SystemExit("stream_bench: Ceph RGW is not installed (ceph-mon, ceph-osd, radosgw); `make install` "
                         "installs it (or ARGS=--synthetic: OpenStack Swift, no decoding)")
    work = Path(tempfile.mkdtemp(prefix="appliance-stream-bench-"))
    tb = testbed.up(TB, nodes=1)
    node = tb.nodes[0]
    try:
        # memstore keeps the shards in memory: ~150 KB an image, with room to spare, and 1 GiB for RGW's own
        rgw = RGWServer(work / "rgw", bind_ip=tb.host_ip, memstore_bytes=args.images * 400_000 + (1 << 30))
        rgw.start()
        try:
            rows, info = measure(args, work, node, rgw)
        finally:
            shape(node.veth, None)
            rgw.stop()
    finally:
        testbed.down(TB)
        shutil.rmtree(work, ignore_errors=True)  # the images, the packed copies, the store's files
    write(Path(args.out), rows, info)


def measure(args, work: Path, node, rgw) -> tuple[list[dict], dict]:
    info, job = prepare(args, work, node, rgw)
    print(f"stream_bench: {info['images']} JPEGs in {info['shards']} tar shards ({info['bytes'] / 1e6:.0f} MB) in "
          f"Ceph RGW; {args.ranks} ranks x batch {args.batch}; finding the demand local disk feeds", flush=True)
    step_ms = find_demand(args, job, info)
    per_sample = info["bytes"] / info["images"]
    demand = args.ranks * args.batch / (step_ms / 1000)  # images/s the training takes
    info.update({"step_ms": step_ms, "demand_samples_per_s": demand, "demand_Bps": demand * per_sample,
                 "demand_vs_unpaced_local": demand / info["unpaced_local_samples_per_s"],
                 "load_before": os.getloadavg()[0]})
    print(f"stream_bench: demand {demand:.0f} images/s ({demand * per_sample / 1e6:.1f} MB/s, step {step_ms:.0f} "
          f"ms) = {info['demand_vs_unpaced_local']:.2f}x local disk unpaced", flush=True)
    runs = [("local", None), *(("stream", float(x)) for x in args.rates.split(",")), ("tfdata", None)]
    rows = []
    for rnd in range(args.rounds):  # the readers interleaved: a change in the machine's other load hits them all
        for mode, mult in runs:
            shape(node.veth, demand * per_sample * mult if mult else None)
            ticks = cpu_ticks(rgw.pids.values())
            r = job(mode, step_ms, args.epochs)
            store_cpu = (cpu_ticks(rgw.pids.values()) - ticks) / os.sysconf("SC_CLK_TCK")
            rows.append(row(mode, mult, r, store_cpu if mode == "stream" else 0.0, info, args.epochs))
            local = rows[rnd * len(runs)]  # the round's first run
            rows[-1].update({"round": rnd, "vs_local": r["samples_per_s"] / local["samples_per_s"]})
            print(f"  round {rnd}: {rows[-1]['reader']:>30}: {r['samples_per_s']:.0f} images/s = "
                  f"{rows[-1]['vs_local']:.2f}x local disk, input wait {r['input_wait']:.1%}, CPU "
                  f"{1000 * rows[-1]['cpu_s_per_image']:.2f} ms/image (+ store "
                  f"{1000 * rows[-1]['store_cpu_s_per_image']:.2f})", flush=True)
    info["load_after"] = os.getloadavg()[0]
    return rows, info


def prepare(args, work: Path, node, rgw):
    """The JPEGs packed into the RGW (tar) and onto the node's disk (TFRecord), the tar shards staged to its disk:
    what was made, and the function that runs a reader (``job(mode, step_ms, epochs)``)."""
    t = time.monotonic()
    make_jpegs(work / "files", args.images)
    made_s, t = time.monotonic() - t, time.monotonic()
    index = data_pack(work / "files", URL, args.shard_bytes, {"ST_AUTH": rgw.auth_url, "ST_USER": rgw.user,
                                                              "ST_KEY": rgw.key})
    pack_s = time.monotonic() - t
    disk = Path(node.disk)
    data_pack(work / "files", f"file://{disk / 'bench-tfrecord'}/", args.shard_bytes, {}, fmt="tfrecord")
    (work / "index.json").write_text(json.dumps(index))
    (work / "creds.json").write_text(json.dumps({"auth_url": rgw.auth_url, "user": rgw.user, "key": rgw.key}))
    st = stage(node.netns, rgw, disk / "bench-staged", URL)
    cache = args.cache_shards * max(s["size"] for s in index["shards"])
    extra = {"local": ["--local-dir", str(disk / "bench-staged")],
             "tfdata": ["--local-dir", str(disk / "bench-tfrecord")],
             "stream": ["--url", URL, "--creds", str(work / "creds.json"), "--local-dir", str(disk / "bench-cache"),
                        "--cache-bytes", str(cache)]}

    def job(mode: str, step_ms: float, epochs: int) -> dict:
        return json.loads(in_node(node.netns, [
            sys.executable, str(ROOT / "bench" / "stream_job.py"), "--mode", mode, "--index", str(work / "index.json"),
            "--map", "jpeg", "--ranks", str(args.ranks), "--batch", str(args.batch), "--window", str(args.window),
            "--step-ms", f"{step_ms:.2f}", "--epochs", str(epochs), *extra[mode]]).strip().splitlines()[-1])

    return {"images": index["samples"], "shards": len(index["shards"]),
            "bytes": sum(s["size"] for s in index["shards"]),
            "ranks": args.ranks, "batch": args.batch, "epochs": args.epochs, "rounds": args.rounds,
            "window": args.window, "cache_bytes": cache, "wait_goal": args.wait_goal, "cores": os.cpu_count(),
            "make_images_s": made_s, "pack_s": pack_s, "stage_s": st["wall_s"], "probes": []}, job


def find_demand(args, job, info: dict) -> float:
    """The step (ms) at the highest demand local disk feeds (``find_step`` from its unpaced rate's step, or
    ``--step-ms``); its unpaced rate and the tries go into ``info``."""
    unpaced = job("local", 0, args.probe_epochs)
    info["unpaced_local_samples_per_s"] = unpaced["samples_per_s"]
    if args.step_ms:
        return args.step_ms

    def probe(step_ms: float) -> float:
        r = job("local", step_ms, args.probe_epochs)
        info["probes"].append({"step_ms": step_ms, "input_wait": r["input_wait"], "samples_per_s": r["samples_per_s"]})
        print(f"  local disk, step {step_ms:.0f} ms: input wait {r['input_wait']:.1%}", flush=True)
        return r["input_wait"]

    first_ms = 1000 * args.ranks * args.batch / unpaced["samples_per_s"]  # its unpaced rate as the demand
    return find_step(probe, first_ms, args.wait_goal, args.search_factor, args.search_tries)[0]


def row(mode: str, mult: float | None, r: dict, store_cpu: float, info: dict, epochs: int) -> dict:
    name = {"local": "local disk (staged tar)", "tfdata": "plain tf.data (TFRecord, disk)"}.get(mode) or (
        f"stream, link {mult:g}x demand" if mult else "stream, link unshaped")
    visits = [e for rk in r["ranks"] for e in rk["epochs"]]
    return {"reader": name, "mode": mode, "link_MBps": info["demand_Bps"] * mult / 1e6 if mult else None,
            "samples_per_s": r["samples_per_s"], "input_wait": r["input_wait"],
            "input_wait_ranks": [x["input_wait"] for x in r["ranks"]], "start_s": r["start_s"],
            "cpu_s_per_image": r["cpu_s"] / r["samples"], "store_cpu_s_per_image": store_cpu / r["read"],
            "wall_s": r["wall_s"], "stalls": sum(e["stalls"] for e in visits),
            "store_bytes_per_epoch": (sum(e["store_bytes"] for e in visits) / info["bytes"] / epochs
                                      if visits else None)}


def summary(rows: list[dict]) -> list[dict]:
    """Each reader's rounds: the means, and each round's ratio to local disk and input wait."""
    out: dict[str, dict] = {}
    for r in rows:
        out.setdefault(r["reader"], {"reader": r["reader"], "link_MBps": r["link_MBps"], "rounds": []})
        out[r["reader"]]["rounds"].append(r)
    for s in out.values():
        rs = s.pop("rounds")
        for k in ("samples_per_s", "vs_local", "input_wait", "start_s", "cpu_s_per_image", "store_cpu_s_per_image"):
            s[k] = sum(r[k] for r in rs) / len(rs)
        fetched = [r["store_bytes_per_epoch"] for r in rs if r["store_bytes_per_epoch"] is not None]
        s["store_bytes_per_epoch"] = sum(fetched) / len(fetched) if fetched else None
        s["per_round"] = [(r["vs_local"], r["input_wait"]) for r in rs]
    return list(out.values())


def write(out: Path, rows: list[dict], info: dict) -> None:
    out.mkdir(parents=True, exist_ok=True)
    cmd = "make bench-stream  # .venv/bin/python bench/stream_bench.py " + " ".join(sys.argv[1:])
    rows, runs = summary(rows), rows
    (out / "stream-decode.json").write_text(json.dumps({"command": cmd, "info": info, "summary": rows, "runs": runs},
                                                       indent=1) + "\n")
    i = info
    lines = ["# Stream mode with JPEG decoding: Ceph RGW vs local disk vs plain tf.data", "", f"`{cmd}`", "",
             f"{i['images']} JPEGs (640x480, {i['bytes'] / i['images'] / 1e3:.0f} KB on average) in {i['shards']} "
             f"tar shards ({i['bytes'] / 1e6:.0f} MB), {i['ranks']} ranks (processes) x batch {i['batch']}, "
             f"{i['epochs']} epochs a run, {i['rounds']} round(s) of the readers in turn; the map: decode_jpeg, "
             "random crop and flip, resize to 224x224 "
             "(num_parallel_calls AUTOTUNE); a modelled accelerator step (a sleep) after a barrier of the ranks. "
             f"dataset.shuffle {i['window']}, the stream's cache {i['cache_bytes'] / 1e6:.0f} MB a rank. One node "
             f"(a network namespace), Ceph RGW (radosgw beast, one memstore OSD) on its bridge; {i['cores']} cores, "
             f"shared with the store's daemons and other work (load {i['load_before']:.1f} before, "
             f"{i['load_after']:.1f} after).", "",
             f"The demand: local disk read unpaced gave {i['unpaced_local_samples_per_s']:.0f} images/s; the "
             + (f"shortest step with local disk's input wait <= {i['wait_goal']:.0%} was " if i["probes"] else
                "step given was ") + f"{i['step_ms']:.0f} ms: "
             f"{i['demand_samples_per_s']:.0f} images/s ({i['demand_Bps'] / 1e6:.1f} MB/s), "
             f"{i['demand_vs_unpaced_local']:.2f}x local disk's unpaced rate. Steps tried: "
             + ", ".join(f"{p['step_ms']:.0f} ms ({p['input_wait']:.1%})" for p in i["probes"]) + ".", "",
             "Measured over each run's steps after its first quarter (bench/stream_job.py); start: until every "
             "rank has its first batch. Input wait: the share of the steps' time the ranks waited for their next "
             "batch (the slowest rank's, as an allreduce waits for it); CPU: the ranks' processes (fetching, "
             "reading, decoding) per image; store CPU: radosgw, ceph-osd and ceph-mon per image read, on the same "
             "cores here.", "",
             "The rounds' means; per round: the ratio to local disk in that round, and the input wait.", "",
             "| reader | images/s | vs local disk | input wait | per round | start (s) | CPU ms/image | "
             "store CPU ms/image | from the store an epoch (x dataset) |", "|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        link = f" ({r['link_MBps']:.0f} MB/s)" if r["link_MBps"] else ""
        fetched = f"{r['store_bytes_per_epoch']:.2f}" if r["store_bytes_per_epoch"] is not None else ""
        each = ", ".join(f"{v:.2f} ({w:.1%})" for v, w in r["per_round"])
        lines.append(f"| {r['reader']}{link} | {r['samples_per_s']:.0f} | {r['vs_local']:.2f} | {r['input_wait']:.1%}"
                     f" | {each} | {r['start_s']:.2f} | {1000 * r['cpu_s_per_image']:.2f} | "
                     f"{1000 * r['store_cpu_s_per_image']:.2f} | {fetched} |")
    save(out, "stream-decode", lines, lambda plt: plot(plt, rows, info))


def plot(plt, rows: list[dict], info: dict):
    labels = [r["reader"].replace(", ", "\n").replace(" (", "\n(") for r in rows]
    x = range(len(rows))
    fig, (a, b) = plt.subplots(1, 2, figsize=(12, 4.4))
    a.bar(x, [r["samples_per_s"] for r in rows], 0.6)
    a.axhline(info["demand_samples_per_s"], color="k", ls="--", lw=1, label="the demand")
    for i, r in enumerate(rows):
        a.text(i, r["samples_per_s"] / 2, f"{r['vs_local']:.2f}x\nwait {r['input_wait']:.1%}", ha="center",
               va="center", fontsize=8, color="white")
    a.set_xticks(list(x), labels, fontsize=8)
    a.set_ylabel("images/s (2 ranks)")
    a.set_title("JPEG input at the demand local disk feeds")
    a.legend(loc="lower right")
    a.set_ylim(0, max(r["samples_per_s"] for r in rows) * 1.25)
    b.bar([i - 0.2 for i in x], [1000 * r["cpu_s_per_image"] for r in rows], 0.4, label="the ranks")
    b.bar([i + 0.2 for i in x], [1000 * r["store_cpu_s_per_image"] for r in rows], 0.4, label="the store's daemons")
    b.set_xticks(list(x), labels, fontsize=8)
    b.set_ylabel("CPU ms per image")
    b.set_title("CPU per image")
    b.legend()
    return fig
