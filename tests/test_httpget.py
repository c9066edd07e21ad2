"""The stager's data path (appliance/store/httpget.py, sigv4.py): bytes straight into the file, failures said.

Fast tier: a real HTTP server on 127.0.0.1 (http.server) and botocore as the judge of the S3 signature. The e2e
staging tests (tests/test_stage.py) run the same code against OpenStack Swift and Ceph RGW.
"""

from __future__ import annotations

import datetime as dt
import http.client
import os
import select
import socket
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

from urllib.parse import urlsplit

import pytest

from appliance.localcloud.rgw_server import self_signed
from appliance.store import httpget, sigv4
from appliance.store.httpget import Headers, HTTPError, get_into, request
from conftest import delayed_acks, http_server, resident_pages
from appliance.store.objects import _transient
from appliance.store.sigv4 import Presigner

BODY = os.urandom(3 * (1 << 20) + 12345)  # more than one buffer, not a multiple of it


class Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"  # keep-alive, as Swift and RGW
    mode = "ok"
    requests: list = []

    def log_message(self, *a):
        pass

    def do_GET(self):
        Handler.requests.append((self.path, dict(self.headers)))
        if Handler.mode == "503":
            self.send_response(503)
            self.send_header("Content-Length", "4")
            self.end_headers()
            self.wfile.write(b"busy")
            return
        if "list-type=2" in self.path:  # an S3 ListObjectsV2 page, its body in a second write
            body = (b'<?xml version="1.0" encoding="UTF-8"?><ListBucketResult xmlns="http://s3.amazonaws.com/doc/'
                    b'2006-03-01/"><Name>c</Name><Prefix></Prefix><KeyCount>1</KeyCount><MaxKeys>1000</MaxKeys>'
                    b'<IsTruncated>false</IsTruncated><Contents><Key>o</Key><LastModified>2026-11-25T00:00:00.000Z'
                    b'</LastModified><ETag>"x"</ETag><Size>1</Size><StorageClass>STANDARD</StorageClass></Contents>'
                    b'</ListBucketResult>')
            self.send_response(200)
            self.send_header("Content-Length", str(len(body)))
            self.send_header("Content-Type", "application/xml")
            self.end_headers()
            self.wfile.write(body)
            return
        if "format=json" in self.path:  # a Swift container listing: one page, then the empty one
            body = b'[{"name": "o", "bytes": 1, "hash": "x"}]' if "marker=" not in self.path else b"[]"
            self.send_response(200)
            self.send_header("Content-Length", str(len(body)))
            self.send_header("Content-Type", "application/json")
            self.end_headers()  # the headers in one write, the body in another, Nagle on: as Ceph RGW's beast
            self.wfile.write(body)
            return
        body = BODY[:1000] if Handler.mode == "small" else BODY
        rng = self.headers.get("Range")
        if rng:
            a, b = rng.split("=")[1].split("-")
            body = BODY[int(a):int(b) + 1]
        self.send_response(206 if rng else 200)
        self.send_header("Content-Length", str(len(body)))
        self.send_header("X-Static-Large-Object", "False")
        self.end_headers()
        if Handler.mode == "short":  # the server dies mid-body
            self.wfile.write(body[: len(body) // 2])
            self.close_connection = True
            return
        self.wfile.write(body)
        if Handler.mode == "close":  # then close the kept-alive connection without a word (an idle timeout)
            self.close_connection = True


@pytest.fixture
def server():
    Handler.mode, Handler.requests = "ok", []
    with http_server(Handler) as url:
        yield url


def _body_and_a_range(url: str, tmp_path) -> dict:
    """The whole body at offset 100 (the sink sees every piece), then bytes 10-19 at 0 on the same kept-alive
    connection: the file holds both where they belong. Returns the first answer's headers."""
    p = tmp_path / "f"
    p.write_bytes(b"\0" * 100)
    seen = bytearray()
    fd = os.open(p, os.O_WRONLY)
    try:
        n, hdrs = get_into(f"{url}/c/o", {}, fd, 100, seen.extend)
        n2, _ = get_into(f"{url}/c/o", {"Range": "bytes=10-19"}, fd, 0, None)  # same connection, kept alive
    finally:
        os.close(fd)
    assert n == len(BODY) and bytes(seen) == BODY
    assert n2 == 10 and p.read_bytes() == BODY[10:20] + b"\0" * 90 + BODY
    return hdrs


def test_the_body_lands_at_the_offset_and_the_sink_sees_every_byte(server, tmp_path):
    assert _body_and_a_range(server, tmp_path)["x-static-large-object"] == "False"


def test_a_body_cut_short_is_an_error_not_a_short_file(server, tmp_path):
    Handler.mode = "short"
    fd = os.open(tmp_path / "f", os.O_WRONLY | os.O_CREAT)
    try:
        with pytest.raises(http.client.IncompleteRead) as e:
            get_into(f"{server}/c/o", {}, fd, 0)
    finally:
        os.close(fd)
    assert _transient(e.value)  # the stager retries it


def test_a_5xx_is_raised_with_its_status_and_is_retried(server, tmp_path):
    Handler.mode = "503"
    fd = os.open(tmp_path / "f", os.O_WRONLY | os.O_CREAT)
    try:
        with pytest.raises(HTTPError) as e:
            get_into(f"{server}/c/o?secret=1", {}, fd, 0)
    finally:
        os.close(fd)
    assert e.value.http_status == 503 and _transient(e.value)
    assert "secret" not in str(e.value)  # a presigned URL's signature is never in a message


def test_a_keep_alive_connection_the_server_closed_is_replaced(server, tmp_path):
    Handler.mode = "close"
    fd = os.open(tmp_path / "f", os.O_WRONLY | os.O_CREAT)
    try:
        for _ in range(3):
            assert get_into(f"{server}/c/o", {}, fd, 0)[0] == len(BODY)
    finally:
        os.close(fd)
    assert len(Handler.requests) == 3


# Ceph RGW's beast frontend (tcp_nodelay off unless set: ceph src/rgw/rgw_asio_frontend.cc) writes headers and body
# separately with Nagle on, as http.server does here: on a kept-alive connection the body waited for our delayed
# ACK of the headers, 40 ms or more per answer (44 ms per small GET, 48 ms per listing against radosgw 16.2.15).
# Counted as the kernel's delayed ACKs over 20 answers (conftest.delayed_acks), not timed: 21 without the quick ACKs
# (APPLIANCE_QUICKACK=0), 0 with them; bench/results/quickack-c4 has what they are worth in time.
def test_a_small_answer_in_two_writes_is_not_held_for_the_delayed_ack(server, tmp_path):
    Handler.mode = "small"
    fd = os.open(tmp_path / "f", os.O_WRONLY | os.O_CREAT)
    try:
        assert delayed_acks(lambda: get_into(f"{server}/c/o", {}, fd, 0)) < 10
    finally:
        os.close(fd)


def test_a_swift_listing_in_two_writes_is_not_held_for_the_delayed_ack(server):
    from appliance.store.objects import StoreCreds, SwiftStore

    store = SwiftStore("c", StoreCreds(storage_url=f"{server}/v1/AUTH_t", token="t"))
    assert [o.name for o in store.list()] == ["o"]
    assert delayed_acks(lambda: list(store.list())) < 10  # two requests each: the page and the empty page after it


def test_an_s3_listing_in_two_writes_is_not_held_for_the_delayed_ack(server):
    """Our own signed requests on httpget's connections (botocore's urllib3 pool before them, with quick ACKs of
    tcp.py too): 44 ms per listing page without; a 1,000-name page each."""
    from appliance.store.objects import S3Store, StoreCreds

    store = S3Store("c", StoreCreds(s3_endpoint=server, s3_access_key="a", s3_secret_key="b"))
    assert [o.name for o in store.list()] == ["o"]
    assert delayed_acks(lambda: list(store.list())) < 10


def test_boto3s_small_answers_are_not_held_for_the_delayed_ack(server):
    """boto3 still makes buckets, HEADs them, uploads and deletes (the checkpoint store's pruning: an answer per
    object): its client's connections take quick ACKs too (tcp.quickack_boto), here asked for a listing page."""
    from appliance.store.objects import S3Store, StoreCreds

    client = S3Store("c", StoreCreds(s3_endpoint=server, s3_access_key="a", s3_secret_key="b")).client()
    assert [o["Key"] for o in client.list_objects_v2(Bucket="c")["Contents"]] == ["o"]
    assert delayed_acks(lambda: client.list_objects_v2(Bucket="c")) < 10


@pytest.mark.parametrize("key", ["plain.bin", "dir/sub dir/ü é+&=?.bin", "a~b_c-d.e/!*'()"])
@pytest.mark.parametrize("endpoint", ["http://127.0.0.1:8080", "https://chi.tacc.chameleoncloud.org:7480"])
def test_the_presigned_url_is_botocores_byte_for_byte(monkeypatch, key, endpoint):
    import boto3
    import botocore.auth
    from botocore.config import Config

    now = dt.datetime(2026, 11, 23, 12, 34, 56)
    monkeypatch.setattr(botocore.auth, "get_current_datetime", lambda: now)
    c = boto3.client("s3", endpoint_url=endpoint, aws_access_key_id="AK", aws_secret_access_key="SK/x+y",
                     region_name="us-east-1", config=Config(s3={"addressing_style": "path"}, signature_version="s3v4"))
    want = c.generate_presigned_url("get_object", Params={"Bucket": "bucket", "Key": key}, ExpiresIn=3600)
    got = Presigner(endpoint, "AK", "SK/x+y", "us-east-1").url("bucket", key, now=now.replace(tzinfo=dt.timezone.utc))
    parse = lambda u: (u.split("?")[0], sorted(u.split("?")[1].split("&")))  # noqa: E731 (same query, any order)
    assert parse(got) == parse(want)
    # at the clock's time: the date strings and the query are made once a second and kept for the next URLs, which
    # a listing's URL between them (with parameters) does not change
    monkeypatch.setattr(sigv4, "_clock", lambda: now.replace(tzinfo=dt.timezone.utc).timestamp() + 0.25)
    p = Presigner(endpoint, "AK", "SK/x+y", "us-east-1")
    assert parse(p.url("bucket", key)) == parse(want)
    p.url("bucket", params={"list-type": "2", "prefix": "x"})
    assert parse(p.url("bucket", key)) == parse(want)
    monkeypatch.setattr(sigv4, "_clock", lambda: now.replace(tzinfo=dt.timezone.utc).timestamp() + 1)
    assert "X-Amz-Date=20261123T123457Z" in p.url("bucket", key)


def test_a_url_is_signed_without_the_one_shot_hmac_that_hands_the_gil_over(monkeypatch):
    """hmac.digest (CPython's _hashlib.hmac_digest) gives the GIL back around every call, however short the message:
    a wait for the GIL per URL among the stager's 32 threads (bench/results/stage-switches/gil-waits.txt). The
    signature is the same made with an HMAC object."""
    import hmac

    now = dt.datetime(2026, 11, 23, 12, 34, 56, tzinfo=dt.timezone.utc)
    want = Presigner("http://127.0.0.1:8080", "AK", "SK/x+y", "us-east-1").url("bucket", "k", now=now)

    def one_shot(*a, **k):
        raise AssertionError("hmac.digest gives the GIL back")

    monkeypatch.setattr(hmac, "digest", one_shot)
    assert Presigner("http://127.0.0.1:8080", "AK", "SK/x+y", "us-east-1").url("bucket", "k", now=now) == want


def test_urls_signed_by_many_threads_across_midnight_are_each_whole(monkeypatch):
    """The stager's threads share one presigner, whose date strings change once a second: every URL signed while
    the clock crosses midnight (the date changes too) is the URL of its own X-Amz-Date, never a mix of two."""
    import itertools

    utc = dt.timezone.utc
    ticks, base = itertools.count(), dt.datetime(2026, 11, 23, 23, 59, 58, tzinfo=utc).timestamp()
    monkeypatch.setattr(sigv4, "_clock", lambda: base + next(ticks) * 0.005)  # 4 s over 800 URLs
    p = Presigner("http://127.0.0.1:8080", "AK", "SK/x+y", "us-east-1")
    urls: list[str] = []
    threads = [threading.Thread(target=lambda: urls.extend(p.url("bucket", f"k{i}") for i in range(100)))
               for _ in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    dates = set()
    for u in urls:
        q = dict(x.split("=", 1) for x in u.split("?")[1].split("&"))
        when = dt.datetime.strptime(q["X-Amz-Date"], "%Y%m%dT%H%M%SZ").replace(tzinfo=utc)
        assert u == p.url("bucket", u.split("?")[0].rsplit("/", 1)[1], now=when)
        dates.add(when.date())
    assert len(urls) == 800 and len(dates) == 2


@pytest.mark.parametrize("endpoint", ["http://127.0.0.1:8080", "https://chi.tacc.chameleoncloud.org:7480/base"])
def test_the_listing_and_part_head_urls_are_botocores_byte_for_byte(monkeypatch, endpoint):
    """What S3Store lists and asks part sizes with (no boto3 in the stager): ListObjectsV2 with botocore's own
    encoding-type=url, HeadObject with a PartNumber."""
    import boto3
    import botocore.auth
    from botocore.config import Config

    now = dt.datetime(2026, 11, 23, 12, 34, 56)
    monkeypatch.setattr(botocore.auth, "get_current_datetime", lambda: now)
    c = boto3.client("s3", endpoint_url=endpoint, aws_access_key_id="AK", aws_secret_access_key="SK/x+y",
                     region_name="us-east-1", config=Config(s3={"addressing_style": "path"}, signature_version="s3v4"))
    p = Presigner(endpoint, "AK", "SK/x+y", "us-east-1")
    utc = now.replace(tzinfo=dt.timezone.utc)
    parse = lambda u: (u.split("?")[0], sorted(u.split("?")[1].split("&")))  # noqa: E731 (same query, any order)
    want = c.generate_presigned_url("list_objects_v2", Params={"Bucket": "bucket", "Prefix": "dir/ü +&=",
                                                               "ContinuationToken": "1/abc+=="}, ExpiresIn=3600)
    got = p.url("bucket", params={"list-type": "2", "prefix": "dir/ü +&=", "continuation-token": "1/abc+==",
                                  "encoding-type": "url"}, now=utc)
    assert parse(got) == parse(want)
    want = c.generate_presigned_url("head_object", Params={"Bucket": "bucket", "Key": "a b/c", "PartNumber": 3},
                                    ExpiresIn=3600)
    assert parse(p.url("bucket", "a b/c", method="HEAD", params={"partNumber": "3"}, now=utc)) == parse(want)


class Proxy(BaseHTTPRequestHandler):
    """A forward proxy: GET of an absolute URL (plain http) and CONNECT tunnels (https), as squid does."""
    protocol_version = "HTTP/1.1"
    seen: list = []

    def log_message(self, *a):
        pass

    def do_GET(self):
        Proxy.seen.append(("GET", self.path, self.headers.get("Proxy-Authorization")))
        u = urlsplit(self.path)
        c = http.client.HTTPConnection(u.netloc, timeout=10)
        c.request("GET", u.path, headers={k: v for k, v in self.headers.items() if not k.lower().startswith("proxy-")})
        r = c.getresponse()
        body = r.read()
        self.send_response(r.status)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def do_CONNECT(self):
        Proxy.seen.append(("CONNECT", self.path, self.headers.get("Proxy-Authorization")))
        host, port = self.path.rsplit(":", 1)
        up = socket.create_connection((host, int(port)), timeout=10)
        self.send_response(200, "Connection established")
        self.end_headers()
        conns = [self.connection, up]
        while True:
            ready, _, _ = select.select(conns, [], [], 10)
            if not ready:
                break
            for s in ready:
                data = s.recv(1 << 16)
                if not data:
                    up.close()
                    self.close_connection = True
                    return
                (up if s is self.connection else self.connection).sendall(data)


def _serve(handler, wrap=None):
    srv = ThreadingHTTPServer(("127.0.0.1", 0), handler)
    if wrap:
        srv.socket = wrap(srv.socket)
    threading.Thread(target=srv.serve_forever, daemon=True).start()
    return srv


def test_gets_go_through_the_proxy_the_environment_names_as_requests_does(server, tmp_path, monkeypatch):
    """The listing goes through requests, which honours HTTP(S)_PROXY and NO_PROXY: the stager's GETs must take the
    same way out, or a node behind a proxy lists a dataset and then cannot fetch a byte of it."""
    import ssl

    from appliance.store import httpget

    Proxy.seen = []
    proxy = _serve(Proxy)
    purl = f"http://user:p%40ss@127.0.0.1:{proxy.server_address[1]}"
    for var in ("http_proxy", "https_proxy", "no_proxy", "HTTP_PROXY", "HTTPS_PROXY", "NO_PROXY"):
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setenv("HTTP_PROXY", purl)
    monkeypatch.setenv("HTTPS_PROXY", purl)
    httpget._local.__dict__.clear()  # this thread's connections and TLS context, made under other settings
    p = tmp_path / "f"
    fd = os.open(p, os.O_RDWR | os.O_CREAT)
    try:
        # plain http: the proxy is asked for the absolute URL, with the proxy's credentials
        assert get_into(f"{server}/c/o", {"X-Auth-Token": "t"}, fd, 0)[0] == len(BODY)
        assert Proxy.seen == [("GET", f"{server}/c/o", "Basic dXNlcjpwQHNz")]  # user:p@ss
        assert Handler.requests[-1][1]["X-Auth-Token"] == "t"
        # NO_PROXY: straight to the store
        monkeypatch.setenv("NO_PROXY", "127.0.0.1")
        httpget._local.__dict__.clear()
        get_into(f"{server}/c/o", {}, fd, 0)
        assert len(Proxy.seen) == 1
        monkeypatch.delenv("NO_PROXY")
        # https: a CONNECT tunnel; the proxy sees the host and port, never the path or the token
        cert, key = self_signed(tmp_path, "127.0.0.1")
        sctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
        sctx.load_cert_chain(cert, key)
        tls = _serve(Handler, lambda s: sctx.wrap_socket(s, server_side=True))
        monkeypatch.setenv("REQUESTS_CA_BUNDLE", str(cert))
        httpget._local.__dict__.clear()
        target = f"127.0.0.1:{tls.server_address[1]}"
        assert get_into(f"https://{target}/c/o", {"X-Auth-Token": "secret"}, fd, 0)[0] == len(BODY)
        assert Proxy.seen[1:] == [("CONNECT", target, "Basic dXNlcjpwQHNz")]
        assert p.read_bytes() == BODY
        tls.shutdown()
    finally:
        os.close(fd)
        httpget._local.__dict__.clear()
        proxy.shutdown()


def test_the_receive_buffer_stays_in_the_cores_l2_cache(tmp_path):
    """A 1 MiB buffer on a core with 512 KiB of L2 cost the stager 4.21 s of system time for 2 GiB, 512 KiB 2.15 s
    (appliance/store/httpget.py buffer_size): the buffer is the L2 sysfs names, from 256 KiB to 1 MiB."""
    from appliance.store.httpget import _l2_bytes, buffer_size

    for i, (level, size) in enumerate([("1", "32K"), ("1", "32K"), ("2", "512K"), ("3", "32768K")]):
        d = tmp_path / f"index{i}"
        d.mkdir()
        (d / "level").write_text(level + "\n")
        (d / "size").write_text(size + "\n")
    assert _l2_bytes(str(tmp_path)) == 512 << 10
    assert _l2_bytes(str(tmp_path / "none")) is None
    assert buffer_size(512 << 10) == 512 << 10 and buffer_size(2 << 20) == 1 << 20
    assert buffer_size(128 << 10) == 256 << 10 and buffer_size(None) == 512 << 10


RAW_HEADERS = (b"Content-Length: 12\r\nETag: \"abc\"\r\nX-Object-Meta-Note: first\r\n  folded on\r\nx-dup: 1\r\n"
               b"X-Dup: 2\r\nX-Empty:\r\nConnection: keep-alive\r\n\r\n")


def test_headers_are_read_as_http_clients_email_parser_reads_them():
    """Headers (httpget's answers, parsed without the email package: a third of a small GET's CPU) gives what
    http.client's HTTPMessage gives for the same bytes."""
    import io

    want = http.client.parse_headers(io.BytesIO(RAW_HEADERS))
    got = Headers(http.client._read_headers(io.BytesIO(RAW_HEADERS)))
    assert [(k, " ".join(v.split())) for k, v in want.items()] == got.items()  # folding: the same words
    for name in ("content-length", "ETAG", "x-dup", "X-Empty", "missing"):
        assert got.get(name) == want.get(name) and got.get_all(name) == want.get_all(name)
    assert got.get("x-object-meta-note") == "first folded on" and "etag" in got and got.get("nope", 5) == 5


def test_chunked_continued_and_closing_answers_come_whole(tmp_path):
    """The answers http.client's own begin() handled, through ours: a 100 Continue before the answer, a chunked
    body, a HEAD's Content-Length without a body, and Connection: close, all on one kept-alive connection."""
    answers = [b"HTTP/1.1 100 Continue\r\n\r\nHTTP/1.1 200 OK\r\nX-Meta: a\r\nTransfer-Encoding: chunked\r\n\r\n"
               b"5\r\nhello\r\n6\r\n world\r\n0\r\n\r\n",
               b"HTTP/1.1 200 OK\r\nContent-Length: 10\r\n\r\n",
               b"HTTP/1.1 200 OK\r\nContent-Length: 3\r\nConnection: close\r\n\r\nabc"]
    lsock = socket.create_server(("127.0.0.1", 0))
    conns = []

    def serve():
        c, _ = lsock.accept()
        conns.append(c)
        for a in answers:
            got = b""
            while b"\r\n\r\n" not in got:
                got += c.recv(65536)
            c.sendall(a)
        c.recv(1)  # until the client closes

    t = threading.Thread(target=serve, daemon=True)
    t.start()
    url = f"http://127.0.0.1:{lsock.getsockname()[1]}/c/o"
    fd = os.open(tmp_path / "f", os.O_RDWR | os.O_CREAT)
    try:
        n, hdrs = get_into(url, {}, fd, 0)
        assert (n, os.pread(fd, 20, 0), hdrs["x-meta"]) == (11, b"hello world", "a")
        status, hdrs, body = request("HEAD", url, {})
        assert (status, hdrs["content-length"], body) == (200, "10", b"")
        n, _ = get_into(url, {}, fd, 0)
        assert (n, os.pread(fd, 3, 0)) == (3, b"abc")
    finally:
        os.close(fd)
        t.join(10)
        lsock.close()
    assert len(conns) == 1 and not t.is_alive()  # one connection for the three, closed after Connection: close


@pytest.fixture
def tls_server(tmp_path, monkeypatch, request):
    """Handler over https (a certificate made here, trusted through REQUESTS_CA_BUNDLE), as Chameleon's store.
    Python's server context picks the cipher suite by its own order; parametrized (indirect) with "client's order",
    by the client's, as OpenSSL's default and so RGW's beast frontend do."""
    import ssl

    cert, key = self_signed(tmp_path / "tls", "127.0.0.1")
    sctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    sctx.load_cert_chain(cert, key)
    if getattr(request, "param", None) == "client's order":
        sctx.options &= ~ssl.OP_CIPHER_SERVER_PREFERENCE
    monkeypatch.setenv("REQUESTS_CA_BUNDLE", str(cert))
    Handler.mode, Handler.requests = "ok", []
    httpget._local.__dict__.clear()
    srv = _serve(Handler, lambda s: sctx.wrap_socket(s, server_side=True))
    try:
        yield f"https://127.0.0.1:{srv.server_address[1]}"
    finally:
        srv.shutdown()
        httpget._local.__dict__.clear()


def _counting(monkeypatch) -> list[int]:
    """Each call of _tlsread.recv_into (the bytes it returned), through a wrapper."""
    calls: list[int] = []
    real = httpget._tlsread

    class Counted:
        recv_some, send_all, set_ciphersuites, read_ahead = (real.recv_some, real.send_all, real.set_ciphersuites,
                                                             real.read_ahead)

        @staticmethod
        def recv_into(*a):
            calls.append(real.recv_into(*a))
            return calls[-1]

    monkeypatch.setattr(httpget, "_tlsread", Counted)
    return calls


@pytest.mark.skipif(httpget._tlsread is None, reason="appliance/store/_tlsread.c is not built here")
def test_an_https_body_is_read_a_buffer_at_a_time_and_lands_whole(tls_server, tmp_path, monkeypatch):
    """Over https the body comes 16 KiB TLS record by record; _tlsread reads a buffer's worth of them per call with
    the GIL released once (the ssl module took and gave back the GIL per record). The bytes, the sink and the
    kept-alive connection are as over http."""
    calls = _counting(monkeypatch)
    _body_and_a_range(tls_server, tmp_path)
    fd = os.open(tmp_path / "g", os.O_WRONLY | os.O_CREAT)
    try:  # a second whole body on the same connection, after the first was read past http.client
        assert get_into(f"{tls_server}/c/o", {}, fd, 0)[0] == len(BODY)
    finally:
        os.close(fd)
    assert (tmp_path / "g").read_bytes() == BODY
    assert len(Handler.requests) == 3 and len({id(c) for c in httpget._local.conns.values()}) == 1
    # 2 bodies of 3 MiB: a call per buffer (512 KiB, 32 records), not per record (~400 for the two)
    assert 2 <= len(calls) <= 2 * (len(BODY) // httpget.BUF + 2) and sum(calls) > len(BODY)


def _thread_reads() -> int:
    """The read system calls this thread has made (/proc/thread-self/io, syscr): read() on a socket among them."""
    with open("/proc/thread-self/io") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("syscr:"))


@pytest.mark.skipif(httpget._tlsread is None, reason="appliance/store/_tlsread.c is not built here")
def test_an_https_body_is_read_from_the_socket_several_records_a_read(tls_server, tmp_path):
    """OpenSSL without read-ahead makes two read()s of the socket per TLS record, its 5-byte header and then its body:
    262,000 system calls for 2 GiB. With read-ahead (httpget.READ_AHEAD) one read() takes what the socket holds, up
    to two records' worth. The bytes are the same, and the kept-alive connection still serves the next answer."""
    fd = os.open(tmp_path / "f", os.O_WRONLY | os.O_CREAT)
    try:
        assert get_into(f"{tls_server}/c/o", {}, fd, 0)[0] == len(BODY)  # the connection and its handshake
        before = _thread_reads()
        assert get_into(f"{tls_server}/c/o", {}, fd, 0)[0] == len(BODY)
        reads = _thread_reads() - before
        Handler.mode = "small"
        assert request("GET", f"{tls_server}/c/o", {})[2] == BODY[:1000]
    finally:
        os.close(fd)
    assert (tmp_path / "f").read_bytes() == BODY
    assert len({id(c) for c in httpget._local.conns.values()}) == 1
    records = len(BODY) // (16 << 10) + 1  # the server writes them in one go: they wait in the socket for the reader
    assert reads < 1.5 * records, f"{reads} read()s for {records} TLS records"  # 2 a record and more before; ~0.7


@pytest.mark.skipif(httpget._tlsread is None, reason="appliance/store/_tlsread.c is not built here")
@pytest.mark.parametrize("tls_server", ["client's order"], indirect=True)
def test_tls_1_3_offers_aes_128_gcm_first_and_a_server_on_the_clients_order_takes_it(tls_server, tmp_path):
    """OpenSSL's client offers AES-256-GCM first; Go's (s5cmd, rclone) AES-128-GCM, which a server that honours the
    client's order (OpenSSL's default) then uses, and which costs less on both ends (httpget.TLS13_SUITES)."""
    import ssl

    fd = os.open(tmp_path / "f", os.O_RDWR | os.O_CREAT)
    try:
        assert get_into(f"{tls_server}/c/o", {}, fd, 0)[0] == len(BODY)
    finally:
        os.close(fd)
    assert (tmp_path / "f").read_bytes() == BODY
    (conn,) = set(httpget._local.conns.values())
    assert conn.sock.cipher()[:2] == ("TLS_AES_128_GCM_SHA256", "TLSv1.3")
    offered = [c["name"] for c in httpget._ssl_context().get_ciphers() if c["protocol"] == "TLSv1.3"]
    assert offered == httpget.TLS13_SUITES.split(":")
    with pytest.raises(TypeError):  # only an ssl.SSLContext's SSL_CTX is touched
        httpget._tlsread.set_ciphersuites(object(), httpget.TLS13_SUITES)
    with pytest.raises(ValueError):
        httpget._tlsread.set_ciphersuites(ssl.create_default_context(), "TLS_NO_SUCH_SUITE")


def test_an_https_body_without_the_extension_comes_through_the_ssl_module(tls_server, tmp_path, monkeypatch):
    Handler.mode = "small"
    assert request("GET", f"{tls_server}/c/o", {})[2] == BODY[:1000]  # a connection made with the extension there
    Handler.mode = "ok"
    monkeypatch.setattr(httpget, "_tlsread", None)
    fd = os.open(tmp_path / "f", os.O_RDWR | os.O_CREAT)
    try:
        assert get_into(f"{tls_server}/c/o", {}, fd, 0)[0] == len(BODY)  # on it, and then on a new one
        httpget._local.__dict__.clear()
        assert get_into(f"{tls_server}/c/o", {}, fd, 0)[0] == len(BODY)
    finally:
        os.close(fd)
    assert (tmp_path / "f").read_bytes() == BODY


def test_an_https_body_cut_short_is_an_error_that_is_retried(tls_server, tmp_path):
    Handler.mode = "short"
    fd = os.open(tmp_path / "f", os.O_WRONLY | os.O_CREAT)
    try:
        with pytest.raises((http.client.IncompleteRead, OSError)) as e:
            get_into(f"{tls_server}/c/o", {}, fd, 0)
    finally:
        os.close(fd)
    assert _transient(e.value)  # the stager fetches it again


def _times_out(tmp_path, monkeypatch, answer: bytes) -> BaseException:
    """A GET (timeout 0.5 s) from an https server that takes the request, sends ``answer`` and then nothing (it
    holds the connection until the test ends): the TimeoutError it raised."""
    import ssl

    cert, key = self_signed(tmp_path / "tls", "127.0.0.1")
    sctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    sctx.load_cert_chain(cert, key)
    monkeypatch.setenv("REQUESTS_CA_BUNDLE", str(cert))
    httpget._local.__dict__.clear()
    held = threading.Event()
    lsock = socket.create_server(("127.0.0.1", 0))

    def serve():
        c, _ = lsock.accept()
        with sctx.wrap_socket(c, server_side=True) as t:
            while b"\r\n\r\n" not in t.recv(65536):
                pass
            if answer:
                t.sendall(answer)
            held.wait(60)

    th = threading.Thread(target=serve, daemon=True)
    th.start()
    fd = os.open(tmp_path / "f", os.O_WRONLY | os.O_CREAT)
    try:
        with pytest.raises(TimeoutError) as e:
            get_into(f"https://127.0.0.1:{lsock.getsockname()[1]}/c/o", {}, fd, 0, timeout=0.5)
        assert not httpget._local.conns  # the connection was dropped, not kept for the next request
        return e.value
    finally:
        held.set()
        os.close(fd)
        th.join(10)
        lsock.close()
        httpget._local.__dict__.clear()


@pytest.mark.skipif(httpget._tlsread is None, reason="appliance/store/_tlsread.c is not built here")
def test_an_https_body_that_stops_coming_times_out(tmp_path, monkeypatch):
    """The store stops sending mid-body (it holds the rest until the test ends): the read gives up after the
    connection's timeout, as the ssl module's would, rather than waiting for ever."""
    calls = _counting(monkeypatch)
    # all but the last 12,345 bytes: at least one read fills its buffer whatever its size (httpget.BUF, a core's L2:
    # 256 KiB to 1 MiB; a 1 MiB prefix left none full on a machine with 1 MiB of L2), the last waits and times out
    sent = BODY[:3 << 20]
    e = _times_out(tmp_path, monkeypatch, b"HTTP/1.1 200 OK\r\nContent-Length: %d\r\n\r\n" % len(BODY) + sent)
    assert _transient(e) and calls  # it was _tlsread's read that timed out


@pytest.mark.skipif(httpget._tlsread is None, reason="appliance/store/_tlsread.c is not built here")
def test_an_https_request_and_the_wait_for_its_answer_each_cross_into_c_once(tls_server, tmp_path, monkeypatch):
    """The ssl module releases the GIL for every wait on the socket and every record: a request was a poll and a
    write, the wait for an answer's headers a read that found nothing, a poll and a read. Each is one call of
    _tlsread now (send_all, recv_some), the ssl module's read and send not at all; the bytes are as before."""
    import ssl

    real = httpget._tlsread
    calls = {"send_all": 0, "recv_some": 0, "ssl read": 0, "ssl send": 0}

    def counted(name, f):
        def call(*a, **k):
            if not (isinstance(a[0], ssl.SSLSocket) and a[0].server_side):  # the test's server is this process
                calls[name] += 1
            return f(*a, **k)
        return call

    class Counted:
        recv_into, set_ciphersuites, read_ahead = real.recv_into, real.set_ciphersuites, real.read_ahead
        send_all = staticmethod(counted("send_all", real.send_all))
        recv_some = staticmethod(counted("recv_some", real.recv_some))

    monkeypatch.setattr(httpget, "_tlsread", Counted)
    monkeypatch.setattr(ssl.SSLSocket, "read", counted("ssl read", ssl.SSLSocket.read))
    monkeypatch.setattr(ssl.SSLSocket, "send", counted("ssl send", ssl.SSLSocket.send))
    Handler.mode = "small"
    for i in range(3):  # on one kept-alive connection
        assert request("GET", f"{tls_server}/c/o", {})[2] == BODY[:1000]
    assert calls["send_all"] == 3 and 3 <= calls["recv_some"] <= 6  # the headers and the body may come apart
    assert calls["ssl read"] == calls["ssl send"] == 0
    assert len({id(c) for c in httpget._local.conns.values()}) == 1


@pytest.mark.skipif(httpget._tlsread is None, reason="appliance/store/_tlsread.c is not built here")
def test_a_body_is_written_and_hashed_a_full_buffer_at_a_time(tls_server, tmp_path):
    """The sink (hashing, progress) and the pwrite see whole buffers, the last one short: a small object is one
    write and one hash (each a release of the GIL). The first piece used to be what http.client's reader held."""
    pieces: list[int] = []
    fd = os.open(tmp_path / "f", os.O_WRONLY | os.O_CREAT)
    try:
        assert get_into(f"{tls_server}/c/o", {}, fd, 0, lambda v: pieces.append(len(v)))[0] == len(BODY)
        Handler.mode = "small"
        assert get_into(f"{tls_server}/c/o", {}, fd, 0, lambda v: pieces.append(len(v)))[0] == 1000
    finally:
        os.close(fd)
    full, rest = divmod(len(BODY), httpget.BUF)
    assert pieces == [httpget.BUF] * full + [rest] + [1000]


@pytest.mark.skipif(httpget._tlsread is None, reason="appliance/store/_tlsread.c is not built here")
def test_an_https_store_that_never_answers_times_out(tmp_path, monkeypatch):
    """The request is taken and no answer comes: the wait for the headers (recv_some) gives up after the
    connection's timeout, an error the stager retries, as the ssl module's wait did."""
    assert _transient(_times_out(tmp_path, monkeypatch, b""))


def test_direct_writes_leave_the_page_cache_and_give_the_same_bytes(tmp_path):
    """write_at: the whole 4 KiB blocks of a write from an aligned place go past the page cache (O_DIRECT), the
    rest (an unaligned place, a short tail) through it; the file holds every byte where it belongs either way."""
    p = tmp_path / "f"
    size = 8 * (1 << 20) + 5000
    fd = os.open(p, os.O_RDWR | os.O_CREAT)
    os.ftruncate(fd, size)
    direct = httpget.open_direct(p)
    if direct is None:
        pytest.skip(f"{tmp_path}'s file system does not take O_DIRECT")
    data = os.urandom(size)
    buf = httpget._POOL.take()
    try:
        pos = 0
        for n in (len(buf), len(buf), 3000, len(buf), size):  # aligned, aligned, a short one, then unaligned ones
            n = min(n, size - pos, len(buf))
            buf[:n] = data[pos:pos + n]
            httpget.write_at(fd, direct, buf[:n], pos)
            pos += n
        while pos < size:
            n = min(len(buf), size - pos)
            buf[:n] = data[pos:pos + n]
            httpget.write_at(fd, direct, buf[:n], pos)
            pos += n
    finally:
        os.close(direct)
        os.close(fd)
    # the first two buffers went direct: none of their 256 pages is cached (the page cache copies every other)
    assert resident_pages(p) <= (size - 2 * len(buf)) // 4096 + 2
    assert p.read_bytes() == data


def test_a_direct_write_the_file_system_refuses_goes_through_the_page_cache(tmp_path, monkeypatch):
    """A file system that opens with O_DIRECT but refuses a write (EINVAL: here an address not on a page boundary,
    elsewhere a larger block than 4 KiB) gets it, and every later one, through the page cache."""
    monkeypatch.setattr(httpget, "_direct_refused", False)
    p = tmp_path / "f"
    fd = os.open(p, os.O_RDWR | os.O_CREAT)
    direct = httpget.open_direct(p)
    if direct is None:
        pytest.skip(f"{tmp_path}'s file system does not take O_DIRECT")
    data = os.urandom(3 * 8192)
    try:
        httpget.write_at(fd, direct, memoryview(bytearray(b"x" + data))[1:8193], 0)  # one byte past an allocation
        assert httpget._direct_refused
        httpget.write_at(fd, direct, memoryview(data)[8192:], 8192)
    finally:
        os.close(direct)
        os.close(fd)
    assert p.read_bytes() == data


def test_held_buffers_are_written_direct_and_replaced_from_the_pool(server, tmp_path):
    """get_into offers each buffer to ``hold`` before writing it: a piece held goes past the page cache and the
    thread goes on with another buffer, the holder's until it releases it; a piece declined is written through the
    page cache and shown to the sink."""
    p = tmp_path / "f"
    fd = os.open(p, os.O_RDWR | os.O_CREAT)
    os.ftruncate(fd, len(BODY))
    direct = httpget.open_direct(p)
    if direct is None:
        pytest.skip(f"{tmp_path}'s file system does not take O_DIRECT")
    held, seen, bufs, lent = [], bytearray(), set(), httpget._POOL.lent

    def hold(view, lease):
        if len(held) >= 2:  # the first two buffers held, the rest declined
            return False
        lease.share()
        held.append((bytes(view), lease))
        bufs.add(id(lease.buf))
        return True

    try:
        n, _ = get_into(f"{server}/c/o", {}, fd, 0, seen.extend, direct=direct, hold=hold)
    finally:
        os.close(direct)
        os.close(fd)
    assert resident_pages(p) <= (len(BODY) - 2 * httpget.BUF) // 4096 + 2  # before the read below caches them
    assert n == len(BODY) and p.read_bytes() == BODY
    assert b"".join(b for b, _ in held) + bytes(seen) == BODY and len(bufs) == 2
    assert httpget._local.buf.obj is not held[0][1].buf.obj  # the thread went on with a spare
    assert all(lease.refs == 1 for _, lease in held) and httpget._POOL.lent == lent + 2
    free = len(httpget._POOL.free)
    for _, lease in held:
        lease.release()
    assert len(httpget._POOL.free) == free + 2 and httpget._POOL.lent == lent  # back once the holder lets go


def test_a_hold_that_passes_leaves_the_pieces_direct_and_shown_to_the_sink(server, tmp_path):
    """``hold`` answering None: nobody reads the bytes back (the stager's GET whose headers gave a CRC-32, taken as
    the bytes pass): written past the page cache as with no ``hold``, and shown to the sink; nothing stays lent."""
    p = tmp_path / "f"
    fd = os.open(p, os.O_RDWR | os.O_CREAT)
    direct = httpget.open_direct(p)
    if direct is None:
        pytest.skip(f"{tmp_path}'s file system does not take O_DIRECT")
    seen, offered, lent = bytearray(), [], httpget._POOL.lent
    try:
        n, _ = get_into(f"{server}/c/o", {}, fd, 0, seen.extend, direct=direct,
                        hold=lambda view, lease: offered.append(len(view)))
    finally:
        os.close(direct)
        os.close(fd)
    assert resident_pages(p) <= 2  # at most the unaligned tail's page, before the read below caches them
    assert n == len(BODY) and bytes(seen) == BODY == p.read_bytes() and sum(offered) == len(BODY)
    assert httpget._POOL.lent == lent


def test_what_may_be_lent_is_bounded_and_past_it_pieces_go_through_the_page_cache(server, tmp_path, monkeypatch):
    assert httpget.lent_most(64 << 30, 512 << 10) == 512  # 256 MiB
    assert httpget.lent_most(1 << 30, 512 << 10) == 128  # a 16th of 1 GiB
    assert httpget.lent_most(None, 512 << 10) == 128 and httpget.lent_most(1, 512 << 10) == 1
    monkeypatch.setattr(httpget._POOL, "most", httpget._POOL.lent)  # none left to lend
    offered, seen = [], bytearray()
    fd = os.open(tmp_path / "f", os.O_RDWR | os.O_CREAT)
    direct = httpget.open_direct(tmp_path / "f")
    try:
        n, _ = get_into(f"{server}/c/o", {}, fd, 0, seen.extend, direct=direct,
                        hold=lambda view, lease: offered.append(1) or True)
    finally:
        if direct is not None:
            os.close(direct)
        os.close(fd)
    assert n == len(BODY) and not offered and bytes(seen) == BODY == (tmp_path / "f").read_bytes()
