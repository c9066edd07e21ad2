"""The local cloud: a small OpenStack-compatible control plane on 127.0.0.1 that behaves like Chameleon.

One HTTP server, one port, the services under path prefixes listed in Keystone's catalog:

    /identity/v3     Keystone: password and application-credential tokens, the service catalog
    /reservation/v1  Blazar: leases of physical hosts and floating IPs, node pools per node type
    /compute/v2.1    Nova: servers (booted as testbed nodes), key pairs, flavors, console output
    /network/v2.0    Neutron: networks, ports, floating IPs (tags, association)
    /image/v2        Glance: the image list, create, upload, delete
    /orchestration   Heat: stacks of the resource types our template uses
    /_admin          test hooks: advance the clock, inject faults, read the request log

Layout: this module is the HTTP plumbing and the table of services; each service is a module with a route table
(keystone.py, blazar.py, nova.py, neutron.py, glance.py, orchestration.py, admin_hooks.py; routing in api.py); the state
and the operations they share are cloud.py; servers run on a node backend (nodes.py: testbed namespaces).

The same client code that talks to Chameleon talks to this, over HTTP, with the real clients
(keystoneauth, openstacksdk, python-blazarclient). Where it matters it acts like Chameleon: lease
dates in UTC at minute resolution, resource_properties as a JSON string of string triples, the
7-day cap and the 48-hour extension window, NotEnoughHostsAvailable when a pool is exhausted or a
host is booked after your end, reservation id != lease id, servers only on an active reservation,
and at the lease end every server of the lease is deleted (the node and its disk are gone).

Time: the cloud has its own clock (the HTTP ``Date`` header), running ``time_scale`` times faster
than real time, and ``POST /_admin/advance`` moves it forward at once.
"""

from __future__ import annotations

import argparse
import email.utils
import json
import os
import signal
import sys
import threading
import traceback
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from urllib.parse import parse_qs, urlparse

from .. import report
from . import admin_hooks, blazar, glance, keystone, neutron, nova, orchestration
from .api import Request, dispatch
from .cloud import CLEAN_SECONDS, DEFAULT_POOLS, REGION, ApiError, Cloud, _uuid, redacted

SERVICES = {m.PREFIX: m for m in (keystone, blazar, nova, neutron, glance, orchestration, admin_hooks)}


class Handler(BaseHTTPRequestHandler):
    server_version = "appliance-localcloud/1"
    protocol_version = "HTTP/1.1"
    # The status line and headers go out in one write and the body in a second; with Nagle's algorithm on a kept-
    # alive connection the body then waits for the client's delayed ACK: 40 ms on every call (measured: 44 ms per
    # GET /leases/ID, 0.7 ms without). OpenStack's services answer in one write (eventlet `eventlet/wsgi.py`
    # `HttpProtocol.handle_one_response`: status, headers and the first chunk joined in `towrite`, one `writelines`
    # + `flush`); TCP_NODELAY gives the same timing here (docs/localcloud.md).
    disable_nagle_algorithm = True
    cloud: Cloud

    def log_message(self, fmt, *args):  # quiet; the request log is in /_admin/requests
        pass

    def date_time_string(self, timestamp=None):
        return email.utils.formatdate(self.cloud.clock.now(), usegmt=True)

    def _send(self, code: int, body=None, headers: dict | None = None) -> None:
        data = b"" if body is None else json.dumps(body).encode()
        self.send_response(code)
        if body is not None:
            self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.send_header("x-openstack-request-id", "req-" + _uuid())
        for k, v in (headers or {}).items():
            self.send_header(k, v)
        self.end_headers()
        if data and self.command != "HEAD":
            self.wfile.write(data)

    def _body(self):
        n = int(self.headers.get("Content-Length") or 0)
        raw = self.rfile.read(n) if n else b""
        if not raw:
            return {}
        try:
            return json.loads(raw)
        except ValueError:
            raise ApiError(400, "Malformed JSON in request body", "BadRequest") from None

    def _dispatch(self):
        url = urlparse(self.path)
        path = url.path.rstrip("/") or "/"
        query = {k: v[0] for k, v in parse_qs(url.query).items()}
        prefix = path.split("/")[1] if path != "/" else ""
        service = SERVICES.get(prefix)
        sub = path[len(prefix) + 1:] or "/"
        streamed = service is glance and glance.raw_body(self.command, sub)
        body = self._body() if self.command in ("POST", "PUT", "PATCH") and not streamed else None
        self.cloud.requests.append({"method": self.command, "path": url.path, "query": query, "body": redacted(body)})
        if unavailable(self.cloud, self.command, url.path):
            raise _Unavailable()
        self.cloud.tick()
        if service is None:
            raise ApiError(404, f"no such service: {path}", "NotFound")
        req = Request(self.command, sub, query, body, f"http://{self.headers.get('Host')}", self.cloud, self)
        return dispatch(service.ROUTES, req, normalize=getattr(service, "normalize", lambda p: p),
                        not_found=getattr(service, "NOT_FOUND", "NotFound"))

    def _handle(self):
        try:
            result = self._dispatch()
            code, body = result[0], result[1]
            headers = result[2] if len(result) > 2 else None
            self._send(code, body, headers)
        except ApiError as e:
            service = SERVICES.get(self.path.split("/")[1], nova)
            self._send(e.code, service.error_body(e))
        except _Unavailable:
            self.send_response(503)
            for k, v in (("Cache-Control", "no-cache"), ("Content-Type", "text/html"),
                         ("Content-Length", str(len(HAPROXY_503)))):
                self.send_header(k, v)
            self.end_headers()
            self.wfile.write(HAPROXY_503)
        except Exception as e:  # pragma: no cover - a bug in the simulator
            traceback.print_exc()
            self._send(500, {"error": {"code": 500, "message": str(e)}})

    do_GET = do_POST = do_PUT = do_DELETE = do_PATCH = do_HEAD = _handle


# Chameleon's API endpoints sit behind HAProxy (its sites are deployed with kolla-ansible, whose loadbalancer role
# puts HAProxy in front of every API: openstack/kolla-ansible ansible/roles/loadbalancer); when no backend of a
# service answers (a restart, an outage) HAProxy itself answers 503 with its own HTML page (haproxy src/http.c
# http_err_msgs, HTTP_ERR_503), which no OpenStack client can read as JSON.
HAPROXY_503 = (b"<html><body><h1>503 Service Unavailable</h1>\nNo server is available to handle this request.\n"
               b"</body></html>\n")


class _Unavailable(Exception):
    pass


def unavailable(cloud: Cloud, method: str, path: str) -> bool:
    """The fault ``"503 METHOD /path/prefix": N`` (POST /_admin/faults): the next N such requests find no backend
    behind HAProxy (one of a few seconds' outage of that service)."""
    with cloud.lock:
        for key, n in cloud.faults.items():
            if n > 0 and key.startswith("503 "):
                _, m, prefix = (key.split(" ", 2) + ["", ""])[:3]
                if m == method and path.startswith(prefix):
                    cloud.faults[key] = n - 1
                    return True
    return False


def serve(state_dir: Path, port: int, time_scale: float, boot_seconds: float, testbed_name: str,
          hosts: int | None = None, region: str = REGION, clock: Path | None = None,
          clean_seconds: float = CLEAN_SECONDS, su_budget: float | None = None) -> None:
    httpd = ThreadingHTTPServer(("127.0.0.1", port), Handler)
    base = f"http://127.0.0.1:{httpd.server_address[1]}"
    pools = None if hosts is None else {**DEFAULT_POOLS, "compute_local": hosts}
    cloud = Cloud(state_dir, time_scale=time_scale, boot_seconds=boot_seconds, base_url=base,
                  testbed_name=testbed_name, pools=pools, region=region, clock=clock, clean_seconds=clean_seconds,
                  su_budget=su_budget)
    Handler.cloud = cloud
    stop = threading.Event()
    # Chameleon's API endpoints are public: a node reaches Keystone (and the object store's catalog entry) at the
    # same address as the launcher. Here the API also listens on the cloud's bridge, so nodes can authenticate
    # with an application credential; a request's Host header decides the URLs its answer names.
    servers = [httpd]
    node_ip = getattr(cloud.nodes, "host_ip", None)
    if node_ip:
        try:
            servers.append(ThreadingHTTPServer((node_ip, httpd.server_address[1]), Handler))
        except OSError as e:
            print(f"the API does not listen on the nodes' bridge {node_ip}: {e}", flush=True)
    for extra in servers[1:]:
        threading.Thread(target=extra.serve_forever, kwargs={"poll_interval": 0.2}, daemon=True).start()

    def on_term(*_):
        stop.set()
        for srv in servers:
            threading.Thread(target=srv.shutdown, daemon=True).start()

    signal.signal(signal.SIGTERM, on_term)
    signal.signal(signal.SIGINT, on_term)

    def engine():
        while not stop.wait(0.2):
            cloud.tick()

    threading.Thread(target=engine, daemon=True).start()
    tmp = state_dir / "endpoint.tmp"  # whole or not at all: `start` polls for this file and reads it at once
    tmp.write_text(base)
    os.replace(tmp, state_dir / "endpoint")
    try:
        httpd.serve_forever(poll_interval=0.2)
    finally:
        cloud.shutdown()
        (state_dir / "endpoint").unlink(missing_ok=True)


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description="appliance local cloud server")
    ap.add_argument("--state", required=True)
    ap.add_argument("--port", type=int, default=0)
    ap.add_argument("--time-scale", type=float, default=1.0)
    ap.add_argument("--boot-seconds", type=float, default=0.0)
    ap.add_argument("--testbed", default="cloud", help="name of the testbed its servers live on")
    ap.add_argument("--hosts", type=int, default=None, help="compute_local hosts in Blazar's pool (default 4)")
    ap.add_argument("--region", default=REGION, help="the site's name (its catalog's region)")
    ap.add_argument("--clock", default=None, help="a file holding the clock every site of this local cloud shares")
    ap.add_argument("--clean-seconds", type=float, default=CLEAN_SECONDS,
                    help="real seconds Ironic cleans a node after its server's delete (cloud.py)")
    ap.add_argument("--su-budget", type=float, default=None, help="the project's SUs (portal.py; default: not enforced)")
    a = ap.parse_args(argv)
    report.default(lambda m: print(m, flush=True))  # what its steps say (its testbed's nodes) into server.log
    serve(Path(a.state), a.port, a.time_scale, a.boot_seconds, a.testbed, a.hosts, a.region,
          Path(a.clock) if a.clock else None, a.clean_seconds, a.su_budget)


if __name__ == "__main__":
    main(sys.argv[1:])
