"""What a node's stager process costs to start: S3 listings and part HEADs through our own signed requests
(appliance/store/s3.py S3Store._ask), so a stager through S3 never imports boto3 (0.21-0.25 s of CPU on every
node's start: docs/staging.md), and a stager through Swift without python-keystoneclient (0.15 s), which swiftclient
imports for auth this process never uses (appliance/node/stage_main.py).

Fast tier: a fake S3 on 127.0.0.1 that answers as Ceph RGW does (ListObjectsV2 pages of at most ``CAP`` names, names
URL-encoded with ``encoding-type=url`` as ceph src/rgw/rgw_common.cc url_encode writes them, S3 error documents).
The signatures are checked against botocore's in tests/test_httpget.py; the e2e staging tests (tests/test_stage.py)
list through a real Ceph RGW and OpenStack Swift's s3api.
"""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys
from http.server import BaseHTTPRequestHandler
from pathlib import Path
from urllib.parse import parse_qs, quote, unquote, urlsplit

import pytest

from appliance.errors import ApplianceError
from appliance.store import base as store_base
from appliance.store.objects import S3Store, StoreCreds, StoreRefused
from conftest import http_server

ROOT = Path(__file__).resolve().parents[1]
NAMES = ["a b/c+d.bin", "plain", "ü/é&=?.bin", "x%20y", "z/1", "z/2", "z/3"]


class FakeS3(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    objects: dict[str, bytes] = {}
    cap = 3
    fail: list = []  # what the next listing pages answer: (status, body)
    asked: list = []  # every request's method and query
    parts: int | None = None  # x-amz-mp-parts-count of every object (None: RGW 16, which does not answer it)

    def log_message(self, *a):
        pass

    def _answer(self, status, body=b"", headers=()):
        self.send_response(status)
        for k, v in headers:
            self.send_header(k, v)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        if self.command != "HEAD":
            self.wfile.write(body)

    def _where(self):
        u = urlsplit(self.path)
        q = {k: v[0] for k, v in parse_qs(u.query, keep_blank_values=True).items()}
        FakeS3.asked.append((self.command, q))
        assert "X-Amz-Signature" in q and q.get("X-Amz-SignedHeaders") == "host"
        bucket, _, key = u.path.lstrip("/").partition("/")
        return bucket, unquote(key), q

    def do_GET(self):
        bucket, key, q = self._where()
        if not key:
            if FakeS3.fail:
                self._answer(*FakeS3.fail.pop(0))
                return
            assert q["list-type"] == "2" and q["encoding-type"] == "url"
            names = sorted(n for n in FakeS3.objects if n.startswith(q.get("prefix", "")))
            start = int(q.get("continuation-token", "0"))
            page = names[start:start + FakeS3.cap]
            more = start + FakeS3.cap < len(names)
            xml = "".join(f"<Contents><Key>{quote(n, safe='/')}</Key><Size>{len(FakeS3.objects[n])}</Size>"
                          f"<ETag>&quot;{hashlib.md5(FakeS3.objects[n]).hexdigest()}&quot;</ETag></Contents>"
                          for n in page)
            body = ('<?xml version="1.0" encoding="UTF-8"?><ListBucketResult xmlns="http://s3.amazonaws.com/doc/'
                    f'2006-03-01/"><Name>{bucket}</Name><IsTruncated>{str(more).lower()}</IsTruncated>{xml}'
                    + (f"<NextContinuationToken>{start + FakeS3.cap}</NextContinuationToken>" if more else "")
                    + "</ListBucketResult>").encode()
            self._answer(200, body, [("Content-Type", "application/xml")])
            return
        data = FakeS3.objects[key]
        self._answer(200, data, [("ETag", f'"{hashlib.md5(data).hexdigest()}"')])

    def do_HEAD(self):
        _, key, q = self._where()
        data = FakeS3.objects[key]
        k = int(q["partNumber"])
        first, part = (k - 1) * 4, min(4, len(data) - (k - 1) * 4)  # parts of 4 bytes, the last one shorter
        headers = [("Content-Range", f"bytes {first}-{first + part - 1}/{len(data)}")]
        if FakeS3.parts is not None:
            headers.append(("x-amz-mp-parts-count", str(FakeS3.parts)))
        self.send_response(206)
        for h in headers:
            self.send_header(*h)
        self.send_header("Content-Length", str(part))
        self.end_headers()


@pytest.fixture
def s3():
    FakeS3.objects = {n: os.urandom(10 + i) for i, n in enumerate(NAMES)}
    FakeS3.fail, FakeS3.asked, FakeS3.parts, FakeS3.cap = [], [], None, 3
    with http_server(FakeS3) as url:
        yield url


def store(endpoint: str) -> S3Store:
    st = S3Store("data", StoreCreds(s3_endpoint=endpoint, s3_access_key="AK", s3_secret_key="SK"))
    st.list_deadline = 5.0  # a failure that is retried when it should not be ends the test in seconds
    return st


def test_every_page_is_read_and_every_name_decoded(s3):
    got = list(store(s3).list())
    assert [o.name for o in got] == sorted(NAMES)  # 7 names, 3 pages of at most 3
    assert all(o.etag == hashlib.md5(FakeS3.objects[o.name]).hexdigest() and o.size == len(FakeS3.objects[o.name])
               for o in got)
    assert [q.get("continuation-token") for _, q in FakeS3.asked] == [None, "3", "6"]
    assert [o.name for o in store(s3).list("z/")] == ["z/1", "z/2", "z/3"]


def test_a_page_that_fails_transiently_is_asked_again(s3, monkeypatch, virtual_time):
    virtual_time(store_base)  # the backoff, not sat out
    FakeS3.fail = [(503, b"<Error><Code>ServiceUnavailable</Code></Error>"), (500, b"")]
    assert len(list(store(s3).list())) == len(NAMES)
    assert len(FakeS3.asked) == 5  # 2 failures and the 3 pages


@pytest.mark.parametrize("status,body,raised,said", [
    (403, b"<Error><Code>SignatureDoesNotMatch</Code></Error>", StoreRefused, "(SignatureDoesNotMatch)"),
    (403, b"<Error><Code>AccessDenied</Code></Error>", StoreRefused, "(AccessDenied)"),
    (404, b"<Error><Code>NoSuchBucket</Code></Error>", FileNotFoundError, "no such bucket"),
    (200, b"<html><body>Welcome to nginx</body></html>", ApplianceError, "is not one"),
    (400, b"<Error><Code>InvalidArgument</Code></Error>", Exception, "HTTP 400 (InvalidArgument) for GET"),
])
def test_a_refusal_or_a_wrong_answer_is_said_at_once(s3, monkeypatch, status, body, raised, said, virtual_time):
    virtual_time(store_base)  # the backoff, not sat out
    FakeS3.fail = [(status, body)] * 3
    with pytest.raises(raised) as e:
        list(store(s3).list())
    assert said in str(e.value) and len(FakeS3.asked) == 1 and "X-Amz" not in str(e.value)


def test_part_sizes_come_from_the_part_heads(s3):
    FakeS3.objects["mp"] = b"x" * 10  # 3 parts of 4 bytes: 4, 4, 2
    FakeS3.parts = 3
    st = store(s3)
    assert st.part_sizes("mp", 3) == [4, 4, 2]
    assert st.part_sizes("mp", 3, every=True) == [4, 4, 2]  # what each HEAD said
    assert st.part_sizes("mp", 2) is None  # another count: the layout is not this one
    FakeS3.parts = None  # Ceph RGW 16: no count at all, and the store is not asked again
    n = len(FakeS3.asked)
    assert st.part_sizes("mp", 3) is None and st.part_sizes("mp", 3) is None and len(FakeS3.asked) == n + 1


class FakeSwift(BaseHTTPRequestHandler):
    """v1 auth (tempauth, a Ceph RGW Swift user) and a container's JSON listing, marker-paged, of FakeS3.objects."""
    protocol_version = "HTTP/1.1"

    def log_message(self, *a):
        pass

    def do_GET(self):
        u = urlsplit(self.path)
        q = {k: v[0] for k, v in parse_qs(u.query, keep_blank_values=True).items()}
        if u.path == "/auth/v1.0":
            assert self.headers["X-Auth-User"] == "u" and self.headers["X-Auth-Key"] == "k"
            body, hdrs = b"", [("X-Storage-Url", f"http://{self.headers['Host']}/v1/AUTH_t"), ("X-Auth-Token", "t")]
        else:
            assert self.headers["X-Auth-Token"] == "t"
            key = unquote(u.path.split("/", 4)[4]) if u.path.count("/") >= 4 else ""
            if key:
                body = FakeS3.objects[key]
                hdrs = [("ETag", hashlib.md5(body).hexdigest())]
            else:
                names = [n for n in sorted(FakeS3.objects) if n > q.get("marker", "")][:3]
                body = json.dumps([{"name": n, "bytes": len(FakeS3.objects[n]),
                                    "hash": hashlib.md5(FakeS3.objects[n]).hexdigest()} for n in names]).encode()
                hdrs = [("Content-Type", "application/json")]
        self.send_response(200)
        for h in hdrs:
            self.send_header(*h)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)


@pytest.fixture
def swift(s3):
    with http_server(FakeSwift) as url:
        yield url


@pytest.mark.parametrize("scheme", ["s3", "swift"])
def test_the_stager_imports_neither_boto3_nor_keystoneclient(s3, swift, tmp_path, scheme):
    """The node's stager process, as `appliance stage` starts it. Before: its S3 listing went through boto3
    (imported, its client built) on every node, and swiftclient imported python-keystoneclient. It signs S3 URLs
    with botocore's signer (store/sigv4.py), and builds no botocore client."""
    creds = StoreCreds(s3_endpoint=s3, s3_access_key="AK", s3_secret_key="SK") if scheme == "s3" else \
        StoreCreds(auth_url=f"{swift}/auth/v1.0", user="u", key="k")
    job = {"url": f"{scheme}://data/", "dest": str(tmp_path / "d"), "mode": "full", "rank": 0, "nodes": 1,
           "concurrency": 4, "creds": creds.__dict__}
    code = ("import runpy, sys\nsys.argv = ['stage_main']\ntry:\n    runpy.run_module('appliance.node.stage_main', "
            "run_name='__main__')\nexcept SystemExit as e:\n    print('EXIT', e.code, sorted(m for m, v in "
            "sys.modules.items() if v is not None and (m.split('.')[0] in ('boto3', 's3transfer', 'keystoneclient') "
            "or m == 'botocore.client')))\n")
    p = subprocess.run([sys.executable, "-c", code], input=json.dumps(job), capture_output=True, text=True,
                       cwd=ROOT, timeout=120)
    lines = p.stdout.strip().splitlines()
    assert lines[-1] == "EXIT 0 []", p.stdout[-2000:] + p.stderr[-2000:]
    assert any(line.startswith("APPLIANCE_STAGED") for line in lines)
    for n, data in FakeS3.objects.items():
        assert (tmp_path / "d" / n).read_bytes() == data
