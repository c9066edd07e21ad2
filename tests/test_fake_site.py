"""The fast tier's view of provisioning and the lease watchdog: an in-process site (tests/fakes.py) with a settable
clock, fault switches and recorded calls. The same behaviours run end to end in test_provision.py and
test_checkpoint.py against the local cloud."""

import datetime as dt
import threading
import time

import pytest

from appliance.checkpoint.watchdog import CloudClock, LeaseWatch
from appliance.cluster import Cluster, find_cluster
from appliance.errors import ApplianceError
from appliance.provision import lifecycle
from appliance.sites import load_spec
from conftest import write_spec
from fakes import FakeCloud, FakeSite, fault, no_nodes


def spec_of(tmp_path, name="fk", nodes=2, lease="lease: {duration: 2h}\n"):
    return load_spec(write_spec(tmp_path, "python x.py", code=tmp_path, name=name, nodes=nodes, extra=lease))


def up(site, spec, **kw):
    return lifecycle.up(site, spec, finish_nodes=no_nodes, **kw)


def test_up_records_everything_and_a_rerun_makes_nothing_new(tmp_path):
    site, spec = FakeSite(), spec_of(tmp_path)
    cl = up(site, spec)
    c = site.cloud
    assert len(c.verbs("create_lease")) == 1 and len(c.verbs("create_server")) == 2
    assert set(cl.site.servers) == {"fk-0", "fk-1"} and cl.site.fip_id in c.fips
    assert cl.nodes[1].via_head and not cl.nodes[0].via_head and cl.head.address == cl.floating_ip
    saved = find_cluster("fk")
    assert saved.site.servers == cl.site.servers and saved.lease_id == cl.lease_id  # typed record round-trips
    up(site, spec)
    assert len(c.verbs("create_lease")) == 1 and len(c.verbs("create_server")) == 2  # idempotent
    assert len(c.verbs("attach_floating_ip")) == 1
    lifecycle.down("fk", site=site)


def test_a_server_in_error_fails_up_and_a_rerun_replaces_only_it(tmp_path):
    site, spec = FakeSite(), spec_of(tmp_path, "fe")
    site.cloud.faults["create_server"] = "ERROR"  # the first server boots into ERROR
    with pytest.raises(ApplianceError, match="is in ERROR"):
        up(site, spec)
    bad = find_cluster("fe").site.servers["fe-0"]
    cl = up(site, spec)
    assert site.cloud.verbs("delete_server") == [(bad,)]
    assert cl.site.servers["fe-0"] != bad and len(site.cloud.verbs("create_server")) == 3
    lifecycle.down("fe", site=site)


def test_a_server_nova_is_deleting_is_said_as_such_and_a_rerun_of_up_replaces_it(tmp_path, said):
    """Nova lists a deleted server, ACTIVE with task_state "deleting", until its machine is torn down (minutes on
    bare metal). `status` said ACTIVE for it, and a re-run of `up` kept it as a node."""
    site, spec = FakeSite(), spec_of(tmp_path, "fdel")
    cl = up(site, spec)
    going = cl.site.servers["fdel-1"]
    site.cloud.servers[going].task_state = "deleting"  # someone deleted it; its teardown goes on
    assert [n["state"] for n in lifecycle.status("fdel", site=site)["nodes"]] == ["ACTIVE", "DELETING"]
    said.clear()
    cl2 = up(site, spec)
    assert cl2.site.servers["fdel-1"] != going and len(site.cloud.verbs("create_server")) == 3
    assert any("fdel-1: its server is being deleted" in m for m in said)
    assert site.cloud.verbs("delete_server") == []  # not deleted again: Nova ignores that, it is going already
    lifecycle.down("fdel", site=site)


def test_an_ended_lease_gets_a_new_lease_and_servers(tmp_path, said):
    site, spec = FakeSite(), spec_of(tmp_path, "fl")
    first = up(site, spec)
    site.cloud.leases[first.lease_id].status = "TERMINATED"
    said.clear()
    second = lifecycle.up(site, spec, finish_nodes=no_nodes)
    assert second.lease_id != first.lease_id and any("Making a new lease" in m for m in said)
    assert len(site.cloud.verbs("create_server")) == 4
    lifecycle.down("fl", site=site)


def test_down_removes_everything_once_and_is_idempotent(tmp_path):
    site, spec = FakeSite(), spec_of(tmp_path, "fd")
    cl = up(site, spec)
    done = lifecycle.down("fd", site=site)
    assert len(done) == 4 and not site.cloud.servers and not site.cloud.fips and cl.lease_id not in site.cloud.leases
    assert find_cluster("fd") is None
    assert lifecycle.down("fd", site=site) == []


def test_a_lease_error_leaves_nothing_behind(tmp_path):
    site, spec = FakeSite(), spec_of(tmp_path, "fx")
    site.cloud.faults["create_lease"] = fault("not enough hosts available")
    with pytest.raises(ApplianceError, match="not enough hosts"):
        up(site, spec)
    assert not site.cloud.servers and find_cluster("fx") is None


# -- the lease watchdog's decisions ------------------------------------------------------------------


def watch(tmp_path, site, *, ends_in_s: float, lease: str, **kw):
    spec = spec_of(tmp_path, "fw", lease=lease)
    cloud = site.cloud
    info = cloud.create_lease("w", "compute_local", 1, dt.timedelta(seconds=ends_in_s))
    cl = Cluster(name="", cloud="local", nodes=[], lease_id=info.id)
    asked, said = [], []
    stopped = threading.Event()

    def request_stop(req):
        asked.append(req)
        stopped.set()

    w = LeaseWatch(spec, cl, request_stop, said.append, site=site, poll=0.01, **kw)
    return w, cloud, info, asked, said, stopped


def test_the_watchdog_stops_the_job_at_the_margin_not_before(tmp_path):
    site = FakeSite()
    w, cloud, info, asked, said, stopped = watch(tmp_path, site, ends_in_s=600,
                                                 lease="lease: {duration: 2h, stop_margin: 60s}\n")
    w.start()
    try:
        assert not stopped.wait(0.2)  # 600 s left, margin 60 s: keep training
        cloud.clock += dt.timedelta(seconds=545)  # 55 s left
        assert stopped.wait(10)
    finally:
        w.close()
    assert info.id in asked[0]["reason"] and not cloud.verbs("extend_lease")


def test_the_watchdog_extends_when_the_spec_says_so_and_stops_when_it_cannot(tmp_path):
    site = FakeSite()
    w, cloud, info, asked, said, stopped = watch(tmp_path, site, ends_in_s=30,
                                                 lease="lease: {duration: 1h, stop_margin: 60s, extend: true}\n")
    end0 = info.end
    w.start()
    try:
        assert cloud.called["extend_lease"].wait(10)
        assert info.end == end0 + dt.timedelta(hours=1) and not stopped.is_set()
        cloud.faults["extend_lease"] = fault("Blazar: extension refused")
        cloud.clock = info.end - dt.timedelta(seconds=30)
        assert stopped.wait(10)
    finally:
        w.close()
    assert any("not extending the lease (Blazar: extension refused)" in m for m in said), said


def test_an_extension_made_elsewhere_renews_the_jobs_credential(tmp_path):
    """A managed run's controller (or Horizon, or `appliance lease extend`) extends the lease: the watchdog sees the
    later end and renews the job's store credential for it, as for its own extension (else 401 on its commits)."""
    site, renewed = FakeSite(), []
    got = threading.Event()
    w, cloud, info, asked, said, stopped = watch(tmp_path, site, ends_in_s=600, lease="lease: {duration: 2h}\n",
                                                 on_extended=lambda end: (renewed.append(end), got.set()))
    w.start()
    try:
        for _ in range(10_000):  # its first read of the lease
            if w.end_seen is not None:
                break
            time.sleep(0.001)
        info.end += dt.timedelta(hours=2)
        assert got.wait(10)
    finally:
        w.close()
    assert renewed == [info.end] and any("was extended to" in m for m in said) and not stopped.is_set()


def test_a_managed_runs_rule_caps_the_watchdogs_extension_or_refuses_it(tmp_path):
    site = FakeSite()
    rule = {"most": (dt.timedelta(minutes=40), "")}
    w, cloud, info, asked, said, stopped = watch(tmp_path, site, ends_in_s=30,
                                                 lease="lease: {duration: 1h, stop_margin: 60s, extend: true}\n",
                                                 extend_by=lambda lid, end: rule["most"])
    end0 = info.end
    w.start()
    try:
        assert cloud.called["extend_lease"].wait(10)
        assert info.end == end0 + dt.timedelta(minutes=40)  # cut to what the run's limits allow
        rule["most"] = (None, "limits.node_hours 10 (10.0 spent or booked, 0.0 left)")
        cloud.clock = info.end - dt.timedelta(seconds=30)
        assert stopped.wait(10)
    finally:
        w.close()
    assert len(cloud.verbs("extend_lease")) == 1 and any("not extending the lease (limits.node_hours" in m for m in said)


class FakeTime:
    """The watchdog's sleeps, on the fake cloud's clock: each wait moves the clock by that long and is recorded."""

    def __init__(self, cloud, stopped):
        self.cloud, self.stopped, self.waits = cloud, stopped, []

    def is_set(self):
        return self.stopped.is_set() or len(self.waits) > 1000

    def wait(self, t):
        self.waits.append(t)
        self.cloud.clock += dt.timedelta(seconds=t)
        return self.is_set()

    set = is_set


def test_the_watchdog_asks_at_the_margin_itself_not_a_poll_or_a_halving_step_later(tmp_path):
    """The end is known: the watchdog's last sleep ends at the margin, so the stop comes at it, however long its poll
    (Chameleon's is 60 s). It used to halve the time left down to 0.2-s steps: up to 0.2 s late, and several reads."""
    site = FakeSite()
    w, cloud, info, asked, said, stopped = watch(tmp_path, site, ends_in_s=120 + 61.3,  # margin: 2 polls
                                                 lease="lease: {duration: 2h, stop_margin: 60s}\n")
    w.poll = 60.0
    w.done = FakeTime(cloud, stopped)
    w.clock = CloudClock(1.0, monotonic=lambda: sum(w.done.waits))
    start = cloud.clock
    w._run()
    assert asked, said
    # the cloud's Date has whole seconds; the watchdog's clock places the margin to within a fraction of one, and
    # never after it (it was 0.16 s late here; up to 1 s with the Date alone)
    assert 61.3 - 0.2 <= (cloud.clock - start).total_seconds() <= 61.3 + 1e-6
    assert len(cloud.verbs("get_lease")) <= 5


def test_the_cloud_clock_narrows_whole_second_dates_and_starts_over_when_the_cloud_jumps():
    t = [0.0]
    c = CloudClock(1.0, monotonic=lambda: t[0])
    base = dt.datetime(2026, 11, 24, 12, 0, 0)
    true = lambda: base + dt.timedelta(seconds=0.37 + t[0])  # noqa: E731 - the cloud's clock, 0.37 s into a second
    for step in (0.0, 0.3, 0.5, 0.7, 0.9):  # reads at different fractions of a second, 1 ms each
        t[0] += step
        c.read(true().replace(microsecond=0), t[0] - 0.001, t[0])
    assert (true() - true().replace(microsecond=0)).total_seconds() > 0.7  # the last Date alone: 0.77 s behind
    assert abs((c.now() - true()).total_seconds()) < 0.16  # the bounds left: A in [0.2, 0.5]
    base += dt.timedelta(days=1)  # the cloud's clock jumps (the local cloud's /advance; an NTP step)
    t[0] += 0.5
    c.read(true().replace(microsecond=0), t[0] - 0.001, t[0])
    assert abs((c.now() - true()).total_seconds()) <= 0.5


def test_the_cloud_clock_forgets_old_reads_so_drift_does_not_pile_up():
    """Our clock 100 ppm off the cloud's, read every 60 s as on Chameleon, for 33 hours: only the last reads count,
    so the estimate stays within half the Date's second. Bounds kept from every read went stale with the drift and
    the error grew to the whole second (0.998 s) before the bounds stopped meeting and started over."""
    t = [0.0]
    c = CloudClock(1.0, monotonic=lambda: t[0])
    base = dt.datetime(2026, 11, 24, 12, 0, 0)
    true = lambda: base + dt.timedelta(seconds=0.37 + 1.0001 * t[0])  # noqa: E731
    worst = 0.0
    for _ in range(2000):
        t[0] += 60.0
        c.read(true().replace(microsecond=0), t[0] - 0.001, t[0])
        worst = max(worst, abs((c.now() - true()).total_seconds()))
    assert worst < 0.6


def test_the_watchdog_reads_the_clock_in_real_seconds(tmp_path):
    """The local cloud's clock can run 60x: 600 cloud seconds left is 10 real seconds, inside a 60 s margin."""
    w, *_ = watch(tmp_path, FakeSite(scale=60.0), ends_in_s=600, lease="lease: {duration: 2h, stop_margin: 60s}\n")
    left, _end = w.left()
    assert left == pytest.approx(10.0, abs=1 / 60)  # the Date's whole second is 1/60 s of real time


def test_a_host_key_mismatch_fails_at_once(tmp_path, monkeypatch):
    """It used to be retried until the SSH timeout (900 s on Chameleon) like a node still booting."""
    from appliance import remote

    tries = []

    class Mismatch:
        def __init__(self, cluster, timeout=15.0):
            tries.append(1)
            raise remote.HostKeyMismatch("node presented a host key that does not match the pinned one")

    site = FakeSite()
    site.ssh_timeout = 2.0
    monkeypatch.setattr(lifecycle, "Session", Mismatch)
    with pytest.raises(ApplianceError, match="does not match the pinned one"):
        lifecycle._wait_ssh(site, Cluster(name="", cloud="local", nodes=[]))
    assert len(tries) == 1


def test_the_watchdog_extends_before_the_node_side_watchdog_would_stop(tmp_path):
    """Issue 12 item 3: the node watchdog stops jobs NODE_WATCH_MARGIN (10 min) before the vendordata end; the
    launcher used to extend only at its own margin (here 60 s), after the node had already stopped the job."""
    from appliance.protocol import NODE_WATCH_MARGIN

    site = FakeSite()
    w, cloud, info, asked, said, stopped = watch(tmp_path, site, ends_in_s=NODE_WATCH_MARGIN + 30,
                                                 lease="lease: {duration: 1h, stop_margin: 60s, extend: true}\n")
    end0 = info.end
    w.start()
    try:
        assert cloud.called["extend_lease"].wait(10)  # 10.5 min left: extended now, not at 60 s
        assert info.end == end0 + dt.timedelta(hours=1) and not stopped.is_set()
    finally:
        w.close()


def test_a_refused_extension_lets_the_job_run_until_the_margin(tmp_path):
    site = FakeSite()
    w, cloud, info, asked, said, stopped = watch(tmp_path, site, ends_in_s=600,
                                                 lease="lease: {duration: 1h, stop_margin: 60s, extend: true}\n")
    cloud.faults["extend_lease"] = fault("Blazar: extension refused")
    w.start()
    try:
        assert cloud.tried["extend_lease"].wait(10)
        assert not stopped.wait(0.3)  # refused at 600 s left: the job goes on
        cloud.clock += dt.timedelta(seconds=545)
        assert stopped.wait(10)
    finally:
        w.close()
    assert len(cloud.verbs("extend_lease")) == 1  # asked once for that end, not at every poll


def test_servers_are_asked_for_and_deleted_in_parallel_and_node_0_stays_the_head(tmp_path, monkeypatch):
    """make bench-scale: up and down made one Nova request per server, one after the other (0.3-1 s each on a real
    Nova: a minute for 64 servers). Four creates (and deletes) must be in flight at once to pass the barrier; the
    nodes keep their order whichever answered first."""
    site, spec = FakeSite(), spec_of(tmp_path, nodes=4)
    c = site.cloud
    barrier = threading.Barrier(4, timeout=10)
    create, delete = c.create_server, c.delete_server

    def slow_create(name, **kw):
        barrier.wait()
        return create(name, **kw)

    def slow_delete(sid):
        barrier.wait()
        return delete(sid)

    monkeypatch.setattr(c, "create_server", slow_create)
    cl = up(site, spec)
    assert [n.name for n in cl.nodes] == ["fk-0", "fk-1", "fk-2", "fk-3"] and cl.head.name == "fk-0"
    assert list(find_cluster("fk").site.servers) == ["fk-0", "fk-1", "fk-2", "fk-3"]
    monkeypatch.setattr(c, "delete_server", slow_delete)
    removed = lifecycle.down("fk", site=site)
    assert sum(x.startswith("server ") for x in removed) == 4 and not c.servers


def test_a_swift_job_on_keystone_gets_its_own_application_credential(monkeypatch):
    """Issue 12 item 2: with OS_CLOUD only, a swift:// job's nodes got one Keystone token, which Chameleon's
    Keystone refuses after a day: every later checkpoint failed to commit. Now the nodes get an application
    credential of the job's own (renewable tokens), expiring a week after the lease end, withdrawn at the job's
    end. Store credentials that renew themselves (Swift v1, S3 keys) go as they are; a Keystone that will not make
    one leaves the token, said once with the fix."""
    for var in ("ST_AUTH", "ST_USER", "ST_KEY", "AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY"):
        monkeypatch.delenv(var, raising=False)
    cloud = FakeCloud()
    site = FakeSite(cloud)
    end = dt.datetime(2026, 11, 30, 12, 0)
    node, withdraw = site.job_store_creds("swift://ckpts/", name="appliance-r-j1", lease_end=end)
    assert node.app_cred and node.app_cred_secret == "s3cret" and node.region == "CHI@fake"
    assert not node.token and not node.storage_url and node.redacted()["app_cred_secret"] == "***"
    [(name, expires)] = cloud.verbs("create_app_cred")
    assert name.startswith("appliance-r-j1-") and expires == end + dt.timedelta(days=7)
    assert node.scoped("swift://ckpts/").app_cred  # what goes to the head node keeps it
    withdraw()
    assert cloud.verbs("delete_app_cred") == [(node.app_cred_id,)] and not cloud.app_creds

    said = []
    cloud.faults["create_app_cred"] = fault("Keystone refused an application credential (403: restricted)")
    node, withdraw = site.job_store_creds("swift://ckpts/", name="x", lease_end=None, say=said.append)
    assert node.token == "t" and withdraw is None
    assert len(said) == 1 and "403" in said[0] and "after a day" in said[0]

    n = len(cloud.verbs("create_app_cred"))
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", "mine")  # S3 keys the user set go as they are
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "theirs")
    assert site.job_store_creds("s3://ckpts/", name="x", lease_end=None)[1] is None
    monkeypatch.setenv("ST_AUTH", "http://store.invalid/auth/v1.0")
    monkeypatch.setenv("ST_USER", "u")
    monkeypatch.setenv("ST_KEY", "k")
    node, withdraw = site.job_store_creds("swift://ckpts/", name="x", lease_end=None)
    assert (node.user, node.key, withdraw) == ("u", "k", None)
    assert len(cloud.verbs("create_app_cred")) == n


def test_a_file_url_needs_no_credentials_and_asks_the_cloud_nothing():
    """The file:// rule, written once (Site.store_creds, Site.job_store_creds): it was written four times, in
    flows, checkpoint/resume.py, checkpoint/job.py and stage_to_nodes."""
    cloud = FakeCloud()
    site = FakeSite(cloud)
    assert site.store_creds("file:///tmp/x/") is None
    assert site.job_store_creds("file:///tmp/x/", name="x", lease_end=None) == (None, None)
    assert not cloud.calls


def test_a_swift_store_with_an_application_credential_renews_its_token_on_a_401(monkeypatch):
    """The node side of it: SwiftStore talks to Swift through swiftclient with a keystoneauth session on the
    application credential; the store's 401 invalidates the session's token and the request goes again with a
    new one (swiftclient/client.py Connection._retry)."""
    import swiftclient

    from appliance.store.objects import StoreCreds, SwiftStore

    tokens = iter(["tok-1", "tok-2"])
    got = []

    class Auth:  # the keystoneauth plugin's surface the session uses
        def __init__(self, **kw):
            self.kw, self.tok = kw, None

        def get_token(self, session, **kw):
            self.tok = self.tok or next(tokens)
            return self.tok

        def invalidate(self):
            self.tok = None
            return True

        def get_endpoint(self, session, **kw):
            return "http://store.invalid/swift/v1/AUTH_p"

        def get_headers(self, session, **kw):
            return {"X-Auth-Token": self.get_token(session)}

    monkeypatch.setattr("keystoneauth1.identity.v3.ApplicationCredential", Auth)

    def head_container(url, token, container, **kw):
        got.append(token)
        if token == "tok-1":
            raise swiftclient.ClientException("expired", http_status=401)
        return {"x-container-object-count": "0"}

    monkeypatch.setattr(swiftclient.client, "head_container", head_container)
    st = SwiftStore("ckpts", StoreCreds(keystone_url="http://keystone.invalid/v3", app_cred_id="i",
                                        app_cred_secret="s", region="CHI@fake"))
    assert st._call(st.conn().head_container, "ckpts")["x-container-object-count"] == "0"
    assert got == ["tok-1", "tok-2"] and st._renewable()


def test_an_s3_url_on_keystone_gets_the_users_ec2_keys_and_the_rgw_root_as_endpoint(monkeypatch):
    """Chameleon's S3 keys are EC2 credentials, and its S3 endpoint is the RGW's root. With OS_CLOUD only, an
    s3:// URL had no keys ("no S3 credentials or endpoint") though Chameleon's own setup-cc-mount-object-store makes
    both from the same login (CC-Images elements/cc-rclone). Now the site asks Keystone for the user's EC2 credential
    and strips ``/swift...`` from the object-store URL, only for s3:// URLs; AWS_* variables still win. A job's
    nodes get an EC2 credential bound to an application credential of the job's own, both withdrawn at its end
    (issue 49: they got the user's, which never expires); the user's only when Keystone refuses, said."""
    from appliance.sites.base import s3_endpoint_of
    from appliance.store.objects import StoreCreds

    for var in ("ST_AUTH", "ST_USER", "ST_KEY", "AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "APPLIANCE_S3_ENDPOINT"):
        monkeypatch.delenv(var, raising=False)
    assert s3_endpoint_of("https://chi.uc.chameleoncloud.org:7480/swift/v1/AUTH_p") == \
        "https://chi.uc.chameleoncloud.org:7480"
    cloud = FakeCloud()
    site = FakeSite(cloud)
    monkeypatch.setattr(site, "_site_store_creds", lambda: StoreCreds(
        storage_url="http://store.invalid:7480/swift/v1/AUTH_x", token="t"))  # an RGW's Swift URL
    assert site.store_creds("swift://ckpts/").s3_access_key is None and not cloud.verbs("ec2_credential")
    assert site.store_creds().s3_access_key is None and not cloud.verbs("ec2_credential")
    node, withdraw = site.job_store_creds("s3://ckpts/", name="x", lease_end=None)
    [(ac_id,)] = cloud.verbs("create_job_ec2")
    assert (node.s3_access_key, node.s3_secret_key, node.s3_endpoint) == (node.s3_access_key, "jobsecret",
                                                                         "http://store.invalid:7480")
    assert cloud.ec2_bound[node.s3_access_key] == ac_id and not node.token and not node.app_cred_secret
    assert not cloud.verbs("ec2_credential")  # the user's own keys stay on this machine
    withdraw()
    assert not cloud.ec2_bound and not cloud.app_creds
    said = []
    cloud.faults["create_app_cred"] = fault("Keystone refused an application credential (403: restricted)")
    node, withdraw = site.job_store_creds("s3://ckpts/", name="x", lease_end=None, say=said.append)
    assert (node.s3_access_key, withdraw) == ("EC2ACCESS", None) and len(said) == 1 and "never" in said[0]
    assert len(cloud.verbs("ec2_credential")) == 1
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", "mine")
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "their")
    assert site.store_creds("s3://ckpts/").s3_access_key == "mine" and len(cloud.verbs("ec2_credential")) == 1


def test_staging_nodes_get_an_application_credential_of_their_own_deleted_after(tmp_path, monkeypatch):
    """Staging (and the resume's checkpoint staging) sent the nodes this machine's Keystone token: keystoneauth
    hands a token out until 30 s before it expires, so a long stage late in a long `appliance resume` could fail
    with 401 halfway, and that token can do all the user can for up to a day. Now the nodes get what a job's nodes
    get (Site.job_store_creds: a restricted application credential for swift:// on Keystone), deleted when the
    staging ends, failed or not."""
    from appliance import flows

    for var in ("ST_AUTH", "ST_USER", "ST_KEY", "AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY"):
        monkeypatch.delenv(var, raising=False)
    cloud = FakeCloud()
    site, spec = FakeSite(cloud), spec_of(tmp_path, "st")
    run = flows.RunContext(spec, site)
    seen = []

    def stage_cluster(cluster, url, dest, *, mode, creds, out, **kw):
        seen.append((creds, dict(cloud.app_creds)))
        if len(seen) == 2:
            raise ApplianceError("staging failed on st-0: boom")
        return {}

    monkeypatch.setattr(flows.steps, "stage_cluster", stage_cluster)
    cluster = Cluster(name="st", cloud="fake", nodes=[], lease_end="2026-11-30T12:00:00")
    flows.stage_to_nodes(run, cluster, "swift://data/x/", "data", mode="full")
    creds, live = seen[0]
    assert creds.app_cred and not creds.token and creds.app_cred_id in live
    [(name, expires)] = cloud.verbs("create_app_cred")
    assert name.startswith("appliance-st-stage-") and expires == dt.datetime(2026, 12, 7, 12, 0)
    assert not cloud.app_creds  # deleted when staging ended
    with pytest.raises(ApplianceError, match="boom"):
        flows.stage_to_nodes(run, cluster, "swift://data/x/", "data", mode="full")
    assert len(cloud.verbs("create_app_cred")) == 2 and not cloud.app_creds  # and when it failed
    flows.stage_to_nodes(run, cluster, "file:///tmp/x/", "data", mode="full")
    assert seen[-1][0] is None and len(cloud.verbs("create_app_cred")) == 2


def test_up_waits_for_its_servers_with_one_listing_a_round_not_a_request_per_server(tmp_path, monkeypatch):
    """make bench-scale-light: waiting for 64 servers asked Nova for each one in turn, every round (64 requests,
    ~36 ms of the launcher's CPU each for openstacksdk's parsing). Now one listing filtered by up's own names."""
    site, spec = FakeSite(), spec_of(tmp_path, "fl", nodes=4)

    def one_by_one(sid):
        raise AssertionError("a request per server")

    monkeypatch.setattr(site.cloud, "get_server", one_by_one)
    cl = up(site, spec)
    assert site.cloud.verbs("get_servers") == [("^fl-[0-9]+$",)]
    assert [n.name for n in cl.nodes] == ["fl-0", "fl-1", "fl-2", "fl-3"]
    lifecycle.down("fl", site=site)


def test_status_reads_its_nodes_from_one_listing(tmp_path, monkeypatch):
    """`appliance status` asked Nova for each node in turn (find_server: a GET, and a listing more for one gone).
    Now one listing, unfiltered: a cluster adopted from a Heat stack has other names."""
    site, spec = FakeSite(), spec_of(tmp_path, "fs", nodes=3)
    up(site, spec)
    gone = site.cloud.servers.pop(next(iter(site.cloud.servers)))

    def one_by_one(sid):
        raise AssertionError("a request per server")

    monkeypatch.setattr(site.cloud, "get_server", one_by_one)
    site.cloud.calls.clear()
    states = {n["name"]: n["state"] for n in lifecycle.status("fs", site=site)["nodes"]}
    assert states == {gone.name: "GONE", **{s.name: "ACTIVE" for s in site.cloud.servers.values()}}
    assert site.cloud.verbs("get_servers") == [(None,)]
    monkeypatch.undo()
    lifecycle.down("fs", site=site)


def test_a_server_missing_from_the_listing_is_said_to_have_disappeared(tmp_path):
    site, spec = FakeSite(), spec_of(tmp_path, "fm", nodes=2)
    site.cloud.faults["create_server"] = "BUILD"
    real = site.cloud.get_servers

    def without_the_first(ids, name_regex=None):
        got = real(ids, name_regex)
        got[ids[0]] = None  # deleted by someone while it booted
        return got

    site.cloud.get_servers = without_the_first
    with pytest.raises(ApplianceError, match="fm-0 .* disappeared while booting"):
        up(site, spec)
    del site.cloud.get_servers
    lifecycle.down("fm", site=site)


def test_finish_asks_for_the_nodes_host_keys_at_once_and_opens_one_ssh_session(tmp_path, monkeypatch):
    """make bench-scale-light: host keys were asked for one node after another (64 round trips to Nova), and SSH
    was opened three times over (to wait for it, for the disk, to contextualize): 3 x 64 key exchanges."""
    site, spec = FakeSite(), spec_of(tmp_path, "fh", nodes=4)
    cl = up(site, spec)
    for i, n in enumerate(cl.nodes):
        n.private_ip = f"10.0.0.{i + 10}"
    barrier = threading.Barrier(4, timeout=10)

    def host_keys(sid):
        barrier.wait()  # passes only with the four requests in flight at once
        return [f"ssh-ed25519 AAAAkey{sid}"]

    opened = []

    class OneSession:
        def __init__(self, cluster, timeout=15.0):
            opened.append(self)
            self.closed = False

        def close(self):
            self.closed = True

        def __enter__(self):
            return self

        def __exit__(self, *exc):
            self.close()

    used = []
    monkeypatch.setattr(site.cloud, "server_host_keys", host_keys, raising=False)
    monkeypatch.setattr(lifecycle, "Session", OneSession)
    monkeypatch.setattr(site, "prepare_nodes", lambda cluster, session: used.append(("disk", session)))
    monkeypatch.setattr(lifecycle, "contextualize", lambda cluster, session=None: used.append(("ctx", session)))
    lifecycle.finish(site, cl)
    assert len(opened) == 1 and opened[0].closed
    assert used == [("disk", opened[0]), ("ctx", opened[0])]
    pinned = open(cl.known_hosts).read().splitlines()
    assert [line.split()[0].split(",")[0] for line in pinned] == ["fh-0", "fh-1", "fh-2", "fh-3"]  # the nodes' order
    lifecycle.down("fh", site=site)


def test_a_refused_key_is_said_at_once_not_after_the_ssh_wait(monkeypatch):
    """Issue 51: nodes that refuse the key were waited on for the whole SSH timeout (60 s locally, 900 s on
    Chameleon), then "SSH never came up". A refused key is final (CC images write authorized_keys before sshd
    starts), so it is said as it comes."""
    from appliance.remote import KeyRefused

    tries = []

    def refusing(cluster, timeout=15.0):
        tries.append(1)
        raise KeyRefused("node1 (10.0.0.1) refused the key /k for user cc", "give the right key")

    monkeypatch.setattr(lifecycle, "Session", refusing)
    site = FakeSite(FakeCloud())
    site.ssh_timeout, site.poll = 3600.0, 0.0
    with pytest.raises(ApplianceError, match="refused the key /k"):
        lifecycle._wait_ssh(site, object())
    assert tries == [1]


def test_the_local_site_uses_the_users_key_pair_when_given(tmp_path):
    from appliance.sites.local import LocalSite

    key = tmp_path / "id"
    key.write_text("k")
    site = LocalSite.__new__(LocalSite)  # no cloud: the user's key needs none
    got = site.login_key("mine", str(key))
    assert (got.name, got.file) == ("mine", str(key))
    with pytest.raises(ApplianceError, match="no private key at"):
        site.login_key("mine", str(tmp_path / "nope"))
    with pytest.raises(ApplianceError, match="without key_file"):
        site.login_key("mine", None)


def test_a_lease_is_over_when_blazar_says_so_or_its_end_has_passed(tmp_path, monkeypatch):
    from appliance.checkpoint import job

    cloud = FakeCloud()
    site = FakeSite(cloud)
    lease = cloud.create_lease("l", "compute_local", 1, dt.timedelta(hours=1))
    over = job.lease_over_for(site)
    assert over(lease.id) is False
    cloud.clock += dt.timedelta(hours=2)  # past its end by the cloud's clock
    assert over(lease.id) is True
    assert over("no-such-lease") is True  # Blazar has none: gone
    monkeypatch.setattr(cloud, "lease_at", lambda lid: (_ for _ in ()).throw(RuntimeError("down")))
    assert over(lease.id) is False  # cannot tell: the ttl decides


def test_an_extension_renews_the_jobs_store_credential_for_the_new_end(tmp_path, monkeypatch):
    """Issue 52 item 6: the job's credential expired a week after the lease end known at its start, so a run extended
    twice got 401 on its commits. Each extension makes one that outlives the new end and writes it over the head's
    credentials file; both are deleted when the job ends."""
    from appliance.checkpoint.job import JobCheckpoints

    for var in ("ST_AUTH", "ST_USER", "ST_KEY", "AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY"):
        monkeypatch.delenv(var, raising=False)
    site = FakeSite()
    w, cloud, info, asked, said, stopped = watch(tmp_path, site, ends_in_s=30,
                                                 lease="lease: {duration: 1h, stop_margin: 60s, extend: true}\n")
    jc = JobCheckpoints(site)
    wrote, renewed = [], threading.Event()

    class Head:
        def run(self, cmd, stdin=None, check=False):
            wrote.append((cmd, stdin))
            renewed.set()

    jc.spec = spec_of(tmp_path, "fw", lease="lease: {duration: 1h, extend: true}\ncheckpoint: {url: 'swift://ckpts/'}\n")
    jc.head, jc.creds_file, jc.say = Head(), "/run/.store-creds.json", said.append
    jc.ctx = type("Ctx", (), {"job_id": "j1"})()
    first = cloud.create_app_cred("appliance-fw-j1-first", expires_at=info.end + dt.timedelta(days=7))
    jc._withdraw_creds = lambda: cloud.delete_app_cred(first["id"])
    w.on_extended = jc.renew_creds
    w.start()
    try:
        assert cloud.called["extend_lease"].wait(10) and renewed.wait(10)  # renewed right after the extension
    finally:
        w.close()
    new_end = cloud.leases[info.id].end
    made = [a for a in cloud.verbs("create_app_cred") if not a[0].endswith("-first")]
    assert made and made[-1][1] == new_end + dt.timedelta(days=7), made
    (cmd, body), = wrote
    assert "mv -f" in cmd and b"app_cred_secret" in body and "umask 077" in cmd
    jc._withdraw()
    assert not cloud.app_creds  # the first and the renewed one


def test_an_up_killed_as_blazar_answers_leaves_no_orphan_lease(tmp_path):
    """A managed run's controller killed mid-handover, right after Blazar made the new lease and before its answer
    was saved: the next `up` (the controller started again) uses that lease, and makes no second one."""
    site, spec = FakeSite(), spec_of(tmp_path, "fo")
    made = site.cloud.create_lease

    def killed_after(*a, **k):
        made(*a, **k)
        raise KeyboardInterrupt  # what the record saw of it: nothing
    site.cloud.create_lease = killed_after
    with pytest.raises(KeyboardInterrupt):
        up(site, spec)
    assert find_cluster("fo").lease_id is None and len(site.cloud.leases) == 1
    site.cloud.create_lease = made
    cl = up(site, spec)
    assert len(site.cloud.leases) == 1 and cl.lease_id == next(iter(site.cloud.leases))
    lifecycle.down("fo", site=site)
    assert all(x.status == "DELETED" for x in site.cloud.leases.values()) or not site.cloud.leases


def test_an_up_killed_as_nova_answers_uses_that_server_and_asks_for_no_second(tmp_path):
    """The same for a server: killed after Nova took the request and before the record had its id. The next `up`
    finds it by its name and the reservation in its metadata; a server of another reservation with that name (the
    last lease's, say) is not taken."""
    site, spec = FakeSite(), spec_of(tmp_path, "fq")
    c = site.cloud
    c.create_server("fq-1", reservation_id="an-older-reservation", image="i", key_name="k", network="n")
    made = c.create_server

    def killed_after(name, **kw):
        sid = made(name, **kw)
        if name == "fq-0":
            raise KeyboardInterrupt
        return sid
    c.create_server = killed_after
    with pytest.raises(KeyboardInterrupt):
        up(site, spec)
    c.create_server = made
    cl = up(site, spec)
    ours = [s for s in c.servers.values() if s.metadata["appliance_reservation"] == cl.reservation_id]
    assert sorted(s.name for s in ours) == ["fq-0", "fq-1"]  # one each: the unrecorded fq-0 was used
    assert set(cl.site.servers.values()) == {s.id for s in ours}
    lifecycle.down("fq", site=site)


def test_a_verb_that_starts_the_local_cloud_says_so_before_it_does(monkeypatch, said):
    """Issue 61: with no OS_CLOUD, `data upload` and the lease verbs act on the local cloud, started silently, whose
    store `cloud stop` empties: the first line says it, before anything goes there."""
    from appliance.sites import local

    seen = []
    monkeypatch.setattr(local.localcloud, "status", lambda site=None: {"running": False})
    monkeypatch.setattr(local.localcloud, "start", lambda site=None: seen.append(list(said)))
    monkeypatch.setattr(local, "connect", lambda **kw: None)
    monkeypatch.setattr(local, "OpenStackCloud", lambda conn: "the cloud")
    assert local.LocalSite().connect() == "the cloud"
    assert len(seen) == 1 and len(seen[0]) == 1, seen
    assert seen[0][0].startswith("starting the local cloud CHI@local") and "OS_CLOUD" in seen[0][0]
    assert local.LocalSite("CHI@local2").describe() == "the local cloud CHI@local2"
