"""Staging from Ceph RGW over https, as Chameleon serves its store (https://chi.uc.chameleoncloud.org, S3 on port
7480 as ChameleonCloud/docs gave it). Every other staging test talks plain http to the local stores, so nothing
checked that our own GETs, listings and part HEADs (appliance/store/httpget.py: http.client)
and swiftclient's listings take an https store's certificate, nor what a node says when its CA bundle does not
vouch for it. The RGW here serves https only, with a certificate made for the test (RGWServer ``tls``)."""

import hashlib
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from appliance.localcloud.rgw_server import RGWServer
from appliance.node.fetch import LARGE
from appliance.node.stage import stage
from appliance.protocol import Line
from appliance.store import httpget
from appliance.store.objects import S3Store, StoreCreds, SwiftStore

pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parents[1]
CA_VARS = ("REQUESTS_CA_BUNDLE", "SSL_CERT_FILE", "AWS_CA_BUNDLE", "CURL_CA_BUNDLE")


@pytest.fixture(scope="module")
def rgw(tmp_path_factory):
    sw = RGWServer(tmp_path_factory.mktemp("rgw-https"), tls=True).start()
    try:
        yield sw
    finally:
        sw.stop()


@pytest.fixture
def trusted(rgw, monkeypatch):
    """This process trusts the RGW's certificate, as a node trusts Chameleon's through its CA bundle."""
    for v in CA_VARS:
        monkeypatch.delenv(v, raising=False)
    monkeypatch.setenv("REQUESTS_CA_BUNDLE", str(rgw.ca_file))
    monkeypatch.setenv("AWS_CA_BUNDLE", str(rgw.ca_file))
    httpget.reset()  # the pools made before, under other settings
    yield
    httpget.reset()


def _creds(rgw) -> StoreCreds:
    c = rgw.credentials()
    return StoreCreds(auth_url=c["auth_url"], user=c["user"], key=c["key"], s3_endpoint=c["s3_endpoint"],
                      s3_access_key=c["s3_access_key"], s3_secret_key=c["s3_secret_key"])


@pytest.fixture(scope="module")
def dataset(rgw, tmp_path_factory):
    """In container ``tlsds``: small objects as our uploads put them (checked by CRC-32), a large plain one as
    another tool puts it (its MD5, ranged GETs into the hasher) and a multipart upload as `aws s3 cp` makes it
    (its parts' MD5s). Returns name -> MD5 of the bytes."""
    import boto3
    import swiftclient
    from boto3.s3.transfer import TransferConfig
    from botocore.config import Config

    os.environ["REQUESTS_CA_BUNDLE"] = str(rgw.ca_file)  # the seeding's clients (module scope: no monkeypatch)
    try:
        c = rgw.credentials()
        src = tmp_path_factory.mktemp("src")
        ours = SwiftStore("tlsds", _creds(rgw))
        ours.ensure_container()
        want = {}
        for i in range(5):
            p = src / f"small-{i}.bin"
            p.write_bytes(os.urandom(1000 + i))
            ours.put(f"ds/small-{i}.bin", p)
            want[f"ds/small-{i}.bin"] = hashlib.md5(p.read_bytes()).hexdigest()
        big = os.urandom(LARGE + (3 << 20))
        conn = swiftclient.Connection(authurl=c["auth_url"], user=c["user"], key=c["key"], retries=0)
        conn.put_object("tlsds", "ds/plain.bin", big)
        want["ds/plain.bin"] = hashlib.md5(big).hexdigest()
        multi = src / "multi.bin"
        multi.write_bytes(os.urandom(20 << 20))
        s3 = boto3.client("s3", endpoint_url=c["s3_endpoint"], aws_access_key_id=c["s3_access_key"],
                          aws_secret_access_key=c["s3_secret_key"], region_name="us-east-1", verify=str(rgw.ca_file),
                          config=Config(request_checksum_calculation="when_required"))  # RGW 16: no CRC trailers
        s3.upload_file(str(multi), "tlsds", "ds/multi.bin",
                       Config=TransferConfig(multipart_threshold=8 << 20, multipart_chunksize=8 << 20))
        assert s3.head_object(Bucket="tlsds", Key="ds/multi.bin")["ETag"].strip('"').endswith("-3")
        want["ds/multi.bin"] = hashlib.md5(multi.read_bytes()).hexdigest()
        return want
    finally:
        del os.environ["REQUESTS_CA_BUNDLE"]


def _tree(dest: Path) -> dict[str, str]:
    return {"ds/" + p.relative_to(dest).as_posix(): hashlib.md5(p.read_bytes()).hexdigest()
            for p in dest.rglob("*") if p.is_file() and not p.name.startswith(".appliance")}


@pytest.mark.parametrize("api", ["swift", "s3"])
def test_every_kind_of_object_is_staged_and_verified_over_https(rgw, dataset, trusted, api, tmp_path):
    store = (SwiftStore if api == "swift" else S3Store)("tlsds", _creds(rgw))
    assert store.endpoint.startswith("https://")
    res = stage(store, "ds/", tmp_path / "d", concurrency=8)
    assert res.files_fetched == len(dataset) and res.size_only == [] and res.corrupt_refetched == 0
    assert _tree(tmp_path / "d") == dataset


def _stage_main(rgw, api: str, dest: Path, env: dict) -> tuple[subprocess.CompletedProcess, list[dict]]:
    """The node's stager (appliance.node.stage_main, as the launcher runs it over SSH) on the RGW's https URL:
    (the process, its APPLIANCE_ERROR lines)."""
    c = rgw.credentials()
    creds = (StoreCreds(auth_url=c["auth_url"], user=c["user"], key=c["key"]).scoped() if api == "swift" else
             StoreCreds(s3_endpoint=c["s3_endpoint"], s3_access_key=c["s3_access_key"],
                        s3_secret_key=c["s3_secret_key"]))
    job = {"url": f"{api}://tlsds/ds/", "dest": str(dest), "mode": "full", "rank": 0, "nodes": 1, "concurrency": 4,
           "creds": creds.__dict__}
    p = subprocess.run([sys.executable, "-m", "appliance.node.stage_main"], input=json.dumps(job), text=True,
                       capture_output=True, timeout=600, env={**env, "PYTHONPATH": str(ROOT)})
    errors = [json.loads(ln.split(" ", 1)[1]) for ln in p.stdout.splitlines() if ln.startswith(Line.ERROR + " ")]
    return p, errors


def test_a_node_that_trusts_the_stores_ca_bundle_stages_over_https(rgw, dataset, tmp_path):
    env = {k: v for k, v in os.environ.items() if k not in CA_VARS}
    p, _ = _stage_main(rgw, "s3", tmp_path / "d", {**env, "SSL_CERT_FILE": str(rgw.ca_file)})
    assert p.returncode == 0, p.stdout[-2000:] + p.stderr[-2000:]
    assert _tree(tmp_path / "d") == dataset


@pytest.mark.parametrize("api", ["swift", "s3"])
def test_a_certificate_the_node_does_not_trust_is_one_line_with_the_fix(rgw, dataset, api, tmp_path):
    """It was asked again for 2 minutes (LIST_DEADLINE) and then said as "cannot reach the object store ...
    check the network"."""
    env = {k: v for k, v in os.environ.items() if k not in CA_VARS}
    p, errors = _stage_main(rgw, api, tmp_path / "d", env)
    assert p.returncode == 1 and len(errors) == 1, p.stdout[-2000:] + p.stderr[-2000:]
    assert errors[0]["message"] == (f"the object store at {rgw.auth_url if api == 'swift' else rgw.s3_endpoint} "
                                    "sent a certificate this machine does not trust (self-signed certificate)")
    assert "REQUESTS_CA_BUNDLE" in errors[0]["fix"]
    assert "asking again" not in p.stdout and "Traceback" not in p.stdout + p.stderr
    assert not any(f.is_file() for f in (tmp_path / "d").rglob("*") if not f.name.startswith(".appliance"))


@pytest.mark.parametrize("api", ["swift", "s3"])
def test_uploads_and_checkpoint_commits_go_up_and_come_back_over_https(rgw, trusted, api, tmp_path):
    """`appliance data upload` (a file in parts among them) and a checkpoint commit, through each API, over https;
    staged back byte for byte."""
    from appliance.data import upload
    from appliance.store.checkpoints import CheckpointStore

    src = tmp_path / "src"
    src.mkdir()
    (src / "small.bin").write_bytes(os.urandom(5000))
    (src / "parts.bin").write_bytes(os.urandom(3_500_000))
    assert upload(str(src), f"{api}://tlsup-{api}/d/", creds=_creds(rgw), segment_size=1_000_000) == 2
    store = (SwiftStore if api == "swift" else S3Store)(f"tlsup-{api}", _creds(rgw))
    res = stage(store, "d/", tmp_path / "back", concurrency=4)
    assert res.files_fetched == 2 and res.size_only == []
    assert all((tmp_path / "back" / f.name).read_bytes() == f.read_bytes() for f in src.iterdir())
    cs = CheckpointStore(f"{api}://tlsck-{api}/", "run", _creds(rgw))
    ck = tmp_path / "ckpt-000000003"
    ck.mkdir()
    (ck / "w.bin").write_bytes(os.urandom(200_000))
    cs.upload(ck, {"step": 3})
    assert [c.step for c in cs.committed()] == [3]
