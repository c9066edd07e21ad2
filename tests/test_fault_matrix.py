"""The handover fault matrix of a managed run (issue 77), in the fast tier: the fake site (tests/fakes.py), the
cloud's clock moved by the test, the jobs stand-ins that commit steps. A run of two jobs and so one lease end (cold:
lease.overlap 0; warm: the next cluster made while the job trains) meets, at each step of its handover, (a) one error (a lost answer for what makes something: the lease, a server, the floating IP; a 5xx left
after the retries for a read or the store), (b) the control plane away for minutes of the cloud's clock (every call
refused), or (c) the controller killed (kill -9: nothing of it runs after), then the run taken over by a controller
on another machine (another APPLIANCE_HOME) once the dead one's lock is stale. Every cell: the run finishes, no
committed step is lost (each job restores the newest commit), no lease, server or floating IP is left at the cloud,
at most one lease is made per cluster the run trains on, every lease made is on the run's ledger, and the wait or
the takeover is on its timeline. The same run end to end on the local cloud: tests/test_lease_end.py."""

from __future__ import annotations

import datetime as dt
import json
import threading
import time
from types import SimpleNamespace

import pytest

from appliance import flows
from appliance.errors import Unanswered, Unavailable
from appliance.flows import managed, recovery
from appliance.provision import lifecycle
from appliance.store.objects import FileStore
from appliance.store.runlock import TTL
from appliance.train.launch import JobResult
from conftest import write_spec
from fakes import FakeCloud, FakeSite

# a handover's steps, and the call each is at: the cloud's (tests/fakes.py FakeCloud), or the store's (staging)
STEPS = {"lease ask": "create_lease", "lease poll": "wait_lease", "server create": "create_server",
         "server poll": "get_servers", "floating IP": "attach_floating_ip", "contextualize": "server_host_keys",
         "stage": "stage data", "restore": "stage checkpoint"}
MADE = ("create_lease", "create_server", "attach_floating_ip")  # what makes something: its answer can be lost
STEP, TOTAL, JOBS = 100, 200, 2  # steps a job makes, each committed at its end; the run's last step; its jobs
AWAY = dt.timedelta(minutes=5)  # the control plane away this long, by the cloud's clock
RETRY = dt.timedelta(seconds=20)  # the cloud's clock moves this much with each call refused meanwhile
DONE = 20.0  # real seconds a wait of the test may take (a bound against a hang: each cell ends in a fraction)


class Killed(BaseException):
    """kill -9 of the controller: no `except Exception` of the appliance catches it, and it runs nothing more."""


class Dying:
    """The killed controller's view of the cloud: the cloud itself until it is killed, then nothing."""

    def __init__(self, cloud: FakeCloud, dead: threading.Event):
        self._cloud, self._dead = cloud, dead

    def __getattr__(self, name):
        if self._dead.is_set():
            raise Killed()
        return getattr(self._cloud, name)


class Cell:
    """One run of the matrix: ``mode`` cold | warm, the fault ``kind`` (error | away | kill) at ``step``."""

    def __init__(self, tmp_path, monkeypatch, mode: str, step: str, kind: str):
        self.tmp, self.mp, self.mode, self.verb, self.kind = tmp_path, monkeypatch, mode, STEPS[step], kind
        self.cloud = FakeCloud(ends=True)
        self.cloud.hook = self.hook
        self.dead = threading.Event()
        self.site = FakeSite(Dying(self.cloud, self.dead))
        self.commits: list[int] = []  # the run's committed steps (its checkpoint store)
        self.lost = 0  # committed steps a job did not restore
        self.jobs: list[str] = []
        self.armed = self.fired = False
        self.away_until: dt.datetime | None = None
        self.controls: list = []
        self.live: tuple[int, dt.datetime] | None = None  # the job training now: (its commit at its stop, its end)

    # the faults

    def hook(self, verb: str, when: str) -> None:
        if self.away_until is not None:
            if self.cloud.clock < self.away_until:
                if when == "ask":
                    self.cloud.clock += RETRY
                    raise Unavailable(f"the cloud is not answering ({verb}: HTTP 503, after the retries)")
                return
            self.away_until = None  # back
        if not self.armed or self.fired or verb != self.verb:
            return
        if when != ("answer" if verb in MADE and self.kind != "away" else "ask"):
            return
        self.fired = True
        if self.kind == "kill":
            self.kill()
            raise Killed()
        if self.kind == "away":
            self.away_until = self.cloud.clock + AWAY
            self.cloud.clock += RETRY
            raise Unavailable(f"the cloud is not answering ({verb}: HTTP 503, after the retries)")
        if verb in MADE:
            raise Unanswered(f"{verb}: no answer (HTTP 504); what was asked for may have been made")
        raise Unavailable(f"{verb}: HTTP 503, after the retries")

    def stage(self, cluster, url, dest, *, mode, creds, out, **kw) -> dict:
        verb = "stage checkpoint" if "/restore/" in dest else "stage data"
        if self.away_until is not None and self.cloud.clock >= self.away_until:
            self.away_until = None
        if self.away_until is not None or (self.armed and not self.fired and verb == self.verb):
            self.fired = True
            if self.kind == "kill":
                self.kill()
                raise Killed()
            if self.kind == "away" and self.away_until is None:
                self.away_until = self.cloud.clock + AWAY
            self.cloud.clock += RETRY
            raise Unavailable(f"staging failed on {cluster.name}-0: could not fetch {url} after 5 tries (HTTP 503)")
        return {}

    def kill(self) -> None:
        """The controller's machine goes: nothing of it runs after; a job training on the head goes on by itself to
        its lease's end, stopped there with a commit (the node's own watchdog)."""
        self.dead.set()
        for c in self.controls:
            c._done.set()
            c.changed.set()
        if self.live is not None:
            step, end = self.live
            self.commits.append(step)
            self.cloud.clock = max(self.cloud.clock, end)

    # the stand-ins: a node's boot, a job

    def finish(self, site, cluster) -> None:
        for node in cluster.nodes:
            site.cloud.server_host_keys(node.server_id)  # what `finish` asks Nova for: the nodes' host keys
        cluster.save()

    def run_job(self, spec, cluster, *, control=None, restore=None, on_first_step=None, **kw) -> JobResult:
        if self.dead.is_set() and control in self.first:
            raise Killed()
        start = int(restore.rstrip("/").rsplit("ckpt-", 1)[1]) if restore else 0
        self.lost += (self.commits[-1] if self.commits else 0) - start
        info = self.cloud.leases.get(cluster.lease_id)
        assert info is not None and info.status == "ACTIVE" and info.end > self.cloud.clock, \
            f"job {len(self.jobs) + 1} on {cluster.name}, not on a running lease of the run's"
        job_id = f"{spec.name}-{len(self.jobs) + 1}"
        self.jobs.append(cluster.name)
        self.armed = True
        end = start + STEP
        hook = control.hook(lambda why: None)
        self.live = (end, info.end)
        hook.started(SimpleNamespace(spec=spec, job_id=job_id, restore=restore, cluster=cluster))
        if on_first_step is not None:
            now = time.time()
            on_first_step({"launched": now, "first_step": now}, {"step": start} if restore else None)
        warm = getattr(control.on_job, "__self__", None)
        warm = warm.warm if warm is not None else None
        if end < TOTAL and warm is not None:  # it trains until the next lease starts, and its cluster is made
            self.cloud.clock = max(self.cloud.clock, info.end - dt.timedelta(minutes=30) + dt.timedelta(seconds=1))
            assert warm._done.wait(DONE)
        if self.dead.is_set() and control in self.first:
            raise Killed()
        self.live = None
        self.commits.append(end)
        ck = [{"name": f"ckpt-{end:09d}", "step": end, "at": time.time()}]
        if end >= TOTAL:
            res = JobResult(job_id=job_id, exit_code=0, world_size=2, rank_hosts=["a", "b"], commits=ck)
        else:  # stopped before its lease's end, with a commit; then the end
            self.cloud.clock = max(self.cloud.clock, info.end)
            res = JobResult(job_id=job_id, exit_code=75, world_size=2, rank_hosts=["a", "b"], commits=ck,
                            lease_end=True, stopped={"step": end, "committed": True, "reason": "lease end"})
        hook.finish(res)
        return res

    # the run

    def spec(self) -> str:
        overlap = "30m" if self.mode == "warm" else "0s"
        code = self.tmp / "code"
        code.mkdir(exist_ok=True)
        return str(write_spec(self.tmp, "python x.py", code=code, name="fm",
                              extra=f"checkpoint: {{url: 'file://{self.tmp}/ck/'}}\n"
                                    f"lease: {{duration: 2h, stop_margin: 1m, overlap: {overlap}}}\n"
                                    f"dataset: {{source: 'file://{self.tmp}/data/', dest: data, mode: full}}\n"))

    def run(self):
        mp, cell = self.mp, self
        mp.setenv("APPLIANCE_HOME", str(self.tmp / "home1"))
        mp.setenv("APPLIANCE_CONTROLLER_POLL", "0.01")
        mp.setattr(recovery, "CLOUD_WAIT", (0.001, 0.004))
        mp.setattr(flows.steps.RunContext, "of", classmethod(lambda cls, s: cls(s, cell.site)))
        mp.setattr(flows.steps, "run_job", self.run_job)
        mp.setattr(flows.steps, "stage_cluster", self.stage)
        mp.setattr(flows.steps, "_resume_point", lambda ctx: SimpleNamespace(
            name=f"ckpt-{cell.commits[-1]:09d}", step=cell.commits[-1]) if cell.commits else None)
        mp.setattr(managed, "_has_committed_work", lambda ctx: bool(cell.commits))
        mp.setattr(lifecycle, "finish", self.finish)

        class Tracked(managed.Control):
            def __init__(self, *a, **k):
                super().__init__(*a, **k)
                cell.controls.append(self)

            def _store(self, fn):
                if cell.dead.is_set() and self in cell.first:
                    raise Killed()
                return super()._store(fn)
        mp.setattr(managed, "Control", Tracked)
        quiet = threading.excepthook
        mp.setattr(threading, "excepthook", lambda a: None if issubclass(a.exc_type, Killed) else quiet(a))
        before = set(threading.enumerate())
        self.first = self.controls
        spec = self.spec()
        try:
            res = flows.run_managed(spec)
        except Killed:
            res = None
        if not self.dead.is_set():
            return res
        for t in set(threading.enumerate()) - before:  # every thread of the dead controller has ended
            _join(t)
        # another machine takes the run over once the dead controller's lock is stale by the store's clock
        self.first = list(self.controls)
        mp.setenv("APPLIANCE_HOME", str(self.tmp / "home2"))
        self.site = FakeSite(self.cloud)
        mp.setattr(FileStore, "clock", lambda store: time.time() + TTL + 1, raising=False)
        return flows.run_managed(spec)

    def state(self) -> dict:
        return json.loads((self.tmp / "ck" / "fm" / "controller" / "state.json").read_text())


def _join(t: threading.Thread) -> None:
    """``t`` ended. threading.enumerate() lists a thread from its start() on, and join() refuses it until it runs
    (RuntimeError "cannot join thread before it is started"): asked again a moment later."""
    for _ in range(10_000):
        try:
            t.join(DONE)
            return
        except RuntimeError:
            time.sleep(0.001)
    raise AssertionError(f"thread {t.name} never ran")


CELLS = [(mode, step, kind) for mode in ("cold", "warm") for step in STEPS for kind in ("error", "away", "kill")]


@pytest.mark.parametrize("mode,step,kind", CELLS, ids=["-".join(c).replace(" ", "_") for c in CELLS])
def test_a_handover_survives_a_fault_at_each_step(tmp_path, monkeypatch, mode, step, kind):
    cell = Cell(tmp_path, monkeypatch, mode, step, kind)
    res = cell.run()
    state = cell.state()
    assert cell.fired, f"the fault at {step} never came"
    assert res is not None and res.exit_code == 0 and state["status"] == "finished", state["events"][-3:]
    assert cell.commits[-1] == TOTAL and cell.lost == 0  # every job restored the newest commit
    c = cell.cloud
    left = [x for x in c.leases.values() if not x.ended]  # Blazar lists ended leases, not charged, until deleted
    assert not left and not c.servers and not c.fips, (left, c.servers, c.fips, state["events"][-6:])
    # one lease per cluster the run trains on, none made twice; warm, one more: the next lease booked as its last job
    # started (not known to be its last), not used, and gone with the run's end
    assert len(c.made) <= JOBS + (mode == "warm"), c.made
    assert set(c.made) <= set(state.get("leases") or {}), (c.made, state.get("leases"))  # each on the ledger
    events = [e["event"] for e in state["events"]]
    if kind != "kill":  # the run waited for the cloud, and said so
        assert "cloud away" in events and events.index("cloud away") < events.index("cloud back"), events
    if kind == "kill":
        assert any(e["event"] == "controller" and e.get("took_over") for e in state["events"]), events

