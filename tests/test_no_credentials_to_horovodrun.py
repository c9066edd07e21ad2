"""horovodrun copies its whole environment onto every rank's ssh command line (visible in `ps`): the doctor's
allreduce and bench's bare-horovodrun baseline use the same allow-list as `appliance train` (issue 14, item 12)."""

from appliance.bench import bare_horovodrun
from appliance.cluster import Cluster, Node
from appliance.node import doctor
from conftest import write_spec
from fakes import FakeRemote
from appliance.sites import load_spec


def test_the_doctors_allreduce_gets_no_credentials(tmp_path, monkeypatch):
    monkeypatch.setenv("OS_PASSWORD", "hunter2")
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "s3cret")
    (tmp_path / "horovodrun").write_text("#!/bin/sh\n")
    seen = {}

    def fake_run(cmd, timeout=60, env=None):
        seen["env"] = env
        return 1, "no"

    monkeypatch.setattr(doctor, "_run", fake_run)
    doctor.allreduce_check(str(tmp_path / "python"))
    assert "OS_PASSWORD" not in seen["env"] and "AWS_SECRET_ACCESS_KEY" not in seen["env"]
    assert "hunter2" not in " ".join(seen["env"].values())
    assert seen["env"]["TF_USE_LEGACY_KERAS"] == "1"


def test_the_bare_horovodrun_baseline_gets_no_credentials(tmp_path, monkeypatch):
    monkeypatch.setenv("OS_PASSWORD", "hunter2")
    node = Node("head", "10.0.0.1", None, "/w")
    cluster = Cluster(name="b", cloud="testbed", nodes=[node], python="/venv/bin/python")
    head = FakeRemote(node)
    session = type("S", (), {"head": head})()
    spec = load_spec(write_spec(tmp_path, "python job.py", code=tmp_path, name="b", nodes=1))
    bare_horovodrun(cluster, spec, session)
    cmd = head.commands[0][0]
    assert "env -i" in cmd and "hunter2" not in cmd and "OS_PASSWORD" not in cmd
    assert "HOROVOD_CYCLE_TIME" not in cmd


def test_the_bare_horovodrun_baseline_gets_what_the_sites_ranks_get(tmp_path, monkeypatch):
    """`appliance bench --overhead` compares the appliance's job with bare horovodrun: on the local site both get its
    ranks' HOROVOD_CYCLE_TIME (Site.rank_env), or the comparison would measure that setting, not the appliance."""
    import contextlib

    import pytest

    from appliance import bench

    node = Node("head", "10.0.0.1", None, "/w")
    cluster = Cluster(name="b", cloud="testbed", nodes=[node], python="/venv/bin/python")
    head = FakeRemote(node)
    session = type("S", (), {"head": head})()
    spec = load_spec(write_spec(tmp_path, "python job.py", code=tmp_path, name="b", nodes=1))
    bare_horovodrun(cluster, spec, session, rank_env={"HOROVOD_CYCLE_TIME": "10"})
    assert "HOROVOD_CYCLE_TIME=10 " in head.commands[0][0]
    seen = {}

    class Done(Exception):
        pass

    def bare(cluster, spec, session, on_line=None, rank_env=None):
        seen["bare"] = rank_env
        raise Done

    def job(spec, cluster, **kw):
        return type("R", (), {"exit_code": 0, "results": {0: {"bench": [{"aggregate": 1.0}]}}, "wall_s": 1.0})()

    monkeypatch.setattr(bench, "bare_horovodrun", bare)
    monkeypatch.setattr(bench, "train_job", job)
    import appliance.remote
    monkeypatch.setattr(appliance.remote, "Session", lambda cluster: contextlib.nullcontext(session))
    with pytest.raises(Done):
        bench.overhead(spec, cluster, bench.BenchConfig(models=["mlp"], batch_sizes=[16]), repeats=1)
    assert seen == {"bare": {"HOROVOD_CYCLE_TIME": "10"}}  # a testbed cluster's, as its jobs' (test_environment.py)
