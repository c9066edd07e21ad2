"""The local cloud's HTTP layer in process (fast tier): every service module loads and routes, tokens are checked
before authenticated routes, paths are normalised as each real API allows, errors come in each service's shape.
The server runs on a fake node backend here; with testbed nodes and the real OpenStack clients in the e2e tier."""

import datetime as dt
import json
import threading
import urllib.error
import urllib.request
from http.server import ThreadingHTTPServer

import pytest

from appliance.localcloud import _credentials, server
from appliance.localcloud.cloud import Cloud
from appliance.localcloud.nodes import NodeBackend


class NoNodes(NodeBackend):
    host_ip = "10.99.0.1"

    def add(self, hostname, authorized_keys, user="root", data_disk=None, image=None):
        raise RuntimeError("no nodes in the fast tier")

    def stop_sshd(self, node): ...
    def run(self, hostname, script): ...
    def remove(self, hostname): ...
    def netns_of(self, hostname): return "ns"
    def address(self, netns, address, *, add): ...
    def shutdown(self): ...


@pytest.fixture
def api(tmp_path):
    creds = _credentials(tmp_path)
    cloud = Cloud(tmp_path, nodes=NoNodes())
    httpd = ThreadingHTTPServer(("127.0.0.1", 0), type("H", (server.Handler,), {"cloud": cloud}))
    t = threading.Thread(target=httpd.serve_forever, kwargs={"poll_interval": 0.01}, daemon=True)
    t.start()
    base = f"http://127.0.0.1:{httpd.server_address[1]}"

    def call(method, path, body=None, token=None, headers=None):
        req = urllib.request.Request(base + path, method=method, data=None if body is None else json.dumps(body).encode(),
                                     headers={"Content-Type": "application/json", **({"X-Auth-Token": token} if token else {}),
                                              **(headers or {})})
        try:
            with urllib.request.urlopen(req, timeout=10) as r:
                return r.status, json.loads(r.read() or b"null"), dict(r.headers)
        except urllib.error.HTTPError as e:
            return e.code, json.loads(e.read() or b"null"), dict(e.headers)

    try:
        yield call, creds
    finally:
        httpd.shutdown()
        httpd.server_close()


def token(call, creds):
    st, body, hdrs = call("POST", "/identity/v3/auth/tokens", {"auth": {"identity": {
        "methods": ["password"], "password": {"user": {"name": creds["username"], "password": creds["password"]}}}}})
    assert st == 201 and body["token"]["catalog"]
    return hdrs["X-Subject-Token"]


def test_every_service_is_routed():
    assert sorted(server.SERVICES) == ["_admin", "compute", "identity", "image", "network", "orchestration",
                                       "reservation"]
    assert all(m.ROUTES for m in server.SERVICES.values())


def test_a_503_fault_is_haproxys_page_for_the_requests_it_names_then_the_service_answers(api):
    """``POST /_admin/faults {"503 GET /reservation/v1/leases": 2}``: the next two GETs under that path find no
    backend behind HAProxy (its own HTML 503, which no client reads as JSON); a POST there and the third GET pass."""
    call, creds = api
    tok = token(call, creds)
    assert call("POST", "/_admin/faults", {"503 GET /reservation/v1/leases": 2})[0] == 200
    base = call("GET", "/identity/v3", token=tok)[1]["version"]["links"][0]["href"].split("/identity")[0]
    for _ in range(2):
        req = urllib.request.Request(base + "/reservation/v1/leases", headers={"X-Auth-Token": tok})
        with pytest.raises(urllib.error.HTTPError) as e:
            urllib.request.urlopen(req, timeout=10)
        assert e.value.code == 503 and e.value.headers["Content-Type"] == "text/html"
        assert e.value.read() == server.HAPROXY_503
    assert call("GET", "/reservation/v1/leases", token=tok)[:2] == (200, {"leases": []})
    st, body, hdrs = call("POST", "/_admin/faults", {})
    assert body["503 GET /reservation/v1/leases"] == 0


def test_tokens_are_checked_before_routing_and_errors_have_each_services_shape(api):
    call, creds = api
    st, body, _ = call("GET", "/reservation/v1/leases")
    assert st == 401 and body["error_code"] == 401  # Blazar's shape, before any route is looked at
    st, body, _ = call("GET", "/reservation/v1/nowhere")
    assert st == 401
    tok = token(call, creds)
    assert call("GET", "/reservation/v1/leases", token=tok)[:2] == (200, {"leases": []})
    st, body, _ = call("GET", "/reservation/v1/nowhere", token=tok)
    assert st == 404 and body["error_name"] == "NotFound"
    st, body, _ = call("GET", "/network/v2.0/floatingips/nope", token=tok)
    assert st == 404 and body["NeutronError"]["type"] == "FloatingIPNotFound"
    st, body, _ = call("GET", "/compute/v2.1/os-keypairs/nope", token=tok)
    assert st == 404 and body["itemNotFound"]["message"] == "Keypair nope not found"


def test_unauthenticated_roots_and_normalised_paths(api):
    call, creds = api
    assert call("GET", "/identity")[0] == 300 and call("GET", "/reservation")[0] == 300
    assert call("GET", "/compute/v2.1")[1]["version"]["id"] == "v2.1"
    tok = token(call, creds)
    st, body, _ = call("GET", f"/compute/v2.1/{'a' * 32}/flavors/detail", token=tok)  # old-style project id
    assert st == 200 and body["flavors"][0]["name"] == "baremetal"
    assert call("GET", "/network/v2.0/networks.json", token=tok)[1]["networks"][0]["name"] == "sharednet1"
    assert call("GET", "/orchestration", token=tok)[0] == 300  # Heat's version document needs a token
    assert call("GET", "/_admin/health")[1] == {"ok": True}
    assert call("GET", "/nowhere")[0] == 404


def test_upstream_error_names_and_suffixes(api):
    call, creds = api
    tok = token(call, creds)
    kp = {"keypair": {"name": "k", "public_key": "ssh-ed25519 AAAAC3Nza k"}}
    assert call("POST", "/compute/v2.1/os-keypairs", kp, token=tok)[0] == 200
    st, body, _ = call("POST", "/compute/v2.1/os-keypairs", kp, token=tok)
    assert st == 409 and body["conflictingRequest"]["code"] == 409  # nova/api/openstack/wsgi.py Fault
    assert call("GET", "/reservation/v1/leases.json", token=tok)[:2] == (200, {"leases": []})  # Rest.route
    project = creds["project_id"]
    st, body, _ = call("GET", f"/orchestration/v1/{project}/stacks/nope", token=tok)
    assert st == 404 and body["explanation"] and body["error"]["type"]  # heat/api/middleware/fault.py


def test_lease_names_may_repeat_and_glance_serves_its_image_schemas(api):
    """What python-chi found (tests/test_provision.py::test_python_chi_speaks_to_the_local_cloud): Blazar lets two
    leases share a name (ChameleonCloud/blazar migration 6bfd1c23aa18 dropped the unique constraint), and glanceclient
    reads /v2/schemas/image before it lists or shows an image (glance/api/v2/schemas.py)."""
    call, creds = api
    tok = token(call, creds)
    st, body, _ = call("GET", "/network/v2.0/networks?name=public", token=tok)
    fip = {"resource_type": "virtual:floatingip", "network_id": body["networks"][0]["id"], "amount": 1}
    end = (dt.datetime.now(dt.timezone.utc) + dt.timedelta(days=1)).strftime("%Y-%m-%d %H:%M")
    lease = {"name": "same", "start_date": "now", "end_date": end, "reservations": [fip], "events": []}
    ids = []
    for _ in range(2):
        st, body, _ = call("POST", "/reservation/v1/leases", lease, token=tok)
        assert st == 201, body
        ids.append(body["lease"]["id"])
    assert ids[0] != ids[1]
    st, schema, _ = call("GET", "/image/v2/schemas/image", token=tok)
    assert st == 200 and schema["name"] == "image" and schema["additionalProperties"] == {"type": "string"}
    assert {"id", "name", "status", "visibility", "checksum", "self", "file", "schema"} <= set(schema["properties"])
    st, coll, _ = call("GET", "/image/v2/schemas/images", token=tok)
    assert st == 200 and coll["properties"]["images"]["items"] == schema
    st, imgs, _ = call("GET", "/image/v2/images", token=tok)
    assert all(i["schema"] == "/v2/schemas/image" and i["self"] == f"/v2/images/{i['id']}" for i in imgs["images"])


def test_keystone_validates_tokens_for_the_store_as_keystone_does(api):
    """The local RGW validates every Keystone token with Keystone (GET /v3/auth/tokens, X-Subject-Token) as the
    service user ceph_rgw, as Chameleon's RGW does. Keystone answers 404 for a token that expired, for one whose
    application credential was deleted, and for one whose credential has access rules when the caller did not send
    OpenStack-Identity-Access-Rules (keystone/token/provider.py _validate_token_access_rules; RGW 16 never sends
    it). Before: GET /v3/auth/tokens answered 200 {} for any valid caller and checked no subject at all."""
    call, creds = api
    user_tok = token(call, creds)
    svc = creds["services"]["ceph_rgw"]
    st, body, hdrs = call("POST", "/identity/v3/auth/tokens", {"auth": {"identity": {
        "methods": ["password"], "password": {"user": {"name": "ceph_rgw", "password": svc,
                                                       "domain": {"name": "Default"}}}}}})
    assert st == 201 and {r["name"] for r in body["token"]["roles"]} >= {"admin"}
    rgw = hdrs["X-Subject-Token"]

    def validate(subject, caller=rgw, **h):
        return call("GET", "/identity/v3/auth/tokens", token=caller, headers={"X-Subject-Token": subject, **h})

    st, body, _ = validate(user_tok)
    assert st == 200 and body["token"]["project"]["id"] == creds["project_id"]
    assert {r["name"] for r in body["token"]["roles"]} == {"member"}
    assert validate("gAAAAnot-a-token")[0] == 404
    assert validate(rgw, caller=user_tok)[0] == 403  # a user may not validate someone else's token

    uid = creds["user_id"]
    acs = f"/identity/v3/users/{uid}/application_credentials"
    plain = call("POST", acs, {"application_credential": {"name": "job"}}, token=user_tok)[1]["application_credential"]
    ruled = call("POST", acs, {"application_credential": {"name": "ruled", "access_rules": [
        {"service": "object-store", "method": "GET", "path": "/v1/**"}]}}, token=user_tok)[1]["application_credential"]
    assert "access_rules" not in plain and ruled["access_rules"]

    def ac_token(cred):
        st, _, hdrs = call("POST", "/identity/v3/auth/tokens", {"auth": {"identity": {
            "methods": ["application_credential"],
            "application_credential": {"id": cred["id"], "secret": cred["secret"]}}}})
        return st, hdrs.get("X-Subject-Token")

    plain_tok, ruled_tok = ac_token(plain)[1], ac_token(ruled)[1]
    assert validate(plain_tok)[0] == 200
    assert validate(ruled_tok)[0] == 404
    assert validate(ruled_tok, **{"OpenStack-Identity-Access-Rules": "1.0"})[0] == 200

    # a restricted credential's token may neither make nor delete credentials; the user's may
    assert call("DELETE", f"{acs}/{plain['id']}", token=plain_tok)[0] == 403
    listed = call("GET", acs, token=user_tok)[1]["application_credentials"]
    assert {x["name"] for x in listed} == {"job", "ruled"} and not any("secret" in x for x in listed)
    assert call("DELETE", f"{acs}/{plain['id']}", token=user_tok)[0] == 204
    assert call("DELETE", f"{acs}/{plain['id']}", token=user_tok)[0] == 404
    assert validate(plain_tok)[0] == 404  # the credential is gone: so are its tokens
    assert ac_token(plain)[0] == 401

    # tokens expire (tests set seconds; a day by default, Chameleon's), and so do credentials
    assert call("GET", "/_admin/tokens")[1]["seconds"] == 86400
    call("POST", "/_admin/tokens", {"seconds": -1})  # issued already expired: no waiting on a real clock
    short = token(call, creds)
    assert validate(short)[0] == 404
    assert call("GET", "/compute/v2.1/servers", token=short)[0] == 401
    call("POST", "/_admin/tokens", {"seconds": 3600})
    past = (dt.datetime.now(dt.timezone.utc) - dt.timedelta(minutes=1)).strftime("%Y-%m-%dT%H:%M:%S")
    old = call("POST", acs, {"application_credential": {"name": "old", "expires_at": past}},
               token=token(call, creds))[1]["application_credential"]
    assert ac_token(old)[0] == 401


def test_keystone_checks_s3_signatures_of_ec2_credentials_for_the_rgw(api):
    """Chameleon's S3 keys are Keystone EC2 credentials; its RGW sends each S3 request's string to sign and
    signature to POST /v3/s3tokens (src/rgw/rgw_auth_keystone.cc EC2Engine::get_from_keystone) and Keystone answers
    with a token of the credential's project, 401 for a wrong signature, 404 for an unknown key
    (keystone/api/s3tokens.py, _shared/EC2_S3_Resource.py). The signature here is botocore's own SigV4."""
    import base64

    from botocore.auth import S3SigV4Auth
    from botocore.awsrequest import AWSRequest
    from botocore.credentials import Credentials

    call, creds = api
    tok, uid = token(call, creds), creds["user_id"]
    ec2 = f"/identity/v3/users/{uid}/credentials/OS-EC2"
    st, body, _ = call("POST", ec2, {"tenant_id": creds["project_id"]}, token=tok)
    assert st == 201
    made = body["credential"]
    assert made["tenant_id"] == creds["project_id"] and made["links"]["self"].endswith(f"{ec2}/{made['access']}")
    assert call("POST", ec2, {"tenant_id": "another-project"}, token=tok)[0] == 404
    assert [c["access"] for c in call("GET", ec2, token=tok)[1]["credentials"]] == [made["access"]]

    class Seen(S3SigV4Auth):  # botocore's signer, keeping the string it signed (what the RGW sends Keystone)
        def signature(self, string_to_sign, request):
            self.sts = string_to_sign
            return super().signature(string_to_sign, request)

    def signed(secret):
        auth = Seen(Credentials(made["access"], secret), "s3", "us-east-1")
        req = AWSRequest(method="GET", url="http://10.99.0.1:7480/bucket", headers={})
        auth.add_auth(req)
        sts = auth.sts
        sig = req.headers["Authorization"].rsplit("Signature=", 1)[1]
        return {"credentials": {"access": made["access"], "token": base64.urlsafe_b64encode(sts.encode()).decode(),
                                "signature": sig}}

    st, body, _ = call("POST", "/identity/v3/s3tokens", signed(made["secret"]))  # no X-Auth-Token: unenforced
    assert st == 200 and body["token"]["methods"] == ["ec2credential"]
    assert body["token"]["project"]["id"] == creds["project_id"] and body["token"]["user"]["id"] == uid
    assert call("POST", "/identity/v3/s3tokens", signed("wrong"))[0] == 401
    unknown = signed(made["secret"])
    unknown["credentials"]["access"] = "0" * 32
    assert call("POST", "/identity/v3/s3tokens", unknown)[0] == 404
    assert call("GET", "/identity/v3/s3tokens")[0] == 405
    # the RGW reads the secret as its service user; another user's token may not; deleted is gone
    assert call("GET", f"{ec2}/{made['access']}", token=tok)[1]["credential"]["secret"] == made["secret"]
    assert call("DELETE", f"{ec2}/{made['access']}", token=tok)[0] == 204
    assert call("POST", "/identity/v3/s3tokens", signed(made["secret"]))[0] == 404


def test_answers_go_out_without_waiting_for_the_clients_delayed_ack(tmp_path):
    """The handler writes the headers and the body separately; with Nagle's algorithm on a kept-alive connection the
    body waited for the client's delayed ACK: 44 ms on every API call (0.7 ms without), which the lease watchdog's
    reads, every poll of `up` and every test paid."""
    import socket

    _credentials(tmp_path)
    nodelay = []

    class H(server.Handler):
        cloud = Cloud(tmp_path, nodes=NoNodes())

        def do_GET(self):
            nodelay.append(self.connection.getsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY))
            return server.Handler._handle(self)

    httpd = ThreadingHTTPServer(("127.0.0.1", 0), H)
    threading.Thread(target=httpd.serve_forever, kwargs={"poll_interval": 0.01}, daemon=True).start()
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{httpd.server_address[1]}/identity/v3", timeout=10) as r:
            assert r.status == 200
    finally:
        httpd.shutdown()
        httpd.server_close()
    assert nodelay and all(nodelay)


@pytest.fixture
def short_log(monkeypatch):
    """REQUEST_LOG at 50, set before ``api`` builds its cloud (the bound, not 2,000 calls, is what is tested)."""
    from appliance.localcloud import cloud as cloud_mod

    monkeypatch.setattr(cloud_mod, "REQUEST_LOG", 50)
    return cloud_mod


def test_the_request_log_keeps_no_secret_and_is_bounded(short_log, api):
    """Issue 49: the unauthenticated /_admin/requests kept every request body, Keystone passwords included, without
    bound, and nodes can reach it."""
    cloud_mod = short_log
    call, creds = api
    tok = token(call, creds)
    reqs = call("GET", "/_admin/requests")[1]["requests"]
    auth = [r for r in reqs if r["path"].endswith("/auth/tokens")][0]
    assert auth["body"]["auth"]["identity"]["password"]["user"] == {"name": creds["username"], "password": "***"}
    assert creds["password"] not in json.dumps(reqs)
    for _ in range(cloud_mod.REQUEST_LOG + 10):
        call("GET", "/_admin/health")
    assert len(call("GET", "/_admin/requests")[1]["requests"]) == cloud_mod.REQUEST_LOG
    assert tok


def test_an_ec2_credential_made_with_an_application_credential_dies_with_it(api):
    """Keystone binds an EC2 credential made through POST /v3/credentials with an application credential's token to
    that credential (keystone/api/credentials.py, app_cred_id in the blob) and refuses it once the application
    credential is gone (EC2_S3_Resource.handle_authenticate): what an s3:// job's nodes get (issue 49)."""
    import base64
    import hashlib
    import hmac

    call, creds = api
    tok = token(call, creds)
    user, project = creds["user_id"], creds["project_id"]
    st, body, _ = call("POST", f"/identity/v3/users/{user}/application_credentials",
                       {"application_credential": {"name": "job-1"}}, token=tok)
    ac = body["application_credential"]
    st, _, hdrs = call("POST", "/identity/v3/auth/tokens", {"auth": {"identity": {
        "methods": ["application_credential"], "application_credential": {"id": ac["id"], "secret": ac["secret"]}}}})
    ac_tok = hdrs["X-Subject-Token"]
    blob = json.dumps({"access": "a" * 32, "secret": "s" * 32})
    st, body, _ = call("POST", "/identity/v3/credentials", {"credential": {
        "type": "ec2", "user_id": user, "project_id": project, "blob": blob}}, token=ac_tok)
    assert st == 201 and json.loads(body["credential"]["blob"])["app_cred_id"] == ac["id"]
    assert body["credential"]["id"] == hashlib.sha256(b"a" * 32).hexdigest()
    sts = b"GET\n\n\nTue, 27 Mar 2007 19:36:42 +0000\n/bucket/"
    sig = base64.encodebytes(hmac.new(b"s" * 32, sts, hashlib.sha1).digest()).decode().strip()
    ask = {"credentials": {"access": "a" * 32, "token": base64.urlsafe_b64encode(sts).decode(), "signature": sig}}
    assert call("POST", "/identity/v3/s3tokens", ask)[0] == 200
    assert call("DELETE", f"/identity/v3/users/{user}/application_credentials/{ac['id']}", token=tok)[0] == 204
    st, body, _ = call("POST", "/identity/v3/s3tokens", ask)
    assert st == 404 and "Application Credential" in json.dumps(body)
    st, _, _ = call("POST", "/identity/v3/credentials", {"credential": {"type": "cert", "user_id": user,
                                                                         "project_id": project, "blob": "{}"}}, token=tok)
    assert st == 400


def test_heat_serves_the_events_and_resources_the_cli_and_horizon_read(api):
    """Issue 51: `openstack stack create --wait` failed with "The Stack (events) could not be found": the local Heat
    answered only stacks and outputs. Events (oldest first, after a marker, the stack's own told by its link) and
    resources (INIT_COMPLETE until made), by name and by name/id, as heat/api/openstack/v1 serves them."""
    import time

    call, creds = api
    tok = token(call, creds)
    project = creds["project_id"]
    tpl = {"heat_template_version": "2018-08-31", "resources": {
        "k": {"type": "OS::Nova::KeyPair", "properties": {"name": "evkey", "public_key": "ssh-ed25519 AAAA x"}}}}
    st, body, _ = call("POST", f"/orchestration/v1/{project}/stacks", {"stack_name": "ev", "template": tpl},
                       token=tok)
    assert st == 201
    sid = body["stack"]["id"]
    for _ in range(200):  # polling the API for the stack's status, as `--wait` does (it runs in the background)
        if call("GET", f"/orchestration/v1/{project}/stacks/ev", token=tok)[1]["stack"]["stack_status"] != \
                "CREATE_IN_PROGRESS":
            break
        time.sleep(0.05)
    st, body, _ = call("GET", f"/orchestration/v1/{project}/stacks/ev/events?sort_dir=asc", token=tok)
    assert st == 200
    evs = body["events"]
    assert [(e["resource_name"], e["resource_status"]) for e in evs] == [
        ("ev", "CREATE_IN_PROGRESS"), ("k", "CREATE_IN_PROGRESS"), ("k", "CREATE_COMPLETE"), ("ev", "CREATE_COMPLETE")]
    last = evs[-1]  # what heatclient's poll_for_events takes for the stack's own event
    assert last["physical_resource_id"] == sid == {x["rel"]: x["href"] for x in last["links"]}["stack"].rsplit("/", 1)[-1]
    after = call("GET", f"/orchestration/v1/{project}/stacks/ev/{sid}/events?marker={evs[1]['id']}", token=tok)[1]
    assert [e["id"] for e in after["events"]] == [e["id"] for e in evs[2:]]
    one = call("GET", f"/orchestration/v1/{project}/stacks/ev/{sid}/resources/k/events", token=tok)[1]["events"]
    assert [e["resource_status"] for e in one] == ["CREATE_IN_PROGRESS", "CREATE_COMPLETE"]
    res = call("GET", f"/orchestration/v1/{project}/stacks/ev/resources", token=tok)[1]["resources"]
    assert [(r["resource_name"], r["resource_type"], r["resource_status"], r["physical_resource_id"]) for r in res] \
        == [("k", "OS::Nova::KeyPair", "CREATE_COMPLETE", "evkey")]
    assert call("GET", f"/orchestration/v1/{project}/stacks/ev/{sid}/resources/nope", token=tok)[0] == 404
    assert call("GET", f"/orchestration/v1/{project}/stacks/nope/events", token=tok)[0] == 404


def test_blazar_lists_each_hosts_allocations_from_now_on_as_python_chi_reads_them(api):
    """GET /v1/os-hosts/allocations (ChameleonCloud/blazar blazar/api/v1/oshosts/v1_0.py allocations_list): every
    host, and the reservations holding it from now on, with dates python-chi's chi/hardware.py parses
    ("%Y-%m-%dT%H:%M:%S.%f"); what a managed run reads to find the next free slot (sites/slots.py)."""
    call, creds = api
    tok = token(call, creds)
    start = dt.datetime.now(dt.timezone.utc).replace(tzinfo=None) + dt.timedelta(hours=2)
    host = {"resource_type": "physical:host", "min": 2, "max": 2, "hypervisor_properties": "",
            "resource_properties": json.dumps(["=", "$node_type", "gpu_local"]), "before_end": "default"}
    lease = {"name": "later", "start_date": start.strftime("%Y-%m-%d %H:%M"),
             "end_date": (start + dt.timedelta(hours=1)).strftime("%Y-%m-%d %H:%M"), "reservations": [host], "events": []}
    st, body, _ = call("POST", "/reservation/v1/leases", lease, token=tok)
    assert st == 201, body
    lid = body["lease"]["id"]
    st, body, _ = call("GET", "/reservation/v1/os-hosts/allocations", token=tok)
    assert st == 200
    st, hosts, _ = call("GET", "/reservation/v1/os-hosts", token=tok)
    gpu = {h["id"] for h in hosts["hosts"] if h["node_type"] == "gpu_local"}
    held = {a["resource_id"]: a["reservations"] for a in body["allocations"]}
    assert set(held) == {h["id"] for h in hosts["hosts"]}  # every host, held or not
    assert all(len(held[h]) == 1 and held[h][0]["lease_id"] == lid for h in gpu)
    assert not any(held[h] for h in set(held) - gpu)
    r = held[next(iter(gpu))][0]
    assert set(r) == {"id", "lease_id", "start_date", "end_date", "extras"}
    assert dt.datetime.strptime(r["start_date"], "%Y-%m-%dT%H:%M:%S.%f") == start.replace(second=0, microsecond=0)


def test_the_stores_servers_listen_below_the_ephemeral_range(tmp_path):
    """Ports handed to Swift's and Ceph's servers come from below the kernel's ephemeral range: a port the kernel
    gave a throwaway socket could be taken by any outgoing connection before the server bound it (Swift then waited
    out its 30 s bind timeout and `make test` saw "Swift did not start (container)")."""
    import socket

    from appliance.localcloud import ports

    low = ports.ephemeral_low()
    got = {ports.listen_port() for _ in range(20)}
    assert all(ports.LOW <= p < low for p in got) and len(got) > 1
    rng = tmp_path / "range"
    rng.write_text("40000\t60999\n")
    assert ports.ephemeral_low(str(rng)) == 40000
    with socket.socket() as s:  # a port in use is never handed out
        p = ports.listen_port()
        s.bind(("127.0.0.1", p))
        s.listen()
        assert p not in {ports.listen_port() for _ in range(50)}


def test_an_endpoint_file_without_an_address_yet_is_a_cloud_not_up():
    """`start` polls for the server's endpoint file and reads it at once: read while being written it was empty, and
    the health check raised (urllib's ValueError, "unknown url type") instead of waiting on (seen in make test)."""
    from appliance import localcloud

    assert localcloud._health("") is False
