"""Keystone v3 (/identity): password and application-credential tokens that expire, token validation for the
services that ask (the local Ceph RGW, as Chameleon's RGW asks its Keystone), application credentials made and
deleted through the API, EC2 credentials (Chameleon's S3 keys) and the /v3/s3tokens check the RGW asks for them,
the service catalog."""

from __future__ import annotations

import base64
import datetime as dt
import hashlib
import hmac
import json
import os
import secrets
import time

from .api import Request, Route
from .cloud import ApiError, _uuid
from .state import AppCred, Ec2Cred, Token

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
            {"id": _uuid(), "interface": i, "region": c.region, "region_id": c.region, "url": url}
            for i in ("public", "internal")]}

    cat = [svc("identity", "keystone", f"{base}/identity/v3"),
           svc("reservation", "blazar", f"{base}/reservation/v1"),
           svc("compute", "nova", f"{base}/compute/v2.1"),
           svc("network", "neutron", f"{base}/network"),
           svc("image", "glance", f"{base}/image"),
           svc("orchestration", "heat", f"{base}/orchestration/v1/{c.project_id}")]
    store = object_store_url(c)
    if store:
        cat.append(svc("object-store", "swift", store))
    extra = c.dir / "catalog-extra.json"
    if extra.exists():
        for e in json.loads(extra.read_text()):
            cat.append(svc(e["type"], e["name"], e["url"]))
    return cat


def object_store_url(c) -> str | None:
    """The object-store endpoint when the local store is the Ceph RGW that validates Keystone tokens: its Swift API
    with the project's account in the URL, as ceph doc/radosgw/keystone.rst registers it
    (``/swift/v1/AUTH_$(project_id)s``, with ``rgw swift account in url = true``). The RGW listens on the cloud's
    bridge; a node and this machine reach it at the same address."""
    p = c.dir / "store.json"
    try:
        store = json.loads(p.read_text()) if p.exists() else {}
    except ValueError:
        return None
    if store.get("kind") != "rgw" or not store.get("keystone"):
        return None
    return f"{store['s3_endpoint']}/swift/v1/AUTH_{c.project_id}"


def token_seconds(c) -> float:
    """How long a token lives: ``APPLIANCE_LOCAL_TOKEN_SECONDS`` (tests: seconds; /_admin/tokens changes it while the
    cloud runs), by default a day as measured on Chameleon (86400 s, kolla-ansible's ``fernet_token_expiry``; Keystone's
    own default is 3600 s, openstack/keystone keystone/conf/token.py ``expiration``)."""
    if getattr(c, "token_lifetime", None) is None:
        c.token_lifetime = float(os.environ.get("APPLIANCE_LOCAL_TOKEN_SECONDS") or 86400)
    return c.token_lifetime


def _service_user(c, user: dict) -> dict | None:
    """The service users the cloud's own services authenticate as (the RGW's ``rgw keystone admin user``): name,
    password and their project (kolla-ansible's `service` project)."""
    svc = c.creds.get("services") or {}
    name = user.get("name") or user.get("id")
    if name in svc and user.get("password") == svc[name]:
        return {"id": name, "name": name}
    return None


def issue_token(req: Request):
    ident = ((req.body or {}).get("auth") or {}).get("identity") or {}
    creds = req.cloud.creds
    ok, service, cred = False, None, None
    methods = ident.get("methods") or []
    if "password" in methods:
        user = (ident.get("password") or {}).get("user") or {}
        ok = (user.get("name") == creds["username"] or user.get("id") == creds["user_id"]) and \
            user.get("password") == creds["password"]
        service = None if ok else _service_user(req.cloud, user)
        ok = ok or service is not None
    elif "application_credential" in methods:
        ac = ident.get("application_credential") or {}
        cred = next((x for x in _app_creds(req.cloud) if ac.get("id") == x.id or ac.get("name") == x.name), None)
        # keystone/application_credential/backends/sql.py authenticate: the secret, then _check_expired
        ok = cred is not None and ac.get("secret") == cred.secret and not cred.expired()
    if not ok:
        raise ApiError(401, "The request you have made requires authentication.", "Unauthorized")
    tok, token = _mint(req, methods, service=service)
    if cred is not None:
        req.cloud.tokens[tok].app_cred, req.cloud.tokens[tok].unrestricted = cred.id, cred.unrestricted
        token["application_credential"] = {"id": cred.id, "name": cred.name, "restricted": not cred.unrestricted}
    return 201, {"token": token}, {"X-Subject-Token": tok}


def _mint(req: Request, methods: list, *, service: dict | None = None) -> tuple[str, dict]:
    """A new token of the cloud's user on its project (or of a service user on `service`) and its body, as
    keystone/common/render_token.py renders it."""
    creds = req.cloud.creds
    tok = "gAAAA" + secrets.token_urlsafe(32)
    lifetime = token_seconds(req.cloud)
    expires = time.time() + lifetime
    now = dt.datetime.now(dt.timezone.utc)
    domain = {"id": "default", "name": "Default"}
    token = {"methods": methods, "expires_at": (now + dt.timedelta(seconds=lifetime)).strftime("%Y-%m-%dT%H:%M:%S.000000Z"),
             "issued_at": now.strftime("%Y-%m-%dT%H:%M:%S.000000Z"),
             "user": {"id": creds["user_id"], "name": creds["username"], "domain": domain,
                      "password_expires_at": None},
             "project": {"id": creds["project_id"], "name": creds["project_name"], "domain": domain},
             "roles": [{"id": _uuid(), "name": "member"}], "catalog": catalog(req),
             "audit_ids": [secrets.token_urlsafe(8)], "is_domain": False}
    if service is not None:
        token["user"] = {**service, "domain": domain, "password_expires_at": None}
        token["project"] = {"id": "service", "name": "service", "domain": domain}
        token["roles"] = [{"id": _uuid(), "name": "admin"}, {"id": _uuid(), "name": "service"}]
    req.cloud.tokens[tok] = Token(expires, token, service=service["name"] if service is not None else None)
    return tok, token


def _app_creds(c) -> list[AppCred]:
    """The cloud's own application credential (unrestricted, as Chameleon asks for: docs cli/authentication.rst)
    and those made through the API."""
    cr = c.creds
    return [AppCred(cr["app_cred_id"], cr["app_cred_name"], cr["app_cred_secret"], unrestricted=True)] + \
        list(c.app_creds.values())


def _unrestricted_only(req: Request) -> None:
    """keystone/api/users.py ``_check_unrestricted_application_credential``: what a token of a restricted
    application credential may not do (make or delete application credentials, make OS-EC2 credentials)."""
    info = req.caller()
    if info.app_cred and not info.unrestricted:
        raise ApiError(403, "You are not authorized to perform the requested action: Using method "
                       "'application_credential' is not allowed for managing additional application credentials.",
                       "Forbidden")


def _may_manage_app_creds(req: Request, user_id: str) -> None:
    c = req.cloud
    _unrestricted_only(req)
    if user_id != c.user_id:
        raise ApiError(403, "You are not authorized to perform the requested action.", "Forbidden")


def create_app_cred(req: Request, user_id: str):
    """keystone/api/users.py UserAppCredListCreateResource.post: a token from a *restricted* application credential
    may not make another (ForbiddenAction, 403); `unrestricted` defaults to false; the secret is made when not
    given and shown only here."""
    c = req.cloud
    _may_manage_app_creds(req, user_id)
    body = (req.body or {}).get("application_credential") or {}
    if not body.get("name"):
        raise ApiError(400, "Invalid input for field 'name': None is not of type 'string'", "ValidationError")
    if any(x.name == body["name"] for x in _app_creds(c)):
        raise ApiError(409, "Conflict occurred attempting to store application_credential - Duplicate entry.",
                       "Conflict")
    cred = AppCred(_uuid().replace("-", ""), body["name"], body.get("secret") or secrets.token_urlsafe(48),
                   unrestricted=bool(body.get("unrestricted", False)), description=body.get("description"),
                   expires_at=body.get("expires_at"), access_rules=body.get("access_rules") or None)
    c.app_creds[cred.id] = cred
    return 201, {"application_credential": {**_app_cred_view(req, user_id, cred), "secret": cred.secret}}


def _app_cred_view(req: Request, user_id: str, cred: AppCred) -> dict:
    return cred.view() | {
        "project_id": req.cloud.project_id, "roles": [{"id": "member", "name": "member"}],
        "links": {"self": f"{req.base}/identity/v3/users/{user_id}/application_credentials/{cred.id}"}}


def list_app_creds(req: Request, user_id: str):
    """keystone/api/users.py UserAppCredListCreateResource.get (the secret is never shown again)."""
    if user_id != req.cloud.user_id:
        raise ApiError(403, "You are not authorized to perform the requested action.", "Forbidden")
    return 200, {"application_credentials": [_app_cred_view(req, user_id, x) for x in req.cloud.app_creds.values()],
                 "links": {"self": f"{req.base}/identity/v3/users/{user_id}/application_credentials",
                           "previous": None, "next": None}}


def delete_app_cred(req: Request, user_id: str, cred_id: str):
    """keystone/api/users.py UserAppCredGetDeleteResource.delete: the same rule as creating (a restricted
    application credential's token may not); 404 for one that does not exist. Its tokens stop validating
    (keystone/token/provider.py _validate_token_access_rules reads the credential, which is gone)."""
    _may_manage_app_creds(req, user_id)
    if req.cloud.app_creds.pop(cred_id, None) is None:
        raise ApiError(404, f"Could not find application credential: {cred_id}.", "Not Found")
    return 204, None


# -- EC2 credentials: Chameleon's S3 keys (`openstack ec2 credentials create`), checked by the RGW through Keystone --

def _ec2_view(req: Request, cred: Ec2Cred) -> dict:
    """keystone/api/users.py _convert_v3_to_ec2_credential and _UserOSEC2CredBaseResource's self link."""
    return {"user_id": cred.user_id, "tenant_id": cred.project_id, "access": cred.access, "secret": cred.secret,
            "trust_id": None,
            "links": {"self": f"{req.base}/identity/v3/users/{cred.user_id}/credentials/OS-EC2/{cred.access}"}}


def _may_use_ec2(req: Request, user_id: str) -> None:
    """Policy identity:ec2_*_credential (keystone/common/policies/ec2_credential.py): the credential's owner, or
    an admin (the RGW's service user, which reads a secret to check streamed uploads)."""
    if user_id == req.cloud.user_id:
        return
    if not req.caller().service:
        raise ApiError(403, "You are not authorized to perform the requested action: identity:ec2_credential.",
                       "Forbidden")
    raise ApiError(404, f"Could not find user: {user_id}.", "Not Found")  # an admin asking: identity_api.get_user


def create_ec2(req: Request, user_id: str):
    """POST /v3/users/{user_id}/credentials/OS-EC2 (UserOSEC2CredentialsResourceListCreate.post): the body names
    the project as ``tenant_id`` (keystoneclient v3 ec2.create sends it so); access and secret are uuid4 hex;
    201 {"credential": ...}. A token of a restricted application credential may not (its
    ``_check_unrestricted_application_credential``, the same 403 as for another application credential)."""
    _unrestricted_only(req)
    _may_use_ec2(req, user_id)
    project = (req.body or {}).get("tenant_id")
    if project != req.cloud.project_id:  # resource_api.get_project
        raise ApiError(404, f"Could not find project: {project}.", "Not Found")
    cred = Ec2Cred(user_id, project, access=_uuid().replace("-", ""), secret=_uuid().replace("-", ""))
    req.cloud.ec2_creds[cred.access] = cred
    return 201, {"credential": _ec2_view(req, cred)}


def list_ec2(req: Request, user_id: str):
    """GET /v3/users/{user_id}/credentials/OS-EC2: the user's EC2 credentials, secrets included (as Keystone
    shows them: `openstack ec2 credentials list` prints them)."""
    _may_use_ec2(req, user_id)
    return 200, {"credentials": [_ec2_view(req, x) for x in req.cloud.ec2_creds.values() if x.user_id == user_id],
                 "links": {"self": f"{req.base}/identity/v3/users/{user_id}/credentials/OS-EC2", "previous": None,
                           "next": None}}


def _ec2_cred(req: Request, access: str) -> Ec2Cred:
    cred = req.cloud.ec2_creds.get(access)
    if cred is None:  # UserOSEC2CredentialsResourceGetDelete._get_cred_data
        raise ApiError(401, "EC2 access key not found.", "Unauthorized")
    return cred


def get_ec2(req: Request, user_id: str, access: str):
    """GET /v3/users/{user_id}/credentials/OS-EC2/{access}: what the RGW asks for the secret
    (src/rgw/rgw_auth_keystone.cc EC2Engine::get_secret_from_keystone)."""
    _may_use_ec2(req, user_id)
    return 200, {"credential": _ec2_view(req, _ec2_cred(req, access))}


def delete_ec2(req: Request, user_id: str, access: str):
    _may_use_ec2(req, user_id)
    _ec2_cred(req, access)
    del req.cloud.ec2_creds[access]
    return 204, None


def create_credential(req: Request):
    """POST /v3/credentials (keystone/api/credentials.py CredentialResource.post), type ``ec2`` only here: the
    blob's ``access`` names it (its id is the access key's SHA-256), and a token made from an application
    credential binds it to that credential (``_assign_unique_id``'s ``app_cred_id``, since Keystone Ussuri:
    OSSA-2020-004). Other types: 400, as this cloud stores no others (assumed: Chameleon's Keystone stores them; no
    caller of ours makes one)."""
    body = (req.body or {}).get("credential") or {}
    if str(body.get("type", "")).lower() != "ec2":
        raise ApiError(400, "Only EC2 credentials are kept by this cloud.", "ValidationError")
    try:
        blob = json.loads(body.get("blob") or "")
    except ValueError:
        raise ApiError(400, "Invalid blob in credential", "ValidationError") from None
    if not isinstance(blob, dict) or blob.get("access") is None:
        raise ApiError(400, "Invalid input for field 'access'", "ValidationError")
    caller = req.caller()
    if body.get("user_id") != req.cloud.user_id or caller.service:  # identity:create_credential: the owner
        raise ApiError(403, "You are not authorized to perform the requested action: identity:create_credential.",
                       "Forbidden")
    if body.get("project_id") != req.cloud.project_id:
        raise ApiError(404, f"Could not find project: {body.get('project_id')}.", "Not Found")
    cred = Ec2Cred(body["user_id"], body["project_id"], access=str(blob["access"]), secret=str(blob.get("secret")),
                   app_cred_id=caller.app_cred or None)
    req.cloud.ec2_creds[cred.access] = cred
    stored = {**blob, **({"app_cred_id": cred.app_cred_id} if cred.app_cred_id else {})}
    return 201, {"credential": {"id": hashlib.sha256(cred.access.encode()).hexdigest(), "type": "ec2",
                                "user_id": cred.user_id, "project_id": cred.project_id, "blob": json.dumps(stored),
                                "links": {"self": f"{req.base}/identity/v3/credentials"}}}


def _s3_signature(string_to_sign: bytes, secret: str) -> str:
    """keystone/api/s3tokens.py _calculate_signature_v1 / _calculate_signature_v4."""
    if string_to_sign[:4] != b"AWS4":
        return base64.encodebytes(hmac.new(secret.encode(), string_to_sign, hashlib.sha1).digest()).decode().strip()
    parts = string_to_sign.split(b"\n")
    scope = parts[2].split(b"/") if len(parts) == 4 and parts[0] == b"AWS4-HMAC-SHA256" else []
    if len(scope) != 4 or scope[2] != b"s3" or scope[3] != b"aws4_request":
        raise ApiError(401, "Invalid EC2 signature.", "Unauthorized")
    key = ("AWS4" + secret).encode()
    for part in (scope[0], scope[1], scope[2], b"aws4_request"):
        key = hmac.new(key, part, hashlib.sha256).digest()
    return hmac.new(key, string_to_sign, hashlib.sha256).hexdigest()


def s3tokens(req: Request):
    """POST /v3/s3tokens (keystone/api/s3tokens.py S3Resource.post, EC2_S3_Resource.handle_authenticate), which
    Ceph RGW calls for every S3 request it does not know the key of (``rgw s3 auth use keystone``;
    src/rgw/rgw_auth_keystone.cc EC2Engine::get_from_keystone sends {"credentials": {access, token: base64 of the
    string to sign, signature}}). Unenforced: no token needed. An unknown key is 404 "EC2 access key not found.",
    a wrong signature 401 "Credential signature mismatch"; otherwise 200 and a token of the credential's user on
    its project, method ``ec2credential``, which the RGW maps to the project's RGW user."""
    body = req.body or {}
    if not body:
        raise ApiError(400, "request must include a request body", "Bad Request")
    credentials = body.get("credentials") or body.get("credential") or body.get("ec2Credentials") or {}
    if "access" not in credentials:
        raise ApiError(401, "EC2 Signature not supplied", "Unauthorized")
    cred = req.cloud.ec2_creds.get(credentials["access"])
    if cred is None:
        raise ApiError(404, "EC2 access key not found.", "Not Found")
    try:
        string_to_sign = base64.urlsafe_b64decode(str(credentials.get("token", "")))
    except ValueError:
        raise ApiError(401, "Credential signature mismatch", "Unauthorized") from None
    if not hmac.compare_digest(str(credentials.get("signature", "")), _s3_signature(string_to_sign, cred.secret)):
        raise ApiError(401, "Credential signature mismatch", "Unauthorized")
    if cred.app_cred_id:  # handle_authenticate: application_credential_api.get_application_credential
        ac = req.cloud.app_creds.get(cred.app_cred_id)
        if ac is None or ac.expired():
            raise ApiError(404, f"Could not find Application Credential: {cred.app_cred_id}.", "Not Found")
    tok, token = _mint(req, ["ec2credential"])
    return 200, {"token": token}, {"X-Subject-Token": tok}


def _s3tokens_get(req: Request):
    """EC2_S3_Resource.ResourceBase.get: MethodNotAllowed, only POST."""
    raise ApiError(405, "The method is not allowed for the requested URL.", "Method Not Allowed")


def validate_token(req: Request):
    """GET/HEAD /v3/auth/tokens (keystone/api/auth.py AuthTokenResource.get): the caller's X-Auth-Token must be
    valid; X-Subject-Token is the token asked about, answered with its body or 404 when it has expired, or when it
    came from an application credential that is gone or carries access rules and the caller did not send
    ``OpenStack-Identity-Access-Rules`` (keystone/token/provider.py _validate_token_access_rules: "Failed to
    validate token"). Ceph RGW 16 (Debian's, as here) does not send that header, so an RGW refuses every token of an
    application credential with access rules. Policy identity:validate_token: a service/admin token, or the
    subject itself."""
    c = req.cloud
    req.auth()
    caller = req.handler.headers.get("X-Auth-Token") or ""
    subject = req.handler.headers.get("X-Subject-Token")
    if subject is None:  # keystoneauth's own check of its token (HEAD without a subject): the caller's
        subject = caller
    if subject != caller and not req.caller().service:
        raise ApiError(403, "You are not authorized to perform the requested action: identity:validate_token.",
                       "Forbidden")
    not_found = ApiError(404, "Failed to validate token", "Not Found")
    record = c.token(subject)
    if record is None or not record.valid():
        raise not_found
    if record.app_cred:
        cred = next((x for x in _app_creds(c) if x.id == record.app_cred), None)
        rules_ok = req.handler.headers.get("OpenStack-Identity-Access-Rules")
        if cred is None or (cred.access_rules is not None and not rules_ok):
            raise not_found
    return 200, {"token": record.body}, {"X-Subject-Token": subject}


ROUTES = [
    Route("GET", "/", lambda req: (300, {"versions": {"values": [_version(req.base)]}}), auth=False),
    Route("GET", "/v3", lambda req: (200, {"version": _version(req.base)}), auth=False),
    Route("POST", "/v3/auth/tokens", issue_token, auth=False),
    Route(("GET", "HEAD"), "/v3/auth/tokens", validate_token, auth=False),
    Route("POST", "/v3/s3tokens", s3tokens, auth=False),
    Route("GET", "/v3/s3tokens", _s3tokens_get, auth=False),
    Route("POST", "/v3/users/([^/]+)/application_credentials", create_app_cred),
    Route("GET", "/v3/users/([^/]+)/application_credentials", list_app_creds),
    Route("DELETE", "/v3/users/([^/]+)/application_credentials/([^/]+)", delete_app_cred),
    Route("POST", "/v3/credentials", create_credential),
    Route("POST", "/v3/users/([^/]+)/credentials/OS-EC2", create_ec2),
    Route(("GET", "HEAD"), "/v3/users/([^/]+)/credentials/OS-EC2", list_ec2),
    Route(("GET", "HEAD"), "/v3/users/([^/]+)/credentials/OS-EC2/([^/]+)", get_ec2),
    Route("DELETE", "/v3/users/([^/]+)/credentials/OS-EC2/([^/]+)", delete_ec2),
]
