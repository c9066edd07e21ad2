"""The run's current cluster in its controller's state in the store (``state["cluster"]``, issue 77), so a controller
on any machine can take the run over: follow a job still training on it, reuse its lease while it runs, and keep
that lease from being deleted as nobody's (flows/leases.py).

What goes into the store: the cluster record (appliance/cluster.py) as it is saved under $APPLIANCE_HOME, its lease
(id, end, reservation), site record (region, servers, floating IP), nodes and addresses, the head, and the host
keys it pinned (public keys: SSH refuses a node whose key it does not know). What never goes: the private key that
logs in (only the spec's ``key_file`` on the machine that takes over, which must be the key pair's private key
there too), its path, the cluster's node-to-node key. Written when a job starts (control._ControlHook.started),
through the controller's state writes; read by ``adopt`` when a controller takes the run over.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

from .. import paths, report
from ..checkpoint import runs
from ..cluster import Cluster, find_cluster
from ..errors import ApplianceError

log = report.get(__name__)

LOCAL_ONLY = ("key_file", "known_hosts", "subset_of")  # paths of this machine's files, never in the store


def to_state(cl: Cluster) -> dict:
    """The cluster's record for the run's state in the store: no private key, no path to one; its pinned host keys
    as the known_hosts lines (``host_keys``). A view of part of a cluster (Cluster.subset) is recorded whole."""
    if cl.is_subset:
        cl = find_cluster(cl.name) or cl
    d = dataclasses.asdict(cl)
    for k in LOCAL_ONLY:
        d.pop(k, None)
    d["site"].pop("key_file", None)
    d["host_keys"] = _read(cl.known_hosts)
    return d


def _read(path: str | None) -> str:
    try:
        return Path(path).read_text() if path else ""
    except OSError:
        return ""


def rebuild(entry: dict, key_file: str) -> Cluster:
    """The cluster record ``entry`` (to_state) saved under this machine's $APPLIANCE_HOME, logging in with
    ``key_file``, its host keys pinned in its own known_hosts file. Returns it."""
    d = {k: v for k, v in entry.items() if k not in (*LOCAL_ONLY, "host_keys", "by")}
    known = paths.clusters_dir() / f"{d['name']}.known_hosts"
    known.parent.mkdir(parents=True, exist_ok=True)
    known.write_text(entry.get("host_keys") or "")
    cl = Cluster.from_dict({**d, "key_file": key_file, "known_hosts": str(known),
                            "site": {**(d.get("site") or {}), "key_file": key_file}})
    cl.save()
    return cl


def adopt(ctx, control, key_file=None) -> Cluster | None:
    """The run's current cluster from its state in the store, as this machine's record: the one here when it has
    the same lease, or when this machine wrote the state's (a record here is written before its lease is asked for,
    so it is this machine's newest: a handover's next lease asked for, its answer not yet recorded, must not give
    way to the job's older one), else rebuilt (the state written by a controller on another machine, which ran the
    run after this one); the login key is the spec's (``key_file``: its path, else the site's login_key of the
    spec). None: the state has none, or no key here (said in one line)."""
    entry = control.state.get("cluster")
    if not isinstance(entry, dict) or not entry.get("name") or not entry.get("nodes"):
        return None
    here = find_cluster(entry["name"])
    if here is not None and (here.lease_id == entry.get("lease_id") or runs.of_this_machine(entry.get("by") or "")
                             or not entry.get("by")):
        return here
    try:
        key = key_file or ctx.site.login_key(ctx.spec.key_name, ctx.spec.key_file).file
    except ApplianceError as e:
        log.info(f"[run] warning: run {ctx.spec.name}'s cluster {entry['name']} is not rebuilt here: {e.message} "
                 f"({e.fix})")
        return None
    cl = rebuild(entry, key)
    log.info(f"[run] run {ctx.spec.name}'s cluster {cl.name} (lease {cl.lease_id}, head {cl.head.name}) rebuilt "
             "here from the run's state in the store")
    control.record("cluster rebuilt", cluster=cl.name, lease_id=cl.lease_id)
    return cl


def leases_in_state(control) -> tuple[set[str], set[str]]:
    """(lease ids, lease names) of the cluster record in the run's state: a lease someone can use, never deleted
    as nobody's (leases.reconcile)."""
    entry = control.state.get("cluster")
    if not isinstance(entry, dict):
        return set(), set()
    if entry.get("lease_id"):
        return {entry["lease_id"]}, set()
    name = (entry.get("site") or {}).get("lease_name")  # asked for by name, not answered yet
    return set(), {name} if name else set()
