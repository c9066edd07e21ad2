"""A managed run's ETTR (flows/ettr.py): the share of its time spent on steps committed and kept, and what ate the
rest, from fabricated timelines and from one the controller itself writes; `appliance ls RUN` shows it."""

import json
import time
from types import SimpleNamespace

import pytest

from appliance.checkpoint import runs
from appliance.flows import ettr, managed
from appliance.train.launch import JobResult
from test_managed_run import _Ctx, _spec

KEPT = {"end_committed": True, "last_commit_at": None}  # a job's end that kept its steps (stopped with a commit)


def _end(at, job, first, *, kept=True, last_commit=None, rc=75):
    return {"at": at, "event": "job end", "job_id": job, "exit_code": rc, "lease_end": rc != 0, "first_step_at": first,
            "last_commit_at": last_commit, "end_committed": kept}


def _sums(e):
    """The parts add up to the run's time, and each breakdown to its part."""
    assert sum(e["parts"].values()) == pytest.approx(e["run_s"], abs=0.05)
    assert sum(e["handover"].values()) == pytest.approx(e["parts"]["handover"], abs=0.05)
    assert sum(e["wait"].values()) == pytest.approx(e["parts"]["wait"], abs=0.05)
    assert e["ettr"] == pytest.approx(e["parts"]["train"] / e["run_s"], abs=1e-4)


COLD = {"find checkpoint": 0.5, "cluster (other)": 9.5, "lease": 20.0, "boot": 200.0, "ssh + contextualize": 30.0,
        "stage data": 5.0, "stage checkpoint": 5.0, "job setup": 10.0, "horovod start": 15.0, "restore": 2.0,
        "first step": 3.0, "total": 300.0}


def test_an_uninterrupted_run_is_its_training_share():
    ev = [{"at": 1000.0, "event": "controller"}, {"at": 1100.0, "event": "job", "job_id": "j1"},
          _end(4700.0, "j1", 1130.0, rc=0), {"at": 4710.0, "event": "end", "status": "finished"}]
    e = ettr.ettr({"events": ev})
    _sums(e)
    assert e["ended"] and e["run_s"] == 3710.0 and e["parts"]["train"] == 3570.0
    assert e["ettr"] == pytest.approx(3570 / 3710, abs=1e-4)
    assert e["parts"]["start"] == 130.0 and e["parts"]["other"] == 10.0  # its first job's launch; its end steps
    assert e["parts"]["handover"] == e["parts"]["wait"] == e["parts"]["lost"] == 0 and e["handovers"] == 0


def _three_leases():
    """Three leases, two cold handovers; the second job's lease end took its nodes 100 s after its last commit."""
    return [{"at": 0.0, "event": "controller"}, {"at": 100.0, "event": "job", "job_id": "j1"},
            _end(1100.0, "j1", 130.0, last_commit=1095.0),
            {"at": 1101.0, "event": "handover", "after": "j1", "warm": False},
            {"at": 1300.0, "event": "job", "job_id": "j2", "restore": True},
            {"at": 1420.5, "event": "downtime", "job_id": "j2", "warm": False, "breakdown": COLD},
            _end(2400.0, "j2", 1420.0, kept=False, last_commit=2300.0, rc=1),
            {"at": 2401.0, "event": "handover", "after": "j2", "warm": False},
            {"at": 2600.0, "event": "job", "job_id": "j3", "restore": True},
            {"at": 2720.5, "event": "downtime", "job_id": "j3", "warm": False, "breakdown": COLD},
            _end(3720.0, "j3", 2720.0, rc=0), {"at": 3730.0, "event": "end", "status": "finished"}]


def test_a_cold_run_over_three_leases_counts_its_handovers_by_phase_and_its_lost_steps():
    e = ettr.ettr({"events": _three_leases()})
    _sums(e)
    assert e["run_s"] == 3730.0 and e["handovers"] == 2
    assert e["parts"]["train"] == (1100 - 130) + (2300 - 1420) + (3720 - 2720)  # j2: to its last commit
    assert e["parts"]["lost"] == 100.0  # j2's steps after its last commit
    assert e["parts"]["handover"] == 2 * 300 + 2 * 20  # each breakdown, and the old cluster going before it
    assert e["handover"]["boot"] == 400.0 and e["handover"]["lease"] == 40.0 and e["handover"]["before resume"] == 40
    assert e["handover"]["first step"] == 6.0 and e["parts"]["start"] == 130.0 and e["parts"]["other"] == 10.0
    assert e["ettr"] == pytest.approx(2850 / 3730, abs=1e-4)


def test_a_parked_span_and_a_slot_wait_are_waits_not_handover_phases():
    ev = _three_leases()[:8] + [
        {"at": 2500.0, "event": "no hosts", "node_type": "gpu_v100"},
        {"at": 2510.0, "event": "parked", "reason": "no slot within lease.wait 1h"},
        {"at": 3510.0, "event": "waiting for hosts", "start": "x", "wait_s": 600},
        {"at": 4110.0, "event": "hosts free", "waited_s": 600.0},
        {"at": 4300.0, "event": "job", "job_id": "j3", "restore": True},
        {"at": 4420.5, "event": "downtime", "job_id": "j3", "breakdown": {**COLD, "cluster (other)": 1709.5,
                                                                          "total": 2000.0}},
        _end(5420.0, "j3", 4420.0, rc=0), {"at": 5430.0, "event": "end", "status": "finished"}]
    e = ettr.ettr({"events": ev})
    _sums(e)
    assert e["wait"] == {"parked": 1000.0, "hosts": 600.0} and e["parts"]["wait"] == 1600.0
    # the waits were inside the second handover's "cluster (other)": counted once, as waits
    assert e["handover"]["cluster (other)"] == 9.5 + 109.5
    assert e["parts"]["handover"] == 300 + 2000 - 1600 + 2 * 20


def test_a_run_still_going_counts_to_now_and_its_running_job_as_training():
    ev = _three_leases()[:6]  # j2 trains since its first step
    e = ettr.ettr({"events": ev}, now=2000.0)
    _sums(e)
    assert not e["ended"] and e["run_s"] == 2000.0 and e["parts"]["train"] == 970 + (2000 - 1420.5)  # from its downtime
    parked = ettr.ettr({"events": [*_three_leases()[:8], {"at": 2500.0, "event": "parked"}]}, now=3000.0)
    _sums(parked)
    assert parked["wait"] == {"parked": 500.0} and parked["handover"]["unfinished"] == (3000 - 2400) - 500.0


def test_a_stopped_run_taken_up_again_counts_the_time_without_a_controller_as_a_wait():
    ev = [{"at": 0.0, "event": "controller"}, {"at": 10.0, "event": "job", "job_id": "j1"},
          _end(1000.0, "j1", 40.0, rc=75), {"at": 1010.0, "event": "end", "status": "stopped"},
          {"at": 5000.0, "event": "controller"}, {"at": 5100.0, "event": "job", "job_id": "j2"},
          _end(6000.0, "j2", 5130.0, rc=0), {"at": 6005.0, "event": "end", "status": "finished"}]
    e = ettr.ettr({"events": ev})
    _sums(e)
    assert e["wait"] == {"no controller": 3990.0} and e["parts"]["start"] == 40 + 130 and e["parts"]["restart"] == 0


def test_a_failed_job_restarted_loses_its_steps_after_its_last_commit():
    ev = [{"at": 0.0, "event": "controller"}, {"at": 10.0, "event": "job", "job_id": "j1"},
          _end(1000.0, "j1", 40.0, kept=False, last_commit=700.0, rc=1),
          {"at": 1100.0, "event": "job", "job_id": "j2"}, _end(2000.0, "j2", 1150.0, rc=0),
          {"at": 2001.0, "event": "end", "status": "finished"}]
    e = ettr.ettr({"events": ev})
    _sums(e)
    assert e["parts"]["lost"] == 300.0 and e["parts"]["restart"] == 150.0 and e["parts"]["train"] == 660 + 850


def test_an_older_timeline_without_marks_reads_the_run_records_lost_seconds():
    ev = [{"at": 0.0, "event": "controller"}, {"at": 10.0, "event": "job", "job_id": "j1"},
          {"at": 1000.0, "event": "job end", "job_id": "j1", "exit_code": 1, "failure": "boom"},
          {"at": 1001.0, "event": "end", "status": "failed"}]
    e = ettr.ettr({"events": ev}, [{"job_id": "j1", "nodes": 2, "node_seconds_lost": 400.0}])
    _sums(e)
    assert e["parts"]["lost"] == 200.0 and e["parts"]["train"] == 790.0 and e["notes"]  # its launch, said
    assert ettr.ettr({"events": []}) is None


def test_the_controller_records_what_the_ettr_needs_and_ls_shows_it(tmp_path, monkeypatch):
    """The timeline the controller itself writes (its job hook, a handover, its downtime), read back from the store
    (on a clock of the test's): `appliance ls RUN` prints one ETTR line and its breakdown, --json the fields."""
    from click.testing import CliRunner

    from appliance.cli import main
    from appliance.flows import control

    now = [10000.0]
    clock = SimpleNamespace(time=lambda: now[0], monotonic=time.monotonic, sleep=time.sleep)
    monkeypatch.setattr(control, "time", clock)
    monkeypatch.setattr(ettr, "time", clock)
    spec = _spec(tmp_path, "me")
    c = managed.Control(spec, None, poll=3600)
    c.take()
    runs.mark_managed(spec)
    for job, at, first, commit, end in (("j1", 10100, 10130, 11000, 11100), ("j2", 11700, 11820, 12500, 12800)):
        now[0] = at
        hook = c.hook(lambda reason: None)
        hook.started(_Ctx(spec, job))
        if job == "j2":
            now[0] = first
            c.record("downtime", job_id="j2", warm=False, breakdown={"lease": 30.0, "boot": 600.0, "total": 700.0})
        now[0] = end
        hook.finish(JobResult(job_id=job, exit_code=75 if job == "j1" else 1, world_size=2, rank_hosts=["n1", "n2"],
                              lease_end=True, commits=[{"name": "c", "step": 10, "at": commit}],
                              timeline={"launched": first - 20, "first_step": first},
                              stopped={"step": 12, "committed": True} if job == "j1" else None))
        if job == "j1":
            now[0] = 11101
            c.handing_over(after="j1", warm=False)
    done = [x for x in c.state["events"] if x["event"] == "job end"]
    assert [(x["first_step_at"], x["last_commit_at"], x["end_committed"]) for x in done] == [
        (10130, 11000, True), (11820, 12500, False)]
    now[0] = 13000
    r = CliRunner().invoke(main, ["ls", "me"])
    assert r.exit_code == 0, r.output
    (line,) = [x for x in r.output.splitlines() if "ETTR" in x]
    assert line == ("  ETTR 55.0%: trained and kept 27m30s of the run's 50m00s so far (controller's clock); "
                    "handovers (1) 12m00s, lost steps 5m00s, start 2m10s, other 3m20s")
    assert "    handovers: before resume 20.0s, lease 30.0s, boot 10m00s, other 70.0s" in r.output.splitlines()
    c.close("failed")
    r = CliRunner().invoke(main, ["ls", "me", "--json"])
    e = json.loads(r.output)["ettr"]
    _sums(e)
    assert e["ended"] and e["clock"] == "controller" and e["handovers"] == 1 and e["run_s"] == 3000.0
    assert {"ettr", "run_s", "parts", "handover", "wait", "notes"} <= set(e) and not e["notes"]
    assert e["parts"] == {"train": 1650.0, "lost": 300.0, "handover": 720.0, "wait": 0.0, "start": 130.0,
                          "restart": 0.0, "other": 200.0}


def test_the_ettr_line_says_each_part():
    from appliance.cli.views import format_ettr

    lines = format_ettr(ettr.ettr({"events": _three_leases()}))
    assert lines[0] == ("  ETTR 76.4%: trained and kept 47m30s of the run's 62m10s (controller's clock); "
                        "handovers (2) 10m40s, lost steps 100.0s, start 2m10s, other 10.0s")
    assert lines[1].startswith("    handovers: before resume 40.0s, find checkpoint 1.0s, cluster (other) 19.0s, "
                               "lease 40.0s, boot 6m40s")
    assert len(lines) == 2


def test_a_wait_for_the_cloud_in_a_handover_is_a_wait_of_its_own():
    """The cloud did not answer the recovery strategy for 900 s of a cold handover (recovery.next_cluster)."""
    ev = _three_leases()
    i = next(k for k, e in enumerate(ev) if e.get("event") == "handover")
    ev[i + 1:i + 1] = [{"at": 1102.0, "event": "cloud away", "error": "Blazar is not answering (HTTP 503)"},
                       {"at": 2002.0, "event": "cloud back", "waited_s": 900.0}]
    for e in ev[i + 3:]:
        e["at"] += 900.0
        for k in ("first_step_at", "last_commit_at"):
            if e.get(k):
                e[k] += 900.0
    e = ettr.ettr({"events": ev})
    _sums(e)
    assert e["wait"] == {"cloud": 900.0}
