"""Listings: every page until an empty one (Ceph RGW answers at most 1,000 names whatever `limit` asks for, and the
old lister stopped at the first short page: staging saw the first 1,000 objects and reported success), and a page
that fails transiently is asked again (issue 14, item 8; issue 12, item 5). A fake Swift connection here; the real
Swift runs in test_stage.py."""

import pytest
import swiftclient

from appliance.errors import ApplianceError
from appliance.store import objects
from appliance.store.objects import StoreCreds, SwiftStore


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

        def _reset(self):
            pass

    return S("c", StoreCreds(storage_url="http://store.invalid/v1/AUTH_x", token="t"))


def test_rgw_pages_of_1000_are_all_read():
    names = [f"obj-{i:05d}" for i in range(2500)]
    assert [o.name for o in store(FakeConn(names)).list()] == names


def test_transient_failures_of_a_page_are_retried(monkeypatch):
    monkeypatch.setattr(objects.time, "sleep", lambda s: None)
    conn = FakeConn([f"o{i}" for i in range(5)], fail=[503, None, 500])
    assert len(list(store(conn).list())) == 5 and conn.calls == 5  # 3 failures, a page, the empty page


def test_a_refusal_is_not_retried(monkeypatch):
    monkeypatch.setattr(objects.time, "sleep", lambda s: None)
    conn = FakeConn(["a"], fail=[403])
    with pytest.raises(ApplianceError, match="refused access"):
        list(store(conn).list())
    assert conn.calls == 1


def test_retries_stop_at_the_deadline(monkeypatch):
    monkeypatch.setattr(objects, "LIST_DEADLINE", 0.0)
    conn = FakeConn(["a"], fail=[503] * 100)
    with pytest.raises(swiftclient.ClientException):
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
    """An SLO as Ceph RGW shows it (../shared/docs/rgw.md): listed with the MD5 of nothing and the manifest's
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
            return "etag"

    f = tmp_path / "x"
    f.write_bytes(b"0123456789")
    conn = PutConn()
    assert store(conn).put("x", f) == "etag"
    assert conn.bodies == [b"0123456789", b"0123456789"]
