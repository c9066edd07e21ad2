"""GET an object's bytes straight into a file: the stager's data path, with as few copies and layers as Python allows.

swiftclient and boto3 hand out each chunk as a new ``bytes`` (requests -> urllib3 -> http.client), so a 256 MB
object is copied several times under the GIL. Here one thread-local buffer receives the socket's bytes
(``readinto``: the kernel copies into it, nothing else does), ``os.pwrite`` puts them at their place in the file and
``sink`` (hashing, progress) sees the same buffer, sized to stay in the core's L2 cache (``buffer_size``). One
keep-alive connection per thread and host.
Swift and S3 differ only in how a request is authorised (a token header; a presigned URL), which the stores own.

Measured with ``make bench-stage`` (bench/results/stage*.md): client CPU per 256 MB object, before and after.
"""

from __future__ import annotations

import base64
import errno
import http.client
import mmap
import os
import ssl
import threading
import urllib.request
from collections.abc import Callable
from urllib.parse import unquote, urlsplit

from . import heldio
from .tcp import quickack

try:
    from . import _tlsread  # an https body many TLS records per call (appliance/store/_tlsread.c)
except ImportError:  # not built here (no compiler when the package was installed): the ssl module's reads
    _tlsread = None
if _tlsread is not None and not _tlsread.available():
    _tlsread = None


def _l2_bytes(root: str = "/sys/devices/system/cpu/cpu0/cache") -> int | None:
    """One core's level-2 cache (Linux sysfs: ``index*/level`` 2, ``size`` like ``512K``), None when unknown."""
    import re
    from pathlib import Path

    try:
        for idx in sorted(Path(root).glob("index*")):
            if (idx / "level").read_text().strip() == "2":
                m = re.fullmatch(r"(\d+)([KMG]?)", (idx / "size").read_text().strip().upper())
                if m:
                    return int(m.group(1)) << {"": 0, "K": 10, "M": 20, "G": 30}[m.group(2)]
    except OSError:
        pass
    return None


def buffer_size(l2: int | None) -> int:
    """One core's L2 cache, from 256 KiB to 1 MiB (512 KiB when unknown). The kernel writes the socket's bytes into
    the buffer, then the page cache and the hash read them back: a buffer that fits L2 is read from there, a larger
    one from L3 or memory, and a smaller one costs more calls. On this machine's 512 KiB of L2 per core (AMD EPYC),
    for 2 GiB (python bench/stage_buffer_ab.py, medians of 6 rounds, the sizes alternating): while the machine was
    slow (memory contended), 1 MiB cost 4.21 s of system time, 512 KiB 2.15 s and 256 KiB 2.48 s; while it was
    fast, 1.66, 1.77 and 2.18 s (wall time 3.70, 3.67, 4.05 s). docs/staging.md of 14aa98a (in git), "The receive buffer"."""
    return min(1 << 20, max(256 << 10, l2)) if l2 else 512 << 10


BUF = buffer_size(_l2_bytes())


class HTTPError(Exception):
    """A non-2xx answer. ``http_status`` is what ``objects._transient`` reads: 5xx and 429 are retried."""

    def __init__(self, status: int, reason: str, url: str, *, code: str | None = None, method: str = "GET"):
        said = " ".join(filter(None, (f"HTTP {status}", reason, f"({code})" if code else "")))
        super().__init__(f"{said} for {method} {url.split('?')[0]}")
        self.http_status = status
        self.code = code  # S3's error code (NoSuchBucket, AccessDenied, ...), when the answer named one


_local = threading.local()

# TLS 1.3's suites in the order offered: AES-128-GCM first, as Go's crypto/tls client offers them (s5cmd and rclone
# get it: bench/results/stage-md5-aes128/negotiated-suites.txt) and as Mozilla's server configurations list them;
# OpenSSL's own order puts AES-256-GCM first. A server that honours the client's order (OpenSSL's default, so RGW's
# beast frontend here) then encrypts with the cheaper one: 3.29 against 2.73 GB/s on one core here
# (`openssl speed -evp`, bench/results/stage-md5-aes128/openssl-speed.txt).
TLS13_SUITES = "TLS_AES_128_GCM_SHA256:TLS_AES_256_GCM_SHA384:TLS_CHACHA20_POLY1305_SHA256"

# How much a TLS connection of ours reads from its socket per read(): two of the largest records (16 KiB of data, 256
# bytes of overhead, a 5-byte header). OpenSSL without read-ahead makes two read()s a record, its header and then its
# body (ssl3_read_n in OpenSSL's ssl/record/rec_layer_s3.c); with it, one read() takes what the socket holds. 8
# streams of 256 MiB over TLS from a server process: 2.31 s of the client's CPU against 2.70 without, 87,789 read()s
# against 262,521 (bench/results/tls-read-ahead/tls.md). Longer buffers made fewer read()s but took more user time
# (lengths.txt there: 1.31 s at 128 KiB, 1.42 at 256 KiB, 1.18 at this length, 1.43 without).
READ_AHEAD = 2 * (5 + 16384 + 256)


def _ssl_context() -> ssl.SSLContext:
    ctx = getattr(_local, "ssl", None)
    if ctx is None:
        # the CA bundle requests (and so swiftclient and boto3) would use: REQUESTS_CA_BUNDLE, else certifi's
        cafile = os.environ.get("REQUESTS_CA_BUNDLE") or os.environ.get("SSL_CERT_FILE")
        if not cafile:
            try:
                import certifi

                cafile = certifi.where()
            except ImportError:
                cafile = None
        ctx = _local.ssl = ssl.create_default_context(cafile=cafile)
        if _tlsread is not None:
            ctx.sslsocket_class = _TLSSocket
            try:
                _tlsread.set_ciphersuites(ctx, TLS13_SUITES)
            except (TypeError, ValueError):
                pass  # an OpenSSL without TLS 1.3: its own order
            try:
                _tlsread.read_ahead(ctx, READ_AHEAD)
            except TypeError:
                pass  # an OpenSSL before 1.1.0: a record in two reads, as before
    return ctx


def _ms(timeout: float | None) -> int:
    """A socket's timeout as _tlsread takes it: milliseconds, -1 for none."""
    return -1 if timeout is None else max(1, int(timeout * 1000))


class _TLSSocket(ssl.SSLSocket):
    """The ssl module's socket, but a read and a write each release the GIL once (``_tlsread``). The ssl module
    releases it for each TLS record and again for each wait on the socket: the wait for an answer's headers was 3
    hand-overs (a read that finds nothing, the poll, the read), a request 2 (a poll for room, the write). With the
    stager's 32 threads on 2 cores a hand-over is often a context switch: 4,000 objects of 100 KB from Ceph RGW over
    https made 13-15 voluntary ones per object, 11.5-12 with this and whole-buffer writes (get_into; rclone: 2-3).
    A read (http.client's reader filling its buffer) waits for a first byte and takes what has come; a write sends
    all. Anything else (flags, a non-blocking socket, before the handshake) is the ssl module's."""

    def recv_into(self, buffer, nbytes=0, flags=0):
        t = self.gettimeout()
        if flags or t == 0 or self._sslobj is None or _tlsread is None:
            return super().recv_into(buffer, nbytes, flags)
        b = memoryview(buffer).cast("B")
        if nbytes:
            b = b[:nbytes]
        if not len(b):
            return 0
        return _tlsread.recv_some(self._sslobj, self.fileno(), b, _ms(t))

    def sendall(self, data, flags=0):
        t = self.gettimeout()
        if flags or t == 0 or self._sslobj is None or _tlsread is None:
            return super().sendall(data, flags)
        with memoryview(data) as view, view.cast("B") as b:
            if len(b):
                _tlsread.send_all(self._sslobj, self.fileno(), b, _ms(t))


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


class Headers:
    """An answer's headers as http.client's HTTPMessage gives them to HTTPResponse and to us (``get``: the first of
    a name, any case; ``get_all``; ``items`` in order), parsed without the email package (``_Response``)."""

    __slots__ = ("_items", "_first")

    def __init__(self, lines: list[bytes]):
        items: list[list[str]] = []
        for raw in lines:
            line = raw.decode("iso-8859-1").rstrip("\r\n")
            if not line:
                continue
            if line[0] in " \t" and items:  # an obsolete folded line continues the header before it (RFC 9112 5.2)
                items[-1][1] += " " + line.strip()
                continue
            name, sep, value = line.partition(":")
            if sep:
                items.append([name, value.strip(" \t")])
        self._items = [(k, v) for k, v in items]
        self._first: dict[str, str] = {}
        for k, v in self._items:
            self._first.setdefault(k.lower(), v)

    def get(self, name: str, default=None):
        return self._first.get(name.lower(), default)

    def get_all(self, name: str, default=None):
        got = [v for k, v in self._items if k.lower() == name.lower()]
        return got or default

    def items(self) -> list[tuple[str, str]]:
        return list(self._items)

    def __contains__(self, name: str) -> bool:
        return name.lower() in self._first


# more than the buffer of http.client's reader (socket.makefile's, io.DEFAULT_BUFFER_SIZE): a ``readinto1`` of it then
# leaves nothing in that reader
_READAHEAD = 64 * 1024


class _Response(http.client.HTTPResponse):
    """http.client's answer with its headers parsed by ``Headers``. http.client parses them with the email package
    (``parse_headers``): about 0.2 ms of CPU per answer here, a third of a 100 KB GET's CPU in this process (a
    cProfile of 2,000 GETs from Ceph RGW: ``HTTPResponse.begin`` 2.9 of 6.3 s), which on a dataset of small files is
    the stager's limit. ``begin`` is CPython 3.11's (Lib/http/client.py, ``HTTPResponse.begin``) but for that line;
    the rest of HTTPResponse (chunked bodies, lengths, keep-alive) is untouched."""

    def __init__(self, sock, *args, **kwargs):
        super().__init__(sock, *args, **kwargs)
        self._tls = sock if _tlsread is not None and isinstance(sock, ssl.SSLSocket) else None
        self._drained = False  # the bytes http.client's reader took ahead of the body's rest are read

    def readinto(self, b) -> int:
        """http.client's, but the body of an https answer of known length is read by ``_tlsread``: a buffer's worth
        of TLS records (512 KiB: 32) per call with the GIL released once, where the ssl module releases and takes it
        back for every record (16 KiB): 8 threads reading 1 GiB over TLS made 34,106 voluntary context switches
        that way against 186, at 2.43 against 1.46 s of CPU (bench/results/tls-reads/tls.md); the stager takes 928
        ms of CPU per 256 MiB object from Ceph RGW over https against 1,351 before (bench/results/stage-tls-ab). The
        first call takes what http.client's buffered reader holds (it reads ahead while it parses the headers;
        ``readinto1`` empties it for a buffer larger than its own); every later one reads the TLS connection itself.
        Bookkeeping (``length``, the end of the body) as http.client's ``readinto``."""
        tls = self._tls
        if tls is None or self.fp is None or self.chunked or not self.length or self._method == "HEAD":
            return super().readinto(b)
        b = memoryview(b)[:self.length]
        if len(b) <= _READAHEAD:
            return super().readinto(b)
        if not self._drained:
            self._drained = True
            n = self.fp.readinto1(b)
        else:
            t = tls.gettimeout()
            n = _tlsread.recv_into(tls._sslobj, tls.fileno(), b, _ms(t))
        if not n:
            self._close_conn()
            return 0
        self.length -= n
        if not self.length:
            self._close_conn()
        return n

    def begin(self):
        if self.headers is not None:
            return
        while True:  # until an answer that is not 100 Continue
            version, status, reason = self._read_status()
            if status != http.client.CONTINUE:
                break
            http.client._read_headers(self.fp)
        self.code = self.status = status
        self.reason = reason.strip()
        if version in ("HTTP/1.0", "HTTP/0.9"):
            self.version = 10
        elif version.startswith("HTTP/1."):
            self.version = 11
        else:
            raise http.client.UnknownProtocol(version)
        self.headers = self.msg = Headers(http.client._read_headers(self.fp))
        tr_enc = self.headers.get("transfer-encoding")
        self.chunked = bool(tr_enc and tr_enc.lower() == "chunked")
        self.chunk_left = None
        self.will_close = self._check_close()
        self.length = None
        length = self.headers.get("content-length")
        if length and not self.chunked:
            try:
                self.length = int(length)
            except ValueError:
                self.length = None
            else:
                if self.length < 0:
                    self.length = None
        if status in (http.client.NO_CONTENT, http.client.NOT_MODIFIED) or 100 <= status < 200 or \
                self._method == "HEAD":
            self.length = 0
        if not self.will_close and not self.chunked and self.length is None:
            self.will_close = True


def _connection(scheme: str, netloc: str, timeout: float, fresh: bool) -> tuple[http.client.HTTPConnection, bool]:
    """(this thread's connection to ``netloc``, whether it was used before). Through a proxy: https tunnels
    (CONNECT; the proxy sees neither the path nor the headers), http asks the proxy for the absolute URL."""
    conns = getattr(_local, "conns", None)
    if conns is None:
        conns = _local.conns = {}
    key = (scheme, netloc)
    c = None if fresh else conns.get(key)
    if c is not None:
        return c, True
    old = conns.pop(key, None)
    if old is not None:
        old.close()
    via = _proxy(scheme, netloc)
    if scheme == "https":
        c = http.client.HTTPSConnection(via[0] if via else netloc, timeout=timeout, context=_ssl_context())
        if via:
            c.set_tunnel(netloc, headers=via[1])
    else:
        c = http.client.HTTPConnection(via[0] if via else netloc, timeout=timeout)
    c.response_class = _Response
    # plain http through a proxy: the request line carries the whole URL, with the proxy's headers (else None)
    c.appliance_via = via[1] if via and scheme == "http" else None
    conns[key] = c
    return c, False


def _drop(scheme: str, netloc: str) -> None:
    c = getattr(_local, "conns", {}).pop((scheme, netloc), None)
    if c is not None:
        c.close()


ALIGN = 4096  # what O_DIRECT asks of a write's address, length and place: a 4 KiB-sector disk's block (512 divides it)


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


def lent_most(available: int | None, buf: int) -> int:
    """How many receive buffers may be lent at once: 256 MiB of them, or a 16th of the memory available where
    that is less (64 MiB when unknown). What is lent waits for the hasher, which on this 2-core machine, beside
    the store, fell up to 131 MiB behind the GETs of 8 x 256 MiB (263 buffers; docs/staging.md of 14aa98a (in git), "Past the page
    cache"); a piece offered when none is left goes through the page cache, as before."""
    most = min(256 << 20, available // 16) if available else 64 << 20
    return max(1, most // buf)


LENT_MOST = lent_most(mem_available(), BUF)  # past that many lent at once, a piece is not offered


class _Pool:
    """Receive buffers, page-aligned (an anonymous mmap each, as O_DIRECT needs) and reused. Each fetching thread
    has one (gone with the thread); a thread that lends its buffer (``Lease``) goes on with another from here, and
    the lent one comes back here once its holders let go. At most ``most`` are lent at once."""

    def __init__(self, most: int):
        self.lock = threading.Lock()
        self.free: list[memoryview] = []
        self.lent = 0
        self.most = most

    def take(self) -> memoryview:
        with self.lock:
            if self.free:
                return self.free.pop()
        return memoryview(mmap.mmap(-1, BUF))

    def spare(self) -> memoryview | None:
        """A buffer to go on with while the one in hand is lent (counted as lent from now), or None once
        ``most`` are."""
        with self.lock:
            if self.lent >= self.most:
                return None
            self.lent += 1
        return self.take()

    def unlent(self, spare: memoryview) -> None:
        """The buffer was not lent after all: ``spare`` goes back."""
        with self.lock:
            self.lent -= 1
            self.free.append(spare)


_POOL = _Pool(LENT_MOST)


class Lease:
    """A receive buffer lent to whoever reads its bytes after the fetching thread has gone on (the hasher): back in
    the pool once the last holder releases it. ``share`` once per holder; the lender holds one from the start."""

    __slots__ = ("buf", "refs")

    def __init__(self, buf: memoryview):
        self.buf = buf
        self.refs = 1

    def share(self) -> None:
        with _POOL.lock:
            self.refs += 1

    def release(self) -> None:
        with _POOL.lock:
            self.refs -= 1
            if self.refs:
                return
            _POOL.lent -= 1
            _POOL.free.append(self.buf)


def _buffer() -> memoryview:
    b = getattr(_local, "buf", None)
    if b is None:
        b = _local.buf = _POOL.take()
    return b


pwrite_all = heldio.pwrite_all  # all of a view at a place in a file (a small one with the GIL held)


def open_direct(path, flags: int = os.O_WRONLY) -> int | None:
    """``path`` opened again with O_DIRECT (writes skip the page cache), or None where the file system refuses it
    (tmpfs: EINVAL) or the platform has none."""
    if not hasattr(os, "O_DIRECT"):
        return None
    try:
        return os.open(path, flags | os.O_DIRECT)
    except OSError:
        return None


_direct_refused = False  # a file system took O_DIRECT at open and refused a write: buffered from then on


def write_at(fd: int, direct: int | None, view: memoryview, pos: int) -> None:
    """All of ``view`` (the start of a receive buffer: page-aligned) at ``pos`` of a file open as ``fd``, and as
    ``direct`` with O_DIRECT: the whole 4 KiB blocks from an aligned ``pos`` through ``direct``, by DMA from the
    buffer, the rest through ``fd`` and the page cache. The page cache's copy is what buffered writes cost: 2 GiB
    from one 512 KiB buffer into a fresh ext4 here took 0.52-4.47 s of system time buffered, depending on the hour,
    and 0.22-0.27 s direct (bench/results/stage-direct/direct-write.txt). A block is written one way only: the direct ones lie wholly inside this write,
    the rest share a block with another write, and those go through the page cache too."""
    global _direct_refused
    if direct is not None and not _direct_refused and pos % ALIGN == 0 and len(view) >= ALIGN:
        k = len(view) // ALIGN * ALIGN
        try:
            done = os.pwrite(direct, view[:k], pos)
        except OSError as e:
            if e.errno != errno.EINVAL:
                raise
            _direct_refused = True  # an alignment this file system does not take: the page cache, as before
            done = 0
        view, pos = view[done:], pos + done  # a short direct write (a full disk): the rest says why, buffered
    pwrite_all(fd, view, pos)


def _send(method: str, url: str, headers: dict, timeout: float, body: bytes | None = None):
    """(connection, response) of one request on this thread's kept-alive connection to the URL's host."""
    u = urlsplit(url)
    path = (u.path or "/") + (f"?{u.query}" if u.query else "")
    fresh = False
    while True:
        conn, reused = _connection(u.scheme, u.netloc, timeout, fresh)
        try:
            if conn.appliance_via is not None:
                conn.request(method, f"http://{u.netloc}{path}", body=body,
                             headers={**headers, **conn.appliance_via})
            else:
                conn.request(method, path, body=body, headers=headers)
            quickack(conn.sock)  # Ceph RGW's body otherwise waits 40 ms for our ACK of its headers (tcp.py)
            return conn, conn.getresponse()
        except (OSError, http.client.HTTPException):
            _drop(u.scheme, u.netloc)
            if reused and not fresh:  # the server closed an idle keep-alive connection: one more try, new socket
                fresh = True
                continue
            raise


def request(method: str, url: str, headers: dict, *, timeout: float = 60.0, body: bytes | None = None) \
        -> tuple[int, dict, bytes]:
    """A small request (a listing page, a HEAD, a token's POST with its ``body``) on the same connections as
    ``get_into``: (status, response headers with lower-case names, body). Any status is returned; OSError and
    http.client's errors are raised."""
    u = urlsplit(url)
    conn, resp = _send(method, url, headers, timeout, body)
    try:
        chunks = []
        while True:
            quickack(conn.sock)  # a body's last short segment waits for the ACK of the ones before it, too
            b = resp.read(BUF)
            if not b:
                break
            chunks.append(b)
    except BaseException:
        _drop(u.scheme, u.netloc)
        raise
    if resp.will_close:
        _drop(u.scheme, u.netloc)
    body, hdrs = b"".join(chunks), {k.lower(): v for k, v in resp.getheaders()}
    if method != "HEAD":
        _whole(u, hdrs, len(body))
    return resp.status, hdrs, body


def _whole(u, hdrs: dict, n: int) -> None:
    """Raises IncompleteRead when fewer than Content-Length bytes came: http.client ends a body quietly when the
    server closes early, and a body cut short is not a shorter answer."""
    length = hdrs.get("content-length")
    if length is not None and "chunked" not in hdrs.get("transfer-encoding", "") and n != int(length):
        _drop(u.scheme, u.netloc)
        raise http.client.IncompleteRead(b"", int(length) - n)


def get_into(url: str, headers: dict, fd: int, offset: int, sink: Callable[[memoryview], None] | None = None,
             *, timeout: float = 60.0, on_headers: Callable[[dict], None] | None = None, direct: int | None = None,
             hold: Callable[[memoryview, Lease], bool | None] | None = None) -> tuple[int, dict]:
    """GET ``url`` and write its body to ``fd`` from ``offset`` on; ``sink`` sees each piece as it is written,
    ``on_headers`` a 2xx answer's headers (lower-case names) before the body. Returns (bytes written, those
    headers). Raises HTTPError for a non-2xx answer, http.client.IncompleteRead when the body ends early, OSError
    for the network or the disk.

    ``direct``: the same file open with O_DIRECT (``open_direct``), for the bytes nobody reads back from the file
    (``write_at``). With no ``hold``, that is every byte: ``sink`` has seen them before the next read. ``hold(view,
    lease)`` is offered each piece first, before it is written: True when it keeps the bytes in the buffer itself
    (``lease.share()``) and reads nothing of them from the file, for the hasher (store/md5lanes.py); then the
    thread goes on with a spare buffer, ``sink`` does not see the piece, and it may go direct. False (or no spare
    buffer): written through the page cache, then shown to ``sink``. None: nobody holds or reads back this piece
    (a GET whose headers said it is checked as it passes): written as with no ``hold``, then shown to ``sink``."""
    u = urlsplit(url)
    conn, resp = _send("GET", url, headers, timeout)
    hdrs = {k.lower(): v for k, v in resp.getheaders()}
    if resp.status >= 300:
        resp.read(1 << 16)
        _drop(u.scheme, u.netloc)
        raise HTTPError(resp.status, resp.reason, url)
    if on_headers is not None:
        try:
            on_headers(hdrs)
        except BaseException:
            _drop(u.scheme, u.netloc)  # the body is left unread: the connection cannot be reused
            raise
    buf = _buffer()
    n = have = 0  # bytes written; bytes in the buffer, not yet written
    try:
        while True:  # the buffer filled before it is written and hashed: a 100 KB body is one pwrite, one hash
            quickack(conn.sock)  # a body's last short segment waits for the ACK of the ones before it, too
            k = resp.readinto(buf[have:])
            have += k
            if have and (not k or have == len(buf)):
                view, lease, kept = buf[:have], None, None
                if hold is not None:
                    spare = _POOL.spare()
                    kept = False  # no spare: through the page cache, for whoever reads it back
                    if spare is not None:
                        lease = Lease(buf)
                        kept = hold(view, lease)
                        if kept:
                            _local.buf = buf = spare  # this one is the holders' until they release it
                        else:
                            _POOL.unlent(spare)
                            lease = None
                if lease is not None:
                    try:
                        write_at(fd, direct, view, offset + n)
                    finally:
                        lease.release()
                else:
                    write_at(fd, direct if kept is None else None, view, offset + n)
                    if sink is not None:
                        sink(view)
                n += have
                have = 0
            if not k:
                break
    except BaseException:
        _drop(u.scheme, u.netloc)
        raise
    if resp.will_close:
        _drop(u.scheme, u.netloc)
    _whole(u, hdrs, n)
    return n, hdrs
