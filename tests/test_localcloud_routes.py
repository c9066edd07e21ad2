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

    def add(self, hostname, authorized_keys):
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
    t = threading.Thread(target=httpd.serve_forever, daemon=True)
    t.start()
    base = f"http://127.0.0.1:{httpd.server_address[1]}"

    def call(method, path, body=None, token=None):
        req = urllib.request.Request(base + path, method=method, data=None if body is None else json.dumps(body).encode(),
                                     headers={"Content-Type": "application/json", **({"X-Auth-Token": token} if token else {})})
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
