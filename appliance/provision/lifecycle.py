"""Cluster verbs: `appliance up`, `status`, `down`, and the lease verbs. One function per verb.

Each verb takes a ``Site`` (appliance.sites: Chameleon, or the local cloud whose servers are testbed nodes) and
asks it for everything that differs between them; nothing here branches on which site it is. Every step records
what it made in the cluster's state file before the next one starts, so a re-run after a failure
creates only what is missing, and `down` finds everything.
"""

from __future__ import annotations

import datetime as dt
import re
import threading
from collections.abc import Callable, Iterable
from concurrent.futures import ThreadPoolExecutor
import time
from pathlib import Path

from .. import killpoints, paths, report
from ..cluster import Cluster, Node, SiteRecord, delete_cluster, find_cluster, load_cluster, state_path
from ..errors import ApplianceError, NoHosts, Unanswered, Unavailable
from ..remote import HostKeyMismatch, KeyRefused, Session
from ..sites import Site, for_cluster
from ..sites.openstack import RESERVATION_KEY, fmt_date
from ..spec import Spec, duration_seconds
from .contextualize import contextualize

log = report.get(__name__)

HOSTKEYS_SCRIPT = (Path(__file__).with_name("hostkeys.sh")).read_text()  # every server's user_data

# ---------------------------------------------------------------------------------------------
# lease verbs


def lease_create(site: Site, spec: Spec, *, start: str | None = None) -> dict:
    begin = dt.datetime.strptime(start, "%Y-%m-%d %H:%M") if start and start != "now" else None
    info = site.cloud.create_lease(_lease_name(spec), spec.nodes.node_type, spec.nodes.count,
                                   dt.timedelta(seconds=duration_seconds(spec.lease.duration)), start=begin,
                                   floating_ip=spec.lease.floating_ip)
    return info.as_dict()


def _lease_name(spec: Spec) -> str:
    return f"{spec.name}-{time.strftime('%m%d%H%M%S')}"


def book(site: Site, spec: Spec, start: dt.datetime | None, *, on_ask: Callable | None = None) -> Cluster:
    """The lease of a cluster to come, asked for now to start at ``start`` (an advance reservation; None: now), and
    recorded under ``spec.name`` with no servers yet; `up` of the same spec later waits for it and goes on."""
    cluster, _ = _leased(site, spec, site.login_key(spec.key_name, spec.key_file), start=start, on_ask=on_ask)
    return cluster


def _leased(site: Site, spec: Spec, key, *, lease_id: str | None = None, start: dt.datetime | None = None,
            on_ask: Callable | None = None) -> tuple[Cluster, object]:
    """The cluster's record with its lease: the one it has while that runs, ``lease_id`` or the spec's, one an
    earlier `up` asked for under the recorded name, or a new one (from ``start``). ``on_ask(name, entry, info)``:
    told of a new lease before Blazar is asked (info None) and again with Blazar's answer (a managed run's ledger
    in the store, flows/leases.py: what a controller on another machine finds again)."""
    c = site.cloud
    cluster = find_cluster(spec.name)
    if cluster is not None and cluster.lease_id:
        info = c.get_lease(cluster.lease_id)
        if info is not None and info.status == "ERROR":  # Blazar keeps an ERROR lease's hosts until it goes
            log.info(f"the lease of {spec.name} ({info.id}) is in ERROR: deleting it (it holds its hosts), then "
                     "making a new lease")
            c.delete_lease(info.id)
        elif info is None or info.ended:
            log.info(f"the lease of {spec.name} has ended ({info.status if info else 'deleted'}); its servers are "
                     "gone. Making a new lease.")
        if info is None or info.unusable:
            delete_cluster(spec.name)
            cluster = None
    if cluster is None:
        cluster = _new_record(site, spec, key)
    lid = lease_id or spec.lease.lease_id or cluster.lease_id
    if lid is None:
        asked = {"cluster": spec.name, "site": spec.site, "node_type": spec.nodes.node_type,
                 "nodes": spec.nodes.count, "start": f"{start:%Y-%m-%d %H:%M}" if start else "now",
                 "duration": spec.lease.duration}
        info = _made_before(c, cluster.site.lease_name)
        if info is not None and on_ask is not None:  # made by an `up` that did not finish: its answer, now
            on_ask(info.name, {**asked, "lease_id": info.id}, info)
        if info is None:
            # the name first, then the lease: an `up` killed between Blazar's answer and the record's save (a
            # managed run's controller, mid-handover) leaves the name, so the next `up` finds that lease and
            # does not leave it behind unrecorded (issue 52: no orphan lease)
            cluster.site.lease_name = _lease_name(spec)
            cluster.save()
            if on_ask is not None:
                on_ask(cluster.site.lease_name, asked, None)
            killpoints.here("lease-asked")  # the fault matrix (killpoints.py): its record written, Blazar not asked
            try:
                info = c.create_lease(cluster.site.lease_name, spec.nodes.node_type, spec.nodes.count,
                                      dt.timedelta(seconds=duration_seconds(spec.lease.duration)), start=start,
                                      floating_ip=spec.lease.floating_ip)
            except Unanswered:  # it may have been made: the record keeps its name, and `up` or `down` finds it
                raise
            except ApplianceError as e:  # Blazar refused it: nothing was made, so no record of it is left
                if on_ask is not None:
                    on_ask(cluster.site.lease_name, {**asked, "refused": e.message[:200]}, None)
                if not cluster.site.servers:
                    delete_cluster(spec.name)
                raise
            killpoints.here("lease-made")  # the fault matrix: Blazar made it, its answer recorded nowhere yet
            if on_ask is not None:
                on_ask(cluster.site.lease_name, {**asked, "lease_id": info.id}, info)
            when = f"from {fmt_date(info.start)} " if start is not None else ""
            log.info(f"lease {info.name} ({info.id}) created: {spec.nodes.count} x {spec.nodes.node_type} "
                     f"{when}until {fmt_date(info.end)} UTC")
    else:
        info = c.get_lease(lid)
        if info is None:
            raise ApplianceError(f"no lease {lid}", "see `appliance lease list`")
    cluster.lease_id, cluster.reservation_id = info.id, info.reservation_id
    cluster.site.fip_reservation_id = info.fip_reservation_id
    cluster.save()
    return cluster, info


def _new_record(site: Site, spec: Spec, key) -> Cluster:
    return Cluster(name=spec.name, cloud=site.kind, nodes=[], key_file=key.file,
                   known_hosts=str(paths.clusters_dir() / f"{spec.name}.known_hosts"), python=site.python,
                   spec_digest=spec.digest, site=SiteRecord(region=spec.site, key_name=key.name, key_file=key.file,
                                                            spec_path=spec.path))


def record_lease(site: Site, spec: Spec, info) -> Cluster:
    """Cluster ``spec.name``'s record on the lease ``info``, which an `up` of it on another machine (a managed run's
    controller there, gone) made: `up` of the same spec then goes on on that lease, and uses the servers that `up`
    asked for on it (found by name and reservation: _adopt_unrecorded) rather than asking for more. A record here of
    the same name, of another lease, is replaced."""
    cluster = _new_record(site, spec, site.login_key(spec.key_name, spec.key_file))
    cluster.site.lease_name = info.name
    cluster.lease_id, cluster.reservation_id = info.id, info.reservation_id
    cluster.site.fip_reservation_id = info.fip_reservation_id
    cluster.lease_end = info.end.isoformat() + "Z"
    cluster.save()
    return cluster


def _adopt_unrecorded(c, spec: Spec, reservation_id: str, servers: dict[str, str]) -> None:
    """Servers an earlier `up` asked for on this reservation and never recorded (killed between Nova's answer and
    the record's save: a managed run's controller, mid-handover): found by name and by the reservation in their
    metadata, and used, rather than asked for again (a second server per node would find no host: the lease has
    one per node) and left behind."""
    missing = {f"{spec.name}-{i}" for i in range(spec.nodes.count)} - set(servers)
    if not missing:
        return
    for srv in c.find_servers(f"^{re.escape(spec.name)}-[0-9]+$"):
        if srv.name in missing and (getattr(srv, "metadata", None) or {}).get(RESERVATION_KEY) == reservation_id \
                and srv.status != "ERROR" and not _deleting(srv):
            log.info(f"  {srv.name}: server {srv.id} was asked for by an `up` that did not finish: using it")
            servers[srv.name] = srv.id
            missing.discard(srv.name)


def _made_before(c, name: str | None):
    """The lease an earlier `up` of this cluster asked Blazar for under ``name`` and never recorded (it was killed
    before its answer was saved), while it can still be used; else None."""
    if not name:
        return None
    for info in c.list_leases():
        if info.name == name and not info.unusable:
            log.info(f"lease {info.name} ({info.id}) was made by an `up` that did not finish: using it")
            return info
    return None


def image_upload(site: Site, path: str, name: str, *, disk_format: str | None = None) -> dict:
    """`appliance image upload`: a built image (make image) into the site's Glance, tagged with the lock it was
    built from. Glance images are per site: upload once per site you lease at."""
    import hashlib

    p = Path(path)
    if not p.is_file():
        raise ApplianceError(f"no image file {path}", "build one with `make image` (docs/image.md)")
    fmt = disk_format or {".qcow2": "qcow2", ".raw": "raw", ".img": "raw"}.get(p.suffix)
    if fmt is None:
        raise ApplianceError(f"cannot tell the disk format of {p.name}", "pass --disk-format qcow2 or raw")
    lock = paths.LOCK
    props = {"appliance_lock_sha256": hashlib.sha256(lock.read_bytes()).hexdigest()[:16] if lock.exists() else "",
             "appliance_stack": "tensorflow 2.18.1, tf-keras 2.18.0, horovod 0.28.1 (NCCL, Gloo)"}
    log.info(f"uploading {p} ({p.stat().st_size / 1e9:.2f} GB, {fmt}) to Glance as {name!r}"
             + (f" at {site.region}" if site.region else ""))
    return site.cloud.upload_image(str(p), name, disk_format=fmt, properties=props)


def lease_show(site: Site, lease_id: str) -> dict:
    info, now = site.cloud.lease_at(lease_id)
    if info is None:
        raise ApplianceError(f"no lease {lease_id}", "see `appliance lease list`")
    d = info.as_dict()
    d["seconds_left"] = max(0, int((info.end - now).total_seconds()))
    return d


def lease_list(site: Site) -> list[dict]:
    return [x.as_dict() for x in site.cloud.list_leases()]


def lease_extend(site: Site, lease_id: str, *, by: str | None = None, to: str | None = None) -> dict:
    c = site.cloud
    delta = dt.timedelta(seconds=duration_seconds(by)) if by else None
    end = dt.datetime.strptime(to, "%Y-%m-%d %H:%M") if to else None
    if not delta and not end:
        raise ApplianceError("nothing to extend by", "give --by 1d or --to 'YYYY-MM-DD HH:MM'")
    return c.extend_lease(lease_id, by=delta, to=end).as_dict()


def lease_delete(site: Site, lease_id: str) -> bool:
    return site.cloud.delete_lease(lease_id)


# ---------------------------------------------------------------------------------------------
# up


NO_VALID_HOST = "no valid host"  # Nova's NoValidHost, in a server's fault


def _no_valid_host(srv) -> bool:
    return NO_VALID_HOST in str((getattr(srv, "fault", None) or {}).get("message", "")).lower()


def _wait_servers(site: Site, cluster: Cluster, replace: Callable[[str], str] | None = None) -> dict[str, object]:
    """Until every server is ACTIVE; fail fast on ERROR; progress, not silence. A server in ERROR "No valid host"
    is asked for again (``replace(name)``: a fresh server's id) with back-off, for up to ``site.clean_timeout``:
    the reserved host is still being cleaned after the server that had it (a lease ended or deleted moments ago:
    Blazar frees its hosts at once, Ironic cleans them for minutes), as python-chi retries a server's boot error
    (chi/server.py ``retry_on_error``). Past that, NoHosts: the caller may try other hosts."""
    deadline = time.monotonic() + site.boot_timeout
    t0 = time.monotonic()
    retries: dict[str, Backoff] = {}
    last: dict[str, str] = {}
    servers: dict[str, object] = {}
    next_note = t0 + 60
    while True:
        # one listing a round (up names its servers RUN-0, RUN-1, ...), not a request per server
        listed = site.cloud.get_servers([n.server_id for n in cluster.nodes], f"^{cluster.name}-[0-9]+$")
        for node in cluster.nodes:
            srv = listed[node.server_id]
            if srv is None:
                raise ApplianceError(f"server {node.name} ({node.server_id}) disappeared while booting",
                                     "run `appliance status`; the lease may have ended")
            if srv.status != last.get(node.name):
                log.info(f"  {node.name}: {srv.status} ({time.monotonic() - t0:.0f}s)")
                last[node.name] = srv.status
            if srv.status == "ERROR" and replace is not None and _no_valid_host(srv):
                retry = retries.setdefault(node.name, Backoff(site.poll * 4, site.clean_timeout))
                due = retry.due()
                if due is None:
                    raise NoHosts(f"server {node.name} found no valid host on its reservation for "
                                  f"{site.clean_timeout:.0f}s (its hosts are taken or still being cleaned)",
                                  "try another node type or a later lease")
                if due:
                    log.info(f"  {node.name}: no valid host yet (its reserved host is still being cleaned after "
                             f"its last server); asking again ({retry.left():.0f}s left)")
                    node.server_id = replace(node.name)
                    deadline = max(deadline, time.monotonic() + site.boot_timeout)
                    last.pop(node.name, None)
                servers[node.name] = srv
                continue
            if srv.status == "ERROR":
                fault = (srv.fault or {}).get("message", "no fault message") if hasattr(srv, "fault") else ""
                raise ApplianceError(f"server {node.name} ({node.server_id}) is in ERROR: {fault}",
                                     "run `appliance up` again (it replaces servers in ERROR), or "
                                     "`appliance down` and start over")
            servers[node.name] = srv
        if all(s.status == "ACTIVE" for s in servers.values()):
            return servers
        if time.monotonic() >= next_note:  # a line a minute while bare metal deploys, not silence
            waiting = ", ".join(f"{n} {s.status}" for n, s in servers.items() if s.status != "ACTIVE")
            log.info(f"  still booting after {time.monotonic() - t0:.0f}s: {waiting} "
                     f"(timeout {site.boot_timeout:.0f}s)")
            next_note += 60
        if time.monotonic() > deadline:
            slow = [n for n, s in servers.items() if s.status != "ACTIVE"]
            raise ApplianceError(f"servers {', '.join(slow)} not ACTIVE after {site.boot_timeout:.0f}s",
                                 "bare metal can take 20 min; run `appliance up` again to keep waiting")
        time.sleep(site.poll)  # polling a remote API


def _wait_ssh(site: Site, cluster: Cluster) -> Session:
    """Until every node answers SSH; returns the open Session, for the steps after it (one key exchange per node,
    not one per step: ~27 ms of the launcher's CPU each, make bench-scale-light). The caller closes it."""
    deadline = time.monotonic() + site.ssh_timeout
    last_err: ApplianceError | None = None
    while time.monotonic() < deadline:
        try:
            return Session(cluster, timeout=5)
        except (HostKeyMismatch, KeyRefused):
            raise  # not something waiting cures: another machine, one that was rebuilt, another key pair
        except ApplianceError as e:
            last_err = e
        time.sleep(site.poll)  # waiting for sshd on remote machines
    raise ApplianceError(f"SSH never came up within {site.ssh_timeout:.0f}s: {last_err.message if last_err else ''}",
                         "check the key pair and image; `appliance status` shows the nodes")


class Backoff:
    """Tries spaced ``first``, then twice as long each time up to ``cap``, for ``budget`` seconds from the first
    failure."""

    def __init__(self, first: float, budget: float, cap: float = 60.0):
        self.delay, self.budget, self.cap = first, budget, cap
        self.start = self.next_at = time.monotonic()
        self.next_at += first

    def due(self) -> bool | None:
        """True: try again now; False: not yet; None: the budget is spent."""
        now = time.monotonic()
        if now - self.start >= self.budget:
            return None
        if now < self.next_at:
            return False
        self.delay = min(self.delay * 2, self.cap)
        self.next_at = now + self.delay
        return True

    def left(self) -> float:
        return max(0.0, self.budget - (time.monotonic() - self.start))


SERVER_CALLS_IN_FLIGHT = 8  # Nova requests at once (create, delete): one at a time, at 0.3-1 s each on a real Nova,
# 64 servers would take up to a minute (docs/benchmark.md, make bench-scale)


def _fan_out(fn: Callable, items: Iterable) -> list:
    """fn over items, SERVER_CALLS_IN_FLIGHT at a time; results in the items' order; the first error is raised
    once every call has ended."""
    items = list(items)
    if len(items) <= 1:
        return [fn(x) for x in items]
    with ThreadPoolExecutor(max_workers=min(SERVER_CALLS_IN_FLIGHT, len(items))) as ex:
        futs = [ex.submit(fn, x) for x in items]
    return [f.result() for f in futs]


def up(site: Site, spec: Spec, *, lease_id: str | None = None, ssh_timeout: float | None = None,
       install: bool = False, variant: str | None = None, wheel_cache: str | None = None,
       finish_nodes: Callable | None = None, timings: dict[str, float] | None = None,
       on_ask: Callable | None = None) -> Cluster:
    """Lease (or reuse) -> servers on the reservation -> floating IP -> host keys -> SSH -> contextualize
    [-> the training stack installed on every node, `install`: for stock images]. ``finish_nodes(site,
    cluster)``: the steps on the booted machines (default `finish`; the fast tests pass their own, as Horovod's runner
    takes its behaviour as callables). ``timings``: filled with the seconds of each phase ("lease", "boot",
    "ssh + contextualize", "install"), which `appliance resume` reports."""
    timings = {} if timings is None else timings
    mark = time.monotonic()

    def phase(name: str) -> None:
        nonlocal mark
        now = time.monotonic()
        timings[name] = timings.get(name, 0.0) + now - mark  # unrounded: resume_breakdown subtracts them
        mark = now

    if ssh_timeout is not None:
        site.ssh_timeout = ssh_timeout
    c = site.cloud
    key = site.login_key(spec.key_name, spec.key_file)
    cluster, info = _leased(site, spec, key, lease_id=lease_id, on_ask=on_ask)
    info = c.wait_lease(info.id)
    cluster.lease_end = info.end.isoformat() + "Z"
    cluster.save()
    phase("lease")
    # 2. servers: one per node, asked for SERVER_CALLS_IN_FLIGHT at a time, each recorded as soon as it is asked
    # for; ERROR ones are replaced
    servers = cluster.site.servers
    saving = threading.Lock()

    def ensure(i: int) -> None:
        name = f"{spec.name}-{i}"
        sid = servers.get(name)
        if sid:
            srv = c.get_server(sid)
            if srv is not None and srv.status != "ERROR" and not _deleting(srv):
                return
            if srv is not None and _deleting(srv):
                log.info(f"  {name}: its server is being deleted; asking for a new one")
            elif srv is not None:
                log.info(f"  {name}: replacing a server in ERROR")
                c.delete_server(sid)
        new = c.create_server(name, reservation_id=info.reservation_id, image=spec.image, key_name=key.name,
                              network=spec.network, user_data=HOSTKEYS_SCRIPT)
        with saving:
            servers[name] = new
            cluster.save()

    def replace(name: str) -> str:  # a server in ERROR "No valid host": a fresh one (_wait_servers)
        c.delete_server(servers[name])
        new = c.create_server(name, reservation_id=info.reservation_id, image=spec.image, key_name=key.name,
                              network=spec.network, user_data=HOSTKEYS_SCRIPT)
        with saving:
            servers[name] = new
            cluster.save()
        return new

    _adopt_unrecorded(c, spec, info.reservation_id, servers)
    _fan_out(ensure, range(spec.nodes.count))
    order = [f"{spec.name}-{i}" for i in range(spec.nodes.count)]  # node 0 is the head, whatever answered first
    cluster.site.servers = servers = {**{n: servers[n] for n in order}, **{n: s for n, s in servers.items()
                                                                            if n not in order}}
    cluster.save()
    log.info(f"waiting for {spec.nodes.count} server(s) to boot{site.boot_note}")
    cluster.nodes = [Node(name=n, private_ip="", address=None, workdir=site.workdir, slots=spec.nodes.slots,
                          user=site.user, server_id=sid) for n, sid in servers.items()]
    try:
        srvs = _wait_servers(site, cluster, replace)
    except NoHosts as e:
        if lease_id is None and spec.lease.lease_id is None:  # the lease this `up` made holds nothing usable
            log.info(f"  {e.message}: cluster {cluster.name} and its lease go")
            down(cluster.name, site)
        raise
    for node in cluster.nodes:
        node.private_ip = c.server_ip(srvs[node.name])
        node.address = node.private_ip
        node.via_head = node is not cluster.nodes[0]
    # 3. floating IP on the head
    head = cluster.nodes[0]
    if not cluster.floating_ip:  # one on the head already: an attach whose answer was lost (not asked for twice)
        fip = c.server_floating_ip(head.server_id) or \
            c.attach_floating_ip(head.server_id, fip_reservation_id=cluster.site.fip_reservation_id)
        cluster.floating_ip = fip.floating_ip_address
        cluster.site.fip_id = fip.id
        cluster.save()
        log.info(f"floating IP {cluster.floating_ip} on {head.name}")
    head.address = cluster.floating_ip
    phase("boot")
    (finish_nodes or finish)(site, cluster)
    phase("ssh + contextualize")
    if install:
        install_on(site, cluster, spec, variant=variant, wheel_cache=wheel_cache)
        phase("install")
    log.info(f"cluster {cluster.name} ready: {len(cluster.nodes)} node(s), head {head.name} at {head.address}")
    return cluster


def install_on(site: Site, cluster: Cluster, spec: Spec, *, variant: str | None = None,
               wheel_cache: str | None = None) -> None:
    """The boot-time installer on every node (provision/install.py); the cluster then trains with that venv."""
    from . import install

    variant = variant or ("gpu" if spec.nodes.node_type.startswith("gpu") else "cpu")
    opts = site.install_options()
    log.info(f"installing the training stack ({variant}) on {len(cluster.nodes)} node(s) into {opts['venv']}")
    res = install.install_stack(cluster, variant=variant, cache_url=wheel_cache or install.DEFAULT_CACHE,
                                creds=site.store_creds(), **opts)
    cluster.python = res["python"]
    cluster.site.installed = {k: v for k, v in res.items() if k != "python"}
    cluster.save()


def finish(site: Site, cluster: Cluster) -> None:
    """Pin every node's host key from what the node published (provision/hostkeys.sh through Nova's server
    password; a console log where one exists), wait for SSH, pick the local disk, contextualize.
    Shared by `up` and `adopt` (a Heat stack made in Horizon)."""
    c = site.cloud
    head = cluster.head
    # 4. host keys, pinned: published by the node itself at boot (bare metal has no console log)
    def host_keys(node) -> list[str]:
        keys = []
        deadline = time.monotonic() + site.ssh_timeout
        while not keys and time.monotonic() < deadline:
            keys = c.server_host_keys(node.server_id)
            if not keys:
                time.sleep(site.poll)  # published late in the boot (cloud-init runs user_data last): poll the API
        if not keys:
            raise ApplianceError(f"{node.name} published no SSH host keys within {site.ssh_timeout:.0f}s",
                                 "the image must run cloud-init with our user_data (CC images do; see "
                                 "`openstack server show` for the server's state); or pin keys by hand in "
                                 f"{cluster.known_hosts} and run `appliance adopt`")
        return keys

    lines = []
    # the nodes' requests SERVER_CALLS_IN_FLIGHT at a time: one after another, 64 nodes took 64 round trips
    for node, keys in zip(cluster.nodes, _fan_out(host_keys, cluster.nodes)):
        names = ",".join(dict.fromkeys([node.name, node.private_ip] + ([node.address] if node is head else [])))
        for k in keys:
            kt, kb = k.split()[:2]
            lines.append(f"{names} {kt} {kb}\n")
    Path(cluster.known_hosts).write_text("".join(lines))
    cluster.save()
    # 5. SSH, then 6. contextualize
    log.info("waiting for SSH")
    with _wait_ssh(site, cluster) as session:
        site.prepare_nodes(cluster, session)  # 7. the site's fast local disk (Chameleon: NVMe): code, data, checkpoints
        contextualize(cluster, session)
    cluster.save()


# ---------------------------------------------------------------------------------------------
# status and down


def _deleting(srv) -> bool:
    """A server Nova is deleting: still listed (its status unchanged, ACTIVE as a rule) with task_state "deleting"
    until its compute has torn it down (nova/compute/api.py ``_delete``), minutes on bare metal. It is going, not
    a node to use or to delete again."""
    return getattr(srv, "task_state", None) == "deleting"


def status(name: str, site: Site | None = None) -> dict:
    cluster = load_cluster(name)
    c = (site or _site_of(cluster)).cloud
    info, now = c.lease_at(cluster.lease_id) if cluster.lease_id else (None, c.now())
    out = {"name": name, "cloud": cluster.cloud, "lease_id": cluster.lease_id,
           "reservation_id": cluster.reservation_id, "floating_ip": cluster.floating_ip, "nodes": []}
    if info is None:
        out.update(lease_status="DELETED", seconds_left=0,
                   message="the lease no longer exists: its servers were deleted with it")
    else:
        out.update(lease_status=info.status, lease_end=info.end.isoformat() + "Z",
                   seconds_left=max(0, int((info.end - now).total_seconds())))
        if info.ended:
            out["message"] = (f"the lease ended at {fmt_date(info.end)} UTC: every server of it was deleted, "
                              "local disks included. `appliance up SPEC` makes a new lease.")
    # one listing, not a GET per node (find_server: a second request, a listing, for each one gone); no name filter:
    # an adopted cluster's servers have the stack's names
    listed = c.get_servers([n.server_id for n in cluster.nodes if n.server_id]) if cluster.nodes else {}
    for node in cluster.nodes:
        srv = listed.get(node.server_id) if node.server_id else None
        state = "GONE" if srv is None else "DELETING" if _deleting(srv) else srv.status
        out["nodes"].append({"name": node.name, "server_id": node.server_id, "private_ip": node.private_ip,
                             "address": node.address, "state": state})
    return out


def down(name: str, site: Site | None = None) -> list[str]:
    """Delete servers, release the floating IP, delete the lease, forget the cluster. Idempotent. The cloud's reads
    and deletes are asked again with back-off (sites/openstack_auth.py); a step that still fails is one line, and
    the record stays for a later `appliance down` to finish."""
    if not state_path(name).exists():
        log.info(f"no cluster named {name!r}; nothing to do")
        return []
    cluster = load_cluster(name)
    try:
        done = _take_down(cluster, (site or _site_of(cluster)).cloud)
    except ApplianceError as e:  # a cloud that does not answer stays Unavailable: a managed run waits for it
        raise (Unavailable if isinstance(e, (Unavailable, Unanswered)) else ApplianceError)(
            f"cluster {name} is not all gone: {e.message}", f"{e.fix + '; then ' if e.fix else ''}run `appliance "
            f"down {name}` again: its record is kept, and it deletes what is left") from None
    delete_cluster(name)
    for suffix in (".known_hosts", ".id_ed25519", ".id_ed25519.pub"):
        (paths.clusters_dir() / f"{name}{suffix}").unlink(missing_ok=True)
    log.info(f"cluster {name}: removed " + (", ".join(done) if done else "its record (nothing left in the cloud)"))
    return done


def teardown(name: str, site: Site | None = None) -> bool:
    """`down` for a thread of its own (a managed run's old cluster, taken down while the run goes on): a failure is
    said in one line, not a thread's traceback, and the record stays. Whether all of it is gone."""
    try:
        down(name, site)
        return True
    except ApplianceError as e:
        log.info(f"warning: {e}")
        return False


def _take_down(cluster: Cluster, c) -> list[str]:
    """What `down` deletes, in its order; what went."""
    done = []
    targets = [(f"server {node.name}", node.server_id) for node in cluster.nodes or [] if node.server_id]
    targets += [(f"server {sid}", sid) for sid in cluster.site.servers.values()
                if sid not in {n.server_id for n in cluster.nodes}]
    gone = _fan_out(lambda t: c.delete_server(t[1]), targets)
    done += [label for (label, _), ok in zip(targets, gone) if ok]
    if cluster.site.fip_id:
        c.release_floating_ip(cluster.site.fip_id)
        done.append(f"floating IP {cluster.floating_ip}")
    if cluster.lease_id and c.delete_lease(cluster.lease_id):
        done.append(f"lease {cluster.lease_id}")
    elif not cluster.lease_id and cluster.site.lease_name:  # asked for, its answer never recorded (or never came)
        for info in c.list_leases():
            if info.name == cluster.site.lease_name and not info.ended \
                    and c.delete_lease(info.id):
                done.append(f"lease {info.id} ({info.name})")
    return done


def _site_of(cluster: Cluster) -> Site:
    site = for_cluster(cluster)
    if site is None:
        raise ApplianceError(f"cluster {cluster.name!r} was not made on a cloud ({cluster.cloud})",
                             "`appliance testbed down` removes a testbed; a Heat stack is deleted in Horizon")
    return site
