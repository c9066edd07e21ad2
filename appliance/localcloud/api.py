"""The local cloud's request routing: each service is a module with a route table (``ROUTES``: method(s), a
path pattern matched in full, a handler, whether it needs a token), an optional path normalisation, and the error
body shape of the real service. server.py holds the HTTP plumbing and the table of services."""

from __future__ import annotations

import re
from collections.abc import Callable
from dataclasses import dataclass

from .cloud import ApiError, Cloud
from .state import Token


@dataclass
class Request:
    method: str
    path: str  # below the service's prefix, e.g. /v3/auth/tokens
    query: dict
    body: object
    base: str  # http://host:port
    cloud: Cloud
    handler: object  # the BaseHTTPRequestHandler, for streamed bodies (Glance uploads) and headers

    def caller(self) -> Token:
        """The record of the token the request came with (an empty one when it has none)."""
        return self.cloud.token(self.handler.headers.get("X-Auth-Token")) or Token(0.0, {})

    def auth(self) -> None:
        tok = self.handler.headers.get("X-Auth-Token")
        if not self.cloud.token_valid(tok):
            raise ApiError(401, "The request you have made requires authentication.", "Unauthorized")


@dataclass
class Route:
    methods: str | tuple | None  # None: any method
    pattern: str
    fn: Callable
    auth: bool = True

    def __post_init__(self):
        if isinstance(self.methods, str):
            self.methods = (self.methods,)


def dispatch(routes: list[Route], req: Request, *, normalize: Callable[[str], str] = lambda p: p,
             not_found: str = "NotFound"):
    """The first route whose pattern matches the path in full and whose method fits. Routes that need a token are
    tried after a token check (made once, before the first of them, as the services check it before routing); they
    match the normalised path (a version prefix or a project id removed)."""
    checked = False
    for r in routes:
        path = req.path
        if r.auth:
            if not checked:
                req.auth()
                checked = True
            path = normalize(req.path)
        m = re.fullmatch(r.pattern, path)
        if m and (r.methods is None or req.method in r.methods):
            return r.fn(req, *m.groups())
    if not checked and any(r.auth for r in routes):
        req.auth()
    raise ApiError(404, f"not found: {req.path}", not_found)


def get_or_404(table: dict, key: str, message: str, name: str):
    """A record by id, or the service's 404 (``message`` and ``name`` as the real service words them)."""
    if key not in table:
        raise ApiError(404, message, name)
    return table[key]


def versions(vid: str, href: str) -> dict:
    return {"versions": [{"id": vid, "status": "CURRENT", "links": [{"rel": "self", "href": href}]}]}


# openstack/nova nova/api/openstack/wsgi.py, class Fault: the body is {NAME: {"code", "message"}}, NAME from
# _fault_names by status, "computeFault" for any other status.
NOVA_FAULT_NAMES = {400: "badRequest", 401: "unauthorized", 403: "forbidden", 404: "itemNotFound", 405: "badMethod",
                    409: "conflictingRequest", 413: "overLimit", 415: "badMediaType", 429: "overLimit",
                    501: "notImplemented", 503: "serviceUnavailable"}


def nova_style_error(e: ApiError) -> dict:
    """Nova's error body (openstack/nova nova/api/openstack/wsgi.py Fault). The local Glance and the /_admin hooks
    answer in it too: a simplification (Glance's own errors are webob text pages), no client here reads them."""
    return {NOVA_FAULT_NAMES.get(e.code, "computeFault"): {"code": e.code, "message": e.message}}
