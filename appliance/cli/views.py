"""How the verbs show results: a job's summary, a resume's downtime, a managed run's timeline."""

from __future__ import annotations

import click

from . import _json_out
from ..node.stage import _fmt_bytes


def _report(res, as_json: bool, done: dict | None = None) -> None:
    """The job summary (text or JSON), then the job's exit code. ``res`` None: the run had finished already
    (nothing ran; with --json, ``done`` says so)."""
    from ..flows import job_summary
    from ..train.launch import check

    if res is None:
        if as_json:
            _json_out(done or {"complete": True})
        return
    summary = job_summary(res)
    if as_json:
        _json_out(summary)
    else:
        click.echo("")
        for line in format_summary(summary):
            click.echo(line)
    check(res)



def format_timeline(tl: dict) -> list[str]:
    """A managed run's controller and its timeline, one line per lease, job end and handover."""
    import datetime as dt

    def at(t):
        return dt.datetime.fromtimestamp(t, dt.timezone.utc).strftime("%m-%d %H:%M:%S")

    c = tl.get("controller") or {}
    alive = (f"alive on {c.get('host')} pid {c.get('pid')} (heartbeat {tl.get('controller_heartbeat_age_s')}s ago)"
             if tl.get("controller_alive") else f"not running (last: {c.get('host')} pid {c.get('pid')})")
    out = [f"managed run {tl.get('run')}: {tl.get('status')}; controller {alive}", *format_progress(tl)]
    for e in tl.get("events") or []:
        kind = e.get("event")
        if kind == "job":
            hosts = e.get("hosts") or []
            ends = f", lease {str(e.get('lease_id'))[:8]} ends {str(e['lease_end'])[:16].replace('T', ' ')}" \
                if e.get("lease_end") else ""
            out.append(f"  {at(e['at'])} job {e.get('job_id')} {'resumed' if e.get('restore') else 'started'} on "
                       f"{len(hosts)} {e.get('node_type')} at {e.get('site')} ({', '.join(hosts)}){ends}")
        elif kind == "job end":
            why = "for the lease end" if e.get("lease_end") else f"exit {e.get('exit_code')}"
            out.append(f"  {at(e['at'])} job {e.get('job_id')} ended at step {e.get('step')}, {why}"
                       + (f": {e['failure']}" if e.get("failure") and not e.get("lease_end") else ""))
        elif kind == "downtime":
            out.append(f"  {at(e['at'])} handover{' (finished by a takeover)' if e.get('takeover') else ''}: "
                       f"{format_breakdown(e.get('breakdown') or {})}")
        elif kind in ("following", "job not started", "waiting"):
            what = {"following": "runs on, its controller gone: followed to its end",
                    "job not started": "never started (its controller was killed): taken over",
                    "waiting": "still runs: waiting for it to end"}[kind]
            out.append(f"  {at(e['at'])} job {e.get('job_id')} on {e.get('cluster')} {what}")
        elif kind in ("controller", "cancel", "end"):
            what = {"controller": f"controller {e.get('id')}" + (" (took over)" if e.get("took_over") else "")
                    + (f", its credential expires {e['credential_expires']} UTC" if e.get("credential_expires") else ""),
                    "cancel": f"cancel asked from {e.get('by')}", "end": f"run {e.get('status')}"}[kind]
            out.append(f"  {at(e['at'])} {what}")
        elif kind == "waiting for hosts":
            out.append(f"  {at(e['at'])} no hosts free now: {_where(e)} booked from {e.get('start')}, a wait of "
                       f"{e.get('wait_s', 0) / 60:.0f} min")
        elif kind == "cloud back":
            out.append(f"  {at(e['at'])} the cloud answers again after {e.get('waited_s')} s")
        elif kind == "hosts free":
            out.append(f"  {at(e['at'])} {_where(e)} free after {e.get('waited_s')} s")
        elif kind == "lease extended":
            out.append(f"  {at(e['at'])} lease {str(e.get('lease_id'))[:8]} extended to {str(e.get('end'))[:16]}")
        elif kind == "lease deleted":
            out.append(f"  {at(e['at'])} lease {e.get('name')} ({str(e.get('lease_id'))[:8]}) deleted: {e.get('reason')}")
        elif kind in ("next lease", "next cluster ready", "next cluster failed", "no hosts", "parked", "stuck",
                      "extend refused", "no next lease", "limit", "no SUs", "slot taken", "next lease refused",
                      "cloud away"):
            detail = (e.get("node_type") and _where(e)) or e.get("error") or e.get("reason") or e.get("cluster") or ""
            out.append(f"  {at(e['at'])} {kind}" + (f": {detail}" if detail else ""))
    return out


def _where(e: dict) -> str:
    """An event's node type, and its site when it is not the run's own: ``gpu_v100 at CHI@TACC``."""
    return f"{e.get('node_type')}" + (f" at {e['site']}" if e.get("site") else "")


def format_progress(tl: dict) -> list[str]:
    """A managed run's node-hours against its limits, its steps and its estimated finish (flows/budget.py)."""
    import datetime as dt

    out, nh, est = [], tl.get("node_hours") or {}, tl.get("estimate") or {}
    if nh:
        limit = nh.get("limit")
        left = f", limit {limit:g} ({max(0.0, limit - nh['spent'] - nh['booked']):.1f} left)" if limit else ""
        out.append(f"  leased node-hours: {nh['spent']:.1f} spent, {nh['booked']:.1f} booked ahead{left}"
                   + (f"; deadline {nh['deadline']} UTC" if nh.get("deadline") else ""))
    if est.get("step") is not None:
        of = f" of {est['total_steps']} ({100 * est['step'] / est['total_steps']:.0f}%)" if est.get("total_steps") else ""
        done = est.get("total_steps") and est["step"] >= est["total_steps"]
        eta = (", done" if done else f"; at {est['steps_per_s']:.2f} steps/s it should finish about "
               f"{dt.datetime.fromtimestamp(est['eta'], dt.timezone.utc):%Y-%m-%d %H:%M} UTC, "
               f"{est['lease_ends_ahead']} lease end(s) ahead" if est.get("eta") else "")
        out.append(f"  steps: {est['step']}{of}{eta}")
    return out


def format_ettr(e: dict) -> list[str]:
    """A managed run's ETTR on one line, then what ate the rest: its handovers by phase, its waits (flows/ettr.py
    defines each part; they sum to the run's time)."""
    p, so_far = e["parts"], "" if e["ended"] else " so far"
    rest = [f"{name} {_dur(p[k])}" for k, name in (("handover", f"handovers ({e['handovers']})"), ("wait", "waits"),
                                                   ("lost", "lost steps"), ("start", "start"),
                                                   ("restart", "restarts"), ("other", "other")) if p[k] >= 0.05]
    ratio = f"{e['ettr']:.1%}" if e.get("ettr") is not None else "-"
    out = [f"  ETTR {ratio}: trained and kept {_dur(p['train'])} of the run's {_dur(e['run_s'])}{so_far} "
           f"(controller's clock)" + (f"; {', '.join(rest)}" if rest else "")]
    for k, name in (("handover", "handovers"), ("wait", "waits")):
        parts = [f"{d} {_dur(s)}" for d, s in e[k].items() if s >= 0.05]
        if parts:
            out.append(f"    {name}: {', '.join(parts)}")
    return out


def _dur(s: float) -> str:
    """Seconds as said: 42.5s, 12m05s, 3h07m."""
    if s < 120:
        return f"{s:.1f}s"
    s = int(round(s))
    return f"{s // 60}m{s % 60:02d}s" if s < 7200 else f"{s // 3600}h{(s % 3600) // 60:02d}m"


def format_breakdown(b: dict) -> str:
    """A resume's downtime on one line: the total to the first step, then each part that took time."""
    from ..flows import RESUME_PHASES

    parts = [f"{k} {b[k]:.1f}s" for k in RESUME_PHASES if b.get(k) is not None and b[k] >= 0.05]
    total = b.get("total")
    return (f"{total:.1f}s to the first step: " if total is not None else "") + ", ".join(parts)


def format_stream(s: dict) -> str:
    """A streamed job's waits for the store, on one line (dataset.mode stream)."""
    share = s["waited_s"] / s["wall_s"] if s.get("wall_s") else 0.0
    line = (f"rank 0 waited {s['waited_s']:.1f}s of {s['wall_s']:.1f}s ({share:.1%}) for shards from the store, "
            f"{s['stalls']} of {s['shards']} shard(s), over {s['epochs']} epoch(s)")
    if "store_bytes" in s:
        per = s["store_bytes"] / max(s["epochs"], 1)
        line += (f"; the ranks read {_fmt_bytes(s['store_bytes'])} from the store, {_fmt_bytes(per)} an epoch"
                 + (f" ({per / s['dataset_bytes']:.2f}x the dataset)" if s.get("dataset_bytes") else ""))
    return line


def format_summary(s: dict) -> list[str]:
    ok = s["exit_code"] == 0
    stopped = bool(s.get("stopped") and s["stopped"].get("committed"))
    head = "done" if ok else ("STOPPED (resumable)" if stopped else "FAILED")
    lines = [f"== {head}: job {s['job_id']} =="]
    if s.get("resumed"):
        r = s["resumed"]
        where = f" (epoch {r['epoch']}, batch {r['batch']})" if "epoch" in r else ""  # a followed job's: step only
        lines.append(f"  resumed   from step {r['step']}{where}" + ("" if r.get("bit_exact", True) else
                     f", world size {r['checkpoint_world_size']} -> {r['world_size']}"))
    if s.get("resume_breakdown"):
        lines.append(f"  downtime  {format_breakdown(s['resume_breakdown'])}")
    if stopped and s["stopped"].get("step") is None:  # level 3: rank 0's syncer ended the job
        st = s["stopped"]
        lines.append(f"  stopped   {st['reason']}, once its working directory was committed (manifest "
                     f"{st.get('files')}): `appliance resume` puts the files back")
    elif stopped:
        st = s["stopped"]
        lines.append(f"  stopped   after step {st['step']}: {st['reason']}")
        lines.append(f"  committed {st['checkpoint']} ({st['seconds']} s from the stop request to the commit)")
    elif s.get("last_checkpoint"):
        lines.append(f"  committed {s['checkpoints_committed']} checkpoint(s), the last {s['last_checkpoint']}")
    lines.append(f"  nodes     {len(s['nodes'])} ({', '.join(s['nodes'])})")
    lines.append(f"  ranks     {s['ranks']} (reported from {', '.join(s['hostnames_reported']) or 'none'})")
    if s.get("epochs") is not None:
        lines.append(f"  epochs    {s['epochs']}")
    if s.get("stream"):
        lines.append(f"  input     {format_stream(s['stream'])}")
    if s.get("val_accuracy") is not None:
        lines.append(f"  accuracy  {s['val_accuracy']:.4f} (validation)")
    if s.get("same_weights_on_all_ranks") is not None:
        lines.append(f"  weights   {'identical on all ranks' if s['same_weights_on_all_ranks'] else 'DIFFER between ranks'}")
    lines.append(f"  wall time {s['wall_seconds']:.1f} s")
    lines.append(f"  log       {s['log']}")
    if not ok and not stopped:
        lines.append(f"  failure   {s['failure']}")
    if stopped or (not ok and s.get("last_checkpoint")):
        s.setdefault("next", []).insert(0, f"  appliance resume {s['run']}        # continue from the last commit")
    lines += ["", "next:"] + s.get("next", ["  appliance testbed status     # the nodes",
                                             "  appliance testbed down       # remove them"])
    return lines
