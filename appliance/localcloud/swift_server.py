"""A real OpenStack Swift (PyPI `swift`) on 127.0.0.1: the local cloud's object store, and the tests'.

Proxy + account/container/object servers, one device (a plain directory), rings of part power 10
and one replica built in-process, tempauth (user test:tester) with the s3api, bulk, slo and dlo
middleware, and a private memcached (a shared one serves stale account info). Every process is
started in its own process group, recorded by PID, and stopped by PID.

    sw = SwiftServer(base).start()
    sw.auth_url, sw.user, sw.key      # native API (auth v1)
    sw.s3_endpoint                    # S3 API: access key "test:tester", secret: the key
    sw.stop()
"""

from __future__ import annotations

import base64
import contextlib
import json
import os
import secrets
import shutil
import signal
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

from ..errors import ApplianceError
from .ports import listen_port

SERVERS = ("account", "container", "object")


class SwiftServer:
    user = "test:tester"
    kind = "swift"

    def __init__(self, base: str | Path, *, proxy_workers: int = 0, bind_ip: str = "127.0.0.1"):
        """bind_ip: where the proxy listens; a testbed bridge's host address makes it reachable from nodes.
        proxy_workers: the proxy's forked workers; 0, as for the other servers, serves in the server's one process
        (openstack/swift swift/common/wsgi.py ``WorkersStrategy.no_fork_sock``: with no workers, no fork). A forking
        server's parent wakes every half second to look after its children (``WorkersStrategy.loop_timeout``): the
        four servers of an idle Swift took 8% of a core here, for as long as a test module holds one."""
        self.base = Path(base)
        self.bind_ip = bind_ip
        self.key = secrets.token_hex(16)  # a fresh secret per start: nothing guessable, nothing to leak twice
        self.proxy_workers = proxy_workers
        self.ports: dict[str, int] = {}
        self.pids: dict[str, int] = {}

    # -- layout ----------------------------------------------------------------------------------

    @property
    def auth_url(self) -> str:
        return f"http://{self.bind_ip}:{self.ports['proxy']}/auth/v1.0"

    @property
    def s3_endpoint(self) -> str:
        return f"http://{self.bind_ip}:{self.ports['proxy']}"

    @property
    def storage_url(self) -> str:
        return f"http://{self.bind_ip}:{self.ports['proxy']}/v1/AUTH_test"

    def credentials(self) -> dict:
        return {"auth_url": self.auth_url, "user": self.user, "key": self.key, "storage_url": self.storage_url,
                "s3_endpoint": self.s3_endpoint, "s3_access_key": self.user, "s3_secret_key": self.key,
                "s3_region": "us-east-1"}

    def _write_config(self) -> None:
        etc, dev, log = self.base / "etc", self.base / "node" / "d1", self.base / "log"
        for d in (etc, dev, log):
            d.mkdir(parents=True, exist_ok=True)
        saved = self.base / "ports.json"
        if saved.exists():
            self.ports = json.loads(saved.read_text())
        else:
            self.ports = {name: listen_port() for name in ("proxy", *SERVERS, "memcached")}
            saved.write_text(json.dumps(self.ports))
        if not (etc / "swift.conf").exists():
            (etc / "swift.conf").write_text(
                f"[swift-hash]\nswift_hash_path_suffix = {secrets.token_hex(8)}\n\n"
                "[storage-policy:0]\nname = default\ndefault = yes\n")
        user = os.environ.get("USER") or "root"
        common = (f"bind_ip = 127.0.0.1\nswift_dir = {etc}\ndevices = {self.base / 'node'}\n"
                  f"mount_check = false\ndisable_fallocate = true\nuser = {user}\nlog_level = WARNING\n"
                  f"log_name = swift\n")
        for name in SERVERS:
            (etc / f"{name}-server.conf").write_text(
                f"[DEFAULT]\nbind_port = {self.ports[name]}\n{common}workers = 0\n\n"
                f"[pipeline:main]\npipeline = healthcheck {name}-server\n\n[app:{name}-server]\nuse = egg:swift#{name}\n\n"
                "[filter:healthcheck]\nuse = egg:swift#healthcheck\n")
        fernet = base64.urlsafe_b64encode(secrets.token_bytes(32)).decode()
        (etc / "proxy-server.conf").write_text(
            f"[DEFAULT]\nbind_port = {self.ports['proxy']}\n{common.replace('127.0.0.1', self.bind_ip)}"
            f"workers = {self.proxy_workers}\n\n"
            "[pipeline:main]\npipeline = catch_errors gatekeeper healthcheck proxy-logging cache listing_formats "
            "bulk s3api tempauth copy slo dlo proxy-logging proxy-server\n\n"
            "[app:proxy-server]\nuse = egg:swift#proxy\naccount_autocreate = true\n\n"
            "[filter:tempauth]\nuse = egg:swift#tempauth\n"
            f"user_test_tester = {self.key} .admin\n"
            f"fernet_key_k1 = {fernet}\nactive_fernet_key_id = k1\n\n"
            "[filter:s3api]\nuse = egg:swift#s3api\n\n"
            "[filter:bulk]\nuse = egg:swift#bulk\nmax_containers_per_extraction = 10000\n"
            "max_failed_extractions = 1000\n\n"
            f"[filter:cache]\nuse = egg:swift#memcache\nmemcache_servers = 127.0.0.1:{self.ports['memcached']}\n\n"
            "[filter:catch_errors]\nuse = egg:swift#catch_errors\n\n"
            "[filter:gatekeeper]\nuse = egg:swift#gatekeeper\n\n"
            "[filter:healthcheck]\nuse = egg:swift#healthcheck\n\n"
            "[filter:proxy-logging]\nuse = egg:swift#proxy_logging\n\n"
            "[filter:listing_formats]\nuse = egg:swift#listing_formats\n\n"
            "[filter:copy]\nuse = egg:swift#copy\n\n"
            "[filter:slo]\nuse = egg:swift#slo\n\n"
            "[filter:dlo]\nuse = egg:swift#dlo\n")
        if not (etc / "object.ring.gz").exists():
            from swift.common.ring import RingBuilder

            for name in SERVERS:
                b = RingBuilder(10, 1, 1)
                b.add_dev({"id": 0, "region": 1, "zone": 1, "ip": "127.0.0.1", "port": self.ports[name],
                           "device": "d1", "weight": 100})
                b.rebalance()
                b.get_ring().save(str(etc / f"{name}.ring.gz"))
                b.save(str(etc / f"{name}.builder"))

    # -- processes -------------------------------------------------------------------------------

    def _spawn(self, name: str, argv: list[str]) -> None:
        with open(self.base / "log" / f"{name}.log", "ab") as out:
            p = subprocess.Popen(argv, stdin=subprocess.DEVNULL, stdout=out, stderr=subprocess.STDOUT,
                                 start_new_session=True)
        self.pids[name] = p.pid
        (self.base / "pids.json").write_text(json.dumps(self.pids))

    def _healthy(self, port: int, ip: str = "127.0.0.1") -> bool:
        try:
            with urllib.request.urlopen(f"http://{ip}:{port}/healthcheck", timeout=1) as r:
                return r.status == 200
        except OSError:
            return False

    def start(self, timeout: float = 30.0) -> SwiftServer:
        memcached = shutil.which("memcached")
        if not memcached:
            raise ApplianceError("memcached is not installed", "apt-get install memcached (make install does)")
        self.stop()  # leftovers of an earlier run of this BASE
        self._write_config()
        bindir = Path(sys.executable).parent
        self._spawn("memcached", [memcached, "-u", "root", "-l", "127.0.0.1", "-p", str(self.ports["memcached"]),
                                  "-U", "0", "-m", "64"])
        for name in SERVERS:
            self._spawn(name, [str(bindir / f"swift-{name}-server"), str(self.base / "etc" / f"{name}-server.conf")])
        self._spawn("proxy", [str(bindir / "swift-proxy-server"), str(self.base / "etc" / "proxy-server.conf")])
        deadline = time.monotonic() + timeout
        pending = {n: self.ports[n] for n in ("proxy", *SERVERS)}
        while pending:
            for n, port in list(pending.items()):
                if self._healthy(port, self.bind_ip if n == "proxy" else "127.0.0.1"):
                    del pending[n]
            if pending and time.monotonic() > deadline:
                logs = " ".join((self.base / "log" / f"{n}.log").read_text()[-300:] for n in pending)
                self.stop()
                raise ApplianceError(f"Swift did not start ({', '.join(pending)}): {logs.strip()}")
            if pending:
                time.sleep(0.05)  # readiness poll of local ports
        return self

    def stop(self) -> None:
        pids_file = self.base / "pids.json"
        pids = json.loads(pids_file.read_text()) if pids_file.exists() else dict(self.pids)
        for pid in pids.values():
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(pid, signal.SIGTERM)
        deadline = time.monotonic() + 10
        for pid in pids.values():
            while time.monotonic() < deadline:
                with contextlib.suppress(ChildProcessError):
                    os.waitpid(pid, os.WNOHANG)
                try:
                    os.kill(pid, 0)
                except ProcessLookupError:
                    break
                time.sleep(0.02)  # bounded wait for a clean exit
            else:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(pid, signal.SIGKILL)
        pids_file.unlink(missing_ok=True)
        self.pids = {}
