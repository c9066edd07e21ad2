"""Neutron v2.0 (/network): networks, ports, floating IPs (tags, association)."""

from __future__ import annotations

import re

from .api import Request, Route, get_or_404, versions
from .cloud import ApiError

PREFIX = "network"


def error_body(e: ApiError) -> dict:
    """openstack/neutron neutron/api/v2/resource.py: {'NeutronError': get_exception_data(e)} (type, message, detail)."""
    return {"NeutronError": {"type": e.name or "NeutronError", "message": e.message, "detail": ""}}


def normalize(path: str) -> str:
    """The version prefix, and a '.json' suffix (kept from the first version of the local cloud; not checked
    against Neutron's router here)."""
    p = path[len("/v2.0"):] if path.startswith("/v2.0") else path
    return re.sub(r"\.json$", "", p)


def networks(req: Request):
    c, q = req.cloud, req.query
    nets = [c.sharednet.view(), c.public.view()]
    for k in ("name", "id"):
        if k in q:
            nets = [n for n in nets if n[k] == q[k]]
    if "router:external" in q:
        nets = [n for n in nets if str(n["router:external"]).lower() == q["router:external"].lower()]
    return 200, {"networks": nets}


def network(req: Request, nid: str):
    for n in (req.cloud.sharednet, req.cloud.public):
        if n.id == nid:
            return 200, {"network": n.view()}
    raise ApiError(404, f"Network {nid} could not be found.", "NetworkNotFound")


def ports(req: Request):
    out = [p.view() for p in req.cloud.ports()]
    if "device_id" in req.query:
        out = [x for x in out if x["device_id"] == req.query["device_id"]]
    return 200, {"ports": out}


def create_fip(req: Request):
    c = req.cloud
    f = (req.body or {}).get("floatingip") or {}
    if f.get("floating_network_id") != c.public.id:
        raise ApiError(400, "floating_network_id must be the external network", "BadRequest")
    with c.lock:
        fip = c._new_fip()
        if f.get("port_id"):
            c.associate(fip.id, f["port_id"])
    return 201, {"floatingip": fip.view()}


def list_fips(req: Request):
    q = req.query
    fips = [f.view() for f in req.cloud.fips.values()]
    for k in ("floating_ip_address", "port_id", "id", "floating_network_id"):
        if k in q:
            fips = [f for f in fips if str(f[k]) == q[k]]
    if "tags" in q:
        want = set(q["tags"].split(","))
        fips = [f for f in fips if want <= set(f["tags"])]
    return 200, {"floatingips": fips}


def fip(req: Request, fid: str):
    c = req.cloud
    rec = get_or_404(c.fips, fid, f"Floating IP {fid} could not be found", "FloatingIPNotFound")
    if req.method == "PUT":
        f = (req.body or {}).get("floatingip") or {}
        return 200, {"floatingip": c.associate(fid, f.get("port_id")).view()}
    if req.method == "DELETE":
        if "blazar" in rec.tags:
            raise ApiError(409, "A reserved floating IP is released by its lease", "Conflict")
        with c.lock:
            c._release_fip(fid)
        return 204, None
    return 200, {"floatingip": rec.view()}


ROUTES = [
    Route(None, "/", lambda req: (200, versions("v2.0", f"{req.base}/network/v2.0/")), auth=False),
    Route(None, "/networks", networks),
    Route(None, "/networks/([^/]+)", network),
    Route(None, "/ports", ports),
    Route("POST", "/floatingips", create_fip),
    Route(None, "/floatingips", list_fips),
    Route(None, "/floatingips/([^/]+)", fip),
]
