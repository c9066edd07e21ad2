"""The local cloud's state and the operations its services share: leases (Blazar), servers (Nova), floating IPs
(Neutron), images (Glance), key pairs, tokens, the clock, and the engine that moves leases through their life.
The HTTP side is one module per service (keystone, blazar, nova, neutron, glance, orchestration, admin_hooks); servers
run on a node backend (nodes.py). See server.py for what is simulated and where each behaviour comes from.
"""

from __future__ import annotations

import base64
import collections
import datetime as dt
import json
import re
import secrets
import threading
import time
import uuid
from pathlib import Path

from .clock import Clock
from .metadata import MetadataService
from .nodes import NodeBackend, TestbedNodes
from .requirements import parse_requirements
from .state import (STAMP, ApiError, AppCred, Ec2Cred, FipReservation, FloatingIp, Host, HostReservation, Image, Keypair,
                    Lease, LeaseEvent, Network, Port, Server, Token, fmt)

MAX_LEASE_SECONDS = 7 * 86400
EXTENSION_WINDOW_SECONDS = 48 * 3600
API_DATE = "%Y-%m-%d %H:%M"
REQUEST_LOG = 2000  # requests the admin API keeps for tests (a bound: the cloud may run for days)
SECRET_KEYS = {"password", "secret", "secret_key", "token", "user_data_secret"}  # redacted in the request log


def redacted(body):
    """A request body for the log: every value under a secret's key replaced (Keystone passwords, application
    credential secrets, EC2 secret keys), the rest as sent."""
    if isinstance(body, dict):
        return {k: "***" if k in SECRET_KEYS and v and not isinstance(v, (dict, list)) else redacted(v)
                for k, v in body.items()}
    if isinstance(body, list):
        return [redacted(v) for v in body]
    return body
REGION = "CHI@local"
DEFAULT_POOLS = {"compute_local": 4, "gpu_local": 2}
# a served cloud's cleaning time (real seconds, as its boot): Chameleon's cleanings take minutes, its boots 10-20;
# here a boot takes ~1 s, and a node is cleaned for twice that
CLEAN_SECONDS = 2.0
# every image here stands for a CC image, whose cloud-init makes the default user cc (uid 1000, passwordless sudo)
# and puts the key pair there, root's keys behind a "Please login as the user cc" command (ChameleonCloud/CC-Images
# elements/cc-common/static/etc/cloud/cloud.cfg.d/92_chi_default_user.cfg; cloudinit/config/cc_ssh.py)
IMAGE_USER = "cc"


def _uuid() -> str:
    return str(uuid.uuid4())


_fmt = fmt


def _parse_api_date(value, field: str) -> float:
    try:
        return dt.datetime.strptime(value, API_DATE).replace(tzinfo=dt.timezone.utc).timestamp()
    except (TypeError, ValueError):
        raise ApiError(400, f"{field} {value!r} must be in format '{API_DATE}' (UTC)", "InvalidDate") from None


# ---------------------------------------------------------------------------------------------
# the cloud's state


class Cloud:
    def __init__(self, state_dir: Path, *, time_scale: float = 1.0, pools: dict[str, int] | None = None,
                 boot_seconds: float = 0.0, base_url: str = "", testbed_name: str = "cloud",
                 nodes: NodeBackend | None = None, region: str = REGION, clock: Path | None = None,
                 clean_seconds: float = 0.0, su_budget: float | None = None):
        self.dir = state_dir
        self.tb_name = testbed_name
        self.region = region  # the site's name: its catalog's region, its nodes' vendordata
        self.clock = Clock(time_scale, clock)
        self.boot_seconds = boot_seconds
        # Ironic cleans a bare-metal node after its server's delete, and until it is AVAILABLE again Nova cannot
        # schedule onto it (openstack/nova nova/virt/ironic/driver.py: `_unprovision` returns once the node is
        # CLEANING, `_node_resources_unavailable` for any state but AVAILABLE): real seconds, like the boot
        self.clean_seconds = clean_seconds
        self.cleaning: dict[str, float] = {}  # host id -> time.monotonic() its cleaning ends
        # a bare-metal node's disks have a size (Chameleon's flavor says 240 GB; a node's is its Ironic node's
        # `local_gb` property, openstack/ironic doc/source/install/enrollment.rst), and a write past it fails.
        # Nodes here share the host's disk; for tests, a node can get a data disk of this many bytes at the
        # dataset's default place (testbed.netns DATA_DIR): None, no such disk
        self.data_disk: int | None = None
        self.base_url = base_url
        self.lock = threading.RLock()
        self._terminating: list[threading.Thread] = []  # the deletes' teardowns (Nova's terminate_instance casts)
        self.creds = json.loads((state_dir / "credentials.json").read_text())
        self.project_id = self.creds["project_id"]
        self.user_id = self.creds["user_id"]
        # Keystone
        self.tokens: dict[str, Token] = {}
        self.app_creds: dict[str, AppCred] = {}  # made through Keystone's API (the cloud's own is in creds)
        self.ec2_creds: dict[str, Ec2Cred] = {}  # by access key (Keystone OS-EC2)
        self.token_lifetime: float | None = None  # seconds (keystone.token_seconds)
        # Blazar
        self.hosts: list[Host] = []
        for node_type, n in (pools or DEFAULT_POOLS).items():
            for i in range(1, n + 1):
                name = f"{node_type}-{i:02d}"
                self.hosts.append(Host(str(len(self.hosts) + 1), name, node_type,
                                       {"node_type": node_type, "node_name": name}))
        self.leases: dict[str, Lease] = {}
        # Nova
        self.servers: dict[str, Server] = {}
        self.keypairs: dict[str, Keypair] = {}
        self.flavor = {"id": "baremetal", "name": "baremetal", "ram": 196608, "vcpus": 48, "disk": 240,
                       "OS-FLV-EXT-DATA:ephemeral": 0, "swap": 0, "rxtx_factor": 1.0, "is_public": True,
                       "os-flavor-access:is_public": True, "links": []}  # a constant: Chameleon's one bare-metal flavor
        # Neutron
        self.fips: dict[str, FloatingIp] = {}
        self.sharednet = Network(_uuid(), "sharednet1", external=False, subnets=[_uuid()])
        self.public = Network(_uuid(), "public", external=True, subnets=[_uuid()])
        # Glance
        made = _fmt(self.clock.now(), "%Y-%m-%dT%H:%M:%SZ")
        self.images: list[Image] = [
            Image(_uuid(), name, self.project_id, made, disk_format="qcow2", container_format="bare", status="active",
                  visibility="public", size=1 << 30, updated_at=made)
            for name in ("appliance-cpu", "CC-Ubuntu22.04", "CC-Ubuntu22.04-CUDA", "CC-Ubuntu24.04",
                         "CC-Ubuntu24.04-CUDA")]  # 24.04: python3 is 3.12, no python3.11 (testbed/nodeimage.py)
        self.faults: dict[str, int] = {}
        # the last REQUEST_LOG requests, secrets redacted (admin_hooks.requests: what tests read back)
        self.requests: collections.deque[dict] = collections.deque(maxlen=REQUEST_LOG)
        self.nodes: NodeBackend = nodes or TestbedNodes(testbed_name)
        sock = self.nodes.metadata_socket()
        self.metadata = MetadataService(self, sock) if sock is not None else None
        self.fip_next = 200
        from .heat import Heat

        self.heat = Heat(self, _uuid)
        from .portal import Portal

        self.portal = Portal(self, su_budget)  # SU enforcement and the unutilized-lease reaper (portal.py)

    def token_valid(self, tok: str | None) -> bool:
        t = self.tokens.get(tok or "")
        return t is not None and t.valid()

    def token(self, tok: str | None) -> Token | None:
        return self.tokens.get(tok or "")

    # -- engine -----------------------------------------------------------------------------------

    def tick(self) -> None:
        """Move leases through their life: PENDING -> ACTIVE at start, TERMINATED at end; an ACTIVE lease nobody
        launched a server on, deleted by the reaper (portal.py). A lease in ERROR stays so (its events do not run)."""
        now = self.clock.now()
        with self.lock:
            for lease in list(self.leases.values()):
                if lease.status == "PENDING" and now >= lease.start:
                    self._start_lease(lease)
                if lease.status == "ACTIVE" and now >= lease.end:
                    self._end_lease(lease, "TERMINATED")
            for lease in self.portal.unused(now):
                self.delete_lease(lease.id)

    def _start_lease(self, lease: Lease) -> None:
        lease.status = "ACTIVE"
        for r in lease.reservations:
            r.status = "active"
            if isinstance(r, FipReservation):
                for _ in range(r.amount):
                    fip = self._new_fip(tags=[f"reservation:{r.id}", "blazar"])
                    r.fips.append(fip.id)
        lease.event("start_lease").status = "DONE"
        lease.updated_at = _fmt(self.clock.now(), STAMP)

    def _end_lease(self, lease: Lease, status: str) -> None:
        """end_lease: delete every server on the reserved hosts, release reserved FIPs."""
        lease.status = "TERMINATING"
        hosts = lease.hosts()
        for srv in list(self.servers.values()):
            if srv.host in hosts and srv.status != "DELETED":
                self._delete_server(srv)
        for r in lease.reservations:
            if isinstance(r, FipReservation):
                for fid in r.fips:
                    self._release_fip(fid)
            r.status = "deleted"
        lease.event("end_lease").status = "DONE"
        lease.status = status
        self.portal.stop_charging(lease, self.clock.now())
        lease.updated_at = _fmt(self.clock.now(), STAMP)

    # -- hosts ------------------------------------------------------------------------------------

    def _busy(self, host_id: str, start: float, end: float, ignore: str | None = None) -> bool:
        """A host held by another lease in that window. A lease in ERROR keeps its hosts until it is deleted:
        Blazar frees a lease's allocations only in its end and delete paths (ChameleonCloud/blazar
        blazar/manager/service.py `delete_lease`, blazar/plugins/oshosts/host_plugin.py `on_end`)."""
        for lease in self.leases.values():
            if lease.id == ignore or lease.status in ("TERMINATED", "DELETED"):
                continue
            if host_id in lease.hosts() and lease.start < end and start < lease.end:
                return True
        return False

    # -- Blazar -----------------------------------------------------------------------------------

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
        reservations: list[HostReservation | FipReservation] = []
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
                    free = [h.id for h in self.hosts if pred(h.capabilities) and not self._busy(h.id, start, end)]
                    if len(free) < lo:
                        # raised in Blazar's manager, it crosses RPC and the API renders its class's code, 500,
                        # with the code as its name (ChameleonCloud/blazar blazar/api/v1/utils.py `Rest.route`,
                        # the RemoteError branch; blazar/manager/exceptions.py NotEnoughResourcesAvailable)
                        raise ApiError(500, "Not enough hosts available", 500)
                    reservations.append(HostReservation(
                        rid, lease_id, resource_id=_uuid(), min=lo, max=hi,
                        hypervisor_properties=req["hypervisor_properties"],
                        resource_properties=req["resource_properties"], before_end=req.get("before_end", "default"),
                        hosts=free[:hi]))
                elif rtype == "virtual:floatingip":
                    if req.get("network_id") != self.public.id:
                        raise ApiError(400, "network_id must be the external network", "InvalidInput")
                    reservations.append(FipReservation(rid, lease_id, req["network_id"], int(req.get("amount", 1))))
                else:
                    raise ApiError(400, f"Unsupported resource type {rtype}", "UnsupportedResourceType")
            lease = Lease(lease_id, body["name"], "PENDING", self.user_id, self.project_id, trust_id=_uuid(),
                          created_at=_fmt(now, STAMP), reservations=reservations, start=start, end=end,
                          events=[LeaseEvent("start_lease", _fmt(start)), LeaseEvent("end_lease", _fmt(end))])
            self.portal.charge(lease)  # or refused, as Chameleon's portal refuses it (portal.py)
            if self.faults.get("lease_error", 0) > 0:
                self.faults["lease_error"] -= 1
                lease.status = "ERROR"
            # a host failed: Blazar's monitor updates the reservation's flags and marks the lease degraded, for a
            # failed reallocation (missing_resources) and a successful one (resources_changed) alike, and never
            # clears it (ChameleonCloud/blazar blazar/monitor/base.py `_update_flags`,
            # blazar/plugins/oshosts/host_plugin.py `heal_reservations`)
            for fault, flag in (("lease_degraded", "missing_resources"), ("lease_reallocated", "resources_changed")):
                if self.faults.get(fault, 0) > 0:
                    self.faults[fault] -= 1
                    lease.degraded = True
                    setattr(reservations[0], flag, True)
            self.leases[lease_id] = lease
        self.tick()
        return lease.view()

    def get_lease(self, lease_id) -> Lease:
        lease = self.leases.get(lease_id)
        if lease is None or lease.status == "DELETED":
            raise ApiError(404, f"Object with {{'id': '{lease_id}'}} not found", "NotFound")
        return lease

    def update_lease(self, lease_id, body: dict) -> dict:
        with self.lock:
            lease = self.get_lease(lease_id)
            if "name" in body:
                lease.name = body["name"]
            if "end_date" in body:
                new_end = _parse_api_date(body["end_date"], "end_date")
                now = self.clock.now()
                if lease.status in ("TERMINATED", "ERROR"):
                    raise ApiError(400, f"Lease {lease_id} is {lease.status} and cannot be updated", "InvalidStatus")
                if lease.status == "ACTIVE":
                    if lease.end - now > EXTENSION_WINDOW_SECONDS:
                        raise ApiError(400, f"Lease can only be extended within {EXTENSION_WINDOW_SECONDS} seconds "
                                            f"of the lease end date ({_fmt(lease.end, API_DATE)})",
                                       "MaxLeaseUpdateWindowException")
                    if new_end - lease.end > MAX_LEASE_SECONDS:
                        raise ApiError(400, f"Lease duration must not exceed {MAX_LEASE_SECONDS} seconds (7 days) "
                                            "from the current end date", "MaxLeaseDurationException")
                elif new_end - lease.start > MAX_LEASE_SECONDS:
                    raise ApiError(400, f"Lease duration must not exceed {MAX_LEASE_SECONDS} seconds (7 days)",
                                   "MaxLeaseDurationException")
                if new_end <= max(now, lease.start):
                    raise ApiError(400, "End date must be later than the current date and the start date", "InvalidInput")
                for h in lease.hosts():
                    if self._busy(h, lease.end, new_end, ignore=lease_id):
                        raise ApiError(500, "Not enough hosts available: a reserved host is booked by another "
                                            "lease after the current end", 500)  # as in create_lease
                self.portal.charge_update(lease, new_end)
                lease.end = new_end
                lease.event("end_lease").time = _fmt(new_end)
            lease.updated_at = _fmt(self.clock.now(), STAMP)
        self.tick()
        return lease.view()

    def delete_lease(self, lease_id) -> None:
        with self.lock:
            lease = self.get_lease(lease_id)
            if lease.status in ("ACTIVE", "PENDING", "ERROR"):
                self._end_lease(lease, "TERMINATED")
            self.portal.stop_charging(lease, self.clock.now())
            lease.status = "DELETED"

    def reservation(self, rid: str) -> tuple[Lease | None, HostReservation | FipReservation | None]:
        for lease in self.leases.values():
            for r in lease.reservations:
                if r.id == rid:
                    return lease, r
        return None, None

    # -- Nova -------------------------------------------------------------------------------------

    def server_view(self, srv: Server) -> dict:
        return srv.view(updated=_fmt(self.clock.now(), "%Y-%m-%dT%H:%M:%SZ"))

    def create_servers(self, body: dict) -> dict:
        s = body.get("server") or {}
        hints = body.get("os:scheduler_hints") or body.get("OS-SCH-HNT:scheduler_hints") or {}
        for key in ("name", "flavorRef", "imageRef"):
            if not s.get(key):
                raise ApiError(400, f"Invalid input for field/attribute server. '{key}' is a required property", "BadRequest")
        if s["flavorRef"] not in ("baremetal", self.flavor["id"]):
            raise ApiError(400, f"Flavor {s['flavorRef']} could not be found.", "BadRequest")
        if not any(i.id == s["imageRef"] for i in self.images):
            raise ApiError(400, f"Image {s['imageRef']} could not be found.", "BadRequest")
        key_name = s.get("key_name")
        if key_name and key_name not in self.keypairs:
            raise ApiError(400, "Invalid key_name provided.", "BadRequest")
        nets = s.get("networks") or []
        if nets and nets != "auto" and not all(n.get("uuid") in (self.sharednet.id,) for n in nets):
            raise ApiError(400, "Network could not be found.", "BadRequest")
        count = int(s.get("min_count", 1))
        count = max(count, int(s.get("max_count", count)))
        # Blazar frees an ended lease's hosts at once (ChameleonCloud/blazar host_plugin.py `on_end` destroys the
        # allocations) while Nova still tears its servers down and Ironic then cleans the nodes: a host whose
        # server is still going, or whose node is cleaning, cannot be scheduled to, and the new server goes to
        # ERROR "No valid host" (see __init__); the client retries it (python-chi chi/server.py `retry_on_error`)
        ids = []
        with self.lock:
            lease, res = self.reservation(hints.get("reservation", ""))
            fault = None
            hosts: list[str] = []
            if res is None or lease is None or not isinstance(res, HostReservation):
                fault = "No valid host was found. There are not enough hosts available."
            elif lease.status != "ACTIVE":
                fault = f"No valid host was found. Reservation {res.id} is not active."
            else:
                used = {x.host for x in self.servers.values() if x.status != "DELETED"}
                cleaning = {h for h, until in self.cleaning.items() if until > time.monotonic()}
                hosts = [h for h in res.hosts if h not in used and h not in cleaning]
                if len(hosts) < count:
                    fault = "No valid host was found. There are not enough hosts available."
            if self.faults.get("server_error", 0) > 0:
                self.faults["server_error"] -= 1
                fault = "Failure prepping block device."
            for i in range(count):
                sid = _uuid()
                name = s["name"] if count == 1 else f"{s['name']}-{i + 1}"
                srv = Server(sid, name, "BUILD", key_name,
                             flavor={"id": self.flavor["id"], "original_name": "baremetal"},
                             image={"id": s["imageRef"]}, metadata=s.get("metadata", {}), tenant_id=self.project_id,
                             user_id=self.user_id, created=_fmt(self.clock.now(), "%Y-%m-%dT%H:%M:%SZ"),
                             host=hosts[i] if not fault else None, user_data=s.get("user_data"),
                             lease=lease.id if lease else None)
                if fault:
                    srv.status = "ERROR"
                    srv.fault = {"code": 500, "message": fault, "created": srv.created}
                self.servers[sid] = srv
                ids.append(sid)
        for sid in ids:
            if self.servers[sid].status == "BUILD":
                threading.Thread(target=self._boot, args=(sid,), daemon=True).start()
        return {"server": {"id": ids[0], "links": [], "OS-DCF:diskConfig": "MANUAL",
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
            kp = self.keypairs.get(srv.key_name or "")
            pub = kp.public_key if kp else ""
            hostname = self._hostname(srv.name)
            with self.lock:  # a testbed node is named after its server: an earlier one of that name gone first
                going = [x for x in self.servers.values() if x is not srv and x.deleting and x.status != "DELETED"
                         and self._hostname(x.name) == hostname]
            self.wait_deleted(going, timeout=120)
            if self.faults.get("ssh_never", 0) > 0:
                self.faults["ssh_never"] -= 1
                pub = ""
                srv.no_ssh = True
            image = next((i.name for i in self.images if i.id == srv.image["id"]), None)
            node = self.nodes.add(hostname, pub + "\n" if pub else "", user=IMAGE_USER, data_disk=self.data_disk,
                                  image=image)
            srv.ip = node.ip  # the metadata service finds the server by it, as Neutron's proxy does
            if srv.user_data:
                # cloud-init's scripts-user runs a user_data script once, late in the boot (after the SSH host
                # keys exist and the network is up); its output goes to the node's log, not to the API:
                # bare-metal servers have no console log (see nova.py `action`)
                script = base64.b64decode(srv.user_data).decode(errors="replace")
                if script.startswith("#!"):
                    r = self.nodes.run(hostname, script)
                    (Path(node.dir) / "user_data.log").write_text(f"{r.stdout}{r.stderr}exit {r.returncode}\n")
            if srv.no_ssh:
                self.nodes.stop_sshd(node)  # booted (cloud-init ran), but sshd never answers
            with self.lock:
                if srv.deleting:  # deleted while it booted: its teardown is this thread's
                    self.nodes.remove(hostname)
                    self._gone(srv)
                    return
                srv.node = hostname
                mac = "fa:16:3e:%02x:%02x:%02x" % tuple(secrets.token_bytes(3))
                srv.addresses = {"sharednet1": [{"addr": node.ip, "version": 4, "OS-EXT-IPS:type": "fixed",
                                                 "OS-EXT-IPS-MAC:mac_addr": mac}]}
                srv.port = Port(_uuid(), sid, self.sharednet.id, mac,
                                [{"subnet_id": self.sharednet.subnets[0], "ip_address": node.ip}])
                srv.hostId = srv.host or ""
                srv.status = "ACTIVE"
                srv.progress = 100
        except Exception as e:  # a failed boot is a server in ERROR, as on Nova
            with self.lock:
                if srv.deleting:
                    self._gone(srv)
                    return
                srv.status = "ERROR"
                srv.fault = {"code": 500, "message": f"boot failed: {e}", "created": srv.created}

    def get_server(self, sid) -> Server:
        srv = self.servers.get(sid)
        if srv is None or srv.status == "DELETED":
            raise ApiError(404, f"Instance {sid} could not be found.", "itemNotFound")
        return srv

    def _delete_server(self, srv: Server) -> None:
        """Nova's delete (called under the lock), which does not wait for the machine: the API marks the instance
        task_state "deleting" and casts terminate_instance to its compute service (nova/compute/api.py
        ``_delete_instance`` -> ``_delete`` -> ``_do_delete``; nova/compute/rpcapi.py ``terminate_instance`` is a
        ``cctxt.cast``), and DELETE /servers/{id} answers 204 at once (nova/api/openstack/compute/servers.py). The
        server is listed, ACTIVE with task_state "deleting", and keeps its host until its node is torn down; then
        it is gone (404). A second delete of a deleting server is ignored, as Nova's ``_delete`` does."""
        if srv.deleting or srv.status == "DELETED":
            return
        srv.deleting = True
        t = threading.Thread(target=self._terminate, args=(srv,), daemon=True)
        self._terminating.append(t)
        t.start()

    def _terminate(self, srv: Server) -> None:
        """The compute side of a delete: the floating IP off its port, the node torn down (outside the cloud's
        lock: the testbed's own lock orders the teardowns), then the server gone."""
        with self.lock:
            if srv.status == "BUILD":  # its boot thread sees `deleting` and ends it
                return
            for fip in self.fips.values():
                if srv.port and fip.port_id == srv.port.id:
                    self._disassociate(fip)
            node, srv.node = srv.node, None
        try:
            if node:
                self.nodes.remove(node)
        finally:
            with self.lock:
                self._gone(srv)
        # the disk it leaves is this machine's business, not Ironic's cleaning (clean_seconds models that)
        self.nodes.wipe()

    def _gone(self, srv: Server) -> None:
        """The server is deleted; its node is cleaned for clean_seconds before Nova can use it again."""
        srv.status = "DELETED"
        if srv.host and self.clean_seconds:
            self.cleaning[srv.host] = time.monotonic() + self.clean_seconds
        srv.gone.set()

    def wait_deleted(self, servers, timeout: float = 300.0) -> None:
        """Until every server given is gone (not under the lock): what Heat's stack delete waits for, and a new
        server for a host or a node name an earlier one still holds."""
        for srv in servers:
            if srv.deleting:  # a server no one deleted is not waited for
                srv.gone.wait(timeout)

    # -- Neutron ----------------------------------------------------------------------------------

    def _new_fip(self, tags=()) -> FloatingIp:
        net = self.nodes.host_ip.rsplit(".", 1)[0]
        addr = f"{net}.{self.fip_next}"
        self.fip_next += 1
        fip = FloatingIp(_uuid(), addr, self.public.id, self.project_id,
                         created_at=_fmt(self.clock.now(), "%Y-%m-%dT%H:%M:%SZ"), tags=list(tags))
        self.fips[fip.id] = fip
        return fip

    def _release_fip(self, fid) -> None:
        fip = self.fips.pop(fid, None)
        if fip:
            self._disassociate(fip)

    def _port(self, port_id) -> Server | None:
        for srv in self.servers.values():
            if srv.port and srv.port.id == port_id and srv.status != "DELETED":
                return srv
        return None

    def ports(self) -> list[Port]:
        return [s.port for s in self.servers.values() if s.port and s.status != "DELETED"]

    def associate(self, fid: str, port_id: str | None) -> FloatingIp:
        with self.lock:
            fip = self.fips.get(fid)
            if fip is None:
                raise ApiError(404, f"Floating IP {fid} could not be found", "FloatingIPNotFound")
            if port_id is None:
                self._disassociate(fip)
                return fip
            srv = self._port(port_id)
            if srv is None or srv.port is None:
                raise ApiError(404, f"Port {port_id} could not be found.", "PortNotFound")
            self._disassociate(fip)
            netns = self.nodes.netns_of(srv.node)
            self.nodes.address(netns, fip.floating_ip_address, add=True)
            fip.port_id, fip.fixed_ip_address, fip.status, fip.netns = port_id, srv.port.ip, "ACTIVE", netns
            srv.addresses["sharednet1"].append({"addr": fip.floating_ip_address, "version": 4,
                                                "OS-EXT-IPS:type": "floating",
                                                "OS-EXT-IPS-MAC:mac_addr": srv.port.mac_address})
            return fip

    def _disassociate(self, fip: FloatingIp) -> None:
        if fip.netns:
            self.nodes.address(fip.netns, fip.floating_ip_address, add=False)
        for srv in self.servers.values():
            if srv.port and srv.port.id == fip.port_id:
                srv.addresses["sharednet1"] = [a for a in srv.addresses["sharednet1"]
                                               if a["addr"] != fip.floating_ip_address]
        fip.port_id, fip.fixed_ip_address, fip.status, fip.netns = None, None, "DOWN", None

    def server_by_fixed_ip(self, ip: str) -> Server | None:
        with self.lock:
            return next((x for x in self.servers.values() if x.ip == ip and x.status != "DELETED"), None)

    def shutdown(self) -> None:
        if self.metadata is not None:
            self.metadata.close()
        with self.lock:
            for srv in list(self.servers.values()):
                if srv.status != "DELETED":
                    self._delete_server(srv)
            terminating = list(self._terminating)
        for t in terminating:  # every teardown finished before the testbed goes
            t.join(300)
        self.nodes.shutdown()
