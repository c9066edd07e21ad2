"""The local cloud: a small OpenStack-compatible control plane on 127.0.0.1 that behaves like Chameleon.

One HTTP server, one port, the services under path prefixes listed in Keystone's catalog:

    /identity/v3     Keystone: password and application-credential tokens, the service catalog
    /reservation/v1  Blazar: leases of physical hosts and floating IPs, node pools per node type
    /compute/v2.1    Nova: servers (booted as testbed nodes), key pairs, flavors, console output
    /network/v2.0    Neutron: networks, ports, floating IPs (tags, association)
    /image/v2        Glance: the image list
    /_admin          test hooks: advance the clock, inject faults, read the request log

The same client code that talks to Chameleon talks to this, over HTTP, with the real clients
(keystoneauth, openstacksdk, python-blazarclient). Where it matters it acts like Chameleon: lease
dates in UTC at minute resolution, resource_properties as a JSON string of string triples, the
7-day cap and the 48-hour extension window, NotEnoughHostsAvailable when a pool is exhausted or a
host is booked after your end, reservation id != lease id, servers only on an active reservation,
and at the lease end every server of the lease is deleted (the node and its disk are gone).

Time: the cloud has its own clock (the HTTP ``Date`` header), running ``time_scale`` times faster
than real time, and ``POST /_admin/advance`` moves it forward at once.
"""

from __future__ import annotations

import argparse
import base64
import copy
import datetime as dt
import email.utils
import json
import os
import re
import secrets
import signal
import sys
import threading
import time
import traceback
import uuid
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from urllib.parse import parse_qs, urlparse

from .. import testbed

MAX_LEASE_SECONDS = 7 * 86400
EXTENSION_WINDOW_SECONDS = 48 * 3600
API_DATE = "%Y-%m-%d %H:%M"
ISO = "%Y-%m-%dT%H:%M:%S.%f"
REGION = "CHI@local"
DEFAULT_POOLS = {"compute_local": 4, "gpu_local": 2}


class ApiError(Exception):
    def __init__(self, code: int, message: str, name: str = ""):
        super().__init__(message)
        self.code, self.message, self.name = code, message, name


def _uuid() -> str:
    return str(uuid.uuid4())


class Clock:
    def __init__(self, scale: float = 1.0):
        self.scale = scale
        self.real0 = time.time()
        self.virt0 = self.real0
        self.offset = 0.0
        self.lock = threading.Lock()

    def now(self) -> float:
        with self.lock:
            return self.virt0 + (time.time() - self.real0) * self.scale + self.offset

    def advance(self, seconds: float) -> None:
        with self.lock:
            self.offset += seconds


def _fmt(ts: float, f: str = ISO) -> str:
    return dt.datetime.fromtimestamp(ts, dt.timezone.utc).replace(tzinfo=None).strftime(f)


def _parse_api_date(value, field: str) -> float:
    try:
        return dt.datetime.strptime(value, API_DATE).replace(tzinfo=dt.timezone.utc).timestamp()
    except (TypeError, ValueError):
        raise ApiError(400, f"{field} {value!r} must be in format '{API_DATE}' (UTC)", "InvalidDate") from None


# ---------------------------------------------------------------------------------------------
# resource_properties: Blazar's grammar (blazar/utils/plugins.py convert_requirements)

OPS = {"=", "==", "!=", ">=", "<=", ">", "<"}


def parse_requirements(text: str):
    """Parse a resource_properties string; returns a predicate on a host's capabilities."""
    if text == "":
        return lambda caps: True
    if not isinstance(text, str):
        raise ApiError(400, "resource_properties must be a JSON-encoded string", "MalformedRequirements")
    try:
        req = json.loads(text)
    except ValueError:
        raise ApiError(400, f"Malformed requirements {text}", "MalformedRequirements") from None
    return _compile(req, text)


def _compile(req, text):
    if not isinstance(req, list) or not req:
        raise ApiError(400, f"Malformed requirements {text}", "MalformedRequirements")
    if req[0] == "and":
        parts = [_compile(r, text) for r in req[1:]]
        return lambda caps: all(p(caps) for p in parts)
    if len(req) != 3 or req[0] not in OPS or not all(isinstance(x, str) for x in req):
        raise ApiError(400, f"Malformed requirements {text}", "MalformedRequirements")
    op, key, value = req
    if not key.startswith("$"):
        raise ApiError(400, f"Malformed requirements {text}", "MalformedRequirements")
    key = key[1:]

    def pred(caps):
        have = caps.get(key)
        if have is None:
            return False
        a, b = have, value
        try:
            a, b = float(have), float(value)
        except ValueError:
            pass
        return {"=": a == b, "==": a == b, "!=": a != b, ">=": a >= b, "<=": a <= b, ">": a > b, "<": a < b}[op]

    return pred


# ---------------------------------------------------------------------------------------------
# the cloud's state


class Cloud:
    def __init__(self, state_dir: Path, *, time_scale: float = 1.0, pools: dict[str, int] | None = None,
                 boot_seconds: float = 0.0, base_url: str = "", testbed_name: str = "cloud"):
        self.dir = state_dir
        self.tb_name = testbed_name
        self.clock = Clock(time_scale)
        self.boot_seconds = boot_seconds
        self.base_url = base_url
        self.lock = threading.RLock()
        self.creds = json.loads((state_dir / "credentials.json").read_text())
        self.project_id = self.creds["project_id"]
        self.user_id = self.creds["user_id"]
        self.tokens: dict[str, float] = {}
        self.hosts = []
        for node_type, n in (pools or DEFAULT_POOLS).items():
            for i in range(1, n + 1):
                self.hosts.append({"id": str(len(self.hosts) + 1), "hypervisor_hostname": f"{node_type}-{i:02d}",
                                   "node_type": node_type, "capabilities": {"node_type": node_type,
                                                                           "node_name": f"{node_type}-{i:02d}"}})
        self.leases: dict[str, dict] = {}
        self.servers: dict[str, dict] = {}
        self.keypairs: dict[str, dict] = {}
        self.fips: dict[str, dict] = {}
        self.sharednet = {"id": _uuid(), "name": "sharednet1", "status": "ACTIVE", "router:external": False,
                          "shared": True, "subnets": [_uuid()], "tags": []}
        self.public = {"id": _uuid(), "name": "public", "status": "ACTIVE", "router:external": True,
                       "shared": True, "subnets": [_uuid()], "tags": []}
        self.flavor = {"id": "baremetal", "name": "baremetal", "ram": 196608, "vcpus": 48, "disk": 240,
                       "OS-FLV-EXT-DATA:ephemeral": 0, "swap": 0, "rxtx_factor": 1.0, "is_public": True,
                       "os-flavor-access:is_public": True, "links": []}
        self.images = [{"id": _uuid(), "name": name, "status": "active", "visibility": "public",
                        "disk_format": "qcow2", "container_format": "bare", "size": 1 << 30, "tags": [],
                        "created_at": _fmt(self.clock.now(), "%Y-%m-%dT%H:%M:%SZ"), "min_disk": 0, "min_ram": 0,
                        "owner": self.project_id, "protected": False}
                       for name in ("appliance-cpu", "CC-Ubuntu22.04", "CC-Ubuntu22.04-CUDA")]
        self.faults: dict[str, int] = {}
        self.requests: list[dict] = []
        self.tb = testbed.ensure_bridge(testbed_name)
        self.fip_next = 200
        from .heat import Heat

        self.heat = Heat(self, _uuid)

    # -- engine -----------------------------------------------------------------------------------

    def tick(self) -> None:
        """Move leases through their life: PENDING -> ACTIVE at start, TERMINATED at end."""
        now = self.clock.now()
        with self.lock:
            for lease in list(self.leases.values()):
                if lease["status"] == "PENDING" and now >= lease["_start"]:
                    self._start_lease(lease)
                if lease["status"] == "ACTIVE" and now >= lease["_end"]:
                    self._end_lease(lease, "TERMINATED")

    def _start_lease(self, lease):
        lease["status"] = "ACTIVE"
        for r in lease["reservations"]:
            r["status"] = "active"
            if r["resource_type"] == "virtual:floatingip":
                for _ in range(int(r["amount"])):
                    fip = self._new_fip(tags=[f"reservation:{r['id']}", "blazar"])
                    r["_fips"].append(fip["id"])
        self._event(lease, "start_lease", "DONE")
        lease["updated_at"] = _fmt(self.clock.now(), "%Y-%m-%d %H:%M:%S")

    def _end_lease(self, lease, status):
        """end_lease: delete every server on the reserved hosts, release reserved FIPs."""
        lease["status"] = "TERMINATING"
        hosts = {h for r in lease["reservations"] for h in r.get("_hosts", [])}
        for srv in list(self.servers.values()):
            if srv["_host"] in hosts and srv["status"] != "DELETED":
                self._delete_server(srv)
        for r in lease["reservations"]:
            for fid in r.get("_fips", []):
                self._release_fip(fid)
            r["status"] = "deleted"
        self._event(lease, "end_lease", "DONE")
        lease["status"] = status
        lease["updated_at"] = _fmt(self.clock.now(), "%Y-%m-%d %H:%M:%S")

    def _event(self, lease, etype, status):
        for e in lease["events"]:
            if e["event_type"] == etype:
                e["status"] = status

    # -- hosts ------------------------------------------------------------------------------------

    def _busy(self, host_id: str, start: float, end: float, ignore: str | None = None) -> bool:
        for lease in self.leases.values():
            if lease["id"] == ignore or lease["status"] in ("TERMINATED", "ERROR", "DELETED"):
                continue
            for r in lease["reservations"]:
                if host_id in r.get("_hosts", []) and lease["_start"] < end and start < lease["_end"]:
                    return True
        return False

    # -- Blazar -----------------------------------------------------------------------------------

    def lease_view(self, lease) -> dict:
        out = {k: copy.deepcopy(v) for k, v in lease.items() if not k.startswith("_")}
        out["start_date"] = _fmt(lease["_start"])
        out["end_date"] = _fmt(lease["_end"])
        for r in out["reservations"]:
            for k in [k for k in r if k.startswith("_")]:
                del r[k]
        return out

    def create_lease(self, body: dict) -> dict:
        now = self.clock.now()
        for key in ("name", "start_date", "end_date", "reservations"):
            if key not in body:
                raise ApiError(400, f"'{key}' is a required property", "MissingParameter")
        start = now if body["start_date"] == "now" else _parse_api_date(body["start_date"], "start_date")
        end = _parse_api_date(body["end_date"], "end_date")
        if body["start_date"] != "now" and start < now - 60:
            raise ApiError(400, "The lease start date must be later than the current date", "InvalidInput")
        if end <= start:
            raise ApiError(400, "Start date must be earlier than end date", "InvalidInput")
        if end - start > MAX_LEASE_SECONDS:
            raise ApiError(400, f"Lease duration must not exceed {MAX_LEASE_SECONDS} seconds (7 days); "
                                f"requested {int(end - start)} seconds", "MaxLeaseDurationException")
        if any(lease["name"] == body["name"] and lease["status"] not in ("TERMINATED", "ERROR")
               for lease in self.leases.values()):
            raise ApiError(409, f"A lease with name {body['name']} already exists", "LeaseNameAlreadyExists")
        lease_id = _uuid()
        reservations = []
        with self.lock:
            for req in body["reservations"]:
                rtype = req.get("resource_type")
                rid = _uuid()
                if rtype == "physical:host":
                    for key in ("min", "max", "hypervisor_properties", "resource_properties"):
                        if key not in req:
                            raise ApiError(400, f"'{key}' is a required property of a physical:host reservation",
                                           "MissingParameter")
                    try:
                        lo, hi = int(req["min"]), int(req["max"])
                    except (TypeError, ValueError):
                        raise ApiError(400, "min and max must be integers", "InvalidInput") from None
                    if lo < 1 or hi < lo:
                        raise ApiError(400, "Invalid values for min/max of hosts", "InvalidRange")
                    pred = parse_requirements(req["resource_properties"])
                    free = [h["id"] for h in self.hosts if pred(h["capabilities"]) and not self._busy(h["id"], start, end)]
                    if len(free) < lo:
                        raise ApiError(409, "Not enough hosts available", "NotEnoughHostsAvailable")
                    reservations.append({
                        "id": rid, "lease_id": lease_id, "status": "pending", "resource_id": _uuid(),
                        "resource_type": rtype, "min": lo, "max": hi,
                        "hypervisor_properties": req["hypervisor_properties"],
                        "resource_properties": req["resource_properties"], "before_end": req.get("before_end", "default"),
                        "missing_resources": False, "resources_changed": False, "_hosts": free[:hi],
                    })
                elif rtype == "virtual:floatingip":
                    if req.get("network_id") != self.public["id"]:
                        raise ApiError(400, "network_id must be the external network", "InvalidInput")
                    reservations.append({"id": rid, "lease_id": lease_id, "status": "pending",
                                         "resource_type": rtype, "network_id": req["network_id"],
                                         "amount": int(req.get("amount", 1)), "_fips": []})
                else:
                    raise ApiError(400, f"Unsupported resource type {rtype}", "UnsupportedResourceType")
            stamp = _fmt(now, "%Y-%m-%d %H:%M:%S")
            lease = {"id": lease_id, "name": body["name"], "status": "PENDING", "degraded": False,
                     "user_id": self.user_id, "project_id": self.project_id, "trust_id": _uuid(),
                     "created_at": stamp, "updated_at": None, "reservations": reservations,
                     "events": [{"event_type": "start_lease", "time": _fmt(start), "status": "UNDONE"},
                                {"event_type": "end_lease", "time": _fmt(end), "status": "UNDONE"}],
                     "_start": start, "_end": end}
            if self.faults.get("lease_error", 0) > 0:
                self.faults["lease_error"] -= 1
                lease["status"] = "ERROR"
            if self.faults.get("lease_degraded", 0) > 0:
                self.faults["lease_degraded"] -= 1
                lease["degraded"] = True
                reservations[0]["missing_resources"] = True
            self.leases[lease_id] = lease
        self.tick()
        return self.lease_view(lease)

    def get_lease(self, lease_id) -> dict:
        lease = self.leases.get(lease_id)
        if lease is None or lease["status"] == "DELETED":
            raise ApiError(404, f"Object with {{'id': '{lease_id}'}} not found", "NotFound")
        return lease

    def update_lease(self, lease_id, body: dict) -> dict:
        with self.lock:
            lease = self.get_lease(lease_id)
            if "name" in body:
                lease["name"] = body["name"]
            if "end_date" in body:
                new_end = _parse_api_date(body["end_date"], "end_date")
                now = self.clock.now()
                if lease["status"] in ("TERMINATED", "ERROR"):
                    raise ApiError(400, f"Lease {lease_id} is {lease['status']} and cannot be updated", "InvalidStatus")
                if lease["status"] == "ACTIVE":
                    if lease["_end"] - now > EXTENSION_WINDOW_SECONDS:
                        raise ApiError(400, f"Lease can only be extended within {EXTENSION_WINDOW_SECONDS} seconds "
                                            f"of the lease end date ({_fmt(lease['_end'], API_DATE)})",
                                       "MaxLeaseUpdateWindowException")
                    if new_end - lease["_end"] > MAX_LEASE_SECONDS:
                        raise ApiError(400, f"Lease duration must not exceed {MAX_LEASE_SECONDS} seconds (7 days) "
                                            "from the current end date", "MaxLeaseDurationException")
                elif new_end - lease["_start"] > MAX_LEASE_SECONDS:
                    raise ApiError(400, f"Lease duration must not exceed {MAX_LEASE_SECONDS} seconds (7 days)",
                                   "MaxLeaseDurationException")
                if new_end <= max(now, lease["_start"]):
                    raise ApiError(400, "End date must be later than the current date and the start date", "InvalidInput")
                for r in lease["reservations"]:
                    for h in r.get("_hosts", []):
                        if self._busy(h, lease["_end"], new_end, ignore=lease_id):
                            raise ApiError(409, "Not enough hosts available: a reserved host is booked by another "
                                                "lease after the current end", "NotEnoughHostsAvailable")
                lease["_end"] = new_end
                self._event_time(lease, "end_lease", new_end)
            lease["updated_at"] = _fmt(self.clock.now(), "%Y-%m-%d %H:%M:%S")
        self.tick()
        return self.lease_view(lease)

    def _event_time(self, lease, etype, ts):
        for e in lease["events"]:
            if e["event_type"] == etype:
                e["time"] = _fmt(ts)

    def delete_lease(self, lease_id) -> None:
        with self.lock:
            lease = self.get_lease(lease_id)
            if lease["status"] in ("ACTIVE", "PENDING", "ERROR"):
                self._end_lease(lease, "TERMINATED")
            lease["status"] = "DELETED"

    def reservation(self, rid: str):
        for lease in self.leases.values():
            for r in lease["reservations"]:
                if r["id"] == rid:
                    return lease, r
        return None, None

    # -- Nova -------------------------------------------------------------------------------------

    def server_view(self, srv) -> dict:
        out = {k: copy.deepcopy(v) for k, v in srv.items() if not k.startswith("_")}
        out["OS-EXT-STS:vm_state"] = {"ACTIVE": "active", "BUILD": "building", "ERROR": "error"}.get(srv["status"], "deleted")
        out["OS-EXT-STS:task_state"] = "spawning" if srv["status"] == "BUILD" else None
        out["OS-EXT-STS:power_state"] = 1 if srv["status"] == "ACTIVE" else 0
        out["updated"] = _fmt(self.clock.now(), "%Y-%m-%dT%H:%M:%SZ")
        return out

    def create_servers(self, body: dict) -> dict:
        s = body.get("server") or {}
        hints = body.get("os:scheduler_hints") or body.get("OS-SCH-HNT:scheduler_hints") or {}
        for key in ("name", "flavorRef", "imageRef"):
            if not s.get(key):
                raise ApiError(400, f"Invalid input for field/attribute server. '{key}' is a required property", "BadRequest")
        if s["flavorRef"] not in ("baremetal", self.flavor["id"]):
            raise ApiError(400, f"Flavor {s['flavorRef']} could not be found.", "BadRequest")
        if not any(i["id"] == s["imageRef"] for i in self.images):
            raise ApiError(400, f"Image {s['imageRef']} could not be found.", "BadRequest")
        key_name = s.get("key_name")
        if key_name and key_name not in self.keypairs:
            raise ApiError(400, f"Invalid key_name provided.", "BadRequest")
        nets = s.get("networks") or []
        if nets and nets != "auto" and not all(n.get("uuid") in (self.sharednet["id"],) for n in nets):
            raise ApiError(400, "Network could not be found.", "BadRequest")
        count = int(s.get("min_count", 1))
        count = max(count, int(s.get("max_count", count)))
        ids = []
        with self.lock:
            lease, res = self.reservation(hints.get("reservation", ""))
            fault = None
            hosts: list[str] = []
            if res is None or lease is None:
                fault = "No valid host was found. There are not enough hosts available."
            elif lease["status"] != "ACTIVE":
                fault = f"No valid host was found. Reservation {res['id']} is not active."
            else:
                used = {x["_host"] for x in self.servers.values() if x["status"] not in ("DELETED",)}
                hosts = [h for h in res["_hosts"] if h not in used]
                if len(hosts) < count:
                    fault = "No valid host was found. There are not enough hosts available."
            if self.faults.get("server_error", 0) > 0:
                self.faults["server_error"] -= 1
                fault = "Failure prepping block device."
            for i in range(count):
                sid = _uuid()
                name = s["name"] if count == 1 else f"{s['name']}-{i + 1}"
                srv = {"id": sid, "name": name, "status": "BUILD", "addresses": {}, "key_name": key_name,
                       "flavor": {"id": self.flavor["id"], "original_name": "baremetal"}, "image": {"id": s["imageRef"]},
                       "metadata": s.get("metadata", {}), "tenant_id": self.project_id, "user_id": self.user_id,
                       "created": _fmt(self.clock.now(), "%Y-%m-%dT%H:%M:%SZ"), "hostId": "", "links": [],
                       "accessIPv4": "", "accessIPv6": "", "progress": 0, "config_drive": "",
                       "_host": hosts[i] if not fault else None, "_user_data": s.get("user_data"),
                       "_console": "", "_node": None, "_lease": lease["id"] if lease else None}
                if fault:
                    srv["status"] = "ERROR"
                    srv["fault"] = {"code": 500, "message": fault, "created": srv["created"]}
                self.servers[sid] = srv
                ids.append(sid)
        for sid in ids:
            if self.servers[sid]["status"] == "BUILD":
                threading.Thread(target=self._boot, args=(sid,), daemon=True).start()
        first = self.servers[ids[0]]
        return {"server": {"id": first["id"], "links": [], "OS-DCF:diskConfig": "MANUAL",
                           "security_groups": [{"name": "default"}], "adminPass": secrets.token_urlsafe(9)}}

    @staticmethod
    def _hostname(name: str) -> str:
        h = re.sub(r"[^a-z0-9-]+", "-", name.lower()).strip("-")[:40]
        return h or "server"

    def _boot(self, sid: str) -> None:
        srv = self.servers[sid]
        if self.boot_seconds:
            time.sleep(self.boot_seconds)  # simulated bare-metal deploy time
        try:
            pub = self.keypairs.get(srv["key_name"] or "", {}).get("public_key", "")
            hostname = self._hostname(srv["name"])
            if self.faults.get("ssh_never", 0) > 0:
                self.faults["ssh_never"] -= 1
                pub = ""
                srv["_no_ssh"] = True
            node = testbed.add_node(self.tb_name, hostname, pub + "\n" if pub else "")
            if srv.get("_no_ssh"):
                testbed.netns._kill_pids([node.sshd_pid])  # boots, but sshd never answers
            hostkey = (Path(node.dir) / "ssh_host_ed25519_key.pub").read_text().strip()
            console = ["[    0.000000] Linux version (appliance local cloud)",
                       f"cloud-init: hostname {hostname}",
                       "-----BEGIN SSH HOST KEY KEYS-----", hostkey, "-----END SSH HOST KEY KEYS-----"]
            ud = srv.get("_user_data")
            if ud and not srv.get("_no_ssh"):
                script = base64.b64decode(ud).decode(errors="replace")
                if script.startswith("#!"):
                    r = testbed.node_exec(self.tb_name, hostname, script)
                    console.append(f"cloud-init: user_data exited {r.returncode}")
                    (Path(node.dir) / "user_data.log").write_text(r.stdout + r.stderr)
            with self.lock:
                if srv["status"] == "DELETED":
                    testbed.remove_node(self.tb_name, hostname)
                    return
                srv["_node"] = hostname
                srv["_console"] = "\n".join(console) + "\n"
                mac = "fa:16:3e:%02x:%02x:%02x" % tuple(secrets.token_bytes(3))
                srv["addresses"] = {"sharednet1": [{"addr": node.ip, "version": 4, "OS-EXT-IPS:type": "fixed",
                                                    "OS-EXT-IPS-MAC:mac_addr": mac}]}
                srv["_port"] = {"id": _uuid(), "device_id": sid, "network_id": self.sharednet["id"],
                                "mac_address": mac, "status": "ACTIVE", "device_owner": "compute:nova",
                                "fixed_ips": [{"subnet_id": self.sharednet["subnets"][0], "ip_address": node.ip}]}
                srv["hostId"] = srv["_host"]
                srv["status"] = "ACTIVE"
                srv["progress"] = 100
        except Exception as e:  # a failed boot is a server in ERROR, as on Nova
            with self.lock:
                srv["status"] = "ERROR"
                srv["fault"] = {"code": 500, "message": f"boot failed: {e}", "created": srv["created"]}

    def get_server(self, sid) -> dict:
        srv = self.servers.get(sid)
        if srv is None or srv["status"] == "DELETED":
            raise ApiError(404, f"Instance {sid} could not be found.", "itemNotFound")
        return srv

    def _delete_server(self, srv) -> None:
        srv["status"] = "DELETED"
        for fip in self.fips.values():
            if srv.get("_port") and fip["port_id"] == srv["_port"]["id"]:
                self._disassociate(fip)
        if srv.get("_node"):
            testbed.remove_node(self.tb_name, srv["_node"])
            srv["_node"] = None

    # -- Neutron ----------------------------------------------------------------------------------

    def _new_fip(self, tags=()) -> dict:
        net = self.tb.host_ip.rsplit(".", 1)[0]
        addr = f"{net}.{self.fip_next}"
        self.fip_next += 1
        fip = {"id": _uuid(), "floating_ip_address": addr, "floating_network_id": self.public["id"],
               "port_id": None, "fixed_ip_address": None, "status": "DOWN", "tags": list(tags),
               "project_id": self.project_id, "tenant_id": self.project_id, "router_id": None,
               "description": "", "created_at": _fmt(self.clock.now(), "%Y-%m-%dT%H:%M:%SZ")}
        self.fips[fip["id"]] = fip
        return fip

    def _release_fip(self, fid) -> None:
        fip = self.fips.pop(fid, None)
        if fip:
            self._disassociate(fip)

    def _port(self, port_id):
        for srv in self.servers.values():
            if srv.get("_port") and srv["_port"]["id"] == port_id and srv["status"] != "DELETED":
                return srv
        return None

    def associate(self, fid: str, port_id: str | None) -> dict:
        with self.lock:
            fip = self.fips.get(fid)
            if fip is None:
                raise ApiError(404, f"Floating IP {fid} could not be found", "FloatingIPNotFound")
            if port_id is None:
                self._disassociate(fip)
                return fip
            srv = self._port(port_id)
            if srv is None:
                raise ApiError(404, f"Port {port_id} could not be found.", "PortNotFound")
            self._disassociate(fip)
            tb = testbed.load(self.tb_name)
            node = next(n for n in tb.nodes if n.name == srv["_node"])
            testbed.netns._run("ip", "-n", node.netns, "addr", "add", f"{fip['floating_ip_address']}/32", "dev", "eth0")
            fip.update(port_id=port_id, fixed_ip_address=srv["_port"]["fixed_ips"][0]["ip_address"], status="ACTIVE",
                       _netns=node.netns)
            srv["addresses"]["sharednet1"].append({"addr": fip["floating_ip_address"], "version": 4,
                                                   "OS-EXT-IPS:type": "floating",
                                                   "OS-EXT-IPS-MAC:mac_addr": srv["_port"]["mac_address"]})
            return fip

    def _disassociate(self, fip) -> None:
        if fip.get("_netns"):
            testbed.netns._run("ip", "-n", fip["_netns"], "addr", "del", f"{fip['floating_ip_address']}/32",
                               "dev", "eth0", check=False)
        for srv in self.servers.values():
            if srv.get("_port") and srv["_port"]["id"] == fip.get("port_id"):
                srv["addresses"]["sharednet1"] = [a for a in srv["addresses"]["sharednet1"]
                                                  if a["addr"] != fip["floating_ip_address"]]
        fip.update(port_id=None, fixed_ip_address=None, status="DOWN", _netns=None)

    def shutdown(self) -> None:
        with self.lock:
            for srv in list(self.servers.values()):
                if srv["status"] != "DELETED":
                    self._delete_server(srv)
        testbed.down(self.tb_name, log=lambda m: None)


def _versions(vid: str, href: str) -> dict:
    """A service's unversioned root: the version document keystoneauth's discovery reads."""
    return {"versions": [{"id": vid, "status": "CURRENT", "links": [{"rel": "self", "href": href}]}]}


def _public(d: dict) -> dict:
    return {k: v for k, v in d.items() if not k.startswith("_")}


# ---------------------------------------------------------------------------------------------
# HTTP


class Handler(BaseHTTPRequestHandler):
    server_version = "appliance-localcloud/1"
    protocol_version = "HTTP/1.1"
    cloud: Cloud

    def log_message(self, fmt, *args):  # quiet; the request log is in /_admin/requests
        pass

    def date_time_string(self, timestamp=None):
        return email.utils.formatdate(self.cloud.clock.now(), usegmt=True)

    def _send(self, code: int, body=None, headers: dict | None = None) -> None:
        data = b"" if body is None else json.dumps(body).encode()
        self.send_response(code)
        if body is not None:
            self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.send_header("x-openstack-request-id", "req-" + _uuid())
        for k, v in (headers or {}).items():
            self.send_header(k, v)
        self.end_headers()
        if data and self.command != "HEAD":
            self.wfile.write(data)

    def _body(self):
        n = int(self.headers.get("Content-Length") or 0)
        raw = self.rfile.read(n) if n else b""
        if not raw:
            return {}
        try:
            return json.loads(raw)
        except ValueError:
            raise ApiError(400, "Malformed JSON in request body", "BadRequest") from None

    def _auth(self) -> None:
        tok = self.headers.get("X-Auth-Token")
        exp = self.cloud.tokens.get(tok or "")
        if not exp or exp < time.time():
            raise ApiError(401, "The request you have made requires authentication.", "Unauthorized")

    def _dispatch(self):
        url = urlparse(self.path)
        path = url.path.rstrip("/") or "/"
        query = {k: v[0] for k, v in parse_qs(url.query).items()}
        raw_upload = self.command == "PUT" and path.startswith("/image/") and path.endswith("/file")
        body = self._body() if self.command in ("POST", "PUT", "PATCH") and not raw_upload else None
        self.cloud.requests.append({"method": self.command, "path": url.path, "query": query, "body": body})
        self.cloud.tick()
        base = f"http://{self.headers.get('Host')}"
        service = path.split("/")[1] if path != "/" else ""
        route = {"identity": self._keystone, "reservation": self._blazar, "compute": self._nova,
                 "network": self._neutron, "image": self._glance, "orchestration": self._heat,
                 "_admin": self._admin}.get(service)
        if route is None:
            raise ApiError(404, f"no such service: {path}", "NotFound")
        return route(path[len(service) + 1:] or "/", query, body, base)

    def _handle(self):
        try:
            result = self._dispatch()
            code, body = result[0], result[1]
            headers = result[2] if len(result) > 2 else None
            self._send(code, body, headers)
        except ApiError as e:
            svc = self.path.split("/")[1]
            if svc == "reservation":
                body = {"error_code": e.code, "error_message": e.message, "error_name": e.name or "BlazarException"}
            elif svc == "identity":
                body = {"error": {"code": e.code, "message": e.message, "title": e.name or "Error"}}
            elif svc == "network":
                body = {"NeutronError": {"type": e.name or "NeutronError", "message": e.message, "detail": ""}}
            else:
                key = {400: "badRequest", 401: "unauthorized", 404: "itemNotFound", 409: "conflict"}.get(e.code, "error")
                body = {key: {"code": e.code, "message": e.message}}
            self._send(e.code, body)
        except Exception as e:  # pragma: no cover - a bug in the simulator
            traceback.print_exc()
            self._send(500, {"error": {"code": 500, "message": str(e)}})

    do_GET = do_POST = do_PUT = do_DELETE = do_PATCH = do_HEAD = _handle

    # -- Keystone ---------------------------------------------------------------------------------

    def _catalog(self, base):
        def svc(stype, name, url):
            return {"type": stype, "name": name, "id": _uuid(), "endpoints": [
                {"id": _uuid(), "interface": i, "region": REGION, "region_id": REGION, "url": url}
                for i in ("public", "internal")]}

        cat = [svc("identity", "keystone", f"{base}/identity/v3"),
               svc("reservation", "blazar", f"{base}/reservation/v1"),
               svc("compute", "nova", f"{base}/compute/v2.1"),
               svc("network", "neutron", f"{base}/network"),
               svc("image", "glance", f"{base}/image"),
               svc("orchestration", "heat", f"{base}/orchestration/v1/{self.cloud.project_id}")]
        extra = self.cloud.dir / "catalog-extra.json"
        if extra.exists():
            for e in json.loads(extra.read_text()):
                cat.append(svc(e["type"], e["name"], e["url"]))
        return cat

    def _keystone(self, path, query, body, base):
        version = {"id": "v3.14", "status": "stable", "updated": "2020-04-07T00:00:00Z",
                   "links": [{"rel": "self", "href": f"{base}/identity/v3/"}],
                   "media-types": [{"base": "application/json", "type": "application/vnd.openstack.identity-v3+json"}]}
        if path == "/" and self.command == "GET":
            return 300, {"versions": {"values": [version]}}
        if path == "/v3" and self.command == "GET":
            return 200, {"version": version}
        if path == "/v3/auth/tokens" and self.command == "POST":
            ident = ((body or {}).get("auth") or {}).get("identity") or {}
            creds = self.cloud.creds
            ok = False
            methods = ident.get("methods") or []
            if "password" in methods:
                user = (ident.get("password") or {}).get("user") or {}
                ok = (user.get("name") == creds["username"] or user.get("id") == creds["user_id"]) and \
                    user.get("password") == creds["password"]
            elif "application_credential" in methods:
                ac = ident.get("application_credential") or {}
                ok = (ac.get("id") == creds["app_cred_id"] or ac.get("name") == creds["app_cred_name"]) and \
                    ac.get("secret") == creds["app_cred_secret"]
            if not ok:
                raise ApiError(401, "The request you have made requires authentication.", "Unauthorized")
            tok = "gAAAA" + secrets.token_urlsafe(32)
            self.cloud.tokens[tok] = time.time() + 3600
            now = dt.datetime.now(dt.timezone.utc)
            token = {"methods": methods, "expires_at": (now + dt.timedelta(hours=1)).strftime("%Y-%m-%dT%H:%M:%S.000000Z"),
                     "issued_at": now.strftime("%Y-%m-%dT%H:%M:%S.000000Z"),
                     "user": {"id": creds["user_id"], "name": creds["username"],
                              "domain": {"id": "default", "name": "Default"}, "password_expires_at": None},
                     "project": {"id": creds["project_id"], "name": creds["project_name"],
                                 "domain": {"id": "default", "name": "Default"}},
                     "roles": [{"id": _uuid(), "name": "member"}], "catalog": self._catalog(base),
                     "audit_ids": [secrets.token_urlsafe(8)], "is_domain": False}
            if "application_credential" in methods:
                token["application_credential"] = {"id": creds["app_cred_id"], "name": creds["app_cred_name"],
                                                   "restricted": False}
            return 201, {"token": token}, {"X-Subject-Token": tok}
        if path == "/v3/auth/tokens" and self.command in ("GET", "HEAD"):
            self._auth()
            return 200, {}
        raise ApiError(404, f"not found: {path}", "NotFound")

    # -- Blazar -----------------------------------------------------------------------------------

    def _blazar(self, path, query, body, base):
        if path == "/":
            return 300, _versions("v1.0", f"{base}/reservation/v1/")
        self._auth()
        c = self.cloud
        m = re.fullmatch(r"/v1/leases(?:/([^/]+))?", path)
        if m:
            lid = m.group(1)
            if lid is None and self.command == "GET":
                return 200, {"leases": [c.lease_view(x) for x in c.leases.values() if x["status"] != "DELETED"]}
            if lid is None and self.command == "POST":
                return 201, {"lease": c.create_lease(body or {})}
            if lid and self.command == "GET":
                return 200, {"lease": c.lease_view(c.get_lease(lid))}
            if lid and self.command == "PUT":
                return 200, {"lease": c.update_lease(lid, body or {})}
            if lid and self.command == "DELETE":
                c.delete_lease(lid)
                return 204, None
        if path == "/v1/os-hosts" and self.command == "GET":
            return 200, {"hosts": [{"id": h["id"], "hypervisor_hostname": h["hypervisor_hostname"],
                                    **h["capabilities"]} for h in c.hosts]}
        raise ApiError(404, f"not found: {path}", "NotFound")

    # -- Nova -------------------------------------------------------------------------------------

    def _nova(self, path, query, body, base):
        version = {"id": "v2.1", "status": "CURRENT", "version": "2.79", "min_version": "2.1",
                   "updated": "2013-07-23T11:33:21Z", "links": [{"rel": "self", "href": f"{base}/compute/v2.1/"}]}
        if path == "/":
            return 200, {"versions": [version]}
        if path == "/v2.1" and self.command == "GET":
            return 200, {"version": version}
        self._auth()
        c = self.cloud
        p = path[len("/v2.1"):] if path.startswith("/v2.1") else path
        p = re.sub(r"^/[0-9a-f]{32}(?=/|$)", "", p)  # a project id in the path (old style)
        if p in ("/flavors", "/flavors/detail"):
            return 200, {"flavors": [c.flavor]}
        m = re.fullmatch(r"/flavors/([^/]+)", p)
        if m:
            if m.group(1) not in (c.flavor["id"], c.flavor["name"]):
                raise ApiError(404, f"Flavor {m.group(1)} could not be found.", "itemNotFound")
            return 200, {"flavor": c.flavor}
        if p == "/os-keypairs":
            if self.command == "GET":
                return 200, {"keypairs": [{"keypair": _public(k)} for k in c.keypairs.values()]}
            kp = (body or {}).get("keypair") or {}
            name = kp.get("name", "")
            if not re.fullmatch(r"[A-Za-z0-9_. -]{1,255}", name or ""):
                raise ApiError(400, "Keypair data is invalid: name", "BadRequest")
            if name in c.keypairs:
                raise ApiError(409, f"Key pair '{name}' already exists.", "conflict")
            if not kp.get("public_key"):
                raise ApiError(400, "Generating key pairs is not supported here: give public_key", "BadRequest")
            rec = {"name": name, "public_key": kp["public_key"].strip(), "fingerprint": "", "type": "ssh",
                   "user_id": c.user_id}
            c.keypairs[name] = rec
            return 200, {"keypair": rec}
        m = re.fullmatch(r"/os-keypairs/([^/]+)", p)
        if m:
            name = m.group(1)
            if name not in c.keypairs:
                raise ApiError(404, f"Keypair {name} not found", "itemNotFound")
            if self.command == "DELETE":
                del c.keypairs[name]
                return 202, None
            return 200, {"keypair": c.keypairs[name]}
        if p == "/servers" and self.command == "POST":
            return 202, c.create_servers(body or {})
        if p in ("/servers", "/servers/detail") and self.command == "GET":
            out = [c.server_view(s) for s in c.servers.values() if s["status"] != "DELETED"]
            if "name" in query:
                out = [s for s in out if re.search(query["name"], s["name"])]
            if p == "/servers":
                out = [{"id": s["id"], "name": s["name"], "links": []} for s in out]
            return 200, {"servers": out}
        m = re.fullmatch(r"/servers/([^/]+)", p)
        if m:
            srv = c.get_server(m.group(1))
            if self.command == "DELETE":
                with c.lock:
                    c._delete_server(srv)
                return 204, None
            return 200, {"server": c.server_view(srv)}
        m = re.fullmatch(r"/servers/([^/]+)/action", p)
        if m and self.command == "POST":
            srv = c.get_server(m.group(1))
            if "os-getConsoleOutput" in (body or {}):
                return 200, {"output": srv["_console"]}
            raise ApiError(400, "unsupported action", "BadRequest")
        m = re.fullmatch(r"/servers/([^/]+)/os-interface", p)
        if m:
            srv = c.get_server(m.group(1))
            ports = [srv["_port"]] if srv.get("_port") else []
            return 200, {"interfaceAttachments": [{"port_id": x["id"], "net_id": x["network_id"], "mac_addr":
                                                   x["mac_address"], "port_state": "ACTIVE",
                                                   "fixed_ips": x["fixed_ips"]} for x in ports]}
        raise ApiError(404, f"not found: {path}", "itemNotFound")

    # -- Neutron ----------------------------------------------------------------------------------

    def _neutron(self, path, query, body, base):
        if path == "/":
            return 200, _versions("v2.0", f"{base}/network/v2.0/")
        self._auth()
        c = self.cloud
        p = path[len("/v2.0"):] if path.startswith("/v2.0") else path
        p = re.sub(r"\.json$", "", p)
        if p == "/networks":
            nets = [c.sharednet, c.public]
            for k in ("name", "id"):
                if k in query:
                    nets = [n for n in nets if n[k] == query[k]]
            if "router:external" in query:
                nets = [n for n in nets if str(n["router:external"]).lower() == query["router:external"].lower()]
            return 200, {"networks": nets}
        m = re.fullmatch(r"/networks/([^/]+)", p)
        if m:
            for n in (c.sharednet, c.public):
                if n["id"] == m.group(1):
                    return 200, {"network": n}
            raise ApiError(404, f"Network {m.group(1)} could not be found.", "NetworkNotFound")
        if p == "/ports":
            ports = [s["_port"] for s in c.servers.values() if s.get("_port") and s["status"] != "DELETED"]
            if "device_id" in query:
                ports = [x for x in ports if x["device_id"] == query["device_id"]]
            return 200, {"ports": ports}
        if p == "/floatingips":
            if self.command == "POST":
                f = (body or {}).get("floatingip") or {}
                if f.get("floating_network_id") != c.public["id"]:
                    raise ApiError(400, "floating_network_id must be the external network", "BadRequest")
                with c.lock:
                    fip = c._new_fip()
                    if f.get("port_id"):
                        c.associate(fip["id"], f["port_id"])
                return 201, {"floatingip": _public(fip)}
            fips = [_public(f) for f in c.fips.values()]
            for k in ("floating_ip_address", "port_id", "id", "floating_network_id"):
                if k in query:
                    fips = [f for f in fips if str(f[k]) == query[k]]
            if "tags" in query:
                want = set(query["tags"].split(","))
                fips = [f for f in fips if want <= set(f["tags"])]
            return 200, {"floatingips": fips}
        m = re.fullmatch(r"/floatingips/([^/]+)", p)
        if m:
            fid = m.group(1)
            if fid not in c.fips:
                raise ApiError(404, f"Floating IP {fid} could not be found", "FloatingIPNotFound")
            if self.command == "PUT":
                f = (body or {}).get("floatingip") or {}
                return 200, {"floatingip": _public(c.associate(fid, f.get("port_id")))}
            if self.command == "DELETE":
                if any(t == "blazar" for t in c.fips[fid]["tags"]):
                    raise ApiError(409, "A reserved floating IP is released by its lease", "Conflict")
                with c.lock:
                    c._release_fip(fid)
                return 204, None
            return 200, {"floatingip": _public(c.fips[fid])}
        raise ApiError(404, f"not found: {path}", "NotFound")

    # -- Heat -------------------------------------------------------------------------------------

    def _heat(self, path, query, body, base):
        from .heat import HeatError

        self._auth()
        c = self.cloud
        m = re.fullmatch(r"/v1/([0-9a-f]+)(/.*)?", path)
        if not m:
            return 300, {"versions": [{"id": "v1.0", "status": "CURRENT",
                                       "links": [{"href": f"{base}/orchestration/v1/", "rel": "self"}]}]}
        p, hbase = m.group(2) or "/", f"{base}/orchestration/v1/{m.group(1)}"
        try:
            if p == "/stacks" and self.command == "POST":
                st = c.heat.create(body or {}, hbase)
                return 201, {"stack": {"id": st.id, "links": [{"href": f"{hbase}/stacks/{st.name}/{st.id}",
                                                                "rel": "self"}]}}
            if p == "/stacks" and self.command == "GET":
                return 200, {"stacks": [{k: v for k, v in s.view(hbase).items() if k not in ("outputs", "parameters")}
                                        for s in c.heat.stacks.values() if s.status != "DELETE_COMPLETE"]}
            m2 = re.fullmatch(r"/stacks/([^/]+)(?:/([^/]+))?(/outputs)?", p)
            if m2:
                st = c.heat.find(m2.group(2) or m2.group(1))
                if self.command == "DELETE":
                    c.heat.delete(st)
                    return 204, None
                if m2.group(3):
                    return 200, {"outputs": [{"output_key": o["output_key"], "description": o["description"]}
                                             for o in st.outputs]}
                return 200, {"stack": st.view(hbase)}
        except HeatError as e:
            return e.code, {"code": e.code, "title": e.title, "explanation": e.message,
                            "error": {"message": e.message, "type": "StackValidationFailed", "traceback": None}}
        raise ApiError(404, f"not found: {path}", "NotFound")

    # -- Glance -----------------------------------------------------------------------------------

    def _glance(self, path, query, body, base):
        if path == "/":
            return 300, _versions("v2.15", f"{base}/image/v2/")
        self._auth()
        imgs = self.cloud.images
        if path == "/v2/images" and self.command == "POST":  # create: queued until its data is uploaded
            b = dict(body or {})
            if not b.get("name"):
                raise ApiError(400, "an image needs a name", "BadRequest")
            if b.get("disk_format") not in (None, "qcow2", "raw", "vmdk", "vdi", "iso", "ami", "ari", "aki"):
                raise ApiError(400, f"Invalid disk format '{b.get('disk_format')}'", "BadRequest")
            now = _fmt(self.cloud.clock.now(), "%Y-%m-%dT%H:%M:%SZ")
            img = {**b, "id": b.get("id") or _uuid(), "status": "queued", "visibility": b.get("visibility", "shared"),
                   "size": None, "checksum": None, "os_hash_algo": None, "os_hash_value": None, "tags": b.get("tags", []),
                   "created_at": now, "updated_at": now, "min_disk": 0, "min_ram": 0, "owner": self.cloud.project_id,
                   "protected": False, "file": None}
            img["file"] = f"/v2/images/{img['id']}/file"
            imgs.append(img)
            return 201, img
        if path == "/v2/images":
            if "name" in query:
                imgs = [i for i in imgs if i["name"] == query["name"]]
            return 200, {"images": imgs, "first": "/v2/images", "schema": "/v2/schemas/images"}
        m = re.fullmatch(r"/v2/images/([^/]+)(/file)?", path)
        if m:
            img = next((i for i in imgs if i["id"] == m.group(1)), None)
            if img is None:
                raise ApiError(404, f"No image found with ID {m.group(1)}", "NotFound")
            if m.group(2) and self.command == "PUT":
                return self._glance_upload(img)
            if self.command == "DELETE" and not m.group(2):
                imgs.remove(img)
                (self.cloud.dir / "images" / img["id"]).unlink(missing_ok=True)
                return 204, None
            if self.command == "GET" and not m.group(2):
                return 200, img
        raise ApiError(404, f"not found: {path}", "NotFound")

    def _upload_chunks(self):
        if "chunked" in (self.headers.get("Transfer-Encoding") or "").lower():
            while True:
                size = int(self.rfile.readline().split(b";")[0].strip() or b"0", 16)
                if size == 0:
                    self.rfile.readline()
                    return
                yield self.rfile.read(size)
                self.rfile.readline()
        left = int(self.headers.get("Content-Length") or 0)
        while left > 0:
            chunk = self.rfile.read(min(left, 1 << 20))
            if not chunk:
                raise ApiError(400, "the image data ended early", "BadRequest")
            left -= len(chunk)
            yield chunk

    def _glance_upload(self, img):
        """PUT /v2/images/ID/file: store the data, then the image is active with Glance's checksums."""
        import hashlib

        if img["status"] != "queued":
            raise ApiError(409, f"Image status transition from {img['status']} to saving is not allowed", "Conflict")
        d = self.cloud.dir / "images"
        d.mkdir(parents=True, exist_ok=True)
        md5, sha512, size = hashlib.md5(), hashlib.sha512(), 0
        tmp = d / f".{img['id']}.part"
        with open(tmp, "wb") as fh:
            for chunk in self._upload_chunks():
                fh.write(chunk)
                md5.update(chunk)
                sha512.update(chunk)
                size += len(chunk)
        tmp.replace(d / img["id"])
        img.update({"status": "active", "size": size, "checksum": md5.hexdigest(), "os_hash_algo": "sha512",
                    "os_hash_value": sha512.hexdigest(),
                    "updated_at": _fmt(self.cloud.clock.now(), "%Y-%m-%dT%H:%M:%SZ")})
        return 204, None

    # -- admin (tests and demos) --------------------------------------------------------------------

    def _admin(self, path, query, body, base):
        c = self.cloud
        if path == "/advance" and self.command == "POST":
            c.clock.advance(float((body or {}).get("seconds", 0)))
            c.tick()
            return 200, {"now": _fmt(c.clock.now())}
        if path == "/faults" and self.command == "POST":
            c.faults.update({k: int(v) for k, v in (body or {}).items()})
            return 200, c.faults
        if path == "/requests":
            if self.command == "DELETE":
                c.requests.clear()
                return 204, None
            return 200, {"requests": c.requests}
        if path == "/clock":
            return 200, {"now": _fmt(c.clock.now()), "time_scale": c.clock.scale}
        if path == "/health":
            return 200, {"ok": True}
        raise ApiError(404, f"not found: {path}", "NotFound")


def serve(state_dir: Path, port: int, time_scale: float, boot_seconds: float, testbed_name: str) -> None:
    httpd = ThreadingHTTPServer(("127.0.0.1", port), Handler)
    base = f"http://127.0.0.1:{httpd.server_address[1]}"
    cloud = Cloud(state_dir, time_scale=time_scale, boot_seconds=boot_seconds, base_url=base,
                  testbed_name=testbed_name)
    Handler.cloud = cloud
    stop = threading.Event()

    def on_term(*_):
        stop.set()
        threading.Thread(target=httpd.shutdown, daemon=True).start()

    signal.signal(signal.SIGTERM, on_term)
    signal.signal(signal.SIGINT, on_term)

    def engine():
        while not stop.wait(0.2):
            cloud.tick()

    threading.Thread(target=engine, daemon=True).start()
    (state_dir / "endpoint").write_text(base)
    try:
        httpd.serve_forever(poll_interval=0.2)
    finally:
        cloud.shutdown()
        (state_dir / "endpoint").unlink(missing_ok=True)


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description="appliance local cloud server")
    ap.add_argument("--state", required=True)
    ap.add_argument("--port", type=int, default=0)
    ap.add_argument("--time-scale", type=float, default=1.0)
    ap.add_argument("--boot-seconds", type=float, default=0.0)
    ap.add_argument("--testbed", default="cloud", help="name of the testbed its servers live on")
    a = ap.parse_args(argv)
    serve(Path(a.state), a.port, a.time_scale, a.boot_seconds, a.testbed)


if __name__ == "__main__":
    main(sys.argv[1:])
