"""Keystone v3 (/identity): password and application-credential tokens, the service catalog."""

from __future__ import annotations

import datetime as dt
import json
import secrets
import time

from .api import Request, Route
from .cloud import REGION, ApiError, _uuid

PREFIX = "identity"


def error_body(e: ApiError) -> dict:
    """openstack/keystone keystone/server/flask/application.py _handle_keystone_exception: {"error": {code, message,
    title}}."""
    return {"error": {"code": e.code, "message": e.message, "title": e.name or "Error"}}


def _version(base: str) -> dict:
    return {"id": "v3.14", "status": "stable", "updated": "2020-04-07T00:00:00Z",
            "links": [{"rel": "self", "href": f"{base}/identity/v3/"}],
            "media-types": [{"base": "application/json", "type": "application/vnd.openstack.identity-v3+json"}]}


def catalog(req: Request) -> list:
    base, c = req.base, req.cloud

    def svc(stype, name, url):
        return {"type": stype, "name": name, "id": _uuid(), "endpoints": [
            {"id": _uuid(), "interface": i, "region": REGION, "region_id": REGION, "url": url}
            for i in ("public", "internal")]}

    cat = [svc("identity", "keystone", f"{base}/identity/v3"),
           svc("reservation", "blazar", f"{base}/reservation/v1"),
           svc("compute", "nova", f"{base}/compute/v2.1"),
           svc("network", "neutron", f"{base}/network"),
           svc("image", "glance", f"{base}/image"),
           svc("orchestration", "heat", f"{base}/orchestration/v1/{c.project_id}")]
    extra = c.dir / "catalog-extra.json"
    if extra.exists():
        for e in json.loads(extra.read_text()):
            cat.append(svc(e["type"], e["name"], e["url"]))
    return cat


def issue_token(req: Request):
    ident = ((req.body or {}).get("auth") or {}).get("identity") or {}
    creds = req.cloud.creds
    ok = False
    methods = ident.get("methods") or []
    if "password" in methods:
        user = (ident.get("password") or {}).get("user") or {}
        ok = (user.get("name") == creds["username"] or user.get("id") == creds["user_id"]) and \
            user.get("password") == creds["password"]
    elif "application_credential" in methods:
        ac = ident.get("application_credential") or {}
        ok = (ac.get("id") == creds["app_cred_id"] or ac.get("name") == creds["app_cred_name"]) and \
            ac.get("secret") == creds["app_cred_secret"]
    if not ok:
        raise ApiError(401, "The request you have made requires authentication.", "Unauthorized")
    tok = "gAAAA" + secrets.token_urlsafe(32)
    req.cloud.tokens[tok] = time.time() + 3600
    now = dt.datetime.now(dt.timezone.utc)
    token = {"methods": methods, "expires_at": (now + dt.timedelta(hours=1)).strftime("%Y-%m-%dT%H:%M:%S.000000Z"),
             "issued_at": now.strftime("%Y-%m-%dT%H:%M:%S.000000Z"),
             "user": {"id": creds["user_id"], "name": creds["username"],
                      "domain": {"id": "default", "name": "Default"}, "password_expires_at": None},
             "project": {"id": creds["project_id"], "name": creds["project_name"],
                         "domain": {"id": "default", "name": "Default"}},
             "roles": [{"id": _uuid(), "name": "member"}], "catalog": catalog(req),
             "audit_ids": [secrets.token_urlsafe(8)], "is_domain": False}
    if "application_credential" in methods:
        token["application_credential"] = {"id": creds["app_cred_id"], "name": creds["app_cred_name"],
                                           "restricted": False}
    return 201, {"token": token}, {"X-Subject-Token": tok}


def check_token(req: Request):
    req.auth()
    return 200, {}


ROUTES = [
    Route("GET", "/", lambda req: (300, {"versions": {"values": [_version(req.base)]}}), auth=False),
    Route("GET", "/v3", lambda req: (200, {"version": _version(req.base)}), auth=False),
    Route("POST", "/v3/auth/tokens", issue_token, auth=False),
    Route(("GET", "HEAD"), "/v3/auth/tokens", check_token, auth=False),
]
