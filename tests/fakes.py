"""In-process fakes for the fast tier (after ray's fake_multi_node provider and openstacksdk's unit-test base):
a cloud with a settable clock, fault switches and a record of every call, and a site over it. Never the only test
of a behaviour: the local cloud + testbed tests exercise the same paths end to end."""

from __future__ import annotations

import datetime as dt
import functools
import itertools
import re
import threading
from collections import defaultdict
from dataclasses import dataclass, field
from types import SimpleNamespace

from appliance.errors import ApplianceError
from appliance.sites.base import LoginKey, Site
from appliance.sites.openstack import LeaseInfo
from appliance.store.objects import Store, StoreCreds


def _effect(fn):
    """Sets ``called[verb]`` once the call has taken effect (tests wait on it instead of sleeping)."""
    @functools.wraps(fn)
    def wrapper(self, *a, **k):
        out = fn(self, *a, **k)
        self.called[fn.__name__].set()
        if self.hook is not None:  # after the effect: a lost answer, a kill before it was recorded
            self.hook(fn.__name__, "answer")
        return out
    return wrapper


@dataclass
class FakeCloud:
    """The OpenStackCloud surface the steps use, in memory."""

    clock: dt.datetime = field(default_factory=lambda: dt.datetime(2026, 11, 23, 12, 0))
    faults: dict = field(default_factory=dict)  # verb -> ApplianceError to raise (once) or a status to boot into
    calls: list = field(default_factory=list)  # (verb, args) in order
    leases: dict = field(default_factory=dict)
    servers: dict = field(default_factory=dict)
    fips: dict = field(default_factory=dict)
    called: defaultdict = field(default_factory=lambda: defaultdict(threading.Event))  # verb -> set once it took effect
    tried: defaultdict = field(default_factory=lambda: defaultdict(threading.Event))  # verb -> set once asked (faults too)
    no_valid_host: int = 0  # the next this many servers go to ERROR "No valid host" (their host is being cleaned)
    # Blazar ends a lease at its end date (TERMINATED, as it is read), and a lease's end or delete deletes the
    # servers on its reservation (ChameleonCloud/blazar blazar/plugins/oshosts/host_plugin.py on_end); off: a lease
    # stays as it was made
    ends: bool = False
    made: list = field(default_factory=list)  # the id of every lease Blazar made, in order
    # hook(verb, "ask" | "answer"): told before a call takes effect and after (the fault matrix: it may raise)
    hook: object = None
    _ids: itertools.count = field(default_factory=itertools.count)

    def _call(self, verb: str, *args):
        self.calls.append((verb, args))
        self.tried[verb].set()
        if self.hook is not None:
            self.hook(verb, "ask")
        fault = self.faults.pop(verb, None)
        if isinstance(fault, Exception):
            raise fault
        return fault

    def _id(self, kind: str) -> str:
        return f"{kind}-{next(self._ids)}"

    def verbs(self, verb: str) -> list:
        return [a for v, a in self.calls if v == verb]

    def now(self) -> dt.datetime:
        return self.clock

    app_creds: dict = field(default_factory=dict)

    def identity_url(self) -> str:
        return "http://keystone.invalid/v3"

    def region_name(self) -> str:
        return "CHI@fake"

    def create_app_cred(self, name, *, expires_at, description="", unrestricted=False):
        self._call("create_app_cred", name, expires_at)
        cred = {"id": self._id("ac"), "name": name, "secret": "s3cret", "expires_at": expires_at,
                "unrestricted": unrestricted}
        self.app_creds[cred["id"]] = cred
        return cred

    def list_app_creds(self):
        return [{k: v for k, v in c.items() if k != "secret"} for c in self.app_creds.values()]

    def delete_app_cred(self, cred_id) -> bool:
        self._call("delete_app_cred", cred_id)
        return self.app_creds.pop(cred_id, None) is not None

    def ec2_credential(self) -> tuple[str, str]:
        self._call("ec2_credential")
        return "EC2ACCESS", "ec2secret"

    ec2_bound: dict = field(default_factory=dict)  # access -> the application credential it was made with

    def create_job_ec2(self, app_cred) -> tuple[str, str]:
        self._call("create_job_ec2", app_cred["id"])
        access = self._id("jobaccess")
        self.ec2_bound[access] = app_cred["id"]
        return access, "jobsecret"

    def delete_ec2(self, access) -> bool:
        self._call("delete_ec2", access)
        return self.ec2_bound.pop(access, None) is not None

    @_effect
    def create_lease(self, name, node_type, count, duration, *, start=None, floating_ip=False):
        self._call("create_lease", name, node_type, count)
        lid = self._id("lease")
        begin = start or self.clock
        self.leases[lid] = LeaseInfo(lid, name, "PENDING" if begin > self.clock else "ACTIVE", begin, begin + duration,
                                     self._id("res"), self._id("fipres") if floating_ip else None, False,
                                     node_type=node_type, hosts=count)
        self.made.append(lid)
        return self.leases[lid]

    def _ended(self, info) -> None:
        if self.ends and info.status in ("ACTIVE", "PENDING") and self.clock >= info.end:
            info.status = "TERMINATED"
            self._servers_go(info.reservation_id)

    def _servers_go(self, reservation_id) -> None:
        if self.ends:
            for sid in [s.id for s in self.servers.values() if s.metadata.get("appliance_reservation") ==
                        reservation_id]:
                self.servers.pop(sid)

    @_effect
    def get_lease(self, lease_id):
        self._call("get_lease", lease_id)
        info = self.leases.get(lease_id)
        if info is not None:
            self._ended(info)
        if info is not None and info.status == "PENDING" and self.clock >= info.start:
            info.status = "ACTIVE"  # Blazar starts it at its start date
        return info

    def lease_at(self, lease_id):
        return self.get_lease(lease_id), self.clock.replace(microsecond=0)  # an HTTP Date: whole seconds

    def list_leases(self):
        for info in self.leases.values():
            self._ended(info)
        return list(self.leases.values())

    hosts: dict = field(default_factory=lambda: {"compute_local": (4, 1.0), "gpu_local": (2, 1.0)})

    def node_type_hosts(self, node_type):
        return self.hosts.get(node_type, (0, 1.0))

    @_effect
    def wait_lease(self, lease_id, **kw):
        self._call("wait_lease", lease_id)
        return self.leases[lease_id]

    def server_host_keys(self, server_id):
        self._call("server_host_keys", server_id)
        return [f"ssh-ed25519 AAAAfake{server_id}"]

    @_effect
    def extend_lease(self, lease_id, *, by=None, to=None):
        self._call("extend_lease", lease_id, by, to)
        info = self.leases[lease_id]
        info.end = to or info.end + by
        return info

    @_effect
    def delete_lease(self, lease_id) -> bool:
        self._call("delete_lease", lease_id)
        info = self.leases.pop(lease_id, None)
        if info is not None:
            self._servers_go(info.reservation_id)
        return info is not None

    @_effect
    def ensure_keypair(self, name, public_key):
        self._call("ensure_keypair", name)

    @_effect
    def create_server(self, name, *, reservation_id, image, key_name, network, **kw):
        status = self._call("create_server", name) or "ACTIVE"
        sid = self._id("srv")
        fault = None
        if self.no_valid_host > 0:
            self.no_valid_host -= 1
            status, fault = "ERROR", {"code": 500, "message": "No valid host was found. There are not enough hosts "
                                                              "available."}
        self.servers[sid] = SimpleNamespace(id=sid, name=name, status=status, ip=f"10.0.0.{len(self.servers) + 10}",
                                            metadata={"appliance_reservation": reservation_id}, fault=fault)
        return sid

    def get_server(self, server_id):
        return self.servers.get(server_id)

    def find_servers(self, name_regex=None):
        self._call("find_servers", name_regex)
        return [srv for srv in self.servers.values() if not name_regex or re.search(name_regex, srv.name)]

    def get_servers(self, server_ids, name_regex=None):
        """One listing filtered by name as Nova filters it (a regular expression search), or of every server."""
        self._call("get_servers", name_regex)
        listed = {sid: srv for sid, srv in self.servers.items() if not name_regex or re.search(name_regex, srv.name)}
        return {sid: listed.get(sid) for sid in server_ids}

    @_effect
    def delete_server(self, server_id) -> bool:
        self._call("delete_server", server_id)
        return self.servers.pop(server_id, None) is not None

    def server_ip(self, srv) -> str:
        return srv.ip

    @_effect
    def attach_floating_ip(self, server_id, *, fip_reservation_id=None):
        self._call("attach_floating_ip", server_id, fip_reservation_id)
        fid = self._id("fip")
        self.fips[fid] = SimpleNamespace(id=fid, floating_ip_address=f"192.0.2.{len(self.fips) + 1}",
                                         server_id=server_id)
        return self.fips[fid]

    def server_floating_ip(self, server_id):
        self._call("server_floating_ip", server_id)
        return next((f for f in self.fips.values() if f.server_id == server_id), None)

    @_effect
    def release_floating_ip(self, fip_id):
        self._call("release_floating_ip", fip_id)
        self.fips.pop(fip_id, None)


class FakeSite(Site):
    kind = "local"  # records say "local" so sites.for_cluster can route them; tests pass the site in directly
    user, workdir, python = "cc", "/work", "/venv/bin/python"
    poll = 0.0
    lease_poll = 0.01

    def __init__(self, cloud: FakeCloud | None = None, scale: float = 1.0):
        super().__init__(None)
        self._cloud = cloud or FakeCloud()
        self.scale = scale

    def connect(self):
        return self._cloud

    def login_key(self, key_name, key_file) -> LoginKey:
        return LoginKey("fake-key", "/dev/null")

    def time_scale(self) -> float:
        return self.scale

    def _site_store_creds(self) -> StoreCreds:
        return StoreCreds(storage_url="http://store.invalid/v1/AUTH_x", token="t")

    def install_options(self) -> dict:
        return {}


def no_nodes(site, cluster):
    """The booted-machine steps of `up` (host keys, SSH, disk, contextualize), skipped in the fast tier."""
    cluster.save()


def fault(msg: str) -> ApplianceError:
    return ApplianceError(msg)


class FakeRemote:
    """A node that records the commands it is given (and their stdin) and answers from a script of replies:
    ``replies`` maps a substring of the command to (rc, out, err); ``fail`` makes every command raise (a node gone)."""

    def __init__(self, node, replies: dict | None = None):
        self.node = node
        self.replies = replies or {}
        self.commands: list[tuple[str, bytes | None]] = []
        self.fail: Exception | None = None

    def run(self, command, *, stdin=None, on_line=None, timeout=None, stop=None, check=False):
        from appliance.remote import Result

        self.commands.append((command, stdin))
        if self.fail is not None:
            raise self.fail
        rc, out, err = next((v for k, v in self.replies.items() if k in command), (0, "", ""))
        for line in out.splitlines():
            if on_line:
                on_line("stdout", line)
        if check and rc != 0:
            raise ApplianceError(f"{command!r} failed on {self.node.name}: {err}")
        return Result(rc, out, err)


class DictStore(Store):
    """An object store in memory (the Store interface the stager uses): name -> bytes; ``slow[name]`` is an Event a
    GET of that object waits on after its first chunk (to order concurrent downloads without sleeping)."""

    scheme = "mem"

    def __init__(self, objects: dict[str, bytes], *, etags: dict[str, str] | None = None,
                 parts: dict[str, list[int]] | None = None):
        import hashlib

        self.objects = dict(objects)
        self.etags = dict(etags or {})  # name -> the ETag listed (a multipart upload's), else the MD5
        self.parts = dict(parts or {})  # name -> part sizes, for a store that answers S3's partNumber
        self.damage: dict[str, int] = {}  # name -> how many of its next GETs of byte 0 arrive with it flipped
        self.gets: list[tuple[str, int | None, int | None]] = []
        self.slow: dict[str, threading.Event] = {}
        self.got: dict[str, threading.Event] = defaultdict(threading.Event)  # set when a GET has returned
        self.started: dict[str, threading.Event] = defaultdict(threading.Event)  # ... has written its first half
        self.meta: dict[str, dict] = {}  # name -> the headers its GETs and HEADs answer with (CRC_META)
        self.heads: list[str] = []
        self._md5 = hashlib.md5

    def list(self, prefix: str = ""):
        from appliance.store.objects import ObjectInfo

        for name in sorted(self.objects):
            if name.startswith(prefix):
                etag = self.etags.get(name) or self._md5(self.objects[name]).hexdigest()
                yield ObjectInfo(name, len(self.objects[name]), etag)

    def part_sizes(self, name, n, *, every=False):
        return self.parts.get(name)

    def crc32(self, name, etag):
        from appliance.store.objects import crc_from

        self.heads.append(name)
        return crc_from(self.meta.get(name, {}), etag)

    def fetch(self, name, fd, offset, sink=None, *, start=None, end=None, on_headers=None):
        if on_headers is not None:  # as httpget: the headers before the body
            on_headers(dict(self.meta.get(name, {})))
        return super().fetch(name, fd, offset, sink, start=start, end=end)

    def get(self, name, write, *, start=None, end=None) -> dict:
        self.gets.append((name, start, end))
        data = self.objects[name][start or 0: None if end is None else end + 1]
        if not start and self.damage.get(name):
            self.damage[name] -= 1
            data = bytes([data[0] ^ 0xFF]) + data[1:]
        half = len(data) // 2
        write(data[:half])
        self.started[name].set()
        if name in self.slow:
            self.slow[name].wait(10)
        write(data[half:])
        self.got[name].set()
        return dict(self.meta.get(name, {}))
