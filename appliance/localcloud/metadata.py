"""Nova's metadata service as the local cloud's servers see it: http://169.254.169.254/openstack/...

On a Chameleon site an instance reaches 169.254.169.254 through Neutron's metadata proxy, which finds the instance
by the request's source address on its network and passes the request on to Nova's metadata API
(neutron/agent/metadata/agent.py `_get_instance_and_tenant_id`; nova/api/metadata/handler.py
`_handle_instance_id_request`). Here the listener sits in the testbed's metadata namespace (testbed
`ensure_metadata`, the counterpart of Neutron's metadata namespace) and looks the server up by its fixed IP.

What it serves (nova/api/metadata/base.py `InstanceMetadata`, OpenStack versions; `latest` and dated versions
alike):
- ``meta_data.json``: uuid, name, hostname, project_id, availability_zone, launch_index, public_keys.
- ``user_data``: the raw user data, 404 when the server has none.
- ``password``: nova/api/metadata/password.py `handle_password`: GET returns the stored text (empty when none);
  POST stores the body once (409 when one is stored; 400 over 4 x 255 = 1,020 bytes); the owner reads it with
  ``GET /servers/{id}/os-server-password`` and clears it with DELETE (nova/api/openstack/compute/server_password.py).
  The appliance's boot script publishes the node's SSH host public keys there: bare-metal servers have no console
  log to print them to.
- ``vendor_data2.json``: Nova's dynamic vendordata (nova/api/metadata/vendordata_dynamic.py: one key per target),
  with Chameleon's target ``chameleon``: node, region, lease_id, lease_start, lease_end (docs/chameleon.md B8,
  read from the CC images' cache-vendordata unit). Live: it shows the lease's end now, an extension included.
  One simplification: the dates are on the nodes' clock (real time) where the cloud's clock runs faster or was
  advanced, so a node compares them with its own `time.time()` as a Chameleon node does.
"""

from __future__ import annotations

import base64
import datetime as dt
import json
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

PASSWORD_MAX = 4 * 255  # nova/api/metadata/password.py CHUNKS * CHUNK_LENGTH
VERSIONS = ("2012-08-10", "2013-04-04", "2013-10-17", "2015-10-15", "2016-06-30", "2016-10-06", "2017-02-22",
            "2018-08-27", "2020-10-14", "latest")  # nova/api/metadata/base.py OPENSTACK_VERSIONS + "latest"
GRIZZLY = "2013-04-04"  # the first version with `password`


class _Handler(BaseHTTPRequestHandler):
    server_version = "appliance-localcloud-metadata/1"
    protocol_version = "HTTP/1.1"
    disable_nagle_algorithm = True  # headers and body are two writes: without this, 40 ms each (server.Handler)
    cloud = None  # set per server class

    def log_message(self, fmt, *args):
        pass

    def _send(self, code: int, body: bytes = b"", ctype: str = "text/plain; charset=UTF-8") -> None:
        self.send_response(code)
        self.send_header("Content-Type", ctype)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        if body and self.command != "HEAD":
            self.wfile.write(body)

    def _handle(self):
        c = self.cloud
        n = int(self.headers.get("Content-Length") or 0)
        body = self.rfile.read(n) if n else b""
        srv = c.server_by_fixed_ip(self.client_address[0])
        if srv is None:  # Neutron's proxy answers 404 for an address with no instance port
            return self._send(404, b"404 Not Found\n\nThe resource could not be found.\n")
        parts = [p for p in self.path.split("?")[0].split("/") if p]
        if parts[:1] != ["openstack"]:
            return self._send(404, b"404 Not Found\n")
        if len(parts) == 1:
            return self._send(200, "\n".join(VERSIONS).encode())
        if parts[1] not in VERSIONS:
            return self._send(404, b"404 Not Found\n")
        leaf = "/".join(parts[2:])
        if leaf == "":
            names = ["meta_data.json"] + (["user_data"] if srv.user_data else []) + (
                ["password"] if VERSIONS.index(parts[1]) >= VERSIONS.index(GRIZZLY) else []) + (
                ["vendor_data2.json"] if VERSIONS.index(parts[1]) >= VERSIONS.index("2016-10-06") else [])
            return self._send(200, "\n".join(names).encode())
        if leaf == "meta_data.json" and self.command == "GET":
            kp = c.keypairs.get(srv.key_name or "")
            md = {"uuid": srv.id, "name": srv.name, "hostname": c._hostname(srv.name),
                  "project_id": c.project_id, "availability_zone": "nova", "launch_index": 0,
                  "public_keys": {kp.name: kp.public_key} if kp else {}}
            return self._send(200, json.dumps(md).encode(), "application/json")
        if leaf == "user_data" and self.command == "GET":
            ud = srv.user_data
            return self._send(200, base64.b64decode(ud)) if ud else self._send(404, b"404 Not Found\n")
        if leaf == "vendor_data2.json" and self.command == "GET" and \
                VERSIONS.index(parts[1]) >= VERSIONS.index("2016-10-06"):
            return self._send(200, json.dumps(vendordata(c, srv)).encode(), "application/json")
        if leaf == "password" and VERSIONS.index(parts[1]) >= VERSIONS.index(GRIZZLY):
            if self.command == "GET":
                return self._send(200, srv.password.encode())
            if self.command == "POST":
                with c.lock:
                    if srv.password:
                        return self._send(409, b"409 Conflict\n")
                    if len(body) > PASSWORD_MAX:
                        return self._send(400, b"400 Bad Request\n\nRequest is too large.\n")
                    srv.password = body.decode("utf-8", errors="replace")
                return self._send(200)
            return self._send(400, b"400 Bad Request\n\nGET and POST only are supported.\n")
        return self._send(404, b"404 Not Found\n")

    do_GET = do_POST = do_PUT = do_DELETE = do_HEAD = _handle


def _node_clock(c, ts: float) -> str:
    """A cloud-clock time on the nodes' (real) clock, as Blazar formats lease dates."""
    real = time.time() + (ts - c.clock.now()) / c.clock.scale
    return dt.datetime.fromtimestamp(real, dt.timezone.utc).strftime("%Y-%m-%dT%H:%M:%S.%f")


def vendordata(c, srv) -> dict:
    lease = c.leases.get(srv.lease or "")
    cham = {"node": srv.host, "region": c.region}
    if lease is not None:
        cham.update(lease_id=lease.id, lease_start=_node_clock(c, lease.start), lease_end=_node_clock(c, lease.end))
    return {"chameleon": cham}


class MetadataService:
    """Serves `cloud`'s servers on an already listening socket (made in the metadata namespace)."""

    def __init__(self, cloud, sock):
        handler = type("MetadataHandler", (_Handler,), {"cloud": cloud})
        self.httpd = ThreadingHTTPServer(sock.getsockname(), handler, bind_and_activate=False)
        self.httpd.socket.close()
        self.httpd.socket = sock
        self.httpd.daemon_threads = True
        self.thread = threading.Thread(target=self.httpd.serve_forever, kwargs={"poll_interval": 0.2},
                                       name="metadata", daemon=True)
        self.thread.start()

    def close(self) -> None:
        self.httpd.shutdown()
        self.httpd.server_close()
