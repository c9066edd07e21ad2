"""A Swift storage URL and token through httpget's connections, without importing swiftclient, keystoneauth1 and
requests: 0.15 s of CPU and 0.18 s of wall time less per staging on the Keystone path, 0.05 and 0.07 with v1 auth
(bench/results/stage-swift-auth; docs/staging.md of 14aa98a (in git), "The stager's token and listing without swiftclient").
The stager's reads (listing, HEAD, GET: swift.SwiftStore) take their token from here; its writes (checkpoints)
still go through swiftclient, which authenticates the same way.

Two ways, as swiftclient and keystoneauth1 do them:
- v1 auth (tempauth, a Ceph RGW Swift user): ``GET auth_url`` with X-Auth-User and X-Auth-Key; the storage URL is
  X-Storage-Url, the token X-Storage-Token or else X-Auth-Token; an answer that is not 2xx, or a body with no
  X-Storage-Url, is a failure (python-swiftclient 4.11, swiftclient/client.py ``get_auth_1_0``).
- a Keystone application credential: ``POST {keystone_url}/auth/tokens`` with the ``application_credential``
  method and no scope (an application credential is scoped already); the token is X-Subject-Token, the storage URL
  the catalog's object-store endpoint on the public interface, in the region when one is named (an endpoint's
  ``region_id``, else its ``region``), the first that matches (Keystone's API reference, "Authenticating with an
  Application Credential"; keystoneauth1/access/service_catalog.py ``ServiceCatalogV3``, the endpoint swiftclient
  asks a session for: ``get_auth``, ``service_type='object-store'``, ``interface='public'``)."""

from __future__ import annotations

import datetime as dt
import json
import time

from ..errors import ApplianceError
from .httpget import HTTPError, request

RENEW_BEFORE = 30.0  # a Keystone token is asked for again this long before it expires, as keystoneauth1 does


def v1(auth_url: str, user: str, key: str) -> tuple[str, str]:
    """(storage URL, token) from v1 auth. HTTPError for an answer that is not 2xx (401: the user or key)."""
    status, hdrs, body = request("GET", auth_url, {"X-Auth-User": user, "X-Auth-Key": key})
    url = hdrs.get("x-storage-url")
    if status < 200 or status >= 300 or (body and not url):
        raise HTTPError(status, "Auth GET failed", auth_url)
    token = hdrs.get("x-storage-token") or hdrs.get("x-auth-token")
    if not url or not token:
        raise ApplianceError(f"the Swift auth at {auth_url} answered without a storage URL or a token",
                             "check ST_AUTH: it is the store's auth URL (…/auth/v1.0)")
    return url, token


def keystone(keystone_url: str, app_cred_id: str, secret: str, region: str | None = None) \
        -> tuple[str, str, float | None]:
    """(storage URL, token, when it expires as time.time() or None) from a Keystone application credential.
    HTTPError for an answer that is not 2xx (401: the credential is wrong, expired or deleted)."""
    url = keystone_url.rstrip("/") + "/auth/tokens"
    body = json.dumps({"auth": {"identity": {"methods": ["application_credential"], "application_credential": {
        "id": app_cred_id, "secret": secret}}}}).encode()
    status, hdrs, answer = request("POST", url, {"Content-Type": "application/json", "Accept": "application/json"},
                                   body=body)
    if status < 200 or status >= 300:
        raise HTTPError(status, "", url, method="POST")
    token = hdrs.get("x-subject-token")
    try:
        got = json.loads(answer)["token"]
    except (ValueError, KeyError, TypeError):
        got = None
    if not token or not isinstance(got, dict):
        raise ApplianceError(f"Keystone at {keystone_url} answered without a token", "check the auth URL in OS_CLOUD")
    store = object_store(got.get("catalog") or [], region)
    if store is None:
        raise ApplianceError(f"Keystone's catalog at {keystone_url} has no object-store endpoint"
                             + (f" in region {region}" if region else ""),
                             "check region_name in OS_CLOUD: it is the site's (CHI@UC, CHI@TACC, ...)")
    return store, token, _expires(got.get("expires_at"))


def object_store(catalog: list, region: str | None) -> str | None:
    """The object-store endpoint's URL on the public interface (in ``region`` when given) of a v3 catalog."""
    for service in catalog:
        if not isinstance(service, dict) or service.get("type") != "object-store":
            continue
        for e in service.get("endpoints") or []:
            if e.get("interface") not in ("public", "publicURL"):
                continue
            if region and (e.get("region_id") or e.get("region")) != region:
                continue
            if e.get("url"):
                return e["url"]
    return None


def _expires(at) -> float | None:
    try:
        return dt.datetime.fromisoformat(str(at).replace("Z", "+00:00")).timestamp()
    except ValueError:
        return None


def fresh(expires: float | None, now: float | None = None) -> bool:
    """Whether a token that expires at ``expires`` (None: not said) may still be used."""
    return expires is None or (time.time() if now is None else now) < expires - RENEW_BEFORE
