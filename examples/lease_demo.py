"""The lease-end demonstration `make deploy` runs on the local cloud.

1. `appliance up` + `appliance stage` for examples/digits.yaml (2 nodes on a 2-hour lease).
2. `appliance run` (flows.run_managed) with `lease.extend` on: nobody resumes by hand. Mid-training, the cloud's
   clock jumps to 90 s before the lease end (the local cloud's accelerated time): the watchdog extends the lease
   and the job trains on. Then another lease books the same hosts from the new end on (the usual reason Chameleon
   refuses an extension) and the clock jumps again: Blazar refuses the extension, the watchdog asks the job to
   stop, every rank stops after the same step and rank 0 commits a checkpoint. The run's cluster goes, a new
   lease and servers come up, the dataset and the checkpoint are staged, and the job continues from that step.
   Three epochs later the second lease's end comes (its hosts booked after it too, the clock jumps again): the same
   once more, on a third lease, where the job runs to the end.
3. A reference run, uninterrupted, with the same seed and world size. Its final weights must equal the
   managed run's, bit for bit.
4. Level 2 (docs/checkpoints.md): an ordinary Keras + Horovod script with nothing of the appliance in it
   (examples/plain_fit.yaml) on the same nodes. Mid-epoch, `appliance train` gets SIGTERM (as from Ctrl-C or a
   batch system); every rank stops after the same step with a committed checkpoint; `appliance resume` continues
   it mid-epoch; its final weights must equal an uninterrupted run's. Then the cluster goes down and the cloud's
   clock is put back on real time.

Throughout, the local cloud's Keystone tokens live 60 s (a day on Chameleon): they expire many times during the
run, the object store refuses the expired ones, and the checkpoints keep committing, because the job's nodes hold
an application credential of the job's own and get new tokens with it (docs/chameleon.md).

Run as `python examples/lease_demo.py [SPEC] [--record DIR]` after the dataset is uploaded (see the Makefile).
``--record DIR`` (`make bench-resume`) also writes the first resume's downtime, phase by phase, to DIR/resume.{json,md,png}.
"""

import dataclasses
import datetime as dt
import json
import os
import random
import re
import signal
import sys
import tempfile
import threading
from pathlib import Path

import yaml

from appliance import localcloud
from appliance.checkpoint import runs
from appliance.cli import format_breakdown, format_progress
from appliance.cluster import find_cluster
from appliance.flows import resume
from appliance import flows, sites
from appliance.sites import load_spec
from appliance.flows import run_job as train


def say(msg: str) -> None:
    print(f"\n=== {msg}", flush=True)


def weights(res) -> str:
    shas = {r.get("weights_sha256") for r in res.results.values()}
    return shas.pop() if len(shas) == 1 else "ranks differ"


def main() -> int:
    args = sys.argv[1:]
    record = None
    if "--record" in args:
        i = args.index("--record")
        record = Path(args[i + 1])
        del args[i:i + 2]
    spec_path = args[0] if args else "examples/digits.yaml"
    spec = load_spec(spec_path)
    if spec.checkpoint.url:  # the demo starts its run over: an earlier demo's checkpoints would be resumed
        n = flows.data_remove(f"{spec.checkpoint.url.rstrip('/')}/{spec.name}/", cloud=spec.cloud)
        if n:
            print(f"removed {n} object(s) of an earlier run of {spec.name} from {spec.checkpoint.url}")
    localcloud.admin("POST", "/tokens", {"seconds": TOKEN_SECONDS})
    print(f"[demo] the local cloud's Keystone tokens live {TOKEN_SECONDS} s in this demo (a day on Chameleon)")
    try:
        return demo(spec_path, spec, record)
    finally:
        localcloud.admin("POST", "/tokens", {"seconds": 86400})


TOKEN_SECONDS = 60


def book_after_end(cloud, cluster, minutes: int = 10) -> list[str]:
    """Another lease on this lease's hosts, from its end on: the usual reason a Chameleon extension is refused
    (Blazar cannot keep a host that someone booked after your end). One 1-host lease per node, by `$node_name`
    (Chameleon's host property). On the local cloud a server's hostId is its Blazar host's id."""
    names = {str(h["id"]): h["node_name"] for h in cloud.blazar.host.list()}
    end = cloud.get_lease(cluster.lease_id).end
    start = end + dt.timedelta(minutes=1)
    ids, hosts = [], []
    for node in cluster.nodes:
        host = names[str(cloud.conn.compute.get_server(node.server_id).host_id)]
        hosts.append(host)
        res = {"resource_type": "physical:host", "min": 1, "max": 1, "hypervisor_properties": "",
               "resource_properties": json.dumps(["=", "$node_name", host]), "before_end": "default"}
        lease = cloud.blazar.lease.create(f"someone-else-{host}", start.strftime("%Y-%m-%d %H:%M"),
                                          (start + dt.timedelta(minutes=minutes)).strftime("%Y-%m-%d %H:%M"), [res], [])
        ids.append(lease["id"])
    print(f"[demo] another lease books {', '.join(hosts)} from {start:%H:%M} UTC, right after this lease's end",
          flush=True)
    return ids


def record_breakdown(out: Path, b: dict, stop_step: int, resumed_step: int) -> None:
    """The resume's downtime by phase: resume.json, a table (resume.md) and a bar of its parts (resume.png)."""
    from appliance.flows import RESUME_PHASES

    out.mkdir(parents=True, exist_ok=True)
    cmd = "make bench-resume  # python examples/lease_demo.py examples/digits.yaml --record " + str(out)
    when = dt.datetime.now(dt.timezone.utc).strftime("%Y-%m-%d %H:%M UTC")
    parts = [(k, b[k]) for k in RESUME_PHASES if b.get(k) is not None]
    (out / "resume.json").write_text(json.dumps({"command": cmd, "measured": when, "breakdown": b,
                                                 "stop_step": stop_step, "resumed_step": resumed_step}, indent=1) + "\n")
    md = [f"# A resume's downtime, phase by phase (`{cmd}`, {when}, {os.cpu_count()} cores, the local cloud)", "",
          f"The job stopped for the lease end after step {stop_step} and resumed at step {resumed_step} on a new lease "
          "(new servers, the dataset and the checkpoint staged again). From `appliance resume` to the job's first "
          f"step: **{b.get('total', 0):.1f} s**.", "", "| phase | seconds |", "|---|---|"]
    md += [f"| {k} | {v:.2f} |" for k, v in parts] + [f"| **total** | **{b.get('total', 0):.2f}** |"]
    (out / "resume.md").write_text("\n".join(md) + "\n")
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(12, 3.2))
    left = 0.0
    for i, (k, v) in enumerate(parts):
        ax.barh([0], [v], left=left, color=plt.cm.tab20(i % 20), label=f"{k} {v:.1f}s")
        left += v
    ax.set_yticks([])
    ax.set_xlabel("seconds from `appliance resume` to the first step")
    ax.legend(fontsize=7, ncol=2, loc="center left", bbox_to_anchor=(1.01, 0.5))
    fig.tight_layout()
    fig.savefig(out / "resume.png", dpi=110)
    print(f"[demo] wrote {out / 'resume.md'}, resume.json, resume.png")


def demo(spec_path: str, spec, record: Path | None = None) -> int:
    say(f"1. up + stage: {spec_path}")
    cluster = flows.up(spec_path)
    flows.stage_spec(spec_path)

    epochs = 30
    at_epoch = random.randint(5, 10)  # an arbitrary moment mid-training
    booked: list[str] = []
    extended = threading.Event()
    seen = {"jobs": 0, "epochs": 0, "commits": 0}

    def lease_now():  # the run's cluster and its site now: each lease end brings a new one
        cl = find_cluster(spec.name)
        return cl, sites.for_cluster(cl)

    def jump_to_end(why: str) -> None:
        cl, site = lease_now()
        left = (site.cloud.get_lease(cl.lease_id).end - site.cloud.now()).total_seconds()
        print(f"[demo] the cloud's clock jumps {left - 90:.0f} s ahead: the lease now ends in 90 s ({why})", flush=True)
        localcloud.admin("POST", "/advance", {"seconds": left - 90})

    def second_end() -> None:  # off the output thread: the job trains on meanwhile
        cl, site = lease_now()
        old_end = site.cloud.get_lease(cl.lease_id).end
        for _ in range(600):  # the watchdog polls every 0.5 s here
            if site.cloud.get_lease(cl.lease_id).end > old_end:
                break
            extended.wait(0.05)
        booked.extend(book_after_end(site.cloud, cl))
        jump_to_end("again; the watchdog cannot extend this time")

    def third_lease() -> None:  # the run keeps lease.extend on: its hosts are booked after this end too
        cl, site = lease_now()
        booked.extend(book_after_end(site.cloud, cl))
        jump_to_end("the second lease's end, no extension either")

    def on_line(line: str) -> None:
        print(line, flush=True)
        if line.startswith("[appliance] job ") and " rank(s) on " in line:
            seen["jobs"] += 1
            seen["epochs"] = 0
        if re.search(r"\] epoch \d+/", line):
            seen["epochs"] += 1
        if re.search(r"\[checkpoint\] step \d+ committed", line):
            seen["commits"] += 1
        if seen["jobs"] == 1 and f"epoch {at_epoch}/{epochs} " in line:
            jump_to_end("the watchdog extends it: lease.extend is on")
            threading.Thread(target=second_end, daemon=True).start()
        if "[watchdog] extended lease" in line:
            extended.set()
        if seen["jobs"] == 2 and seen["epochs"] == 3 and re.search(r"\] epoch \d+/", line):
            threading.Thread(target=third_lease, daemon=True).start()

    say(f"2. appliance run, lease.extend on: at epoch {at_epoch} the lease is 90 s from its end, and later the next "
        "lease's; nobody resumes by hand")
    # keep_when_done: the reference run and the level-2 script below use the run's last cluster
    spec = dataclasses.replace(spec, lease=dataclasses.replace(spec.lease, extend=True, keep_when_done=True))
    before = len((runs.load(spec.name) or {}).get("jobs", []))  # an earlier demo's jobs stay in the run's record
    try:
        last = flows.run_managed(spec_path, spec=spec, out=on_line)
    finally:
        site = sites.for_spec(spec)
        for lid in booked:
            site.cloud.delete_lease(lid)
    jobs = runs.load(spec.name)["jobs"][before:]
    if last is None or last.exit_code != 0 or len(jobs) != 3:
        print(f"demo: expected the run to finish in 3 jobs across 2 lease ends, got {len(jobs)} job(s): "
              f"{last.failure if last else 'nothing ran'}")
        return 1
    if not extended.is_set():
        print("demo: expected the watchdog to extend the lease once")
        return 1
    ends = [(a["last_step"], b["first_step"], b.get("resume_breakdown") or {}) for a, b in zip(jobs, jobs[1:])]
    if record is not None and ends[0][2]:
        record_breakdown(record, ends[0][2], ends[0][0], ends[0][1])

    say("3. a reference run, uninterrupted (same seed, same world size, no checkpoints)")
    cluster = flows.up(spec_path)  # the resumed run's cluster (no-op)
    ref = train(reference_spec(spec_path, spec), cluster, out=lambda line: None)
    plain = plain_fit(cluster)
    flows.down(spec.name)
    # the demo's leases are gone: put the cloud's clock back on real time, so that a client dating a lease by this
    # machine's clock ("now + 1 minute") is not refused as starting in the past
    localcloud.admin("POST", "/clock/reset")

    r0, ref0 = last.results.get(0, {}), ref.results.get(0, {})
    same = weights(last) == weights(ref) and ref.exit_code == 0
    say("summary")
    print("  the watchdog extended the lease once and the job trained on; the second time another lease had "
          "booked the hosts, Blazar refused the extension, and the job stopped before the end")
    for i, (stop_step, resumed_step, b) in enumerate(ends, 1):
        print(f"  lease end {i}: stopped after step {stop_step}, committed; `appliance run` resumed on a new lease at "
              f"step {resumed_step} (steps lost: {stop_step - resumed_step})")
        if b:
            print(f"    downtime  {format_breakdown(b)}")
    for line in format_progress(flows.timeline(spec.name) or {}):  # what `appliance ls RUN` says of it
        print(f"  {line.strip()}")
    print(f"  final validation accuracy {r0.get('val_accuracy')} (reference {ref0.get('val_accuracy')})")
    print(f"  final weights {'EQUAL' if same else 'DIFFER from'} the uninterrupted reference run "
          f"(sha256 {weights(last)[:16]}…)")
    print(f"  level 2, an unchanged Keras script: {plain}")
    n = seen["commits"]
    if localcloud.store_takes_keystone():
        print(f"  Keystone tokens lived {TOKEN_SECONDS} s: {n} checkpoint(s) committed by the three jobs, each with "
              "its own application credential")
    else:  # APPLIANCE_LOCAL_STORE=swift: OpenStack Swift with its own v1 auth, which Keystone's tokens never meet
        print(f"  {n} checkpoint(s) committed by the three jobs to OpenStack Swift (v1 auth: Keystone's tokens "
              "never met the store)")
    lost = sum(a - b for a, b, _ in ends)
    return 0 if same and lost == 0 and plain.startswith("stopped") and "EQUAL" in plain else 1


def reference_spec(spec_path: str, spec):
    """The spec's uninterrupted twin: named RUN-reference, no checkpoints, the same code (read from a temporary
    directory that is removed at once: a directory per demo was left in /tmp)."""
    raw = yaml.safe_load(Path(spec_path).read_text())
    raw["name"] = f"{spec.name}-reference"
    raw.pop("checkpoint", None)
    raw["train"]["code"] = str(Path(spec.code_dir).resolve())
    with tempfile.TemporaryDirectory(prefix="appliance-ref-") as d:
        ref_spec = Path(d) / "reference.yaml"
        ref_spec.write_text(yaml.safe_dump(raw))
        return load_spec(str(ref_spec))


def plain_weights(lines: list[str]) -> str:
    found = [m.group(1) for m in (re.search(r"weights sha256 (\w+)", x) for x in lines) if m]
    return found[-1] if found else "none"


def plain_fit(cluster, spec_path: str = "examples/plain_fit.yaml") -> str:
    """Step 4: an unchanged Keras script, stopped mid-epoch by SIGTERM to `appliance train` and resumed."""
    spec = load_spec(spec_path)
    flows.data_remove(f"{spec.checkpoint.url.rstrip('/')}/{spec.name}/", cloud=spec.cloud)
    say(f"4. level 2: {spec_path}, an ordinary Keras script; SIGTERM to `appliance train` in epoch 3")
    at = {"done": False}

    def on_line(line: str) -> None:
        print(line, flush=True)
        if "Epoch 3/" in line and not at["done"]:
            at["done"] = True
            print("[demo] SIGTERM to appliance train", flush=True)
            os.kill(os.getpid(), signal.SIGTERM)

    first = train(spec, cluster, out=on_line)
    if first.exit_code != 75 or not first.stopped:
        return f"did not stop as asked (exit {first.exit_code}: {first.failure})"
    lines: list[str] = []
    second = resume(spec.name, cluster_name=cluster.name, out=lambda m: (print(m, flush=True), lines.append(m)))
    if second is None or second.exit_code != 0:
        return f"the resume failed: {second.failure if second else 'nothing to resume'}"
    ref_lines: list[str] = []
    train(reference_spec(spec_path, spec), cluster, out=ref_lines.append)
    same = plain_weights(lines) == plain_weights(ref_lines) != "none"
    return (f"stopped after step {first.stopped['step']} (epoch {first.stopped['epoch']}), committed; resumed at "
            f"step {second.resumed['step']}; final weights {'EQUAL' if same else 'DIFFER from'} the uninterrupted "
            f"run's")


if __name__ == "__main__":
    sys.exit(main())
