"""One path to the next cluster (issue 77 item 2), in the fast tier: a managed run's first job, new or continued,
takes its cluster from the recovery strategy (flows/recovery.py) as a handover does, and never the site's default
cluster; a handover waits for the warm cluster only while its lease starts soon (handover.Warm.ready)."""

import dataclasses
import datetime as dt
import functools
import threading
from types import SimpleNamespace

import pytest

from appliance import flows
from appliance.errors import NoHosts
from appliance.flows import managed
from appliance.provision import lifecycle
from appliance.sites.local import LocalSite
from appliance.train.launch import JobResult
from conftest import write_spec
from fakes import FakeSite, no_nodes

DONE = 30  # seconds a run of these tests is given to end: each ends at once, unless it waits for a lease (fails)


def _job(rc=0, *, lease_end=False, n=[0]):  # noqa: B006 - a counter for job ids
    n[0] += 1
    stopped = {"step": 40, "reason": "lease end (vendordata)", "committed": True} if lease_end else None
    return JobResult(job_id=f"p{n[0]}", exit_code=rc, world_size=2, rank_hosts=["a", "b"], lease_end=lease_end,
                     stopped=stopped)


@pytest.fixture
def first_job_of(tmp_path, monkeypatch):
    """run_managed of a spec on compute_local with nodes.alternatives [gpu_local], through its real first job and
    resume, with committed work (a continued run) or none (a new one): new leases of the node types in ``refused``
    are refused for want of hosts; ``default`` stands for the site's default cluster. Returns (result, the node
    types leases were asked for, the jobs run as (node type, cluster), the default cluster's uses)."""
    def run(name: str, committed: bool, refused: set, default=None):
        spec = write_spec(tmp_path, "python x.py", code=tmp_path, name=name,
                          extra=f"checkpoint: {{url: 'file://{tmp_path}/ck/'}}\n"
                                "nodes: {count: 2, node_type: compute_local, alternatives: [gpu_local]}\n")
        asked, ran, defaults = [], [], []

        def up(site, spec, **kw):
            asked.append(spec.nodes.node_type)
            if spec.nodes.node_type in refused:
                raise NoHosts(f"not enough hosts available for 2 x {spec.nodes.node_type}")
            return SimpleNamespace(name=spec.name, cloud="local", world_size=2)

        def job(spec, cluster, **kw):
            ran.append((spec.nodes.node_type, cluster.name))
            return _job(0)

        def default_cluster(self, spec):  # the bare testbed on the local cloud; none on Chameleon
            defaults.append(spec.name)
            return default
        monkeypatch.setattr(managed, "_has_committed_work", lambda ctx: committed)
        monkeypatch.setattr(flows.steps, "_resume_point", lambda ctx: None)  # its synced files: nothing to stage
        monkeypatch.setattr(flows.steps, "run_job", job)
        monkeypatch.setattr(lifecycle, "up", up)
        monkeypatch.setattr(LocalSite, "default_cluster", default_cluster)
        return flows.run_managed(str(spec)), asked, ran, defaults
    return run


@pytest.mark.parametrize("committed", [True, False], ids=["continued", "new"])
def test_a_run_whose_first_choice_is_busy_starts_on_the_alternative(first_job_of, committed):
    """`appliance run SPEC` again (after parking, a stop, a reboot, a takeover) with the spec's node type busy and
    nodes.alternatives free: the run failed at once, having asked only for its own node type."""
    res, asked, ran, _ = first_job_of(f"pa{int(committed)}", committed, {"compute_local"})
    assert asked == ["compute_local", "gpu_local"]
    assert res.exit_code == 0 and ran == [("gpu_local", f"pa{int(committed)}")]


def test_a_continued_managed_run_never_trains_on_the_sites_default_cluster(first_job_of):
    """The local site's default cluster is the bare testbed, no lease of the run's: a continued run with no cluster
    record here trained on it, and reported finished."""
    testbed = SimpleNamespace(name="testbed-tb", cloud="testbed", world_size=2, lease_id=None)
    res, asked, ran, defaults = first_job_of("pb", True, set(), default=testbed)
    assert res.exit_code == 0 and ran == [("compute_local", "pb")] and asked == ["compute_local"]
    assert defaults == []


def test_a_managed_resume_without_the_strategys_cluster_is_refused_in_one_line(tmp_path, monkeypatch):
    from appliance.errors import ApplianceError

    spec = flows.check(str(write_spec(tmp_path, "python x.py", code=tmp_path, name="pc",
                                      extra=f"checkpoint: {{url: 'file://{tmp_path}/ck/'}}\n")))
    monkeypatch.setattr(flows.steps, "_resume_point", lambda ctx: None)
    monkeypatch.setattr(LocalSite, "default_cluster", lambda self, spec: pytest.fail("the default cluster was taken"))
    with pytest.raises(ApplianceError, match="trains only on a lease of its own") as e:
        flows.steps.resume("pc", spec=spec, control=SimpleNamespace())
    assert "\n" not in str(e.value.message)


# -- the current lease gone early: the warm booking starts hours ahead ------------------------------------------------


@pytest.fixture
def warm_run(tmp_path, monkeypatch):
    """run_managed on the fake site (its clock stands still) of a run with 2 h leases and lease.overlap 30m, whose
    first job, on the run's cluster, starts the next cluster's booking (handover.Warm) and ends with its lease once
    that is booked; ``meanwhile(site, current, control)`` runs before it ends. Returns (whether the run ended within
    DONE seconds, its result, the clusters its resumes were given, the site, its first cluster, its controller, the
    next lease booked)."""
    def run(name: str, meanwhile):
        site = FakeSite()
        spec = flows.check(str(write_spec(tmp_path, "python x.py", code=tmp_path, name=name,
                                          extra=f"checkpoint: {{url: 'file://{tmp_path}/ck/'}}\n"
                                                "lease: {duration: 2h, overlap: 30m, book_ahead: 2h}\n")))  # at once
        current = lifecycle.up(site, spec, finish_nodes=no_nodes)
        monkeypatch.setattr(flows.steps.RunContext, "of", classmethod(lambda cls, s: cls(s, site)))
        monkeypatch.setenv("APPLIANCE_CONTROLLER_POLL", "0.05")
        booked, book, resumed, got = threading.Event(), lifecycle.book, [], {}

        def booking(*a, **k):
            cl = book(*a, **k)
            got["next"] = cl.lease_id
            booked.set()
            return cl
        monkeypatch.setattr(lifecycle, "book", booking)
        monkeypatch.setattr(lifecycle, "up", lambda site, spec, **kw: SimpleNamespace(name=spec.name))

        def first_job(self):
            got["control"] = self.control
            self.job_started(current, spec)  # its next cluster is booked meanwhile (lease.overlap)
            assert booked.wait(DONE)
            meanwhile(site, current, self.control)
            return _job(3, lease_end=True)
        monkeypatch.setattr(managed._Run, "first_job", first_job)
        monkeypatch.setattr(flows.steps, "resume", lambda run, **kw: resumed.append(kw["acquire"]({})) or _job(0))
        t = threading.Thread(target=lambda: got.setdefault("res", flows.run_managed(str(spec.path))), daemon=True)
        t.start()
        t.join(DONE)  # a bound, not a wait: the run ends at once, or has waited for the next lease (the failure)
        return not t.is_alive(), got.get("res"), resumed, site, current, got["control"], got["next"]
    return run


def test_when_the_current_lease_goes_early_the_handover_is_cold_at_once_not_at_the_next_leases_start(warm_run):
    """The next lease starts overlap before the current one's end, 1.5 h ahead here; the current one is deleted
    (Horizon, `appliance lease delete`): the run went into Warm.ready and waited for the next lease's start, status
    running, nothing training."""
    def gone_early(site, current, control):
        site.cloud.delete_lease(current.lease_id)

    ended, res, resumed, site, current, control, nxt = warm_run("pw", gone_early)
    assert ended and res.exit_code == 0
    assert [(cl.name, nt) for cl, nt in resumed] == [("pw", "compute_local")]  # cold: a new lease now
    assert (nxt,) in site.cloud.verbs("delete_lease")  # the booking went
    events = [e["event"] for e in control.state["events"]]
    assert "next lease abandoned" in events and events.index("handover") < events.index("next lease abandoned")


def test_a_cancel_while_the_handover_waits_for_the_next_lease_ends_the_run_at_once(warm_run):
    """The next lease starts in 10 minutes (within overlap + stop_margin: waited for); `appliance cancel` then
    stops the run at once: nothing more is leased, and the booking goes."""
    def near_then_cancel(site, current, control):
        site.cloud.clock = current.lease_end_at - dt.timedelta(minutes=40)
        lease_at = site.cloud.lease_at

        def read(lid):  # the handover looks at the next lease's start: the cancel comes as it waits
            if control.state["status"] == "handover" and control.cancel is None:
                threading.Thread(target=control.cancelled, args=({"by": "elsewhere"},)).start()
            return lease_at(lid)
        site.cloud.lease_at = read

    ended, res, resumed, site, current, control, nxt = warm_run("px", near_then_cancel)
    assert ended and control.state["status"] == "cancelled" and resumed == []
    assert (nxt,) in site.cloud.verbs("delete_lease") and (current.lease_id,) in site.cloud.verbs("delete_lease")


def test_the_warm_cluster_is_waited_for_while_its_lease_starts_within_overlap_and_stop_margin(tmp_path):
    from appliance.flows.handover import Warm
    from test_fake_site import spec_of

    site = FakeSite()
    spec = spec_of(tmp_path, "py", lease="lease: {duration: 2h, overlap: 30m, stop_margin: 5m}\n")
    current = lifecycle.up(site, spec, finish_nodes=no_nodes)
    w = Warm(flows.RunContext(spec, site), current, lambda ev, **kw: None, None, 0.001,
             up=functools.partial(lifecycle.up, finish_nodes=no_nodes))
    w.booked = (current.lease_id, site)  # a lease that starts now (the fake's clock): due
    assert w.far() is None
    start = site.cloud.clock
    site.cloud.clock = start - dt.timedelta(hours=2)  # 2 h ahead: past 35 min
    assert "past lease.overlap 30m + lease.stop_margin 5m" in w.far()
    site.cloud.clock = start - dt.timedelta(minutes=35)
    assert w.far() is None
    lifecycle.down("py", site=site)


def test_a_continued_run_goes_on_on_the_next_cluster_its_killed_controller_booted(tmp_path, monkeypatch):
    """The controller was killed as the handover began: RUN's lease ends soon, RUN_h is up on the next lease. The
    run went on on RUN, took RUN_h down as "made and never used", and was stopped again at RUN's end."""
    from appliance.checkpoint import runs

    site = FakeSite()
    spec = flows.check(str(write_spec(tmp_path, "python x.py", code=tmp_path, name="pz",
                                      extra=f"checkpoint: {{url: 'file://{tmp_path}/ck/'}}\n"
                                            "lease: {duration: 2h, overlap: 30m}\n")))
    up = functools.partial(lifecycle.up, finish_nodes=no_nodes)
    own = up(site, spec)
    runs.job_started(spec, own, "pz-old")  # the killed controller's last job ran on it
    site.cloud.clock += dt.timedelta(minutes=90)  # the next lease starts overlap before the end
    nxt = up(site, dataclasses.replace(spec, name="pz_h"))
    site.cloud.clock += dt.timedelta(minutes=15)  # 15 min of RUN's lease left, 1 h 45 of the next's
    ran = []
    monkeypatch.setattr(flows.steps.RunContext, "of", classmethod(lambda cls, s: cls(s, site)))
    monkeypatch.setattr(managed, "_has_committed_work", lambda ctx: True)
    monkeypatch.setattr(flows.steps, "_resume_point", lambda ctx: None)
    monkeypatch.setattr(flows.steps, "run_job", lambda spec, cluster, **kw: ran.append(cluster.name) or _job(0))
    monkeypatch.setattr(lifecycle, "up", up)
    assert flows.run_managed(str(spec.path)).exit_code == 0
    assert ran == ["pz_h"] and len(site.cloud.verbs("create_lease")) == 2  # no new lease
    assert site.cloud.verbs("delete_lease") == [(own.lease_id,)]  # the one not used goes; the next one is kept
    lifecycle.down(nxt.name, site=site)
