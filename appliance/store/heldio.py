"""A stager's small file-system calls (open, close, rename, a file's mtime, a journal's line, a small body's write)
with the GIL held: ``_heldio`` (a C extension, appliance/store/_heldio.c) where it is built, else the os module's,
which give the GIL back around each call. With 32 fetching threads on a few cores each such hand-over costs more
than the call: docs/staging.md of 14aa98a (in git), "Small objects: their MD5s in the lanes, their file calls with the GIL held". Only
for the stager's local destination: a call that waits on a device holds every thread with it. A large body's
buffer is written with the GIL released once, in pieces of WRITE_PIECE bytes (``pwrite_all``)."""

from __future__ import annotations

import os

try:
    from . import _heldio
except ImportError:  # not built here (no compiler when the package was installed): the os module's calls
    _heldio = None


def built() -> bool:
    return _heldio is not None


def open_file(path, flags: int, mode: int = 0o644) -> int:
    return _heldio.open(path, flags, mode) if _heldio is not None else os.open(path, flags, mode)


def close(fd: int) -> None:
    (_heldio or os).close(fd)


def replace(src, dst) -> None:
    (_heldio or os).replace(src, dst)


def mtime_ns(path) -> int:
    return _heldio.mtime_ns(path) if _heldio is not None else os.stat(path).st_mtime_ns


def write_all(fd: int, data: bytes) -> None:
    """All of ``data`` (a file opened with O_APPEND: one line, in one piece)."""
    if _heldio is not None:
        _heldio.write(fd, data)
        return
    view = memoryview(data)
    while view:
        view = view[os.write(fd, view):]


HELD_WRITE = 128 * 1024  # a write up to this size into the page cache is made with the GIL held (pwrite_all)
# The most one pwrite of a larger view puts into the page cache. The kernel sizes the page cache's folios by the
# write: a receive buffer (a core's L2, up to 1 MiB) in one pwrite fills folios that large, taken whole from the free
# lists; a VM whose host takes back free memory (free page reporting) faults on the host at the first touch of their
# pages; 128 KiB pieces cost less system time there and no more on memory the VM holds (2 GiB of 256 MiB objects,
# medians of 3, against 512 KiB pieces: plain objects 1.80 s against 3.59, our uploads' 1.42 against 2.35; warmed,
# 1.84 against 1.83 and 1.37 against 1.77: bench/results/stage-write-size/pieces.txt)
WRITE_PIECE = 128 * 1024


def pwrite_all(fd: int, view, pos: int) -> None:
    """All of ``view`` at ``pos`` of a file; up to HELD_WRITE bytes with the GIL held (a copy into the page cache
    of a few tens of microseconds, less than a hand-over of the GIL among the fetching threads), more with the GIL
    released once, in pwrites of up to WRITE_PIECE bytes. A regular file takes it all, short of a full disk (then
    ENOSPC is raised)."""
    if _heldio is not None:
        if len(view) <= HELD_WRITE:
            _heldio.pwrite(fd, view, pos)
        else:
            _heldio.pwrite_pieces(fd, view, pos, WRITE_PIECE)
        return
    done = 0
    while done < len(view):
        done += os.pwrite(fd, view[done:done + WRITE_PIECE], pos + done)
