"""Named points where a process can be killed on purpose (kill -9 of itself), for the fault matrix of managed runs
(tests/test_checkpoint.py): ``APPLIANCE_KILL_AT=POINT[:N],...`` kills the process the N-th time (default the first)
it reaches POINT. The points are where a killed controller leaves the most to find again:

- ``lease-asked``: the lease's record is in the store, Blazar not asked yet;
- ``lease-made``: Blazar made the lease, its answer not recorded anywhere yet;
- ``job-lock``: the job holds the run's lock in the store, and has not started on the head node;
- ``job-started``: the job runs, detached on the head node.

Unset (every user's case) it costs one dictionary lookup per point.
"""

from __future__ import annotations

import os
import signal

ENV = "APPLIANCE_KILL_AT"
_seen: dict[str, int] = {}


def here(point: str) -> None:
    """Kill this process with SIGKILL (nothing of it runs after: no finally, no atexit) when ``APPLIANCE_KILL_AT``
    names ``point`` and this is its N-th time here."""
    asked = os.environ.get(ENV)
    if not asked:
        return
    _seen[point] = _seen.get(point, 0) + 1
    for item in asked.split(","):
        name, _, nth = item.strip().partition(":")
        if name == point and _seen[point] == (int(nth) if nth.isdigit() else 1):
            os.kill(os.getpid(), signal.SIGKILL)
