"""/_admin: the simulator's own hooks for tests and demos (no real service has these)."""

from __future__ import annotations

from .api import Request, Route, nova_style_error
from .cloud import _fmt

PREFIX = "_admin"


error_body = nova_style_error


def advance(req: Request):
    c = req.cloud
    c.clock.advance(float((req.body or {}).get("seconds", 0)))
    c.tick()
    return 200, {"now": _fmt(c.clock.now())}


def reset_clock(req: Request):
    req.cloud.clock.reset()
    return 200, {"now": _fmt(req.cloud.clock.now())}


def faults(req: Request):
    req.cloud.faults.update({k: int(v) for k, v in (req.body or {}).items()})
    return 200, req.cloud.faults


def tokens(req: Request):
    """How long the tokens Keystone issues from now on live (tests: seconds; Chameleon's live a day)."""
    if req.method == "POST":
        req.cloud.token_lifetime = float((req.body or {})["seconds"])
    from .keystone import token_seconds

    return 200, {"seconds": token_seconds(req.cloud)}


def terms(req: Request):
    """Chameleon's terms this cloud holds its users to, changed while it runs (tests): ``clean_seconds`` (a node's
    cleaning after its server's delete, cloud.py), ``su_budget`` (the project's SUs, portal.py; null: not
    enforced), ``data_disk`` (bytes of the data disk a node booted from now on has, cloud.py; null: none).
    Answers them with the SUs used and left."""
    c, body = req.cloud, req.body or {}
    if req.method == "POST":
        if "data_disk" in body:
            c.data_disk = None if body["data_disk"] is None else int(body["data_disk"])
        if "clean_seconds" in body:
            c.clean_seconds = float(body["clean_seconds"])
        if "su_budget" in body:
            c.portal.su_budget = None if body["su_budget"] is None else float(body["su_budget"])
    return 200, {"clean_seconds": c.clean_seconds, "su_budget": c.portal.su_budget, "data_disk": c.data_disk,
                 "su_used": round(c.portal.used(), 4), "su_left": c.portal.left()}


def requests(req: Request):
    if req.method == "DELETE":
        req.cloud.requests.clear()
        return 204, None
    return 200, {"requests": list(req.cloud.requests)}


ROUTES = [
    Route("POST", "/advance", advance, auth=False),
    Route("POST", "/clock/reset", reset_clock, auth=False),
    Route("POST", "/faults", faults, auth=False),
    Route(None, "/tokens", tokens, auth=False),
    Route(None, "/terms", terms, auth=False),
    Route(None, "/requests", requests, auth=False),
    Route(None, "/clock", lambda req: (200, {"now": _fmt(req.cloud.clock.now()), "time_scale": req.cloud.clock.scale}),
          auth=False),
    Route(None, "/health", lambda req: (200, {"ok": True}), auth=False),
]
