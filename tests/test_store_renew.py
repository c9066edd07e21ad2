"""A process that outlives its store token (a managed run's controller: weeks; a bare Keystone token: a day) has it
made again by the site when the store refuses it: SwiftStore's ``renew``, against a Swift on loopback that takes
one token at a time, as Keystone's expiry leaves it. Without ``renew`` a refused bare token is said, once."""

from __future__ import annotations

import hashlib
import http.server
import threading

import pytest

from appliance.store.objects import StoreCreds, StoreRefused, open_store


class _Swift(http.server.BaseHTTPRequestHandler):
    """The container ``c`` of one account: listings, HEAD, PUT; anything with a token other than ``valid`` is 401."""

    protocol_version = "HTTP/1.1"

    def _ok(self) -> bool:
        if self.headers.get("X-Auth-Token") == self.server.valid:
            return True
        self._answer(401, b"")
        return False

    def _answer(self, status: int, body: bytes, **headers) -> None:
        self.send_response(status)
        for k, v in {"Content-Length": str(len(body)), **headers}.items():
            self.send_header(k, v)
        self.end_headers()
        self.wfile.write(body)

    def do_GET(self):  # noqa: N802 - http.server's names
        if self._ok():
            self._answer(200, b"[]", **{"Content-Type": "application/json; charset=utf-8"})

    def do_HEAD(self):  # noqa: N802
        if self._ok():
            self._answer(204, b"")

    def do_PUT(self):  # noqa: N802
        body = self.rfile.read(int(self.headers.get("Content-Length") or 0))
        if self._ok():
            self.server.put[self.path.rsplit("/", 1)[1]] = body
            self._answer(201, b"", Etag=hashlib.md5(body).hexdigest())

    def log_message(self, *a):
        pass


@pytest.fixture
def fake_swift():
    srv = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _Swift)
    srv.valid, srv.put = "t1", {}
    threading.Thread(target=srv.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True).start()
    yield srv
    srv.shutdown()
    srv.server_close()


def _creds(srv, token: str) -> StoreCreds:
    return StoreCreds(storage_url=f"http://127.0.0.1:{srv.server_address[1]}/v1/AUTH_p", token=token)


def test_a_refused_token_is_made_again_for_reads_and_writes(fake_swift, tmp_path):
    made = []

    def renew():
        made.append(fake_swift.valid)
        return _creds(fake_swift, fake_swift.valid)

    store, _ = open_store("swift://c/", _creds(fake_swift, "t1"), renew)
    store.reach()
    assert list(store.list("")) == [] and made == []
    fake_swift.valid = "t2"  # t1 expired
    assert list(store.list("")) == [] and made == ["t2"]
    fake_swift.valid = "t3"
    assert store.create("lock", b"held") and fake_swift.put["lock"] == b"held" and made == ["t2", "t3"]
    fake_swift.valid = "t4"
    f = tmp_path / "state.json"
    f.write_text('{"status": "running"}')
    store.put("state.json", f)  # a file body, sent again from the start with the new token
    assert fake_swift.put["state.json"] == f.read_bytes() and made == ["t2", "t3", "t4"]
    store.reach()
    assert made == ["t2", "t3", "t4"]  # one new token per refusal, not per request


def test_without_renew_a_refused_bare_token_is_said_with_its_fix(fake_swift):
    store, _ = open_store("swift://c/", _creds(fake_swift, "t1"))
    fake_swift.valid = "t2"
    with pytest.raises(StoreRefused, match=r"\(401\): the token may have expired"):
        list(store.list(""))
    with pytest.raises(StoreRefused, match="renewable store credentials"):
        store.reach()


def test_a_token_the_site_cannot_renew_is_refused_once_not_in_a_loop(fake_swift):
    made = []
    store, _ = open_store("swift://c/", _creds(fake_swift, "t1"), lambda: made.append(1) or _creds(fake_swift, "t1"))
    fake_swift.valid = "t2"
    with pytest.raises(StoreRefused, match=r"\(401\)"):
        list(store.list(""))
    with pytest.raises(StoreRefused, match=r"\(401\)"):
        store.reach()
    assert len(made) == 2
