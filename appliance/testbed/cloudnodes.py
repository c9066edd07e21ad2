"""Single nodes on a bridge-only testbed: the local cloud's servers (appliance/localcloud/nodes.py), each added and
removed on its own as Nova boots and deletes it, and the testbed's metadata namespace where the local cloud serves
169.254.169.254."""

from __future__ import annotations

import ipaddress
import os
import shutil
import socket
import subprocess
import threading
import time
from pathlib import Path

from ..errors import ApplianceError
from .netns import (METADATA_IP, Testbed, TestbedNode, _alive, _base, _locked, _make_bridge, _run, _start_node,
                    _stop_node, _teardown, _wait_ready, load)



def ensure_bridge(name: str) -> Testbed:
    """A testbed with a bridge and no nodes yet (idempotent); nodes come and go with add/remove_node."""
    with _locked(name):
        tb = load(name)
        if tb is not None and _run("ip", "link", "show", tb.bridge or "", check=False).returncode == 0:
            return tb
        if tb is not None:
            _teardown(name, tb)
        base = _base(name)
        base.mkdir(parents=True, exist_ok=True)
        return _make_bridge(name, base)


def ensure_metadata(name: str) -> str:
    """The testbed's metadata namespace (idempotent): ``apl-NAME-md`` on the bridge at the subnet's .2, carrying
    169.254.169.254 as Neutron's metadata namespace does (neutron/agent/metadata/driver.py serves it from the
    DHCP or router namespace). Nodes added afterwards get a host route to it. Returns the namespace's name."""
    with _locked(name, wait=120):
        tb = load(name)
        if tb is None or not tb.bridge:
            raise ApplianceError(f"testbed {name} has no bridge")
        ns, veth = f"apl-{name}-md", f"apl{name}md"
        net = ipaddress.IPv4Network(f"{tb.host_ip}/{tb.prefix}", strict=False)
        ip = str(net.network_address + 2)
        if tb.metadata_ip == ip and Path("/run/netns", ns).exists():
            return ns
        _run("ip", "netns", "del", ns, check=False)
        _run("ip", "link", "del", veth, check=False)
        _run("ip", "netns", "add", ns)
        _run("ip", "link", "add", veth, "type", "veth", "peer", "name", "eth0", "netns", ns)
        _run("ip", "link", "set", veth, "master", tb.bridge, "up")
        _run("ip", "-n", ns, "addr", "add", f"{ip}/{tb.prefix}", "dev", "eth0")
        _run("ip", "-n", ns, "addr", "add", f"{METADATA_IP}/32", "dev", "eth0")
        _run("ip", "-n", ns, "link", "set", "eth0", "up")
        _run("ip", "-n", ns, "link", "set", "lo", "up")
        tb.metadata_ip = ip
        tb.save()
        return ns


def listen_in_netns(netns: str, address: str, port: int) -> socket.socket:
    """A listening TCP socket bound inside namespace ``netns``, for a server in this process (a socket stays in the
    namespace it was made in). setns(2) moves only the calling thread, so a short-lived thread makes it."""
    import ctypes

    libc = ctypes.CDLL(None, use_errno=True)
    clone_newnet = 0x40000000
    got: dict = {}

    def make():
        own = os.open("/proc/thread-self/ns/net", os.O_RDONLY)
        target = os.open(f"/run/netns/{netns}", os.O_RDONLY)
        try:
            if libc.setns(target, clone_newnet) != 0:
                raise OSError(ctypes.get_errno(), f"setns into {netns} failed")
            try:
                sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
                sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
                sock.bind((address, port))
                sock.listen(64)
                got["sock"] = sock
            finally:
                libc.setns(own, clone_newnet)
        except OSError as e:
            got["error"] = e
        finally:
            os.close(own)
            os.close(target)

    t = threading.Thread(target=make, name=f"listen-in-{netns}")
    t.start()
    t.join()
    if "error" in got:
        raise ApplianceError(f"cannot listen on {address}:{port} in {netns}: {got['error']}")
    return got["sock"]


def add_node(name: str, node_name: str, authorized_keys: str, *, ready_timeout: float = 20.0,
             user: str = "root", data_disk: int | None = None, image: str | None = None) -> TestbedNode:
    """Boot one node on testbed ``name`` and wait for its sshd. Returns the node record. ``user``: its login user
    (``nodeimage.default_user``); ``data_disk``: bytes of its data disk (None: none); ``image``: the CC image's
    name (``nodeimage.image_mounts``)."""
    with _locked(name, wait=120):
        tb = load(name)
        if tb is None:
            raise ApplianceError(f"testbed {name} does not exist")
        used = {int(n.veth.rsplit("v", 1)[1]) for n in tb.nodes if n.veth}
        index = next(i for i in range(1, 200) if i not in used)
        node = _start_node(tb, index, node_name, authorized_keys, user=user, data_disk=data_disk, image=image)
    _wait_ready(tb, [node], ready_timeout)
    return node


def remove_node(name: str, node_name: str, wipe: bool = True) -> list[str]:
    """Delete one node: its processes, namespace, link, disk and pinned key. Its disk is moved aside under the
    testbed's lock and wiped after it (``wipe=False``: left to the caller, ``wipe_aside``), so the wipe of a node
    that held a stack (~50,000 files) neither holds the lock nor keeps its host from the next server."""
    with _locked(name, wait=120):
        tb = load(name)
        if tb is None:
            return []
        keep, removed = [], []
        for n in tb.nodes:
            if n.name == node_name:
                removed += _stop_node(n)
                _set_aside(Path(n.dir))
            else:
                keep.append(n)
        tb.nodes = keep
        tb.save()
        kh = Path(tb.known_hosts)
        if kh.exists():
            kh.write_text("".join(line for line in kh.read_text().splitlines(True)
                                  if not line.startswith(f"{node_name},")))
    if wipe:
        wipe_aside(name)
    return removed


ASIDE = ".removed-"  # not a node's name (RUN-0, ...): a removed node's disk, waiting to be wiped


def _set_aside(d: Path) -> None:
    if d.exists():
        d.rename(d.with_name(f"{d.name}{ASIDE}{os.getpid()}-{time.monotonic_ns()}"))


def wipe_aside(name: str) -> None:
    """Delete the disks of removed nodes of testbed ``name`` (moved aside by ``remove_node``)."""
    tb = load(name)
    for d in (Path(tb.base).glob(f"*{ASIDE}*") if tb is not None else ()):
        shutil.rmtree(d, ignore_errors=True)


def node_exec(name: str, node_name: str, script: str, timeout: float = 120.0) -> subprocess.CompletedProcess:
    """Run a shell script inside a node (its network, UTS and mount namespaces), as cloud-init would."""
    tb = load(name)
    node = next((n for n in (tb.nodes if tb else []) if n.name == node_name), None)
    if node is None or not _alive(node.sshd_pid):
        raise ApplianceError(f"testbed {name}: node {node_name} is not running")
    return subprocess.run(["nsenter", "-t", str(node.sshd_pid), "-n", "-u", "-m", "--", "sh", "-c", script],
                          capture_output=True, text=True, timeout=timeout)
