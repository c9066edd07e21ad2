"""Nova v2.1 (/compute): servers (booted on the node backend), key pairs, the flavor, console output (none: bare metal),
server password, interfaces."""

from __future__ import annotations

import re

from .api import Request, Route, get_or_404, nova_style_error
from .cloud import ApiError
from .state import Keypair

PREFIX = "compute"
NOT_FOUND = "itemNotFound"


error_body = nova_style_error


def normalize(path: str) -> str:
    """The version prefix, and the project id that old-style compute URLs carry: openstack/nova
    nova/api/openstack/compute/routes.py ROUTE_LIST is mapped with `create_route` of the project mapper
    (nova/api/openstack/__init__.py), which accepts each path with and without '/{project_id}'."""
    p = path[len("/v2.1"):] if path.startswith("/v2.1") else path
    return re.sub(r"^/[0-9a-f]{32}(?=/|$)", "", p)  # a project id in the path (old style)


def _version(base: str) -> dict:
    return {"id": "v2.1", "status": "CURRENT", "version": "2.79", "min_version": "2.1",
            "updated": "2013-07-23T11:33:21Z", "links": [{"rel": "self", "href": f"{base}/compute/v2.1/"}]}


def flavor(req: Request, fid: str):
    c = req.cloud
    if fid not in (c.flavor["id"], c.flavor["name"]):
        raise ApiError(404, f"Flavor {fid} could not be found.", "itemNotFound")
    return 200, {"flavor": c.flavor}


def create_keypair(req: Request):
    c = req.cloud
    kp = (req.body or {}).get("keypair") or {}
    name = kp.get("name", "")
    if not re.fullmatch(r"[A-Za-z0-9_. -]{1,255}", name or ""):
        raise ApiError(400, "Keypair data is invalid: name", "BadRequest")
    if name in c.keypairs:
        raise ApiError(409, f"Key pair '{name}' already exists.", "conflictingRequest")
    if not kp.get("public_key"):
        raise ApiError(400, "Generating key pairs is not supported here: give public_key", "BadRequest")
    rec = Keypair(name, kp["public_key"].strip(), c.user_id)
    c.keypairs[name] = rec
    return 200, {"keypair": rec.view()}


def keypair(req: Request, name: str):
    kp = get_or_404(req.cloud.keypairs, name, f"Keypair {name} not found", "itemNotFound")
    if req.method == "DELETE":
        del req.cloud.keypairs[name]
        return 202, None
    return 200, {"keypair": kp.view()}


def list_servers(req: Request, detail: str | None):
    # `name` is a regular expression searched in the name, for any user: openstack/nova
    # nova/api/openstack/compute/servers.py `_get_server_search_options` (a non-admin's filters include it),
    # nova/db/main/api.py `_regex_instance_filter` (the database's REGEXP: a search, not a whole-name match)
    out = [req.cloud.server_view(s) for s in req.cloud.servers.values() if s.status != "DELETED"]
    if "name" in req.query:
        out = [s for s in out if re.search(req.query["name"], s["name"])]
    if not detail:
        out = [{"id": s["id"], "name": s["name"], "links": []} for s in out]
    return 200, {"servers": out}


def server(req: Request, sid: str):
    c = req.cloud
    srv = c.get_server(sid)
    if req.method == "DELETE":
        with c.lock:
            c._delete_server(srv)
        return 204, None
    return 200, {"server": c.server_view(srv)}


def action(req: Request, sid: str):
    req.cloud.get_server(sid)
    if "os-getConsoleOutput" in (req.body or {}):
        # Every server here is bare metal (flavor baremetal), and Nova's Ironic driver has no get_console_output
        # (nova/virt/ironic/driver.py; the ComputeDriver default in nova/virt/driver.py raises
        # NotImplementedError), which nova/api/openstack/compute/console_output.py turns into
        # common.raise_feature_not_supported(): 501 with this message.
        raise ApiError(501, "The requested functionality is not supported.", "notImplemented")
    raise ApiError(400, "unsupported action", "BadRequest")


def server_password(req: Request, sid: str):
    """nova/api/openstack/compute/server_password.py: GET shows what the server POSTed to its metadata
    ``password`` (empty when nothing), DELETE clears it (204). See metadata.py for the server's side."""
    c = req.cloud
    srv = c.get_server(sid)
    if req.method == "DELETE":
        with c.lock:
            srv.password = ""
        return 204, None
    if req.method != "GET":
        raise ApiError(405, "The method specified is not allowed for this resource.", "badMethod")
    return 200, {"password": srv.password}


def interfaces(req: Request, sid: str):
    srv = req.cloud.get_server(sid)
    ports = [srv.port] if srv.port else []
    return 200, {"interfaceAttachments": [{"port_id": x.id, "net_id": x.network_id, "mac_addr": x.mac_address,
                                           "port_state": "ACTIVE", "fixed_ips": x.view()["fixed_ips"]} for x in ports]}


ROUTES = [
    Route(None, "/", lambda req: (200, {"versions": [_version(req.base)]}), auth=False),
    Route("GET", "/v2.1", lambda req: (200, {"version": _version(req.base)}), auth=False),
    Route(None, "/flavors(?:/detail)?", lambda req: (200, {"flavors": [req.cloud.flavor]})),
    Route(None, "/flavors/([^/]+)", flavor),
    Route("GET", "/os-keypairs",
          lambda req: (200, {"keypairs": [{"keypair": k.view()} for k in req.cloud.keypairs.values()]})),
    Route(None, "/os-keypairs", create_keypair),
    Route(None, "/os-keypairs/([^/]+)", keypair),
    Route("POST", "/servers", lambda req: (202, req.cloud.create_servers(req.body or {}))),
    Route("GET", "/servers(/detail)?", list_servers),
    Route(None, "/servers/([^/]+)", server),
    Route("POST", "/servers/([^/]+)/action", action),
    Route(None, "/servers/([^/]+)/os-interface", interfaces),
    Route(None, "/servers/([^/]+)/os-server-password", server_password),
]
