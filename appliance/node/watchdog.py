"""The node-side watchdog (`appliance watchdog --node`, the image's appliance-watchdog.service).

It reads Chameleon's on-node lease end and writes the STOP file of every training job running on the node, for
jobs whose launcher went away; rank 0 then stops every rank after the same step and commits a checkpoint.
"""

from __future__ import annotations

import datetime as dt
import glob
import json
import time
from collections.abc import Callable
from pathlib import Path

from ..protocol import Env
from .vendordata import VENDORDATA, vendordata_lease_end



def running_run_dirs(proc: str = "/proc") -> set[str]:
    """Run directories of the training processes running on this node (their APPLIANCE_RUN_DIR)."""
    found = set()
    for env_path in glob.glob(f"{proc}/[0-9]*/environ"):
        try:
            raw = open(env_path, "rb").read()
        except OSError:
            continue
        for item in raw.split(b"\0"):
            if item.startswith(Env.RUN_DIR.encode() + b"="):
                found.add(item.split(b"=", 1)[1].decode(errors="replace"))
    return found


def node_watch(*, margin: float = 600.0, poll: float = 60.0, once: bool = False, vendordata=None,
               proc: str = "/proc", log: Callable[[str], None] = print, now: Callable[[], float] = time.time) -> list[str]:
    """Watch Chameleon's on-node lease end (vendordata, cached hourly by the CC images) and, ``margin`` seconds
    before it, write the STOP file of every training job running on this node, as the launcher-side watchdog
    does: rank 0 then stops every rank after the same step and commits a checkpoint. This covers jobs whose
    launcher went away (a laptop closed). The node has no cloud credentials, so it cannot extend the lease.
    Returns the run directories it asked to stop (with ``once``: after one look)."""
    stopped: list[str] = []
    said_none = False
    while True:
        end = vendordata_lease_end(vendordata or VENDORDATA)
        if end is None:
            if not said_none:
                log("no lease end in vendordata (not a Chameleon node, or the cache is not written yet)")
                said_none = True
        elif now() >= end - margin:
            for d in sorted(running_run_dirs(proc)):
                stop = Path(d) / "STOP"
                if d in stopped or stop.exists() or not Path(d).is_dir():
                    continue
                tmp = stop.with_name(".STOP.tmp")
                tmp.write_text(json.dumps({"reason": "lease end (node watchdog)", "deadline": end - 30}))
                tmp.replace(stop)
                stopped.append(d)
                log(f"lease ends at {dt.datetime.fromtimestamp(end, dt.timezone.utc):%Y-%m-%d %H:%M} UTC: "
                    f"asked the job in {d} to stop and checkpoint")
        if once:
            return stopped
        time.sleep(poll)
