"""A stop request for a run's job, in the object store: ``URL/RUN/controller/stop.json`` (issue 77).

`appliance cancel RUN`, typed on any machine, writes it for the job that holds the run's lock (its id), beside the
controller's timeline; the head node's beat (node/lockbeat.py), which runs as long as the job and talks to the
store, reads it every STOP_POLL seconds and writes the job's STOP file (rank 0 then stops every rank after the same
step and commits), then answers in the same object (``answered``: the store's time). A request names its job, so a
request left in the store never stops a later job of the run. The controller that holds the run waits for the
answer (or the job's end) for two of the job lock's heartbeats, then deletes the job's lease (flows/stopping.py).
No secret is written here: the job id, who asked, and when.
"""

from __future__ import annotations

import json
import tempfile
import time

from .checkpoints import CheckpointStore

REQUEST = "controller/stop.json"  # relative to the run's prefix (URL/RUN/)
STOP_POLL = 15.0  # seconds between two looks of the head node's beat at the request, at most


def ask(cs: CheckpointStore, job_id: str, by: str, reason: str = "appliance cancel") -> dict:
    """Write the stop request for ``job_id`` (``cs``: the run's store, prefix URL/RUN/). Returns it."""
    req = {"job_id": job_id, "by": by, "reason": reason, "at": round(time.time(), 3)}
    cs.put_text(REQUEST, json.dumps(req), tempfile.gettempdir())
    return req


def asked(cs: CheckpointStore, job_id: str) -> dict | None:
    """The stop request for ``job_id``, None when there is none for that job (none at all, another job's, or not
    readable). A store that does not answer raises."""
    try:
        req = cs.read_json(REQUEST)
    except (FileNotFoundError, json.JSONDecodeError):
        return None
    return req if isinstance(req, dict) and req.get("job_id") == job_id else None


def answer(cs: CheckpointStore, req: dict, at: float) -> None:
    """The head node's answer: the job's STOP file is written (``at``: when, by the store's clock)."""
    cs.put_text(REQUEST, json.dumps({**req, "answered": at}), tempfile.gettempdir())
