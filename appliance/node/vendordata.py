"""Chameleon's on-node lease end, from the vendordata the CC images cache (``chameleon.lease_end``)."""

from __future__ import annotations

import datetime as dt
import json
from pathlib import Path

VENDORDATA = ("/var/cache/vendordata2.json",)


def vendordata_lease_end(paths=VENDORDATA) -> float | None:
    """Chameleon's on-node lease end (vendordata ``chameleon.lease_end``) as a Unix time, if readable."""
    for p in paths:
        try:
            end = json.loads(Path(p).read_text())["chameleon"]["lease_end"]
        except (OSError, KeyError, TypeError, ValueError):
            continue
        for fmt in ("%Y-%m-%dT%H:%M:%S.%f", "%Y-%m-%dT%H:%M:%S", "%Y-%m-%d %H:%M:%S", "%Y-%m-%dT%H:%M:%SZ",
                    "%Y-%m-%d %H:%M"):
            try:
                return dt.datetime.strptime(str(end).replace("+00:00", ""), fmt).replace(
                    tzinfo=dt.timezone.utc).timestamp()
            except ValueError:
                pass
    return None
