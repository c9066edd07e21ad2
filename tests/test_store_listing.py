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
        return {}, [{"name": n, "bytes": 1, "hash": "d41d8cd98f00b204e9800998ecf8427e"} for n in rest[:min(limit,
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
