"""Chameleon Cloud (CHI@UC, CHI@TACC): OpenStack + Blazar, bare-metal nodes booted from the appliance image."""

from __future__ import annotations

from pathlib import Path

from ..cluster import Cluster
from ..errors import ApplianceError, SpecError
from ..spec import Nodes, Spec, duration_seconds
from ..store.objects import StoreCreds
from . import local_disk
from .base import NEW_KEY, LoginKey, Site
from .openstack import OpenStackCloud
from .openstack_auth import connect

CHAMELEON_PYTHON = "/opt/appliance/venv/bin/python"  # the appliance image's venv (images/)
SITES = ("CHI@UC", "CHI@TACC")  # bare-metal sites with GPU nodes
MAX_LEASE_S = 7 * 86400  # Chameleon's lease cap
DEFAULT_KEYS = ("~/.ssh/id_ed25519", "~/.ssh/id_rsa")  # the private key a spec without key_file logs in with


def default_key() -> str | None:
    """The first of DEFAULT_KEYS on this machine (expanded), or None."""
    return next((str(p) for k in DEFAULT_KEYS if (p := Path(k).expanduser()).exists()), None)


class ChameleonSite(Site):
    kind = "chameleon"
    user = "cc"  # CC images' login user
    workdir = "/home/cc"
    python = CHAMELEON_PYTHON
    boot_timeout = 1800.0  # bare metal deploys in 10-20 min
    ssh_timeout = 900.0
    poll = 2.0  # polling a remote API
    lease_poll = 60.0
    boot_note = " (bare metal: 10-20 min)"

    def connect(self):
        return OpenStackCloud(connect(region=self.region))

    def describe(self) -> str:
        import os

        where = self.region or (self._cloud.region_name() if self._cloud is not None else None)
        entry = os.environ.get("OS_CLOUD")
        return " ".join(filter(None, ["Chameleon", where, f"(OS_CLOUD={entry})" if entry else None]))

    def login_key(self, key_name, key_file) -> LoginKey:
        key_file = key_file or default_key()
        if not key_file or not Path(key_file).expanduser().exists():
            raise ApplianceError(f"no private key for key pair {key_name!r} on this machine",
                                 "set key_file in the spec to the private key of key_name")
        return LoginKey(key_name or "", str(Path(key_file).expanduser()))

    def catalog(self, node_type: str, site: str | None = None) -> dict | None:
        """The node types' table shipped with the appliance (chameleon_types.py, dated)."""
        from .chameleon_types import facts

        return facts(node_type, site or self.region)

    def check_here(self, spec: Spec) -> None:
        """key_file, or without it ~/.ssh/id_ed25519 or id_rsa (login_key's defaults), is a file here."""
        super().check_here(spec)
        if not spec.key_file and default_key() is None:
            raise SpecError(f"key_file: not set, and neither {' nor '.join(DEFAULT_KEYS)} is on this machine (the "
                            f"private key of key pair {spec.key_name!r} is needed to log in to the nodes)", NEW_KEY)

    def _site_store_creds(self) -> StoreCreds:
        return self._keystone_store_creds()

    @classmethod
    def check_spec(cls, spec: Spec) -> None:
        if duration_seconds(spec.lease.duration) > MAX_LEASE_S:
            raise SpecError(f"lease.duration: {spec.lease.duration} is longer than Chameleon's 7-day maximum",
                            "use at most 7d and let the watchdog extend or resume")
        for at, site in [("site", spec.site)] + [("nodes.alternatives", a.site) for a in spec.nodes.alternatives]:
            if site is not None and site not in SITES:
                raise SpecError(f"{at}: {site!r} is not a Chameleon bare-metal site with GPUs",
                                "use CHI@UC or CHI@TACC")
        if spec.nodes.node_type == Nodes.node_type:  # the default names the local cloud's node type
            raise SpecError(f"nodes.node_type: missing for cloud: chameleon ({Nodes.node_type} is the local cloud's)",
                            "set it to a node type of the site, e.g. gpu_rtx_6000 (the site's hardware catalog "
                            "lists them: https://chameleoncloud.org/hardware/)")
        if spec.image == Spec.image:
            raise SpecError(f"image: missing for cloud: chameleon ({Spec.image} is the local cloud's)",
                            "set image: appliance-gpu (built with `make image`, docs/image.md), or a stock image "
                            "such as CC-Ubuntu24.04-CUDA with `appliance up --install`")
        if not spec.key_name:
            raise SpecError("key_name: missing for cloud: chameleon", "set key_name to your Nova key pair's name")

    def prepare_nodes(self, cluster: Cluster, session) -> None:
        """The fast local disk (NVMe) for code, data and local checkpoints (sites/local_disk.py)."""
        plans = session.each(lambda r: local_disk.prepare(r, self.workdir, self.user))
        for node in cluster.nodes:
            node.workdir = plans[node.name].workdir

    def install_options(self) -> dict:
        return dict(venv=str(Path(CHAMELEON_PYTHON).parent.parent), system_deps=True, sudo=self.user != "root")
