"""The local cloud's state and the operations its services share: leases (Blazar), servers (Nova), floating IPs
(Neutron), images (Glance), key pairs, tokens, the clock, and the engine that moves leases through their life.
The HTTP side is one module per service (keystone, blazar, nova, neutron, glance, orchestration, admin_hooks); servers
run on a node backend (nodes.py). See server.py for what is simulated and where each behaviour comes from.
"""

from __future__ import annotations

import base64
import copy
import datetime as dt
import json
import re
import secrets
import threading
import time
import uuid
from pathlib import Path

from .metadata import MetadataService
from .nodes import NodeBackend, TestbedNodes

MAX_LEASE_SECONDS = 7 * 86400
EXTENSION_WINDOW_SECONDS = 48 * 3600
API_DATE = "%Y-%m-%d %H:%M"
ISO = "%Y-%m-%dT%H:%M:%S.%f"
REGION = "CHI@local"
DEFAULT_POOLS = {"compute_local": 4, "gpu_local": 2}
# every image here stands for a CC image, whose cloud-init makes the default user cc (uid 1000, passwordless sudo)
# and puts the key pair there, root's keys behind a "Please login as the user cc" command (ChameleonCloud/CC-Images
# elements/cc-common/static/etc/cloud/cloud.cfg.d/92_chi_default_user.cfg; cloudinit/config/cc_ssh.py)
IMAGE_USER = "cc"


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

    def reset(self) -> None:
        """Back on this machine's clock (a demo that jumped ahead puts it back when its leases are gone)."""
        with self.lock:
            self.real0 = self.virt0 = time.time()
            self.offset = 0.0


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
                 boot_seconds: float = 0.0, base_url: str = "", testbed_name: str = "cloud",
                 nodes: NodeBackend | None = None):
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
        self.token_info: dict[str, dict] = {}  # token -> the application credential it came from (if any)
        self.app_creds: dict[str, dict] = {}  # made through Keystone's API (the cloud's own is in creds)
        self.ec2_creds: dict[str, dict] = {}  # access key -> EC2 credential (Keystone OS-EC2)
        self.token_bodies: dict[str, dict] = {}  # token -> what Keystone answers when a service validates it
        self.token_lifetime: float | None = None  # seconds (keystone.token_seconds)
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
                        "owner": self.project_id, "protected": False, "checksum": None, "os_hash_algo": None,
                        "os_hash_value": None, "updated_at": _fmt(self.clock.now(), "%Y-%m-%dT%H:%M:%SZ")}
                       for name in ("appliance-cpu", "CC-Ubuntu22.04", "CC-Ubuntu22.04-CUDA")]
        self.faults: dict[str, int] = {}
        self.requests: list[dict] = []
        self.nodes: NodeBackend = nodes or TestbedNodes(testbed_name)
        sock = self.nodes.metadata_socket()
        self.metadata = MetadataService(self, sock) if sock is not None else None
        self.fip_next = 200
        from .heat import Heat

        self.heat = Heat(self, _uuid)

    def token_valid(self, tok: str | None) -> bool:
        exp = self.tokens.get(tok or "")
        return bool(exp) and exp >= time.time()

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
        # No check on the name: Blazar dropped its unique constraint on leases.name (ChameleonCloud/blazar
        # blazar/db/migration/alembic_migrations/versions/6bfd1c23aa18_allow_duplicate_lease_names.py), so two leases
        # may share a name (LeaseNameAlreadyExists, manager/service.py, is left for a duplicate the DB would refuse)
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
            # a host failed: Blazar's monitor updates the reservation's flags and marks the lease degraded, for a
            # failed reallocation (missing_resources) and a successful one (resources_changed) alike, and never
            # clears it (ChameleonCloud/blazar blazar/monitor/base.py `_update_flags`,
            # blazar/plugins/oshosts/host_plugin.py `heal_reservations`)
            for fault, flag in (("lease_degraded", "missing_resources"), ("lease_reallocated", "resources_changed")):
                if self.faults.get(fault, 0) > 0:
                    self.faults[fault] -= 1
                    lease["degraded"] = True
                    reservations[0][flag] = True
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
                       "_node": None, "_lease": lease["id"] if lease else None}
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
            node = self.nodes.add(hostname, pub + "\n" if pub else "", user=IMAGE_USER)
            srv["_ip"] = node.ip  # the metadata service finds the server by it, as Neutron's proxy does
            ud = srv.get("_user_data")
            if ud:
                # cloud-init's scripts-user runs a user_data script once, late in the boot (after the SSH host
                # keys exist and the network is up); its output goes to the node's log, not to the API:
                # bare-metal servers have no console log (see nova.py `action`)
                script = base64.b64decode(ud).decode(errors="replace")
                if script.startswith("#!"):
                    r = self.nodes.run(hostname, script)
                    (Path(node.dir) / "user_data.log").write_text(f"{r.stdout}{r.stderr}exit {r.returncode}\n")
            if srv.get("_no_ssh"):
                self.nodes.stop_sshd(node)  # booted (cloud-init ran), but sshd never answers
            with self.lock:
                if srv["status"] == "DELETED":
                    self.nodes.remove(hostname)
                    return
                srv["_node"] = hostname
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
            self.nodes.remove(srv["_node"])
            srv["_node"] = None

    # -- Neutron ----------------------------------------------------------------------------------

    def _new_fip(self, tags=()) -> dict:
        net = self.nodes.host_ip.rsplit(".", 1)[0]
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
            netns = self.nodes.netns_of(srv["_node"])
            self.nodes.address(netns, fip["floating_ip_address"], add=True)
            fip.update(port_id=port_id, fixed_ip_address=srv["_port"]["fixed_ips"][0]["ip_address"], status="ACTIVE",
                       _netns=netns)
            srv["addresses"]["sharednet1"].append({"addr": fip["floating_ip_address"], "version": 4,
                                                   "OS-EXT-IPS:type": "floating",
                                                   "OS-EXT-IPS-MAC:mac_addr": srv["_port"]["mac_address"]})
            return fip

    def _disassociate(self, fip) -> None:
        if fip.get("_netns"):
            self.nodes.address(fip["_netns"], fip["floating_ip_address"], add=False)
        for srv in self.servers.values():
            if srv.get("_port") and srv["_port"]["id"] == fip.get("port_id"):
                srv["addresses"]["sharednet1"] = [a for a in srv["addresses"]["sharednet1"]
                                                  if a["addr"] != fip["floating_ip_address"]]
        fip.update(port_id=None, fixed_ip_address=None, status="DOWN", _netns=None)

    def server_by_fixed_ip(self, ip: str) -> dict | None:
        with self.lock:
            return next((x for x in self.servers.values() if x.get("_ip") == ip and x["status"] != "DELETED"), None)

    def shutdown(self) -> None:
        if self.metadata is not None:
            self.metadata.close()
        with self.lock:
            for srv in list(self.servers.values()):
                if srv["status"] != "DELETED":
                    self._delete_server(srv)
        self.nodes.shutdown()
