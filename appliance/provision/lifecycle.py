"""Cluster verbs: `appliance up`, `status`, `down`, and the lease verbs. One function per verb.

The cloud sits behind one small interface (``OpenStackCloud``: leases, servers, floating IPs), with
two profiles: ``chameleon`` (a real site, from clouds.yaml/OS_CLOUD or openrc) and ``local`` (the
local cloud on 127.0.0.1, started on demand, whose servers are testbed nodes). Every step records
what it made in the cluster's state file before the next one starts, so a re-run after a failure
creates only what is missing, and `down` finds everything.
"""

from __future__ import annotations

import datetime as dt
import os
import sys
import time
from dataclasses import dataclass
from pathlib import Path

from .. import paths
from ..cluster import Cluster, Node, delete_cluster, find_cluster, load_cluster, state_path
from ..errors import ApplianceError
from ..spec import Spec, duration_seconds, load_spec
from ..remote import Session
from . import local_disk
from .contextualize import contextualize
from .openstack import OpenStackCloud, connect, fmt_date

CHAMELEON_PYTHON = "/opt/appliance/venv/bin/python"  # the appliance image's venv (images/)


@dataclass
class Profile:
    kind: str  # "chameleon" or "local"
    cloud: OpenStackCloud
    user: str
    workdir: str
    python: str
    key_name: str
    key_file: str
    boot_timeout: float
    ssh_timeout: float

    def time_scale(self) -> float:
        """Cloud seconds per real second: 1 on Chameleon; the local cloud's clock can run faster."""
        if self.kind != "local":
            return 1.0
        from .. import localcloud

        return float(localcloud.admin("GET", "/clock").get("time_scale", 1.0))


def _local_key() -> tuple[str, str]:
    from ..localcloud import state_dir

    d = state_dir()
    priv = d / "id_ed25519"
    if not priv.exists():
        from cryptography.hazmat.primitives import serialization
        from cryptography.hazmat.primitives.asymmetric import ed25519

        key = ed25519.Ed25519PrivateKey.generate()
        fd = os.open(priv, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        with os.fdopen(fd, "wb") as fh:
            fh.write(key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.OpenSSH,
                                       serialization.NoEncryption()))
        pub = key.public_key().public_bytes(serialization.Encoding.OpenSSH, serialization.PublicFormat.OpenSSH)
        (d / "id_ed25519.pub").write_text(pub.decode() + " appliance-local\n")
    return str(priv), (d / "id_ed25519.pub").read_text().strip()


def open_cloud(spec_cloud: str, site: str | None = None, key_name: str | None = None,
               key_file: str | None = None, log=print) -> Profile:
    if spec_cloud == "local":
        from .. import localcloud

        localcloud.start(log=log)
        conn = connect(cloud=localcloud.CLOUD_NAME, config_file=str(localcloud.clouds_yaml()))
        cloud = OpenStackCloud(conn)
        priv, pub = _local_key()
        cloud.ensure_keypair("appliance-local", pub)
        return Profile("local", cloud, user="root", workdir="/mnt/local", python=sys.executable,
                       key_name="appliance-local", key_file=priv, boot_timeout=120, ssh_timeout=60)
    conn = connect(region=site)
    if not key_file:
        for cand in ("~/.ssh/id_ed25519", "~/.ssh/id_rsa"):
            if Path(cand).expanduser().exists():
                key_file = str(Path(cand).expanduser())
                break
    if not key_file or not Path(key_file).expanduser().exists():
        raise ApplianceError(f"no private key for key pair {key_name!r} on this machine",
                             "set key_file in the spec to the private key of key_name")
    return Profile("chameleon", OpenStackCloud(conn), user="cc", workdir="/home/cc", python=CHAMELEON_PYTHON,
                   key_name=key_name or "", key_file=str(Path(key_file).expanduser()), boot_timeout=1800,
                   ssh_timeout=900)


def profile_for(cluster: Cluster, log=print) -> Profile:
    x = cluster.extra
    return open_cloud(cluster.cloud, x.get("site"), x.get("key_name"), x.get("key_file"), log=log)


# ---------------------------------------------------------------------------------------------
# lease verbs


def lease_create(spec_path: str, *, start: str | None = None, log=print) -> dict:
    spec = load_spec(spec_path)
    prof = open_cloud(spec.cloud, spec.site, spec.key_name, spec.key_file, log=log)
    begin = dt.datetime.strptime(start, "%Y-%m-%d %H:%M") if start and start != "now" else None
    info = prof.cloud.create_lease(_lease_name(spec), spec.nodes.node_type, spec.nodes.count,
                                   dt.timedelta(seconds=duration_seconds(spec.lease.duration)), start=begin,
                                   floating_ip=spec.lease.floating_ip)
    return info.as_dict()


def _lease_name(spec: Spec) -> str:
    return f"{spec.name}-{time.strftime('%m%d%H%M%S')}"


def _cloud_for(cloud: str, site: str | None, log) -> OpenStackCloud:
    if cloud == "local":
        from .. import localcloud

        localcloud.start(log=log)
        return OpenStackCloud(connect(cloud=localcloud.CLOUD_NAME, config_file=str(localcloud.clouds_yaml())))
    return OpenStackCloud(connect(region=site))


def image_upload(path: str, name: str, *, cloud: str = "chameleon", site: str | None = None,
                 disk_format: str | None = None, log=print) -> dict:
    """`appliance image upload`: a built image (make image) into the site's Glance, tagged with the lock it was
    built from. Glance images are per site: upload once per site you lease at."""
    import hashlib

    p = Path(path)
    if not p.is_file():
        raise ApplianceError(f"no image file {path}", "build one with `make image` (docs/image.md)")
    fmt = disk_format or {".qcow2": "qcow2", ".raw": "raw", ".img": "raw"}.get(p.suffix)
    if fmt is None:
        raise ApplianceError(f"cannot tell the disk format of {p.name}", "pass --disk-format qcow2 or raw")
    lock = Path(__file__).resolve().parents[2] / "requirements.lock"
    props = {"appliance_lock_sha256": hashlib.sha256(lock.read_bytes()).hexdigest()[:16] if lock.exists() else "",
             "appliance_stack": "tensorflow 2.18.1, tf-keras 2.18.0, horovod 0.28.1 (NCCL, Gloo)"}
    c = _cloud_for(cloud, site, log)
    log(f"uploading {p} ({p.stat().st_size / 1e9:.2f} GB, {fmt}) to Glance as {name!r}"
        + (f" at {site}" if site else ""))
    return c.upload_image(str(p), name, disk_format=fmt, properties=props)


def lease_show(lease_id: str, *, cloud: str = "chameleon", site: str | None = None, log=print) -> dict:
    c = _cloud_for(cloud, site, log)
    info = c.get_lease(lease_id)
    if info is None:
        raise ApplianceError(f"no lease {lease_id}", "see `appliance lease list`")
    d = info.as_dict()
    d["seconds_left"] = max(0, int((info.end - c.now()).total_seconds()))
    return d


def lease_list(*, cloud: str = "chameleon", site: str | None = None, log=print) -> list[dict]:
    return [x.as_dict() for x in _cloud_for(cloud, site, log).list_leases()]


def lease_extend(lease_id: str, *, by: str | None = None, to: str | None = None, cloud: str = "chameleon",
                 site: str | None = None, log=print) -> dict:
    c = _cloud_for(cloud, site, log)
    delta = dt.timedelta(seconds=duration_seconds(by)) if by else None
    end = dt.datetime.strptime(to, "%Y-%m-%d %H:%M") if to else None
    if not delta and not end:
        raise ApplianceError("nothing to extend by", "give --by 1d or --to 'YYYY-MM-DD HH:MM'")
    return c.extend_lease(lease_id, by=delta, to=end).as_dict()


def lease_delete(lease_id: str, *, cloud: str = "chameleon", site: str | None = None, log=print) -> bool:
    return _cloud_for(cloud, site, log).delete_lease(lease_id)


# ---------------------------------------------------------------------------------------------
# up


def _wait_servers(prof: Profile, cluster: Cluster, log) -> dict[str, object]:
    """Until every server is ACTIVE; fail fast on ERROR; progress, not silence."""
    deadline = time.monotonic() + prof.boot_timeout
    t0 = time.monotonic()
    last: dict[str, str] = {}
    servers: dict[str, object] = {}
    next_note = t0 + 60
    while True:
        for node in cluster.nodes:
            srv = prof.cloud.get_server(node.server_id)
            if srv is None:
                raise ApplianceError(f"server {node.name} ({node.server_id}) disappeared while booting",
                                     "run `appliance status`; the lease may have ended")
            if srv.status != last.get(node.name):
                log(f"  {node.name}: {srv.status} ({time.monotonic() - t0:.0f}s)")
                last[node.name] = srv.status
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
            log(f"  still booting after {time.monotonic() - t0:.0f}s: {waiting} "
                f"(timeout {prof.boot_timeout:.0f}s)")
            next_note += 60
        if time.monotonic() > deadline:
            slow = [n for n, s in servers.items() if s.status != "ACTIVE"]
            raise ApplianceError(f"servers {', '.join(slow)} not ACTIVE after {prof.boot_timeout:.0f}s",
                                 "bare metal can take 20 min; run `appliance up` again to keep waiting")
        time.sleep(2 if prof.kind == "chameleon" else 0.2)  # polling a remote API


def _wait_ssh(prof: Profile, cluster: Cluster, log) -> None:
    from ..remote import Session

    deadline = time.monotonic() + prof.ssh_timeout
    last_err: ApplianceError | None = None
    while time.monotonic() < deadline:
        try:
            with Session(cluster, timeout=5):
                return
        except ApplianceError as e:
            last_err = e
        time.sleep(2 if prof.kind == "chameleon" else 0.2)  # waiting for sshd on remote machines
    raise ApplianceError(f"SSH never came up within {prof.ssh_timeout:.0f}s: {last_err.message if last_err else ''}",
                         "check the key pair and image; `appliance status` shows the nodes")


def up(spec_path: str, *, lease_id: str | None = None, ssh_timeout: float | None = None, log=print,
       spec: Spec | None = None, install: bool = False, variant: str | None = None,
       wheel_cache: str | None = None) -> Cluster:
    """Lease (or reuse) -> servers on the reservation -> floating IP -> host keys -> SSH -> contextualize
    [-> the training stack installed on every node, `install`: for stock images]."""
    spec = spec or load_spec(spec_path)
    prof = open_cloud(spec.cloud, spec.site, spec.key_name, spec.key_file, log=log)
    if ssh_timeout is not None:
        prof.ssh_timeout = ssh_timeout
    c = prof.cloud
    cluster = find_cluster(spec.name)
    if cluster is not None and cluster.lease_id:
        info = c.get_lease(cluster.lease_id)
        if info is None or info.status in ("TERMINATED", "DELETED", "ERROR"):
            log(f"the lease of {spec.name} has ended ({info.status if info else 'deleted'}); its servers are gone. "
                "Making a new lease.")
            delete_cluster(spec.name)
            cluster = None
    if cluster is None:
        cluster = Cluster(name=spec.name, cloud=prof.kind, nodes=[], key_file=prof.key_file,
                          known_hosts=str(paths.clusters_dir() / f"{spec.name}.known_hosts"), python=prof.python,
                          spec_digest=spec.digest,
                          extra={"site": spec.site, "key_name": prof.key_name, "key_file": prof.key_file,
                                 "spec": spec.path, "servers": {}})
    # 1. lease
    lid = lease_id or spec.lease.lease_id or cluster.lease_id
    if lid is None:
        info = c.create_lease(_lease_name(spec), spec.nodes.node_type, spec.nodes.count,
                              dt.timedelta(seconds=duration_seconds(spec.lease.duration)),
                              floating_ip=spec.lease.floating_ip)
        log(f"lease {info.name} ({info.id}) created: {spec.nodes.count} x {spec.nodes.node_type} until "
            f"{fmt_date(info.end)} UTC")
    else:
        info = c.get_lease(lid)
        if info is None:
            raise ApplianceError(f"no lease {lid}", "see `appliance lease list`")
    cluster.lease_id, cluster.reservation_id = info.id, info.reservation_id
    cluster.extra["fip_reservation_id"] = info.fip_reservation_id
    cluster.save()
    info = c.wait_lease(info.id, log=log)
    cluster.lease_end = info.end.isoformat() + "Z"
    cluster.save()
    # 2. servers: one per node, recorded as soon as it is asked for; ERROR ones are replaced
    servers: dict = cluster.extra.setdefault("servers", {})
    for i in range(spec.nodes.count):
        name = f"{spec.name}-{i}"
        sid = servers.get(name)
        if sid:
            srv = c.get_server(sid)
            if srv is not None and srv.status != "ERROR":
                continue
            if srv is not None:
                log(f"  {name}: replacing a server in ERROR")
                c.delete_server(sid)
        servers[name] = c.create_server(name, reservation_id=info.reservation_id, image=spec.image,
                                        key_name=prof.key_name, network=spec.network)
        cluster.save()
    log(f"waiting for {spec.nodes.count} server(s) to boot"
        + (" (bare metal: 10-20 min)" if prof.kind == "chameleon" else ""))
    cluster.nodes = [Node(name=n, private_ip="", address=None, workdir=prof.workdir, slots=spec.nodes.slots,
                          user=prof.user, server_id=sid) for n, sid in servers.items()]
    srvs = _wait_servers(prof, cluster, log)
    for node in cluster.nodes:
        node.private_ip = prof.cloud.server_ip(srvs[node.name])
        node.address = node.private_ip
        node.via_head = node is not cluster.nodes[0]
    # 3. floating IP on the head
    head = cluster.nodes[0]
    if not cluster.floating_ip:
        fip = c.attach_floating_ip(head.server_id, fip_reservation_id=cluster.extra.get("fip_reservation_id"))
        cluster.floating_ip = fip.floating_ip_address
        cluster.extra["fip_id"] = fip.id
        cluster.save()
        log(f"floating IP {cluster.floating_ip} on {head.name}")
    head.address = cluster.floating_ip
    finish(prof, cluster, log)
    if install:
        install_on(prof, cluster, spec, variant=variant, wheel_cache=wheel_cache, log=log)
    log(f"cluster {cluster.name} ready: {len(cluster.nodes)} node(s), head {head.name} at {head.address}")
    return cluster


def install_on(prof: Profile, cluster: Cluster, spec: Spec, *, variant: str | None = None,
               wheel_cache: str | None = None, log=print) -> None:
    """The boot-time installer on every node (provision/install.py); the cluster then trains with that venv."""
    from ..data import creds as creds_mod
    from . import install

    variant = variant or ("gpu" if spec.nodes.node_type.startswith("gpu") else "cpu")
    if prof.kind == "local":  # nodes are namespaces here: no PyPI, the host's packages, a per-node venv
        opts = dict(venv=f"{prof.workdir}/appliance/venv", system_deps=False, sudo=False,
                    python=getattr(sys, "_base_executable", sys.executable),
                    pip_env={"PIP_NO_INDEX": "1", "PIP_FIND_LINKS": str(install.local_wheelhouse(log=log))})
    else:
        opts = dict(venv=str(Path(CHAMELEON_PYTHON).parent.parent), system_deps=True, sudo=prof.user != "root")
    log(f"installing the training stack ({variant}) on {len(cluster.nodes)} node(s) into {opts['venv']}")
    res = install.install_stack(cluster, variant=variant, cache_url=wheel_cache or install.DEFAULT_CACHE,
                                creds=creds_mod.resolve(prof.kind, spec.site, log=log), log=log, **opts)
    cluster.python = res["python"]
    cluster.extra["installed"] = {k: v for k, v in res.items() if k != "python"}
    cluster.save()


def finish(prof: Profile, cluster: Cluster, log=print) -> None:
    """Pin every node's host key from its console log, wait for SSH, pick the local disk, contextualize.
    Shared by `up` and `adopt` (a Heat stack made in Horizon)."""
    c = prof.cloud
    head = cluster.head
    # 4. host keys from the console (cloud-init prints them), pinned
    lines = []
    for node in cluster.nodes:
        keys = []
        deadline = time.monotonic() + prof.ssh_timeout
        while not keys and time.monotonic() < deadline:
            keys = c.console_host_keys(node.server_id)
            if not keys:
                time.sleep(2 if prof.kind == "chameleon" else 0.2)  # console log fills during boot
        if not keys:
            raise ApplianceError(f"no SSH host keys in {node.name}'s console log after {prof.ssh_timeout:.0f}s",
                                 "the image must run cloud-init (CC images do); or pin keys by hand in "
                                 f"{cluster.known_hosts}")
        names = ",".join(dict.fromkeys([node.name, node.private_ip] + ([node.address] if node is head else [])))
        for k in keys:
            kt, kb = k.split()[:2]
            lines.append(f"{names} {kt} {kb}\n")
    Path(cluster.known_hosts).write_text("".join(lines))
    cluster.save()
    # 5. SSH, then 6. contextualize
    log("waiting for SSH")
    _wait_ssh(prof, cluster, log)
    if prof.kind == "chameleon":  # 7. the fast local disk (NVMe) for code, data and local checkpoints
        with Session(cluster) as session:
            plans = session.each(lambda r: local_disk.prepare(r, prof.workdir, prof.user, log=log))
        for node in cluster.nodes:
            node.workdir = plans[node.name].workdir
    contextualize(cluster, log=log)
    cluster.save()


# ---------------------------------------------------------------------------------------------
# status and down


def status(name: str, log=print) -> dict:
    cluster = load_cluster(name)
    prof = profile_for(cluster, log=lambda m: None)
    c = prof.cloud
    info = c.get_lease(cluster.lease_id) if cluster.lease_id else None
    now = c.now()
    out = {"name": name, "cloud": cluster.cloud, "lease_id": cluster.lease_id,
           "reservation_id": cluster.reservation_id, "floating_ip": cluster.floating_ip, "nodes": []}
    if info is None:
        out.update(lease_status="DELETED", seconds_left=0,
                   message="the lease no longer exists: its servers were deleted with it")
    else:
        out.update(lease_status=info.status, lease_end=info.end.isoformat() + "Z",
                   seconds_left=max(0, int((info.end - now).total_seconds())))
        if info.status in ("TERMINATED", "DELETED"):
            out["message"] = (f"the lease ended at {fmt_date(info.end)} UTC: every server of it was deleted, "
                              "local disks included. `appliance up SPEC` makes a new lease.")
    for node in cluster.nodes:
        srv = c.get_server(node.server_id) if node.server_id else None
        out["nodes"].append({"name": node.name, "server_id": node.server_id, "private_ip": node.private_ip,
                             "address": node.address, "state": srv.status if srv else "GONE"})
    return out


def down(name: str, log=print) -> list[str]:
    """Delete servers, release the floating IP, delete the lease, forget the cluster. Idempotent."""
    if not state_path(name).exists():
        log(f"no cluster named {name!r}; nothing to do")
        return []
    cluster = load_cluster(name)
    prof = profile_for(cluster, log=lambda m: None)
    c = prof.cloud
    done = []
    for node in cluster.nodes or []:
        if node.server_id and c.delete_server(node.server_id):
            done.append(f"server {node.name}")
    for sid in (cluster.extra.get("servers") or {}).values():
        if sid not in {n.server_id for n in cluster.nodes} and c.delete_server(sid):
            done.append(f"server {sid}")
    if cluster.extra.get("fip_id"):
        c.release_floating_ip(cluster.extra["fip_id"])
        done.append(f"floating IP {cluster.floating_ip}")
    if cluster.lease_id and c.delete_lease(cluster.lease_id):
        done.append(f"lease {cluster.lease_id}")
    delete_cluster(name)
    for suffix in (".known_hosts", ".id_ed25519", ".id_ed25519.pub"):
        (paths.clusters_dir() / f"{name}{suffix}").unlink(missing_ok=True)
    log(f"cluster {name}: removed " + (", ".join(done) if done else "its record (nothing left in the cloud)"))
    return done
