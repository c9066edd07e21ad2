"""A managed run through the control plane's bad hours (issue 77 item 1), in the fast tier: a step of the recovery
strategy the cloud does not answer (errors.Unavailable, Unanswered) puts the run in status waiting, with the error on
the timeline, and the run goes on by itself once the cloud answers; a cancel ends the wait at once."""

import json
import threading
from types import SimpleNamespace

import pytest

from appliance import flows
from appliance.checkpoint.runs import NEXT, RunStatus
from appliance.errors import Unanswered, Unavailable
from appliance.flows import managed, recovery
from appliance.provision import lifecycle
from appliance.train.launch import JobResult
from conftest import write_spec


@pytest.fixture
def away_run(tmp_path, monkeypatch):
    """run_managed of a new run on the local site whose first `lifecycle.up` calls raise ``errors`` in turn (then
    succeed), the job on the cluster ending with 0. Returns (result, the controller's state.json, the ups asked)."""
    def run(name: str, errors: list, on_error=None):
        ups = []

        def up(site, spec, **kw):
            ups.append(spec.nodes.node_type)
            if errors:
                e = errors.pop(0)
                if on_error is not None:
                    on_error(spec)
                raise e
            return SimpleNamespace(name=spec.name, cloud="local", world_size=2)

        def job(spec, cluster, **kw):
            return JobResult(job_id="w1", exit_code=0, world_size=2, rank_hosts=["a", "b"])

        monkeypatch.setattr(managed, "_has_committed_work", lambda ctx: False)
        monkeypatch.setattr(flows.steps, "run_job", job)
        monkeypatch.setattr(lifecycle, "up", up)
        return (*_managed(tmp_path, name, monkeypatch), ups)
    return run


def _managed(tmp_path, name: str, monkeypatch):
    """run_managed of a spec named ``name``, its checkpoints under tmp_path: its result and its controller's state."""
    spec = write_spec(tmp_path, "python x.py", code=tmp_path, name=name,
                      extra=f"checkpoint: {{url: 'file://{tmp_path}/ck/'}}\n")
    monkeypatch.setattr(recovery, "reconcile", lambda ctx, control, ledger=None: [])
    res = flows.run_managed(str(spec))
    return res, json.loads((tmp_path / "ck" / name / "controller" / "state.json").read_text())


def test_the_run_waits_while_the_cloud_does_not_answer_and_goes_on_by_itself(away_run, monkeypatch):
    """One 503 left after keystoneauth's retries, then a lease POST whose answer was lost and could not be looked
    up: the run ended "failed" at the first of them, its checkpoint and (for the second) a billed lease left behind."""
    monkeypatch.setattr(recovery, "CLOUD_WAIT", (0.01, 0.02))
    res, state, ups = away_run("cw1", [Unavailable("Blazar is not answering (HTTP 503)"),
                                       Unanswered("the lease cw1 may have been made (HTTP 504)")])
    assert res.exit_code == 0 and len(ups) == 3 and state["status"] == "finished"
    events = [e["event"] for e in state["events"]]
    away = [e for e in state["events"] if e["event"] == "cloud away"]
    assert len(away) == 1 and "HTTP 503" in away[0]["error"]  # said once for the whole wait
    assert events.index("cloud away") < events.index("cloud back"), events


def test_a_cancel_ends_the_wait_for_the_cloud_at_once(away_run, monkeypatch):
    monkeypatch.setattr(recovery, "CLOUD_WAIT", (600.0, 600.0))
    monkeypatch.setenv("APPLIANCE_CONTROLLER_POLL", "0.05")
    out = {}

    def cancel_later(spec):
        threading.Thread(target=lambda: out.setdefault("cancel", managed.cancel(
            spec.name, url=spec.checkpoint.url)), daemon=True).start()

    t = threading.Thread(target=lambda: out.setdefault("run", away_run(
        "cw2", [Unavailable("Keystone is not answering")] * 50, on_error=cancel_later)))
    t.start()
    t.join(30)  # a hang guard only: the wait is 600 s, the cancel ends it within a poll
    assert not t.is_alive(), "the run still waits for the cloud after its cancel"
    res, state, ups = out["run"]
    assert res is None and state["status"] == "cancelled" and len(ups) == 1


def test_waiting_is_a_status_of_its_own_reached_from_every_status_that_asks_the_cloud():
    for s in (RunStatus.STARTING, RunStatus.RUNNING, RunStatus.HANDOVER, RunStatus.PARKED):
        assert RunStatus.WAITING in NEXT[s]
    assert {RunStatus.RUNNING, RunStatus.CANCELLED, RunStatus.PARKED} <= NEXT[RunStatus.WAITING]


@pytest.fixture
def resumed_run(tmp_path, monkeypatch):
    """run_managed of a run with committed work whose resumes raise ``errors`` in turn (then succeed, the job ending
    with 0). Returns (result, the controller's state.json, the resumes asked)."""
    def run(name: str, errors: list):
        asked = []

        def resume(run_name, **kw):
            asked.append(run_name)
            if errors:
                raise errors.pop(0)
            return JobResult(job_id="w1", exit_code=0, world_size=2, rank_hosts=["a", "b"])

        monkeypatch.setattr(managed, "_has_committed_work", lambda ctx: True)
        monkeypatch.setattr(flows.steps, "resume", resume)
        return (*_managed(tmp_path, name, monkeypatch), asked)
    return run


def test_a_node_that_does_not_answer_ssh_for_a_while_is_waited_for(resumed_run, monkeypatch):
    """A resume whose SSH to the cluster's head failed ended the unattended run (a warm handover's, on a banner that
    did not come): the run waits and resumes again; a node away longer than NODE_WAIT still ends it, with its error."""
    from appliance.errors import Unreachable

    monkeypatch.setattr(recovery, "CLOUD_WAIT", (0.01, 0.02))
    drop = Unreachable("SSH to nw-0 (10.0.0.9:22) failed after 15.0s: Error reading SSH protocol banner")
    res, state, asked = resumed_run("nw1", [drop, drop])
    assert res.exit_code == 0 and len(asked) == 3 and state["status"] == "finished"
    away = [e for e in state["events"] if e["event"] == "cloud away"]
    assert len(away) == 1 and "SSH protocol banner" in away[0]["error"]
    monkeypatch.setattr(recovery, "NODE_WAIT", 0.05)
    with pytest.raises(Unreachable, match="nw-0"):
        resumed_run("nw2", [drop] * 1000)
    # only waits in a row count: another error between them (here the cloud's) starts the count again
    monkeypatch.setattr(recovery, "CLOUD_WAIT", (0.02, 0.02))
    res, state, asked = resumed_run("nw3", [drop, drop, Unavailable("Nova is not answering"), drop, drop])
    assert res.exit_code == 0 and len(asked) == 6
