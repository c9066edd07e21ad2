"""The node-side watchdog (`appliance watchdog --node`, the image's appliance-watchdog.service).

It reads Chameleon's on-node lease end and writes the STOP file of every training job running on the node, for
jobs whose launcher went away; rank 0 then stops every rank after the same step and commits a checkpoint.
"""

from __future__ import annotations

import datetime as dt
import glob
import json
import os
import time
from collections.abc import Callable

from ..protocol import NODE_WATCH_MARGIN, RUN_MARKER, Env
from .vendordata import LIVE_URL, VENDORDATA, vendordata_lease_end
from .. import report

log = report.get(__name__)



def running_run_dirs(proc: str = "/proc") -> set[str]:
    """Run directories of the training processes running on this node (their APPLIANCE_RUN_DIR)."""
    return set(running_jobs(proc))


def running_jobs(proc: str = "/proc") -> dict[str, set[int]]:
    """Run directory -> the uids of the processes that name it (APPLIANCE_RUN_DIR in their environment)."""
    found: dict[str, set[int]] = {}
    for env_path in glob.glob(f"{proc}/[0-9]*/environ"):
        try:
            raw = open(env_path, "rb").read()
            uid = os.stat(os.path.dirname(env_path)).st_uid
        except OSError:
            continue
        for item in raw.split(b"\0"):
            if item.startswith(Env.RUN_DIR.encode() + b"="):
                found.setdefault(item.split(b"=", 1)[1].decode(errors="replace"), set()).add(uid)
    return found


def request_stop(run_dir: str, uids: set[int], body: dict) -> str | None:
    """Write the STOP file of one run directory, as root, safely: only a directory the launcher made (it holds
    RUN_MARKER), owned by a user whose process names it, opened without following a link at any step (the
    directory itself, the marker, the temporary file), then renamed into place. Returns why it did not, or None."""
    if not os.path.isabs(run_dir) or os.path.normpath(run_dir) != run_dir:
        return "not an absolute, normal path"
    try:
        fd = os.open(run_dir, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW)
    except OSError as e:
        return f"cannot open it as a directory without following links ({e.strerror})"
    try:
        st = os.fstat(fd)
        if st.st_uid not in uids:
            return f"owned by uid {st.st_uid}, not by the job's user"
        try:
            mfd = os.open(RUN_MARKER, os.O_RDONLY | os.O_NOFOLLOW, dir_fd=fd)
        except OSError:
            return "not a run directory the appliance made"
        try:
            if os.fstat(mfd).st_uid != st.st_uid:
                return "its marker belongs to another user"
        finally:
            os.close(mfd)
        if os.path.lexists(os.path.join(run_dir, "STOP")):
            return "a stop was already asked for"
        tmp = f".STOP.{os.getpid()}.tmp"
        try:
            os.unlink(tmp, dir_fd=fd)  # a leftover (or a planted link): removed, never followed
        except FileNotFoundError:
            pass
        tfd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o644, dir_fd=fd)
        with os.fdopen(tfd, "w") as fh:
            fh.write(json.dumps(body))
            if os.geteuid() == 0:
                os.fchown(fh.fileno(), st.st_uid, st.st_gid)  # the job's, so its next start can remove it
        os.replace(tmp, "STOP", src_dir_fd=fd, dst_dir_fd=fd)
        return None
    finally:
        os.close(fd)


def node_watch(*, margin: float = NODE_WATCH_MARGIN, poll: float = 60.0, once: bool = False, vendordata=None,
               live: str | None = LIVE_URL, proc: str = "/proc", now: Callable[[], float] = time.time) -> list[str]:
    """Watch Chameleon's on-node lease end (vendordata: live from the metadata service, else the hourly cache of
    the CC images) and, ``margin`` seconds before it, write the STOP file of every training job running on this
    node, as the launcher-side watchdog does: rank 0 then stops every rank after the same step and commits a
    checkpoint. This covers jobs whose launcher went away (a laptop closed). The node has no cloud credentials, so
    it cannot extend the lease; the launcher extends before this margin (protocol.NODE_WATCH_MARGIN). An end read
    from the cache is checked against the live document again before acting: the cache lags an extension by up
    to an hour. Returns the run directories it asked to stop (with ``once``: after one look)."""
    stopped: list[str] = []
    refused: set[str] = set()
    said_none = False
    while True:
        # about to act on the cache: the live document is asked once more, with Nova's own patience
        end = vendordata_lease_end(vendordata or VENDORDATA, live, near=lambda e: now() >= e - margin)
        if end is None:
            if not said_none:
                log.info("no lease end in vendordata (not a Chameleon node, or the cache is not written yet)")
                said_none = True
        elif now() >= end - margin:
            for d, uids in sorted(running_jobs(proc).items()):
                if d in stopped:
                    continue
                why = request_stop(d, uids, {"reason": "lease end (node watchdog)", "deadline": end - 30})
                if why is None:
                    stopped.append(d)
                    log.info(f"lease ends at {dt.datetime.fromtimestamp(end, dt.timezone.utc):%Y-%m-%d %H:%M} UTC: "
                             f"asked the job in {d} to stop and checkpoint")
                elif why != "a stop was already asked for" and d not in refused:
                    refused.add(d)
                    log.info(f"not stopping the job that names {d}: {why}")
        if once:
            return stopped
        time.sleep(poll)
