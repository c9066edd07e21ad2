"""Cluster records: the machines a run uses, however they were obtained.

A ``Cluster`` is what every later step (contextualize, stage, train, checkpoint) needs to know:
nodes with their addresses, the login key, the pinned host keys. It is saved as one JSON state
file per cluster under $APPLIANCE_HOME/clusters/NAME.json; provisioning fills in the lease
fields on clouds that have leases.
"""

from __future__ import annotations

import dataclasses
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
class Cluster:
    name: str
    cloud: str  # "testbed", "local" or "chameleon"
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
    extra: dict = field(default_factory=dict)

    @property
    def head(self) -> Node:
        return self.nodes[0]

    @property
    def single_host(self) -> bool:
        return len(self.nodes) == 1 and self.nodes[0].address is None

    @property
    def world_size(self) -> int:
        return sum(n.slots for n in self.nodes)

    def config_dir(self, node: Node) -> str:
        return self.etc_dir or f"{node.workdir}/appliance/etc"

    def rank_hosts(self) -> list[str]:
        """Rank r runs on rank_hosts()[r] (horovodrun fills hosts in -H order)."""
        return [n.name for n in self.nodes for _ in range(n.slots)]

    # -- persistence ---------------------------------------------------------------------------

    def save(self) -> Path:
        p = state_path(self.name)
        tmp = p.with_suffix(".tmp")
        tmp.write_text(json.dumps(dataclasses.asdict(self), indent=2))
        os.chmod(tmp, 0o600)
        tmp.replace(p)
        return p

    @classmethod
    def from_dict(cls, d: dict) -> Cluster:
        d = dict(d)
        d["nodes"] = [Node(**n) for n in d["nodes"]]
        return cls(**d)


def state_path(name: str) -> Path:
    return paths.clusters_dir() / f"{name}.json"


def load_cluster(name: str) -> Cluster:
    p = state_path(name)
    if not p.exists():
        raise ApplianceError(f"no cluster named {name!r}", "bring one up with `appliance up SPEC` or `appliance testbed up`")
    return Cluster.from_dict(json.loads(p.read_text()))


def find_cluster(name: str) -> Cluster | None:
    return load_cluster(name) if state_path(name).exists() else None


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
