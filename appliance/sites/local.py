"""The local cloud (appliance/localcloud on 127.0.0.1, servers are testbed namespaces): Chameleon's stand-in.

The only module of the appliance's steps that imports the simulator (`appliance.localcloud`, `appliance.testbed`);
the import-layers contract (.importlinter) keeps it so.
"""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

from .. import localcloud, paths, report, testbed
from ..cluster import Cluster, from_testbed
from ..errors import ApplianceError, SpecError
from ..spec import Spec, duration_seconds
from ..store.objects import StoreCreds
from .base import LoginKey, Site
from .openstack import OpenStackCloud
from .openstack_auth import connect

log = report.get(__name__)

KEY_NAME = "appliance-local"
LOCK = paths.LOCK


class LocalSite(Site):
    kind = "local"
    user = "cc"  # the local cloud's images are CC images: cc with passwordless sudo (localcloud/cloud.py IMAGE_USER)
    workdir = "/mnt/local"  # each testbed node's private "local SSD", root's until prepare_nodes
    boot_timeout = 120.0
    clean_timeout = 60.0  # the local cloud cleans a node for CLEAN_SECONDS (2 s; `cloud start --clean-seconds`)
    ssh_timeout = 60.0
    poll = 0.2
    lease_poll = 0.5
    # Horovod's background loop wakes every HOROVOD_CYCLE_TIME ms, 1 by default since Horovod 0.21 (5 before;
    # horovod/horovod horovod/common/operations.cc BackgroundThreadLoop), and with Gloo asks the other ranks over TCP
    # each time: ~12% of a core per rank, training or idle (2 ranks, 10 s idle after hvd.init(): 1.2 CPU-s each).
    # The local cloud's nodes share this one machine's cores, so that loop takes from the other ranks' training;
    # at 5 ms it is 0.37-0.55 CPU-s in those 10 s, at 10 ms 0.26 (20 ms: 0.23, the rank's other threads). A
    # Chameleon node's ranks have their own cores and keep Horovod's default.
    rank_env = {"HOROVOD_CYCLE_TIME": "10"}

    def connect(self):
        """The site's own Keystone and services: CHI@local, or CHI@local2 (started when first used), each with
        credentials of its own, as Chameleon's sites have. Starting it is said first: a user who meant Chameleon
        (OS_CLOUD not set) learns it before anything is uploaded to a store that `cloud stop` empties."""
        if not self.cloud_up():
            log.info(f"starting {self.describe()}, a simulator on this machine (`appliance cloud stop` ends it and "
                     "empties its store); for Chameleon, export OS_CLOUD (docs/chameleon.md)")
        localcloud.start(site=self.region)
        return OpenStackCloud(connect(cloud=localcloud.cloud_name(self.region),
                                      config_file=str(localcloud.clouds_yaml(self.region)), region=self.region))

    def login_key(self, key_name=None, key_file=None) -> LoginKey:
        """The user's key pair when the spec or `adopt --key-file` names one, as on Chameleon (``key_name`` must name
        a key pair the cloud has, e.g. from `openstack keypair create --public-key`, and ``key_file`` is its private
        key here); else the local cloud's own. It recorded its own key whatever was given, so nodes launched with
        the user's key pair refused it (issue 51)."""
        if key_file:
            path = Path(key_file).expanduser()
            if not path.is_file():
                raise ApplianceError(f"no private key at {key_file} on this machine",
                                     "set key_file (or --key-file) to the private key of your key pair")
            return LoginKey(key_name or "", str(path))
        if key_name and key_name != KEY_NAME:
            raise ApplianceError(f"key_name {key_name!r} without key_file: its private key is needed here",
                                 "set key_file in the spec (or --key-file) to the key pair's private key")
        priv, pub = _local_key()
        self.cloud.ensure_keypair(KEY_NAME, pub)
        return LoginKey(KEY_NAME, priv)

    @classmethod
    def check_spec(cls, spec: Spec) -> None:
        from ..localcloud.cloud import DEFAULT_POOLS, MAX_LEASE_SECONDS

        if duration_seconds(spec.lease.duration) > MAX_LEASE_SECONDS:  # what `up` would be told (Chameleon's cap)
            raise SpecError(f"lease.duration: {spec.lease.duration} is longer than the local cloud's 7-day maximum "
                            "(Chameleon's)", "use at most 7d and let the watchdog extend or resume")
        for at, nt in [("nodes.node_type", spec.nodes.node_type)] + [("nodes.alternatives", a.node_type)
                                                                      for a in spec.nodes.alternatives]:
            if nt not in DEFAULT_POOLS:
                raise SpecError(f"{at}: {nt!r} is not a node type of the local cloud",
                                f"use one of {', '.join(DEFAULT_POOLS)}")
        for at, site in [("site", spec.site)] + [("nodes.alternatives", a.site) for a in spec.nodes.alternatives]:
            if site is not None and site not in localcloud.SITES:
                raise SpecError(f"{at}: {site!r} is not a site of the local cloud",
                                f"use one of {', '.join(localcloud.SITES)}")

    @property
    def python(self) -> str:  # nodes share this machine's file system
        return localcloud.image_python(self.region)

    def describe(self) -> str:
        return f"the local cloud {self.region or localcloud.SITES[0]}"

    def cloud_up(self) -> bool:
        return bool(localcloud.status(self.region)["running"])

    def time_scale(self) -> float:
        """The local cloud's clock can run faster than real time (tests, the demo)."""
        return float(localcloud.admin("GET", "/clock", site=self.region).get("time_scale", 1.0))

    def _site_store_creds(self) -> StoreCreds:
        """The local cloud's store: its Ceph RGW takes Keystone tokens as Chameleon's does, so the same Keystone
        path, and for s3:// URLs the same EC2 credentials, which the RGW checks with Keystone (`store_creds`); the
        OpenStack Swift (APPLIANCE_LOCAL_STORE=swift) has only v1 auth and its own S3 keys."""
        if self.region not in (None, localcloud.SITES[0]):
            raise ApplianceError(f"the local cloud's {self.region} has no object store",
                                 f"use {localcloud.SITES[0]}'s: a run keeps its checkpoints at its own site")
        own = StoreCreds(**localcloud.object_store())
        if not localcloud.store_takes_keystone():
            return own
        from openstack.exceptions import ServiceDisabledException

        try:
            creds = self._keystone_store_creds()
        except ServiceDisabledException:
            # the store starts on first use, and a token from before that carries a catalog without it (Chameleon's
            # catalog always lists object-store): connect again, with a token whose catalog does
            self._cloud = None
            creds = self._keystone_store_creds()
        creds.s3_endpoint = own.s3_endpoint
        return creds

    def prepare_nodes(self, cluster: Cluster, session) -> None:
        """The node's local disk is mounted root-owned, as a freshly mounted NVMe drive is on Chameleon: give it to
        the login user, with sudo as local_disk.prepare does there."""
        wd = self.workdir

        def claim(remote):
            r = remote.run(f"test -O {wd} || sudo -n chown {self.user}: {wd}")
            if r.rc != 0:
                raise ApplianceError(f"{remote.node.name}: could not take {wd} for {self.user}: {r.err.strip()[:120]}",
                                     "check `sudo -n true` works for the login user")

        session.each(claim)  # node.workdir stays the site's (up set it)

    def install_options(self) -> dict:
        """Nodes are namespaces here: no PyPI, the host's packages, a per-node venv; the node's own Python, found
        by install-stack.sh as on Chameleon (a CC-Ubuntu24.04 node has no python3.11)."""
        return dict(venv=f"{self.workdir}/appliance/venv", system_deps=False, sudo=False, python="auto",
                    pip_env={"PIP_NO_INDEX": "1", "PIP_FIND_LINKS": str(local_wheelhouse())})

    def default_cluster(self, spec: Spec) -> Cluster:
        """The default testbed `tb` (brought up if needed), for runs with no cluster of their own."""
        tb = testbed.load("tb")
        if tb is None or not testbed.status("tb")["up"]:
            tb = testbed.up("tb", spec.nodes.count, slots=spec.nodes.slots)
        cl = from_testbed(tb)
        if cl.world_size != spec.world_size and not cl.single_host:
            raise ApplianceError(f"the testbed has {cl.world_size} slot(s) but {spec.path} asks for {spec.world_size}",
                                 f"run `appliance testbed down` and `appliance testbed up --nodes {spec.nodes.count}`")
        return cl


def _local_key() -> tuple[str, str]:
    d = localcloud.state_dir()
    priv = d / "id_ed25519"
    if not priv.exists():
        from cryptography.hazmat.primitives import serialization
        from cryptography.hazmat.primitives.asymmetric import ed25519

        key = ed25519.Ed25519PrivateKey.generate()
        paths.write_private(priv, key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.OpenSSH,
                                                    serialization.NoEncryption()))
        pub = key.public_key().public_bytes(serialization.Encoding.OpenSSH, serialization.PublicFormat.OpenSSH)
        (d / "id_ed25519.pub").write_text(pub.decode() + " appliance-local\n")
    return str(priv), (d / "id_ed25519.pub").read_text().strip()


def local_wheelhouse() -> Path:
    """The local cloud's nodes have no route to PyPI: fill a wheelhouse here (from pip's cache after the first
    time) that they read through the shared filesystem, with wheels for every Python a node may run
    (install-stack.sh's PYTHONS: a CC-Ubuntu24.04 node's is 3.12). Chameleon nodes use PyPI directly."""
    wh = Path.home() / ".cache" / "appliance" / "wheelhouse"
    wh.mkdir(parents=True, exist_ok=True)
    reqs = [line for line in LOCK.read_text().splitlines() if line and not line.startswith("#")
            and not line.startswith("horovod==")]
    have = [_wheelhouse_entry(p.name) for p in wh.iterdir()]
    pip = [sys.executable, "-m", "pip", "--disable-pip-version-check", "download", "-q", "--no-deps", "-d", str(wh)]
    cmds = []
    for version in node_pythons():
        tags = _tags_of(version)
        # (name, version) with a wheel this Python takes: a pin that moved, or a wheel of another Python, is missing
        got = {(n, v) for n, v, t in have if t is None or t & tags}
        names = {n for n, _ in got}
        missing = [r for r in reqs if (_norm(r.split("==")[0]), _version(r.split("==")[1])) not in got] + \
            [r for r in ("pip", "setuptools", "wheel") if r not in names]
        if missing:
            this = version == "%d.%d" % sys.version_info[:2]
            cmds.append(pip + ([] if this else _other_python(version)) + missing)
    if ("horovod", paths.lock_pin("horovod")) not in {(n, v) for n, v, _ in have}:
        cmds.append(pip + ["--no-binary", ":all:", "horovod==" + paths.lock_pin("horovod")])
    if cmds:
        log.info(f"filling the local wheelhouse {wh} (Python {', '.join(node_pythons())}; from PyPI or pip's cache)")
    for cmd in cmds:
        r = subprocess.run(cmd, capture_output=True, text=True)
        if r.returncode != 0:
            raise ApplianceError(f"pip download failed: {(r.stderr.strip().splitlines() or ['?'])[-1]}",
                                 "check this machine reaches PyPI")
    return wh


def node_pythons() -> list[str]:
    """The Pythons the stack installs on (install-stack.sh's PYTHONS, its one source)."""
    m = re.search(r'^PYTHONS="([^"]+)"', paths.shipped("images/install-stack.sh").read_text(), re.M)
    return m.group(1).split() if m else ["%d.%d" % sys.version_info[:2]]


def _platforms() -> list[str]:
    """This machine's manylinux platform tags, newest first (PEP 600, and the legacy aliases of PEP 599)."""
    import platform

    arch = platform.machine()
    glibc = platform.libc_ver()[1] or "2.17"
    minor = int(glibc.split(".")[1])
    return ([f"manylinux_2_{m}_{arch}" for m in range(minor, 4, -1)] +
            [f"manylinux{x}_{arch}" for x in ("2014", "2010", "1")] + [f"linux_{arch}"])


def _tags_of(version: str) -> set:
    from packaging import tags

    if version == "%d.%d" % sys.version_info[:2]:
        return set(tags.sys_tags())
    v = tuple(int(x) for x in version.split("."))
    return set(tags.cpython_tags(v, platforms=_platforms())) | set(tags.compatible_tags(v, platforms=_platforms()))


def _other_python(version: str) -> list[str]:
    """pip download's options for another Python's wheels (binary only: pip cannot build for another Python)."""
    plat = [a for p in _platforms() for a in ("--platform", p)]
    return ["--only-binary", ":all:", "--python-version", version, "--implementation", "cp", *plat]


def _norm(name: str) -> str:  # PEP 503
    return re.sub(r"[-_.]+", "-", name).lower()


def _version(v: str) -> str:  # PEP 440's normal form, as parse_wheel_filename gives it
    from packaging.version import InvalidVersion, Version

    try:
        return str(Version(v))
    except InvalidVersion:
        return v


def _wheelhouse_entry(filename: str) -> tuple[str, str, set | None]:
    """(normalised name, version, the wheel's tags) of a wheel; an sdist (``name-version.tar.gz``) has no tags."""
    if filename.endswith(".whl"):
        from packaging.utils import parse_wheel_filename

        name, version, _build, tags = parse_wheel_filename(filename)
        return _norm(name), str(version), set(tags)
    name, _, version = re.sub(r"\.(tar\.gz|zip)$", "", filename).rpartition("-")
    return _norm(name), _version(version), None


# `appliance cloud` and `appliance testbed`: the simulator itself, reached through the local site
cloud_start, cloud_stop, cloud_status = localcloud.start, localcloud.stop, localcloud.status
testbed_up, testbed_down, testbed_status = testbed.up, testbed.down, testbed.status
