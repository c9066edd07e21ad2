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
        cred = next((x for x in _app_creds(req.cloud) if ac.get("id") == x["id"] or ac.get("name") == x["name"]), None)
        ok = cred is not None and ac.get("secret") == cred["secret"]
    if not ok:
        raise ApiError(401, "The request you have made requires authentication.", "Unauthorized")
    tok = "gAAAA" + secrets.token_urlsafe(32)
    req.cloud.tokens[tok] = time.time() + 3600
    if "application_credential" in methods:
        req.cloud.token_info[tok] = {"app_cred": cred["id"], "unrestricted": cred["unrestricted"]}
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
        token["application_credential"] = {"id": cred["id"], "name": cred["name"],
                                           "restricted": not cred["unrestricted"]}
    return 201, {"token": token}, {"X-Subject-Token": tok}


def _app_creds(c) -> list[dict]:
    """The cloud's own application credential (unrestricted, as Chameleon asks for: docs cli/authentication.rst)
    and those made through the API."""
    cr = c.creds
    return [{"id": cr["app_cred_id"], "name": cr["app_cred_name"], "secret": cr["app_cred_secret"],
             "unrestricted": True}] + list(c.app_creds.values())


def create_app_cred(req: Request, user_id: str):
    """keystone/api/users.py UserAppCredListCreateResource.post: a token from a *restricted* application credential
    may not make another (ForbiddenAction, 403); `unrestricted` defaults to false; the secret is made when not
    given and shown only here."""
    c = req.cloud
    info = c.token_info.get(req.handler.headers.get("X-Auth-Token") or "", {})
    if info.get("app_cred") and not info.get("unrestricted"):
        raise ApiError(403, "You are not authorized to perform the requested action: Using method "
                       "'application_credential' is not allowed for managing additional application credentials.",
                       "Forbidden")
    if user_id != c.user_id:
        raise ApiError(403, "You are not authorized to perform the requested action.", "Forbidden")
    body = (req.body or {}).get("application_credential") or {}
    if not body.get("name"):
        raise ApiError(400, "Invalid input for field 'name': None is not of type 'string'", "ValidationError")
    if any(x["name"] == body["name"] for x in _app_creds(c)):
        raise ApiError(409, "Conflict occurred attempting to store application_credential - Duplicate entry.",
                       "Conflict")
    cred = {"id": _uuid().replace("-", ""), "name": body["name"], "secret": body.get("secret") or
            secrets.token_urlsafe(48), "unrestricted": bool(body.get("unrestricted", False))}
    c.app_creds[cred["id"]] = cred
    return 201, {"application_credential": {
        **cred, "description": body.get("description"), "project_id": c.project_id, "expires_at": body.get("expires_at"),
        "roles": [{"id": _uuid(), "name": "member"}], "access_rules": body.get("access_rules") or [],
        "links": {"self": f"{req.base}/identity/v3/users/{user_id}/application_credentials/{cred['id']}"}}}


def check_token(req: Request):
    req.auth()
    return 200, {}


ROUTES = [
    Route("GET", "/", lambda req: (300, {"versions": {"values": [_version(req.base)]}}), auth=False),
    Route("GET", "/v3", lambda req: (200, {"version": _version(req.base)}), auth=False),
    Route("POST", "/v3/auth/tokens", issue_token, auth=False),
    Route(("GET", "HEAD"), "/v3/auth/tokens", check_token, auth=False),
    Route("POST", "/v3/users/([^/]+)/application_credentials", create_app_cred),
]
