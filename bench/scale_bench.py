"""`make bench-scale`: how the control plane grows with the node count (issue 16 goal 4).

On the local cloud (its Blazar pool raised to the largest N), for each N in --nodes (2, 4, 8, 16), in a child
process of its own (so its memory and threads are its own): a new lease and `up` (lease, boot, SSH + contextualize),
staging a --dataset-mb dataset from the local store (full: every node gets all of it; shard: each node 1/N),
a tiny Horovod job on N ranks (bench/scale_job/tiny.py: init + 20 allreduces), then `down`. Each phase's wall time
and the launcher's own CPU seconds (getrusage of this process: the nodes' processes are not its children), the
launcher's peak RSS, threads and open files. Results: bench/results/scale.{json,md,png}.

The testbed's N nodes share this machine (2 cores here): wall times that grow with N are the machine's limit as
much as the launcher's; what the benchmark looks for is a phase that grows faster than the work it does.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

PHASES = ("lease", "boot", "ssh + contextualize", "stage full", "stage shard", "job setup", "horovod job", "down")
DATA_DIR = Path("/var/tmp/appliance-bench/scale-data")
URL = "swift://bench-scale/"


def write_spec(d: Path, n: int, mode: str, job: str = "tiny.py") -> str:
    p = d / f"scale{n}-{mode}.yaml"
    p.write_text("\n".join([
        f"name: scale{n}", "cloud: local", f"nodes: {{count: {n}, node_type: compute_local, slots: 1}}",
        "image: appliance-cpu", "lease: {duration: 2h}", "train:", f"  code: {ROOT / 'bench' / 'scale_job'}",
        f"  command: python {job}", f"dataset: {{source: {URL}, dest: data/scale-{mode}, mode: {mode}}}"]) + "\n")
    return str(p)


class Sampler(threading.Thread):
    """The launcher's threads and open file descriptors, sampled every 0.2 s (their peak)."""

    def __init__(self):
        super().__init__(daemon=True)
        self.threads = self.fds = 0
        self.done = threading.Event()

    def run(self):
        while not self.done.wait(0.2):
            self.threads = max(self.threads, threading.active_count())
            self.fds = max(self.fds, len(os.listdir("/proc/self/fd")))


def machine_cpu() -> float:
    """CPU seconds this machine has spent since boot, every core and process (/proc/stat: user, nice, system, irq,
    softirq; not idle, iowait or steal)."""
    with open("/proc/stat") as f:
        v = [int(x) for x in f.readline().split()[1:]]
    return (sum(v[:7]) - v[3] - v[4]) / os.sysconf("SC_CLK_TCK")


def one(n: int, tmp: Path, job_file: str = "tiny.py") -> dict:
    """One N, in this process: every phase's seconds and the launcher's peaks."""
    from appliance import flows
    from appliance.flows import run_job

    quiet = lambda m: None  # noqa: E731
    full, shard = write_spec(tmp, n, "full", job_file), write_spec(tmp, n, "shard", job_file)
    s = Sampler()
    s.start()
    t: dict[str, float] = {}
    cpu: dict[str, float] = {}  # the launcher's own CPU seconds (this process: the nodes' processes are not ours)
    phases: dict[str, float] = {}

    mcpu: dict[str, float] = {}  # the whole machine's CPU seconds (every process: launcher, nodes, cloud, store)

    def cpu_now() -> float:
        r = resource.getrusage(resource.RUSAGE_SELF)
        return r.ru_utime + r.ru_stime

    t0, c0, m0 = time.monotonic(), cpu_now(), machine_cpu()
    cl = flows.up(full, timings=phases)
    t["up"], cpu["up"], mcpu["up"] = time.monotonic() - t0, cpu_now() - c0, machine_cpu() - m0
    try:
        for mode, spec in (("full", full), ("shard", shard)):
            t0, c0, m0 = time.monotonic(), cpu_now(), machine_cpu()
            res = flows.stage_spec(spec, cl.name, out=quiet)
            t[f"stage {mode}"], cpu[f"stage {mode}"] = time.monotonic() - t0, cpu_now() - c0
            mcpu[f"stage {mode}"] = machine_cpu() - m0
            assert len(res) == n, res
        c0, m0 = cpu_now(), machine_cpu()
        job = run_job(flows.load_spec(full), cl, out=quiet)
        cpu["job"], mcpu["job"] = cpu_now() - c0, machine_cpu() - m0
        assert job.exit_code == 0, job.failure
        assert sorted(job.results) == list(range(n)), job.results
        t["job setup"] = job.timeline["launched"] - job.started_at
        t["horovod job"] = job.wall_s - t["job setup"]
    finally:
        t0, c0, m0 = time.monotonic(), cpu_now(), machine_cpu()
        flows.down(cl.name)
        t["down"], cpu["down"], mcpu["down"] = time.monotonic() - t0, cpu_now() - c0, machine_cpu() - m0
    s.done.set()
    out = {k: round(v, 2) for k, v in {**phases, **t}.items()}
    out.update({f"cpu {k}": round(v, 2) for k, v in cpu.items()})
    # busy: the machine's CPU over (wall x cores); near 1, the phase waited for the shared cores, not for a step
    # done one node after another
    walls = {"up": t["up"], "stage full": t["stage full"], "stage shard": t["stage shard"],
             "job": t["job setup"] + t["horovod job"], "down": t["down"]}
    out.update({f"busy {k}": round(mcpu[k] / (walls[k] * (os.cpu_count() or 1)), 2) for k in mcpu if walls[k] > 0})
    out.update({"n": n, "peak_rss_mb": round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024, 1),
                "peak_threads": s.threads, "peak_fds": s.fds})
    return out


def seed(mb: int) -> None:
    """A --dataset-mb dataset of 64 MiB files in the local cloud's store (once; kept on disk between runs)."""
    DATA_DIR.mkdir(parents=True, exist_ok=True)
    want = max(1, mb // 64)
    have = sorted(DATA_DIR.glob("part-*.bin"))
    if len(have) != want:
        for f in have:
            f.unlink()
        for i in range(want):
            with open(DATA_DIR / f"part-{i:03d}.bin", "wb") as fh:
                fh.write(os.urandom(64 << 20))
    subprocess.run([str(Path(sys.executable).parent / "appliance"), "data", "upload", str(DATA_DIR), URL,
                    "--cloud", "local"], check=True, cwd=ROOT, stdout=subprocess.DEVNULL)


def plot(rows: list[dict], path: Path) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    ns = [r["n"] for r in rows]
    fig, (ax, ax3, ax2) = plt.subplots(1, 3, figsize=(17, 4.8))
    for ph in PHASES:
        ax.plot(ns, [r.get(ph, 0) for r in rows], marker="o", label=ph)
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.set_xticks(ns, [str(n) for n in ns])
    ax.set_xlabel("nodes")
    ax.set_ylabel("wall seconds")
    ax.set_title("wall time per phase (all nodes share this machine)", fontsize=10)
    ax.legend(fontsize=7)
    for k in ("up", "stage full", "stage shard", "job", "down"):
        ax3.plot(ns, [r.get(f"cpu {k}", 0) for r in rows], marker="o", label=k)
    ax3.plot(ns, [rows[0].get("cpu job", 0) * n / ns[0] for n in ns], ls=":", color="grey",
             label="linear in N (from job at the smallest N)")
    ax3.set_xscale("log", base=2)
    ax3.set_xticks(ns, [str(n) for n in ns])
    ax3.set_xlabel("nodes")
    ax3.set_ylabel("CPU seconds")
    ax3.set_title("the launcher's own CPU per phase", fontsize=10)
    ax3.legend(fontsize=7)
    ax2.plot(ns, [r["peak_rss_mb"] for r in rows], marker="o", label="peak RSS (MB)")
    ax2.plot(ns, [r["peak_threads"] for r in rows], marker="s", label="peak threads")
    ax2.plot(ns, [r["peak_fds"] for r in rows], marker="^", label="peak open files")
    ax2.set_xscale("log", base=2)
    ax2.set_xticks(ns, [str(n) for n in ns])
    ax2.set_xlabel("nodes")
    ax2.set_title("the launcher's resources")
    ax2.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--nodes", default=None, help="the node counts (default 2,4,8,16; with --light 16,32,64)")
    ap.add_argument("--dataset-mb", type=int, default=None, help="MB of 64 MiB files (default 1024; --light 64)")
    ap.add_argument("--light", action="store_true",
                    help="where the testbed cannot go with TensorFlow on every node: the job is bench/scale_job/"
                         "light.py (a result line per rank, no TensorFlow or Horovod import) and the dataset 64 MB, "
                         "so what grows with N is the launcher's side. Results: scale-light.{json,md,png}")
    ap.add_argument("--out", default=str(ROOT / "bench" / "results"))
    ap.add_argument("--one", type=int, default=None, help=argparse.SUPPRESS)
    a = ap.parse_args()
    job_file, stem = ("light.py", "scale-light") if a.light else ("tiny.py", "scale")
    a.nodes = a.nodes or ("16,32,64" if a.light else "2,4,8,16")
    a.dataset_mb = a.dataset_mb or (64 if a.light else 1024)
    if a.one is not None:
        import tempfile
        with tempfile.TemporaryDirectory() as d:
            print("SCALE_ROW " + json.dumps(one(a.one, Path(d), job_file)), flush=True)
        return
    from appliance import localcloud, report

    ns = [int(x) for x in a.nodes.split(",")]
    localcloud.stop()  # a cloud whose pool holds the largest N
    with report.to(print):
        localcloud.start(hosts=max(ns))
    rows = []
    try:
        seed(a.dataset_mb)
        for n in ns:
            print(f"N={n} ...", flush=True)
            p = subprocess.run([sys.executable, __file__, "--one", str(n), *(["--light"] if a.light else [])],
                               capture_output=True, text=True, cwd=ROOT)
            row = next((json.loads(x[len("SCALE_ROW "):]) for x in p.stdout.splitlines()
                        if x.startswith("SCALE_ROW ")), None)
            if row is None:
                sys.exit(f"N={n} failed:\n{p.stdout[-3000:]}\n{p.stderr[-3000:]}")
            print("  " + ", ".join(f"{k} {v}" for k, v in row.items() if k != "n"), flush=True)
            rows.append(row)
    finally:
        localcloud.stop()
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    cmd = ("make bench-scale-light" if a.light else "make bench-scale") + "  # python bench/scale_bench.py " + \
        " ".join(sys.argv[1:])
    (out / f"{stem}.json").write_text(json.dumps({"command": cmd, "measured": time.strftime("%Y-%m-%d"),
                                                "dataset_mb": a.dataset_mb, "rows": rows}, indent=1) + "\n")
    for r in rows:  # staging's aggregate rate: full moves N copies of the dataset, shard one
        r["stage full MB/s"] = round(r["n"] * a.dataset_mb * 1.048576 / r["stage full"], 1)
        r["stage shard MB/s"] = round(a.dataset_mb * 1.048576 / r["stage shard"], 1)
    cols = ["n", *PHASES, "stage full MB/s", "stage shard MB/s", "cpu up", "cpu stage full", "cpu stage shard",
            "cpu job", "cpu down", "busy up", "busy stage full", "busy stage shard", "busy job", "busy down",
            "peak_rss_mb", "peak_threads", "peak_fds"]
    md = [f"# Control plane at scale (`{cmd}`, {time.strftime('%Y-%m-%d')}, dataset {a.dataset_mb} MB, "
          f"{os.cpu_count()} cores)", "", "| " + " | ".join(cols) + " |", "|" + "---|" * len(cols)]
    md += ["| " + " | ".join(str(r.get(c, "")) for c in cols) + " |" for r in rows]
    (out / f"{stem}.md").write_text("\n".join(md) + "\n")
    plot(rows, out / f"{stem}.png")
    print(f"wrote {out / stem}.md, .json, .png")


if __name__ == "__main__":
    main()
