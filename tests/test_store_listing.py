"""Listings: every page until an empty one (Ceph RGW answers at most 1,000 names whatever `limit` asks for, and the
old lister stopped at the first short page: staging saw the first 1,000 objects and reported success), and a page
that fails transiently is asked again (issue 14, item 8; issue 12, item 5). A fake Swift here (its listing and
manifest GETs answered at httpget.request, its writes as swiftclient's connection); the real Swift runs in
test_stage.py."""

import hashlib
import json
import os
import threading
from http.server import BaseHTTPRequestHandler
from urllib.parse import parse_qsl, unquote, urlsplit

import pytest
import swiftclient

from appliance.errors import ApplianceError
from appliance.store import base as store_base
from appliance.store import httpget, objects
from appliance.store.httpget import HTTPError
from appliance.store.objects import StoreCreds, SwiftStore

_FAKE: list = [None]  # the fake the last store() made answers its reads


@pytest.fixture(autouse=True)
def swift_reads(monkeypatch):
    """The store's reads (a listing page, an SLO's manifest) go through httpget.request: answered by the fake's
    get_container and get_object as the Swift API answers them (a JSON page; a failure's status)."""
    real = httpget.request

    def request(method, url, headers, **kw):
        conn, u = _FAKE[0], urlsplit(url)
        if u.hostname != "store.invalid":  # a real server's (the tests' own)
            return real(method, url, headers, **kw)
        q = dict(parse_qsl(u.query))
        container, _, name = unquote(u.path).split("/AUTH_x/", 1)[1].partition("/")
        try:
            if "multipart-manifest" in q:
                hdrs, body = conn.get_object(container, name, query_string="multipart-manifest=get")
                return 200, hdrs, body
            _, page = conn.get_container(container, prefix=q.get("prefix"), marker=q.get("marker"),
                                         limit=int(q["limit"]))
        except swiftclient.ClientException as e:
            return e.http_status, {}, b""
        return 200, {}, json.dumps(page).encode()

    monkeypatch.setattr(httpget, "request", request)


class FakeConn:
    """get_container as RGW answers it: at most ``cap`` names a page, marker-paged; ``fail`` is a list of
    statuses the next calls answer with (None: a connection reset)."""

    def __init__(self, names, cap=1000, fail=()):
        self.names, self.cap, self.fail, self.calls = sorted(names), cap, list(fail), 0

    def get_container(self, container, prefix=None, marker=None, limit=None):
        self.calls += 1
        if self.fail:
            status = self.fail.pop(0)
            if status is None:
                raise ConnectionResetError("reset by peer")
            raise swiftclient.ClientException("boom", http_status=status)
        rest = [n for n in self.names if (not marker or n > marker) and n.startswith(prefix or "")]
        return {}, [{"name": n, "bytes": 1, "hash": "9dd4e461268c8034f5c8564e155c67a6"} for n in rest[:min(limit,
                                                                                                             self.cap)]]


def store(conn):
    class S(SwiftStore):
        def conn(self):
            return conn

        def head(self, name):  # the fake's HEAD (the store's own asks on httpget's connection: tests below)
            return {k.lower(): v for k, v in conn.head_object(self.container, name).items()}

        def _reset(self):
            pass

    _FAKE[0] = conn
    return S("c", StoreCreds(storage_url="http://store.invalid/v1/AUTH_x", token="t"))


def test_rgw_pages_of_1000_are_all_read():
    names = [f"obj-{i:05d}" for i in range(2500)]
    assert [o.name for o in store(FakeConn(names)).list()] == names


def test_transient_failures_of_a_page_are_retried(monkeypatch, virtual_time):
    virtual_time(store_base)  # the backoff, not sat out
    conn = FakeConn([f"o{i}" for i in range(5)], fail=[503, None, 500])
    assert len(list(store(conn).list())) == 5 and conn.calls == 5  # 3 failures, a page, the empty page


def test_a_refusal_is_not_retried(monkeypatch, virtual_time):
    virtual_time(store_base)  # the backoff, not sat out
    conn = FakeConn(["a"], fail=[403])
    with pytest.raises(ApplianceError, match="refused access"):
        list(store(conn).list())
    assert conn.calls == 1


def test_a_certificate_this_machine_does_not_trust_is_not_retried_and_is_said_as_such(monkeypatch, virtual_time):
    """An https store (Chameleon's are) whose certificate no CA bundle here vouches for: the page was asked again
    for 2 minutes, then said as "cannot reach the object store ... check the network". Now one try, and the line
    says what failed and how to trust it. The texts are those ssl (the stager's requests) and requests (swiftclient's
    writes) raise; tests/test_stage_https.py meets them from a real RGW over https."""
    import ssl

    import requests

    clock = virtual_time(store_base)
    verify = ssl.SSLCertVerificationError(1, "[SSL: CERTIFICATE_VERIFY_FAILED] certificate verify failed: "
                                             "self-signed certificate (_ssl.c:1006)")
    wrapped = requests.exceptions.SSLError(
        "HTTPSConnectionPool(host='127.0.0.1', port=7480): Max retries exceeded with url: /auth/v1.0 (Caused by "
        f"SSLError({verify!r}))")

    class Conn(FakeConn):
        def get_container(self, *a, **kw):
            self.calls += 1
            raise verify

    conn = Conn(["a"])
    st = store(conn)
    with pytest.raises(ssl.SSLCertVerificationError):
        list(st.list())
    assert conn.calls == 1 and clock.slept == 0  # not asked again
    for err in (wrapped, verify):
        said = objects.unreachable(st, err)
        assert said.message == ("the object store at http://store.invalid/v1/AUTH_x sent a certificate this machine "
                                "does not trust (self-signed certificate)")
        assert "REQUESTS_CA_BUNDLE" in said.fix
    assert "cannot reach" in objects.unreachable(st, ConnectionRefusedError(111, "Connection refused")).message


def test_retries_stop_at_the_deadline(monkeypatch):
    monkeypatch.setattr(store_base, "LIST_DEADLINE", 0.0)
    conn = FakeConn(["a"], fail=[503] * 100)
    with pytest.raises(HTTPError, match="HTTP 503"):
        list(store(conn).list())


def test_nodes_get_only_the_credentials_their_url_uses():
    """Issue 12 item 2: the S3 secret used to travel to the nodes (and sit on the head's disk) for swift:// jobs."""
    from appliance.store.objects import StoreCreds

    both = StoreCreds(storage_url="http://swift/v1/AUTH_p", token="tok", s3_endpoint="http://rgw:7480",
                      s3_access_key="AK", s3_secret_key="SECRET")
    sw = both.scoped("swift://ckpts/")
    assert sw.token == "tok" and sw.s3_secret_key is None and sw.s3_access_key is None
    s3 = both.scoped("s3://ckpts/")
    assert s3.s3_secret_key == "SECRET" and s3.token is None and s3.storage_url is None
    assert both.scoped().s3_secret_key == "SECRET"  # no URL: unchanged


class RGWConn(FakeConn):
    """An SLO as Ceph RGW shows it (measured on radosgw 16): listed with the MD5 of nothing and the manifest's
    length, the manifest GET answered with an empty body; its segments in CONTAINER_segments."""

    segs = [{"name": "big/3000/1000/0000000%d" % i, "bytes": b, "hash": h}
            for i, (b, h) in enumerate([(1000, "a" * 32), (1000, "b" * 32), (1000, "c" * 32)])]
    etag = objects.slo_etag(segs)

    def __init__(self):
        super().__init__([])
        self.gets = []

    def get_container(self, container, prefix=None, marker=None, limit=None):
        if marker:
            return {}, []
        if container == "c_segments":
            return {}, [s for s in self.segs if s["name"].startswith(prefix or "")]
        return {}, [{"name": "big", "bytes": 374, "hash": objects.EMPTY_MD5},
                    {"name": "plain", "bytes": 5, "hash": "5d41402abc4b2a76b9719d911017c592"}]

    def head_object(self, container, name):
        if name == "big":
            return {"Content-Length": "3000", "ETag": f'"{self.etag}"', "X-Static-Large-Object": "True"}
        return {"Content-Length": "5", "ETag": "5d41402abc4b2a76b9719d911017c592"}

    def get_object(self, container, name, query_string=None, **kw):
        self.gets.append((name, query_string))
        return {"x-object-meta-static-large-object": "True"}, b""


def test_an_rgw_slo_is_listed_with_its_real_size_and_etag_and_its_segments_found():
    conn = RGWConn()
    st = store(conn)
    listed = {o.name: (o.size, o.etag) for o in st.list()}
    assert listed == {"big": (3000, RGWConn.etag), "plain": (5, "5d41402abc4b2a76b9719d911017c592")}
    assert st.slo_segments("big") == [{"bytes": s["bytes"], "hash": s["hash"]} for s in RGWConn.segs]


def test_a_plain_object_is_never_read_whole_to_look_for_a_manifest():
    """Real Swift ignores ?multipart-manifest=get on a plain object and sends the whole body: HEAD first."""
    conn = RGWConn()
    assert store(conn).slo_segments("plain") is None and conn.gets == []


def test_segments_that_do_not_add_up_to_the_etag_are_not_trusted():
    conn = RGWConn()
    conn.etag = "0" * 32
    assert store(conn).slo_segments("big") == []


def test_a_put_refused_mid_request_is_sent_again_from_the_start(tmp_path):
    """A token that expires during a PUT: swiftclient (retries=0) renews it but cannot rewind a file body and raises
    "... no ability to reset contents for reupload"; the store sends the file again, from its first byte."""
    class PutConn(FakeConn):
        def __init__(self):
            super().__init__([])
            self.bodies = []

        def put_object(self, container, name, body, **kw):
            self.bodies.append(body.read())
            if len(self.bodies) == 1:
                raise swiftclient.ClientException("put_object('c', 'x', ...) failure and no ability to reset "
                                                  "contents for reupload.")
            return hashlib.md5(self.bodies[-1]).hexdigest()  # as a store answers: the MD5 of what arrived

    f = tmp_path / "x"
    f.write_bytes(b"0123456789")
    conn = PutConn()
    assert store(conn).put("x", f) == hashlib.md5(b"0123456789").hexdigest()
    assert conn.bodies == [b"0123456789", b"0123456789"]


class SegConn(FakeConn):
    """put_object as a store answers it: the ETag is the MD5 of the bytes received (``flip``: the segment names
    whose bytes arrive changed). Records the calls and how many ran at once."""

    def __init__(self, flip=()):
        super().__init__([])
        import threading

        self.flip, self.puts, self.lock, self.now, self.most = set(flip), [], threading.Lock(), 0, 0
        self.all_in = threading.Barrier(3, timeout=10)  # the 3 segments of the test are in flight together

    def put_container(self, c):
        pass

    def put_object(self, container, name, body, query_string=None, etag=None, **kw):
        import swiftclient

        data = body.encode() if isinstance(body, str) else body.read()
        if query_string is None:
            with self.lock:
                self.now += 1
                self.most = max(self.most, self.now)
            self.all_in.wait()  # only when the segments go up in parallel do all three get here
            with self.lock:
                self.now -= 1
        if name in self.flip:
            data = b"X" + data[1:]
        if etag is not None and hashlib.md5(data).hexdigest() != etag:  # refused, not stored (swift/obj/server.py)
            raise swiftclient.ClientException("Unprocessable Entity", http_status=422)
        self.puts.append((container, name, query_string, data))
        return hashlib.md5(data).hexdigest()


def test_segments_go_up_in_parallel_and_are_checked_against_the_md5s_computed_before(tmp_path):
    f = tmp_path / "state.data"
    f.write_bytes(bytes(range(256)) * 12)  # 3,072 bytes: 3 segments of 1,024
    md5s = objects.large_object_etags(f, 1024)
    conn = SegConn()
    store(conn).put("ck/state.data", f, segment_size=1024, md5s=md5s)
    assert conn.most == 3
    manifest = [p for p in conn.puts if p[2] == "multipart-manifest=put"]
    assert len(manifest) == 1 and conn.puts[-1] is manifest[0]  # the manifest last, once every segment is in
    import json

    assert [s["etag"] for s in json.loads(manifest[0][3])] == md5s["parts"]


def test_a_segment_that_arrives_changed_fails_the_upload_and_no_manifest_is_written(tmp_path):
    f = tmp_path / "state.data"
    f.write_bytes(bytes(range(256)) * 12)
    md5s = objects.large_object_etags(f, 1024)
    conn = SegConn(flip={"ck/state.data/3072/1024/00000001"})
    with pytest.raises(ApplianceError, match="segment 1 of ck/state.data did not arrive as the file's bytes: the "
                                             "store refused them"):
        store(conn).put("ck/state.data", f, segment_size=1024, md5s=md5s)
    assert not [p for p in conn.puts if p[2] == "multipart-manifest=put"]


@pytest.mark.parametrize("size", [0, 1, 1023, 1024, 1025, 3072, 5000])
def test_large_object_etags_are_the_md5s_a_store_reports(tmp_path, size):
    """The whole file's MD5 and the parts' (two threads), and the SLO and S3 multipart ETags made of the parts."""
    import hashlib
    import os

    f = tmp_path / "f"
    data = os.urandom(size)
    f.write_bytes(data)
    parts = [hashlib.md5(data[o:o + 1024]) for o in range(0, size, 1024)]
    e = objects.large_object_etags(f, 1024)
    assert e["md5"] == hashlib.md5(data).hexdigest() and e["parts"] == [m.hexdigest() for m in parts]
    if size > 1024:
        assert e["swift"] == hashlib.md5("".join(m.hexdigest() for m in parts).encode()).hexdigest()
        assert e["s3"] == hashlib.md5(b"".join(m.digest() for m in parts)).hexdigest() + f"-{len(parts)}"
    else:
        assert "swift" not in e and "s3" not in e


def test_a_checkpoint_file_goes_up_in_parts_of_128_mib_and_never_in_more_than_1000(tmp_path, monkeypatch):
    from appliance.store.checkpoints import CheckpointStore

    monkeypatch.delenv("APPLIANCE_SEGMENT_BYTES", raising=False)
    cs = CheckpointStore(f"file://{tmp_path}/", "r", None)
    mib128 = 128 * 1024**2
    assert cs.segment_for(1) == cs.segment_for(1000 * mib128) == mib128
    big = 1000 * mib128 + 1  # a 125 GiB file: 1,001 parts of 128 MiB would be refused by Swift and RGW
    assert cs.segment_for(big) * 1000 >= big and -(-big // cs.segment_for(big)) == 1000


def test_s3_listings_leave_timestamps_unparsed():
    """botocore parsed every listed object's LastModified with dateutil: 60% of an S3 listing's CPU (0.126 -> 0.050
    ms per object against the real RGW). The stager never reads it, so the client keeps the store's string."""
    from appliance.store.objects import S3Store, StoreCreds

    client = S3Store("b", StoreCreds(s3_endpoint="http://127.0.0.1:9", s3_access_key="a", s3_secret_key="s")).client()
    body = (b'<?xml version="1.0" encoding="UTF-8"?><ListBucketResult xmlns="http://s3.amazonaws.com/doc/2006-03-01/">'
            b"<Name>b</Name><KeyCount>1</KeyCount><IsTruncated>false</IsTruncated><Contents><Key>k</Key>"
            b"<LastModified>2026-11-24T17:00:00.000Z</LastModified><ETag>&quot;abc&quot;</ETag><Size>3</Size>"
            b"</Contents></ListBucketResult>")
    shape = client.meta.service_model.operation_model("ListObjectsV2").output_shape
    parser = client._endpoint._response_parser_factory.create_parser("rest-xml")  # what the endpoint parses with
    parsed = parser.parse({"status_code": 200, "headers": {}, "body": body}, shape)
    assert parsed["Contents"][0]["LastModified"] == "2026-11-24T17:00:00.000Z"
    assert parsed["Contents"][0]["Size"] == 3 and parsed["Contents"][0]["Key"] == "k"


def test_an_s3_bucket_name_another_project_holds_is_said_with_the_fix():
    """A Ceph RGW without tenants (Chameleon's) shares bucket names among all projects: HEAD answers 403 for a
    bucket someone else owns, PUT 409 BucketAlreadyExists for one made meanwhile. Both end in one line with the fix;
    a bucket of ours made meanwhile (BucketAlreadyOwnedByYou) is fine. (botocore's Stubber answers as the store.)"""
    from botocore.stub import Stubber

    from appliance.store.objects import S3Store, StoreCreds

    def store():
        st = S3Store("shared", StoreCreds(s3_endpoint="http://127.0.0.1:9", s3_access_key="a", s3_secret_key="s"))
        return st, Stubber(st.client())

    st, stub = store()
    stub.add_client_error("head_bucket", service_error_code="403", http_status_code=403)
    stub.add_response("list_buckets", {"Buckets": []})  # our keys are good: the bucket is someone else's
    with stub, pytest.raises(ApplianceError, match="belongs to someone else.*choose another bucket name"):
        st.ensure_container()
    st, stub = store()  # keys the store does not take: HEAD says 403 as well, the listing of our buckets says why
    stub.add_client_error("head_bucket", service_error_code="403", http_status_code=403)
    stub.add_client_error("list_buckets", service_error_code="InvalidAccessKeyId", http_status_code=403)
    with stub, pytest.raises(ApplianceError, match=r"S3 refused the keys \(InvalidAccessKeyId\).*check the EC2 keys"):
        st.ensure_container()
    st, stub = store()
    stub.add_client_error("head_bucket", service_error_code="404", http_status_code=404)
    stub.add_client_error("create_bucket", service_error_code="BucketAlreadyExists", http_status_code=409)
    with stub, pytest.raises(ApplianceError, match="belongs to someone else"):
        st.ensure_container()
    st, stub = store()
    stub.add_client_error("head_bucket", service_error_code="404", http_status_code=404)
    stub.add_client_error("create_bucket", service_error_code="BucketAlreadyOwnedByYou", http_status_code=409)
    with stub:
        st.ensure_container()


def test_s3_uploads_send_no_checksum_of_botocores_own():
    """botocore 1.36+ adds a CRC32 to every PutObject and UploadPart by default: 0.6 s of CPU per 1.6 GB uploaded
    (make bench-stage STORE=rgw, upload rows), and headers (aws-chunked trailers over HTTPS) that RGWs before Squid do
    not know. Our uploads are checked by MD5 against the store's ETag, so the client sends none."""
    from botocore.awsrequest import AWSResponse

    from appliance.store.objects import S3Store, StoreCreds

    client = S3Store("b", StoreCreds(s3_endpoint="http://127.0.0.1:9", s3_access_key="a", s3_secret_key="s")).client()
    sent = []

    class Raw:
        def stream(self, **kw):
            return iter([b""])

    def answer(request, **kw):  # the request as it would go on the wire; the store's answer, made up
        sent.append({k.lower(): v for k, v in request.headers.items()})
        return AWSResponse(request.url, 200, {"ETag": '"0"'}, Raw())

    client.meta.events.register("before-send.s3.*", answer)
    client.put_object(Bucket="b", Key="k", Body=b"data")
    client.upload_part(Bucket="b", Key="k", UploadId="u", PartNumber=1, Body=b"data")
    assert len(sent) == 2
    for headers in sent:
        assert not [k for k in headers if k.startswith("x-amz-checksum") or k == "x-amz-sdk-checksum-algorithm"]
        assert "aws-chunked" not in str(headers.get("content-encoding", ""))


def test_s3_uploads_send_each_parts_md5_and_complete_only_when_all_arrived_as_sent(tmp_path):
    """The store checks each PUT's bytes against its Content-MD5 (one PUT, and each part of a multipart upload). A
    part the store took as other bytes (here: answered with another ETag) aborts the upload instead of completing
    it, so the key keeps what it held; before, s3transfer completed it and nothing checked the ETag (`data upload`,
    `data pack`). The requests as they would go on the wire; the store's answers made up (real stores:
    tests/test_stage.py::test_an_upload_that_arrives_as_other_bytes_is_refused_and_keeps_what_was_there)."""
    import base64
    import threading

    from botocore.awsrequest import AWSResponse

    from appliance.store.objects import S3Store, StoreCreds
    from appliance.store.parts import MiB

    st = S3Store("b", StoreCreds(s3_endpoint="http://127.0.0.1:9", s3_access_key="a", s3_secret_key="s"))
    sent, lock, flip, signed = [], threading.Lock(), set(), set()

    class Raw:
        def __init__(self, body):
            self.body = body

        def stream(self, **kw):
            return iter([self.body])

    def answer(request, **kw):
        q = request.url.split("?", 1)[1] if "?" in request.url else ""
        body = request.body.read() if hasattr(request.body, "read") else (request.body or b"")
        with lock:
            sent.append((request.method, q, request.headers.get("Content-MD5"), hashlib.md5(body).digest()))
            signed.add(request.headers.get("X-Amz-Content-SHA256"))
        etag = '"' + hashlib.md5(body).hexdigest() + ('x' if "partNumber=2" in q and flip else "") + '"'
        if request.method == "POST" and q.startswith("uploads"):
            xml = b"<InitiateMultipartUploadResult><UploadId>u</UploadId></InitiateMultipartUploadResult>"
            return AWSResponse(request.url, 200, {}, Raw(xml))
        if request.method == "POST":  # complete: the ETag of the parts the store took (store/s3.py)
            got = sorted((int(q.split("partNumber=")[1].split("&")[0]), d) for _, q, _, d in sent if "partNumber" in q)
            e = hashlib.md5(b"".join(d for _, d in got)).hexdigest() + f"-{len(got)}"
            xml = f"<CompleteMultipartUploadResult><ETag>&quot;{e}&quot;</ETag></CompleteMultipartUploadResult>"
            return AWSResponse(request.url, 200, {}, Raw(xml.encode()))
        return AWSResponse(request.url, 204 if request.method == "DELETE" else 200, {"ETag": etag}, Raw(b""))

    st.client().meta.events.register("before-send.s3.*", answer)
    f = tmp_path / "f"
    f.write_bytes(os.urandom(1000))
    st.put("one", f, segment_size=5 * MiB)
    assert [(m, base64.b64decode(md5) == digest) for m, q, md5, digest in sent] == [("PUT", True)]
    f.write_bytes(os.urandom(12 * MiB + 5))
    sent.clear()
    assert st.put("mp", f, segment_size=5 * MiB) == objects.large_object_etags(f, 5 * MiB)["s3"]
    parts = [x for x in sent if "partNumber" in x[1]]
    assert len(parts) == 3 and all(base64.b64decode(md5) == digest for _, _, md5, digest in parts)
    flip.add(1)
    sent.clear()
    with pytest.raises(ApplianceError, match="part 2 of mp did not arrive as the file's bytes"):
        st.put("mp", f, segment_size=5 * MiB)
    assert [m for m, q, *_ in sent if "partNumber" not in q] == ["POST", "DELETE"]  # started, aborted; never completed
    # no SHA-256 of the bytes over http (botocore's default there; over https it leaves it out itself for a PUT with
    # Content-MD5): 0.5 s of CPU per 768 MiB
    assert signed == {b"UNSIGNED-PAYLOAD"}, signed  # the header as botocore sends it
    flip.clear(), sent.clear()  # MD5s a caller made for parts S3 does not take (under 5 MiB): made again for ours
    small = objects.large_object_etags(f, 1 * MiB)
    assert st.put("mp", f, segment_size=1 * MiB, md5s=small) == objects.large_object_etags(f, 5 * MiB)["s3"]


class V1Swift(BaseHTTPRequestHandler):
    """Swift's v1 auth (tempauth, or Ceph RGW's Swift users: GET /auth/v1.0 with X-Auth-User and X-Auth-Key, the
    token and storage URL in X-Auth-Token and X-Storage-Url), Keystone's application credential tokens (POST
    /v3/auth/tokens: the token in X-Subject-Token, the store in the catalog, one endpoint per region), and objects
    and a container listing (GET /v1/AUTH_t/c?format=json, marker-paged) that take only the current token."""

    protocol_version = "HTTP/1.1"
    auths: list = []
    token = "tk0"
    ports: list = []  # the client port of each object request: which connection it came on
    names = ["a", "b"]

    def do_POST(self):
        if self.path != "/v3/auth/tokens":
            return self._answer(404)
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        ident = body["auth"]["identity"]
        if ident["methods"] != ["application_credential"] or ident["application_credential"] != {"id": "ac",
                                                                                                 "secret": "s"}:
            return self._answer(401)
        V1Swift.auths.append(V1Swift.token)
        host = self.headers["Host"]
        catalog = [{"type": "identity", "endpoints": [{"interface": "public", "region_id": "CHI@fake",
                                                       "url": f"http://{host}/v3"}]},
                   {"type": "object-store", "endpoints": [
                       {"interface": "public", "region_id": "CHI@other", "url": "http://other.invalid/v1/AUTH_t"},
                       {"interface": "internal", "region_id": "CHI@fake", "url": "http://internal.invalid/v1/AUTH_t"},
                       {"interface": "public", "region_id": "CHI@fake", "url": f"http://{host}/v1/AUTH_t"}]}]
        answer = json.dumps({"token": {"methods": ["application_credential"], "catalog": catalog,
                                       "expires_at": "2099-01-01T00:00:00.000000Z"}}).encode()
        return self._answer(201, answer, **{"X-Subject-Token": V1Swift.token, "Content-Type": "application/json"})

    def log_message(self, *a):
        pass

    def _answer(self, status: int, body: bytes = b"", **headers) -> None:
        self.send_response(status)
        for k, v in {"Content-Length": str(len(body)), **headers}.items():
            self.send_header(k, v)
        self.end_headers()
        self.wfile.write(body)

    def do_GET(self):
        if self.path == "/auth/v1.0":
            if (self.headers.get("X-Auth-User"), self.headers.get("X-Auth-Key")) != ("u:t", "k"):
                return self._answer(401)
            V1Swift.auths.append(V1Swift.token)
            return self._answer(200, **{"X-Auth-Token": V1Swift.token,
                                        "X-Storage-Url": f"http://{self.headers['Host']}/v1/AUTH_t"})
        V1Swift.ports.append(self.client_address[1])
        if self.headers.get("X-Auth-Token") != V1Swift.token:
            return self._answer(401)
        path, _, query = self.path.partition("?")
        if path == "/v1/AUTH_t/c":
            q = dict(parse_qsl(query))
            assert q["format"] == "json"
            page = [{"name": n, "bytes": len(f"/v1/AUTH_t/c/{n}"), "hash": hashlib.md5(f"/v1/AUTH_t/c/{n}".encode())
                     .hexdigest()} for n in V1Swift.names if n > q.get("marker", "")][:int(q["limit"])]
            return self._answer(200, json.dumps(page).encode(), **{"Content-Type": "application/json"})
        return self._answer(200, self.path.encode())

    def do_HEAD(self):
        V1Swift.ports.append(self.client_address[1])
        if self.headers.get("X-Auth-Token") != V1Swift.token:
            return self._answer(401)
        if self.path.endswith("/missing"):
            self.send_response(404)
            self.send_header("Content-Length", "0")
            self.end_headers()
            return
        self.send_response(200)
        self.send_header("Content-Length", "7")
        self.send_header("X-Object-Meta-Color", "blue")
        self.end_headers()


def test_a_stagers_threads_share_one_v1_token_and_one_new_one_when_it_expires(tmp_path):
    """Each of a stager's threads asked v1 auth for a token of its own, on a connection of its own: 17 token
    requests at the start of an 8-object staging at 32 transfers (bench/results/stage-swift-token). One thread asks;
    the others take its token, and when the store refuses it, the threads that were refused get one new one."""
    from conftest import http_server

    V1Swift.auths, V1Swift.token = [], "tk0"
    with http_server(V1Swift) as url:
        st = SwiftStore("c", StoreCreds(auth_url=f"{url}/auth/v1.0", user="u:t", key="k"))
        fd = os.open(tmp_path / "f", os.O_WRONLY | os.O_CREAT)
        gate = threading.Barrier(8)
        got = []

        def fetch(i):
            gate.wait()  # all eight threads want a token at once
            got.append(st.fetch(f"o{i}", fd, 0)[0])

        try:
            for expired in (False, True):
                if expired:
                    V1Swift.token = "tk1"  # the store no longer takes tk0
                threads = [threading.Thread(target=fetch, args=(i,)) for i in range(8)]
                for t in threads:
                    t.start()
                for t in threads:
                    t.join()
        finally:
            os.close(fd)
    assert len(got) == 16 and all(n > 0 for n in got)
    assert V1Swift.auths == ["tk0", "tk1"]


def test_a_head_goes_on_the_connection_the_threads_gets_use(tmp_path):
    """The staging of a large object HEADs it (its CRC-32, an SLO?) before its GET. Through swiftclient each thread
    opened a connection of its own for that, a TLS handshake more per thread on an https store; on httpget's kept-alive
    connection, the one its GETs use, there is none. A refused token is renewed for a HEAD as for a GET."""
    from conftest import http_server

    V1Swift.auths, V1Swift.token, V1Swift.ports = [], "tk0", []
    with http_server(V1Swift) as url:
        st = SwiftStore("c", StoreCreds(auth_url=f"{url}/auth/v1.0", user="u:t", key="k"))
        fd = os.open(tmp_path / "f", os.O_WRONLY | os.O_CREAT)
        try:
            st.fetch("a", fd, 0)
            assert st.head("a")["x-object-meta-color"] == "blue"
            V1Swift.token = "tk1"
            assert st.head("b")["content-length"] == "7"
            st.fetch("b", fd, 0)
            with pytest.raises(FileNotFoundError):
                st.head("missing")
        finally:
            os.close(fd)
    assert len(V1Swift.ports) == 6 and len(set(V1Swift.ports)) == 1, V1Swift.ports  # b's first HEAD: a 401
    assert V1Swift.auths == ["tk0", "tk1"]


_READS = """
import json, os, sys
from appliance.store.objects import StoreCreds, SwiftStore
url, how, dest = sys.argv[1:]
creds = StoreCreds(auth_url=url + "/auth/v1.0", user="u:t", key="k") if how == "v1" else \
    StoreCreds(keystone_url=url + "/v3", app_cred_id="ac", app_cred_secret="s", region="CHI@fake")
st = SwiftStore("c", creds)
listed = [(o.name, o.size, o.etag) for o in st.list()]
fd = os.open(dest, os.O_WRONLY | os.O_CREAT)
got = [st.fetch(name, fd, 0)[0] for name, _, _ in listed]
print(json.dumps({"listed": listed, "got": got, "head": st.head("a")["content-length"],
                  "loaded": sorted(m for m in ("swiftclient", "keystoneauth1", "requests")
                                   if m in sys.modules)}))
"""


@pytest.mark.parametrize("how", ["v1", "keystone"])
def test_a_stagers_reads_and_their_token_import_neither_swiftclient_nor_requests(tmp_path, how):
    """A stager's reads (the listing, HEADs, GETs) and their token, from v1 auth or from Keystone with an
    application credential (what Chameleon's nodes get), go through httpget's connections. Through swiftclient the
    listing and the token imported swiftclient, requests and urllib3, and keystoneauth1 for a credential (0.15 s of
    CPU per staging on the Keystone path: bench/results/stage-swift-auth). The token comes from the catalog's
    public object-store endpoint in the credential's region, and a refused one is renewed."""
    import subprocess
    import sys
    from pathlib import Path

    from conftest import http_server

    root = Path(__file__).resolve().parents[1]
    V1Swift.auths, V1Swift.token, V1Swift.ports, V1Swift.names = [], "tk0", [], ["a", "b", "c"]
    with http_server(V1Swift) as url:
        p = subprocess.run([sys.executable, "-c", _READS, url, how, str(tmp_path / "f")], capture_output=True,
                           text=True, timeout=120, env={**os.environ, "PYTHONPATH": str(root)})
        assert p.returncode == 0, p.stderr[-2000:]
        got = json.loads(p.stdout)
        assert [n for n, _, _ in got["listed"]] == ["a", "b", "c"] and got["got"] == [14, 14, 14]
        assert got["head"] == "7" and got["loaded"] == [] and V1Swift.auths == ["tk0"]
        # in this process: a token the store refuses is renewed once, from the same source
        creds = StoreCreds(auth_url=url + "/auth/v1.0", user="u:t", key="k") if how == "v1" else \
            StoreCreds(keystone_url=url + "/v3", app_cred_id="ac", app_cred_secret="s", region="CHI@fake")
        st = SwiftStore("c", creds)
        assert [o.name for o in st.list()] == ["a", "b", "c"]
        V1Swift.token = "tk1"
        assert [o.name for o in st.list()] == ["a", "b", "c"] and V1Swift.auths == ["tk0", "tk0", "tk1"]


def test_keystones_catalog_gives_the_public_object_store_of_the_region():
    from appliance.store import swiftauth

    cat = [{"type": "identity", "endpoints": [{"interface": "public", "region_id": "R", "url": "http://id"}]},
           {"type": "object-store", "endpoints": [
               {"interface": "admin", "region_id": "R", "url": "http://admin"},
               {"interface": "public", "region": "Q", "url": "http://q"},
               {"interface": "public", "region_id": "R", "url": "http://r"}]}]
    assert swiftauth.object_store(cat, "R") == "http://r" and swiftauth.object_store(cat, "Q") == "http://q"
    assert swiftauth.object_store(cat, None) == "http://q" and swiftauth.object_store(cat, "S") is None
    assert swiftauth.fresh(None) and swiftauth.fresh(1000.0, now=900.0) and not swiftauth.fresh(1000.0, now=990.0)


def test_a_token_given_and_refused_is_not_taken_again_once_a_new_one_was_made():
    """Credentials with a token and the v1 user and key that make new ones: the given token until the store refuses
    it, then one from v1 auth; when that one is refused too, a newer one, never the given one again (it had been
    refused already: asking with it again was a second 401 and then "refused access")."""
    from conftest import http_server

    V1Swift.auths, V1Swift.token, V1Swift.ports, V1Swift.names = [], "tk0", [], ["a"]
    with http_server(V1Swift) as url:
        st = SwiftStore("c", StoreCreds(storage_url=f"{url}/v1/AUTH_t", token="given", auth_url=f"{url}/auth/v1.0",
                                        user="u:t", key="k"))
        assert [o.name for o in st.list()] == ["a"] and V1Swift.auths == ["tk0"]
        V1Swift.token = "tk1"
        assert [o.name for o in st.list()] == ["a"] and V1Swift.auths == ["tk0", "tk1"]


def test_a_file_store_listing_skips_a_file_renamed_away_during_the_walk(tmp_path, monkeypatch):
    """A run lock's heartbeat rewrites its generation as NAME.part renamed onto NAME. A file:// listing that walked
    the directory before the rename and read the .part's size after it raised FileNotFoundError, which the lock's
    reader takes for "no container yet": the lock read as held by nobody while its holder renewed it."""
    (tmp_path / "r" / "lock").mkdir(parents=True)
    (tmp_path / "r" / "lock" / "000000001.json").write_text("{}")
    real = os.walk

    def walk(top):  # the walk sees the heartbeat's temporary file, which is renamed before its stat
        return [(d, dirs, [*files, "000000001.json.part"] if d.endswith("lock") else files) for d, dirs, files in
                real(top)]
    monkeypatch.setattr(objects.os, "walk", walk)
    assert [o.name for o in objects.FileStore(str(tmp_path)).list("r/lock/")] == ["r/lock/000000001.json"]
