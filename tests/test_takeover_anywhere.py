"""A managed run taken over from another machine, and cancelled from anywhere (issue 77 item 3), fast tier: the
run's current cluster is in its controller's state in the store (no secret), a controller under another
APPLIANCE_HOME rebuilds it, follows the job still training on it and keeps its lease; a cancel in the store becomes
the job's STOP on its head node (node/lockbeat.py); a job that does not answer within two of its lock's heartbeats
loses its lease, with the steps lost said. Another machine is another APPLIANCE_HOME (a tmp dir)."""

from __future__ import annotations

import datetime as dt
import json
import os
import tempfile
from types import SimpleNamespace

import pytest

from appliance import flows
from appliance.checkpoint import runs
from appliance.cluster import Cluster, Node, SiteRecord, find_cluster
from appliance.flows import control as control_mod
from appliance.flows import managed, runcluster, stopping, takeover
from appliance.node import lockbeat
from appliance.protocol import RUN_MARKER
from appliance.sites import open_site
from appliance.sites.openstack_api import LeaseInfo
from appliance.store import stopask
from appliance.store.checkpoints import open_run
from appliance.store.runlock import RunLock
from appliance.train import headjob
from conftest import write_spec

SECRET = "-----BEGIN OPENSSH PRIVATE KEY-----\nnot-a-real-key-but-a-secret\n"
HOST_KEYS = "n1,10.0.0.1 ssh-ed25519 AAAAC3host1\nn2,10.0.0.2 ssh-ed25519 AAAAC3host2\n"


def _key(d) -> str:
    d.mkdir(parents=True, exist_ok=True)
    p = d / "id_ed25519"
    p.write_text(SECRET)
    p.chmod(0o600)
    return str(p)


@pytest.fixture
def first_home(tmp_path, monkeypatch):
    """A run whose controller (home 1) started a job on its cluster (lease L1, its host keys pinned): (spec, that
    controller). Each test's run has a name of its own."""
    monkeypatch.setenv("APPLIANCE_HOME", str(tmp_path / "home1"))
    name = f"ta{os.urandom(3).hex()}"
    key = _key(tmp_path / "keys")
    spec = flows.check(str(write_spec(tmp_path, "python x.py", code=tmp_path, name=name,
                                      extra=f"checkpoint: {{url: 'file://{tmp_path}/ck/'}}\nkey_file: {key}\n")))
    known = tmp_path / "home1" / "clusters" / f"{name}.known_hosts"
    known.parent.mkdir(parents=True, exist_ok=True)
    known.write_text(HOST_KEYS)
    cl = Cluster(name=name, cloud="local", key_file=key, known_hosts=str(known), lease_id="L1",
                 lease_end="2026-12-01T10:00:00", site=SiteRecord(key_name="k", key_file=key, lease_name=f"{name}-1",
                                                                  servers={"n1": "s1", "n2": "s2"}),
                 nodes=[Node("n1", "10.0.0.1", "10.0.0.1", "/w", server_id="s1"),
                        Node("n2", "10.0.0.2", None, "/w", server_id="s2")])
    cl.save()
    runs.mark_managed(spec)
    c = managed.Control(spec, None, poll=3600)
    c.take()
    c.hook(lambda why: None).started(SimpleNamespace(spec=spec, job_id=f"{name}-1", restore=None, cluster=cl))
    c._done.set()  # its machine goes away: no more heartbeats, its lock is not released
    return spec, c


def _second_home(tmp_path, monkeypatch, spec, dead):
    """A controller of the run on another machine (home 2), which took the run over from ``dead``."""
    monkeypatch.setenv("APPLIANCE_HOME", str(tmp_path / "home2"))
    monkeypatch.setattr(control_mod, "gone_here", lambda cid: cid == dead.id)  # its lock went stale
    c = managed.Control(spec, None, poll=0.01)
    c.take()
    assert c.took_over == dead.id
    return c


def _job_lock(ctx, job_id, launcher, *, started=True, lease_id="L1") -> dict:
    lock = RunLock(ctx.checkpoints, job_id, cluster=ctx.spec.name, head="n1", launcher=launcher, lease_id=lease_id)
    lock.started = started
    assert lock.acquire(tempfile.gettempdir())[0] is None
    return lock.read()


def test_the_runs_state_carries_its_cluster_without_secrets_and_another_home_rebuilds_it(first_home, tmp_path,
                                                                                          monkeypatch):
    spec, first = first_home
    buf = bytearray()
    first.cs.store.get(first.cs.prefix + "state.json", buf.extend)  # as it is in the store
    text = buf.decode()
    state = json.loads(text)
    rec = state["cluster"]
    assert rec["lease_id"] == "L1" and rec["site"]["servers"] == {"n1": "s1", "n2": "s2"}
    assert [n["address"] for n in rec["nodes"]] == ["10.0.0.1", None] and rec["host_keys"] == HOST_KEYS
    assert "not-a-real-key" not in text and "id_ed25519" not in text and "key_file" not in text
    # another machine, with the spec's key pair's private key of its own
    second = _second_home(tmp_path, monkeypatch, spec, first)
    assert find_cluster(spec.name) is None
    key2 = _key(tmp_path / "keys2")
    got = runcluster.adopt(flows.RunContext(spec, open_site("local")), second, key_file=key2)
    here = find_cluster(spec.name)
    assert got is not None and here is not None and here.lease_id == "L1" and here.head.name == "n1"
    assert here.key_file == key2 and here.site.key_file == key2 and here.site.servers == {"n1": "s1", "n2": "s2"}
    assert here.known_hosts.startswith(str(tmp_path / "home2")) and open(here.known_hosts).read() == HOST_KEYS
    assert any(e["event"] == "cluster rebuilt" for e in second.state["events"])
    second.close("finished")


class _Cloud:
    def __init__(self, leases):
        self.leases, self.deleted = leases, []

    def list_leases(self):
        return self.leases

    def delete_lease(self, lease_id):
        self.deleted.append(lease_id)

    def get_lease(self, lease_id):
        return None

    def now(self):
        return dt.datetime(2026, 12, 7, 9, 30)


def test_a_takeover_from_another_home_follows_the_job_still_training_and_keeps_its_lease(first_home, tmp_path,
                                                                                         monkeypatch, said):
    spec, first = first_home
    ctx1 = flows.RunContext(spec, open_site("local"))
    job = _job_lock(ctx1, f"{spec.name}-1", first.id)
    first.asked(f"{spec.name}-1", {"cluster": spec.name, "lease_id": "L1"})
    first.asked(f"{spec.name}-2", {"cluster": f"{spec.name}_h", "lease_id": "L2"})  # nothing uses it
    second = _second_home(tmp_path, monkeypatch, spec, first)
    ctx = flows.RunContext(spec, open_site("local"))
    lease = lambda i, n, st, h: LeaseInfo(i, n, st, dt.datetime(2026, 12, 7, h), dt.datetime(2026, 12, 7, h + 1),  # noqa: E731
                                          None, None, False, node_type="compute_local", hosts=1)
    # L2: the next cluster's, booked ahead by the dead controller, not started: nothing uses it
    cloud = _Cloud([lease("L1", f"{spec.name}-1", "ACTIVE", 9), lease("L2", f"{spec.name}-2", "PENDING", 11)])
    monkeypatch.setattr(ctx, "at", lambda site=None: SimpleNamespace(cloud=cloud))
    asked_head = []
    monkeypatch.setattr(headjob, "job_runs", lambda cl, run: asked_head.append(cl) or True)
    looks = [job, job, None]
    monkeypatch.setattr(takeover, "live_job", lambda ctx: looks.pop(0))
    monkeypatch.setattr(managed._Run, "account", lambda self: None)
    ended = []
    monkeypatch.setattr(managed._Run, "followed_end", lambda self, job_id, cluster: ended.append(
        (job_id, cluster.name)) or "followed")
    run = managed._Run(ctx, second, 0, None)
    assert run.first_job() == "followed"
    assert ended == [(job["job_id"], spec.name)] and run.current == spec.name
    assert asked_head and asked_head[0].known_hosts.startswith(str(tmp_path / "home2"))  # its head, asked from here
    assert cloud.deleted == ["L2"]  # the rebuilt record's lease stays; the one nothing uses goes
    events = [e["event"] for e in second.state["events"]]
    assert "following" in events and "job not started" not in events
    run.settle()
    second.close("finished")


def test_a_job_the_dead_controller_locked_and_never_started_is_taken_over_from_another_home_at_once(
        first_home, tmp_path, monkeypatch):
    spec, first = first_home
    job = _job_lock(flows.RunContext(spec, open_site("local")), f"{spec.name}-1", first.id, started=False)
    second = _second_home(tmp_path, monkeypatch, spec, first)
    ctx = flows.RunContext(spec, open_site("local"))
    monkeypatch.setattr(headjob, "job_runs", lambda cl, run: None)  # its head cannot be asked
    monkeypatch.setattr(takeover, "_withdraw_job_creds", lambda ctx, job_id: None)
    assert takeover._launched(ctx, second, job)[0] == "not started"
    assert takeover._launched(ctx, second, {**job, "started": True})[0] == ""  # the lock's ttl decides
    second.close("finished")


def test_a_cancel_in_the_store_becomes_the_jobs_stop_file_on_its_head(tmp_path):
    cs = open_run(f"file://{tmp_path}/store/", "r", None)
    rd = tmp_path / "run"
    rd.mkdir()
    (rd / RUN_MARKER).write_text("")
    lock = RunLock(cs, "r-2", cluster="c", head="n1", interval=60, ttl=300)
    assert lock.acquire(tmp_path)[0] is None
    stopask.ask(cs, "r-1", "elsewhere")  # an older job's request: not this job's
    assert not lockbeat.check_stop(lock, str(rd), "r-2") and not (rd / "STOP").exists()
    assert stopping.ask(cs, "laptop") == "r-2"  # `appliance cancel`: for the job that holds the run's lock
    (rd / "r-2.pid").write_text(str(os.getpid()))  # running, until its second round
    rounds = []

    def wait(seconds):
        rounds.append(seconds)
        if len(rounds) == 2:
            (rd / "r-2.rc").write_text("0")
    lockbeat.beat(lock, str(rd), "r-2", wait=wait)
    assert json.loads((rd / "STOP").read_text())["reason"] == "appliance cancel"
    assert rounds[0] <= stopask.STOP_POLL  # looked at more often than the lock's heartbeat
    assert stopask.asked(cs, "r-2")["answered"]


def _a_cancelled_job(spec, monkeypatch):
    """A run's controller (taken) and the lock of a job of it started elsewhere on lease L9, whose run's newest
    commit is step 120: (context, the cloud that records lease deletes, controller)."""
    ctx = flows.RunContext(spec, open_site("local"))
    cloud = _Cloud([])
    monkeypatch.setattr(ctx, "at", lambda site=None: SimpleNamespace(cloud=cloud))
    monkeypatch.setattr(takeover, "newest_commit", lambda ctx: ("ckpt-000000120", 120))
    monkeypatch.setenv("APPLIANCE_RUN_LOCK_INTERVAL", "60")
    c = managed.Control(spec, None, poll=3600)
    c.take()
    _job_lock(ctx, f"{spec.name}-1", "elsewhere", lease_id="L9")
    return ctx, cloud, c


@pytest.mark.parametrize("answers", [False, True])
def test_a_job_that_does_not_answer_the_cancel_loses_its_lease_and_the_steps_lost_are_said(tmp_path, monkeypatch,
                                                                                           said, answers):
    spec = flows.check(str(write_spec(tmp_path, "python x.py", code=tmp_path, name=f"tc{os.urandom(3).hex()}",
                                      extra=f"checkpoint: {{url: 'file://{tmp_path}/ck/'}}\n")))
    ctx, cloud, c = _a_cancelled_job(spec, monkeypatch)
    clock, rd = [0.0], tmp_path / "run"
    rd.mkdir()
    (rd / RUN_MARKER).write_text("")
    head = RunLock(ctx.checkpoints, f"{spec.name}-1", cluster="c", head="n1")

    def wait(seconds):  # the fake clock; the head's beat looks at the request meanwhile when it answers
        clock[0] += seconds
        if answers:
            lockbeat.check_stop(head, str(rd), f"{spec.name}-1")
        return False
    got = stopping.enforce(ctx, c, wait=wait, now=lambda: clock[0])
    if answers:
        assert got == "answered" and cloud.deleted == [] and (rd / "STOP").exists()
    else:
        assert got == "deleted" and cloud.deleted == ["L9"] and 120 <= clock[0] < 130
        line = next(m for m in said if "did not answer the stop within 120s" in m)
        assert "lease L9 is deleted" in line and "steps after step 120" in line and "lost" in line
        assert any(e["event"] == "lease deleted" and e["lease_id"] == "L9" for e in c.state["events"])
    c.close("cancelled")


def test_a_lock_with_no_word_of_a_start_is_not_the_cancels_to_end(tmp_path, monkeypatch):
    spec = flows.check(str(write_spec(tmp_path, "python x.py", code=tmp_path, name=f"tn{os.urandom(3).hex()}",
                                      extra=f"checkpoint: {{url: 'file://{tmp_path}/ck/'}}\n")))
    ctx = flows.RunContext(spec, open_site("local"))
    c = managed.Control(spec, None, poll=3600)
    c.take()
    _job_lock(ctx, f"{spec.name}-1", "a dead controller", started=False, lease_id="L9")
    assert stopping.enforce(ctx, c, wait=lambda s: pytest.fail("waited"), now=lambda: 0.0) == "not started"
    c.close("cancelled")


def test_the_controller_enforces_the_stop_on_a_cancel(tmp_path, monkeypatch):
    spec = flows.check(str(write_spec(tmp_path, "python x.py", code=tmp_path, name=f"te{os.urandom(3).hex()}",
                                      extra=f"checkpoint: {{url: 'file://{tmp_path}/ck/'}}\n")))
    c = managed.Control(spec, None, poll=3600)
    c.take()
    monkeypatch.setattr(managed._Run, "account", lambda self: None)
    enforced = []
    monkeypatch.setattr(stopping, "enforce", lambda ctx, control: enforced.append(control))
    run = managed._Run(flows.RunContext(spec, open_site("local")), c, 0, None)
    c.cancelled({"controller": c.id, "by": "elsewhere"})
    run.settle()
    assert enforced == [c]
    c.close("cancelled")


def test_the_cancels_check_outlives_a_store_that_does_not_answer_for_a_while(tmp_path, monkeypatch, said):
    """The enforcer's thread died on one refused read of the run's lock (a store token from the run's start): a
    read that fails is said once and looked at again, and the stop is still enforced, the time the store was away
    not counted against the job."""
    import requests

    from appliance.errors import Unavailable

    spec = flows.check(str(write_spec(tmp_path, "python x.py", code=tmp_path, name=f"tu{os.urandom(3).hex()}",
                                      extra=f"checkpoint: {{url: 'file://{tmp_path}/ck/'}}\n")))
    ctx, cloud, c = _a_cancelled_job(spec, monkeypatch)
    real, reads = RunLock.read, []

    def read(self):
        reads.append(1)
        if len(reads) == 1:  # not only the appliance's errors: a client's own (swiftclient, keystoneauth, requests)
            raise requests.exceptions.ConnectionError("Connection refused")
        if len(reads) in (3, 4):
            raise Unavailable("the store is not answering (HTTP 503, asked again with back-off)")
        return real(self)

    monkeypatch.setattr(RunLock, "read", read)
    clock, poll = [0.0], 10.0

    def wait(seconds):
        clock[0] += seconds
        return False
    assert stopping.enforce(ctx, c, wait=wait, poll=poll, now=lambda: clock[0]) == "deleted"
    assert cloud.deleted == ["L9"] and 120 + 2 * poll <= clock[0] < 120 + 4 * poll  # the store's time away not the job's
    assert len([m for m in said if "cannot read run" in m and "Connection refused" in m]) == 1
    assert not [m for m in said if "HTTP 503" in m]  # said once for the whole cancel
    c.close("cancelled")
