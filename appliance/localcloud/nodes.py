"""The local cloud's node backend: where its servers run. Nova's side (appliance/localcloud/cloud.py) asks this
interface and nothing else, so the simulator's services do not reach into the testbed's internals.

``TestbedNodes`` runs each server as a testbed node (a network namespace with its own sshd on the cloud's bridge,
appliance/testbed); a floating IP is an extra address on the node's interface.
"""

from __future__ import annotations

from abc import ABC, abstractmethod

from .. import report, testbed


class NodeBackend(ABC):
    @property
    @abstractmethod
    def host_ip(self) -> str:
        """This machine's address on the nodes' network (the floating-IP range is next to it)."""

    @abstractmethod
    def add(self, hostname: str, authorized_keys: str, user: str = "root", data_disk: int | None = None,
            image: str | None = None):
        """Boot a node whose login user ``user`` has the key pair ``authorized_keys``, with a data disk of
        ``data_disk`` bytes (None: none), from the image named ``image``; returns it (``.ip``, ``.dir`` with its host keys, ``.sshd_pid``,
        ``.netns``)."""

    @abstractmethod
    def stop_sshd(self, node) -> None:
        """The node runs, but its sshd never answers (fault injection)."""

    @abstractmethod
    def run(self, hostname: str, script: str):
        """Run a script on the node as its boot does (user_data); returns a CompletedProcess."""

    @abstractmethod
    def remove(self, hostname: str) -> None:
        """Tear the node down; what it wrote may still be wiped by ``wipe``."""

    def wipe(self) -> None:
        """Delete what removed nodes left (their disks), after their hosts are free again."""

    @abstractmethod
    def netns_of(self, hostname: str) -> str:
        ...

    @abstractmethod
    def address(self, netns: str, address: str, *, add: bool) -> None:
        """Add or remove a floating IP on a node."""

    @abstractmethod
    def shutdown(self) -> None:
        ...

    def metadata_socket(self, port: int = 80):
        """A listening socket at 169.254.169.254:port as the nodes reach it, or None where nodes have no metadata."""
        return None


class TestbedNodes(NodeBackend):
    def __init__(self, testbed_name: str):
        self.name = testbed_name
        self.bridge = testbed.ensure_bridge(testbed_name)
        self.metadata_netns = testbed.ensure_metadata(testbed_name)

    @property
    def host_ip(self) -> str:
        return self.bridge.host_ip

    def add(self, hostname: str, authorized_keys: str, user: str = "root", data_disk: int | None = None,
            image: str | None = None):
        return testbed.add_node(self.name, hostname, authorized_keys, user=user, data_disk=data_disk, image=image)

    def stop_sshd(self, node) -> None:
        testbed.kill_pids([node.sshd_pid])

    def run(self, hostname: str, script: str):
        return testbed.node_exec(self.name, hostname, script)

    def remove(self, hostname: str) -> None:
        testbed.remove_node(self.name, hostname, wipe=False)

    def wipe(self) -> None:
        testbed.wipe_aside(self.name)

    def netns_of(self, hostname: str) -> str:
        tb = testbed.load(self.name)
        return next(n for n in tb.nodes if n.name == hostname).netns

    def address(self, netns: str, address: str, *, add: bool) -> None:
        testbed.node_address(netns, address, add=add)

    def metadata_socket(self, port: int = 80):
        return testbed.listen_in_netns(self.metadata_netns, testbed.METADATA_IP, port)

    def shutdown(self) -> None:
        with report.muted():
            testbed.down(self.name)
