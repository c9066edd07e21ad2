"""Cluster records: the machines a run uses, however they were obtained.

A ``Cluster`` is what every later step (contextualize, stage, train, checkpoint) needs to know:
nodes with their addresses, the login key, the pinned host keys. It is saved as one JSON state
file per cluster under $APPLIANCE_HOME/clusters/NAME.json; provisioning fills in the lease
fields on clouds that have leases.
"""

from __future__ import annotations

import dataclasses
import datetime as dt
import json
import os
import sys
from dataclasses import dataclass, field
from pathlib import Path

from . import paths
from .errors import ApplianceError


@dataclass
class Node:
    name: str  # hostname, as peers know it
    private_ip: str  # address peers use (Gloo/NCCL traffic)
    address: str | None  # where the launcher connects with SSH; None = this machine, no SSH
    workdir: str  # node-local disk as seen on the node (code, data, checkpoints)
    slots: int = 1
    user: str = "root"
    port: int = 22
    via_head: bool = False  # reach through the head node as jump host
    server_id: str | None = None


@dataclass
class SiteRecord:
    """What a site made for a cluster, so `up` can resume and `down` finds everything (no secrets)."""

    region: str | None = None  # CHI@UC, CHI@TACC (None: the default of clouds.yaml / OS_REGION_NAME)
    key_name: str | None = None  # the Nova key pair the servers were booted with
    key_file: str | None = None  # its private key on the launcher
    spec_path: str | None = None
    servers: dict[str, str] = field(default_factory=dict)  # node name -> server id, as soon as asked for
    fip_reservation_id: str | None = None  # the lease's reserved floating IP, if any
    fip_id: str | None = None  # the floating IP attached to the head
    installed: dict = field(default_factory=dict)  # `up --install`: the stack tag, built or from the cache
    stack: str | None = None  # `adopt`: the Heat stack
    stack_id: str | None = None
    lease_name: str | None = None  # the lease `up` asks Blazar for, recorded before it asks

    @classmethod
    def from_dict(cls, d: dict) -> SiteRecord:
        d = dict(d)
        if "site" in d:  # the `extra` bag of state files written before 0.2
            d["region"] = d.pop("site")
        if "spec" in d:
            d["spec_path"] = d.pop("spec")
        known = {f.name for f in dataclasses.fields(cls)}
        return cls(**{k: v for k, v in d.items() if k in known})


@dataclass
class Cluster:
    name: str
    cloud: str  # the site ("local", "chameleon"), or "testbed" / "node" (machines no site made)
    nodes: list[Node]
    key_file: str | None = None  # private key the launcher logs in with
    known_hosts: str | None = None  # pinned host keys of every node
    python: str = sys.executable  # the Python (venv) with TensorFlow + Horovod on the nodes
    etc_dir: str | None = None  # where contextualize writes cluster.json and the hostfile
    nic: str | None = None  # filled by contextualize: NIC for Gloo/NCCL
    lease_id: str | None = None
    reservation_id: str | None = None
    lease_end: str | None = None  # ISO UTC
    floating_ip: str | None = None
    spec_digest: str | None = None
    testbed: str | None = None
    site: SiteRecord = field(default_factory=SiteRecord)
    subset_of: int | None = None  # a view of the first nodes of a cluster this many nodes big (never saved)

    @property
    def lease_end_at(self) -> dt.datetime | None:
        """``lease_end`` as a naive UTC datetime (None: no lease, or unreadable)."""
        try:
            return dt.datetime.fromisoformat(self.lease_end.replace("Z", "")) if self.lease_end else None
        except ValueError:
            return None

    @property
    def head(self) -> Node:
        return self.nodes[0]

    @property
    def single_host(self) -> bool:
        return len(self.nodes) == 1 and self.nodes[0].address is None

    @property
    def world_size(self) -> int:
        return sum(n.slots for n in self.nodes)

    @property
    def is_subset(self) -> bool:
        return self.subset_of is not None

    def subset(self, n: int) -> Cluster:
        """The first n nodes (the head first) as a cluster of their own, for a job on part of the cluster
        (`appliance bench` on 1..N nodes). It keeps the name (and so the cluster key); saving it saves the
        whole cluster's record with this view's other fields (a lease extended meanwhile, the NIC)."""
        if not 1 <= n <= len(self.nodes):
            raise ApplianceError(f"cluster {self.name!r} has {len(self.nodes)} node(s), not {n}",
                                 f"ask for 1 to {len(self.nodes)} nodes")
        return dataclasses.replace(self, nodes=list(self.nodes[:n]), subset_of=len(self.nodes))

    def config_dir(self, node: Node) -> str:
        return self.etc_dir or f"{node.workdir}/appliance/etc"

    def rank_hosts(self) -> list[str]:
        """Rank r runs on rank_hosts()[r] (horovodrun fills hosts in -H order)."""
        return [n.name for n in self.nodes for _ in range(n.slots)]

    # -- persistence ---------------------------------------------------------------------------

    def save(self) -> Path:
        p = state_path(self.name)
        d = dataclasses.asdict(self)
        if self.is_subset:
            if not p.exists():
                return p
            full = json.loads(p.read_text())
            d["nodes"], d["site"], d["subset_of"] = full["nodes"], full.get("site", full.get("extra", {})), None
        paths.write_private(p, json.dumps(d, indent=2).encode())
        return p

    @classmethod
    def from_dict(cls, d: dict) -> Cluster:
        d = dict(d)
        d["nodes"] = [Node(**n) for n in d["nodes"]]
        d["site"] = SiteRecord.from_dict(d.pop("site", None) or d.pop("extra", None) or {})
        d.pop("extra", None)
        return cls(**d)


def state_path(name: str) -> Path:
    return paths.clusters_dir() / f"{name}.json"


def load_cluster(name: str) -> Cluster:
    cl = find_cluster(name)
    if cl is None:
        raise ApplianceError(f"no cluster named {name!r}", "bring one up with `appliance up SPEC` or `appliance testbed up`")
    return cl


def find_cluster(name: str) -> Cluster | None:
    """The record of cluster ``name``, or None: none, or deleted while it was looked for (a teardown in another
    thread: a warm handover's, a controller's end). Records are written whole (paths.write_private)."""
    try:
        text = state_path(name).read_text()
    except FileNotFoundError:
        return None
    return Cluster.from_dict(json.loads(text))


def delete_cluster(name: str) -> None:
    state_path(name).unlink(missing_ok=True)


def from_testbed(tb, name: str | None = None) -> Cluster:
    """The cluster record of a testbed (see appliance.testbed)."""
    nodes = [Node(name=n.name, private_ip=n.ip, address=None if tb.mode == "single-host" else n.ip,
                  workdir=n.workdir, slots=n.slots, user="root") for n in tb.nodes]
    return Cluster(name=name or f"testbed-{tb.name}", cloud="testbed", nodes=nodes,
                   key_file=None if tb.mode == "single-host" else tb.key_file,
                   known_hosts=None if tb.mode == "single-host" else tb.known_hosts,
                   python=sys.executable, testbed=tb.name)


def node_config_path() -> Path | None:
    """cluster.json written at boot by the Heat template (or by contextualize), if this machine has one."""
    etc = os.environ.get("APPLIANCE_ETC") or "/etc/appliance"
    p = Path(etc) / "cluster.json"
    return p if p.exists() else None


def from_node_config(path: Path | None = None) -> Cluster:
    """The cluster this machine is the head of, from its contextualized files: `appliance` run on the head node
    of a stack launched from heat-templates/horovod-cluster.yaml. Reuses the boot-time cluster key
    (~/.ssh/id_appliance) and the host keys pinned in ~/.ssh/known_hosts."""
    import getpass
    import shutil
    import socket

    path = path or node_config_path()
    if path is None:
        raise ApplianceError("this machine has no /etc/appliance/cluster.json", "run on a contextualized head node")
    cfg = json.loads(Path(path).read_text())
    me = socket.gethostname()
    if cfg.get("head") != me:
        raise ApplianceError(f"this is {me}, not the head node {cfg.get('head')} of cluster {cfg.get('name')}",
                             f"run appliance on {cfg.get('head')}, or `appliance adopt` from your own machine")
    name = cfg["name"]
    ssh = Path.home() / ".ssh"
    d = paths.clusters_dir()
    key = d / f"{name}.id_ed25519"
    if (ssh / "id_appliance").exists():
        paths.write_private(key, (ssh / "id_appliance").read_bytes())
        shutil.copyfile(ssh / "id_appliance.pub", d / f"{name}.id_ed25519.pub")
    known = d / f"{name}.known_hosts"
    lines, inside = [], False
    for line in (ssh / "known_hosts").read_text().splitlines() if (ssh / "known_hosts").exists() else []:
        if line.startswith("# BEGIN appliance"):
            inside = True
        elif line.startswith("# END appliance"):
            inside = False
        elif inside and line.strip():
            lines.append(line)
    known.write_text("\n".join(lines) + "\n")
    etc = Path(path).parent
    workdir = os.environ.get("APPLIANCE_WORKDIR") or (
        str(etc.parent.parent) if etc.parts[-2:] == ("appliance", "etc") else str(Path.home()))
    user = getpass.getuser()
    nodes = [Node(name=n["name"], private_ip=n["ip"], address=None if n["name"] == me else n["ip"], workdir=workdir,
                  slots=int(n.get("slots", 1)), user=user) for n in cfg["nodes"]]
    nodes.sort(key=lambda n: n.name != me)  # the head first
    return Cluster(name=name, cloud="node", nodes=nodes, key_file=str(key), known_hosts=str(known),
                   python=sys.executable, etc_dir=str(etc), lease_id=cfg.get("lease_id"),
                   lease_end=cfg.get("lease_end"))
