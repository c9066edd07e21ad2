"""Where the staging benchmarks write: a fresh ext4 with a journal, formatted as `appliance up` formats a node's blank
NVMe disk (appliance/sites/local_disk.py: ``mkfs.ext4 -q -F -L appliance``), on a loop device over a sparse file in
the work directory (direct I/O, so the file's pages are not cached twice).

Why not the work directory itself: this machine's root file system is ext4 without a journal, and ext4 without a
journal, making a file, skips every free inode deleted in the last minute (five minutes while its inode table block
is dirty), looking each one up in that block (torvalds/linux fs/ext4/ialloc.c: ``recently_deleted``,
``RECENTCY_MIN`` 60 and ``RECENTCY_DIRTY`` 300, "In no journal mode"). A
benchmark that deletes 10,000 files and makes 10,000 more pays a scan that grows round after round: 5,000 files of
100 KB cost 0.32, 1.12, 1.59 and 3.58 s of system time in 4 rounds there, and 0.31-0.41 s each here; the stager on
5,000 objects from Ceph RGW 8.1-9.5 s of system time there, 2.6-3.1 s here (docs/staging.md, 2026-11-26). A
Chameleon node's disk, formatted by `appliance up` or by the image, has a journal.

    with node_disk(work, size) as (dest_root, what): ...   # what: a line for the report
Without root, or where loop devices cannot be had, it yields ``work`` itself and says so in ``what``.
"""

from __future__ import annotations

import os
import subprocess
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

MKFS = ["mkfs.ext4", "-q", "-F", "-L", "appliance"]  # appliance/sites/local_disk.py's
EAGER = ["-E", "lazy_itable_init=0,lazy_journal_init=0"]  # no inode tables zeroed in the background while we time


def _run(*argv: str) -> subprocess.CompletedProcess:
    return subprocess.run(argv, capture_output=True, text=True)


def _release(mnt: Path, image: Path) -> None:
    """Unmount ``mnt`` and detach every loop device over ``image`` (what a killed run left, too)."""
    if _run("mountpoint", "-q", str(mnt)).returncode == 0:
        _run("umount", str(mnt))
    if image.exists():
        for line in _run("losetup", "-j", str(image)).stdout.splitlines():
            _run("losetup", "-d", line.split(":")[0])
        image.unlink()


@contextmanager
def node_disk(work: Path, size: int) -> Iterator[tuple[Path, str]]:
    """A journaled ext4 of ``size`` bytes (sparse) mounted at ``work/node-disk``; removed afterwards."""
    work.mkdir(parents=True, exist_ok=True)
    mnt, image = work / "node-disk", work / "node-disk.img"
    _release(mnt, image)
    why = "not root" if os.geteuid() != 0 else ""
    if not why:
        with open(image, "wb") as fh:
            fh.truncate(size)
        made = _run(*MKFS, *EAGER, str(image))
        loop = _run("losetup", "--find", "--show", "--direct-io=on", str(image)) if made.returncode == 0 else made
        mnt.mkdir(exist_ok=True)
        mounted = _run("mount", loop.stdout.strip(), str(mnt)) if loop.returncode == 0 else loop
        if mounted.returncode != 0:
            why = (mounted.stderr or mounted.stdout).strip().splitlines()[-1:] or ["mount failed"]
            why = why[0]
            _release(mnt, image)
    if why:
        yield work, f"the work directory's own file system ({why}: no loop-mounted ext4)"
        return
    try:
        yield mnt, (f"a fresh ext4 with a journal ({size / 2**30:.0f} GiB, `{' '.join(MKFS)}` as `appliance up` "
                    "formats a node's disk; on a loop device, direct I/O)")
    finally:
        _release(mnt, image)
