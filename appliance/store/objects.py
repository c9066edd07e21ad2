"""Object stores by URL: swift://container/prefix, s3://bucket/prefix, file:///path.

One small interface, ``Store``: ``list`` (paged with markers through any number of objects),
``get`` (streamed, optionally a byte range), ``put`` (SLO-segmented above a size), ``delete``.
Swift goes through python-swiftclient (one connection per thread), S3 through boto3.

Credentials (``StoreCreds``) come from the same place as provisioning: a Keystone session
(storage URL + token, both scoped and expiring), or Swift v1 auth (the local cloud's Ceph RGW or Swift; tokens
renewed on a 401), and EC2-style keys for S3. They are never logged and never put on a command line.
"""

from __future__ import annotations

import base64
import functools
import hashlib
import json
import os
import random
import re
import tempfile
import threading
import time
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import TypeVar
from urllib.parse import urlparse

from ..errors import ApplianceError, socket_reason, untrusted_certificate
from .tcp import quickack_boto, quickack_swift
from .. import report

log = report.get(__name__)
T = TypeVar("T")

try:  # zlib-ng's CRC-32: zlib's function (the same values), folded with PCLMULQDQ/VPCLMULQDQ where the CPU has them.
    # 9.9 GB/s on one core here against zlib's 3.5 (bench/crc_speed.py of ac0d90f, in git; 14.8 and 2.8 in another run). It lets go
    # of the GIL as zlib does.
    from zlib_ng.zlib_ng import crc32 as _crc32
except ImportError:  # not in the lock's venv (a node set up by hand): zlib's, slower, same values
    from zlib import crc32 as _crc32

SWIFT_PAGE = 10000  # Swift returns at most 10,000 names per listing request; Ceph RGW caps it at 1,000
LIST_DEADLINE = 120.0  # seconds a listing page is retried (5xx, resets, timeouts) before staging gives up
MAX_OBJECT = 5 * 1024**3  # a single PUT is capped at 5 GiB
SEGMENTS_IN_FLIGHT = 8  # SLO segments / S3 parts uploaded at once
EMPTY_MD5 = "d41d8cd98f00b204e9800998ecf8427e"  # Ceph RGW lists an SLO with this hash and the manifest's length
# The object's CRC-32, in its user metadata, for the stager to check its bytes with instead of an MD5 (15x the
# speed: 9.9 GB/s against 0.65 here with zlib-ng, 3.5 with zlib; and ranges combine: crc32_combine). Written by our
# uploads from the same read of the file that gave the MD5s the store's ETag is checked against, and bound to that
# ETag: "<crc32 hex> <etag>..." (a file in parts: the ETags either API lists it with). A stager trusts it only while
# the object's ETag is that one, so bytes that changed after the hashing (a file rewritten during its upload; an
# object replaced, metadata copied) are checked by their MD5 as before. Swift's X-Object-Meta-* and S3's
# x-amz-meta-* are one set of metadata in Ceph RGW and in Swift's s3api.
CRC_META = "appliance-crc32"


@dataclass
class ObjectInfo:
    name: str  # full object name (with the prefix)
    size: int
    etag: str  # MD5 hex for plain objects; for SLO, md5 of the segments' etags


@dataclass
class StoreCreds:
    """How to reach the object store. Serialisable (sent to nodes on stdin for staging)."""

    storage_url: str | None = None  # Swift: preauthenticated URL + token (from Keystone or v1 auth)
    token: str | None = None
    auth_url: str | None = None  # Swift v1 auth (tempauth), used to get a token
    user: str | None = None
    key: str | None = None
    s3_endpoint: str | None = None
    s3_access_key: str | None = None
    s3_secret_key: str | None = None
    s3_region: str = "us-east-1"
    # Keystone application credential (a job's nodes, on a Keystone site): swiftclient asks Keystone for a token
    # with it, and for a new one whenever the store refuses the old (401), for as long as the credential lives
    keystone_url: str | None = None  # the identity endpoint as nodes reach it (…/v3)
    app_cred_id: str | None = None
    app_cred_secret: str | None = None
    region: str | None = None
    extra: dict = field(default_factory=dict)

    SECRETS = ("token", "key", "s3_secret_key", "app_cred_secret")

    def redacted(self) -> dict:
        return {k: ("***" if k in self.SECRETS and v else v) for k, v in self.__dict__.items()}

    @property
    def app_cred(self) -> bool:
        return bool(self.keystone_url and self.app_cred_id and self.app_cred_secret)

    def scoped(self, url: str | None = None) -> StoreCreds:
        """What nodes get: for a ``url``, only what its scheme uses (a swift:// job never carries the S3 secret,
        an s3:// one no Swift token); for Swift, a token (expires) instead of a password, when we can make one."""
        scheme = parse_url(url)[0] if url else None
        if scheme == "s3":
            return StoreCreds(s3_endpoint=self.s3_endpoint, s3_access_key=self.s3_access_key,
                              s3_secret_key=self.s3_secret_key, s3_region=self.s3_region)
        keep_s3 = scheme is None
        s3 = dict(s3_endpoint=self.s3_endpoint, s3_access_key=self.s3_access_key, s3_secret_key=self.s3_secret_key,
                  s3_region=self.s3_region) if keep_s3 else {}
        if self.auth_url and self.user and self.key:
            # Swift v1 auth (tempauth, or a Ceph RGW Swift user): a credential of the object store alone. Nodes
            # get it rather than one token, because tokens expire (RGW: rgw_swift_token_expiration, a day by
            # default; Chameleon's Keystone: a day) and a multi-day job must keep committing checkpoints:
            # swiftclient fetches a new token with it when the store answers 401 (issue 12 item 2).
            return StoreCreds(auth_url=self.auth_url, user=self.user, key=self.key, **s3)
        if self.app_cred:
            return StoreCreds(keystone_url=self.keystone_url, app_cred_id=self.app_cred_id,
                              app_cred_secret=self.app_cred_secret, region=self.region, **s3)
        if scheme == "swift":
            return StoreCreds(storage_url=self.storage_url, token=self.token, auth_url=self.auth_url,
                              user=self.user, key=self.key, extra=dict(self.extra))
        return self


class StoreRefused(ApplianceError):
    """The store refused us for good (credentials, permissions, a name it will not make): asking again does not
    help, so retries stop at once and a job is not started over it."""


def _status(e: BaseException) -> int | None:
    status = getattr(e, "http_status", None)  # swiftclient.ClientException
    if status is None:
        status = (getattr(e, "response", None) or {}).get("ResponseMetadata", {}).get("HTTPStatusCode") \
            if isinstance(getattr(e, "response", None), dict) else None  # botocore ClientError
    return status


def _transient(e: BaseException) -> bool:
    """A failure worth asking again: a 5xx or 429, a reset or a timeout; not a 4xx answer, our own refusal, or a
    certificate this machine does not trust (it was asked again for 2 minutes and then said as "cannot reach")."""
    if isinstance(e, (ApplianceError, FileNotFoundError)) or untrusted_certificate(e):
        return False
    status = _status(e)
    if status is not None:
        return status >= 500 or status == 429
    return True  # no HTTP answer at all: connection reset, refused, timed out


def _no_answer(e: BaseException) -> bool:
    """The store did not answer at all: refused, unresolvable, reset, timed out."""
    return _transient(e) and _status(e) is None


def transient_retry(fn: Callable, *, deadline: float | None = None, reset: Callable[[], None] | None = None,
                    note: Callable[[str], None] | None = None):
    """fn() until it succeeds, retrying transient failures with exponential backoff and jitter (0.2 s .. 8 s)
    for up to ``deadline`` seconds (LIST_DEADLINE); the last failure is raised. ``note`` hears of the first
    failure that is asked again (a wait of minutes is said, not silent)."""
    t_end = time.monotonic() + (LIST_DEADLINE if deadline is None else deadline)
    delay = 0.2
    while True:
        try:
            return fn()
        except Exception as e:
            if not _transient(e) or time.monotonic() >= t_end:
                raise
            if note is not None:
                status = _status(e)
                note(f"{'HTTP ' + str(status) if status else socket_reason(e)}: asking again for up to "
                     f"{max(0.0, t_end - time.monotonic()):.0f} s")
                note = None
            if reset is not None:
                reset()
            time.sleep(min(delay, 8.0, max(0.0, t_end - time.monotonic())) * (0.5 + random.random()))  # backoff
            delay *= 2


_IPV4 = re.compile(r"\d+\.\d+\.\d+\.\d+")


def container_name_problem(scheme: str, name: str) -> str | None:
    """Why Ceph RGW (Chameleon's store) would refuse to make this container or bucket; None when it would not.

    S3: ``valid_s3_bucket_name`` with ``rgw_relaxed_s3_bucket_names`` off, its default (ceph
    src/rgw/rgw_rest_s3.h): 3-63 characters, lower-case letters, digits, '-' and '.', a letter or digit first and
    last, no '.' next to another '.' or a '-', not an IPv4 address. Swift: ``RGWHandler_REST_SWIFT::
    validate_bucket_name`` (src/rgw/rgw_rest_swift.cc) over ``RGWHandler_REST::validate_bucket_name``: 3-255
    characters (../shared/docs/rgw.md: 400 InvalidBucketName under 3), no '/' and not '.' first.
    tests/test_stage.py checks these rules against the real radosgw."""
    if scheme == "s3":
        if not 3 <= len(name) <= 63:
            return f"S3 bucket names are 3-63 characters long; {name!r} has {len(name)}"
        if not re.fullmatch(r"[a-z0-9][a-z0-9.-]*[a-z0-9]", name):
            return (f"S3 bucket names are lower-case letters, digits, '-' and '.', a letter or digit first and last; "
                    f"{name!r} is not")
        if ".." in name or ".-" in name or "-." in name:
            return f"S3 bucket names have no '.' next to another '.' or a '-'; {name!r} has"
        if _IPV4.fullmatch(name):
            return f"an S3 bucket name cannot look like an IP address ({name!r})"
    elif scheme == "swift":
        if not 3 <= len(name) <= 255:
            return f"container names on Chameleon's store (Ceph RGW) are 3-255 characters long; {name!r} has {len(name)}"
        if name.startswith(".") or "/" in name:
            return f"a container name cannot start with '.' or hold '/' ({name!r})"
    return None


def _check_name(scheme: str, name: str) -> None:
    """Before a container or bucket is made: a name the store would refuse, said with its rule."""
    why = container_name_problem(scheme, name)
    if why:
        raise StoreRefused(f"cannot make {scheme}://{name}/: {why}", "choose another name in the URL")


def parse_url(url: str) -> tuple[str, str, str]:
    """(scheme, container_or_bucket_or_root, prefix)."""
    u = urlparse(url)
    if u.scheme == "file":
        return "file", u.path, ""
    if u.scheme not in ("swift", "s3") or not u.netloc:
        raise ApplianceError(f"{url!r} is not a swift://container/prefix, s3://bucket/prefix or file:///path URL",
                             "write e.g. swift://datasets/imagenet/")
    if u.query or u.fragment or url.endswith(("?", "#")):  # urlparse drops them: the prefix would be another one
        raise ApplianceError(f"{url!r} has a '?' or '#', which a URL reads as a query or fragment and drops",
                             "remove it: write the prefix plainly, e.g. swift://ckpts/run1/")
    return u.scheme, u.netloc, u.path.lstrip("/")


class Store:
    scheme = ""
    where = ""  # the container, bucket or root directory
    list_deadline: float | None = None  # seconds a failing listing page is retried (None: LIST_DEADLINE)

    @property
    def endpoint(self) -> str:
        """Where the store answers (for messages)."""
        return ""

    def _retry_note(self) -> Callable[[str], None]:
        """Says (report) that a listing is asked again."""
        return lambda m: log.info(f"object store{f' at {self.endpoint}' if self.endpoint else ''} did not answer ({m})")

    @property
    def holder(self) -> str:
        """What holds this store's objects, in its own words (for messages)."""
        return {"swift": "container", "s3": "bucket"}.get(self.scheme, "directory")

    def url(self, prefix: str = "") -> str:
        """The URL of ``prefix`` in this store, as a user writes it (for messages)."""
        return f"{self.scheme}://{self.where}/{prefix}"

    def list(self, prefix: str = "") -> Iterator[ObjectInfo]:
        """Every object whose name starts with ``prefix``. Raises FileNotFoundError when the container or bucket
        itself is not there (a directory that is not there holds nothing)."""
        raise NotImplementedError

    def get(self, name: str, write: Callable[[bytes], None], *, start: int | None = None,
            end: int | None = None) -> dict:
        """Stream an object (or bytes start..end inclusive) to ``write``. Returns its headers (lower-case)."""
        raise NotImplementedError

    def fetch(self, name: str, fd: int, offset: int, sink: Callable[[memoryview], None] | None = None, *,
              start: int | None = None, end: int | None = None,
              on_headers: Callable[[dict], None] | None = None) -> tuple[int, dict]:
        """Write an object (or bytes start..end inclusive) to ``fd`` from ``offset`` on, showing each piece to
        ``sink``. Returns (bytes written, headers). Swift and S3 GET straight into the file (httpget.get_into), and
        show the answer's headers to ``on_headers`` before its body; other stores do not call it."""
        from .httpget import pwrite_all

        pos = offset

        def write(b: bytes) -> None:
            nonlocal pos
            pwrite_all(fd, memoryview(b), pos)
            pos += len(b)
            if sink is not None:
                sink(memoryview(b))

        headers = self.get(name, write, start=start, end=end)
        return pos - offset, headers

    def slo_segments(self, name: str) -> list[dict] | None:
        """For an SLO: [{bytes, hash}] in order; None for a plain object."""
        return None

    def forked(self) -> None:
        """In a process forked from the one that made this store (the stager's, node/fetch.py): drop what talks to
        the store over the parent's connections; it connects again on first use."""

    def crc32(self, name: str, etag: str) -> int | None:
        """The CRC-32 the object's CRC_META gives for bytes of this ETag (one HEAD); None when it gives none."""
        return None

    def part_sizes(self, name: str, n: int, *, every: bool = False) -> list[int] | None:
        """The sizes of a multipart object's ``n`` parts as the store says them (S3 ``partNumber``): from the first
        part's size (every part but the last is that size, as every upload tool makes them), or with ``every``
        from each part's own answer. None when the store does not say (appliance/store/parts.py)."""
        return None

    def put(self, name: str, path: Path, *, segment_size: int = MAX_OBJECT, md5s: dict | None = None) -> str:
        """Upload a file (in parts of ``segment_size`` above it). ``md5s``: the file's MD5s as
        ``large_object_etags(path, segment_size)`` computed them (computed here when None); the store's ETags are
        checked against those, so the bytes are not hashed again on the way up. Swift and S3 objects carry the
        content's CRC-32 in CRC_META, bound to the ETag they should have."""
        raise NotImplementedError

    def delete(self, name: str) -> None:
        raise NotImplementedError

    def create(self, name: str, data: bytes) -> bool:
        """Write a small object only if the name holds none: True if written, False if it was there (the store
        refused with 412). One request, checked by the store, so of two writers of one name exactly one wins (the
        run lock, store/runlock.py)."""
        raise NotImplementedError

    def reach(self) -> None:
        """One request that needs the credentials, to start warm; raises FileNotFoundError for a missing
        container. Nothing to do for a store that is a directory."""


# ---------------------------------------------------------------------------------------------
# Swift


class SwiftStore(Store):
    scheme = "swift"

    def __init__(self, container: str, creds: StoreCreds):
        self.container = self.where = container
        self.creds = creds
        self._local = threading.local()
        if not (creds.storage_url and creds.token) and not (creds.auth_url and creds.user and creds.key) \
                and not creds.app_cred:
            raise ApplianceError("no Swift credentials", "set OS_CLOUD (Keystone) or ST_AUTH/ST_USER/ST_KEY")
        self._auth = None  # the application credential's keystoneauth plugin, shared by every thread's connection
        # (storage URL, token) of every thread's reads (listing, HEAD, GET: ``_tokened``), made without swiftclient
        # (store/swiftauth.py), and with v1 auth every thread's swiftclient connection's too: each thread asking for
        # its own was a token request on a connection (a TLS handshake) of its own per thread, 17 at the start of
        # an 8-object staging at 32 transfers (bench/results/stage-swift-token)
        self._shared: tuple[str, str] | None = None
        self._expires: float | None = None  # a Keystone token's end (time.time()); v1 says none
        self._token_lock = threading.Lock()

    def conn(self):
        c = getattr(self._local, "conn", None)
        if c is None:
            import swiftclient

            if self.creds.app_cred:
                # swiftclient with a keystoneauth session: on a 401 it invalidates the session's token and asks
                # Keystone for a new one with the application credential (swiftclient/client.py Connection._retry)
                from keystoneauth1 import session as ks_session
                from keystoneauth1.identity import v3

                if self._auth is None:
                    self._auth = v3.ApplicationCredential(auth_url=self.creds.keystone_url,
                                                          application_credential_id=self.creds.app_cred_id,
                                                          application_credential_secret=self.creds.app_cred_secret)
                c = swiftclient.Connection(session=ks_session.Session(auth=self._auth, timeout=60),
                                           os_options={"region_name": self.creds.region} if self.creds.region
                                           else {}, retries=0, timeout=60)
            else:
                # with auth_url/user/key, swiftclient asks for a new token once when the store refuses one (401):
                # an expired token is renewed, not fatal; with a bare token it cannot be
                url, token = (self.creds.storage_url, self.creds.token) if self.creds.token else \
                    (self._shared or (None, None))
                c = swiftclient.Connection(authurl=self.creds.auth_url, user=self.creds.user, key=self.creds.key,
                                           preauthurl=url, preauthtoken=token, retries=0, timeout=60)
            quickack_swift(c)  # listings and small GETs from Ceph RGW without a 40 ms wait each (tcp.py)
            self._local.conn = c
        return c

    def _share(self) -> None:
        """This thread's connection's v1 token for every connection made after it (a bare token is the creds'
        own; a keystoneauth session's plugin is shared already)."""
        c = getattr(self._local, "conn", None)
        if getattr(c, "token", None) and getattr(c, "url", None) and not self.creds.token \
                and getattr(c, "session", None) is None:
            self._shared = (c.url, c.token)

    def _read_token(self, stale: str | None = None) -> tuple[str, str]:
        """(storage URL, token) for the reads: the one this store holds unless it is ``stale`` (the one the store has
        just refused) or a Keystone token about to expire; else the creds' own token until the store refuses it
        (never again after a new one was made); else a new one from v1 auth or Keystone (store/swiftauth.py: no swiftclient), held from then on. One thread asks at
        a time, so threads refused the same expired token ask for one new one between them. A refusal of the
        credentials is StoreRefused."""
        from . import swiftauth
        from .httpget import HTTPError

        with self._token_lock:
            have = self._shared
            if have is not None and have[1] != stale and swiftauth.fresh(self._expires):
                return have
            if self.creds.token and self.creds.storage_url and \
                    (have is None and self.creds.token != stale or not self._renewable()):
                return self.creds.storage_url, self.creds.token  # until refused once; then renewed when it can be
            try:
                if self.creds.app_cred:
                    url, token, self._expires = swiftauth.keystone(self.creds.keystone_url, self.creds.app_cred_id,
                                                                   self.creds.app_cred_secret, self.creds.region)
                else:
                    url, token = swiftauth.v1(self.creds.auth_url, self.creds.user, self.creds.key)
            except HTTPError as e:
                if e.http_status in (401, 403):
                    raise self._refused(e.http_status) from None
                raise
            self._shared = (url, token)
            return self._shared

    def _call(self, fn, *args, **kwargs):
        import swiftclient

        try:
            got = fn(*args, **kwargs)
            self._share()  # a token swiftclient asked for inside the call (on first use, or after a 401)
            return got
        except swiftclient.ClientException as e:
            if e.http_status == 404:
                raise FileNotFoundError(f"swift://{self.container}/{args[1] if len(args) > 1 else ''}") from None
            if e.http_status == 413 and "quota" in str(e).lower():  # RGW's QuotaExceeded (Swift's own quotas too)
                raise quota_exceeded(f"swift://{self.container}/") from None
            if e.http_status in (401, 403):
                # swiftclient drops a refused token and, without auth_url/user/key, is left with no URL at all
                # ("Unsupported scheme ... None", which looked transient and was retried for minutes): start over
                self._reset()
                raise self._refused(e.http_status) from None
            raise

    @property
    def endpoint(self) -> str:
        return self.creds.storage_url or self.creds.auth_url or ""

    def _renewable(self) -> bool:
        return bool(self.creds.auth_url and self.creds.user and self.creds.key) or self.creds.app_cred

    def _refused(self, status: int) -> ApplianceError:
        renewable = self._renewable()
        return StoreRefused(
            f"Swift refused access to container {self.container!r} ({status})"
            + ("" if renewable or status != 401 else ": the token may have expired"),
            "check the credentials and that the container is yours at this site" if renewable
            else "give the job renewable store credentials (an unrestricted application credential in "
                 "OS_CLOUD, so the job can make its own; ST_AUTH/ST_USER/ST_KEY; or an s3:// URL with EC2 keys): "
                 "a token lives a day")

    def list(self, prefix: str = "") -> Iterator[ObjectInfo]:
        """Every object under ``prefix``: page after page until a page comes back empty. A short page is not the
        end: Ceph RGW answers at most 1,000 names whatever ``limit`` asks for (../shared/docs/rgw.md). A page
        that fails (5xx, a reset, a timeout) is asked again with backoff, for up to LIST_DEADLINE seconds."""
        marker = ""
        while True:
            page = transient_retry(lambda: self._page(prefix, marker), deadline=self.list_deadline,
                                   reset=self._reset, note=self._retry_note())
            if not page:
                return
            for o in page:
                if "subdir" in o:
                    continue
                size, etag = int(o["bytes"]), (o.get("slo_etag") or o["hash"]).strip('"')
                # Ceph RGW lists an SLO by its manifest (the MD5 of nothing), and both stores list a DLO's manifest
                # (X-Object-Manifest, `swift upload --use-dlo`) as 0 bytes: HEAD tells the truth
                if etag == EMPTY_MD5 and (size > 0 or not o["name"].endswith("/")):
                    hdrs = self.head(o["name"])
                    if size > 0 or hdrs.get("x-object-manifest"):
                        size, etag = int(hdrs.get("content-length", size)), str(hdrs.get("etag", etag)).strip('"')
                yield ObjectInfo(o["name"], size, etag)
            marker = page[-1].get("name") or page[-1].get("subdir")

    def _page(self, prefix: str, marker: str) -> list[dict]:
        """One page of the container's listing (JSON), through httpget's connections (as swiftclient's
        ``get_container`` asks for it: ``format=json``, ``prefix``, ``marker``, ``limit``; 204, no body, is an
        empty one)."""
        from urllib.parse import urlencode

        query = urlencode({"format": "json", **({"prefix": prefix} if prefix else {}),
                           **({"marker": marker} if marker else {}), "limit": SWIFT_PAGE})
        body = self._tokened(None, lambda url, token: _asked("GET", f"{url}?{query}", token)[1])
        return json.loads(body) if body else []

    def head(self, name: str) -> dict:
        """An object's headers (lower-case names), asked again on transient failures. On this thread's kept-alive
        connection, the one its GETs use (httpget): through swiftclient each thread opened a connection of its own
        for them, with a TLS handshake, and the staging of a plain object HEADs it twice (its CRC_META, an SLO?)."""
        return transient_retry(lambda: self._tokened(name, lambda url, token: _asked("HEAD", url, token)[0]),
                               deadline=self.list_deadline, reset=self._reset)

    def _reset(self) -> None:
        self._local.conn = None  # a connection that failed is not reused

    def forked(self) -> None:
        self._local, self._token_lock, self._auth = threading.local(), threading.Lock(), None

    def get(self, name, write, *, start=None, end=None) -> dict:
        headers = {}
        if start is not None:
            headers["Range"] = f"bytes={start}-{'' if end is None else end}"
        hdrs, body = self._call(self.conn().get_object, self.container, name, resp_chunk_size=1 << 20,
                                headers=headers)
        for chunk in body:
            write(chunk)
        return {k.lower(): v for k, v in hdrs.items()}

    def _tokened(self, name: str | None, send: Callable[[str, str], T]) -> T:
        """``send(the object's URL (the container's for a None ``name``), a token)`` with the reads' token
        (``_read_token``); once more with a new one when the store refuses it (401) and the credentials can make
        one, as swiftclient does. A 404 is FileNotFoundError, a refusal StoreRefused; ``send`` raises httpget's
        HTTPError for any other answer that is not 2xx."""
        from urllib.parse import quote

        from .httpget import HTTPError

        stale = None
        for renewed in (False, True):
            url, token = self._read_token(stale)
            try:
                return send(f"{url}/{quote(self.container)}" + ("" if name is None else f"/{quote(name)}"), token)
            except HTTPError as e:
                if e.http_status == 404:
                    raise FileNotFoundError(f"swift://{self.container}/{name or ''}") from None
                if e.http_status == 401 and not renewed and self._renewable():
                    stale = token  # expired: ask for a new token once, as swiftclient does
                    continue
                if e.http_status in (401, 403):
                    raise self._refused(e.http_status) from None
                raise
        raise AssertionError("unreachable")

    def fetch(self, name, fd, offset, sink=None, *, start=None, end=None, on_headers=None):
        from .httpget import get_into

        headers = {"Range": f"bytes={start}-{'' if end is None else end}"} if start is not None else {}
        return self._tokened(name, lambda url, token: get_into(url, {**headers, "X-Auth-Token": token}, fd, offset,
                                                               sink, on_headers=on_headers))

    def crc32(self, name, etag):
        return crc_from(self.head(name), etag)

    def _dlo_segments(self, head: dict) -> list[dict]:
        """A DLO's segments: every object under its ``X-Object-Manifest`` (``container/prefix``, URL-quoted), in
        the order of their names, as Swift joins them (swift/common/middleware/dlo.py); [] unless their sizes add
        up to the object's length and their MD5s to its ETag (the MD5 of the segments' MD5s, as an SLO's)."""
        from urllib.parse import unquote

        container, _, prefix = unquote(str(head["x-object-manifest"])).partition("/")
        try:
            seg_store = type(self)(container, self.creds)
            seg_store.list_deadline = self.list_deadline
            segs = [{"bytes": o.size, "hash": o.etag} for o in sorted(seg_store.list(prefix), key=lambda o: o.name)]
        except (FileNotFoundError, ApplianceError):
            return []
        size, etag = int(head.get("content-length", -1)), str(head.get("etag", "")).strip('"')
        return segs if segs and sum(s["bytes"] for s in segs) == size and slo_etag(segs) == etag else []

    def slo_segments(self, name):
        """None for a plain object; for an SLO (or a DLO: ``_dlo_segments``) its segments ``[{"bytes", "hash"}]``,
        or [] when the store shows neither the manifest nor segments that add up to the object's ETag.

        HEAD first: real Swift ignores ``?multipart-manifest=get`` on a plain object and sends the whole body.
        Ceph RGW answers it with an empty body for an SLO (../shared/docs/rgw.md), so there the segments are
        read from the segment container's listing (``CONTAINER_segments``, under ``NAME/``: where we and
        `swift upload --use-slo` put them) and kept only if their sizes add up to the object's length and their
        MD5s to its ETag."""
        head = self.head(name)
        if head.get("x-object-manifest"):
            return self._dlo_segments(head)
        if str(head.get("x-static-large-object", "")).lower() != "true":
            return None
        body = transient_retry(lambda: self._tokened(name, lambda url, token: _asked(
            "GET", f"{url}?multipart-manifest=get", token)[1]), deadline=self.list_deadline)
        try:
            manifest = json.loads(body) if body else None
        except ValueError:
            manifest = None
        if isinstance(manifest, list) and manifest:
            return [{"bytes": int(s["bytes"]), "hash": s["hash"]} for s in manifest]
        size, etag = int(head.get("content-length", -1)), str(head.get("etag", "")).strip('"')
        groups: dict[str, list[ObjectInfo]] = {}
        try:
            segments_store = type(self)(f"{self.container}_segments", self.creds)
            segments_store.list_deadline = self.list_deadline
            for o in segments_store.list(name + "/"):
                groups.setdefault(o.name.rsplit("/", 1)[0], []).append(o)
        except FileNotFoundError:
            return []
        for group in groups.values():
            segs = [{"bytes": o.size, "hash": o.etag} for o in sorted(group, key=lambda o: o.name)]
            if sum(s["bytes"] for s in segs) == size and slo_etag(segs) == etag:
                return segs
        return []

    def put(self, name, path, *, segment_size=MAX_OBJECT, md5s=None) -> str:
        path = Path(path)
        size = path.stat().st_size
        if md5s is None:  # the store's ETags are checked against these, and its CRC_META is from the same reads
            md5s = large_object_etags(path, segment_size, whole=False)
        conn = self.conn()
        if size <= segment_size:
            meta = _crc_header("X-Object-Meta-", md5s, md5s.get("md5"))
            # the ETag header: the store checks the bytes it received against it and refuses them (422) when they
            # differ, keeping what the name held (swift/obj/server.py PUT; Ceph RGW's Swift API too: test_stage.py)
            with open(path, "rb") as fh:
                etag = self._checked_put(name, md5s["md5"], lambda: self._put_body(
                    self.container, name, lambda: (fh.seek(0), fh)[1], content_length=size, etag=md5s["md5"],
                    **({"headers": meta} if meta else {})))
            return etag
        seg_container = f"{self.container}_segments"
        self._call(conn.put_container, seg_container)

        def one(i: int, off: int) -> dict:
            n = min(segment_size, size - off)
            seg = f"{name}/{size}/{segment_size}/{i:08d}"
            parts = []
            with open(path, "rb") as fh:  # a handle per segment: segments go up in parallel

                def body():  # streamed: a 5 GiB segment is never read into memory
                    fh.seek(off)
                    parts.append(_Slice(fh, n))
                    return parts[-1]

                # the store checks the bytes against the MD5 computed before the upload (md5s; the ETag header),
                # and its ETag is checked again below: the bytes are hashed once
                etag = self._checked_put(f"segment {i} of {name}", md5s["parts"][i], lambda: self._put_body(
                    seg_container, seg, body, content_length=n, chunk_size=1 << 20, etag=md5s["parts"][i]))
            if parts[-1].left:  # the file ended early: it was cut while being sent
                raise _damaged(f"segment {i} of {name}", md5s["parts"][i], etag)
            return {"path": f"/{seg_container}/{seg}", "etag": md5s["parts"][i], "size_bytes": n}

        offsets = list(enumerate(range(0, size, segment_size)))
        # one stream of a Python client is far below a store's bandwidth (make bench-stage, "upload"): the segments
        # go up in parallel, each on its thread's own connection; the manifest, in order, only once all are in
        with ThreadPoolExecutor(max_workers=min(SEGMENTS_IN_FLIGHT, len(offsets))) as pool:
            manifest = list(pool.map(lambda a: one(*a), offsets))
        meta = _crc_header("X-Object-Meta-", md5s, md5s.get("swift"))  # the manifest's metadata is the SLO's
        return self._call(conn.put_object, self.container, name, json.dumps(manifest),
                          query_string="multipart-manifest=put", **({"headers": meta} if meta else {}))

    def _checked_put(self, what: str, md5: str, put: Callable[[], str]) -> str:
        """``put()``, sent with ETag ``md5``: a store that received other bytes refuses them (422) and keeps what
        the name held; one that answers with another ETag all the same is said so too."""
        import swiftclient

        try:
            etag = put()
        except swiftclient.ClientException as e:
            if e.http_status != 422:
                raise
            raise _damaged(what, md5, None) from None
        if str(etag).strip('"') != md5:
            raise _damaged(what, md5, etag)
        return etag

    def _put_body(self, container: str, name: str, body: Callable, **kwargs) -> str:
        """PUT ``body()``; once more with a fresh ``body()`` when a 401 came mid-request. An expired token is
        refused with 401 and swiftclient fetches a new one, but with ``retries=0`` it cannot rewind a file body
        to send it again and raises "... no ability to reset contents for reupload" instead (found with Ceph
        RGW tokens of 2 s: a checkpoint file's PUT failed and the checkpoint was not committed)."""
        import swiftclient

        try:
            return self._call(self.conn().put_object, container, name, body(), **kwargs)
        except swiftclient.ClientException as e:
            if e.http_status is not None or "reset contents" not in str(e):
                raise
        return self._call(self.conn().put_object, container, name, body(), **kwargs)

    def delete(self, name) -> None:
        """Delete an object; for an SLO, its segments too. (``multipart-manifest=delete`` on a plain object
        answers 200 and deletes nothing, so it is used only for SLO manifests.)"""
        try:
            hdrs = self._call(self.conn().head_object, self.container, name)
            slo = str(hdrs.get("x-static-large-object", "")).lower() == "true"
            self._call(self.conn().delete_object, self.container, name,
                       query_string="multipart-manifest=delete" if slo else None)
        except FileNotFoundError:
            pass

    def create(self, name, data) -> bool:
        """PUT with ``If-None-Match: *``: Swift's object server answers 412 when the name exists
        (swift/obj/server.py ``_pre_create_checks``; the proxy passes it on, swift/proxy/controllers/obj.py), and so
        does Ceph RGW's Swift API (src/rgw/rgw_rest_swift.cc ``RGWPutObj_ObjStore_SWIFT::get_params`` reads
        HTTP_IF_NONE_MATCH; src/rgw/driver/rados/rgw_rados.cc refuses an existing object with
        ERR_PRECONDITION_FAILED at its exclusive create)."""
        import swiftclient

        try:
            self._call(self.conn().put_object, self.container, name, data, content_length=len(data),
                       etag=hashlib.md5(data).hexdigest(), headers={"If-None-Match": "*"})
        except swiftclient.ClientException as e:
            if e.http_status == 412:
                return False
            raise
        return True

    def reach(self) -> None:
        """One authenticated request (HEAD of the container): the token, and the store's first check of it."""
        self._call(self.conn().head_container, self.container)

    def ensure_container(self) -> None:
        _check_name("swift", self.container)
        self._call(self.conn().put_container, self.container)


def _asked(method: str, url: str, token: str) -> tuple[dict, bytes]:
    """(headers, body) of one small Swift request with ``token`` on httpget's connections; httpget's HTTPError for
    an answer that is not 2xx (``SwiftStore._tokened`` turns 401, 403 and 404 into what they mean)."""
    from .httpget import HTTPError, request

    status, hdrs, body = request(method, url, {"X-Auth-Token": token})
    if status >= 300:
        raise HTTPError(status, "", url, method=method)
    return hdrs, body


# ---------------------------------------------------------------------------------------------
# S3 (Chameleon's Ceph RGW, or Swift's s3api)


class S3Store(Store):
    scheme = "s3"

    def __init__(self, bucket: str, creds: StoreCreds):
        if not (creds.s3_endpoint and creds.s3_access_key and creds.s3_secret_key):
            raise ApplianceError("no S3 credentials or endpoint",
                                 "set AWS_ACCESS_KEY_ID/AWS_SECRET_ACCESS_KEY and APPLIANCE_S3_ENDPOINT "
                                 "(`openstack ec2 credentials create` makes the keys)")
        self.bucket = self.where = bucket
        self.creds = creds
        self._client = None
        self._presigner = None
        self._no_part_numbers = False  # the store ignores ?partNumber (part_sizes)
        self._lock = threading.Lock()

    @property
    def endpoint(self) -> str:
        return self.creds.s3_endpoint or ""

    def forked(self) -> None:
        self._client, self._lock = None, threading.Lock()

    def client(self):
        """One client for all threads: botocore's clients are thread-safe ("Low-level clients are thread safe",
        boto3's guide to multithreading), and each costs milliseconds of CPU to build (a client per thread cost
        the stager's 32 threads more than their downloads of small objects)."""
        with self._lock:
            if self._client is None:
                import boto3
                from botocore.config import Config

                # s3v4 also for presigned URLs (botocore presigns with SigV2 unless told), which every RGW accepts.
                # Timestamps stay the strings the store sent: botocore parses each listed object's LastModified
                # with dateutil, 60% of a listing's CPU (0.126 -> 0.050 ms per object listed, measured against
                # the real RGW), and nothing here reads them.
                # No CRC32 of botocore's own on uploads (its default since 1.36: `when_supported`): every PUT
                # we send carries its bytes' MD5 (Content-MD5, which the store checks: put), the CRC cost 0.6 s of
                # CPU per 1.6 GB (make bench-stage STORE=rgw, the upload rows), and RGWs before Squid do not know the
                # x-amz-checksum-* headers and aws-chunked trailers it sends them with over HTTPS (ceph/ceph PRs
                # 49986 and 63326; red-hat-storage/ceph-qe-scripts PR 766 lists the failures it met).
                # No SHA-256 of the payload either (UNSIGNED-PAYLOAD; the signature still covers every header,
                # Content-MD5 with them): botocore leaves it out itself over https when a PUT carries a checksum
                # header (botocore/auth.py S3SigV4Auth._should_sha256_sign_payload), and signs every byte over http
                # or without one. Ours always carry Content-MD5; the SHA-256 cost 0.5-0.6 s of CPU per 768 MiB
                # uploaded (1.08-1.21 s against 0.50-0.58, 3 rounds each, one RGW here).
                session = boto3.session.Session()
                session._session.get_component("response_parser_factory").set_parser_defaults(
                    timestamp_parser=str)
                self._client = session.client(
                    "s3", endpoint_url=self.creds.s3_endpoint, aws_access_key_id=self.creds.s3_access_key,
                    aws_secret_access_key=self.creds.s3_secret_key, region_name=self.creds.s3_region,
                    config=Config(retries={"max_attempts": 1},
                                  s3={"addressing_style": "path", "payload_signing_enabled": False},
                                  max_pool_connections=64, signature_version="s3v4",
                                  request_checksum_calculation="when_required"))
                quickack_boto(self._client)  # small answers from Ceph RGW without a 40 ms wait each (tcp.py)
            return self._client

    def _signer(self):
        if self._presigner is None:
            from .sigv4 import Presigner

            self._presigner = Presigner(self.creds.s3_endpoint, self.creds.s3_access_key, self.creds.s3_secret_key,
                                        self.creds.s3_region)
        return self._presigner

    def _ask(self, method: str, key: str = "", params: dict | None = None) -> tuple[int, dict, bytes]:
        """One small signed request (a listing page, a HEAD) through httpget's connections: the stager lists and
        asks for part sizes without importing boto3 (0.21-0.25 s of CPU on each node's start: docs/staging.md)."""
        from .httpget import request

        signer = self._signer()
        return request(method, signer.url(self.bucket, key, method=method, params=params), {"Host": signer.host})

    def _list_page(self, prefix: str, token: str | None):
        """One ListObjectsV2 page (AWS's API reference: ListObjectsV2), its names URL-encoded by the store
        (``encoding-type=url``, as boto3 asks: a name with characters XML 1.0 cannot carry still lists)."""
        from xml.etree import ElementTree

        from .httpget import HTTPError

        params = {"list-type": "2", "prefix": prefix, "encoding-type": "url",
                  **({"continuation-token": token} if token else {})}
        status, _, body = self._ask("GET", params=params)
        if status >= 300:
            m = re.search(rb"<Code>([^<]{1,64})</Code>", body)
            code = m.group(1).decode(errors="replace") if m else None
            if code == "NoSuchBucket" or (status == 404 and code is None):
                raise FileNotFoundError(f"s3://{self.bucket}: no such bucket")
            if status in (401, 403):
                raise self._refused(code or str(status))
            raise HTTPError(status, "", f"{self.endpoint}/{self.bucket}", code=code)
        try:
            page = ElementTree.fromstring(body)
        except ElementTree.ParseError:
            page = None
        if page is None or not page.tag.endswith("ListBucketResult"):
            raise ApplianceError(f"the S3 endpoint {self.endpoint} answered a bucket listing with something that "
                                 f"is not one ({body[:60]!r})", "check APPLIANCE_S3_ENDPOINT (the object store's "
                                 "S3 endpoint, e.g. https://chi.tacc.chameleoncloud.org:7480)")
        return page

    def list(self, prefix: str = "") -> Iterator[ObjectInfo]:
        """Every object under ``prefix``, a page of up to 1,000 after another while the store says the listing is
        truncated; a page that fails transiently is asked again (up to LIST_DEADLINE)."""
        from urllib.parse import unquote_plus

        ns = "{http://s3.amazonaws.com/doc/2006-03-01/}"
        token = None
        while True:
            page = transient_retry(lambda: self._list_page(prefix, token), deadline=self.list_deadline,
                                   note=self._retry_note())
            for o in page.iterfind(f"{ns}Contents"):
                # botocore decodes these names with unquote_plus (botocore/handlers.py decode_list_object_v2):
                # AWS writes a space as '+', Ceph RGW and Swift's s3api as %20, and both write '+' as %2B
                name, size = unquote_plus(o.findtext(f"{ns}Key")), int(o.findtext(f"{ns}Size"))
                etag = (o.findtext(f"{ns}ETag") or "").strip('"')
                if etag == EMPTY_MD5 and size > 0:  # Ceph RGW lists a Swift SLO by its manifest here too: HEAD
                    status, h, _ = transient_retry(lambda: self._ask("HEAD", name), deadline=self.list_deadline)
                    if status < 300:
                        size, etag = int(h.get("content-length", size)), h.get("etag", etag).strip('"')
                yield ObjectInfo(name, size, etag)
            token = page.findtext(f"{ns}NextContinuationToken")
            if page.findtext(f"{ns}IsTruncated") != "true" or not token:
                return

    def get(self, name, write, *, start=None, end=None) -> dict:
        kw = {"Range": f"bytes={start}-{'' if end is None else end}"} if start is not None else {}
        r = self.client().get_object(Bucket=self.bucket, Key=name, **kw)
        for chunk in r["Body"].iter_chunks(1 << 20):
            write(chunk)
        return {k.lower(): v for k, v in r["ResponseMetadata"]["HTTPHeaders"].items()}

    def fetch(self, name, fd, offset, sink=None, *, start=None, end=None, on_headers=None):
        from .httpget import HTTPError, get_into

        # a presigned URL signs only the host, so the Range header may be added (sigv4: botocore's signer)
        signer = self._signer()
        url = signer.url(self.bucket, name)
        headers = {"Host": signer.host}
        if start is not None:
            headers["Range"] = f"bytes={start}-{'' if end is None else end}"
        try:
            return get_into(url, headers, fd, offset, sink, on_headers=on_headers)
        except HTTPError as e:
            if e.http_status == 404:
                raise FileNotFoundError(f"s3://{self.bucket}/{name}") from None
            if e.http_status in (401, 403):
                raise self._refused(str(e.http_status)) from None
            raise

    def crc32(self, name, etag):
        status, h, _ = self._ask("HEAD", name)
        if status == 404:
            raise FileNotFoundError(f"s3://{self.bucket}/{name}")
        return crc_from(h, etag) if status < 300 else None

    def part_sizes(self, name, n, *, every=False):
        """HEAD ?partNumber=K: AWS, OpenStack Swift's s3api (swift/common/middleware/s3api/controllers/obj.py) and
        Ceph RGW from Reef on answer with that part's length, its Content-Range and x-amz-mp-parts-count. Ceph RGW
        16 (Pacific) answers with the whole object and no count: then None, and this store is not asked again.
        Any refusal of a HEAD is None too (the parts' sizes are then guessed: store/parts.py)."""
        from .parts import layout

        if self._no_part_numbers:
            return None
        sizes = []
        for k in range(1, (n if every else 1) + 1):
            status, h, _ = self._ask("HEAD", name, {"partNumber": str(k)})
            if status >= 300:
                return None
            count = h.get("x-amz-mp-parts-count")
            if count is None or not count.isdigit() or int(count) != n:
                self._no_part_numbers = count is None
                return None
            sizes.append(int(h.get("content-length", "0")))
        if every:
            return sizes
        total = str(h.get("content-range", "")).rpartition("/")[2]
        return layout(int(total), sizes[0]) if total.isdigit() and sizes[0] > 0 else None

    def _refused(self, why: str) -> StoreRefused:
        return StoreRefused(f"S3 refused access to bucket {self.bucket!r} ({why})",
                            "check the EC2 keys (`openstack ec2 credentials list`; AWS_ACCESS_KEY_ID, "
                            "AWS_SECRET_ACCESS_KEY) and that the bucket is yours at this site")

    def _keys_refused(self) -> StoreRefused | None:
        """After a 403 without a body (a HEAD): whether the store refuses our keys themselves, asked with a request
        any valid keys may make (the list of our buckets). None when the keys are good."""
        from botocore.exceptions import ClientError

        try:
            self.client().list_buckets()
            return None
        except ClientError as e:
            code = e.response.get("Error", {}).get("Code") or str(_status(e))
            return StoreRefused(f"S3 refused the keys ({code})",
                                "check the EC2 keys (`openstack ec2 credentials list`; AWS_ACCESS_KEY_ID, "
                                "AWS_SECRET_ACCESS_KEY) and APPLIANCE_S3_ENDPOINT")

    def put(self, name, path, *, segment_size=MAX_OBJECT, md5s=None) -> str:
        """A file of ``segment_size`` bytes or more goes up in parts (a multipart upload, parts as boto3's upload_file
        sizes them: store/parts.py s3transfer_part, so the ETag is the one ``data upload`` expects), others in one
        PUT. Every PUT carries its bytes' MD5 (Content-MD5): the store refuses bytes that differ (400 BadDigest;
        AWS's PutObject and UploadPart, ceph src/rgw/rgw_op.cc, swift's s3api), and a multipart upload is completed
        only once every part is in as sent, so a failed upload leaves the key what it was."""
        from botocore.exceptions import ClientError

        from .parts import s3transfer_part

        path = Path(path)
        size = path.stat().st_size
        part = s3transfer_part(segment_size, size)
        if md5s is None or (size >= segment_size and len(md5s.get("parts") or [0]) != max(1, -(-size // part))):
            # the store checks the bytes against these, and its CRC_META is from the same reads (a caller's, made
            # for parts of another size than S3's smallest, would send every part with a wrong Content-MD5)
            md5s = large_object_etags(path, part, whole=False)
        # a file of segment_size or more goes in parts ("<md5 of the MD5s>-N", or -1 for one part)
        one = md5s.get("md5") and hashlib.md5(bytes.fromhex(md5s["md5"])).hexdigest() + "-1"
        want = md5s.get("md5") if size < segment_size else md5s.get("s3") or one
        meta = _crc_header("", md5s, want) or {}
        try:
            if size < segment_size:
                with open(path, "rb") as fh:
                    got = self.client().put_object(Bucket=self.bucket, Key=name, Body=fh, ContentLength=size,
                                                   Metadata=meta, ContentMD5=_b64(want))["ETag"]
            else:
                got = self._put_parts(name, path, size, part, md5s.get("parts") or [md5s["md5"]], meta)
        except ClientError as e:
            code = e.response.get("Error", {}).get("Code")
            if code == "NoSuchBucket":  # said as Swift's missing container
                raise FileNotFoundError(f"s3://{self.bucket}: no such bucket") from None
            if code in ("BadDigest", "InvalidDigest"):
                raise _damaged(name, want, None) from None
            if code == "QuotaExceeded":
                raise quota_exceeded(f"s3://{self.bucket}/") from None
            raise
        if got.strip('"') != want:
            raise _damaged(name, want, got)
        return got.strip('"')

    def _put_parts(self, name: str, path: Path, size: int, part: int, md5s: list[str], meta: dict) -> str:
        """A multipart upload: the parts in parallel (SEGMENTS_IN_FLIGHT, each on its own connection of the shared
        client), each with its Content-MD5; completed once all are in, else aborted (the parts are dropped and the
        key keeps what it held). Returns the store's ETag."""
        client = self.client()
        up = client.create_multipart_upload(Bucket=self.bucket, Key=name, Metadata=meta)["UploadId"]

        def one(i: int) -> dict:
            off, n = i * part, min(part, size - i * part)
            with open(path, "rb") as fh:  # a handle per part; streamed, never held in memory
                fh.seek(off)
                body = _Slice(fh, n)
                etag = client.upload_part(Bucket=self.bucket, Key=name, UploadId=up, PartNumber=i + 1, Body=body,
                                          ContentLength=n, ContentMD5=_b64(md5s[i]))["ETag"]
            if body.left or etag.strip('"') != md5s[i]:  # the file ended early; a store that did not check
                raise _damaged(f"part {i + 1} of {name}", md5s[i], etag)
            return {"PartNumber": i + 1, "ETag": etag}

        try:
            with ThreadPoolExecutor(max_workers=min(SEGMENTS_IN_FLIGHT, len(md5s))) as pool:
                done = list(pool.map(one, range(len(md5s))))
            etag = client.complete_multipart_upload(Bucket=self.bucket, Key=name, UploadId=up,
                                                    MultipartUpload={"Parts": done}).get("ETag")
            # Ceph RGW 16 answers the completion with an empty <ETag> (radosgw 16.2.15 here); its HEAD has it
            return etag or client.head_object(Bucket=self.bucket, Key=name)["ETag"]
        except BaseException:
            try:
                client.abort_multipart_upload(Bucket=self.bucket, Key=name, UploadId=up)
            except Exception:  # noqa: BLE001 - the store's lifecycle rules drop what an abort could not
                pass
            raise

    def delete(self, name) -> None:
        self.client().delete_object(Bucket=self.bucket, Key=name)

    def create(self, name, data) -> bool:
        """PutObject with ``If-None-Match: *`` (AWS S3's conditional write; Ceph RGW's S3 API reads it in
        src/rgw/rgw_rest_s3.cc ``RGWPutObj_ObjStore_S3::get_params`` and refuses an existing object with 412,
        src/rgw/driver/rados/rgw_rados.cc)."""
        from botocore.exceptions import ClientError

        try:
            self.client().put_object(Bucket=self.bucket, Key=name, Body=data, ContentMD5=_b64(
                hashlib.md5(data).hexdigest()), IfNoneMatch="*")
        except ClientError as e:
            if e.response.get("ResponseMetadata", {}).get("HTTPStatusCode") == 412 or \
                    e.response.get("Error", {}).get("Code") == "PreconditionFailed":
                return False
            if e.response.get("Error", {}).get("Code") == "NoSuchBucket":
                raise FileNotFoundError(f"s3://{self.bucket}: no such bucket") from None
            raise
        return True

    def reach(self) -> None:
        """One signed request (HEAD of the bucket): the client built, the keys' first check by the store."""
        from botocore.exceptions import ClientError

        try:
            self.client().head_bucket(Bucket=self.bucket)
        except ClientError as e:
            status = e.response.get("ResponseMetadata", {}).get("HTTPStatusCode")
            if status == 404:
                raise FileNotFoundError(f"s3://{self.bucket}") from None
            if status in (401, 403):  # someone else's bucket, or keys the store does not take (HEAD says not which)
                raise (self._keys_refused() or self._taken()) from None
            raise

    def _taken(self) -> StoreRefused:
        return StoreRefused(f"S3 bucket {self.bucket!r} belongs to someone else (bucket names are shared by every "
                            "project of the store)", "choose another bucket name in the s3:// URL")

    def ensure_container(self) -> None:
        """The bucket, made when it is not there (as SwiftStore makes its container): HEAD, then PUT. On a Ceph
        RGW without tenants (Chameleon's) bucket names are one namespace for every project, so a name another
        project holds is refused (403 on HEAD, 409 BucketAlreadyExists on PUT): said with the fix."""
        from botocore.exceptions import ClientError

        _check_name("s3", self.bucket)
        taken = self._taken()
        try:
            self.client().head_bucket(Bucket=self.bucket)
            return
        except ClientError as e:
            status = e.response.get("ResponseMetadata", {}).get("HTTPStatusCode")
            if status in (401, 403):  # someone else's bucket, or keys the store does not take (HEAD says not which)
                raise (self._keys_refused() or taken) from None
            if status != 404:
                raise
        try:
            self.client().create_bucket(Bucket=self.bucket)
        except ClientError as e:
            code = e.response.get("Error", {}).get("Code")
            if code == "BucketAlreadyExists":
                raise taken from None
            if _status(e) in (401, 403):
                raise self._refused(code or str(_status(e))) from None
            if code != "BucketAlreadyOwnedByYou":  # made meanwhile by another of our uploads
                raise


# ---------------------------------------------------------------------------------------------
# file://


class FileStore(Store):
    scheme = "file"

    def __init__(self, root: str):
        self.root = Path(root)
        self.where = str(self.root)

    def list(self, prefix: str = "") -> Iterator[ObjectInfo]:
        base = self.root
        for dirpath, _dirs, files in sorted(os.walk(base)):
            for f in sorted(files):
                p = Path(dirpath) / f
                name = str(p.relative_to(base))
                if name.startswith(prefix):
                    yield ObjectInfo(name, p.stat().st_size, md5_file(p))

    def get(self, name, write, *, start=None, end=None) -> dict:
        with open(self.root / name, "rb") as fh:
            if start:
                fh.seek(start)
            left = None if end is None else end - (start or 0) + 1
            while left is None or left > 0:
                chunk = fh.read(1 << 20 if left is None else min(1 << 20, left))
                if not chunk:
                    break
                write(chunk)
                if left is not None:
                    left -= len(chunk)
        return {}

    def put(self, name, path, *, segment_size=MAX_OBJECT, md5s=None) -> str:
        dst = self.root / name
        dst.parent.mkdir(parents=True, exist_ok=True)
        tmp = dst.with_name(dst.name + ".part")
        with open(path, "rb") as src, open(tmp, "wb") as out:
            while chunk := src.read(1 << 20):
                out.write(chunk)
        tmp.replace(dst)
        return md5_file(dst)

    def create(self, name, data) -> bool:
        """The bytes in a file of their own, then link(2) to the name: it fails with EEXIST where the name is taken,
        so of two writers exactly one wins, and a reader never sees half of it."""
        dst = self.root / name
        dst.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(prefix=".create-", dir=dst.parent)
        try:
            with open(fd, "wb") as fh:
                fh.write(data)
            os.link(tmp, dst)
        except FileExistsError:
            return False
        finally:
            os.unlink(tmp)
        return True

    def delete(self, name) -> None:
        p = self.root / name
        p.unlink(missing_ok=True)
        for d in p.parents:  # no empty pseudo-directories left behind, as in an object store
            if d == self.root or self.root not in d.parents:
                break
            try:
                d.rmdir()
            except OSError:
                break


def quota_exceeded(where: str) -> StoreRefused:
    """The store refused a write past the project's quota (Ceph RGW: S3 403 / Swift 413 QuotaExceeded): not asked
    again, said in one line."""
    return StoreRefused(f"the object store refused a write to {where}: the project's storage quota is used up",
                        "delete what you no longer need (`appliance data rm URL`) or ask for a larger quota; the "
                        "local cloud's store holds 3/4 of APPLIANCE_RGW_MEMSTORE_BYTES (8 GiB by default)")


def _b64(md5_hex: str) -> str:
    """An MD5 as the Content-MD5 header carries it."""
    return base64.b64encode(bytes.fromhex(md5_hex)).decode()


def _damaged(what: str, want: str, got: str | None) -> ApplianceError:
    """An upload whose bytes at the store are not the file's (damaged on the way, or the file changed after it was
    hashed): retried by the checkpoint uploader, one line for `data upload`."""
    return ApplianceError(
        f"{what} did not arrive as the file's bytes: the store "
        + (f"made ETag {got.strip(chr(34))} of them, the file's is {want}" if got else
           f"refused them, as they did not match the file's MD5 {want}; it keeps what it held"),
        "upload it again; a file must not change while it is being uploaded")


def _crc_header(prefix: str, md5s: dict | None, etag: str | None) -> dict:
    """The CRC_META header (``prefix``: Swift's X-Object-Meta-; boto3's Metadata takes the bare key) for an upload
    whose store ETag will be ``etag`` (and, for a file in parts, its ETag through the other API), when ``md5s``
    (large_object_etags) has the content's CRC-32."""
    if not md5s or md5s.get("crc32") is None or not etag:
        return {}
    # OpenStack Swift's s3api shows an SLO not uploaded through S3 with its ETag and "-N"
    # (swift/common/middleware/s3api/s3response.py)
    others = [md5s[k] for k in ("swift", "s3") if md5s.get(k)] + ([md5s["swift"] + "-N"] if md5s.get("swift") else [])
    return {prefix + CRC_META: crc_meta(md5s["crc32"], etag, *[e for e in others if e != etag])}


class _Slice:
    """At most ``n`` bytes of an open file from where it stands, read in chunks (a segment streamed, never held in
    memory); seekable within them (botocore reads an S3 part once to sign its SHA-256 over http, then rewinds)."""

    def __init__(self, fh, n: int):
        self.fh, self.left, self.n, self.start = fh, n, n, fh.tell()

    def seek(self, pos: int, whence: int = 0) -> int:
        pos = max(0, min(self.n, pos + (0, self.n - self.left, self.n)[whence]))
        self.fh.seek(self.start + pos)
        self.left = self.n - pos
        return pos

    def tell(self) -> int:
        return self.n - self.left

    def read(self, size: int = -1) -> bytes:  # a file's read(): the rest when no size is given
        if self.left <= 0:
            return b""
        data = self.fh.read(min(size if size is not None and size >= 0 else self.left, self.left))
        self.left -= len(data)
        return data


HASH_THREADS = max(1, min(8, os.cpu_count() or 1))  # hashlib lets go of the GIL: parts hash on every core


def large_object_etags(p: Path, part_size: int, *, whole: bool = True) -> dict:
    """What a store reports for a file uploaded in parts of ``part_size``: ``md5`` of the content, and for a file
    larger than one part ``parts`` (each part's MD5), ``swift`` (a Static Large Object's ETag: the MD5 of its
    segments' hex MD5s, concatenated; swift/common/middleware/slo.py) and ``s3`` (a multipart upload's ETag: the
    MD5 of the parts' binary MD5s, then "-" and the part count). The parts are hashed in parallel with hashlib, a
    part per thread on every core (positioned reads of the page cache). An MD5 cannot be split, so the whole file's
    is one more pass, in order, beside them; ``whole=False`` leaves it out of a file in parts (the parts' MD5s cover
    every byte). ``crc32``: the content's CRC-32, from the same reads as the parts' MD5s (CRC_META)."""
    fd = os.open(p, os.O_RDONLY)
    try:
        size = os.fstat(fd).st_size
        if size <= part_size:
            crc = Crc32()
            one = md5_range(fd, 0, size, crc=crc)
            return {"md5": one.hexdigest(), "parts": [one.hexdigest()] if size else [], "crc32": crc.value}
        ranges = [(a, min(part_size, size - a)) for a in range(0, size, part_size)]
        crcs = [Crc32() for _ in ranges]
        with ThreadPoolExecutor(min(HASH_THREADS, len(ranges) + whole)) as pool:
            full = pool.submit(md5_range, fd, 0, size) if whole else None
            digests = list(pool.map(lambda r, c: md5_range(fd, r[0], r[1], crc=c).digest(), ranges, crcs))
            out = {"md5": full.result().hexdigest()} if full is not None else {}
    finally:
        os.close(fd)
    crc = 0
    for c in crcs:
        crc = crc32_combine(crc, c.value, c.size)
    return {**out, "parts": [d.hex() for d in digests], "crc32": crc,
            "swift": hashlib.md5("".join(d.hex() for d in digests).encode()).hexdigest(),
            "s3": hashlib.md5(b"".join(digests)).hexdigest() + f"-{len(digests)}"}


def parts_match(p: Path, part_size: int, parts: list[str]) -> bool:
    """Whether the file's parts of ``part_size`` have these MD5s (a manifest's record of a file in parts)."""
    got = large_object_etags(p, part_size, whole=False)
    return got["parts"] == list(parts)


def segmented(headers: dict) -> bool:
    """An answer whose body is a Swift large object's segments joined (an SLO or a DLO): its ETag is not the MD5 of
    the body, and the segments' MD5s check it (SwiftStore.slo_segments)."""
    return str(headers.get("x-static-large-object", "")).lower() == "true" or bool(headers.get("x-object-manifest"))


def slo_etag(segments: list[dict]) -> str:
    """An SLO's ETag, from its segments: the MD5 of their MD5s (hex) joined (Swift and Ceph RGW alike)."""
    return hashlib.md5("".join(s["hash"] for s in segments).encode()).hexdigest()


def md5_range(fd: int, start: int, n: int, h=None, crc: Crc32 | None = None):
    """Feed bytes start..start+n of the open file ``fd`` to ``h`` (a new MD5 if None), and to ``crc`` if given,
    and return ``h``: one reused 4 MiB buffer, positioned reads (threads may share the fd). Raises OSError if the
    file is shorter."""
    h = hashlib.md5() if h is None else h
    buf = memoryview(bytearray(min(max(n, 1), 4 << 20)))
    pos, end = start, start + n
    while pos < end:
        k = os.preadv(fd, [buf[:min(len(buf), end - pos)]], pos)
        if not k:
            raise OSError(f"the file ends at byte {pos}, before {end}")
        h.update(buf[:k])
        if crc is not None:
            crc.update(buf[:k])
        pos += k
    return h


class Crc32:
    """zlib's CRC-32 (the one of gzip and S3's x-amz-checksum-crc32) with hashlib's ``update``, computed by
    zlib-ng (``_crc32``). Both let go of the GIL for all but small buffers, as hashlib does."""

    def __init__(self):
        self.value, self.size = 0, 0

    def update(self, data) -> None:
        self.value = _crc32(data, self.value)
        self.size += len(data)


def _gf2_times(mat: tuple[int, ...], vec: int) -> int:
    out, i = 0, 0
    while vec:
        if vec & 1:
            out ^= mat[i]
        vec >>= 1
        i += 1
    return out


@functools.lru_cache(maxsize=64)
def _zeros_operator(n: int) -> tuple[int, ...]:
    """The 32x32 GF(2) matrix that turns the CRC of A into the CRC of A followed by ``n`` zero bytes (zlib's
    crc32_combine, zlib/crc32.c: the operator for one zero bit, squared up to n's bits). Cached: the stager's
    ranges have a few lengths."""
    one_bit = (0xEDB88320,) + tuple(1 << k for k in range(31))
    op = tuple(_gf2_times(one_bit, one_bit[k]) for k in range(32))  # 2 zero bits
    op = tuple(_gf2_times(op, op[k]) for k in range(32))  # 4
    op = tuple(_gf2_times(op, op[k]) for k in range(32))  # 8: one zero byte
    out = None
    while n:
        if n & 1:
            out = op if out is None else tuple(_gf2_times(op, out[k]) for k in range(32))
        n >>= 1
        if n:
            op = tuple(_gf2_times(op, op[k]) for k in range(32))
    return out


def crc32_combine(crc1: int, crc2: int, len2: int) -> int:
    """The CRC-32 of A + B from CRC(A), CRC(B) and B's length (zlib's crc32_combine; Python's zlib has none)."""
    if len2 <= 0:
        return crc1
    return _gf2_times(_zeros_operator(len2), crc1) ^ crc2


def crc_meta(crc: int, *etags: str) -> str:
    """The CRC_META value for content of this CRC-32 that the store will list with one of ``etags``."""
    return " ".join([f"{crc:08x}", *(e.strip('"') for e in etags if e)])


def crc_from(headers: dict, etag: str) -> int | None:
    """The CRC-32 an object's headers (lower-case names; Swift's or S3's) carry in CRC_META, when it was written
    for ``etag`` (the listing's: the size staged is the listing's too); None when there is none, it is malformed,
    or it was written for other bytes. It may name several ETags: a file in parts is listed with its SLO ETag
    through the Swift API and its multipart ETag through S3 (OpenStack Swift's s3api), both made of the same parts'
    MD5s."""
    words = str(headers.get(f"x-object-meta-{CRC_META}") or headers.get(f"x-amz-meta-{CRC_META}") or "").split()
    if len(words) < 2 or not re.fullmatch(r"[0-9a-f]{8}", words[0]):
        return None
    return int(words[0], 16) if etag and etag.strip('"') in words[1:] else None


def md5_file(p: Path) -> str:
    fd = os.open(p, os.O_RDONLY)
    try:
        return md5_range(fd, 0, os.fstat(fd).st_size).hexdigest()
    finally:
        os.close(fd)


def unreachable(store: Store, e: BaseException) -> ApplianceError | None:
    """A store that never answered (refused, unresolvable, reset, timed out), or whose certificate this machine
    does not trust, in one line with the fix; None for any other failure (an HTTP answer, our own refusal)."""
    where = f" at {store.endpoint}" if store.endpoint else ""
    why = untrusted_certificate(e)
    if why:  # an https store (Chameleon's are) whose certificate no CA bundle here vouches for
        return ApplianceError(f"the object store{where} sent a certificate this machine does not trust ({why})",
                              "point REQUESTS_CA_BUNDLE (or SSL_CERT_FILE) at the CA bundle that signed it, or "
                              "update the system's CA certificates (the ca-certificates package)")
    if not _no_answer(e):
        return None
    fix = {"s3": "check APPLIANCE_S3_ENDPOINT (or the object-store endpoint in OS_CLOUD's catalog) and the network",
           "swift": "check ST_AUTH (or the object-store endpoint in OS_CLOUD's catalog) and the network"}
    return ApplianceError(f"cannot reach the object store{where} ({socket_reason(e)})",
                          fix.get(store.scheme, "check the network"))


def open_store(url: str, creds: StoreCreds | None) -> tuple[Store, str]:
    """(store, prefix) for a URL."""
    scheme, where, prefix = parse_url(url)
    if scheme == "file":
        return FileStore(where), prefix
    if creds is None:
        raise ApplianceError(f"no credentials for {url}", "see docs/staging.md (OS_CLOUD, or the local cloud)")
    if scheme == "swift":
        return SwiftStore(where, creds), prefix
    return S3Store(where, creds), prefix


def swift_fallback(url: str, creds: StoreCreds) -> tuple[Store, str] | None:
    """s3://bucket/prefix -> swift://bucket/prefix (same data on Chameleon's Ceph), if Swift creds exist."""
    scheme, where, prefix = parse_url(url)
    if scheme != "s3" or not (creds.storage_url or creds.auth_url or creds.app_cred):
        return None
    return SwiftStore(where, creds), prefix
