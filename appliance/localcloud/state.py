"""The local cloud's state as typed records, grouped by the service that owns them (Keystone, Blazar, Nova, Neutron,
Glance; Heat's stacks are heat.Stack). A record holds what the real service stores; ``view()`` renders the body its
API answers with (the field names and shapes of the upstream serializers cited in each service's module). What only
the simulator needs (the host a server runs on, its testbed node, the namespace a floating IP sits in) is a plain
attribute that no body shows.

tests/test_localcloud_bodies.py holds every body of a scripted session as it was when this state was dicts shaped as
the API bodies: the records must render the same.
"""

from __future__ import annotations

import copy
import datetime as dt
import threading
import time
from dataclasses import dataclass, field


class ApiError(Exception):
    """An answer of an error, in the status and body shape of the service that raised it."""

    def __init__(self, code: int, message: str, name=""):
        super().__init__(message)
        self.code, self.message, self.name = code, message, name


ISO = "%Y-%m-%dT%H:%M:%S.%f"
STAMP = "%Y-%m-%d %H:%M:%S"  # Blazar's created_at / updated_at
NOVA_TIME = "%Y-%m-%dT%H:%M:%SZ"


def fmt(ts: float, f: str = ISO) -> str:
    return dt.datetime.fromtimestamp(ts, dt.timezone.utc).replace(tzinfo=None).strftime(f)


# -- Keystone ------------------------------------------------------------------------------------------------------

@dataclass
class Token:
    """An issued token: when it expires (this machine's clock), the body Keystone renders for it
    (keystone/common/render_token.py), and where it came from."""
    expires: float
    body: dict
    app_cred: str | None = None  # the application credential it was issued for
    unrestricted: bool = False  # ... and whether that credential is unrestricted
    service: str | None = None  # a service user's token (the RGW's)

    def valid(self) -> bool:
        return self.expires >= time.time()


@dataclass
class AppCred:
    """keystone/application_credential/backends/sql.py ApplicationCredentialModel (the fields a body shows)."""
    id: str
    name: str
    secret: str
    unrestricted: bool = False
    description: str | None = None
    expires_at: str | None = None
    access_rules: list | None = None

    def view(self) -> dict:
        """_to_dict: without the secret (shown once, on create), access_rules only when there are rules."""
        out = {"id": self.id, "name": self.name, "unrestricted": self.unrestricted, "description": self.description,
               "expires_at": self.expires_at}
        if self.access_rules:
            out["access_rules"] = self.access_rules
        return out

    def expired(self) -> bool:
        """keystone/application_credential/backends/sql.py authenticate -> _check_expired."""
        if not self.expires_at:
            return False
        try:
            when = dt.datetime.fromisoformat(str(self.expires_at).replace("Z", "+00:00"))
        except ValueError:
            return False
        if when.tzinfo is None:
            when = when.replace(tzinfo=dt.timezone.utc)
        return dt.datetime.now(dt.timezone.utc) >= when


@dataclass
class Ec2Cred:
    """An OS-EC2 credential (Chameleon's S3 keys); ``app_cred_id``: the application credential whose token made it
    through /v3/credentials (keystone/api/credentials.py records it in the blob)."""
    user_id: str
    project_id: str
    access: str
    secret: str
    app_cred_id: str | None = None


# -- Blazar --------------------------------------------------------------------------------------------------------

@dataclass
class Host:
    """A reservable host (blazar/db/sqlalchemy/models.py ComputeHost with its extra capabilities)."""
    id: str
    hypervisor_hostname: str
    node_type: str
    capabilities: dict

    def view(self) -> dict:
        return {"id": self.id, "hypervisor_hostname": self.hypervisor_hostname, **self.capabilities}


@dataclass
class LeaseEvent:
    event_type: str  # start_lease / end_lease
    time: str
    status: str = "UNDONE"

    def view(self) -> dict:
        return {"event_type": self.event_type, "time": self.time, "status": self.status}


@dataclass
class HostReservation:
    """A physical:host reservation (blazar/plugins/oshosts); ``hosts``: the ids of the hosts it holds."""
    id: str
    lease_id: str
    resource_id: str
    min: int
    max: int
    hypervisor_properties: str
    resource_properties: str
    before_end: str
    hosts: list[str]
    status: str = "pending"
    missing_resources: bool = False
    resources_changed: bool = False
    resource_type = "physical:host"

    def view(self) -> dict:
        return {"id": self.id, "lease_id": self.lease_id, "status": self.status, "resource_id": self.resource_id,
                "resource_type": self.resource_type, "min": self.min, "max": self.max,
                "hypervisor_properties": self.hypervisor_properties,
                "resource_properties": self.resource_properties, "before_end": self.before_end,
                "missing_resources": self.missing_resources, "resources_changed": self.resources_changed}


@dataclass
class FipReservation:
    """A virtual:floatingip reservation (blazar/plugins/floatingips); ``fips``: the floating IPs it made."""
    id: str
    lease_id: str
    network_id: str
    amount: int
    fips: list[str] = field(default_factory=list)
    status: str = "pending"
    resource_type = "virtual:floatingip"

    def view(self) -> dict:
        return {"id": self.id, "lease_id": self.lease_id, "status": self.status, "resource_type": self.resource_type,
                "network_id": self.network_id, "amount": self.amount}


Reservation = HostReservation | FipReservation


@dataclass
class Lease:
    """blazar/db/sqlalchemy/models.py Lease; ``start`` and ``end`` on the cloud's clock (seconds)."""
    id: str
    name: str
    status: str
    user_id: str
    project_id: str
    trust_id: str
    created_at: str
    reservations: list[Reservation]
    start: float
    end: float
    events: list[LeaseEvent]
    degraded: bool = False
    updated_at: str | None = None

    def hosts(self) -> set[str]:
        return {h for r in self.reservations if isinstance(r, HostReservation) for h in r.hosts}

    def event(self, event_type: str) -> LeaseEvent:
        return next(e for e in self.events if e.event_type == event_type)

    def view(self) -> dict:
        return {"id": self.id, "name": self.name, "status": self.status, "degraded": self.degraded,
                "user_id": self.user_id, "project_id": self.project_id, "trust_id": self.trust_id,
                "created_at": self.created_at, "updated_at": self.updated_at,
                "reservations": [r.view() for r in self.reservations], "events": [e.view() for e in self.events],
                "start_date": fmt(self.start), "end_date": fmt(self.end)}


# -- Nova ----------------------------------------------------------------------------------------------------------

@dataclass
class Keypair:
    """nova/api/openstack/compute/keypairs.py (`_filter_keypair`): name, public_key, fingerprint, type, user_id."""
    name: str
    public_key: str
    user_id: str
    fingerprint: str = ""
    type: str = "ssh"

    def view(self) -> dict:
        return {"name": self.name, "public_key": self.public_key, "fingerprint": self.fingerprint, "type": self.type,
                "user_id": self.user_id}


@dataclass
class Port:
    """A server's port on sharednet1 (Neutron's, made by Nova at boot; neutron/db/db_base_plugin_common.py
    `_make_port_dict`, the fields our clients read)."""
    id: str
    device_id: str
    network_id: str
    mac_address: str
    fixed_ips: list[dict]
    status: str = "ACTIVE"
    device_owner: str = "compute:nova"

    @property
    def ip(self) -> str:
        return self.fixed_ips[0]["ip_address"]

    def view(self) -> dict:
        return {"id": self.id, "device_id": self.device_id, "network_id": self.network_id,
                "mac_address": self.mac_address, "status": self.status, "device_owner": self.device_owner,
                "fixed_ips": copy.deepcopy(self.fixed_ips)}


@dataclass
class Server:
    """A server as Nova keeps it (the fields of its show body: nova/api/openstack/compute/views/servers.py `show`
    with the OS-EXT-STS extension's states), and where the simulator runs it."""
    id: str
    name: str
    status: str  # BUILD, ACTIVE, ERROR, DELETED
    key_name: str | None
    flavor: dict
    image: dict
    metadata: dict
    tenant_id: str
    user_id: str
    created: str
    addresses: dict = field(default_factory=dict)
    hostId: str = ""
    progress: int = 0
    fault: dict | None = None
    # the simulator's
    host: str | None = None  # the reserved host (a Blazar host id) it runs on
    lease: str | None = None
    user_data: str | None = None  # base64, as given
    node: str | None = None  # the testbed node, once booted
    ip: str | None = None  # its fixed address (the metadata service finds it by it)
    port: Port | None = None
    password: str = ""  # what it POSTed to the metadata service's password
    no_ssh: bool = False
    deleting: bool = False  # a delete was asked: task_state "deleting" until its node is torn down
    gone: threading.Event = field(default_factory=threading.Event, repr=False, compare=False)  # set once DELETED

    def view(self, updated: str) -> dict:
        out = {"id": self.id, "name": self.name, "status": self.status, "addresses": copy.deepcopy(self.addresses),
               "key_name": self.key_name, "flavor": copy.deepcopy(self.flavor), "image": copy.deepcopy(self.image),
               "metadata": copy.deepcopy(self.metadata), "tenant_id": self.tenant_id, "user_id": self.user_id,
               "created": self.created, "hostId": self.hostId, "links": [], "accessIPv4": "", "accessIPv6": "",
               "progress": self.progress, "config_drive": ""}
        if self.fault is not None:
            out["fault"] = copy.deepcopy(self.fault)
        out["OS-EXT-STS:vm_state"] = {"ACTIVE": "active", "BUILD": "building", "ERROR": "error"}.get(self.status,
                                                                                                      "deleted")
        out["OS-EXT-STS:task_state"] = "deleting" if self.deleting else "spawning" if self.status == "BUILD" else None
        out["OS-EXT-STS:power_state"] = 1 if self.status == "ACTIVE" else 0
        out["updated"] = updated
        return out


# -- Neutron -------------------------------------------------------------------------------------------------------

@dataclass
class Network:
    """neutron/db/db_base_plugin_common.py `_make_network_dict` (with the external-net extension's router:external)."""
    id: str
    name: str
    external: bool
    subnets: list[str]
    shared: bool = True
    status: str = "ACTIVE"

    def view(self) -> dict:
        return {"id": self.id, "name": self.name, "status": self.status, "router:external": self.external,
                "shared": self.shared, "subnets": list(self.subnets), "tags": []}


@dataclass
class FloatingIp:
    """neutron/db/l3_db.py `_make_floatingip_dict` (tenant_id beside project_id, as Neutron shows both)."""
    id: str
    floating_ip_address: str
    floating_network_id: str
    project_id: str
    created_at: str
    tags: list[str] = field(default_factory=list)
    port_id: str | None = None
    fixed_ip_address: str | None = None
    status: str = "DOWN"
    netns: str | None = None  # the simulator's: the node namespace that holds the address

    def view(self) -> dict:
        return {"id": self.id, "floating_ip_address": self.floating_ip_address,
                "floating_network_id": self.floating_network_id, "port_id": self.port_id,
                "fixed_ip_address": self.fixed_ip_address, "status": self.status, "tags": list(self.tags),
                "project_id": self.project_id, "tenant_id": self.project_id, "router_id": None, "description": "",
                "created_at": self.created_at}


# -- Glance --------------------------------------------------------------------------------------------------------

@dataclass
class Image:
    """glance/api/v2/images.py get_base_properties' stored fields; ``properties``: the others a client set (Glance's
    image schema is permissive: glance/schema.py PermissiveSchema)."""
    id: str
    name: str
    owner: str
    created_at: str
    disk_format: str | None = None
    container_format: str | None = None
    status: str = "queued"
    visibility: str = "shared"
    size: int | None = None
    checksum: str | None = None
    os_hash_algo: str | None = None
    os_hash_value: str | None = None
    tags: list = field(default_factory=list)
    updated_at: str = ""
    min_disk: int = 0
    min_ram: int = 0
    protected: bool = False
    properties: dict = field(default_factory=dict)

    CORE = ("id", "name", "owner", "created_at", "disk_format", "container_format", "status", "visibility", "size",
            "checksum", "os_hash_algo", "os_hash_value", "tags", "updated_at", "min_disk", "min_ram", "protected")

    def view(self) -> dict:
        """glance/api/v2/images.py ResponseSerializer._format_image: the extra properties, then every base attribute
        (`image_view[key] = getattr(image, key)`: one not given is null, e.g. container_format), and links to
        itself, its data and its schema."""
        return {**copy.deepcopy(self.properties), **{k: copy.deepcopy(getattr(self, k)) for k in self.CORE},
                "self": f"/v2/images/{self.id}", "file": f"/v2/images/{self.id}/file", "schema": "/v2/schemas/image"}
