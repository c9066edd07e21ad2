"""Swift (python-swiftclient, one connection per thread; Ceph RGW's Swift API or OpenStack Swift)."""

from __future__ import annotations

import hashlib
import json
import threading
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from ..errors import ApplianceError
from .tcp import quickack_swift
from .. import report

from .base import T, SWIFT_PAGE, MAX_OBJECT, SEGMENTS_IN_FLIGHT, ObjectInfo, StoreCreds, StoreRefused, transient_retry, _check_name, Store, quota_exceeded, date_header
from .hashes import EMPTY_MD5, _damaged, _crc_header, _Slice, large_object_etags, slo_etag, crc_from

log = report.get(__name__)
class SwiftStore(Store):
    scheme = "swift"

    def __init__(self, container: str, creds: StoreCreds, renew: Callable[[], StoreCreds] | None = None):
        self.container = self.where = container
        self.creds = creds
        # new credentials when the store refuses a bare token (it expired: a day on Chameleon), for a process that
        # outlives one (a managed run's controller); the site's Keystone session makes them (flows RunContext)
        self._renew = renew
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
            if self._renew is not None and not (self.creds.app_cred or self.creds.auth_url):
                self._renewed()
                return self.creds.storage_url, self.creds.token
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

    def _renewed(self) -> None:
        """The credentials ``renew`` makes now, for every connection made from here on; the ones held stay when it
        makes none this store can use (a refusal)."""
        new = self._renew()
        if not (new and (new.storage_url and new.token or new.app_cred or new.auth_url and new.user and new.key)):
            raise StoreRefused(f"Swift refused the token for container {self.container!r} (401), and the site gave "
                               "no new one", "check the store credentials (`appliance check --online`)")
        self.creds, self._shared = new, None
        self._reset()

    def _call(self, fn, *args, _again: bool = True, **kwargs):
        """``fn(*args, **kwargs)`` (a swiftclient call on this thread's connection), its errors said as the store's;
        once more on a new connection with new credentials when ``renew`` makes them and the store refused the
        token (401), unless a body was sent from an iterator or a file (it is not sent again: said refused)."""
        import swiftclient

        try:
            got = fn(*args, **kwargs)
            self._share()  # a token swiftclient asked for inside the call (on first use, or after a 401)
            return got
        except swiftclient.ClientException as e:
            if e.http_status == 401 and self._renew is not None and _again:
                self._renewed()
                if any(hasattr(a, "__next__") or hasattr(a, "read") for a in (*args, *kwargs.values())):
                    raise _Renewed(self._refused(401).message) from None  # _put_body sends a fresh body() once
                return self._call(getattr(self.conn(), fn.__name__), *args, _again=False, **kwargs)
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
        return bool(self.creds.auth_url and self.creds.user and self.creds.key) or self.creds.app_cred or \
            self._renew is not None

    def _refused(self, status: int) -> ApplianceError:
        renewable = self._renewable()
        return StoreRefused(
            f"Swift refused access to container {self.container!r} ({status})"
            + ("" if renewable or status != 401 else ": the token may have expired"),
            "check the credentials and that the container is yours at this site" if renewable
            else "use renewable store credentials (an unrestricted application credential in "
                 "OS_CLOUD, from which the job and the run's controller make their own; ST_AUTH/ST_USER/ST_KEY; or "
                 "an s3:// URL with EC2 keys): a token lives a day")

    def list(self, prefix: str = "") -> Iterator[ObjectInfo]:
        """Every object under ``prefix``: page after page until a page comes back empty. A short page is not the
        end: Ceph RGW answers at most 1,000 names whatever ``limit`` asks for (``rgw_max_listing_results``,
        1000 by default, bounds it: ceph src/rgw/rgw_op.cc ``RGWListBucket::parse_max_keys``). A page
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

    def fetch(self, name, fd, offset, sink=None, *, start=None, end=None, on_headers=None, deadline=None):
        from .httpget import get_into

        headers = {"Range": f"bytes={start}-{'' if end is None else end}"} if start is not None else {}
        return self._tokened(name, lambda url, token: get_into(url, {**headers, "X-Auth-Token": token}, fd, offset,
                                                               sink, on_headers=on_headers, deadline=deadline))

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
        Ceph RGW answers it with an empty body for an SLO (measured on radosgw 16), so there the segments are
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
        self._call(self.conn().put_container, seg_container)  # each call on this thread's connection of the moment

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
        return self._call(self.conn().put_object, self.container, name, json.dumps(manifest),
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
        except _Renewed:
            return self._call(self.conn().put_object, container, name, body(), _again=False, **kwargs)
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

    def clock(self) -> float:
        return date_header(self._call(self.conn().head_container, self.container).get("date"))

    def ensure_container(self) -> None:
        _check_name("swift", self.container)
        self._call(self.conn().put_container, self.container)


class _Renewed(StoreRefused):
    """A 401 on a request whose body cannot be sent again: the credentials were made again (SwiftStore._call);
    the caller that can make the body anew sends it once more (_put_body), any other is refused."""


def _asked(method: str, url: str, token: str) -> tuple[dict, bytes]:
    """(headers, body) of one small Swift request with ``token`` on httpget's connections; httpget's HTTPError for
    an answer that is not 2xx (``SwiftStore._tokened`` turns 401, 403 and 404 into what they mean)."""
    from .httpget import HTTPError, request

    status, hdrs, body = request(method, url, {"X-Auth-Token": token})
    if status >= 300:
        raise HTTPError(status, "", url, method=method)
    return hdrs, body
