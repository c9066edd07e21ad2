"""Pick the node-local disk the appliance works on (code, staged data, local checkpoints).

On Chameleon the fast disk is often not the root disk: gpu_a100_pcie has its OS on the 1.92 TB NVMe, but
gpu_p100_nvlink boots from a 200 GB SSD beside a 1.6 TB NVMe, compute_liqid has two 3.84 TB NVMe drives
beside a 480 GB boot disk, and gpu_h100 boots from a 480 GB BOSS card next to a 3.84 TB NVMe. Those extra
drives come up blank and unmounted. ``choose`` reads ``lsblk --json`` and decides, in this order:

1. an NVMe filesystem mounted somewhere other than ``/`` and the system paths: work under it;
2. the root filesystem is on NVMe: keep the default work directory;
3. the largest blank NVMe disk (no partitions, no filesystem, not mounted, not in use): mkfs.ext4 it and
   mount it at ``/mnt/nvme`` (sudo; destructive only for a disk with nothing on it);
4. otherwise the default work directory.

``prepare`` runs that on a node over SSH and returns the directory. It is idempotent: after the first run
the disk is case 1. The decision is a pure function, unit-tested against lsblk output of those node types.
"""

from __future__ import annotations

import json
import shlex
from dataclasses import dataclass

from ..errors import ApplianceError
from .. import report

log = report.get(__name__)

MOUNT_POINT = "/mnt/nvme"
SYSTEM_MOUNTS = ("/boot", "/boot/efi", "[SWAP]", "/var", "/usr", "/home")
LSBLK = "lsblk --json --bytes -o NAME,PATH,TYPE,SIZE,FSTYPE,MOUNTPOINT"


@dataclass(frozen=True)
class DiskPlan:
    workdir: str  # where the appliance works on this node
    reason: str  # one line for the log
    mkfs: str | None = None  # a blank NVMe disk to format and mount at MOUNT_POINT
    size: int = 0  # bytes of the chosen device, 0 when unknown


def _walk(dev: dict, parent: str | None = None):
    yield dev, parent
    for child in dev.get("children") or []:
        yield from _walk(child, parent or dev["name"])


def choose(lsblk: dict | str, default_workdir: str, subdir: str = "appliance") -> DiskPlan:
    """The disk plan for one node, from ``lsblk --json --bytes -o NAME,PATH,TYPE,SIZE,FSTYPE,MOUNTPOINT``."""
    data = json.loads(lsblk) if isinstance(lsblk, str) else lsblk
    devices = data.get("blockdevices") or []
    mounted, root_on_nvme, blank = [], False, []
    for disk in devices:
        if disk.get("type") != "disk" or not str(disk.get("name", "")).startswith("nvme"):
            continue
        size = int(disk.get("size") or 0)
        in_use = False
        for dev, _ in _walk(disk):
            mp = dev.get("mountpoint")
            if dev.get("fstype") or mp or dev is not disk:
                in_use = True
            if mp == "/":
                root_on_nvme = True
            elif mp and mp not in SYSTEM_MOUNTS and not mp.startswith(("/boot", "/snap")):
                mounted.append((int(dev.get("size") or size), mp))
        if not in_use:
            blank.append((size, disk.get("path") or f"/dev/{disk['name']}"))
    if mounted:
        size, mp = max(mounted)
        return DiskPlan(f"{mp.rstrip('/')}/{subdir}", f"NVMe mounted at {mp}", size=size)
    if root_on_nvme:
        return DiskPlan(default_workdir, "the root filesystem is on NVMe")
    if blank:
        size, path = max(blank)
        return DiskPlan(f"{MOUNT_POINT}/{subdir}", f"blank NVMe {path} ({size / 1e12:.2f} TB): formatting it",
                        mkfs=path, size=size)
    return DiskPlan(default_workdir, "no NVMe device: using the default work directory")


def prepare(remote, default_workdir: str, user: str) -> DiskPlan:
    """Run ``choose`` on a node and carry it out (mkfs + mount when needed); returns the plan."""
    r = remote.run(LSBLK)
    if r.rc != 0:
        log.info(f"{remote.node.name}: lsblk failed ({r.err.strip()[:80]}); using {default_workdir}")
        return DiskPlan(default_workdir, "lsblk failed")
    plan = choose(r.out, default_workdir)
    if plan.mkfs:
        dev = shlex.quote(plan.mkfs)
        cmd = (f"sudo -n mkfs.ext4 -q -F -L appliance {dev} && sudo -n mkdir -p {MOUNT_POINT} && "
               f"sudo -n mount -o noatime {dev} {MOUNT_POINT} && "
               f"echo 'LABEL=appliance {MOUNT_POINT} ext4 defaults,noatime,nofail 0 2' | sudo -n tee -a /etc/fstab")
        r = remote.run(cmd)
        if r.rc != 0:
            raise ApplianceError(f"{remote.node.name}: could not format and mount {plan.mkfs}: "
                                 f"{(r.err or r.out).strip().splitlines()[-1:]}",
                                 fix="check `sudo -n true` works for the login user, or mount the disk by hand")
    if plan.workdir != default_workdir:
        wd = shlex.quote(plan.workdir)
        r = remote.run(f"sudo -n mkdir -p {wd} && sudo -n chown {shlex.quote(user)} {wd}")
        if r.rc != 0:
            raise ApplianceError(f"{remote.node.name}: could not create {plan.workdir}: {r.err.strip()[:120]}",
                                 fix="check `sudo -n true` works for the login user")
    log.info(f"{remote.node.name}: local disk {plan.workdir} ({plan.reason})")
    return plan
