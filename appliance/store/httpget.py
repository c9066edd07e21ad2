"""The stager's HTTP: GET an object's bytes into a file, and small requests (listings, HEADs, a token's POST),
through urllib3, the HTTP client requests, swiftclient and boto3 stand on.

One pool manager per proxy and CA bundle keeps connections alive per host, shared by the stager's threads. A body
comes in pieces of ``CHUNK`` bytes: each is written at its place in the file (``os.pwrite``) and shown to ``sink``
(hashing, progress). hashlib, zlib-ng, the ssl module and the socket reads let go of the GIL for pieces this size, so
a node's cores work in parallel with no C of ours. Swift and S3 differ only in how a request is authorised (a token
header; a signed URL), which the stores own.

A failure is said in the terms the rest of the package reads (``objects._transient``, ``unreachable``): an answer
that is not 2xx is ``HTTPError`` with its status; no answer at all is the OSError under urllib3's exception (a
refused connection, a reset, an untrusted certificate), else ConnectionError or TimeoutError with urllib3's words.
"""

from __future__ import annotations

import base64
import http.client
import os
import threading
import urllib.request
from collections.abc import Callable
from urllib.parse import unquote, urlsplit

import urllib3

from .tcp import quickack, quickack_pools

CHUNK = 1 << 20  # bytes of a body read, written and hashed at a time: large enough that the GIL is let go of


class HTTPError(Exception):
    """A non-2xx answer. ``http_status`` is what ``objects._transient`` reads: 5xx and 429 are retried."""

    def __init__(self, status: int, reason: str, url: str, *, code: str | None = None, method: str = "GET"):
        said = " ".join(filter(None, (f"HTTP {status}", reason, f"({code})" if code else "")))
        super().__init__(f"{said} for {method} {url.split('?')[0]}")
        self.http_status = status
        self.code = code  # S3's error code (NoSuchBucket, AccessDenied, ...), when the answer named one


def _ca_file() -> str | None:
    """The CA bundle requests (and so swiftclient and boto3) would use: REQUESTS_CA_BUNDLE, SSL_CERT_FILE, else
    certifi's; None: the system's."""
    cafile = os.environ.get("REQUESTS_CA_BUNDLE") or os.environ.get("SSL_CERT_FILE")
    if cafile:
        return cafile
    try:
        import certifi

        return certifi.where()
    except ImportError:
        return None


def _proxy(scheme: str, netloc: str) -> tuple[str, dict] | None:
    """The proxy the environment names for this URL's scheme and host (HTTP_PROXY, HTTPS_PROXY, NO_PROXY, as
    requests, and so swiftclient and boto3, read them): (proxy host:port, its Proxy-Authorization header), or None.
    The listing and the GETs then take the same way out."""
    proxies = urllib.request.getproxies_environment()
    url = proxies.get(scheme)
    host = urlsplit(f"//{netloc}").hostname or netloc
    if not url or urllib.request.proxy_bypass_environment(host, proxies):
        return None
    p = urlsplit(url if "://" in url else f"http://{url}")
    if p.scheme not in ("http", ""):
        raise OSError(f"proxy {p.scheme}://{p.hostname}: the stager takes only http:// proxies "
                      "(HTTPS_PROXY=http://HOST:PORT tunnels https through it)")
    auth = {}
    if p.username:
        cred = f"{unquote(p.username)}:{unquote(p.password or '')}".encode()
        auth = {"Proxy-Authorization": "Basic " + base64.b64encode(cred).decode()}
    return f"{p.hostname}:{p.port or 80}", auth


_managers: dict = {}
_lock = threading.Lock()


def _manager(scheme: str, netloc: str) -> urllib3.PoolManager:
    """The pool manager for this URL: through the environment's proxy (https tunnels with CONNECT, so the proxy
    sees neither path nor headers; http asks it for the absolute URL), trusting the CA bundle named now. Its
    connections ask for a quick ACK before each answer (tcp.py)."""
    via, cafile = _proxy(scheme, netloc), _ca_file()
    key = (via[0] if via else None, tuple(sorted(via[1].items())) if via else (), cafile)
    with _lock:
        m = _managers.get(key)
        if m is None:
            kw = {"num_pools": 32, "maxsize": 64, "ca_certs": cafile, "retries": False}
            m = urllib3.ProxyManager(f"http://{via[0]}", proxy_headers=via[1], **kw) if via else \
                urllib3.PoolManager(**kw)
            m.pool_classes_by_scheme = quickack_pools()
            _managers[key] = m
    return m


def _forked() -> None:
    """In a forked child: the parent's pools (and their connections) are the parent's; this process makes its own."""
    global _managers, _lock
    _managers, _lock = {}, threading.Lock()


os.register_at_fork(after_in_child=_forked)


def reset() -> None:
    """Forget every pool (their connections close): the next request connects anew."""
    with _lock:
        gone = list(_managers.values())
        _managers.clear()
    for m in gone:
        m.clear()


# A kept-alive connection the server closed in the meantime is asked once more on a new one (GET and HEAD, as
# urllib3 retries idempotent requests); any answer, a 5xx included, is returned as it is, to be judged by the caller
_RETRY = urllib3.Retry(total=1, connect=1, read=1, status=0, other=0, redirect=False, raise_on_status=False,
                       raise_on_redirect=False)


def _no_answer(e: urllib3.exceptions.HTTPError) -> Exception:
    """What urllib3 raised, in the terms ``objects._transient`` and ``unreachable`` read: the OSError under it
    (refused, reset, a certificate not trusted), else a ConnectionError or TimeoutError with its words."""
    if isinstance(e, urllib3.exceptions.MaxRetryError) and e.reason is not None:
        e = e.reason
    for c in (e, e.__cause__, e.__context__, *e.args):
        if isinstance(c, (OSError, http.client.IncompleteRead)):
            return c
    if isinstance(e, urllib3.exceptions.TimeoutError):
        return TimeoutError(str(e))
    return ConnectionError(str(e))


def _open(method: str, url: str, headers: dict, timeout: float, body: bytes | None = None):
    u = urlsplit(url)
    try:
        return _manager(u.scheme, u.netloc).request(
            method, url, headers=headers, body=body, preload_content=False, decode_content=False, redirect=False,
            retries=_RETRY, timeout=urllib3.Timeout(connect=timeout, read=timeout))
    except urllib3.exceptions.HTTPError as e:
        raise _no_answer(e) from e


def _discard(resp) -> None:
    """Close the answer's connection (its body is not read to the end) and give the slot back to its pool, which
    connects anew on its next use."""
    resp.close()
    resp.release_conn()


def _sock(resp):
    conn = resp.connection
    return getattr(conn, "sock", None)


def request(method: str, url: str, headers: dict, *, timeout: float = 60.0, body: bytes | None = None) \
        -> tuple[int, dict, bytes]:
    """A small request (a listing page, a HEAD, a token's POST with its ``body``): (status, response headers with
    lower-case names, body). Any status is returned; no answer raises (``_no_answer``), and so does a body that
    ends before its Content-Length."""
    resp = _open(method, url, headers, timeout, body)
    try:
        chunks = []
        while True:
            quickack(_sock(resp))  # a body's last short segment waits for the ACK of the ones before it, too
            b = resp.read(CHUNK)
            if not b:
                break
            chunks.append(b)
    except urllib3.exceptions.HTTPError as e:
        _discard(resp)
        raise _no_answer(e) from e
    except BaseException:
        _discard(resp)
        raise
    resp.release_conn()
    return resp.status, {k.lower(): v for k, v in resp.headers.items()}, b"".join(chunks)


def pwrite_all(fd: int, view, pos: int) -> None:
    """All of ``view`` at ``pos`` of the file open as ``fd``."""
    view = memoryview(view)
    while len(view):
        k = os.pwrite(fd, view, pos)
        view, pos = view[k:], pos + k


def get_into(url: str, headers: dict, fd: int, offset: int, sink: Callable[[memoryview], None] | None = None,
             *, timeout: float = 60.0, on_headers: Callable[[dict], None] | None = None) -> tuple[int, dict]:
    """GET ``url`` and write its body to ``fd`` from ``offset`` on; ``sink`` sees each piece as it is written,
    ``on_headers`` a 2xx answer's headers (lower-case names) before the body. Returns (bytes written, those
    headers). Raises HTTPError for a non-2xx answer, and for no answer or a body that ends before its
    Content-Length what ``_no_answer`` says; OSError for the disk."""
    resp = _open("GET", url, headers, timeout)
    try:
        hdrs = {k.lower(): v for k, v in resp.headers.items()}
        if resp.status >= 300:
            raise HTTPError(resp.status, resp.reason or "", url)
        if on_headers is not None:
            on_headers(hdrs)
        n = 0
        while True:
            quickack(_sock(resp))
            b = resp.read(CHUNK)
            if not b:
                break
            pwrite_all(fd, b, offset + n)
            n += len(b)
            if sink is not None:
                sink(memoryview(b))
    except urllib3.exceptions.HTTPError as e:
        _discard(resp)
        raise _no_answer(e) from e
    except BaseException:
        _discard(resp)  # the body is left unread: the connection cannot be reused
        raise
    resp.release_conn()
    return n, hdrs


def mem_available(path="/proc/meminfo") -> int | None:
    """The kernel's MemAvailable in bytes, None when unknown."""
    try:
        with open(path) as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return None
