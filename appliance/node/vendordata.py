"""Chameleon's on-node lease end (vendordata ``chameleon.lease_end``): live from the metadata service, else the cache.

CC images cache vendordata hourly in /var/cache/vendordata2.json (cache-vendordata.timer), so after a lease
extension the cache can show the old end for up to an hour: a node that stopped on it would stop a job whose lease
was just extended. The live document (Nova's metadata service, http://169.254.169.254/openstack/latest/
vendor_data2.json) shows the end Blazar has now; the cache is the fallback when the metadata service does not
answer (docs/chameleon.md B8).
"""

from __future__ import annotations

import datetime as dt
import json
import os
import time
import urllib.request
from collections.abc import Callable
from pathlib import Path

from ..protocol import Env

VENDORDATA = ("/var/cache/vendordata2.json",)
LIVE_URL = "http://169.254.169.254/openstack/latest/vendor_data2.json"
LIVE_TIMEOUT = 2.0  # a routine read (rank 0 asks between two steps)
LIVE_BACKOFF = 600.0  # after the live document failed, read only the cache for this long (not on Chameleon?)
# a read that decides a stop waits as long as Nova itself waits for a dynamic vendordata target, and 2 s more: 5 s
# to connect and 5 s to read (nova/conf/api.py vendordata_dynamic_connect_timeout, vendordata_dynamic_read_timeout)
RECHECK_TIMEOUT = 12.0

_live_down_until = 0.0


def parse_lease_end(doc) -> float | None:
    """``chameleon.lease_end`` of a vendordata document as a Unix time (UTC), or None."""
    try:
        end = doc["chameleon"]["lease_end"]
    except (KeyError, TypeError):
        return None
    for fmt in ("%Y-%m-%dT%H:%M:%S.%f", "%Y-%m-%dT%H:%M:%S", "%Y-%m-%d %H:%M:%S", "%Y-%m-%dT%H:%M:%SZ",
                "%Y-%m-%d %H:%M"):
        try:
            return dt.datetime.strptime(str(end).replace("+00:00", ""), fmt).replace(
                tzinfo=dt.timezone.utc).timestamp()
        except ValueError:
            pass
    return None


def live_lease_end(url: str = LIVE_URL, timeout: float = LIVE_TIMEOUT) -> float | None:
    """The lease end from the metadata service now (no proxy: the address is link-local), or None."""
    global _live_down_until
    if time.monotonic() < _live_down_until:
        return None
    opener = urllib.request.build_opener(urllib.request.ProxyHandler({}))
    try:
        with opener.open(url, timeout=timeout) as r:
            end = parse_lease_end(json.loads(r.read(1 << 20)))
    except (OSError, ValueError):
        end = None
    if end is None:
        _live_down_until = time.monotonic() + LIVE_BACKOFF
    return end


def cached_lease_end(paths=VENDORDATA) -> float | None:
    for p in paths:
        try:
            end = parse_lease_end(json.loads(Path(p).read_text()))
        except (OSError, ValueError):
            continue
        if end is not None:
            return end
    return None


def live_url() -> str | None:
    """The live document's address: APPLIANCE_VENDORDATA_URL when the launcher set it (empty: none), else Nova's."""
    v = os.environ.get(Env.VENDORDATA_URL)
    return LIVE_URL if v is None else (v or None)


_FROM_ENV = object()


def vendordata_lease_end(paths=VENDORDATA, live=_FROM_ENV, near: Callable[[float], bool] | None = None) -> float | None:
    """Chameleon's on-node lease end as a Unix time: the live document first, else the hourly cache. ``near(end)``:
    whether an end would make the caller stop; an end from the cache that would is checked against the live
    document once more, with RECHECK_TIMEOUT, whatever the backoff (the cache lags an extension by up to an hour,
    and a slow metadata service is no reason to stop a job whose lease was extended: issue 52)."""
    if live is _FROM_ENV:
        live = live_url()
    end = live_lease_end(live) if live else None
    if end is not None:
        return end
    end = cached_lease_end(paths)
    if end is not None and live and near is not None and near(end):
        reset_live_backoff()
        end = live_lease_end(live, timeout=RECHECK_TIMEOUT) or end
    return end


def reset_live_backoff() -> None:
    global _live_down_until
    _live_down_until = 0.0
