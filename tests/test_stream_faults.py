"""Stream mode's faults, found before the lease is spent (issue 78 item 5), without TensorFlow: a shard index.json
names that the store lacks, or holds at another size, is named by `check --online` and at the job's start; a shard
whose fetches are exhausted stops the reader at its next sample, not when it reaches that shard; through
tests/faultproxy.py in front of an in-process Swift (``FileSwift``), the ranks' GETs are asked again through 5xx
and resets, a held or trickling GET is cut at its deadline and asked again, and every rank (not only rank 0) says
when it waits on the store."""

import hashlib
import itertools
import json
import shutil
import threading
import time
from pathlib import Path
from urllib.parse import parse_qsl, unquote

import pytest

from appliance.errors import ApplianceError
from appliance.node import stream_fetch
from appliance.node.stream_fetch import SLOW_S, store_fetch
from conftest import http_server
from faultproxy import FaultProxy
from test_store_listing import V1Swift
from test_stream import copier, packed


def test_a_shard_missing_or_of_another_size_is_named_by_check_online_and_at_the_jobs_start(tmp_path):
    from types import SimpleNamespace

    from click.testing import CliRunner

    from appliance.cli import main
    from appliance.data.stream import JobStream, stream_check
    from appliance.spec import parse_spec
    from conftest import write_spec

    src = tmp_path / "store" / "data"
    index = packed(src, 6, 2)
    (src / "index.json").write_text(json.dumps(index))
    url = f"file://{src}/"
    assert stream_check(url, None) == index
    gone, cut = index["shards"][1]["name"], index["shards"][4]["name"]
    (src / gone).unlink()
    (src / cut).write_bytes((src / cut).read_bytes()[:512])
    with pytest.raises(ApplianceError) as e:
        stream_check(url, None)
    assert e.value.message == (f"dataset.source {url}: of the 6 shard(s) index.json names, 1 not in the store ({gone}) "
                            f"and 1 of another size ({cut}: 512 bytes there, {index['shards'][4]['size']:,} in "
                            "index.json); a job would fail when it reaches them")

    code = tmp_path / "code"
    code.mkdir()
    (code / "x.py").write_text("")
    spec = write_spec(tmp_path, "python x.py", code=code, name="sf",
                      extra=f"dataset: {{source: '{url}', mode: stream}}\n")
    r = CliRunner().invoke(main, ["check", str(spec), "--online"], env={"APPLIANCE_HOME": str(tmp_path)})
    assert r.exit_code == 1 and r.stdout == "" and len(r.stderr.strip().splitlines()) == 1, r.stderr
    assert f"1 not in the store ({gone})" in r.stderr and "(fix: pack the dataset again" in r.stderr

    made = []  # the job's start: refused before any credential is made or a node is touched
    site = SimpleNamespace(store_creds=lambda u: None, job_store_creds=lambda *a, **kw: made.append(a))
    ctx = SimpleNamespace(spec=parse_spec({"name": "s", "train": {"command": "x"},
                                           "dataset": {"source": url, "mode": "stream"}}), say=print)
    with pytest.raises(ApplianceError, match=f"1 not in the store \\({gone}\\)"):
        JobStream(site).prepare(ctx)
    assert made == []


def test_a_shard_whose_fetches_are_exhausted_stops_the_reader_at_its_next_sample(tmp_path, monkeypatch):
    """The 5th shard read never matches its MD5; the 2nd's GET is slow (it returns once the 5th has failed). The
    reader stops while it waits for the 2nd, with the 5th's error, not after reading the 2nd to 4th."""
    from appliance.node import stream as stream_mod
    from appliance.node.stream import Stream
    from appliance.node.stream_order import Order, reads

    index = packed(tmp_path / "src", 6, 4)
    o = Order(tuple(x["samples"] for x in index["shards"]), 7, 1, 1, 0)
    order = [index["shards"][j]["name"] for _, j, _, first, _ in itertools.islice(reads(o, 0, 1, 0), 24) if first]
    made = []

    class Cache(stream_mod.ShardCache):
        def __init__(self, *a, **kw):
            made.append(self)
            super().__init__(*a, **kw)

    monkeypatch.setattr(stream_mod, "ShardCache", Cache)
    plain = copier(tmp_path / "src")

    def fetch(name, dest):
        plain(name, dest)
        if name == order[4]:
            with open(dest, "r+b") as fh:
                fh.write(b"X")
        elif name == order[1]:
            with made[0]._cv:
                assert made[0]._cv.wait_for(lambda: made[0]._failed, timeout=10)

    s = Stream(index, seed=7, rank=0, world=1, batch_size=1, root=tmp_path / "c", fetch=fetch, capacity=1 << 30,
               window=0)
    got = []
    with pytest.raises(ApplianceError, match=f"shard {order[4]}: its bytes did not match index.json's MD5"):
        for key, _ in s.samples():
            got.append(key)
    assert len(got) <= 5, got  # shard 1's 4 samples, at most one of the 2nd's; not the 2nd to the 4th's 12 more


class FileSwift(V1Swift):
    """Swift's v1 auth (test_store_listing's) and its reads over ``root``, a directory per container: listings as
    JSON, marker-paged, and objects with their MD5 as ETag."""

    root = Path(".")

    def do_GET(self):
        path, _, query = self.path.partition("?")
        if path == "/auth/v1.0" or self.headers.get("X-Auth-Token") != V1Swift.token:
            return super().do_GET()
        container, _, name = unquote(path.removeprefix("/v1/AUTH_t/")).partition("/")
        base = self.root / container
        if not name:
            q = dict(parse_qsl(query))
            names = sorted(p.relative_to(base).as_posix() for p in base.rglob("*") if p.is_file())
            page = [{"name": n, "bytes": (base / n).stat().st_size, "hash": hashlib.md5((base / n).read_bytes())
                     .hexdigest()} for n in names if n.startswith(q.get("prefix", "")) and n > q.get("marker", "")]
            return self._answer(200, json.dumps(page[:int(q.get("limit", 10000))]).encode())
        if not (base / name).is_file():
            return self._answer(404)
        data = (base / name).read_bytes()
        return self._answer(200, data, ETag=hashlib.md5(data).hexdigest())


@pytest.fixture
def fake_swift(tmp_path, virtual_time):
    """swift://data/p/ with 3 packed shards, through a FaultProxy in front of an in-process Swift; the ranks'
    credentials file. The retries' backoff is walked without waiting it out."""
    from appliance.store import base

    virtual_time(base)
    index = packed(tmp_path / "store" / "data" / "p", 3, 40)
    (tmp_path / "store" / "data" / "p" / "index.json").write_text(json.dumps(index))
    V1Swift.token = "tk0"
    with http_server(type("Swift", (FileSwift,), {"root": tmp_path / "store"})) as up:
        proxy = FaultProxy(up).start()
        creds = tmp_path / "creds.json"
        creds.write_text(json.dumps({"auth_url": f"{proxy.url}/auth/v1.0", "user": "u:t", "key": "k"}))
        try:
            yield proxy, index, str(creds)
        finally:
            proxy.stop()


def fetcher(swift, said, rank=3, monkeypatch=None, deadline=None):
    """A rank's fetch; with ``deadline``, each GET's (whatever its size)."""
    proxy, index, creds = swift
    if deadline is not None:
        monkeypatch.setattr(stream_fetch, "GET_FLOOR_S", deadline)
        monkeypatch.setattr(stream_fetch, "GET_MIN_RATE", 1e12)
    return store_fetch("swift://data/p/", creds, said.append, rank=rank,
                       sizes={s["name"]: s["size"] for s in index["shards"]})


def check_bytes(tmp_path, index, i, md5):
    name = index["shards"][i]["name"]
    assert md5 == index["shards"][i]["md5"]
    assert (tmp_path / "got").read_bytes() == (tmp_path / "store" / "data" / "p" / name).read_bytes()


def test_every_rank_says_the_gets_it_asks_again_through_5xx_and_resets(tmp_path, fake_swift):
    proxy, index, _ = fake_swift
    said: list[str] = []
    fetch = fetcher(fake_swift, said)
    proxy.fail_gets = 2
    name = index["shards"][0]["name"]
    check_bytes(tmp_path, index, 0, fetch(name, tmp_path / "got"))
    assert said == [f"[appliance] stream rank 3: {name}: HTTP 503: asking again for up to 600 s"]
    proxy.reset_gets = 2  # (httpget asks once more at once on a new connection: a kept-alive one may be stale)
    check_bytes(tmp_path, index, 1, fetch(index["shards"][1]["name"], tmp_path / "got"))
    assert len(said) == 1  # within the minute: held back, said once the minute is over, with what was held
    fetch.waits.check(time.monotonic() + 61)
    assert said[1].startswith(f"[appliance] stream rank 3: {index['shards'][1]['name']}: ") and \
        "asking again" in said[1], said
    assert [x.split()[0] for x in proxy.failed] == ["GET", "GET", "RESET", "RESET"]


def run_fetch(fetch, name, dest) -> tuple[threading.Thread, list]:
    out: list = []
    t = threading.Thread(target=lambda: out.append(fetch(name, dest)), daemon=True)
    t.start()
    return t, out


def test_a_held_get_is_said_by_its_rank_within_a_minute_and_cut_at_its_deadline(tmp_path, fake_swift, monkeypatch):
    proxy, index, _ = fake_swift
    said: list[str] = []
    fetch = fetcher(fake_swift, said, 1, monkeypatch, deadline=0.2)
    proxy.hold_gets = 1
    name = index["shards"][2]["name"]
    t, out = run_fetch(fetch, name, tmp_path / "got")
    assert proxy.wait_held(1, timeout=10)
    fetch.waits.check(time.monotonic() + SLOW_S - 1)
    fetch.waits.check(time.monotonic() + SLOW_S)
    t.join(timeout=10)
    assert out, "the held GET was never cut"
    check_bytes(tmp_path, index, 2, out[0])
    assert said[:1] == [f"[appliance] stream rank 1: waiting on the store: {name}: 0 B of "
                        f"{index['shards'][2]['size'] / 1000:.1f} KB in 30 s; the GET is cut and asked again 0 s "
                        "after it began"], said


def test_a_trickling_get_is_cut_at_its_deadline_and_asked_again(tmp_path, fake_swift, monkeypatch):
    proxy, index, _ = fake_swift
    said: list[str] = []
    fetch = fetcher(fake_swift, said, 2, monkeypatch, deadline=0.15)
    proxy.trickle_gets, proxy.trickle_every = 1, 0.01  # a byte every 10 ms: the shard would take a minute
    name = index["shards"][0]["name"]
    t, out = run_fetch(fetch, name, tmp_path / "got")
    t.join(timeout=10)
    assert out, "the trickling GET was never cut"
    check_bytes(tmp_path, index, 0, out[0])
    assert proxy.failed == [f"TRICKLE GET /v1/AUTH_t/data/p/{name}"]
    assert said == [f"[appliance] stream rank 2: {name}: no whole answer within the GET's deadline of 0 s: asking "
                    "again for up to 600 s"], said


def test_a_rank_other_than_0_says_its_waits_from_its_first_get(tmp_path, fake_swift, monkeypatch, capsys):
    from appliance.node import stream as stream_mod
    from appliance.protocol import Env

    proxy, index, creds = fake_swift
    for k, v in {Env.STREAM_URL: "swift://data/p/", Env.STREAM_CREDS: creds, Env.STREAM_CACHE: str(tmp_path / "c"),
                 Env.STREAM_CACHE_BYTES: str(1 << 30), "HOROVOD_RANK": "1", "HOROVOD_SIZE": "2"}.items():
        monkeypatch.setenv(k, v)
    monkeypatch.setattr(stream_mod, "_ACTIVE", [])
    proxy.fail_gets = 1
    s = stream_mod.open_stream(2, seed=7)
    assert s.rank == 1 and s.index == index
    assert "[appliance] stream rank 1: index.json: HTTP 503: asking again" in capsys.readouterr().err
    shutil.rmtree(tmp_path / "c", ignore_errors=True)


def test_a_gets_deadline_grows_with_its_shard():
    assert stream_fetch.get_deadline(None) == stream_fetch.GET_FLOOR_S
    assert 300 < stream_fetch.get_deadline(64 * 10**6) < 320  # a 64 MB shard: cut after ~5 minutes
