"""A managed run's effective training time ratio (ETTR), from what its controller records: `appliance ls RUN`.

The run's time, ``run_s``: from its first controller's start (the timeline's first event) to its end (the "end"
event, when it is the timeline's last), or to now for a run still going. Every instant of it is given to exactly
one part below (a span covering it; where spans overlap, the one of the highest rank, in the order listed); what no
span covers is ``other``. So the parts sum to ``run_s`` by construction, and ``ettr = train / run_s``.

- ``train``: steps committed and kept. A job's span from its first step to its end when its end kept its steps
  (it exited 0, or stopped with a commit: a lease's end, a cancel), else to its last commit; the checkpoint writes
  in between count as training. A job still running counts up to now (its commits are recorded at its end).
- ``lost``: steps trained after the last commit of a job that ended without committing them (a failure, or a lease
  end that took its nodes): from that commit (its first step if it committed none) to its end. The resume redoes
  them.
- ``wait``: no hosts, or no controller. ``parked``: from a "parked" (or "no SUs") event to the next event that is
  not one of a parked run's ("slot taken", "no hosts", "next lease refused"); ``hosts``: from "waiting for hosts"
  (a slot booked ahead) to "hosts free" (or the next job, park or end); ``no controller``: from an "end" to the
  next "controller" (the run stopped, or parked without SUs, until `appliance run SPEC` again); ``cloud``: from
  "cloud away" (the cloud did not answer the recovery strategy) to "cloud back".
- ``handover``: each handover's downtime by phase, from the "downtime" event's breakdown (steps.RESUME_PHASES):
  its ``total`` ends at the new job's first step, its phases laid out in the order they run (a cold handover's
  ``cluster (other)``, where the run looks for hosts and waits, before its ``lease``), and ``before resume`` from
  the previous job's end to the breakdown's start (the old cluster going). A wait inside a handover is counted as
  a wait, not as its phase. A handover with no downtime recorded (in progress, or the run ended in it) is
  ``unfinished``, from the previous job's end to the next job or the end.
- ``start``: from a controller's start to the first step of its first job (the run's cluster, staging, the
  launch), when that job is not a handover's.
- ``restart``: from the end of a job not handed over (a failure, then `--max-restarts`) to the next job's first
  step.
- ``other``: the rest (the run's end steps, the moments between a job's end and the next step of the run).

The clock: every time here is the controller's (``time.time()`` on the machine it runs on, where it also launches
the jobs): the events' ``at``, a job's first step and commits, the breakdowns' seconds. The cloud's clock (the
leases' dates) is not used: on the local cloud it runs ``time_scale`` times faster, and on Chameleon it agrees
with the controller's within their skew. A run taken over by a controller on another machine mixes two machines'
clocks (as far apart as NTP leaves them). "Now", for a run still going, is the reading machine's clock.

What it reads: the timeline (Control.record's events; the "job end" fields of ``job_end_marks``), and for jobs
whose "job end" has no marks (written before they were), the run record's jobs (its lost node-seconds).
"""

from __future__ import annotations

import time

from ..protocol import EXIT_STOPPED
from .steps import RESUME_PHASES

# a breakdown's phases laid out on the timeline: as RESUME_PHASES, with "cluster (other)" (a cold handover's look
# for hosts and its waits: recovery.Recovery.cold) before the new lease
LAYOUT = ("find checkpoint", "cluster (other)", *(p for p in RESUME_PHASES if p not in ("find checkpoint",
                                                                                        "cluster (other)")))
RANK = {"train": 6, "lost": 6, "wait": 5, "handover": 4, "unfinished": 3, "start": 2, "restart": 2}
PARKED_QUIET = ("parked", "no SUs", "slot taken", "no hosts", "next lease refused")
WAIT_ENDS = ("hosts free", "job", "end", "controller", "parked", "cancel")


def job_end_marks(res) -> dict:
    """What the "job end" event keeps for the ETTR, from the job's result: its first step (None: it made none; left
    out when its launcher did not watch it start: a followed job), its last commit (None: none; the launcher's
    clock) and whether its end kept its steps."""
    tl = res.timeline or {}
    commits = [c["at"] for c in res.commits or [] if c.get("at") is not None]
    return {**({"first_step_at": tl.get("first_step")} if "launched" in tl else {}),
            "last_commit_at": max(commits, default=None),
            "end_committed": res.exit_code == 0 or bool((res.stopped or {}).get("committed"))}


def ettr(tl: dict, jobs: list[dict] | None = None, now: float | None = None) -> dict | None:
    """The run's ETTR and its parts (seconds) from its timeline ``tl`` (read_timeline) and its run record's
    ``jobs`` (run_details: a fallback for older timelines); None without events."""
    events = sorted((e for e in tl.get("events") or [] if e.get("at") is not None), key=lambda e: e["at"])
    if not events:
        return None
    ended = events[-1].get("event") == "end"
    start = events[0]["at"]
    finish = events[-1]["at"] if ended else max(events[-1]["at"], time.time() if now is None else now)
    notes: list[str] = []
    js = _jobs(events, {j.get("job_id"): j for j in jobs or []}, finish, notes)
    spans = [*_job_spans(js), *_wait_spans(events, finish), *_handover_spans(events, js, finish),
             *_setup_spans(events, js, finish)]
    parts = _paint(spans, start, finish)
    run_s = finish - start
    top: dict[str, float] = {"train": 0.0, "lost": 0.0, "handover": 0.0, "wait": 0.0, "start": 0.0, "restart": 0.0,
                             "other": 0.0}
    sub: dict[str, dict[str, float]] = {"handover": {}, "wait": {}}
    for (part, detail), s in parts.items():
        part = "handover" if part == "unfinished" else part
        top[part] += s
        if part in sub:
            sub[part][detail] = sub[part].get(detail, 0.0) + s
    return {"ettr": round(top["train"] / run_s, 4) if run_s > 0 else None, "run_s": round(run_s, 2),
            "from": start, "to": finish, "ended": ended, "clock": "controller",
            "parts": {k: round(v, 2) for k, v in top.items()},
            "handover": {k: round(v, 2) for k, v in sub["handover"].items()},
            "wait": {k: round(v, 2) for k, v in sub["wait"].items()},
            "handovers": sum(e.get("event") == "downtime" for e in events), "notes": notes}


def _jobs(events: list[dict], records: dict, finish: float, notes: list[str]) -> list[dict]:
    """Each job of the timeline: {id, at, end, first, kept_to} (kept_to: where its kept steps end)."""
    out = []
    for i, e in enumerate(events):
        if e.get("event") != "job":
            continue
        jid = e.get("job_id")
        done = next((x for x in events[i + 1:] if x.get("event") == "job end" and x.get("job_id") == jid), None)
        down = next((x for x in events[i + 1:] if x.get("event") == "downtime" and x.get("job_id") == jid), None)
        end = done["at"] if done else _unended(events, i, jid, finish, notes)
        first = (done or {}).get("first_step_at") or (down or {}).get("at")
        if first is None and (done is None or "first_step_at" not in done):
            first = e["at"]  # not recorded: its launch counts as training
            notes.append(f"job {jid}: its first step is not on the timeline; its launch counts as training")
        out.append({"id": jid, "at": e["at"], "end": end, "first": first, "handed": down is not None,
                    "kept_to": _kept_to(done, records.get(jid), end, notes)})
    return out


def _unended(events: list[dict], i: int, jid, finish: float, notes: list[str]) -> float:
    """The end of a job with no "job end": the run's next job or end, or a controller's start that does not follow
    it (its controller was killed); else it runs now."""
    for k, x in enumerate(events[i + 1:], i + 1):
        kind = x.get("event")
        if kind in ("job", "end") or (kind == "controller" and not any(
                y.get("job_id") == jid and y.get("event") in ("following", "waiting") for y in events[k:])):
            notes.append(f"job {jid}: its end is not on the timeline; it counts as training to {kind!r}")
            return x["at"]
    return finish


def _kept_to(done: dict | None, record: dict | None, end: float, notes: list[str]) -> float | None:
    """Where a job's kept steps end: its end (kept, or still running), its last commit (None: none), or, for a "job
    end" without marks, its end less the run record's lost seconds."""
    if done is None:
        return end
    if "end_committed" in done:
        return end if done["end_committed"] else done.get("last_commit_at")
    if done.get("exit_code") == 0 or (done.get("exit_code") == EXIT_STOPPED and not done.get("failure")):
        return end
    if record and record.get("nodes") and record.get("node_seconds_lost") is not None:
        return end - record["node_seconds_lost"] / record["nodes"]
    notes.append(f"job {done.get('job_id')}: its last commit is not recorded; its time counts as training")
    return end


def _job_spans(js: list[dict]):
    for j in js:
        if j["first"] is None:
            continue
        kept = j["first"] if j["kept_to"] is None else min(max(j["kept_to"], j["first"]), j["end"])
        yield j["first"], kept, "train", ""
        yield kept, j["end"], "lost", ""


def _next(events: list[dict], i: int, stop, finish: float) -> float:
    """The time of the first event after ``events[i]`` that ``stop(kind)`` picks, else ``finish``."""
    return next((x["at"] for x in events[i + 1:] if stop(x.get("event"))), finish)


def _wait_spans(events: list[dict], finish: float):
    for i, e in enumerate(events):
        kind = e.get("event")
        if kind in ("parked", "no SUs") and not (i and events[i - 1].get("event") in ("parked", "no SUs")):
            yield e["at"], _next(events, i, lambda k: k not in PARKED_QUIET, finish), "wait", "parked"
        elif kind == "waiting for hosts":
            yield e["at"], _next(events, i, lambda k: k in WAIT_ENDS, finish), "wait", "hosts"
        elif kind == "cloud away":
            yield e["at"], _next(events, i, lambda k: k in ("cloud back", *WAIT_ENDS), finish), "wait", "cloud"
        elif kind == "end" and i + 1 < len(events):
            yield e["at"], _next(events, i, lambda k: k == "controller", finish), "wait", "no controller"


def _handover_spans(events: list[dict], js: list[dict], finish: float):
    """Each downtime's phases ending at its job's first step, what came before its resume, and each handover with
    no downtime ("unfinished")."""
    firsts = {j["id"]: j["first"] for j in js}
    for i, e in enumerate(events):
        if e.get("event") == "downtime":
            b = e.get("breakdown") or {}
            end = firsts.get(e.get("job_id")) or e["at"]
            total = b.get("total") or sum(b.get(p) or 0.0 for p in LAYOUT)
            t = end - total
            before = _prev_end(js, t, e.get("job_id"))
            if before is not None and before < t:
                yield before, t, "handover", "before resume"
            for p in LAYOUT:
                if b.get(p):
                    yield t, min(t + b[p], end), "handover", p
                    t += b[p]
            if t < end:
                yield t, end, "handover", "other"
        elif e.get("event") == "handover":
            nxt = next((x for x in events[i + 1:] if x.get("event") in ("handover", "downtime", "end")), None)
            if nxt is None or nxt.get("event") != "downtime":
                began = _prev_end(js, e["at"], None)
                yield (e["at"] if began is None else began), _next(events, i, lambda k: k in ("job", "end"), finish), \
                    "unfinished", "unfinished"


def _prev_end(js: list[dict], t: float, not_job) -> float | None:
    """The latest end of a job (not ``not_job``) at or before ``t``."""
    return max((j["end"] for j in js if j["id"] != not_job and j["end"] <= t + 1e-6), default=None)


def _setup_spans(events: list[dict], js: list[dict], finish: float):
    """A controller's start to its first job's first step ("start"), a job's end not handed over to the next job's
    first step ("restart"), where that next job is not a handover's."""
    for e in events:
        if e.get("event") != "controller":
            continue
        j = next((j for j in js if j["at"] >= e["at"]), None)
        if j is None:
            yield e["at"], finish, "start", ""
        elif not j["handed"]:
            yield e["at"], j["first"] or j["end"], "start", ""
    for a, b in zip(js, js[1:]):
        between = [x.get("event") for x in events if a["end"] < x["at"] < b["at"]]
        if not b["handed"] and a["end"] <= b["at"] and not {"end", "controller", "handover"} & set(between):
            yield a["end"], b["first"] or b["end"], "restart", ""


def _paint(spans, start: float, finish: float) -> dict[tuple[str, str], float]:
    """Seconds of [start, finish] by (part, detail): each piece to the highest-ranked span covering it (the
    earliest listed among equals), ("other", "") where none does."""
    spans = [(max(a, start), min(b, finish), part, d) for a, b, part, d in spans if min(b, finish) > max(a, start)]
    cuts = sorted({start, finish, *(a for a, *_ in spans), *(b for _, b, *_ in spans)})
    out: dict[tuple[str, str], float] = {}
    for a, b in zip(cuts, cuts[1:]):
        mid = (a + b) / 2
        over = [(-RANK[p], k, p, d) for k, (x, y, p, d) in enumerate(spans) if x <= mid < y]
        key = (min(over)[2], min(over)[3]) if over else ("other", "")
        out[key] = out.get(key, 0.0) + (b - a)
    return out
