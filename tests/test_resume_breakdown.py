"""A resume's downtime, phase by phase (issue 16 goal 5): computed from the marks of flows.resume, lifecycle.up and
the job, kept in the run record, shown by `appliance resume` and `appliance ls RUN`.

Fast tier. The e2e managed run (tests/test_lease_end.py::
test_a_managed_run_crosses_two_lease_ends_warm_after_its_launching_shell_is_killed) checks the same on two real
handovers: staging, horovodrun, the restore and the first step, with no lease, boot or SSH in them.
"""

from __future__ import annotations

import itertools
import json
import time
from types import SimpleNamespace

from click.testing import CliRunner

from appliance.checkpoint import runs
from appliance.cli import main
from appliance.flows import RESUME_PHASES, resume_breakdown
from appliance.provision import lifecycle
from appliance.train.launch import JobResult
from fakes import FakeSite

T0 = 1_800_000_000.0


def job(timeline, resumed=None) -> JobResult:
    return JobResult(job_id="r-1", exit_code=0, world_size=2, rank_hosts=["a", "b"], timeline=timeline,
                     resumed=resumed)


def test_the_parts_add_up_to_the_time_to_the_first_step():
    t = {"start": T0, "checkpoint chosen": T0 + 1, "cluster ready": T0 + 61, "data staged": T0 + 71,
         "checkpoint staged": T0 + 73}
    up = {"lease": 20.0, "boot": 25.0, "ssh + contextualize": 14.0}
    res = job({"launched": T0 + 75, "resumed": T0 + 90, "first_step": T0 + 92}, {"step": 300, "restore_s": 3.0})
    b = resume_breakdown(t, up, res)
    assert b == {"find checkpoint": 1.0, "lease": 20.0, "boot": 25.0, "ssh + contextualize": 14.0,
                 "cluster (other)": 1.0, "stage data": 10.0, "stage checkpoint": 2.0, "job setup": 2.0,
                 "horovod start": 12.0, "restore": 3.0, "first step": 2.0, "total": 92.0}
    assert abs(sum(v for k, v in b.items() if k != "total") - b["total"]) < 0.05


def test_up_s_phases_leave_no_negative_remainder_when_they_are_all_of_up(tmp_path, monkeypatch):
    """CI caught "cluster (other)" at -0.01 s: lifecycle.up rounded each phase to 10 ms, and when up spent (nearly)
    nothing outside its phases the rounded parts added up to more than the whole. A clock that moves 5.1 ms per
    reading makes every phase round up."""
    from test_fake_site import spec_of, up

    ticks = itertools.count()
    clock = SimpleNamespace(monotonic=lambda: next(ticks) * 0.0051, sleep=lambda s: None, time=time.time,
                            strftime=time.strftime, gmtime=time.gmtime)
    monkeypatch.setattr(lifecycle, "time", clock)
    phases: dict[str, float] = {}
    up(FakeSite(), spec_of(tmp_path), timings=phases)
    whole = (next(ticks) - 1) * 0.0051  # the first reading was 0: up's phases are the whole span
    t = {"start": T0, "checkpoint chosen": T0, "cluster ready": T0 + whole, "data staged": T0 + whole,
         "checkpoint staged": T0 + whole}
    b = resume_breakdown(t, phases, job({"launched": T0 + whole + 1, "resumed": T0 + whole + 3,
                                         "first_step": T0 + whole + 4}, {"step": 3, "restore_s": 0.5}))
    assert all(b[k] is not None and b[k] >= 0 for k in RESUME_PHASES if k in b), b
    assert abs(sum(v for k, v in b.items() if k != "total") - b["total"]) < 0.07  # 12 parts, each to 10 ms


def test_a_reused_cluster_has_no_lease_or_boot_and_a_job_that_never_stepped_has_no_total():
    t = {"start": T0, "checkpoint chosen": T0 + 1, "cluster ready": T0 + 1.5, "data staged": T0 + 1.5,
         "checkpoint staged": T0 + 2}
    b = resume_breakdown(t, {}, job({"launched": T0 + 3}))
    assert "lease" not in b and b["cluster (other)"] == 0.5
    assert b["horovod start"] is None and b["first step"] is None and b["total"] is None


def test_runs_RUN_shows_each_job_and_a_resumes_downtime(tmp_path, monkeypatch):
    monkeypatch.setenv("APPLIANCE_HOME", str(tmp_path))
    down = {"find checkpoint": 0.4, "lease": 20.0, "boot": 25.0, "ssh + contextualize": 14.0, "cluster (other)": 0.2,
            "stage data": 0.0, "stage checkpoint": 2.0, "job setup": 2.0, "horovod start": 12.0, "restore": 3.0,
            "first step": 2.0, "total": 80.6}
    runs.save({"run": "r", "status": "complete", "step": 900,
               "last_checkpoint": {"name": "step-000000900", "step": 900, "committed_at": 1.0},
               "node_seconds_used": 7200, "node_seconds_lost": 0, "jobs": [
                   {"job_id": "r-1", "status": "stopped", "nodes": 2, "first_step": 0, "last_step": 300},
                   {"job_id": "r-2", "status": "running", "nodes": 2}]})
    runs.record_resume("r", "r-2", down)
    out = CliRunner().invoke(main, ["ls", "r"])
    assert out.exit_code == 0, out.output
    lines = out.output.splitlines()
    assert lines[0].startswith("run r: complete, step 900, last checkpoint step-000000900")
    assert "job 1 r-1: stopped, steps 0..300 on 2 node(s)" in lines[1]
    assert lines[3] == ("    downtime 80.6s to the first step: find checkpoint 0.4s, lease 20.0s, boot 25.0s, "
                        "ssh + contextualize 14.0s, cluster (other) 0.2s, stage checkpoint 2.0s, job setup 2.0s, "
                        "horovod start 12.0s, restore 3.0s, first step 2.0s")
    js = json.loads(CliRunner().invoke(main, ["ls", "r", "--json"]).output)
    assert js["jobs"][1]["resume_breakdown"] == down
    bad = CliRunner().invoke(main, ["ls", "nope"])
    assert bad.exit_code == 1 and "no record of run 'nope'" in bad.output and "Traceback" not in bad.output
