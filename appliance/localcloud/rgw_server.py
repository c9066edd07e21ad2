"""A real Ceph RADOS Gateway (Debian's ceph 16.2.x): the object store Chameleon runs, on one machine.

Chameleon's object store is Ceph RGW serving the Swift and S3 APIs (ChameleonCloud/docs `swift/index.rst`;
tests/test_store_guarantees.py measures what it guarantees). This starts one `ceph-mon`, one `ceph-osd` on memstore (the
data lives in the OSD's memory: a stopped store is an empty store) and `radosgw` with the beast frontend on
``bind_ip``, with Swift v1 auth (user ``UID:tester``, ``test:tester`` by default) and S3 keys made by `radosgw-admin`. No mgr: the cluster
never reaches HEALTH_OK and does not need to. Every process runs in its own process group, recorded by PID,
and is stopped by PID (radosgw first: SIGTERM to all three at once makes radosgw hang for 120 s).

    rgw = RGWServer(base, bind_ip=...).start()
    rgw.auth_url, rgw.user, rgw.key      # Swift API, v1 auth: X-Storage-Url http://ADDR:PORT/swift/v1
    rgw.s3_endpoint                      # S3 API: access key / secret in credentials()
    rgw.stop()

With ``tls=True`` the beast frontend serves https only, as Chameleon's store does
(``https://chi.uc.chameleoncloud.org``, its S3 endpoint on port 7480 as ChameleonCloud/docs gave it), with a
certificate made here for ``bind_ip`` (``rgw.ca_file``: clients trust it through REQUESTS_CA_BUNDLE / SSL_CERT_FILE /
AWS_CA_BUNDLE).
"""

from __future__ import annotations

import contextlib
import json
import os
import secrets
import shutil
import signal
import ssl
import subprocess
import time
import urllib.request
import uuid
from pathlib import Path

from ..errors import ApplianceError
from .ports import listen_port

DAEMONS = ("mon", "osd", "rgw")
PACKAGES = "ceph-mon ceph-osd radosgw ceph-common"
# memstore keeps objects in the OSD's memory up to this many bytes (ceph's default is 1 GiB, less than a
# staging benchmark writes); a cap, not an allocation
MEMSTORE_BYTES = int(os.environ.get("APPLIANCE_RGW_MEMSTORE_BYTES", str(8 << 30)))
QUOTA_SHARE = 0.75  # of memstore's bytes, the RGW user's quota: writes past it are refused, not held


def self_signed(d: Path, ip: str) -> tuple[Path, Path]:
    """A self-signed certificate (a CA, ``ip`` its IP SAN, a month) and its key (0600), in ``d``: (cert.pem,
    key.pem). A client that trusts cert.pem (REQUESTS_CA_BUNDLE, SSL_CERT_FILE, AWS_CA_BUNDLE) verifies the server."""
    import datetime
    import ipaddress

    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import NameOID

    key = ec.generate_private_key(ec.SECP256R1())
    name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, ip)])
    now = datetime.datetime.now(datetime.timezone.utc)
    cert = (x509.CertificateBuilder().subject_name(name).issuer_name(name).public_key(key.public_key())
            .serial_number(x509.random_serial_number()).not_valid_before(now - datetime.timedelta(hours=1))
            .not_valid_after(now + datetime.timedelta(days=30))
            .add_extension(x509.SubjectAlternativeName([x509.IPAddress(ipaddress.ip_address(ip))]), critical=False)
            .add_extension(x509.BasicConstraints(ca=True, path_length=None), critical=True)
            .sign(key, hashes.SHA256()))
    d.mkdir(parents=True, exist_ok=True)
    keyfile, certfile = d / "key.pem", d / "cert.pem"
    keyfile.write_bytes(key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                                          serialization.NoEncryption()))
    os.chmod(keyfile, 0o600)
    certfile.write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    return certfile, keyfile


def installed() -> bool:
    return all(shutil.which(b) for b in ("ceph-mon", "ceph-osd", "radosgw", "radosgw-admin", "monmaptool"))


class RGWServer:
    s3_access_key = "appliance-local"
    kind = "rgw"

    def __init__(self, base: str | Path, *, bind_ip: str = "127.0.0.1", token_seconds: int = 86400,
                 keystone: dict | None = None, uid: str = "test", memstore_bytes: int | None = None,
                 tls: bool = False):
        """token_seconds: how long a Swift v1 token lives (``rgw swift token expiration``; RGW refuses an older
        one with 401: ceph src/rgw/rgw_swift_auth.cc, ``SignedTokenEngine::authenticate``). A day by default,
        as RGW's own default and Chameleon's Keystone tokens; tests use seconds.

        keystone: ``{url, user, password, project, domain}``: the RGW also takes Keystone tokens, validating each
        with Keystone (``GET /v3/auth/tokens``, X-Subject-Token) as the service user, as Chameleon's RGW does
        (ceph doc/radosgw/keystone.rst; kolla-ansible's ceph-guide: service user ``ceph_rgw``, account in URL). v1
        auth keeps working beside it.

        uid: the RGW user that owns the v1 subuser (``UID:tester``) and the S3 keys. The local cloud makes it the
        project id, the user RGW maps the project's Keystone tokens to, so Swift (Keystone or v1) and S3 see the
        same containers, as Chameleon's EC2 credentials and tokens both name the project. With Keystone the RGW
        checks S3 keys with Keystone (``rgw s3 auth use keystone``: POST /v3/s3tokens, then the secret from
        /v3/users/<user>/credentials/OS-EC2/<access>), as Chameleon's S3 keys are EC2 credentials, and the user
        gets no S3 keys of the RGW's own.

        memstore_bytes: the most the OSD keeps (MEMSTORE_BYTES by default). Writes into a full one are not refused
        but held: a full cluster makes RADOS clients pause until it is not (ceph doc/cephfs/full.rst, "Handling a
        full Ceph file system", at ``mon_osd_full_ratio``), so RGW's PUT hangs. A staging benchmark that put 8.5 GB
        under the 8 GiB default hung so (bench/stage_bench.py now asks for what it puts). So the user's quota is
        QUOTA_SHARE of it, and RGW refuses a write past it (QuotaExceeded), as a project's quota on Chameleon would.

        tls: https only (beast's ``ssl_endpoint``, ``ssl_certificate``, ``ssl_private_key``: ceph
        doc/radosgw/frontends.rst; src/rgw/rgw_asio_frontend.cc ``AsioFrontend::init_ssl``), with a self-signed
        certificate for ``bind_ip`` made at start (``ca_file``)."""
        self.keystone = keystone
        self.tls = tls
        self.uid = uid
        self.memstore_bytes = int(memstore_bytes or MEMSTORE_BYTES)
        self.base = Path(base)
        self.token_seconds = int(token_seconds)
        self.bind_ip = bind_ip
        self.key = secrets.token_hex(16)  # fresh secrets per start: nothing guessable, nothing to leak twice
        self.s3_secret_key = secrets.token_hex(20)
        self.ports: dict[str, int] = {}
        self.pids: dict[str, int] = {}

    # -- layout ----------------------------------------------------------------------------------

    @property
    def user(self) -> str:
        """The Swift v1 user: the RGW user's subuser."""
        return f"{self.uid}:tester"

    @property
    def conf(self) -> Path:
        return self.base / "ceph.conf"

    @property
    def s3_endpoint(self) -> str:
        return f"{'https' if self.tls else 'http'}://{self.bind_ip}:{self.ports['rgw']}"

    @property
    def ca_file(self) -> Path | None:
        """The certificate the https endpoint serves, for clients to trust (None without ``tls``)."""
        return self.base / "tls" / "cert.pem" if self.tls else None

    def _make_certificate(self) -> str:
        """The certificate and key under base/tls (``self_signed``); beast's options for them."""
        cert, key = self_signed(self.base / "tls", self.bind_ip)
        return f"ssl_certificate={cert} ssl_private_key={key}"

    @property
    def auth_url(self) -> str:
        return f"{self.s3_endpoint}/auth/v1.0"

    @property
    def storage_url(self) -> str:
        return f"{self.s3_endpoint}/swift/v1"

    def credentials(self) -> dict:
        """v1 auth and, without Keystone, the RGW user's own S3 keys. With Keystone the S3 keys are Keystone's EC2
        credentials (`openstack ec2 credentials create`), as on Chameleon, and none are given here."""
        own = not self.keystone
        return {"auth_url": self.auth_url, "user": self.user, "key": self.key, "storage_url": self.storage_url,
                "s3_endpoint": self.s3_endpoint, "s3_access_key": self.s3_access_key if own else None,
                "s3_secret_key": self.s3_secret_key if own else None, "s3_region": "us-east-1"}

    def _write_config(self) -> None:
        self.base.mkdir(parents=True, exist_ok=True)
        for d in ("mon", "osd", "run", "log"):
            (self.base / d).mkdir(exist_ok=True)
        self.ports = {"mon": listen_port(), "rgw": listen_port(self.bind_ip)}
        (self.base / "ports.json").write_text(json.dumps(self.ports))
        b = self.base
        # a one-node test cluster: one replica, no cephx, a memstore OSD (ceph doc/dev/dev_cluster_deployment.rst,
        # vstart.sh sets the same), and radosgw with the beast frontend
        self.conf.write_text(
            "[global]\n"
            f"fsid = {uuid.uuid4()}\n"
            f"mon host = [v2:127.0.0.1:{self.ports['mon']}]\n"
            "mon initial members = a\n"
            "ms bind msgr1 = false\n"
            "public addr = 127.0.0.1\n"
            "auth cluster required = none\nauth service required = none\nauth client required = none\n"
            "keyring = /dev/null\n"
            "osd pool default size = 1\nosd pool default min size = 1\nosd pool default pg num = 8\n"
            "osd pool default pgp num = 8\nosd pool default pg autoscale mode = off\n"
            "osd crush chooseleaf type = 0\nmon allow pool size one = true\nmon max pg per osd = 1000\n"
            "paxos propose interval = 0.01\npaxos min wait = 0.001\n"
            f"run dir = {b / 'run'}\nadmin socket = {b / 'run'}/$name.asok\npid file = {b / 'run'}/$name.pid\n"
            f"log file = {b / 'log'}/$name.log\nlog to stderr = false\nerr to stderr = false\n"
            "mon data avail warn = 1\nmon data avail crit = 0\n"
            "\n[mon]\n"
            f"mon data = {b / 'mon'}/$id\n"
            "\n[osd]\n"
            f"osd data = {b / 'osd'}/$id\nosd objectstore = memstore\nmemstore device bytes = {self.memstore_bytes}\n"
            "osd max object size = 1073741824\n"
            "\n[client.rgw.local]\n"
            # beast without tcp_nodelay, Ceph's default (doc/radosgw/frontends.rst; src/rgw/rgw_asio_frontend.cc):
            # answers go out as headers, then body, with Nagle on; our clients ACK at once (store/tcp.py)
            f"rgw frontends = beast {'ssl_' if self.tls else ''}endpoint={self.bind_ip}:{self.ports['rgw']}"
            f"{' ' + self._make_certificate() if self.tls else ''}\n"
            "ms mon client mode = crc\n"
            "rgw dns name = localhost\n"
            f"rgw swift token expiration = {self.token_seconds}\n"
            "rgw enable usage log = false\n" + self._keystone_config())
        os.chmod(self.conf, 0o600)  # the service user's password, when there is one

    def _keystone_config(self) -> str:
        """ceph doc/radosgw/keystone.rst (Pacific): API v3, a service user in a project that validates tokens;
        ``accepted roles`` as kolla-ansible and ceph-ansible's rgw-keystone-v3 profile set them (RGW compares role
        names with fnmatch, case-sensitively, src/rgw/rgw_keystone.cc TokenEnvelope::has_role: its default "Member, admin" refuses Keystone's lower-case
        ``member``); the project's account in the URL (``/swift/v1/AUTH_<project id>``, kolla-ansible
        ``ceph_rgw_swift_account_in_url``) and no implicit tenants: the RGW user is the project id."""
        k = self.keystone
        if not k:
            return ""
        return ("rgw keystone api version = 3\n"
                f"rgw keystone url = {k['url']}\n"
                f"rgw keystone admin user = {k['user']}\n"
                f"rgw keystone admin password = {k['password']}\n"
                f"rgw keystone admin project = {k.get('project', 'service')}\n"
                f"rgw keystone admin domain = {k.get('domain', 'Default')}\n"
                "rgw keystone accepted roles = member, _member_, admin\n"
                "rgw keystone implicit tenants = false\n"
                "rgw keystone verify ssl = false\n"
                "rgw swift account in url = true\n"
                # S3 keys are Keystone EC2 credentials (doc/radosgw/keystone.rst "rgw s3 auth use keystone";
                # src/rgw/rgw_auth_keystone.cc EC2Engine), as Chameleon's `openstack ec2 credentials create` keys
                "rgw s3 auth use keystone = true\n")

    # -- processes -------------------------------------------------------------------------------

    def _ceph(self, *argv: str, timeout: float = 60.0) -> str:
        p = subprocess.run([*argv, "-c", str(self.conf)], capture_output=True, text=True, timeout=timeout,
                           stdin=subprocess.DEVNULL)
        if p.returncode != 0:
            raise ApplianceError(f"Ceph RGW did not start: {' '.join(argv[:3])}: "
                                 f"{(p.stderr or p.stdout).strip()[-300:]}", f"see {self.base / 'log'}")
        return p.stdout

    def _spawn(self, name: str, argv: list[str]) -> None:
        with open(self.base / "log" / f"{name}.out", "ab") as out:
            p = subprocess.Popen([*argv, "-c", str(self.conf), "-f"], stdin=subprocess.DEVNULL, stdout=out,
                                 stderr=subprocess.STDOUT, start_new_session=True)
        self.pids[name] = p.pid
        (self.base / "pids.json").write_text(json.dumps(self.pids))

    def healthy(self) -> bool:
        try:
            ctx = ssl.create_default_context(cafile=str(self.ca_file)) if self.tls else None
            with urllib.request.urlopen(f"{self.s3_endpoint}/", timeout=2, context=ctx) as r:  # anonymous ListBuckets
                return r.status == 200
        except OSError:
            return False

    def start(self, timeout: float = 60.0) -> RGWServer:
        if not installed():
            raise ApplianceError("Ceph RGW is not installed (ceph-mon, ceph-osd, radosgw)",
                                 f"apt-get install --no-install-recommends {PACKAGES} (make install does)")
        self.stop()  # leftovers of an earlier run of this BASE: memstore keeps nothing, so start clean
        for d in ("mon", "osd", "run"):
            shutil.rmtree(self.base / d, ignore_errors=True)
        self._write_config()
        fsid = next(ln.split("=", 1)[1].strip() for ln in self.conf.read_text().splitlines()
                    if ln.startswith("fsid"))
        monmap = self.base / "monmap"
        self._ceph("monmaptool", "--create", "--clobber", "--fsid", fsid, "--addv", "a",
                   f"[v2:127.0.0.1:{self.ports['mon']}]", str(monmap))
        self._ceph("ceph-mon", "--mkfs", "-i", "a", "--monmap", str(monmap))
        self._spawn("mon", ["ceph-mon", "-i", "a"])
        osd_uuid = str(uuid.uuid4())
        osd_id = self._ceph("ceph", "osd", "new", osd_uuid).strip()
        (self.base / "osd" / osd_id).mkdir(parents=True, exist_ok=True)
        self._ceph("ceph-osd", "-i", osd_id, "--mkfs", "--osd-uuid", osd_uuid)
        self._spawn("osd", ["ceph-osd", "-i", osd_id])
        deadline = time.monotonic() + timeout
        while json.loads(self._ceph("ceph", "osd", "stat", "-f", "json")).get("num_up_osds", 0) < 1:
            self._check_alive(("mon", "osd"), deadline, "the OSD did not come up")
            time.sleep(0.1)  # readiness poll of the OSD map (no HEALTH_OK without a mgr)
        self._spawn("rgw", ["radosgw", "-n", "client.rgw.local"])
        while not self.healthy():
            self._check_alive(DAEMONS, deadline, "radosgw did not answer")
            time.sleep(0.1)  # readiness poll of a local port
        admin = ("radosgw-admin", "-n", "client.admin")
        own_keys = [] if self.keystone else [f"--access-key={self.s3_access_key}", f"--secret-key={self.s3_secret_key}"]
        self._ceph(*admin, "user", "create", f"--uid={self.uid}", f"--display-name={self.uid}", *own_keys)
        self._ceph(*admin, "subuser", "create", f"--uid={self.uid}", f"--subuser={self.user}", "--access=full")
        self._ceph(*admin, "key", "create", f"--subuser={self.user}", "--key-type=swift", f"--secret={self.key}")
        # a full memstore OSD holds writes rather than refusing them (RADOS pauses clients at mon_osd_full_ratio):
        # the user's quota refuses them first, at QUOTA_SHARE of what it keeps, with RGW's own QuotaExceeded (S3 403,
        # Swift 413; ceph doc/radosgw/admin.rst "Quota Management", src/rgw/rgw_quota.cc)
        self._ceph(*admin, "quota", "set", "--quota-scope=user", f"--uid={self.uid}",
                   f"--max-size={int(self.memstore_bytes * QUOTA_SHARE)}")
        self._ceph(*admin, "quota", "enable", "--quota-scope=user", f"--uid={self.uid}")
        return self

    def _check_alive(self, names, deadline: float, what: str) -> None:
        for n in names:
            pid = self.pids.get(n)
            with contextlib.suppress(ChildProcessError):
                if pid and os.waitpid(pid, os.WNOHANG)[0] == pid:
                    self.stop()
                    raise ApplianceError(f"Ceph RGW did not start: {n} exited",
                                         f"see {self.base / 'log'} ({n}.out and the .log files)")
        if time.monotonic() > deadline:
            self.stop()
            raise ApplianceError(f"Ceph RGW did not start: {what}", f"see {self.base / 'log'}")

    def stop(self) -> None:
        pids_file = self.base / "pids.json"
        pids = json.loads(pids_file.read_text()) if pids_file.exists() else dict(self.pids)
        # radosgw, then the OSD, then the monitor: memstore keeps nothing, so SIGKILL loses nothing either
        for name in reversed(DAEMONS):
            pid = pids.get(name)
            if not pid:
                continue
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(pid, signal.SIGKILL)
            deadline = time.monotonic() + 10
            while time.monotonic() < deadline:
                with contextlib.suppress(ChildProcessError):
                    os.waitpid(pid, os.WNOHANG)
                try:
                    os.kill(pid, 0)
                except ProcessLookupError:
                    break
                time.sleep(0.02)  # bounded wait for the kernel to reap it
        pids_file.unlink(missing_ok=True)
        self.pids = {}
