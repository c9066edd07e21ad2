"""Testbed nodes as network namespaces, each with its own sshd.

Layout of a testbed named NAME (state under $APPLIANCE_HOME/testbeds/NAME):

    testbed.json            the record below (what exists, with PIDs)
    id_ed25519[.pub]        the key the launcher logs in with (the cloud's "key pair")
    known_hosts             every node's host key, pinned
    node1/                  sshd_config, hosts, sshd.log,
          disk/             bind-mounted at /mnt/local inside the node: its "local SSD"
          ssh/              bind-mounted at /root/.ssh inside the node
          etc/, home/       a node whose login user is not root (the local cloud's: cc, as on CC images): its own
                            passwd, group, shadow, sudoers.d and /home, bind-mounted (``nodeimage.default_user``)
          etc-ssh/          bind-mounted at /etc/ssh inside the node: its host keys where an image keeps them

Host side: a bridge ``apl-NAME`` with 10.77.X.1/24; node i is 10.77.X.(10+i) on its eth0. A testbed the local
cloud uses also has a metadata namespace ``apl-NAME-md`` (10.77.X.2, and 169.254.169.254 on its eth0) where the
local cloud's metadata service listens, and each node a host route to 169.254.169.254 through it.
Every namespace, link and process is recorded and removed by ``down``, by PID.
"""

from __future__ import annotations

import contextlib
import dataclasses
import fcntl
import ipaddress
import json
import os
import pwd
import re
import shutil
import signal
import socket
import subprocess
import sys
import time
import zlib
from dataclasses import dataclass, field
from pathlib import Path

from .. import paths, report
from ..errors import ApplianceError
from .nodeimage import DEFAULT_UID, default_user, image_mounts, root_home_for, sshd_config

log = report.get(__name__)

NAME_RE = re.compile(r"^[a-z][a-z0-9]{0,5}$")
NODE_MOUNT = "/mnt/local"  # where a node sees its local disk
# the local disk of a node booted from a stock CC image (the stack installed on it: a venv of ~50,000 files) is a
# tmpfs of this size, so removing the node frees it at once rather than by unlinking each file (a minute of this
# machine's disk under load); a Chameleon node's disk is ~200 GB, more than any test here writes
CC_DISK = "8g"
DATA_DIR = "data"  # a node's data disk, where one is asked for: at the dataset's default place (dataset.dest)
METADATA_IP = "169.254.169.254"  # Nova's metadata address, as instances see it
SSHD = "/usr/sbin/sshd"


@dataclass
class TestbedNode:
    name: str  # hostname inside the node
    ip: str  # its private address (on the bridge), or 127.0.0.1 in single-host mode
    dir: str  # host-side directory of this node
    netns: str | None = None
    veth: str | None = None
    sshd_pid: int | None = None
    slots: int = 1
    user: str = "root"  # the login user: root, or an image's default user (cc) that cloud-init made
    data_disk: int | None = None  # bytes of its data disk at disk/DATA_DIR (a tmpfs of that size); None: none

    @property
    def disk(self) -> str:
        """The node's local disk as seen from the host."""
        return str(Path(self.dir) / "disk")

    @property
    def workdir(self) -> str:
        """The node's local disk as seen from inside the node."""
        return NODE_MOUNT if self.netns else self.disk

    @property
    def host_key_pub(self) -> Path:
        """The node's SSH host public key (seen as /etc/ssh/ssh_host_ed25519_key.pub inside the node)."""
        return Path(self.dir) / "etc-ssh" / "ssh_host_ed25519_key.pub"


@dataclass
class Testbed:
    name: str
    mode: str  # "netns" or "single-host"
    base: str
    nodes: list[TestbedNode] = field(default_factory=list)
    bridge: str | None = None
    host_ip: str | None = None
    prefix: int = 24
    reason: str = ""  # why single-host mode was chosen
    metadata_ip: str | None = None  # the metadata namespace's address on the bridge (local cloud testbeds)

    @property
    def key_file(self) -> str:
        return str(Path(self.base) / "id_ed25519")

    @property
    def known_hosts(self) -> str:
        return str(Path(self.base) / "known_hosts")

    def save(self) -> None:
        p = Path(self.base) / "testbed.json"
        tmp = p.with_suffix(".tmp")
        tmp.write_text(json.dumps(dataclasses.asdict(self), indent=2))
        tmp.replace(p)

    @classmethod
    def from_dict(cls, d: dict) -> Testbed:
        d = dict(d)
        d["nodes"] = [TestbedNode(**n) for n in d.get("nodes", [])]
        return cls(**d)


# ---------------------------------------------------------------------------------------------
# helpers


def _run(*cmd: str, check: bool = True, input: str | None = None) -> subprocess.CompletedProcess:
    p = subprocess.run(cmd, capture_output=True, text=True, input=input)
    if check and p.returncode != 0:
        raise ApplianceError(f"testbed: `{' '.join(cmd)}` failed: {(p.stderr or p.stdout).strip()}")
    return p


def _base(name: str) -> Path:
    return paths.testbeds_dir() / name


@contextlib.contextmanager
def _locked(name: str, wait: float = 0.0):
    """The testbed's lock. ``wait``: seconds to wait for it (the local cloud boots and deletes servers in
    parallel threads, one node at a time each); 0 = fail at once (two CLI commands on one testbed)."""
    with open(paths.testbeds_dir() / f".{name}.lock", "w") as fh:
        deadline = time.monotonic() + wait
        while True:
            try:
                fcntl.flock(fh, fcntl.LOCK_EX | fcntl.LOCK_NB)
                break
            except BlockingIOError:
                if time.monotonic() >= deadline:
                    raise ApplianceError(f"testbed {name}: another `appliance testbed up/down` is running on it",
                                         "wait for it to finish, then run the command again") from None
                time.sleep(0.05)
        yield


def namespaces_available() -> tuple[bool, str]:
    """Whether netns nodes can be made here, and if not, why."""
    if os.geteuid() != 0:
        return False, "not running as root (network namespaces need root)"
    for tool in ("ip", "unshare", "ssh-keygen"):
        if not shutil.which(tool):
            return False, f"`{tool}` is not installed"
    if not os.path.exists(SSHD):
        return False, f"{SSHD} is missing (apt-get install openssh-server)"
    probe = f"apl-probe-{os.getpid()}"
    p = _run("ip", "netns", "add", probe, check=False)
    if p.returncode != 0:
        return False, f"cannot create network namespaces ({p.stderr.strip()})"
    _run("ip", "netns", "del", probe, check=False)
    return True, ""


def _pick_subnet(name: str) -> ipaddress.IPv4Network:
    """A free 10.77.X.0/24: deterministic from the name, skipping ones already on an interface."""
    used = _run("ip", "-o", "-4", "addr", "show", check=False).stdout
    start = 0 if name == "tb" else zlib.crc32(name.encode()) % 200 + 20
    for k in range(250):
        x = (start + k) % 250
        net = ipaddress.IPv4Network(f"10.77.{x}.0/24")
        if f" {net.network_address + 1}/" not in used:
            return net
    raise ApplianceError("testbed: no free 10.77.X.0/24 subnet", "remove old testbeds with `appliance testbed down`")


def _keygen(path: Path, comment: str) -> None:
    if not path.exists():
        _run("ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-C", comment, "-f", str(path))


def _alive(pid: int | None, needle: str = "") -> bool:
    if not pid:
        return False
    try:
        cmdline = Path(f"/proc/{pid}/cmdline").read_bytes().decode(errors="replace")
    except OSError:
        return False
    try:  # the process may end between the two reads: /proc answers ESRCH (ProcessLookupError) then
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return False
    if stat.split(") ", 1)[1].startswith("Z"):
        return False
    return needle in cmdline


def _tcp_open(ip: str, port: int = 22, timeout: float = 0.5) -> bool:
    try:
        with socket.create_connection((ip, port), timeout=timeout) as s:
            s.settimeout(timeout)
            return s.recv(4).startswith(b"SSH")
    except OSError:
        return False


def _netns_pids(ns: str) -> list[int]:
    p = _run("ip", "netns", "pids", ns, check=False)
    return [int(x) for x in p.stdout.split()] if p.returncode == 0 else []


def _kill_pids(pids: list[int], wait: float = 5.0) -> None:
    """SIGKILL each PID and wait (bounded) until they are gone, reaping our own children."""
    for pid in pids:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)
    deadline = time.monotonic() + wait
    pending = set(pids)
    while pending and time.monotonic() < deadline:
        for pid in list(pending):
            with contextlib.suppress(ChildProcessError, OSError):
                os.waitpid(pid, os.WNOHANG)
            if not _alive(pid):
                pending.discard(pid)
        if pending:
            time.sleep(0.02)  # bounded wait for the kernel to finish the kills


# A node's orphans (the detached job's wrapper once its SSH session has gone, a killed rank's children) are reaped at
# once by its PID 1 (systemd on Chameleon's images). Here the host's PID 1 is theirs, and one that reaps late (this
# VM's reaped after ~1.3 s) left each ended job a zombie that `tail --pid` took for alive. The node's sshd is made
# their reaper: PR_SET_CHILD_SUBREAPER (prctl(2); kept across execve, so the process that execs down to `sshd -D`
# keeps it), and OpenSSH's main_sigchld_handler reaps every child with waitpid(-1) (openssh-portable sshd.c, 9.2).
_REAPS_ORPHANS = ("import ctypes, os, sys; ctypes.CDLL(None).prctl(36, 1, 0, 0, 0); "  # 36: PR_SET_CHILD_SUBREAPER
                  "os.execvp(sys.argv[1], sys.argv[1:])")


# ---------------------------------------------------------------------------------------------
# verbs


def load(name: str = "tb") -> Testbed | None:
    p = _base(name) / "testbed.json"
    if not p.exists():
        return None
    return Testbed.from_dict(json.loads(p.read_text()))


def _healthy(tb: Testbed) -> bool:
    if tb.mode == "single-host":
        return True
    return all(_alive(n.sshd_pid, "sshd") and _tcp_open(n.ip) for n in tb.nodes)


def up(name: str = "tb", nodes: int = 2, *, slots: int = 1, mode: str = "auto",
       ready_timeout: float = 20.0, data_disk: int | None = None) -> Testbed:
    """Bring up a testbed of ``nodes`` nodes. Idempotent: a healthy testbed of that size is reused.
    ``data_disk``: each node has a data disk of that many bytes at /mnt/local/data (namespace nodes)."""
    if not NAME_RE.match(name):
        raise ApplianceError(f"testbed name {name!r} is invalid", "use 1-6 lowercase letters/digits, e.g. tb")
    if nodes < 1 or nodes > 50:
        raise ApplianceError(f"testbed: {nodes} nodes requested", "ask for 1 to 50 nodes")
    with _locked(name):
        tb = load(name)
        if tb is not None:
            if _healthy(tb) and (len(tb.nodes) == nodes or tb.mode == "single-host"):
                log.info(f"testbed {name} is already up ({len(tb.nodes)} node(s), {tb.mode}); nothing to do")
                return tb
            if _healthy(tb):
                raise ApplianceError(f"testbed {name} is up with {len(tb.nodes)} nodes, not {nodes}",
                                     f"run `appliance testbed down --name {name}` first")
            log.info(f"testbed {name} is partly down; cleaning up before bringing it up again")
            _teardown(name, tb)
        ok, reason = namespaces_available() if mode in ("auto", "netns") else (False, "single-host mode requested")
        if not ok and mode == "netns":
            raise ApplianceError(f"testbed: cannot make namespace nodes: {reason}", "run as root on Linux, or use --mode single-host")
        base = _base(name)
        base.mkdir(parents=True, exist_ok=True)
        try:
            if ok:
                tb = _up_netns(name, base, nodes, slots, ready_timeout, data_disk)
            else:
                log.info(f"testbed {name}: single-host mode ({reason}): all {nodes * slots} slots on this machine, "
                         "no SSH")
                tb = _up_single(name, base, nodes * slots, reason)
        except BaseException:
            partial = load(name)
            if partial is not None:
                _teardown(name, partial)
            raise
        return tb


def _up_single(name: str, base: Path, slots: int, reason: str) -> Testbed:
    d = base / "local"
    (d / "disk").mkdir(parents=True, exist_ok=True)
    tb = Testbed(name=name, mode="single-host", base=str(base), reason=reason,
                 nodes=[TestbedNode(name=socket.gethostname(), ip="127.0.0.1", dir=str(d), slots=slots)])
    tb.save()
    return tb


@contextlib.contextmanager
def _subnets_locked():
    """Machine-wide, while a free subnet is picked and put on a bridge: testbeds brought up at once from different
    APPLIANCE_HOMEs (two users, test workers) could otherwise both find the same 10.77.X.0/24 free."""
    import tempfile

    with open(Path(tempfile.gettempdir()) / "appliance-testbed-subnets.lock", "w") as fh:
        fcntl.flock(fh, fcntl.LOCK_EX)
        yield


def _make_bridge(name: str, base: Path) -> Testbed:
    with _subnets_locked():
        return _make_bridge_on(name, base, _pick_subnet(name))


def _make_bridge_on(name: str, base: Path, net: ipaddress.IPv4Network) -> Testbed:
    host_ip = str(net.network_address + 1)
    bridge = f"apl-{name}"
    tb = Testbed(name=name, mode="netns", base=str(base), bridge=bridge, host_ip=host_ip, prefix=net.prefixlen)
    _keygen(base / "id_ed25519", f"appliance-testbed-{name}")
    root_home = Path(pwd.getpwuid(0).pw_dir)
    for mnt in (Path(NODE_MOUNT), root_home / ".ssh"):
        if not mnt.exists():
            mnt.mkdir(mode=0o700, parents=True)
    Path("/run/sshd").mkdir(mode=0o755, exist_ok=True)
    Path(tb.known_hosts).touch()
    tb.save()  # record early so a failure half-way can be torn down
    # An address of its own: a bridge without one takes its lowest port's and changes it when that port goes
    # (net/bridge/br_stp_if.c br_stp_recalculate_bridge_id), and the other nodes' ARP entries for this machine then
    # point at a port that is gone until they expire (up to a minute: SSH to them timed out meanwhile). A Chameleon
    # node's gateway keeps its MAC when another server is deleted. Locally administered (02:...), random.
    mac = "02:" + ":".join(f"{b:02x}" for b in os.urandom(5))
    _run("ip", "link", "add", bridge, "address", mac, "type", "bridge")
    _run("ip", "addr", "add", f"{host_ip}/{net.prefixlen}", "dev", bridge)
    _run("ip", "link", "set", bridge, "up")
    return tb


def _start_node(tb: Testbed, index: int, node_name: str, authorized_keys: str, slots: int = 1,
                ip: str | None = None, user: str = "root", data_disk: int | None = None,
                image: str | None = None) -> TestbedNode:
    """Create one node (namespace, veth, sshd) on the testbed's bridge; does not wait for sshd. ``user``: the
    login user; another than root is made as cloud-init makes an image's default user (``nodeimage.default_user``).
    ``data_disk``: a disk of that many bytes for data at ``/mnt/local/data``, the login user's, smaller than the
    datasets a test streams (a write past it fails with ENOSPC, and ``df`` says its size): a tmpfs, mounted on the
    host so the host sees into it as into the rest of the node's disk. ``image``: the CC image it boots from, where that
    differs from this machine (``nodeimage.image_mounts``)."""
    base = Path(tb.base)
    net = ipaddress.IPv4Network(f"{tb.host_ip}/{tb.prefix}", strict=False)
    root_home = Path(pwd.getpwuid(0).pw_dir)
    d = base / node_name
    (d / "disk").mkdir(parents=True, exist_ok=True)
    if image and image.startswith("CC-"):  # a stock CC image: the stack is installed on it (~50,000 files)
        _run("mount", "-t", "tmpfs", "-o", f"size={CC_DISK},mode=755", f"apl-disk-{node_name}", str(d / "disk"))
    if data_disk:
        owner = 0 if user == "root" else DEFAULT_UID
        (d / "disk" / DATA_DIR).mkdir(exist_ok=True)
        _run("mount", "-t", "tmpfs", "-o", f"size={int(data_disk)},mode=755,uid={owner},gid={owner}",
             f"apl-data-{node_name}", str(d / "disk" / DATA_DIR))
    (d / "ssh").mkdir(mode=0o700, parents=True, exist_ok=True)
    os.chmod(d / "ssh", 0o700)
    etc_ssh = d / "etc-ssh"
    etc_ssh.mkdir(mode=0o755, parents=True, exist_ok=True)
    for f in ("ssh_config", "moduli"):  # the node's ssh client and sshd read these, as the host's do
        if Path("/etc/ssh", f).is_file():
            shutil.copy(Path("/etc/ssh", f), etc_ssh / f)
    node = TestbedNode(name=node_name, ip=ip or str(net.network_address + 10 + index), dir=str(d),
                       netns=f"apl-{tb.name}-{node_name}", veth=f"apl{tb.name}v{index}", slots=slots, user=user,
                       data_disk=data_disk)
    tb.nodes.append(node)
    tb.save()
    _keygen(etc_ssh / "ssh_host_ed25519_key", f"root@{node_name}")
    mounts = ""
    if user == "root":
        (d / "ssh" / "authorized_keys").write_text(authorized_keys)
    else:
        mounts = default_user(d, user, authorized_keys) + root_home_for(d, root_home)
    mounts += image_mounts(d, image)
    os.chmod(d / "ssh" / "authorized_keys", 0o600)
    (d / "hosts").write_text(f"127.0.0.1\tlocalhost\n{node.ip}\t{node_name}\n")
    (d / "sshd_config").write_text(sshd_config(node))
    ns = node.netns
    _run("ip", "netns", "add", ns)
    _run("ip", "link", "add", node.veth, "type", "veth", "peer", "name", "eth0", "netns", ns)
    _run("ip", "link", "set", node.veth, "master", tb.bridge, "up")
    _run("ip", "-n", ns, "addr", "add", f"{node.ip}/{tb.prefix}", "dev", "eth0")
    # an address a deleted node had (servers come and go) may still sit in the bridge's neighbour cache with the
    # old node's MAC, REACHABLE for up to 45 s: forget it here, and announce the new MAC (gratuitous ARP at link up)
    # to the other namespaces on the bridge
    _run("ip", "neigh", "flush", "to", node.ip, "dev", tb.bridge, check=False)
    _run("ip", "netns", "exec", ns, "sh", "-c", "echo 1 > /proc/sys/net/ipv4/conf/eth0/arp_notify")
    _run("ip", "-n", ns, "link", "set", "eth0", "up")
    _run("ip", "-n", ns, "link", "set", "lo", "up")
    _run("ip", "-n", ns, "route", "add", "default", "via", tb.host_ip)
    if tb.metadata_ip:  # the host route Neutron's DHCP agent hands out for metadata (neutron/agent/linux/dhcp.py)
        _run("ip", "-n", ns, "route", "add", f"{METADATA_IP}/32", "via", tb.metadata_ip)
    else:  # no metadata here: fail fast, never reach the host's own cloud metadata through its default route
        _run("ip", "-n", ns, "route", "add", "unreachable", f"{METADATA_IP}/32")
    # /dev/shm: a tmpfs of the node's own, as a machine's is (mode 1777, as systemd mounts it: src/shared/mount-setup.c
    # in systemd/systemd), gone with the node's mount namespace when its last process ends, with what a killed job
    # left there (multiprocessing's named semaphores)
    script = (
        f"hostname {node_name} && mount -t tmpfs -o mode=1777,nosuid,nodev tmpfs /dev/shm && "
        f"mount --bind {d}/hosts /etc/hosts && mount --bind {etc_ssh} /etc/ssh && "
        f"mount --rbind {d}/disk {NODE_MOUNT} && "  # with its data disk, where it has one
        f"{mounts}mount --bind {d}/ssh {root_home}/.ssh && "
        f"exec {SSHD} -D -f {d}/sshd_config -E {d}/sshd.log"
    )
    with open(d / "boot.log", "wb") as out:
        proc = subprocess.Popen(
            [sys.executable, "-c", _REAPS_ORPHANS, "ip", "netns", "exec", ns, "unshare", "--uts", "--mount",
             "--propagation", "private", "sh", "-c", script],
            stdin=subprocess.DEVNULL, stdout=out, stderr=subprocess.STDOUT, start_new_session=True)
    node.sshd_pid = proc.pid
    keytype, key = node.host_key_pub.read_text().split()[:2]
    with open(tb.known_hosts, "a") as fh:
        fh.write(f"{node.name},{node.ip} {keytype} {key}\n")
    tb.save()
    return node


def _wait_ready(tb: Testbed, nodes: list[TestbedNode], timeout: float) -> None:
    deadline = time.monotonic() + timeout
    pending = list(nodes)
    while pending:
        for n in list(pending):
            if _tcp_open(n.ip):
                pending.remove(n)
            elif not _alive(n.sshd_pid, ""):
                logs = [Path(n.dir) / "boot.log", Path(n.dir) / "sshd.log"]
                text = " ".join(p.read_text()[-400:] for p in logs if p.exists())
                raise ApplianceError(f"testbed: sshd on {n.name} exited at start: {text.strip()}")
        if pending and time.monotonic() > deadline:
            raise ApplianceError(f"testbed: sshd on {', '.join(n.name for n in pending)} did not answer within "
                                 f"{timeout:.0f}s", "see sshd.log under " + tb.base)
        if pending:
            time.sleep(0.05)  # readiness poll of a local port


def _up_netns(name: str, base: Path, count: int, slots: int, ready_timeout: float,
              data_disk: int | None = None) -> Testbed:
    tb = _make_bridge(name, base)
    pub = (base / "id_ed25519.pub").read_text()
    for i in range(1, count + 1):
        _start_node(tb, i, f"node{i}", pub, slots=slots, data_disk=data_disk)
    _wait_ready(tb, tb.nodes, ready_timeout)
    log.info(f"testbed {name}: {count} node(s) up on {tb.bridge} ({tb.host_ip}/{tb.prefix})")
    return tb


def _stop_node(node: TestbedNode) -> list[str]:
    removed = []
    if node.netns:
        pids = _netns_pids(node.netns)
        if node.sshd_pid and node.sshd_pid not in pids and _alive(node.sshd_pid, "sshd"):
            pids.append(node.sshd_pid)
        if pids:
            _kill_pids(pids)
            removed.append(f"{len(pids)} process(es) in {node.netns}")
        if _run("ip", "netns", "del", node.netns, check=False).returncode == 0:
            removed.append(f"namespace {node.netns}")
    if node.veth and _run("ip", "link", "del", node.veth, check=False).returncode == 0:
        removed.append(f"link {node.veth}")
    for disk, what in ((os.path.join(node.disk, DATA_DIR), "data disk"), (node.disk, "disk")):
        if os.path.ismount(disk) and _run("umount", "--lazy", disk, check=False).returncode == 0:
            removed.append(f"{what} {disk}")  # its tmpfs, with what the node left there
    return removed


def _mounts_under(base: Path) -> list[str]:
    """Mount points at or below ``base`` (/proc/self/mounts escapes a space in a path as \\040)."""
    prefix = str(base).rstrip("/") + "/"
    points = [line.split()[1].replace("\\040", " ") for line in Path("/proc/self/mounts").read_text().splitlines()]
    return sorted((p for p in points if (p + "/").startswith(prefix)), reverse=True)


def _teardown(name: str, tb: Testbed | None) -> list[str]:
    removed: list[str] = []
    namespaces = set()
    if tb is not None:
        for n in tb.nodes:
            removed += _stop_node(n)
    # sweep anything of this testbed that the record may have missed
    listing = _run("ip", "netns", "list", check=False).stdout
    for line in listing.splitlines():
        ns = line.split()[0] if line.strip() else ""
        if ns.startswith(f"apl-{name}-"):
            namespaces.add(ns)
    for ns in sorted(namespaces):
        pids = _netns_pids(ns)
        if pids:
            _kill_pids(pids)
            removed.append(f"{len(pids)} process(es) in {ns}")
        if _run("ip", "netns", "del", ns, check=False).returncode == 0:
            removed.append(f"namespace {ns}")
    # delete host-side veths explicitly: a namespace the kernel keeps alive would otherwise keep its pair
    veths = {n.veth for n in tb.nodes if n.veth} if tb is not None else set()
    for line in _run("ip", "-o", "link", "show", check=False).stdout.splitlines():
        m = re.match(rf"^\d+: (apl{name}(?:v\d+|md))[@:]", line)
        if m:
            veths.add(m.group(1))
    for veth in sorted(veths):
        if _run("ip", "link", "del", veth, check=False).returncode == 0:
            removed.append(f"link {veth}")
    bridge = tb.bridge if tb and tb.bridge else f"apl-{name}"
    if _run("ip", "link", "del", bridge, check=False).returncode == 0:
        removed.append(f"bridge {bridge}")
    base = _base(name)
    for mnt in _mounts_under(base):  # a data disk whose node the record missed
        if _run("umount", "--lazy", mnt, check=False).returncode == 0:
            removed.append(f"data disk {mnt}")
    if base.exists():
        shutil.rmtree(base)
        removed.append(f"state {base}")
    return removed


def down(name: str = "tb", wait: float = 0.0) -> list[str]:
    """Remove the testbed: processes (by PID), namespaces, bridge, state. Idempotent. ``wait``: seconds to wait
    for the testbed's lock (the local cloud's stop, while its server's last node threads end)."""
    with _locked(name, wait):
        removed = _teardown(name, load(name))
    log.info(f"testbed {name}: removed " + (", ".join(removed) if removed else "nothing (it was not up)"))
    return removed


def status(name: str = "tb") -> dict:
    tb = load(name)
    if tb is None:
        return {"name": name, "up": False, "nodes": []}
    nodes = []
    for n in tb.nodes:
        if tb.mode == "single-host":
            st = "up"
        else:
            st = "up" if (_alive(n.sshd_pid, "sshd") and _tcp_open(n.ip)) else "down"
        nodes.append({"name": n.name, "ip": n.ip, "netns": n.netns, "sshd_pid": n.sshd_pid,
                      "slots": n.slots, "disk": n.disk, "state": st})
    return {"name": name, "up": all(x["state"] == "up" for x in nodes), "mode": tb.mode, "bridge": tb.bridge,
            "reason": tb.reason, "nodes": nodes}


def _netns_node(name: str, node: str) -> tuple[Testbed, TestbedNode]:
    """The testbed and its namespaced node ``node``, or a one-line error."""
    tb = load(name)
    if tb is None:
        raise ApplianceError(f"testbed {name} is not up", "run `appliance testbed up` first")
    n = next((x for x in tb.nodes if x.name == node and x.netns), None)
    if n is None:
        raise ApplianceError(f"testbed {name} has no node {node!r}", "see `appliance testbed status`")
    return tb, n


def kill_node(name: str, node: str) -> int:
    """Kill every process of one node (its sshd and whatever runs in it): the node 'dies'.

    Returns how many processes were killed.
    """
    pids = _netns_pids(_netns_node(name, node)[1].netns)
    _kill_pids(pids)
    return len(pids)


def cut_connections(name: str, node: str, peer: str | None = None) -> int:
    """Cut the SSH connections that ``peer`` (default: this machine, the launcher) has open to one node, as a
    network outage or a laptop put to sleep would: the sshd processes serving them are killed, the node and
    everything else on it keep running. Returns how many processes were killed."""
    tb, n = _netns_node(name, node)
    peer = peer or tb.host_ip
    out = _run("ip", "netns", "exec", n.netns, "ss", "-tnpH", "state", "established", "( sport = :22 )").stdout
    # not the node's listening sshd, which holds a connection it accepted until it has forked the child that serves it
    pids = sorted({int(m) for line in out.splitlines() if line.split()[3].rsplit(":", 1)[0] == peer
                   for m in re.findall(r"pid=(\d+)", line)} - {n.sshd_pid})
    _kill_pids(pids)
    return len(pids)


# -- what the local cloud's node backend uses (appliance/localcloud/nodes.py) ---------------------------------


def kill_pids(pids: list[int], wait: float = 5.0) -> None:
    """SIGKILL each PID and wait (bounded) until they are gone."""
    _kill_pids(pids, wait)


def node_address(netns: str, address: str, *, add: bool) -> None:
    """Add (or remove) an extra /32 address on a node's eth0: a floating IP associated with it."""
    _run("ip", "-n", netns, "addr", "add" if add else "del", f"{address}/32", "dev", "eth0", check=add)
    if add:  # the address may have been another node's: forget its old neighbour entries on the bridge side
        _run("ip", "neigh", "flush", "to", address, check=False)
