"""A process that outlives its store token (a managed run's controller: weeks; a bare Keystone token: a day) has it
made again by the site when the store refuses it: SwiftStore's ``renew``, against a Swift on loopback that takes
one token at a time, as Keystone's expiry leaves it. Without ``renew`` a refused bare token is said, once."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from appliance.store.objects import StoreCreds, StoreRefused, open_store

pytestmark = pytest.mark.timeout(60)  # a request that hangs fails its test in a minute, not the run's ten


# The fake runs in a process of its own: a worker that ran an eventlet-based test before this one (OpenStack's
# libraries) may have green threads, and a server thread beside a client in one such process never answered.
SERVER = r"""
import hashlib, http.server, sys
from pathlib import Path

state = Path(sys.argv[1])


class Swift(http.server.BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"

    def _ok(self):
        if self.headers.get("X-Auth-Token") == (state / "valid").read_text():
            return True
        self._answer(401, b"")
        return False

    def _answer(self, status, body, **headers):
        self.send_response(status)
        for k, v in {"Content-Length": str(len(body)), **headers}.items():
            self.send_header(k, v)
        self.end_headers()
        self.wfile.write(body)

    def do_GET(self):
        if self._ok():
            self._answer(200, b"[]", **{"Content-Type": "application/json; charset=utf-8"})

    def do_HEAD(self):
        if self._ok():
            self._answer(204, b"")

    def do_PUT(self):
        body = self.rfile.read(int(self.headers.get("Content-Length") or 0))
        if self._ok():
            (state / ("put-" + self.path.rsplit("/", 1)[1])).write_bytes(body)
            self._answer(201, b"", Etag=hashlib.md5(body).hexdigest())

    def log_message(self, *a):
        pass


srv = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Swift)
print(srv.server_address[1], flush=True)
srv.serve_forever()
"""


class _Fake:
    """The container ``c`` of one account: listings, HEAD, PUT; a request with a token other than ``valid`` is 401."""

    def __init__(self, state: Path):
        self.state = state
        self.valid = "t1"
        self.proc = subprocess.Popen([sys.executable, "-c", SERVER, str(state)], stdout=subprocess.PIPE, text=True)
        self.port = int(self.proc.stdout.readline())

    @property
    def valid(self) -> str:
        return (self.state / "valid").read_text()

    @valid.setter
    def valid(self, token: str) -> None:
        (self.state / "valid").write_text(token)

    def put(self, name: str) -> bytes:
        return (self.state / f"put-{name}").read_bytes()


@pytest.fixture
def fake_swift(tmp_path):
    (tmp_path / "fake").mkdir()
    srv = _Fake(tmp_path / "fake")
    yield srv
    srv.proc.kill()
    srv.proc.wait()


def _creds(srv, token: str) -> StoreCreds:
    return StoreCreds(storage_url=f"http://127.0.0.1:{srv.port}/v1/AUTH_p", token=token)


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
    assert store.create("lock", b"held") and fake_swift.put("lock") == b"held" and made == ["t2", "t3"]
    fake_swift.valid = "t4"
    f = tmp_path / "state.json"
    f.write_text('{"status": "running"}')
    store.put("state.json", f)  # a file body, sent again from the start with the new token
    assert fake_swift.put("state.json") == f.read_bytes() and made == ["t2", "t3", "t4"]
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
