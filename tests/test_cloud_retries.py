"""The control plane's bad hours, fast tier: OpenStackCloud with the real clients (keystoneauth's session,
python-blazarclient) over a fake Blazar at the requests level that answers 5xx, resets or nothing when told. A read
or a DELETE is asked again by keystoneauth itself (sites/openstack_auth.py retry_policy); a lease POST whose answer
was lost is looked for by name before it is asked again, once; `down` survives a 5xx, and says a lasting one in a
line, its record kept."""

from __future__ import annotations

import datetime as dt
import email.utils
import itertools
import json
from types import SimpleNamespace
from urllib.parse import urlparse

import pytest
import requests
from requests.adapters import BaseAdapter

from appliance.cluster import Cluster, SiteRecord, find_cluster
from appliance.errors import ApplianceError, Unanswered, Unavailable
from appliance.provision import lifecycle
from appliance.sites import openstack_auth
from appliance.sites.openstack import RUN_CLOUD, OpenStackCloud
from appliance.sites.openstack_auth import read_retry_session, retry_policy
from fakes import FakeSite

NOW = dt.datetime(2026, 3, 2, 12, 0, 0)
BARE_500 = (500, {"error_code": 500, "error_message": "Internal Server Error", "error_name": 500})


class FakeBlazar(BaseAdapter):
    """Blazar's lease routes in memory. ``faults``: (METHOD, path, what) taken in order by the first request they
    match: a status or (status, body) (answered without acting), ("made", status[, body]) (acted on, then answered
    so: the answer lost on its way back), or "reset" (the connection closed without an answer)."""

    def __init__(self):
        super().__init__()
        self.leases: dict[str, dict] = {}
        self.faults: list[tuple[str, str, object]] = []
        self.seen: list[tuple[str, str]] = []
        self.ids = itertools.count(1)

    def send(self, request, **kwargs):
        method, path = request.method, urlparse(request.url).path.removeprefix("/v1")
        self.seen.append((method, path))
        fault = next((f for f in self.faults if f[:2] == (method, path)), None)
        if fault is not None:
            self.faults.remove(fault)
            what = fault[2]
            if what == "reset":
                raise requests.exceptions.ConnectionError("Connection reset by peer")
            if isinstance(what, tuple) and what[0] == "made":
                self.route(method, path, request)
                what = what[1:] if len(what) > 2 else what[1]
            status, body = what if isinstance(what, tuple) else (what, {"error_message": "Gateway Time-out"})
            return self.answer(request, status, body)
        return self.answer(request, *self.route(method, path, request))

    def route(self, method: str, path: str, request) -> tuple[int, dict | None]:
        parts = path.strip("/").split("/")
        if method == "POST" and parts == ["leases"]:
            body = json.loads(request.body)
            lid = f"lease-{next(self.ids)}"
            self.leases[lid] = {"id": lid, "name": body["name"], "status": "PENDING", "start_date": "2026-03-02 12:00",
                                "end_date": body["end_date"], "created_at": f"{NOW:%Y-%m-%d %H:%M:%S}",
                                "reservations": [{"id": f"res-{lid}", "resource_type": "physical:host"}]}
            return 201, {"lease": self.leases[lid]}
        if method == "GET" and parts == ["leases"]:
            return 200, {"leases": list(self.leases.values())}
        lease = self.leases.get(parts[1]) if len(parts) == 2 else None
        if lease is None:
            return 404, {"error_message": f"Object with {{'lease_id': '{parts[-1]}'}} not found", "error_code": 404}
        if method == "DELETE":
            del self.leases[parts[1]]
            return 204, None
        lease["status"] = "ACTIVE"  # a lease read twice has started
        return 200, {"lease": lease}

    def answer(self, request, status: int, body: dict | None) -> requests.Response:
        r = requests.Response()
        r.status_code, r.request, r.url = status, request, request.url
        r._content = json.dumps(body).encode() if body is not None else b""
        r.headers["Content-Type"] = "application/json"
        r.headers["Date"] = email.utils.format_datetime(NOW.replace(tzinfo=dt.timezone.utc), usegmt=True)
        return r

    def close(self):
        pass

    def asked(self, method: str, path: str = "/leases") -> int:
        return self.seen.count((method, path))


@pytest.fixture
def blazar(monkeypatch):
    monkeypatch.setattr(openstack_auth, "RETRY_DELAY", 0.001)  # keystoneauth's back-off, 1 ms apart here
    return FakeBlazar()


def cloud_over(blazar: FakeBlazar, *, managed: bool = False) -> OpenStackCloud:
    from keystoneauth1 import token_endpoint

    sess = read_retry_session()(auth=token_endpoint.Token("http://blazar.test/v1", "tok"))
    sess.session.mount("http://", blazar)
    conn = SimpleNamespace(session=sess, config=SimpleNamespace(get_region_name=lambda: "CHI@fake",
                                                                name=RUN_CLOUD if managed else "chi"))
    return OpenStackCloud(conn)


def create(c: OpenStackCloud, name: str = "run-1"):
    return c.create_lease(name, "compute_skylake", 2, dt.timedelta(hours=4), start=NOW)


def test_a_lease_post_answered_504_after_blazar_made_it_is_found_by_name_not_asked_again(blazar):
    blazar.faults.append(("POST", "/leases", ("made", 504)))
    info = create(cloud_over(blazar))
    assert info.name == "run-1" and list(blazar.leases) == [info.id]
    assert blazar.asked("POST") == 1 and blazar.asked("GET") == 1  # the one lookup, by name


def test_a_lease_post_reset_before_blazar_acted_is_asked_again_once(blazar):
    blazar.faults.append(("POST", "/leases", "reset"))
    info = create(cloud_over(blazar))
    assert list(blazar.leases) == [info.id] and blazar.asked("POST") == 2


def test_an_older_lease_of_the_same_name_is_not_taken_for_the_one_asked(blazar):
    blazar.leases["old"] = {"id": "old", "name": "run-1", "status": "ACTIVE", "start_date": "2026-03-01 12:00",
                            "end_date": "2026-03-03 12:00", "created_at": "2026-03-01 12:00:00", "reservations": []}
    blazar.faults.append(("POST", "/leases", 503))
    info = create(cloud_over(blazar))
    assert info.id != "old" and blazar.asked("POST") == 2


def test_a_bare_500_for_a_managed_runs_credential_is_looked_up_then_asked_again_once(blazar):
    blazar.faults.append(("POST", "/leases", ("made", *BARE_500)))  # the RPC timed out; the manager made it
    c = cloud_over(blazar, managed=True)
    assert create(c).id in blazar.leases and blazar.asked("POST") == 1 and len(blazar.leases) == 1
    blazar.faults.append(("POST", "/leases", BARE_500))  # nothing made: asked again, made
    info = create(c, "run-2")
    assert blazar.asked("POST") == 3 and info.name == "run-2" and len(blazar.leases) == 2


def test_two_lost_answers_are_unanswered_keeping_the_name_and_a_users_bare_500_is_the_restricted_hint(blazar):
    blazar.faults += [("POST", "/leases", 504), ("POST", "/leases", 504)]
    with pytest.raises(Unanswered, match=r"lease run-1, twice \(HTTP 504.*looks for the lease by its name"):
        create(cloud_over(blazar))
    assert blazar.asked("POST") == 2 and not blazar.leases
    blazar.faults.append(("POST", "/leases", BARE_500))  # not a managed run's credential: maybe a restricted one
    with pytest.raises(ApplianceError, match=r"HTTP 500.*restricted"):
        create(cloud_over(blazar))
    assert blazar.asked("POST") == 3


def test_a_lookup_that_fails_too_is_unanswered_never_nothing_made(blazar, monkeypatch):
    monkeypatch.setattr(openstack_auth, "RETRIES", 1)
    blazar.faults += [("POST", "/leases", ("made", 502)), ("GET", "/leases", 503), ("GET", "/leases", 503)]
    with pytest.raises(Unanswered, match=r"nor the listing that looks for it \(HTTP 503\)"):
        create(cloud_over(blazar))
    assert blazar.asked("POST") == 1 and len(blazar.leases) == 1  # not asked again: it may be (it is) there


def test_a_503_on_a_read_of_the_lease_while_waiting_is_asked_again_and_the_wait_goes_on(blazar):
    c = cloud_over(blazar)
    info = create(c)
    blazar.faults += [("GET", f"/leases/{info.id}", 503), ("GET", f"/leases/{info.id}", "reset")]
    assert c.wait_lease(info.id, timeout=5, poll=0).status == "ACTIVE"
    assert blazar.asked("GET", f"/leases/{info.id}") == 3


def test_a_read_that_never_answers_is_unavailable_not_gone(blazar, monkeypatch):
    monkeypatch.setattr(openstack_auth, "RETRIES", 2)
    c = cloud_over(blazar)
    info = create(c)
    blazar.faults += [("GET", f"/leases/{info.id}", 503)] * 3
    with pytest.raises(Unavailable, match=r"Blazar is not answering \(HTTP 503, asked again"):
        c.get_lease(info.id)
    assert blazar.asked("GET", f"/leases/{info.id}") == 3


def test_only_reads_deletes_and_keystones_token_are_sent_again():
    assert retry_policy("http://x/v1/leases", "POST", {}, None) == {"connect_retries": 0, "status_code_retries": 0}
    assert retry_policy("http://x/v1/leases/L", "PUT", {}, None)["status_code_retries"] == 0
    for url, method, kw in [("http://x/v1/leases", "GET", {}), ("http://x/v1/leases/L", "DELETE", {}),
                            ("http://k/v3/auth/tokens", "POST", {"authenticated": False})]:
        got = retry_policy(url, method, kw, None)
        assert got["connect_retries"] == got["status_code_retries"] == openstack_auth.RETRIES
        assert 500 in got["retriable_status_codes"] and 503 in got["retriable_status_codes"]


def record(name: str, lease_id: str) -> Cluster:
    cl = Cluster(name=name, cloud="local", nodes=[], lease_id=lease_id, site=SiteRecord())
    cl.save()
    return cl


def test_down_survives_a_503_and_a_lasting_one_is_a_line_with_the_record_kept(blazar, monkeypatch, caplog):
    c = cloud_over(blazar)
    site = FakeSite(cloud=c)
    first = create(c)
    record("rd", first.id)
    blazar.faults.append(("DELETE", f"/leases/{first.id}", 503))
    assert lifecycle.down("rd", site) == [f"lease {first.id}"] and not blazar.leases and find_cluster("rd") is None
    monkeypatch.setattr(openstack_auth, "RETRIES", 1)
    second = create(c, "run-2")
    record("rd", second.id)
    blazar.faults += [("DELETE", f"/leases/{second.id}", 503)] * 2
    with pytest.raises(ApplianceError) as e:
        lifecycle.down("rd", site)
    assert "\n" not in str(e.value) and "cluster rd is not all gone: Blazar is not answering (HTTP 503" in str(e.value)
    assert "run `appliance down rd` again" in str(e.value)
    assert find_cluster("rd") is not None and second.id in blazar.leases  # kept, for the next `down`
    blazar.faults += [("DELETE", f"/leases/{second.id}", 503)] * 2
    assert lifecycle.teardown("rd", site) is False and find_cluster("rd") is not None  # a thread's: a line
    assert lifecycle.teardown("rd", site) is True and find_cluster("rd") is None and not blazar.leases


def test_nova_and_neutron_failures_in_down_are_one_line():
    import openstack.exceptions

    def refuse(*a, **k):
        raise openstack.exceptions.HttpException("Service Unavailable", http_status=503)

    c = OpenStackCloud.__new__(OpenStackCloud)
    c.conn = SimpleNamespace(compute=SimpleNamespace(delete_server=refuse), network=SimpleNamespace(get_ip=refuse))
    with pytest.raises(Unavailable, match=r"^Nova is not answering \(HTTP 503"):
        c.delete_server("s-1")
    with pytest.raises(Unavailable, match=r"^Neutron is not answering \(HTTP 503"):
        c.release_floating_ip("f-1")


def test_a_server_asked_for_without_an_answer_is_found_by_name_and_reservation_before_it_is_asked_again():
    from keystoneauth1.exceptions import ConnectFailure

    from appliance.sites.openstack_api import RESERVATION_KEY, ListedServer

    made: list[ListedServer] = []
    answers = iter(["made then reset", "reset", "answered"])

    def create_server(**kw):
        what = next(answers)
        if what != "reset":
            made.append(ListedServer(f"s-{len(made)}", kw["name"], "BUILD", {}, metadata=kw["metadata"]))
        if what != "answered":
            raise ConnectFailure("Unable to establish connection: Connection reset by peer")
        return made[-1]

    found = SimpleNamespace(id="x")
    c = OpenStackCloud.__new__(OpenStackCloud)
    c.conn = SimpleNamespace(image=SimpleNamespace(find_image=lambda n: found),
                             compute=SimpleNamespace(find_flavor=lambda n: found, create_server=create_server),
                             network=SimpleNamespace(find_network=lambda n: found))
    c.find_servers = lambda regex: [s for s in made if s.metadata.get(RESERVATION_KEY) == "res-1"]
    ask = dict(reservation_id="res-1", image="img", key_name="k", network="sharednet1")
    assert c.create_server("run-0", **ask) == "s-0" and len(made) == 1  # found: not asked again
    assert c.create_server("run-1", reservation_id="res-2", image="img", key_name="k", network="n") == "s-1"
    assert len(made) == 2  # none found on res-2: asked once more, answered


def test_a_cluster_record_deleted_while_it_is_looked_for_is_none_not_an_error(monkeypatch):
    """A warm handover's teardown (another thread) deletes a record between a look's `exists` and its read: the
    record is not there (None), not "no cluster named" raised into the managed run's handover."""
    from appliance import cluster

    class Vanishing:
        def exists(self):
            return True  # there when asked ...

        def read_text(self):
            raise FileNotFoundError("fm.json")  # ... and gone when read

    monkeypatch.setattr(cluster, "state_path", lambda name: Vanishing())
    assert cluster.find_cluster("fm") is None
    with pytest.raises(ApplianceError, match="no cluster named 'fm'"):
        cluster.load_cluster("fm")
