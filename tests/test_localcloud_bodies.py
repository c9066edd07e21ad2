"""What the local cloud answers, body by body (fast tier): a scripted session through every service (Keystone,
Blazar, Nova, Neutron, Glance, Heat, the admin hooks) on a node backend that boots at once, compared with
tests/data/localcloud_bodies.json after ids, secrets, addresses and times are numbered by first appearance.

The bodies there were recorded from the local cloud whose state was dicts shaped as the API bodies, before its
state became typed records (appliance/localcloud/state.py): a change of any field, value or status a client sees
fails here. A deliberate change of what the local cloud answers re-records them:
``APPLIANCE_RECORD_BODIES=1 pytest tests/test_localcloud_bodies.py`` (and the diff is reviewed).
Key order is not compared: JSON clients do not read it."""

from __future__ import annotations

import datetime as dt
import json
import os
import re
import subprocess
import threading
import urllib.error
import urllib.request
from http.server import ThreadingHTTPServer
from pathlib import Path
from types import SimpleNamespace

from appliance.localcloud import _credentials, server
from appliance.localcloud.cloud import Cloud
from appliance.localcloud.nodes import NodeBackend

GOLDEN = Path(__file__).parent / "data" / "localcloud_bodies.json"


class InstantNodes(NodeBackend):
    """Servers boot at once; a node is a record (no namespace, no sshd)."""

    host_ip = "10.99.0.1"

    def __init__(self, root: Path):
        self.root, self.nodes, self.addresses = root, {}, []
        self.teardown = threading.Event()  # a node's teardown (a server's delete) waits for it
        self.teardown.set()

    def add(self, hostname, authorized_keys, user="root", data_disk=None, image=None):
        d = self.root / hostname
        d.mkdir(parents=True, exist_ok=True)
        ip = f"10.99.0.{10 + sum(hostname.encode()) % 180}"  # by name: servers boot in threads, in any order
        node = SimpleNamespace(ip=ip, dir=str(d), sshd_pid=0, netns=f"ns-{hostname}")
        self.nodes[hostname] = node
        return node

    def stop_sshd(self, node): ...

    def run(self, hostname, script):
        return subprocess.CompletedProcess([], 0, "", "")

    def remove(self, hostname):
        assert self.teardown.wait(10)
        self.nodes.pop(hostname, None)

    def netns_of(self, hostname):
        return self.nodes[hostname].netns

    def address(self, netns, address, *, add):
        self.addresses.append((netns, address, add))

    def shutdown(self): ...


class Normaliser:
    """Numbers what differs from run to run (ids, tokens, secrets, keys, MACs) by first appearance, so two runs of
    the same session give the same text; every time is one <time> (whether two fall in the same second is luck)."""

    PATTERNS = [
        ("uuid", r"[0-9a-f]{8}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{12}"),
        ("hex32", r"(?<![0-9a-f])[0-9a-f]{32}(?![0-9a-f])"),
        ("token", r"gAAAA[A-Za-z0-9_-]+"),
        ("sshkey", r"ssh-ed25519 [A-Za-z0-9+/=]+"),
        ("privkey", r"-----BEGIN OPENSSH PRIVATE KEY-----[^\"]*?-----END OPENSSH PRIVATE KEY-----"),
        ("mac", r"fa:16:3e:[0-9a-f]{2}:[0-9a-f]{2}:[0-9a-f]{2}"),
        ("time", r"\d{4}-\d\d-\d\d[T ]\d\d:\d\d(?::\d\d(?:\.\d+)?)?Z?"),
        ("secret", r"(?<=\"secret\": \")[A-Za-z0-9_-]+"),
        ("secret", r"(?<=\"adminPass\": \")[A-Za-z0-9_-]+"),
        ("audit", r"(?<=\"audit_ids\": \[\")[A-Za-z0-9_-]+"),
        ("pw", r"(?<=\"password\": \")[A-Za-z0-9_-]+"),
    ]

    def __init__(self, fixed: dict[str, str]):
        self.names: dict[str, str] = dict(fixed)
        self.count: dict[str, int] = {}

    def _name(self, kind: str, value: str) -> str:
        if value not in self.names:
            self.count[kind] = self.count.get(kind, 0) + 1
            self.names[value] = f"<{kind}{self.count[kind]}>"
        return self.names[value]

    def __call__(self, obj) -> object:
        text = json.dumps(obj, sort_keys=True)
        for value, name in list(self.names.items()):
            text = text.replace(value, name)
        for kind, pattern in self.PATTERNS:
            text = re.sub(pattern, lambda m, k=kind: "<time>" if k == "time" else self._name(k, m.group(0)), text)
        return json.loads(text)


TEMPLATE = """
heat_template_version: 2018-08-31
parameters:
  reservation_id: {type: string, constraints: [{custom_constraint: blazar.reservation}]}
resources:
  key: {type: OS::Nova::KeyPair, properties: {name: hkey, public_key: "ssh-ed25519 AAAAC3NzaC1lZDI1NTE5AAAAIHeat"}}
  head:
    type: OS::Nova::Server
    properties:
      name: hs-head
      image: appliance-cpu
      flavor: baremetal
      key_name: {get_resource: key}
      networks: [{network: sharednet1}]
      scheduler_hints: {reservation: {get_param: reservation_id}}
  ip: {type: OS::Neutron::FloatingIP, properties: {floating_network: public}}
  assoc:
    type: OS::Neutron::FloatingIPAssociation
    properties: {floatingip_id: {get_resource: ip}, port_id: {get_attr: [head, addresses, sharednet1, 0, port]}}
outputs:
  head_ip: {value: {get_attr: [ip, floating_ip_address]}, description: the head's floating IP}
"""


def session(tmp_path: Path) -> list:
    """Every call a client of ours (or python-chi, or the `openstack` CLI) makes, in the order of a lease's life."""
    creds = _credentials(tmp_path)
    cloud = Cloud(tmp_path, nodes=InstantNodes(tmp_path / "nodes"), pools={"compute_local": 3, "gpu_local": 1})
    httpd = ThreadingHTTPServer(("127.0.0.1", 0), type("H", (server.Handler,), {"cloud": cloud}))
    threading.Thread(target=httpd.serve_forever, kwargs={"poll_interval": 0.01}, daemon=True).start()
    base = f"http://127.0.0.1:{httpd.server_address[1]}"
    out: list = []
    tok = ""

    def call(method, path, body=None, note="", headers=None, raw=None):
        data = raw if raw is not None else (None if body is None else json.dumps(body).encode())
        req = urllib.request.Request(base + path, method=method, data=data,
                                     headers={"Content-Type": "application/json",
                                              **({"X-Auth-Token": tok} if tok else {}), **(headers or {})})
        try:
            with urllib.request.urlopen(req, timeout=10) as r:
                st, text = r.status, r.read()
        except urllib.error.HTTPError as e:
            st, text = e.code, e.read()
        try:
            got = json.loads(text or b"null")
        except ValueError:
            got = text.decode(errors="replace")
        out.append({"call": f"{method} {path}", "note": note, "status": st, "body": got})
        return got

    def wait(path, key, field, until):
        """Poll as a client does until the record leaves its transient state (the boot runs in a thread)."""
        for _ in range(500):
            got = call("GET", path)
            if got[key][field] not in until:
                out.pop()
                got = call("GET", path, note="after it settled")
                return got
            out.pop()
            threading.Event().wait(0.01)
        raise AssertionError(f"{path} stayed {until}")

    try:
        got = call("POST", "/identity/v3/auth/tokens", {"auth": {"identity": {"methods": ["password"], "password": {
            "user": {"name": creds["username"], "password": creds["password"]}}}}}, note="password token")
        tok = next(t for t in cloud.tokens)
        uid, pid = creds["user_id"], creds["project_id"]
        call("GET", "/identity/v3/auth/tokens", headers={"X-Subject-Token": tok}, note="validate own token")
        got = call("POST", f"/identity/v3/users/{uid}/application_credentials",
                   {"application_credential": {"name": "extra", "secret": "s3cret-extra", "description": "d"}})
        call("GET", f"/identity/v3/users/{uid}/application_credentials")
        call("POST", "/identity/v3/auth/tokens", {"auth": {"identity": {"methods": ["application_credential"],
             "application_credential": {"id": got["application_credential"]["id"], "secret": "s3cret-extra"}}}},
             note="restricted app cred token")
        call("DELETE", f"/identity/v3/users/{uid}/application_credentials/{got['application_credential']['id']}")
        ec2 = call("POST", f"/identity/v3/users/{uid}/credentials/OS-EC2", {"tenant_id": pid})
        call("GET", f"/identity/v3/users/{uid}/credentials/OS-EC2")
        call("GET", f"/identity/v3/users/{uid}/credentials/OS-EC2/{ec2['credential']['access']}")
        call("DELETE", f"/identity/v3/users/{uid}/credentials/OS-EC2/{ec2['credential']['access']}")

        call("GET", "/reservation/v1/os-hosts")
        call("GET", "/network/v2.0/networks")
        call("GET", "/network/v2.0/networks?router:external=True")
        public = next(n for n in cloud_networks(call) if n["router:external"])
        call("GET", "/compute/v2.1/flavors/detail")
        call("GET", "/compute/v2.1/flavors/baremetal")
        call("GET", "/image/v2/images?name=appliance-cpu")
        image = call("GET", "/image/v2/images?name=appliance-cpu")["images"][0]
        call("POST", "/compute/v2.1/os-keypairs", {"keypair": {"name": "k1", "public_key": "ssh-ed25519 AAAAk1 x"}})
        call("POST", "/compute/v2.1/os-keypairs", {"keypair": {"name": "k1", "public_key": "ssh-ed25519 AAAAk1 x"}},
             note="twice")
        call("GET", "/compute/v2.1/os-keypairs")
        call("GET", "/compute/v2.1/os-keypairs/k1")

        now = dt.datetime.fromisoformat(call("GET", "/_admin/clock")["now"])
        start, end = (f"{now + dt.timedelta(hours=h):%Y-%m-%d %H:%M}" for h in (0, 2))
        body = {"name": "l1", "start_date": "now", "end_date": end,
                "reservations": [{"resource_type": "physical:host", "min": 2, "max": 2, "hypervisor_properties": "",
                                  "resource_properties": '["=", "$node_type", "compute_local"]'},
                                 {"resource_type": "virtual:floatingip", "network_id": public["id"], "amount": 1}]}
        lease = call("POST", "/reservation/v1/leases", body)["lease"]
        call("POST", "/reservation/v1/leases", {**body, "name": "l2", "reservations": body["reservations"][:1]},
             note="no hosts left: 500")
        call("POST", "/reservation/v1/leases", {**body, "name": "bad", "start_date": start,
                                                 "end_date": f"{now + dt.timedelta(days=8):%Y-%m-%d %H:%M}"},
             note="over 7 days")
        call("GET", "/reservation/v1/leases")
        call("GET", f"/reservation/v1/leases/{lease['id']}.json")
        host_res = next(r for r in lease["reservations"] if r["resource_type"] == "physical:host")
        call("GET", f"/network/v2.0/floatingips?tags=reservation:"
                    f"{next(r for r in lease['reservations'] if r['resource_type'] != 'physical:host')['id']}")

        srv = {"server": {"name": "n", "flavorRef": "baremetal", "imageRef": image["id"], "key_name": "k1",
                          "networks": [{"uuid": next(n for n in cloud_networks(call) if not n["router:external"])["id"]}],
                          "min_count": 2, "max_count": 2},
               "os:scheduler_hints": {"reservation": host_res["id"]}}
        call("POST", "/compute/v2.1/servers", srv)
        ids = [s["id"] for s in call("GET", "/compute/v2.1/servers?name=^n-")["servers"]]
        for sid in ids:
            wait(f"/compute/v2.1/servers/{sid}", "server", "status", ("BUILD",))
        call("GET", "/compute/v2.1/servers/detail")
        call("POST", "/compute/v2.1/servers", {**srv, "server": {**srv["server"], "name": "x", "min_count": 1,
                                                                 "max_count": 1}}, note="no host left: ERROR")
        call("GET", "/compute/v2.1/servers/detail?name=^x$")
        call("POST", f"/compute/v2.1/servers/{ids[0]}/action", {"os-getConsoleOutput": {"length": 10}})
        call("GET", f"/compute/v2.1/servers/{ids[0]}/os-interface")
        port = call("GET", f"/network/v2.0/ports?device_id={ids[0]}")["ports"][0]
        fips = call("GET", "/network/v2.0/floatingips")["floatingips"]
        call("PUT", f"/network/v2.0/floatingips/{fips[0]['id']}", {"floatingip": {"port_id": port["id"]}})
        call("GET", f"/compute/v2.1/servers/{ids[0]}")
        call("DELETE", f"/network/v2.0/floatingips/{fips[0]['id']}", note="reserved: 409")
        mine = call("POST", "/network/v2.0/floatingips", {"floatingip": {"floating_network_id": public["id"]}})
        call("GET", f"/network/v2.0/floatingips/{mine['floatingip']['id']}")
        call("DELETE", f"/network/v2.0/floatingips/{mine['floatingip']['id']}")
        call("GET", f"/compute/v2.1/servers/{ids[0]}/os-server-password")
        with cloud.lock:  # what the node POSTs to its metadata service (metadata.py) is the server's password
            cloud_server_set_password(cloud, ids[0], "ENCRYPTED")
        call("GET", f"/compute/v2.1/servers/{ids[0]}/os-server-password")
        call("DELETE", f"/compute/v2.1/servers/{ids[0]}/os-server-password")
        call("GET", f"/compute/v2.1/servers/{ids[0]}/os-server-password")

        from appliance.localcloud.metadata import vendordata

        out.append({"call": "vendordata", "note": "", "status": 0,
                    "body": vendordata(cloud, cloud_server(cloud, ids[0]))})

        stack = call("POST", f"/orchestration/v1/{pid}/stacks",
                     {"stack_name": "hs", "template": TEMPLATE, "parameters": {"reservation_id": "nope"}},
                     note="unknown reservation")
        call("PUT", f"/reservation/v1/leases/{lease['id']}", {"end_date": "2999-01-01 00:00"}, note="too far")
        cloud.nodes.teardown.clear()  # the node's teardown held: what Nova answers meanwhile
        call("DELETE", f"/compute/v2.1/servers/{ids[1]}", note="answered at once: the compute tears it down")
        call("GET", f"/compute/v2.1/servers/{ids[1]}", note="deleting")
        call("DELETE", f"/compute/v2.1/servers/{ids[1]}", note="again, while it is deleting: ignored")
        cloud.nodes.teardown.set()
        cloud.wait_deleted([cloud.servers[ids[1]]])
        call("GET", f"/compute/v2.1/servers/{ids[1]}", note="gone")
        stack = call("POST", f"/orchestration/v1/{pid}/stacks",
                     {"stack_name": "hs", "template": TEMPLATE, "parameters": {"reservation_id": host_res["id"]}})
        wait(f"/orchestration/v1/{pid}/stacks/hs/{stack['stack']['id']}", "stack", "stack_status",
             ("CREATE_IN_PROGRESS",))
        call("GET", f"/orchestration/v1/{pid}/stacks")
        call("GET", f"/orchestration/v1/{pid}/stacks/hs/{stack['stack']['id']}/outputs")
        call("GET", "/compute/v2.1/servers/detail")
        call("GET", "/network/v2.0/floatingips")
        call("DELETE", f"/orchestration/v1/{pid}/stacks/hs/{stack['stack']['id']}")
        call("GET", "/compute/v2.1/servers")
        call("GET", "/compute/v2.1/os-keypairs")

        img = call("POST", "/image/v2/images", {"name": "mine", "disk_format": "qcow2", "container_format": "bare",
                                                 "hw_firmware_type": "uefi"})
        call("PUT", f"/image/v2/images/{img['id']}/file", raw=b"image bytes",
             headers={"Content-Type": "application/octet-stream"})
        call("GET", f"/image/v2/images/{img['id']}")
        call("DELETE", f"/image/v2/images/{img['id']}")

        call("POST", "/_admin/faults", {"lease_degraded": 1})
        call("DELETE", f"/reservation/v1/leases/{lease['id']}", note="ends it: its servers go")
        cloud.wait_deleted(list(cloud.servers.values()))  # as a client polls until they are gone
        call("GET", "/compute/v2.1/servers")
        call("GET", "/network/v2.0/floatingips")
        deg = call("POST", "/reservation/v1/leases", {**body, "name": "deg"})["lease"]
        call("POST", "/_admin/advance", {"seconds": 3 * 3600})
        call("GET", f"/reservation/v1/leases/{deg['id']}", note="past its end")
        call("GET", "/reservation/v1/leases")
    finally:
        httpd.shutdown()
        httpd.server_close()
        cloud.shutdown()
    norm = Normaliser({tmp_path.name: "<tmp>", creds["user_id"]: "<user>", creds["project_id"]: "<project>",
                       creds["app_cred_id"]: "<appcred>", str(httpd.server_address[1]): "<port>"})
    return [norm(x) for x in out]


def cloud_networks(call) -> list:
    got = call("GET", "/network/v2.0/networks")
    return got["networks"]


def cloud_server(cloud, sid):
    return cloud.servers[sid]


def cloud_server_set_password(cloud, sid, value):
    cloud.servers[sid].password = value


def test_every_body_the_local_cloud_answers_is_as_recorded(tmp_path):
    got = session(tmp_path)
    if os.environ.get("APPLIANCE_RECORD_BODIES"):
        GOLDEN.parent.mkdir(exist_ok=True)
        GOLDEN.write_text(json.dumps(got, indent=1, sort_keys=True) + "\n")
    want = json.loads(GOLDEN.read_text())
    assert [x["call"] for x in got] == [x["call"] for x in want]
    for g, w in zip(got, want):
        assert g == w, f"{g['call']} ({g['note']})"
