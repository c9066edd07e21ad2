"""The stager's HTTP: GET an object's bytes into a file, and small requests (listings, HEADs, a token's POST),
through the standard library's http.client (the client urllib3, and so requests, swiftclient and boto3, stand on),
its public API only.

Each thread keeps one connection alive per host (``_connection``), made again when the server closed it. A body is
read into one reused buffer per thread (``HTTPResponse.readinto``: no new object per piece), written at its place in
the file (``os.pwrite``) and shown to ``sink`` (hashing, progress), ``CHUNK`` bytes at a time. The ssl module, the
socket reads, hashlib and zlib-ng let go of the GIL for pieces this size, so a node's cores work side by side with no
C of ours (node/fetch.py adds processes). Swift and S3 differ only in how a request is authorised (a token header;
a signed URL), which the stores own. A failure is an ``HTTPError`` with its status for an answer that is not 2xx,
else OSError (a refused connection, a reset, an untrusted certificate, a timeout) or http.client's errors (a body
cut short: IncompleteRead), which ``base._transient`` reads as worth asking again.
"""

from __future__ import annotations

import base64
import http.client
import os
import socket
import ssl
import threading
import time
import urllib.request
from collections.abc import Callable
from urllib.parse import unquote, urlsplit

from .tcp import quickack

CHUNK = 1 << 20  # bytes of a body read, written and hashed at a time: large enough that the GIL is let go of


class HTTPError(Exception):
    """A non-2xx answer. ``http_status`` is what ``base._transient`` reads: 5xx and 429 are retried."""

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


def _find_proxy(scheme: str, netloc: str) -> tuple[str, dict] | None:
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


_lock = threading.Lock()
_routes: dict = {}  # (scheme, netloc) -> (proxy, CA bundle): read from the environment once (it walks os.environ)
_contexts: dict = {}  # CA bundle -> SSLContext, shared by every thread
_local = threading.local()  # this thread's connections and buffer


def _route(scheme: str, netloc: str) -> tuple:
    got = _routes.get((scheme, netloc))
    if got is None:
        got = _routes[(scheme, netloc)] = (_find_proxy(scheme, netloc), _ca_file() if scheme == "https" else None)
    return got


def _context(cafile: str | None) -> ssl.SSLContext:
    with _lock:
        ctx = _contexts.get(cafile)
        if ctx is None:
            ctx = _contexts[cafile] = ssl.create_default_context(cafile=cafile)
    return ctx


def _connection(scheme: str, netloc: str, timeout: float, fresh: bool) -> tuple[http.client.HTTPConnection, bool]:
    """(this thread's connection to ``netloc``, whether it was used before). Through a proxy: https tunnels
    (CONNECT; the proxy sees neither the path nor the headers), http asks the proxy for the absolute URL."""
    conns = getattr(_local, "conns", None)
    if conns is None:
        conns = _local.conns = {}
    via, cafile = _route(scheme, netloc)
    key = (scheme, netloc, via[0] if via else None, cafile)
    c = None if fresh else conns.get(key)
    if c is not None and c.sock is not None:
        c.sock.settimeout(timeout)
        return c, True
    if c is not None:  # closed after a Connection: close answer: http.client connects again on the next request
        return c, False
    old = conns.pop(key, None)
    if old is not None:
        old.close()
    if scheme == "https":
        c = http.client.HTTPSConnection(via[0] if via else netloc, timeout=timeout, context=_context(cafile))
        if via:
            c.set_tunnel(netloc, headers=via[1])
    else:
        c = http.client.HTTPConnection(via[0] if via else netloc, timeout=timeout)
    conns[key] = c
    return c, False


def reset() -> None:
    """Forget what was read from the environment (proxies, CA bundle) and this thread's connections."""
    with _lock:
        _routes.clear()
        _contexts.clear()
    for c in getattr(_local, "conns", {}).values():
        c.close()
    _local.conns = {}


def _forked() -> None:
    """In a forked child: the parent's connections are the parent's; this process makes its own."""
    global _lock, _local
    _lock, _local = threading.Lock(), threading.local()


os.register_at_fork(after_in_child=_forked)


def _send(method: str, url: str, headers: dict, timeout: float, body: bytes | None = None, on_sent=None):
    """(connection, response) of one request on this thread's kept-alive connection to the URL's host; a
    connection the server closed while idle is replaced once. ``on_sent`` is shown the connection once the request
    is sent, before the answer is waited for."""
    u = urlsplit(url)
    path = (u.path or "/") + (f"?{u.query}" if u.query else "")
    via = _route(u.scheme, u.netloc)[0]
    fresh = False
    while True:
        conn, reused = _connection(u.scheme, u.netloc, timeout, fresh)
        try:
            if via and u.scheme == "http":  # plain http through a proxy: the whole URL, with the proxy's headers
                conn.request(method, f"http://{u.netloc}{path}", body=body, headers={**headers, **via[1]})
            else:
                conn.request(method, path, body=body, headers=headers)
            quickack(conn.sock)  # Ceph RGW's body otherwise waits 40 ms for our ACK of its headers (tcp.py)
            if on_sent is not None:
                on_sent(conn)
            return conn, conn.getresponse()
        except (OSError, http.client.HTTPException):
            conn.close()
            if reused and not fresh:  # the server closed an idle keep-alive connection: one more try, new socket
                fresh = True
                continue
            raise


def _buffer() -> memoryview:
    b = getattr(_local, "buf", None)
    if b is None:
        b = _local.buf = memoryview(bytearray(CHUNK))
    return b


def _body(conn, resp, hdrs: dict, each: Callable[[memoryview], None]) -> int:
    """Read the answer's body into this thread's buffer, each full buffer (and the last part) to ``each``; the
    bytes read. Raises IncompleteRead when fewer than its Content-Length came: http.client ends a body quietly when
    the server closes early, and a body cut short is not a shorter answer."""
    buf, n, have = _buffer(), 0, 0
    while True:
        quickack(conn.sock)  # a body's last short segment waits for the ACK of the ones before it, too
        k = resp.readinto(buf[have:])
        have += k
        if have and (not k or have == len(buf)):
            each(buf[:have])
            n, have = n + have, 0
        if not k:
            break
    length = hdrs.get("content-length")
    if length is not None and "chunked" not in hdrs.get("transfer-encoding", "") and n != int(length):
        conn.close()
        raise http.client.IncompleteRead(b"", int(length) - n)
    return n


def request(method: str, url: str, headers: dict, *, timeout: float = 60.0, body: bytes | None = None) \
        -> tuple[int, dict, bytes]:
    """A small request (a listing page, a HEAD, a token's POST with its ``body``): (status, response headers with
    lower-case names, body). Any status is returned; no answer, or a body cut short, raises."""
    conn, resp = _send(method, url, headers, timeout, body)
    hdrs = {k.lower(): v for k, v in resp.getheaders()}
    chunks: list[bytes] = []
    try:
        if method == "HEAD":
            resp.read()
        else:
            _body(conn, resp, hdrs, lambda view: chunks.append(bytes(view)))
    except BaseException:
        conn.close()
        raise
    return resp.status, hdrs, b"".join(chunks)


def pwrite_all(fd: int, view, pos: int) -> None:
    """All of ``view`` at ``pos`` of the file open as ``fd``."""
    view = memoryview(view)
    while len(view):
        k = os.pwrite(fd, view, pos)
        view, pos = view[k:], pos + k


class _Cut:
    """A GET's overall deadline: ``seconds`` after it began, its socket is shut down from a timer's thread, which
    ends a read that is waiting (the socket's own ``timeout`` bounds each read alone, so an answer held back, or
    trickled a byte at a time, would wait on it for ever)."""

    def __init__(self, seconds: float):
        self.seconds, self.fired = seconds, False
        self._end, self._timer = time.monotonic() + seconds, None

    def arm(self, conn) -> None:
        sock = conn.sock

        def cut() -> None:
            self.fired = True
            try:
                sock.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass

        self.cancel()
        self._timer = threading.Timer(max(0.0, self._end - time.monotonic()), cut)
        self._timer.daemon = True
        self._timer.start()

    def cancel(self) -> None:
        if self._timer is not None:
            self._timer.cancel()


def get_into(url: str, headers: dict, fd: int, offset: int, sink: Callable[[memoryview], None] | None = None,
             *, timeout: float = 60.0, on_headers: Callable[[dict], None] | None = None,
             deadline: float | None = None) -> tuple[int, dict]:
    """GET ``url`` and write its body to ``fd`` from ``offset`` on; ``sink`` sees each piece as it is written,
    ``on_headers`` a 2xx answer's headers (lower-case names) before the body. Returns (bytes written, those
    headers). Raises HTTPError for a non-2xx answer, IncompleteRead when the body ends early, OSError for the
    network or the disk, and TimeoutError when the whole answer has not come within ``deadline`` seconds."""
    cut = _Cut(deadline) if deadline else None
    try:
        return _get_into(url, headers, fd, offset, sink, timeout, on_headers, cut)
    except (OSError, http.client.HTTPException):
        if cut is None or not cut.fired:
            raise
    finally:
        if cut is not None:
            cut.cancel()
    # raised here, with nothing behind it: what the socket said after the cut (an end of file, or a reset when
    # the server wrote on after it) is the cut's doing, and errors.socket_reason would say it instead
    raise TimeoutError(f"no whole answer within the GET's deadline of {deadline:.0f} s")


def _get_into(url, headers, fd, offset, sink, timeout, on_headers, cut: _Cut | None) -> tuple[int, dict]:
    conn, resp = _send("GET", url, headers, timeout, on_sent=cut.arm if cut is not None else None)
    hdrs = {k.lower(): v for k, v in resp.getheaders()}
    pos = [offset]

    def each(view: memoryview) -> None:
        pwrite_all(fd, view, pos[0])
        pos[0] += len(view)
        if sink is not None:
            sink(view)

    try:
        if resp.status >= 300:
            raise HTTPError(resp.status, resp.reason, url)
        if on_headers is not None:
            on_headers(hdrs)
        n = _body(conn, resp, hdrs, each)
    except BaseException:
        conn.close()  # the body is left unread: the connection cannot be reused
        raise
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
