"""`appliance data pack SRC_URL URL` (issue 78 item 7): a dataset in a store object by object, packed into tar
shards through memory: the same shards and index.json as a pack of the same files from a local directory, readable
by stream mode; its GETs asked again through the store's faults (tests/faultproxy.py in front of an in-process
Swift), an object whose bytes do not match its listing never packed, and what it cannot do said in one line."""

import json
from pathlib import Path

import pytest

from appliance.data import pack_from_store
from appliance.data.pack import pack
from appliance.errors import ApplianceError
from appliance.store.objects import FileStore, StoreCreds
from conftest import http_server
from faultproxy import FaultProxy
from test_stream_faults import FileSwift, V1Swift


def dataset(root: Path, n: int = 30) -> Path:
    """Two classes' folders of ``n`` samples each (an image and its label), packed as users have them."""
    for c in range(2):
        for k in range(n):
            d = root / f"class{c}"
            d.mkdir(parents=True, exist_ok=True)
            (d / f"{k:04d}.jpg").write_bytes(bytes([c, k]) * (100 + 37 * k))
            (d / f"{k:04d}.cls").write_text(str(c))
    (root / "notes").mkdir()  # a folder marker's directory, as a listing shows it: not a sample
    return root


def shards_of(root: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in sorted(root.glob("shard-*"))}


def test_a_pack_from_a_store_writes_the_shards_a_pack_of_the_same_files_would(tmp_path):
    from appliance.data.stream import stream_check
    from appliance.node.stream import tar_samples

    src = dataset(tmp_path / "store" / "raw")
    want = pack(src, FileStore(str(tmp_path / "local")), "", shard_size=8000)
    got = pack_from_store(f"file://{src}/", f"file://{tmp_path}/packed/", src_creds=None, creds=None,
                          shard_size=8000)
    assert got == want and len(got["shards"]) > 3 and got["samples"] == 60
    assert shards_of(tmp_path / "packed") == shards_of(tmp_path / "local")
    assert stream_check(f"file://{tmp_path}/packed/", None) == got  # what stream mode reads
    keys = [k for s in got["shards"] for k, _ in tar_samples(tmp_path / "packed" / s["name"])]
    assert keys == sorted(f"class{c}/{k:04d}" for c in range(2) for k in range(30))


def test_what_a_pack_from_a_store_cannot_do_is_one_line(tmp_path):
    src = dataset(tmp_path / "raw")
    with pytest.raises(ApplianceError, match="writes tar shards only"):
        pack_from_store(f"file://{src}/", f"file://{tmp_path}/p/", src_creds=None, creds=None, fmt="tfrecord")
    with pytest.raises(ApplianceError, match="is inside the source"):
        pack_from_store(f"file://{src}/", f"file://{src}/packed/", src_creds=None, creds=None)
    with pytest.raises(ApplianceError, match="no object under it to pack"):
        pack_from_store(f"file://{tmp_path}/empty/", f"file://{tmp_path}/p/", src_creds=None, creds=None)
    assert not (tmp_path / "p").exists()


def test_a_pack_from_swift_asks_again_through_faults_and_never_packs_bytes_that_do_not_match(tmp_path,
                                                                                           virtual_time):
    from appliance.store import base

    virtual_time(base)
    dataset(tmp_path / "store" / "data" / "raw", 6)
    want = pack(tmp_path / "store" / "data" / "raw", FileStore(str(tmp_path / "local")), "", shard_size=2000)
    V1Swift.token = "tk0"
    with http_server(type("Swift", (FileSwift,), {"root": tmp_path / "store"})) as up:
        proxy = FaultProxy(up).start()
        creds = StoreCreds(auth_url=f"{proxy.url}/auth/v1.0", user="u:t", key="k")
        try:
            proxy.fail_gets, proxy.reset_gets = 3, 2
            got = pack_from_store("swift://data/raw/", f"file://{tmp_path}/packed/", src_creds=creds, creds=None,
                                  shard_size=2000)
            assert got == want and shards_of(tmp_path / "packed") == shards_of(tmp_path / "local")
            assert len(proxy.failed) == 5

            class Changing(FileSwift):  # an object that changed since it was listed: its bytes, not its listing
                def do_GET(self):
                    if self.path.endswith("class1/0003.jpg"):
                        return self._answer(200, b"x" * 422)  # its size, other bytes
                    return super().do_GET()

            with http_server(type("Swift", (Changing,), {"root": tmp_path / "store"})) as up2:
                proxy.up_port = int(up2.rsplit(":", 1)[1])
                with pytest.raises(ApplianceError, match=r"swift://data/raw/class1/0003.jpg: its bytes did not match"):
                    pack_from_store("swift://data/raw/", f"file://{tmp_path}/again/", src_creds=creds, creds=None,
                                    shard_size=2000)
        finally:
            proxy.stop()
    assert not (tmp_path / "again" / "index.json").exists()  # nothing committed
    assert json.loads((tmp_path / "packed" / "index.json").read_text()) == want
