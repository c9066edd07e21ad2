"""The stager's data path (appliance/store/httpget.py on http.client, sigv4.py on botocore's signer): bytes into the
file at their place, failures said in the terms the stager retries on.

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
from appliance.store import httpget
from appliance.store.httpget import HTTPError, get_into, request
from conftest import delayed_acks, http_server
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


def test_a_get_cut_at_its_deadline_is_said_as_such_whatever_the_socket_said_after(monkeypatch):
    """The server that writes on after the cut resets the connection: the read ends on ECONNRESET, not an end of
    file. The rank said "Connection reset by peer" (errors.socket_reason reads the errno in what an error was
    raised from) instead of the deadline, 1 time in ~50 under load."""
    from appliance.errors import socket_reason

    def reset_after_the_cut(url, headers, fd, offset, sink, timeout, on_headers, cut):
        cut.fired = True  # the cut's timer ran, and shut the socket down
        raise ConnectionResetError(104, "Connection reset by peer")

    monkeypatch.setattr(httpget, "_get_into", reset_after_the_cut)
    with pytest.raises(TimeoutError) as e:
        get_into("http://127.0.0.1:9/c/o", {}, 0, 0, deadline=30)
    assert socket_reason(e.value) == "no whole answer within the GET's deadline of 30 s"
    assert _transient(e.value)  # asked again, like a reset


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
    got = Presigner(endpoint, "AK", "SK/x+y", "us-east-1").url("bucket", key)
    assert got == want


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
    parse = lambda u: (u.split("?")[0], sorted(u.split("?")[1].split("&")))  # noqa: E731 (same query, any order)
    want = c.generate_presigned_url("list_objects_v2", Params={"Bucket": "bucket", "Prefix": "dir/ü +&=",
                                                               "ContinuationToken": "1/abc+=="}, ExpiresIn=3600)
    got = p.url("bucket", params={"list-type": "2", "prefix": "dir/ü +&=", "continuation-token": "1/abc+==",
                                  "encoding-type": "url"})
    assert parse(got) == parse(want)
    want = c.generate_presigned_url("head_object", Params={"Bucket": "bucket", "Key": "a b/c", "PartNumber": 3},
                                    ExpiresIn=3600)
    assert parse(p.url("bucket", "a b/c", method="HEAD", params={"partNumber": "3"})) == parse(want)


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
    threading.Thread(target=srv.serve_forever, kwargs={"poll_interval": 0.01}, daemon=True).start()
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
    httpget.reset()  # this thread's connections and TLS context, made under other settings
    p = tmp_path / "f"
    fd = os.open(p, os.O_RDWR | os.O_CREAT)
    try:
        # plain http: the proxy is asked for the absolute URL, with the proxy's credentials
        assert get_into(f"{server}/c/o", {"X-Auth-Token": "t"}, fd, 0)[0] == len(BODY)
        assert Proxy.seen == [("GET", f"{server}/c/o", "Basic dXNlcjpwQHNz")]  # user:p@ss
        assert Handler.requests[-1][1]["X-Auth-Token"] == "t"
        # NO_PROXY: straight to the store
        monkeypatch.setenv("NO_PROXY", "127.0.0.1")
        httpget.reset()
        get_into(f"{server}/c/o", {}, fd, 0)
        assert len(Proxy.seen) == 1
        monkeypatch.delenv("NO_PROXY")
        # https: a CONNECT tunnel; the proxy sees the host and port, never the path or the token
        cert, key = self_signed(tmp_path, "127.0.0.1")
        sctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
        sctx.load_cert_chain(cert, key)
        tls = _serve(Handler, lambda s: sctx.wrap_socket(s, server_side=True))
        monkeypatch.setenv("REQUESTS_CA_BUNDLE", str(cert))
        httpget.reset()
        target = f"127.0.0.1:{tls.server_address[1]}"
        assert get_into(f"https://{target}/c/o", {"X-Auth-Token": "secret"}, fd, 0)[0] == len(BODY)
        assert Proxy.seen[1:] == [("CONNECT", target, "Basic dXNlcjpwQHNz")]
        assert p.read_bytes() == BODY
        tls.shutdown()
    finally:
        os.close(fd)
        httpget.reset()
        proxy.shutdown()


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
    httpget.reset()
    srv = _serve(Handler, lambda s: sctx.wrap_socket(s, server_side=True))
    try:
        yield f"https://127.0.0.1:{srv.server_address[1]}"
    finally:
        srv.shutdown()
        httpget.reset()


def test_an_https_body_lands_whole_and_in_pieces_of_a_chunk(tls_server, tmp_path):
    """Over https, as Chameleon serves its store: the bytes land whole, on a kept-alive connection and on a new one,
    and the sink (hashing, progress) and the pwrite see pieces of CHUNK bytes (each lets go of the GIL), the last
    one short."""
    pieces: list[int] = []
    fd = os.open(tmp_path / "f", os.O_RDWR | os.O_CREAT)
    try:
        assert get_into(f"{tls_server}/c/o", {}, fd, 0, lambda v: pieces.append(len(v)))[0] == len(BODY)
        assert get_into(f"{tls_server}/c/o", {}, fd, 0)[0] == len(BODY)
        httpget.reset()
        assert get_into(f"{tls_server}/c/o", {}, fd, 0)[0] == len(BODY)
    finally:
        os.close(fd)
    assert (tmp_path / "f").read_bytes() == BODY
    full, rest = divmod(len(BODY), httpget.CHUNK)
    assert pieces == [httpget.CHUNK] * full + [rest]


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
    httpget.reset()
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
        return e.value
    finally:
        held.set()
        os.close(fd)
        th.join(10)
        lsock.close()
        httpget.reset()


def test_an_https_body_that_stops_coming_times_out(tmp_path, monkeypatch):
    """The store stops sending mid-body (it holds the rest until the test ends): the read gives up after the
    connection's timeout rather than waiting for ever, an error the stager retries."""
    sent = BODY[:3 << 20]
    e = _times_out(tmp_path, monkeypatch, b"HTTP/1.1 200 OK\r\nContent-Length: %d\r\n\r\n" % len(BODY) + sent)
    assert _transient(e)


def test_an_https_store_that_never_answers_times_out(tmp_path, monkeypatch):
    """The request is taken and no answer comes: the wait for the headers (recv_some) gives up after the
    connection's timeout, an error the stager retries, as the ssl module's wait did."""
    assert _transient(_times_out(tmp_path, monkeypatch, b""))


