"""The object-store interface every store implements (``Store``), its records (``ObjectInfo``, ``StoreCreds``),
URLs and names, and how a failure is read: retried (``transient_retry``), refused, or not there."""

from __future__ import annotations

import random
import re
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import TypeVar
from urllib.parse import urlparse

from ..errors import ApplianceError, socket_reason, untrusted_certificate
from .. import report

log = report.get(__name__)
T = TypeVar("T")

SWIFT_PAGE = 10000  # Swift returns at most 10,000 names per listing request; Ceph RGW caps it at 1,000
S3_PAGE = 1000  # ListObjectsV2's max-keys: AWS's default and cap, and Ceph RGW's (rgw_max_listing_results)
LIST_DEADLINE = 120.0  # seconds a listing page is retried (5xx, resets, timeouts) before staging gives up
MAX_OBJECT = 5 * 1024**3  # a single PUT is capped at 5 GiB
SEGMENTS_IN_FLIGHT = 8  # SLO segments / S3 parts uploaded at once



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
    characters (radosgw 16 answers 400 InvalidBucketName under 3), no '/' and not '.' first.
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
              on_headers: Callable[[dict], None] | None = None, deadline: float | None = None) -> tuple[int, dict]:
        """Write an object (or bytes start..end inclusive) to ``fd`` from ``offset`` on, showing each piece to
        ``sink``. Returns (bytes written, headers). Swift and S3 GET straight into the file (httpget.get_into), and
        show the answer's headers to ``on_headers`` before its body; other stores do not call it. ``deadline``:
        seconds the whole GET may take (Swift and S3: then TimeoutError, which is asked again)."""
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

    def clock(self) -> float:
        """The store's own time (the Date header of one request, RFC 9110 section 6.6.1: whole seconds), so that
        every machine that writes or judges a heartbeat in it (store/runlock.py) reads one clock, whatever its own
        says; this machine's for a store that is a directory."""
        return time.time()



def date_header(value: str | None) -> float:
    """A response's Date header as a timestamp; this machine's clock when there is none (a store that sends no
    Date breaks HTTP/1.1's rule for origin servers with a clock, RFC 9110 section 6.6.1)."""
    from email.utils import parsedate_to_datetime

    try:
        return parsedate_to_datetime(value).timestamp() if value else time.time()
    except (TypeError, ValueError):
        return time.time()


def quota_exceeded(where: str) -> StoreRefused:
    """The store refused a write past the project's quota (Ceph RGW: S3 403 / Swift 413 QuotaExceeded): not asked
    again, said in one line."""
    return StoreRefused(f"the object store refused a write to {where}: the project's storage quota is used up",
                        "delete what you no longer need (`appliance data rm URL`) or ask for a larger quota; the "
                        "local cloud's store holds 3/4 of APPLIANCE_RGW_MEMSTORE_BYTES (8 GiB by default)")
