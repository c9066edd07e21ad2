"""The stager's data path (appliance/store/httpget.py, sigv4.py): bytes straight into the file, failures said.

Fast tier: a real HTTP server on 127.0.0.1 (http.server) and botocore as the judge of the S3 signature. The e2e
staging tests (tests/test_stage.py) run the same code against OpenStack Swift and Ceph RGW.
"""

from __future__ import annotations

import datetime as dt
import http.client
import os
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from appliance.store.httpget import HTTPError, get_into
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
        body = BODY
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
    srv = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    t = threading.Thread(target=srv.serve_forever, daemon=True)
    t.start()
    yield f"http://127.0.0.1:{srv.server_address[1]}"
    srv.shutdown()
    srv.server_close()


def test_the_body_lands_at_the_offset_and_the_sink_sees_every_byte(server, tmp_path):
    p = tmp_path / "f"
    p.write_bytes(b"\0" * 100)
    seen = bytearray()
    fd = os.open(p, os.O_WRONLY)
    try:
        n, hdrs = get_into(f"{server}/c/o", {}, fd, 100, seen.extend)
        n2, _ = get_into(f"{server}/c/o", {"Range": "bytes=10-19"}, fd, 0, None)  # same connection, kept alive
    finally:
        os.close(fd)
    assert n == len(BODY) and bytes(seen) == BODY and hdrs["x-static-large-object"] == "False"
    assert n2 == 10 and p.read_bytes() == BODY[10:20] + b"\0" * 90 + BODY


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
