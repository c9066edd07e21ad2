"""Choosing the node-local disk on Chameleon node types (lsblk --json shapes as those nodes report them)."""

import json

from appliance.sites import local_disk
from appliance.sites.local_disk import choose

TB = 10**12


def disk(name, size, children=(), fstype=None, mountpoint=None):
    return {"name": name, "path": f"/dev/{name}", "type": "disk", "size": size, "fstype": fstype,
            "mountpoint": mountpoint, "children": list(children) or None}


def part(name, size, fstype="ext4", mountpoint=None):
    return {"name": name, "path": f"/dev/{name}", "type": "part", "size": size, "fstype": fstype,
            "mountpoint": mountpoint}


def lsblk(*disks):
    return json.dumps({"blockdevices": list(disks)})


def root_sata(name="sda", size=240 * 10**9):
    return disk(name, size, [part(f"{name}1", 2**20, fstype=None), part(f"{name}2", size - 2**21, mountpoint="/")])


def test_rtx6000_has_no_nvme():
    p = choose(lsblk(root_sata()), "/home/cc")
    assert (p.workdir, p.mkfs) == ("/home/cc", None)


def test_a100_root_on_nvme_keeps_the_home_directory():
    d = disk("nvme0n1", int(1.92 * TB), [part("nvme0n1p1", 2**29, fstype="vfat", mountpoint="/boot/efi"),
                                           part("nvme0n1p2", int(1.9 * TB), mountpoint="/")])
    p = choose(lsblk(d), "/home/cc")
    assert (p.workdir, p.mkfs) == ("/home/cc", None)


def test_p100_nvlink_formats_the_blank_nvme():
    p = choose(lsblk(root_sata(size=200 * 10**9), disk("nvme0n1", int(1.6 * TB))), "/home/cc")
    assert p.mkfs == "/dev/nvme0n1"
    assert p.workdir == "/mnt/nvme/appliance"


def test_liqid_picks_the_largest_blank_nvme():
    p = choose(lsblk(root_sata(size=480 * 10**9), disk("nvme0n1", int(3.84 * TB)), disk("nvme1n1", int(3.9 * TB))),
               "/home/cc")
    assert p.mkfs == "/dev/nvme1n1"


def test_an_nvme_with_data_on_it_is_never_formatted():
    # a partitioned but unmounted NVMe (someone's data) and one with a bare filesystem: neither is blank
    used = disk("nvme0n1", int(3.84 * TB), [part("nvme0n1p1", int(3.84 * TB))])
    fs = disk("nvme1n1", int(3.84 * TB), fstype="xfs")
    p = choose(lsblk(root_sata(), used, fs), "/home/cc")
    assert (p.workdir, p.mkfs) == ("/home/cc", None)


def test_a_mounted_nvme_is_used_so_reruns_are_idempotent():
    after = disk("nvme0n1", int(1.6 * TB), fstype="ext4", mountpoint="/mnt/nvme")
    p = choose(lsblk(root_sata(), after), "/home/cc")
    assert (p.workdir, p.mkfs) == ("/mnt/nvme/appliance", None)


class FakeRemote:
    """Records commands; answers lsblk with a p100_nvlink node's disks."""

    class node:
        name = "node1"

    def __init__(self, fail_on=None):
        self.commands, self.fail_on = [], fail_on

    def run(self, cmd, **kw):
        from appliance.remote import Result
        self.commands.append(cmd)
        if cmd.startswith("lsblk"):
            return Result(0, lsblk(root_sata(), disk("nvme0n1", int(1.6 * TB))), "")
        if self.fail_on and self.fail_on in cmd:
            return Result(1, "", "sudo: a password is required\n")
        return Result(0, "", "")


def test_prepare_formats_mounts_and_owns_the_directory():
    r = FakeRemote()
    p = local_disk.prepare(r, "/home/cc", "cc")
    assert p.workdir == "/mnt/nvme/appliance"
    assert "mkfs.ext4" in r.commands[1] and "/dev/nvme0n1" in r.commands[1] and "/etc/fstab" in r.commands[1]
    assert "chown cc /mnt/nvme/appliance" in r.commands[2]


def test_prepare_without_sudo_is_a_clear_error():
    import pytest
    from appliance.errors import ApplianceError
    with pytest.raises(ApplianceError, match="could not format and mount /dev/nvme0n1"):
        local_disk.prepare(FakeRemote(fail_on="mkfs"), "/home/cc", "cc")
