"""Chameleon's terms, fast tier: the local cloud holds its users to them as Chameleon does (a deleted bare-metal
server's node is cleaned before Nova can use it, NotEnoughHostsAvailable is HTTP 500, the portal refuses a lease the
project's SUs cannot pay, an ERROR lease keeps its hosts, a lease nobody launched on is reaped, a restricted
application credential cannot make EC2 credentials), and the client acts on each (fakes.py for the client side).
The same behaviours meet the real OpenStack clients in tests/test_provision.py."""

from __future__ import annotations

import datetime as dt
import re
import threading
import time

import pytest

from appliance.cluster import find_cluster
from appliance.errors import ApplianceError, NoHosts, NoSUs, Unanswered
from appliance.localcloud import _credentials, portal
from appliance.localcloud.cloud import ApiError, Cloud
from appliance.provision import lifecycle
from appliance.sites.openstack_api import explain_blazar, unanswered
from fakes import FakeSite
from test_fake_site import spec_of, up
from test_localcloud_bodies import InstantNodes
from test_localcloud_routes import api, token  # noqa: F401 - the HTTP fixture

# -- the local cloud ------------------------------------------------------------------------------------------------


@pytest.fixture
def sim(tmp_path):
    _credentials(tmp_path)
    c = Cloud(tmp_path, nodes=InstantNodes(tmp_path / "nodes"), pools={"compute_local": 2, "gpu_local": 1})
    yield c
    c.shutdown()


def lease(c: Cloud, n: int = 1, hours: float = 2, node_type: str = "compute_local", name: str = "l") -> dict:
    end = dt.datetime.fromtimestamp(c.clock.now() + hours * 3600, dt.timezone.utc)
    return c.create_lease({"name": name, "start_date": "now", "end_date": f"{end:%Y-%m-%d %H:%M}", "reservations": [
        {"resource_type": "physical:host", "min": n, "max": n, "hypervisor_properties": "",
         "resource_properties": f'["=", "$node_type", "{node_type}"]'}]})


def server(c: Cloud, res_id: str, name: str = "s"):
    image = c.images[0].id
    sid = c.create_servers({"server": {"name": name, "flavorRef": "baremetal", "imageRef": image},
                            "os:scheduler_hints": {"reservation": res_id}})["server"]["id"]
    srv = c.servers[sid]
    deadline = time.monotonic() + 10
    while srv.status == "BUILD" and time.monotonic() < deadline:
        time.sleep(0.01)  # its boot thread (InstantNodes: at once)
    return srv


def test_a_deleted_servers_node_is_cleaned_before_nova_can_place_a_server_on_it(sim):
    """Blazar frees a lease's hosts at once; Ironic cleans the node after the server's delete, and Nova's ironic
    driver reports it unusable meanwhile: a server asked for then goes to ERROR "No valid host"."""
    sim.clean_seconds = 600.0
    first = lease(sim)
    res = first["reservations"][0]["id"]
    srv = server(sim, res)
    assert srv.status == "ACTIVE"
    sim.delete_lease(first["id"])  # the lease's end or delete: its server goes, its host is free in Blazar
    sim.wait_deleted([srv], timeout=10)
    again = lease(sim, name="l2")  # Blazar picks free hosts in DB order: the same one
    assert sim.leases[again["id"]].hosts() == sim.leases[first["id"]].hosts()
    bad = server(sim, again["reservations"][0]["id"], "s2")
    assert bad.status == "ERROR" and bad.fault["message"].startswith("No valid host was found")
    sim.cleaning[srv.host] = time.monotonic()  # its cleaning is over
    assert server(sim, again["reservations"][0]["id"], "s3").status == "ACTIVE"


def test_a_host_whose_server_is_still_being_deleted_is_no_valid_host_either(sim):
    first = lease(sim)
    res = first["reservations"][0]["id"]
    srv = server(sim, res)
    sim.nodes.teardown.clear()  # its teardown takes its time
    with sim.lock:
        sim._delete_server(srv)
    try:
        assert server(sim, res, "s2").status == "ERROR"
    finally:
        sim.nodes.teardown.set()


def test_the_wipe_of_a_removed_nodes_disk_does_not_hold_its_host(sim):
    """What a node leaves on this machine's disk (a stack install: ~50,000 files) is wiped after its server is gone:
    the host is Nova's again after clean_seconds (Ironic's cleaning), not after this machine's rm -r, which under load
    outlasted the client's wait for a cleaned host (NoHosts after 60 s)."""
    first = lease(sim)
    srv = server(sim, first["reservations"][0]["id"])
    wiping = threading.Event()
    sim.nodes.wipe = wiping.wait  # the wipe takes its time
    sim.delete_lease(first["id"])
    try:
        sim.wait_deleted([srv], timeout=10)  # gone (its host free) while its disk is still being wiped
    finally:
        wiping.set()
    assert srv.status == "DELETED"


def test_not_enough_hosts_is_a_500_as_blazar_renders_it_and_the_client_still_reads_no_hosts(sim):
    lease(sim, 2)
    with pytest.raises(ApiError) as e:
        lease(sim, 1, name="more")
    assert e.value.code == 500 and e.value.message == "Not enough hosts available"

    class BlazarClientException(Exception):  # python-blazarclient's, as it carries a 500's message and code
        def __init__(self, message, **kwargs):
            super().__init__(message)
            self.kwargs = kwargs

    got = explain_blazar(BlazarClientException("ERROR: Not enough hosts available", code=500),
                         node_type="compute_local", count=1)
    assert isinstance(got, NoHosts)
    bare = explain_blazar(BlazarClientException("ERROR: Internal Server Error", code=500), node_type="x", count=1)
    assert not isinstance(bare, NoHosts) and "unrestricted" in bare.fix  # a bare 500: the trust, not the hosts


def test_an_error_lease_keeps_its_hosts_until_it_is_deleted(sim):
    sim.faults["lease_error"] = 1
    bad = lease(sim, 2)
    assert bad["status"] == "ERROR"
    with pytest.raises(ApiError, match="Not enough hosts"):
        lease(sim, 1, name="next")
    sim.delete_lease(bad["id"])
    assert lease(sim, 2, name="next")["status"] == "ACTIVE"


def test_the_portal_refuses_a_lease_the_projects_sus_cannot_pay_and_a_deleted_one_stops_its_charge(sim):
    sim.portal.su_budget = 10.0
    first = lease(sim, 2, hours=4)  # 2 hosts x 4 h x su_factor 1: 8 SUs
    with pytest.raises(ApiError) as e:
        lease(sim, 1, hours=3, name="more", node_type="gpu_local")
    assert e.value.code == 400 and e.value.name == "ExternalServiceFilterException"
    m = re.fullmatch(rf"Reservation for project {portal.PROJECT} would spend (\S+) SUs, only (\S+) left", e.value.message)
    assert m and float(m[1]) == pytest.approx(3, abs=0.05) and float(m[2]) == pytest.approx(2, abs=0.05)  # "now" has
    refusal = explain_blazar(Exception(e.value.message))  # seconds, the end date whole minutes
    assert isinstance(refusal, NoSUs) and f"only {m[2]} left" in str(refusal) and "PI" in refusal.fix
    sim.clock.advance(3600)
    sim.delete_lease(first["id"])  # charged for the hour it ran: 2 SUs
    assert sim.portal.left() == pytest.approx(8.0, abs=0.01)
    second = lease(sim, 1, hours=7, name="long")
    sim.clock.advance(6 * 3600 + 120)  # within 48 h of its end: an extension is asked, and charged
    with pytest.raises(ApiError, match=r"Reservation update would spend 2\.00 more SUs, only 1\.\d\d left"):
        sim.update_lease(second["id"], {"end_date": _at(sim.leases[second["id"]].end + 7200)})
    sim.portal.su_budget = None  # a project whose allocation the portal does not limit
    sim.update_lease(second["id"], {"end_date": _at(sim.leases[second["id"]].end + 7200)})


def _at(t: float) -> str:
    return f"{dt.datetime.fromtimestamp(t, dt.timezone.utc):%Y-%m-%d %H:%M}"


def test_a_lease_nobody_launched_a_server_on_is_reaped_after_its_grace(sim):
    idle, used = lease(sim, 1, hours=24, name="idle"), lease(sim, 1, hours=24, name="used")
    server(sim, used["reservations"][0]["id"])
    sim.clock.advance(portal.REAP_AFTER_S - 60)
    sim.tick()
    assert sim.leases[idle["id"]].status == "ACTIVE"
    sim.clock.advance(120)
    sim.tick()
    assert sim.leases[idle["id"]].status == "DELETED" and sim.leases[used["id"]].status == "ACTIVE"


def test_a_restricted_application_credential_cannot_make_ec2_credentials(api):  # noqa: F811
    call, creds = api
    tok = token(call, creds)
    user, project = creds["user_id"], creds["project_id"]
    ac = call("POST", f"/identity/v3/users/{user}/application_credentials",
              {"application_credential": {"name": "job"}}, token=tok)[1]["application_credential"]
    _, _, hdrs = call("POST", "/identity/v3/auth/tokens", {"auth": {"identity": {
        "methods": ["application_credential"], "application_credential": {"id": ac["id"], "secret": ac["secret"]}}}})
    st, body, _ = call("POST", f"/identity/v3/users/{user}/credentials/OS-EC2", {"tenant_id": project},
                       token=hdrs["X-Subject-Token"])
    assert st == 403 and "application_credential" in body["error"]["message"]
    assert call("POST", f"/identity/v3/users/{user}/credentials/OS-EC2", {"tenant_id": project}, token=tok)[0] == 201


def test_the_terms_are_set_and_read_through_the_admin_hook(api):  # noqa: F811
    call, _ = api
    st, body, _ = call("POST", "/_admin/terms", {"clean_seconds": 5, "su_budget": 100})
    assert st == 200 and body["clean_seconds"] == 5.0 and body["su_left"] == 100.0
    assert call("POST", "/_admin/terms", {"su_budget": None})[1]["su_left"] is None


# -- the client ------------------------------------------------------------------------------------------------------


def test_up_asks_again_for_a_server_that_found_no_valid_host_while_its_node_is_cleaned(tmp_path, said):
    site, spec = FakeSite(), spec_of(tmp_path, "cn")
    site.cloud.no_valid_host = 3  # the first servers find their hosts still being cleaned
    cl = up(site, spec)
    c = site.cloud
    assert len(c.verbs("create_server")) == 5 and len(c.verbs("delete_server")) == 3  # each ERROR one deleted
    assert all(c.servers[s].status == "ACTIVE" for s in cl.site.servers.values())
    assert find_cluster("cn").site.servers == cl.site.servers  # the record names the new servers
    assert any("no valid host yet" in m for m in said)
    lifecycle.down("cn", site=site)


def test_past_the_cleaning_time_up_gives_the_hosts_up_and_takes_down_what_it_made(tmp_path):
    site, spec = FakeSite(), spec_of(tmp_path, "cg")
    site.clean_timeout = 0.0
    site.cloud.no_valid_host = 1
    with pytest.raises(NoHosts, match="no valid host"):
        up(site, spec)
    assert not site.cloud.leases and not site.cloud.servers and find_cluster("cg") is None


def test_a_lease_asked_for_without_an_answer_is_found_by_its_name_not_left_behind(tmp_path):
    """A 502/504 or a timeout after Blazar made the lease: the record keeps the lease's name; `down` deletes the lease
    it finds under that name, and `up` again uses it."""
    site, spec = FakeSite(), spec_of(tmp_path, "cu")
    c = site.cloud
    real = c.create_lease

    def made_then_lost(*a, **kw):
        real(*a, **kw)
        raise Unanswered("Blazar did not answer whether it made lease cu (GatewayTimeout: 504)")
    c.create_lease = made_then_lost
    with pytest.raises(Unanswered):
        up(site, spec)
    (info,) = c.leases.values()
    assert find_cluster("cu").site.lease_name == info.name and find_cluster("cu").lease_id is None
    c.create_lease = real
    cl = up(site, spec)  # found by its name, used
    assert cl.lease_id == info.id and len(c.leases) == 1
    lifecycle.down("cu", site=site)
    c.create_lease = made_then_lost
    with pytest.raises(Unanswered):
        up(site, spec)
    assert lifecycle.down("cu", site=site) and not c.leases  # down finds it by its name too


def test_gateway_errors_and_timeouts_are_unanswered_a_refusal_is_not():
    class BlazarClientException(Exception):
        def __init__(self, message, **kwargs):
            super().__init__(message)
            self.kwargs = kwargs

    class ConnectTimeout(Exception):
        pass

    assert unanswered(BlazarClientException("Bad Gateway", code=502))
    assert unanswered(ConnectTimeout("timed out"))
    assert not unanswered(BlazarClientException("Not enough hosts available", code=500))
    assert not unanswered(BlazarClientException("would spend", code=400))


def test_our_lease_in_error_is_deleted_before_a_new_one_is_made(tmp_path, said):
    site, spec = FakeSite(), spec_of(tmp_path, "ce")
    first = up(site, spec)
    site.cloud.leases[first.lease_id].status = "ERROR"
    second = up(site, spec)
    assert second.lease_id != first.lease_id and first.lease_id not in site.cloud.leases
    assert any("is in ERROR: deleting it" in m for m in said)
    lifecycle.down("ce", site=site)


def test_the_syncer_thread_outlives_a_keystone_outage_and_syncs_after_it(tmp_path, said):
    """Keystone frozen for minutes: the token request timed out past the listing's retry and killed the syncer's
    thread; nothing written after the outage was synced until the job's exit."""
    from appliance.node.filesync import Syncer
    from appliance.store.filesync import FileSet

    fs = FileSet(f"file://{tmp_path / 'store'}/", "r", None)
    work = tmp_path / "work"
    work.mkdir()
    (work / "model.h5").write_bytes(b"w")
    s = Syncer(work, fs, every_s=0.0, stop_file=None, exclude=set())
    s.poll_s = 0.001
    real, down = fs.manifests, {"n": 3}
    committed = threading.Event()

    def manifests(*a):
        if down["n"] > 0:
            down["n"] -= 1
            raise TimeoutError("Keystone did not answer (token request)")
        got = real(*a)
        return got

    fs.manifests = manifests
    sync = s.sync
    s.sync = lambda **kw: (body := sync(**kw), body and committed.set())[0]
    t = threading.Thread(target=s.run, daemon=True)
    t.start()
    try:
        assert committed.wait(20), "the syncer's thread died"
    finally:
        s.done.set()
        t.join(10)
    assert real() == [1]


# -- the managed run -------------------------------------------------------------------------------------------------


def test_a_lease_refused_for_the_projects_sus_parks_the_run_with_the_balance_in_one_line(tmp_path, monkeypatch, said):
    from appliance import flows
    from appliance.flows import managed
    from appliance.provision import lifecycle
    from test_managed_run import _lease_end_job

    spec = tmp_path / "ms.yaml"
    spec.write_text(f"name: ms\ncloud: local\ntrain: {{code: {tmp_path}, command: python x.py}}\n"
                    f"checkpoint: {{url: 'file://{tmp_path}/ck/'}}\nnodes: {{count: 2, node_type: compute_local, "
                    "alternatives: [gpu_local]}\n")
    monkeypatch.setattr(managed._Run, "first_job", lambda self: _lease_end_job())
    asked = []

    def up(site, spec, **kw):
        asked.append(spec.nodes.node_type)
        raise NoSUs(f"not enough SUs for this lease (Blazar: Reservation for project {portal.PROJECT} would spend "
                    "48.00 SUs, only 12.00 left)", "ask your project's PI for SUs")
    monkeypatch.setattr(lifecycle, "up", up)
    monkeypatch.setattr(flows.steps, "resume", lambda run, **kw: kw["acquire"]({}))
    with pytest.raises(NoSUs, match="only 12.00 left"):  # its line, and a non-zero exit of `appliance run -f`
        flows.run_managed(str(spec))
    assert asked == ["compute_local"]  # not the alternative: the SUs are the project's, whatever the node type
    tl = managed.read_timeline(managed._control_of("ms", None, "local", None))
    assert tl["status"] == "parked" and "only 12.00 left" in next(e for e in tl["events"]
                                                                   if e["event"] == "no SUs")["reason"]
    (line,) = [m for m in said if "is parked, holding no lease" in m]
    assert "only 12.00 left" in line and "fix: ask your project's PI" in line and "\n" not in line


def test_a_free_slot_taken_before_it_is_booked_is_looked_for_again(tmp_path):
    from types import SimpleNamespace

    from appliance import flows
    from appliance.flows.handover import wait_for_slot
    from appliance.spec import Alternative

    site = FakeSite()
    spec = spec_of(tmp_path, "mt", lease="lease: {duration: 2h, wait: 6h}\n")
    c = site.cloud
    c.next_slot = lambda nt, count, length, after: c.clock  # free now, by the allocations read
    c.faults["create_lease"] = NoHosts("not enough hosts available for 2 x compute_local")  # taken meanwhile
    events = []
    control = SimpleNamespace(cancel=None, changed=threading.Event(), poll=0.001,
                              record=lambda ev, **kw: events.append((ev, kw)))
    choice = Alternative("compute_local")
    assert wait_for_slot(flows.RunContext(spec, site), control, [choice]) is choice
    assert [e for e, _ in events][:1] == ["slot taken"] and len(c.verbs("create_lease")) == 2
    lifecycle.down("mt", site=site)


def test_the_next_cluster_of_a_run_is_never_another_runs_cluster():
    """RUN-h was a valid run name: a run named train-h had its cluster taken down by run train's controller as a
    next cluster left by a killed one (issue 60 item 7)."""
    from appliance.flows.handover import other_name
    from appliance.spec import NAME_RE

    for run in ("train", "t", "a" * 39):
        nxt = other_name(run, run)
        assert not NAME_RE.fullmatch(nxt) and other_name(run, nxt) == run and other_name(run, None) == nxt


# -- the controller's own robustness (issue 60 item 11) ----------------------------------------------------------------


def _controller(tmp_path, monkeypatch, name="mk"):
    from appliance import flows
    from appliance.flows import managed
    from conftest import write_spec

    monkeypatch.setenv("APPLIANCE_CONTROLLER_LOCK_INTERVAL", "0.02")
    spec = flows.check(str(write_spec(tmp_path, "python x.py", code=tmp_path, name=name,
                                      extra=f"checkpoint: {{url: 'file://{tmp_path}/ck/'}}\n")))
    return spec, managed.Control(spec, None, poll=0.005)


def test_a_cancel_request_that_is_not_an_object_does_not_stop_the_controllers_heartbeat(tmp_path, monkeypatch):
    spec, c = _controller(tmp_path, monkeypatch)
    c.take()
    try:
        c.cs.put_text("cancel.json", "[1, 2]", str(tmp_path))
        beat = c.lock.read()["heartbeat"]
        deadline = time.monotonic() + 10
        while c.lock.read()["heartbeat"] == beat and time.monotonic() < deadline:
            time.sleep(0.01)  # the heartbeat is the thread's own work: looked at, not waited for by a sleep alone
        assert c.lock.read()["heartbeat"] != beat and c.cancel is None
    finally:
        c.close("cancelled")


def test_a_controller_whose_lock_renewals_fail_says_so_and_when_they_work_again(tmp_path, monkeypatch, said):
    """A controller's lock renewals that failed were silent: a controller whose store token had expired went on,
    its lock going stale under it, with not a word until the run's end."""
    import tempfile

    spec, c = _controller(tmp_path, monkeypatch, "mh")
    assert c.lock.acquire(tempfile.gettempdir())[0] is None  # held, without take()'s beating thread
    renew = c.lock.heartbeat

    def refused(tmp_dir):
        raise OSError("the store did not answer")
    monkeypatch.setattr(c.lock, "heartbeat", refused)
    assert c._heartbeat() and c._heartbeat() and c._heartbeat()  # not lost: tried again at the next beat
    warned = [m for m in said if "could not renew its lock" in m]
    assert len(warned) == 1 and "the store did not answer" in warned[0] and "goes stale in" in warned[0]
    monkeypatch.setattr(c.lock, "heartbeat", renew)
    assert c._heartbeat() and any("renews its lock again" in m for m in said)
    said.clear()
    assert c._heartbeat() and not said
    c.lock.release()


def test_a_controller_that_lost_its_lock_writes_no_more_of_the_runs_state(tmp_path, monkeypatch):
    spec, c = _controller(tmp_path, monkeypatch, "ml")
    c.record("controller", state="running")
    before = c.cs.read_json("state.json")
    c.lost = True
    c.record("job", state="running", job_id="late")
    assert c.cs.read_json("state.json") == before


def test_the_runs_end_steps_all_run_when_one_fails(tmp_path, monkeypatch, said):
    """A 503 while the unused next cluster was taken down skipped closing the state, releasing the lock and deleting
    the controller's credential (valid for 60 days)."""
    from appliance import flows
    from appliance.flows import credential, managed

    spec, _ = _controller(tmp_path, monkeypatch, "mf")
    dropped = []
    monkeypatch.setattr(credential, "drop", lambda ctx, made=None: dropped.append(ctx.spec.name))

    class Warm:
        def abandon(self):
            raise ApplianceError("Nova: 503 Service Unavailable")

    def loop(self):
        self.warm = Warm()
        return None
    monkeypatch.setattr(managed._Run, "loop", loop)
    flows.run_managed(spec.path)
    assert dropped == ["mf"]
    tl = managed.read_timeline(managed._control_of("mf", None, "local", None))
    assert tl["status"] == "finished" and not tl["controller_alive"]
    assert any("a step of the run's end failed" in m and "503" in m for m in said)


def test_a_controller_of_another_machine_with_the_same_hostname_is_not_taken_for_gone():
    import socket

    from appliance.checkpoint import runs

    me = runs.machine_tag()
    assert runs.process_gone(f"{socket.gethostname()}:999999999:1.ab:{me}")  # no such pid here: gone
    assert not runs.process_gone(f"{socket.gethostname()}:999999999:1.ab:{'0' * 10}")  # a container of that name


def test_the_warm_handover_books_an_alternative_when_the_first_choice_is_busy_through_the_overlap(tmp_path):
    """The run's own hosts are busy until the end the next lease overlaps, and the rest of its node type is booked:
    every handover went cold, a full bare-metal boot, with nodes.alternatives free (issue 60 item 10)."""
    import functools

    from appliance import flows
    from appliance.flows.handover import Warm
    from fakes import no_nodes

    site = FakeSite()
    spec = spec_of(tmp_path, "mw", lease="lease: {duration: 2h, overlap: 30m, book_ahead: 2h}\nnodes: {count: 2, "
                                        "node_type: compute_local, alternatives: [gpu_local]}\n")
    mk = functools.partial(lifecycle.up, finish_nodes=no_nodes)
    current = mk(site, spec)
    c = site.cloud
    c.faults["create_lease"] = NoHosts("not enough hosts available for 2 x compute_local")
    said = []
    w = Warm(flows.RunContext(spec, site), current, lambda ev, **kw: said.append((ev, kw)), None, 0.001, up=mk).start()
    deadline = time.monotonic() + 10
    while len(c.leases) < 2 and time.monotonic() < deadline:
        time.sleep(0.001)  # the thread books it, then waits for its start
    (nxt,) = [x for x in c.leases.values() if x.id != current.lease_id]
    c.clock = nxt.start
    cl = w.ready()
    assert cl is not None and w.choice.node_type == "gpu_local"
    assert [a[1] for a in c.verbs("create_lease")][-2:] == ["compute_local", "gpu_local"]
    assert [ev for ev, _ in said] == ["next lease refused", "next lease", "next cluster ready"]
    assert dict(said)["next lease"]["node_type"] == "gpu_local"
    w.abandon()
    lifecycle.down("mw", site=site)


# -- the run's leases asked for, in the store (issue 60 item 3) --------------------------------------------------------


def test_each_lease_is_in_the_runs_state_in_the_store_before_blazar_is_asked_then_with_its_answer(tmp_path,
                                                                                                   monkeypatch):
    from appliance.flows.leases import Asked

    site, spec = FakeSite(), spec_of(tmp_path, "la")
    _, c = _controller(tmp_path, monkeypatch, "la")
    seen_at_create, tracked = [], []
    real = site.cloud.create_lease

    def create_lease(name, *a, **kw):  # what the store holds when Blazar is asked
        seen_at_create.append(c.cs.read_json("state.json")["asked"][name])
        return real(name, *a, **kw)
    site.cloud.create_lease = create_lease
    cl = up(site, spec, on_ask=Asked(c, lambda info, n, nt, s: tracked.append((info.id, n, nt))))
    (before,) = seen_at_create
    assert before["cluster"] == "la" and before["nodes"] == 2 and "lease_id" not in before
    (entry,) = c.cs.read_json("state.json")["asked"].values()
    assert entry["lease_id"] == cl.lease_id and tracked == [(cl.lease_id, 2, "compute_local")]
    lifecycle.down("la", site=site)


def test_a_lease_whose_record_cannot_be_written_is_not_asked_for(tmp_path, monkeypatch):
    from appliance.flows.leases import Asked
    from appliance.store.checkpoints import StoreUnavailable

    from appliance.flows import control

    site, spec = FakeSite(), spec_of(tmp_path, "lb")
    _, c = _controller(tmp_path, monkeypatch, "lb")
    monkeypatch.setattr(control, "ASK_WAIT", 0.5)  # how long a lease's record waits for the store (600 s)

    def down(*a, **kw):
        raise StoreUnavailable("the store did not answer")
    monkeypatch.setattr(c.cs, "put_text", down)
    with pytest.raises(StoreUnavailable):
        up(site, spec, on_ask=Asked(c))
    assert not site.cloud.verbs("create_lease") and not site.cloud.leases


def test_a_controller_on_another_machine_deletes_the_leases_an_earlier_one_asked_for_and_keeps_its_own(
        tmp_path, monkeypatch):
    """The earlier controller's machine is gone with its cluster records: the lease it booked ahead (or asked for
    and never heard back about) would run idle, paid for, to its end."""
    from appliance import flows
    from appliance.flows.leases import Asked, reconcile

    site, spec = FakeSite(), spec_of(tmp_path, "lc")
    _, first = _controller(tmp_path, monkeypatch, "lc")
    ahead = lifecycle.book(site, spec, site.cloud.clock + dt.timedelta(hours=1), on_ask=Asked(first))
    other = site.cloud.create_lease("someone-elses", "compute_local", 1, dt.timedelta(hours=1))  # not the run's
    lifecycle.delete_cluster("lc")  # ... the machine that had its record is gone
    _, second = _controller(tmp_path, monkeypatch, "lc")
    second.state["asked"] = first.cs.read_json("state.json")["asked"]  # what take() reads from the store
    assert reconcile(flows.RunContext(spec, site), second) == [ahead.lease_id]
    assert set(site.cloud.leases) == {other.id}
    assert all(e["closed"] for e in second.state["asked"].values())
    # a lease a cluster record of this machine uses is kept (the run goes on on it)
    kept = lifecycle.book(site, spec, None, on_ask=Asked(second))
    assert reconcile(flows.RunContext(spec, site), second) == [] and kept.lease_id in site.cloud.leases
    rec = find_cluster("lc")  # asked for here, its answer never recorded: its `up` finds it by its name and uses it
    rec.lease_id = None
    rec.save()
    assert reconcile(flows.RunContext(spec, site), second) == [] and kept.lease_id in site.cloud.leases
    lifecycle.down("lc", site=site)


def test_the_controller_renews_its_store_credentials_when_the_store_refuses_them(tmp_path, monkeypatch):
    """The controller's store token (a bare Keystone token) lives a day; its state writes were lost after that, and
    a lease's record (which must be written before Blazar is asked) stopped the run: `make deploy` found it."""
    from appliance.flows import managed
    from appliance.store.base import StoreRefused
    from appliance.store.checkpoints import CheckpointStore

    spec, _ = _controller(tmp_path, monkeypatch, "mn")
    renewed = []
    c = managed.Control(spec, None, poll=0.005, renew=lambda: renewed.append(1))
    real = CheckpointStore.put_text

    def expired(self, *a, **kw):
        if not renewed:
            raise StoreRefused("Swift refused access to container 'checkpoints' (401): the token may have expired")
        return real(self, *a, **kw)
    monkeypatch.setattr(CheckpointStore, "put_text", expired)
    c.asked("mn-1", {"cluster": "mn"})
    assert renewed == [1] and c.cs.read_json("state.json")["asked"]["mn-1"]["cluster"] == "mn"
    assert c.lock.cs is c.cs


def test_the_runs_status_changes_only_by_its_named_transitions(tmp_path, monkeypatch, said):
    """One method per transition (Control.running, handing_over, parked, close; runs.NEXT): a change no controller
    makes is said and leaves the status as it was; an ended run's status changes no more."""
    from appliance.checkpoint.runs import RunStatus

    spec, c = _controller(tmp_path, monkeypatch, "mt")
    c.running("job", job_id="j1")
    c.handing_over(after="j1", warm=False)
    c.running("job", job_id="j2")
    assert c.state["status"] == RunStatus.RUNNING
    c.parked(reason="no slot within lease.wait 1h")
    c.handing_over(after="j2", warm=False)  # a parked run holds no lease: nothing of it ends with one
    assert c.state["status"] == RunStatus.PARKED
    assert any("handover: run mt cannot go from parked to handover; its status stays parked" in m for m in said)
    assert [e["event"] for e in c.state["events"]][-2:] == ["parked", "handover"]  # on the timeline all the same
    c._to(RunStatus.FINISHED, "end", {"status": RunStatus.FINISHED})
    c.running("job", job_id="late")
    assert c.state["status"] == RunStatus.FINISHED
    assert c.cs.read_json("state.json")["status"] == "finished"
