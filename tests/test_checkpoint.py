"""Checkpoints, the lease watchdog and `appliance resume`.

Real parts throughout: the digits example (TensorFlow + Horovod on 2 testbed nodes), a real Swift server
(with a fault-injecting HTTP proxy in front of it where the store must fail), and the local cloud (Blazar
leases whose end deletes the servers). Every resumed run is compared with an uninterrupted run of the same
seed and world size: the final weights must be bit-identical.
"""

import contextlib
import csv
import datetime as dt
import io
import json
import os
import random
import tempfile
import time
from pathlib import Path

import pytest
import yaml

from appliance import localcloud
from appliance.checkpoint import runs
from appliance.checkpoint.resume import choose_checkpoint, find_spec
from appliance.flows import RunContext
from appliance.flows import resume
from appliance.store.checkpoints import CheckpointStore
from appliance.cluster import Cluster
from appliance.errors import ApplianceError
from appliance.sites.local import LocalSite
from appliance.store.objects import StoreCreds, slo_etag
from appliance import flows, sites
from appliance.spec import load_spec
from appliance.flows import run_job as train
from click.testing import CliRunner

from appliance.cli import main as cli_main
from conftest import ROOT, NETNS_OK
from faultproxy import FaultProxy

pytestmark = pytest.mark.skipif(not NETNS_OK, reason="needs network namespaces")

DIGITS = ROOT / "examples" / "digits"
EPOCHS = 4  # 22 steps per epoch on 2 ranks: 88 steps
LONG = 30  # the lease tests: 660 steps, so a stop asked for at an arbitrary epoch lands well before the end


def digits_spec(tmp_path: Path, name: str, *, url: str | None, every: int = 20, env: dict | None = None,
                extra: str = "", fname: str | None = None, epochs: int = EPOCHS) -> str:
    lines = [f"name: {name}", "cloud: local", "nodes: {count: 2, node_type: compute_local, slots: 1}",
             "image: appliance-cpu", "train:", f"  code: {DIGITS}", f"  command: python train.py --epochs {epochs}"]
    # a stop-check interval of ~5 digits steps (default 1 s, ~100 steps) so that these short runs can stop
    env = {"APPLIANCE_STOP_CHECK_SECONDS": "0.05", **(env or {})}
    lines.append("  env: " + json.dumps(env))
    if url:
        lines.append(f"checkpoint: {{url: {json.dumps(url)}, every_steps: {every}, keep: 2}}")
    p = tmp_path / (fname or f"{name}.yaml")
    p.write_text("\n".join(lines) + "\n" + extra)
    return str(p)


def sha(res) -> str:
    shas = {r["weights_sha256"] for r in res.results.values()}
    assert len(shas) == 1, res.results
    return shas.pop()


class Lines:
    """Collects job output; calls hooks on lines that match (from the launcher's output thread)."""

    def __init__(self):
        self.lines: list[str] = []
        self.hooks: list[tuple[str, object]] = []

    def on(self, text: str, fn) -> None:
        self.hooks.append((text, fn))

    def __call__(self, line: str) -> None:
        self.lines.append(line)
        for i, (text, fn) in enumerate(list(self.hooks)):
            if text in line:
                self.hooks.remove((text, fn))
                fn(line)

    def has(self, text: str) -> bool:
        return any(text in x for x in self.lines)


@pytest.fixture(scope="module")
def reference(cluster2, tmp_path_factory):
    """The uninterrupted run: same seed, same world size, no checkpoints."""
    res = train(load_spec(digits_spec(tmp_path_factory.mktemp("ref"), "ckref", url=None)), cluster2,
                out=lambda line: None)
    assert res.exit_code == 0, res.failure
    assert res.results[0]["steps"] == EPOCHS * 22
    return sha(res)


@pytest.fixture(scope="module")
def reference_long(cluster2, tmp_path_factory):
    res = train(load_spec(digits_spec(tmp_path_factory.mktemp("ref30"), "ckref30", url=None, epochs=LONG)), cluster2,
                out=lambda line: None)
    assert res.exit_code == 0, res.failure
    return sha(res)


def store_for(swift, run) -> CheckpointStore:
    return CheckpointStore("swift://ckpts/", run, StoreCreds(auth_url=swift.auth_url, user=swift.user, key=swift.key))


def stop_file(tb, run: str) -> Path:
    return Path(tb.nodes[0].disk) / "appliance" / "runs" / run / "STOP"


# ---------------------------------------------------------------------------------------------------------
# the store: commit, verify, prune, corruption


def fake_ckpt(root: Path, step: int, payload: bytes) -> Path:
    d = root / f"ckpt-{step:09d}"
    (d / "metrics").mkdir(parents=True)
    (d / "state.data-00000-of-00001").write_bytes(payload)
    (d / "meta.json").write_text(json.dumps({"step": step, "epoch": 0, "offset": step, "world_size": 2}))
    (d / "metrics" / "metrics.csv").write_text("step,epoch,metric,value,time\n")
    return d


@pytest.mark.parametrize("swift", ["swift", "rgw"], indirect=True)
def test_a_file_above_the_segment_size_commits_as_an_slo(swift, tmp_path, tb2, monkeypatch):
    """Issue 14 item 2: files over 5 GiB became SLOs whose ETag is not their MD5, so the commit check failed forever,
    and each segment was read into memory. Here the segment size is 1 MiB so the test stays small."""
    monkeypatch.setenv("APPLIANCE_SEGMENT_BYTES", str(1 << 20))
    cs = store_for(swift, "slo")
    cs.store.ensure_container()
    local = fake_ckpt(tmp_path, 10, os.urandom((5 << 19) + 7))  # 2.5 MiB + 7 bytes: 3 segments
    m = cs.upload(local, json.loads((local / "meta.json").read_text()))
    segs = cs.store.slo_segments(cs.prefix + "ckpt-000000010/state.data-00000-of-00001")
    assert segs is not None and [s["bytes"] for s in segs] == [1 << 20, 1 << 20, (1 << 19) + 7]
    assert [c.step for c in cs.committed()] == [10] and cs.verify(cs.committed()[0]) is None
    got = cs.download(cs.committed()[0], tmp_path / "back")  # checks every file's MD5 against the manifest
    assert (got / "state.data-00000-of-00001").read_bytes() == (local / "state.data-00000-of-00001").read_bytes()
    f = m["files"]["state.data-00000-of-00001"]
    assert f["size"] == (5 << 19) + 7 and f["part_size"] == 1 << 20 and len(f["parts"]) == 3 and "md5" not in f
    assert f["etag"] == slo_etag([{"hash": h} for h in f["parts"]])  # the store's ETag is made of the parts' MD5s


@pytest.mark.parametrize("swift", ["swift", "rgw"], indirect=True)
def test_a_file_above_the_segment_size_commits_as_an_s3_multipart_upload(swift, tmp_path, tb2, monkeypatch):
    """The same through S3: parts uploaded by boto3 (no CRC32 of its own), the multipart ETag checked against the
    parts' MD5s, the manifest holding those, and a download checked part by part."""
    monkeypatch.setenv("APPLIANCE_SEGMENT_BYTES", str(5 << 20))  # S3's smallest part: 5 MiB
    c = swift.credentials()
    keys = StoreCreds(s3_endpoint=c["s3_endpoint"], s3_access_key=c["s3_access_key"], s3_secret_key=c["s3_secret_key"])
    cs = CheckpointStore("s3://ckpts3/", "mpu", keys)
    cs.ensure_container()
    local = fake_ckpt(tmp_path, 10, os.urandom((11 << 20) + 7))  # 11 MiB + 7 bytes: 3 parts
    m = cs.upload(local, json.loads((local / "meta.json").read_text()))
    f = m["files"]["state.data-00000-of-00001"]
    assert f["part_size"] == 5 << 20 and len(f["parts"]) == 3 and "md5" not in f and f["etag"].endswith("-3")
    assert [c.step for c in cs.committed()] == [10] and cs.verify(cs.committed()[0]) is None
    got = cs.download(cs.committed()[0], tmp_path / "back")  # each part's MD5 against the manifest
    assert (got / "state.data-00000-of-00001").read_bytes() == (local / "state.data-00000-of-00001").read_bytes()


@pytest.mark.parametrize("swift", ["swift", "rgw"], indirect=True)
def test_commit_prune_and_a_corrupted_newest_checkpoint(swift, tmp_path, tb2, said):
    cs = store_for(swift, "unit")
    cs.store.ensure_container()
    for step in (10, 20, 30):
        local = fake_ckpt(tmp_path, step, bytes([step]) * 5000)
        m = cs.upload(local, json.loads((local / "meta.json").read_text()))
        assert m["files"]["state.data-00000-of-00001"]["md5"] == m["files"]["state.data-00000-of-00001"]["etag"]
        cs.prune(keep=2)
    assert [c.step for c in cs.committed()] == [30, 20]
    assert not [o for o in cs.store.list(cs.prefix + "ckpt-000000010/")]  # pruned entirely, manifest first
    # an upload that died before its manifest is not a checkpoint
    partial = fake_ckpt(tmp_path, 40, b"x" * 5000)
    cs.store.put(cs.prefix + "ckpt-000000040/state.data-00000-of-00001", partial / "state.data-00000-of-00001")
    assert [c.step for c in cs.committed()] == [30, 20]
    # corrupt the newest in the store (same size, other bytes): caught by the manifest, the previous one is used
    bad = tmp_path / "bad"
    bad.write_bytes(b"\0" * 5000)
    cs.store.put(cs.prefix + "ckpt-000000030/state.data-00000-of-00001", bad)
    said.clear()
    spec = load_spec(digits_spec(tmp_path, "unit", url="swift://ckpts/"))
    import os
    os.environ.update({"ST_AUTH": swift.auth_url, "ST_USER": swift.user, "ST_KEY": swift.key})
    try:
        good = choose_checkpoint(spec, RunContext.of(spec).checkpoints)
    finally:
        for k in ("ST_AUTH", "ST_USER", "ST_KEY"):
            os.environ.pop(k, None)
    assert good.step == 20
    assert any("ckpt-000000030" in m and "corrupted" in m and "using ckpt-000000020" in m for m in said), said
    # what a node downloads is checked against the manifest again
    out = cs.download(good, tmp_path / "dl")
    assert (out / "state.data-00000-of-00001").read_bytes() == bytes([20]) * 5000


def test_resume_finds_the_spec_beside_swift_checkpoints(swift, st_env, tmp_path):
    """`appliance resume RUN --url swift://...` from a machine with no record of RUN: the spec saved beside the
    checkpoints is read with the site's credentials (issue 14, item 5: it was read with none, and always failed)."""
    cs = store_for(swift, "urlspec")
    cs.ensure_container()
    cs.put_text("spec.yaml", Path(digits_spec(tmp_path, "urlspec", url="swift://ckpts/")).read_text(), tmp_path)
    spec = find_spec("urlspec", url="swift://ckpts/", creds=flows.data_creds("swift://ckpts/", "local"))
    assert spec.name == "urlspec" and spec.checkpoint.url == "swift://ckpts/"


# ---------------------------------------------------------------------------------------------------------
# faults during training, on the 2-node testbed


@pytest.mark.slow
@pytest.mark.parametrize("swift", ["swift", "rgw"], indirect=True)
def test_kill9_of_rank0_while_uploading_keeps_the_previous_commit(cluster2, tb2, swift, st_env, reference,
                                                                   tmp_path, said):
    spec = load_spec(digits_spec(tmp_path, "ckkill", url="swift://ckpts/",
                                 env={"APPLIANCE_FAULT": "kill-during-upload:40"}))
    res = train(spec, cluster2, out=lambda line: None)
    assert res.exit_code != 0 and res.stopped is None
    assert [c["step"] for c in res.commits] == [20]
    cs = store_for(swift, "ckkill")
    assert [c.step for c in cs.committed()] == [20]  # ckpt-40 was half uploaded: not committed
    assert [o for o in cs.store.list(cs.prefix + "ckpt-000000040/")]
    assert runs.load("ckkill")["status"] == "failed"
    # resume on the same cluster, with the fault removed from the spec
    cluster2.save()
    fixed = digits_spec(tmp_path, "ckkill", url="swift://ckpts/", fname="fixed.yaml")
    said.clear()
    res2 = resume("ckkill", spec_path=fixed, cluster_name=cluster2.name, out=said.append)
    assert res2.exit_code == 0, (res2.failure, res2.stopped, said[-20:])
    assert res2.resumed["step"] == 20 and res2.resumed["bit_exact"]
    assert sha(res2) == reference
    # metrics: one CSV, one step axis across both jobs; TensorBoard events from both
    final = cs.committed()[0]
    assert final.step == EPOCHS * 22
    buf = bytearray()
    cs.store.get(f"{cs.prefix}{final.name}/metrics/metrics.csv", buf.extend)
    steps = [int(r["step"]) for r in csv.DictReader(io.StringIO(buf.decode()))]
    assert steps == sorted(steps) and steps[-1] == EPOCHS * 22 and 20 in steps
    events = [o.name for o in cs.store.list(f"{cs.prefix}{final.name}/metrics/tb/")]
    assert len(events) == 2


def _train_cli_with_ctrl_c(spec: str, cluster, when: str) -> tuple[int, list[str]]:
    """`appliance train SPEC` as a user runs it, sent SIGINT (a terminal's Ctrl-C) at the first line holding
    ``when``: (exit status, output lines)."""
    import signal
    import subprocess
    import sys

    cluster.save()  # the CLI finds it by name
    # as from a terminal: the CLI starts with SIGINT at its default, whatever this session inherited (a shell's
    # `make test &` starts it ignored, an ignored signal stays so across exec, and Python then installs no
    # KeyboardInterrupt handler: the Ctrl-C never arrived). A caught signal is reset to its default by exec.
    before = signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        p = subprocess.Popen([sys.executable, "-m", "appliance.cli", "train", spec, "--cluster", cluster.name],
                             stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, cwd=ROOT)
    finally:
        signal.signal(signal.SIGINT, before)
    lines, sent = [], False
    try:
        for line in p.stdout:
            lines.append(line.rstrip())
            if not sent and when in line:
                p.send_signal(signal.SIGINT)
                sent = True
        rc = p.wait(timeout=120)
    finally:
        if p.poll() is None:
            p.kill()
    assert sent, "\n".join(lines[-40:])
    return rc, lines


@pytest.mark.slow
def test_ctrl_c_to_appliance_train_stops_the_job_with_a_committed_checkpoint(cluster2, tb2, swift, st_env, tmp_path):
    """The real CLI under SIGINT, as a terminal's Ctrl-C delivers it: the job was killed and the work since its last
    checkpoint lost. Now every rank stops after the same step with a committed checkpoint, exit 75 (resumable)."""
    spec = digits_spec(tmp_path, "ckint", url="swift://ckpts/", epochs=40)
    rc, lines = _train_cli_with_ctrl_c(spec, cluster2, "[checkpoint] step 20 committed")
    text = "\n".join(lines)
    assert rc == 75, text[-3000:]
    assert "[appliance] Ctrl-C: the job saves a checkpoint at its next step and stops" in text
    stop = [x for x in lines if "[checkpoint] stopped after step" in x]
    assert stop and "Ctrl-C to appliance train" in stop[0], text[-3000:]
    step = int(stop[0].split("stopped after step ")[1].split()[0])
    assert 20 <= step < 40 * 22 and store_for(swift, "ckint").committed()[0].step == step


@pytest.mark.slow
def test_ctrl_c_ends_a_custom_loop_once_its_files_are_committed(cluster2, tb2, swift, st_env, tmp_path):
    """Level 3 (examples/custom_loop: nothing stops it at a step). The first Ctrl-C synced its working directory
    and left it training; only a second Ctrl-C stopped it, as a kill. Now rank 0's syncer commits the files and
    ends the job: exit 75, resumable, the newest ./checkpoint-N.h5 in the store."""
    from appliance.store.filesync import FileSet

    p = tmp_path / "loopint.yaml"
    p.write_text("\n".join([
        "name: loopint", "cloud: local", "nodes: {count: 2, node_type: compute_local, slots: 1}",
        "image: appliance-cpu", "train:", f"  code: {ROOT / 'examples' / 'custom_loop'}",
        "  command: python train.py --epochs 400", "checkpoint: {url: \"swift://ckpts/\", keep: 2}"]) + "\n")
    rc, lines = _train_cli_with_ctrl_c(str(p), cluster2, "] epoch 3/400 ")
    text = "\n".join(lines)
    assert rc == 75, text[-3000:]
    assert "[appliance] protected (level 3 only, " in text
    assert "[appliance] Ctrl-C: the job's working directory is committed now and the job ends" in text
    assert "[checkpoint] stopped (Ctrl-C to appliance train) with the working directory committed" in text, text[-3000:]
    epochs = [int(x.split("] epoch ")[1].split("/")[0]) for x in lines if "] epoch " in x and "/400 loss" in x]
    assert epochs and max(epochs) < 400  # ended, not finished
    fs = FileSet("swift://ckpts/", "loopint", StoreCreds(auth_url=swift.auth_url, user=swift.user, key=swift.key))
    body = fs.newest_good()
    assert body is not None and any(r.startswith("checkpoint-") for r in body["files"]), body


@pytest.mark.slow
def test_store_5xx_is_retried_and_a_dead_store_is_reported_loudly(cluster2, tb2, swift, st_env, reference,
                                                                   tmp_path, monkeypatch):
    from appliance.store import runlock

    proxy = FaultProxy(swift.s3_endpoint, bind_ip=tb2.host_ip).start()
    try:
        st_env(proxy.url + "/auth/v1.0")
        proxy.fail_puts = 4  # the first checkpoint uploads meet 503s
        res = train(load_spec(digits_spec(tmp_path, "ck5xx", url="swift://ckpts/")), cluster2,
                    out=lambda line: None)
        assert res.exit_code == 0, res.failure
        assert len(proxy.failed) == 4 and all(f.startswith("PUT ") for f in proxy.failed)
        assert sha(res) == reference  # training went on while uploads were retried
        assert [c.step for c in store_for(swift, "ck5xx").committed()] == [88, 80]

        # the store goes down for good after the first commit; a stop is requested with a short deadline
        out = Lines()
        # the launcher's release of the run's lock at the end waits 5 s for the dead store, not a minute (it is
        # best effort: the lock expires by itself; what is tested is the node's stop)
        monkeypatch.setattr(runlock, "READ_WAIT", 5.0)

        # the job waits after step 21 until the store is down (its 68 steps after the commit take about a second,
        # less than the commit's line may take to get here)
        released = tmp_path / "released"  # the ranks see it (one file system); it stays for the next test's resume

        def store_dies(line):
            proxy.down = True
            stop_file(tb2, "ckdown").write_text(json.dumps({"reason": "test: lease end", "deadline": time.time() + 6}))
            released.touch()

        out.on("[checkpoint] step 20 committed", store_dies)
        res = train(load_spec(digits_spec(tmp_path, "ckdown", url="swift://ckpts/",
                                          env={"APPLIANCE_FAULT": f"hold-at:21:{released}"})), cluster2, out=out)
        assert res.exit_code == 1
        assert res.stopped and res.stopped["committed"] is False
        assert "NOT committed" in res.failure and "kept on node1" in res.failure
        local = Path(tb2.nodes[0].disk) / "appliance" / "runs" / "ckdown" / "checkpoints" / res.stopped["checkpoint"]
        assert (local / "meta.json").exists()  # the local checkpoint is kept
        proxy.down = False
        assert [c.step for c in store_for(swift, "ckdown").committed()] == [20]  # nothing committed was lost
    finally:
        proxy.stop()


def use_store(monkeypatch, server) -> None:
    """Store credentials the way a user sets them (ST_*), for a store server a test started itself."""
    monkeypatch.setenv("ST_AUTH", server.auth_url)
    monkeypatch.setenv("ST_USER", server.user)
    monkeypatch.setenv("ST_KEY", server.key)


def every_checkpoint_commits(tmp_path, run: str, cluster, reference) -> tuple[Lines, list[str]]:
    """The digits job on swift://ckpts/: it ends as the reference does and no checkpoint failed to commit."""
    out = Lines()
    res = train(load_spec(digits_spec(tmp_path, run, url="swift://ckpts/")), cluster, out=out)
    assert res.exit_code == 0, res.failure
    assert sha(res) == reference
    said = [x for x in out.lines if "checkpoint" in x]
    assert not [x for x in said if "NOT committed" in x], said
    return out, said


def test_checkpoints_keep_committing_after_the_store_token_expires(cluster2, tb2, reference, tmp_path, monkeypatch):
    """Issue 12 item 2: rank 0 got one token; when the store refused it as expired (401), no checkpoint committed
    again and the lease-end stop failed. Here a real Ceph RGW whose Swift tokens live 2 s (Chameleon's live a
    day): every token the job holds expires many times over, and each checkpoint still commits, because nodes
    get the store's own credential and swiftclient renews the token on a 401."""
    from appliance.localcloud.rgw_server import RGWServer

    rgw = RGWServer(tmp_path / "rgw", bind_ip=tb2.host_ip, token_seconds=2).start()
    try:
        use_store(monkeypatch, rgw)
        out, said = every_checkpoint_commits(tmp_path, "cktoken", cluster2, reference)
        # the last is committed (a periodic save that comes while the previous upload is still going is skipped
        # by design, so the one before it depends on the machine's speed)
        assert [c.step for c in store_for(rgw, "cktoken").committed()][0] == 88, said
        log = "".join(p.read_text(errors="replace") for p in (tmp_path / "rgw" / "log").glob("*.log"))
        assert "old timed out token was used" in log  # the store did refuse expired tokens on the way
    finally:
        rgw.stop()


def test_an_expired_bare_token_is_said_at_each_commit_and_never_retried(cluster2, tb2, tmp_path, monkeypatch):
    """Nodes that hold only a token (Keystone's, on Chameleon with OS_CLOUD): once the store refuses it, swiftclient
    dropped it and was left with no URL ("Unsupported scheme ... None"), which looked transient: the last
    checkpoint's upload was retried for minutes and the job hung past the test's 10-minute limit. Now each commit
    says the token may have expired, with the fix, and nothing is retried."""
    import swiftclient

    from appliance.localcloud.rgw_server import RGWServer

    rgw = RGWServer(tmp_path / "rgw", bind_ip=tb2.host_ip, token_seconds=2).start()

    def token_only(self, url=None):  # what nodes get from a Keystone session: a URL and a token
        storage_url, token = swiftclient.get_auth(self.auth_url, self.user, self.key)
        return StoreCreds(storage_url=storage_url, token=token)

    class RefusingKeystone:  # a restricted application credential in OS_CLOUD may not make another
        def create_app_cred(self, *a, **k):
            raise ApplianceError("Keystone refused an application credential (403: restricted)", "")

    monkeypatch.setattr(StoreCreds, "scoped", token_only)
    monkeypatch.setattr(LocalSite, "connect", lambda self: RefusingKeystone())
    try:
        use_store(monkeypatch, rgw)
        out = Lines()
        res = train(load_spec(digits_spec(tmp_path, "ckbare", url="swift://ckpts/")), cluster2, out=out)
        assert res.exit_code == 0, res.failure
        assert len([x for x in out.lines if "no application credential for the nodes" in x]) == 1
        refused = [x for x in out.lines if "NOT committed" in x]
        assert refused and all("the token may have expired" in x and "renewable" in x for x in refused), refused
        assert not out.has("retrying in")
    finally:
        rgw.stop()


@pytest.mark.slow
def test_a_job_with_only_keystone_credentials_keeps_committing_as_its_tokens_expire(cloud, cluster2, reference,
                                                                                   tmp_path, monkeypatch):
    """Issue 12 item 2 on the path most Chameleon users take: OS_CLOUD only and a swift:// URL. The nodes got one
    Keystone token; Chameleon's Keystone refuses it after a day and no checkpoint committed after that (a week-long
    lease lost six days). Here the local cloud's Keystone issues tokens that live 3 s and its Ceph RGW validates
    each token with Keystone, as Chameleon's does: the job's own application credential gets rank 0 a new token
    whenever the store refuses the old one, every checkpoint commits, and the credential is deleted at the end."""
    for var in ("ST_AUTH", "ST_USER", "ST_KEY", "AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY"):
        monkeypatch.delenv(var, raising=False)
    site = sites.open_site("local")
    creds = site.store_creds()
    assert creds.token and not creds.user  # the Keystone path, not the store's own v1 user
    localcloud.admin("POST", "/tokens", {"seconds": 3})
    localcloud.admin("DELETE", "/requests")
    try:
        out, said = every_checkpoint_commits(tmp_path, "ckkeystone", cluster2, reference)
        assert not out.has("no application credential")
        store = CheckpointStore("swift://ckpts/", "ckkeystone", site.store_creds())
        assert [c.step for c in store.committed()][0] == 88, said
    finally:
        localcloud.admin("POST", "/tokens", {"seconds": 86400})
    reqs = localcloud.admin("GET", "/requests")["requests"]
    by_app_cred = [r for r in reqs if r["method"] == "POST" and r["path"].endswith("/auth/tokens")
                   and "application_credential" in ((r["body"] or {}).get("auth", {}).get("identity", {})
                                                    .get("methods") or [])
                   and r["body"]["auth"]["identity"]["application_credential"].get("id") != _own_app_cred()]
    assert len(by_app_cred) >= 2, "rank 0 never renewed its token"
    assert any(r["method"] == "GET" and r["path"].endswith("/auth/tokens") for r in reqs)  # the RGW validated
    conn = site.cloud.conn
    left = conn.session.get(f"{site.cloud.identity_url()}/users/{conn.current_user_id}/application_credentials").json()
    assert left["application_credentials"] == []


def test_a_node_stages_with_its_application_credential_through_keystone_and_no_client_library(cloud, tmp_path,
                                                                                                 monkeypatch):
    """What a node gets on Chameleon for a swift:// URL (OS_CLOUD only): an application credential of the job's
    own. The node's stager (appliance.node.stage_main) takes its token from the local cloud's Keystone and its
    store from the catalog, and the Ceph RGW validates the token with Keystone, as Chameleon's does; the files arrive
    byte for byte, and the process never imports swiftclient, keystoneauth1 or requests (0.15 s of CPU per
    staging: bench/results/stage-swift-auth)."""
    import subprocess
    import sys

    from appliance.store.objects import SwiftStore

    for var in ("ST_AUTH", "ST_USER", "ST_KEY", "AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY"):
        monkeypatch.delenv(var, raising=False)
    site = sites.open_site("local")
    creds = site.store_creds()
    assert creds.token and not creds.user  # the Keystone path, not the store's own v1 user
    store = SwiftStore("ksstage", creds)
    store.ensure_container()
    want = {f"f{i}": os.urandom(100_000 + i) for i in range(3)}
    for name, data in want.items():
        (tmp_path / name).write_bytes(data)
        store.put(f"ds/{name}", tmp_path / name)
    node, withdraw = site.job_store_creds("swift://ksstage/ds/", name="ksstage", lease_end=None)
    assert node.app_cred and not node.token
    localcloud.admin("DELETE", "/requests")
    job = {"url": "swift://ksstage/ds/", "dest": str(tmp_path / "d"), "mode": "full", "rank": 0, "nodes": 1,
           "concurrency": 4, "creds": node.__dict__}
    run = ("import atexit, runpy, sys; atexit.register(lambda: print('LOADED', sorted(m for m in ('swiftclient', "
           "'keystoneauth1', 'requests') if m in sys.modules))); "
           "runpy.run_module('appliance.node.stage_main', run_name='__main__')")
    try:
        p = subprocess.run([sys.executable, "-c", run], input=json.dumps(job), text=True, capture_output=True,
                           timeout=300, env={**os.environ, "PYTHONPATH": str(ROOT)})
    finally:
        if withdraw is not None:
            withdraw()
    assert p.returncode == 0, p.stdout[-2000:] + p.stderr[-2000:]
    assert p.stdout.splitlines()[-1] == "LOADED []"
    got = {f.name: f.read_bytes() for f in (tmp_path / "d").iterdir() if f.is_file() and
           not f.name.startswith(".appliance")}
    assert got == want  # byte for byte
    reqs = localcloud.admin("GET", "/requests")["requests"]
    assert [r for r in reqs if r["method"] == "POST" and r["path"].endswith("/auth/tokens")
            and (r["body"] or {}).get("auth", {}).get("identity", {}).get("application_credential", {}).get("id")
            == node.app_cred_id]
    assert any(r["method"] == "GET" and r["path"].endswith("/auth/tokens") for r in reqs)  # the RGW validated


def _own_app_cred() -> str:
    return json.loads((localcloud.state_dir() / "credentials.json").read_text())["app_cred_id"]


def test_resume_on_another_world_size_reports_the_rescaling(cluster2, swift, st_env, tmp_path, said):
    # continues the run the previous test left stopped at its step-20 commit, on one node instead of two
    one = Cluster(name="pt-one", cloud="testbed", nodes=[cluster2.nodes[0]], key_file=cluster2.key_file,
                  known_hosts=cluster2.known_hosts, python=cluster2.python, etc_dir=cluster2.etc_dir,
                  testbed=cluster2.testbed)
    one.save()
    said.clear()
    res = resume("ckdown", cluster_name="pt-one", out=said.append)
    assert res.exit_code == 0, res.failure
    r = res.resumed
    assert (r["checkpoint_world_size"], r["world_size"], r["bit_exact"], r["policy"]) == (2, 1, False, "lr")
    assert (r["old_global_batch"], r["global_batch"]) == (64, 32)
    assert r["batch"] == 40  # 20 steps x 64 samples = 40 steps x 32
    assert any("not bit-exact across world sizes" in m for m in said)


# ---------------------------------------------------------------------------------------------------------
# the lease: the watchdog stops the job before the end; admin termination; both resume on a new lease


def lease_left(cluster) -> float:
    prof = sites.for_cluster(cluster)
    info = prof.cloud.get_lease(cluster.lease_id)
    return (info.end - prof.cloud.now()).total_seconds()


def wait_for(what: str, cond, timeout: float = 300.0, every: float = 1.0):
    """Poll ``cond`` until it returns something true (a condition of the run, read from the store and the records;
    nothing here waits for a time to pass)."""
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        got = cond()
        if got:
            return got
        time.sleep(every)  # the poll's period
    raise AssertionError(f"timed out after {timeout:.0f}s waiting for {what}")


def _job_sha(run: str, job_id: str) -> str:
    """The final weights' digest from a job's own output (the launcher's copy of it on this machine)."""
    from appliance.protocol import Line, parse

    shas = set()
    for line in (runs.record_dir(run) / f"{job_id}.log").read_text().splitlines():
        got = parse(line.split("] ", 1)[-1], (Line.RESULT,))
        if got and isinstance(got[1], dict) and "weights_sha256" in got[1]:
            shas.add(got[1]["weights_sha256"])
    assert len(shas) == 1, shas
    return shas.pop()


@pytest.mark.slow
def test_a_managed_run_crosses_two_lease_ends_warm_after_its_launching_shell_is_killed(cloud, reference_long,
                                                                                      tmp_path, monkeypatch):
    """`appliance run SPEC` (issue 52): the command returns once its controller (a process of its own) holds the run,
    and every process of the shell that typed it is killed with -9 at once. On the second lease the controller
    itself is killed -9 while the job trains, and `appliance run SPEC` again follows that job, makes its next
    cluster meanwhile, and hands it over warm when its lease's end takes its nodes. The spec asks for a warm handover
    (lease.overlap): at each lease, the next lease is booked to start 15 minutes before this one ends, and once the
    cloud's clock gets there its cluster is booted and staged while the job trains. At the end (the clock jumps
    again) the job stops after a step with a committed checkpoint and continues on that cluster from that very
    step, with no lease, boot or SSH in the downtime. The run finishes on its third lease with no further command:
    0 steps lost, the final weights the uninterrupted run's, each handover's downtime on the run's timeline."""
    import signal
    import socket
    import subprocess
    import sys

    from appliance.cluster import find_cluster
    from appliance.flows import managed

    monkeypatch.setenv("APPLIANCE_CONTROLLER_POLL", "0.5")  # the controller looks at the next lease twice a second
    # the second lease's job waits after step 300 (past the commit the test waits for) until `released` exists,
    # so that it is still there when its controller has been killed, another follows it, and its lease ends (the
    # whole training is ~20 s here); the weights are the same
    released = Path(tempfile.gettempdir()) / f"appliance-released-{os.urandom(4).hex()}"  # the ranks' user sees it
    spec_path = digits_spec(tmp_path, "cklease", url="swift://ckpts/", every=50, epochs=LONG,
                            env={"APPLIANCE_FAULT": f"hold-at:300:{released}"},
                            extra="lease: {duration: 1h, stop_margin: 60s, overlap: 15m}\n")
    shell = subprocess.Popen(["bash", "-c", f"{sys.executable} -m appliance.cli run {spec_path}; sleep 600"],
                             stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True)
    said = ""
    for line in iter(shell.stdout.readline, ""):  # its first lines (the store may start first), to its own
        said += line
        if "controller started" in line:
            break
    os.killpg(shell.pid, signal.SIGKILL)  # the shell, `appliance run` if still there, the sleep: all of it
    shell.wait()
    assert "controller started" in said, said + shell.stdout.read()
    cs = CheckpointStore("swift://ckpts/", "cklease", sites.open_site("local").store_creds())
    reader = managed._control_of("cklease", None, "local", None)
    state = lambda: managed.read_timeline(reader) or {}  # noqa: E731
    events = lambda kind: [e for e in state().get("events", []) if e["event"] == kind]  # noqa: E731
    try:
        stopped_at = 0
        for lease in (1, 2):
            # the job of this lease has committed past where the last one stopped (at a random one of its first
            # commits: the training is 660 steps, ~20 s here, and each lease end takes a few seconds of polls)
            target = stopped_at + 50 * random.randint(1, 3 - lease)

            def committed_here():
                jobs = events("job")
                done = cs.committed()
                return len(jobs) == lease and done and done[0].step >= target and find_cluster(jobs[-1]["cluster"])

            cl = wait_for(f"a commit at step >= {target} on lease {lease}", committed_here, every=0.2)
            if lease == 2:  # the controller is killed -9 while the job trains (the laptop slept): the job goes on,
                # detached on its head; `appliance run SPEC` again follows it, and makes its next cluster meanwhile
                dead = state()["controller"]["pid"]
                os.kill(dead, signal.SIGKILL)
                wait_for("the controller's end", lambda: managed.gone_here(f"{socket.gethostname()}:{dead}:"))
                again = subprocess.run([sys.executable, "-m", "appliance.cli", "run", spec_path, "--json"],
                                       capture_output=True, text=True, timeout=120)
                assert again.returncode == 0, again.stderr
                wait_for("the new controller to follow the job", lambda: events("following"), every=0.2)
            if lease == 1:  # the controller runs with a credential of its own, in a file, not in its environment
                env = open(f"/proc/{state()['controller']['pid']}/environ", "rb").read().decode()
                own = yaml.safe_load(open(env.split("APPLIANCE_RUN_CLOUD=")[1].split("\0")[0]))["clouds"]
                secret = own["appliance-run"]["auth"]["application_credential_secret"]
                assert secret not in env and "\0OS_" not in "\0" + env
                assert [x["name"] for x in sites.open_site("local").cloud.list_app_creds()
                        if x["name"].startswith("appliance-run-cklease-")]
            # 14 minutes before its end: the next lease has started; its cluster is made while the job trains
            localcloud.admin("POST", "/advance", {"seconds": lease_left(cl) - 14 * 60})
            wait_for(f"the next cluster of lease {lease}", lambda: len(events("next cluster ready")) == lease,
                     every=0.2)
            # then the end comes: the first job stops 60 s before it; the second, held at its step with no
            # launcher, is there when the end takes its nodes, and resumes from its newest commit
            localcloud.admin("POST", "/advance", {"seconds": lease_left(cl) + (5 if lease == 2 else -45)})
            ended = wait_for(f"the job of lease {lease} to stop for its end",
                             lambda: [e for e in events("job end") if e["lease_end"]][lease - 1:])
            stopped_at = ended[0]["step"]
            released.touch()  # the third job goes through step 300
        final = wait_for("the run to finish", lambda: (s := state()).get("status") not in (None, "running", "handover",
                                                                                          "starting") and s)
        assert final["status"] == "finished", final["events"][-4:]
        assert not final["controller_alive"]  # it ended with the run, its lock released
        ev = final["events"]
        jobs = [e for e in ev if e["event"] == "job"]
        assert len({j["lease_id"] for j in jobs}) == 3 and [j["restore"] for j in jobs] == [False, True, True]
        assert [j["cluster"] for j in jobs] == ["cklease", "cklease_h", "cklease"]  # the two names take turns
        rec = runs.load("cklease")
        assert [j["status"] for j in rec["jobs"]] == ["stopped", "stopped", "complete"] and rec["status"] == "complete"
        for before, after in zip(rec["jobs"], rec["jobs"][1:]):
            assert after["first_step"] == before["last_step"]  # 0 steps lost at each lease end
        assert rec["node_seconds_lost"] == 0
        assert _job_sha("cklease", rec["jobs"][-1]["job_id"]) == reference_long
        for j in jobs[:2]:  # the old leases went
            old = sites.open_site("local").cloud.get_lease(j["lease_id"])
            assert old is None or old.status == "DELETED", old
        assert find_cluster("cklease_h") is None  # the third lease's next one, if booked, went with the run's end
        # each handover's downtime, phase by phase: no lease, boot or SSH in it (the cluster was up), the checkpoint
        # staged, horovodrun, the restore, the first step; the parts add up to the whole
        downs = [e for e in ev if e["event"] == "downtime"]
        assert len(downs) == 2 and all(d["warm"] for d in downs)
        assert [j.get("resume_breakdown") for j in rec["jobs"][1:]] == [d["breakdown"] for d in downs]
        for b in (d["breakdown"] for d in downs):
            assert b.get("lease") is None and b.get("boot") is None and b.get("ssh + contextualize") is None, b
            bad = [k for k in flows.RESUME_PHASES if k not in ("lease", "boot", "ssh + contextualize", "install")
                   and (b.get(k) is None or b[k] < 0)]
            assert not bad, (bad, b)
            assert b["restore"] > 0, b
            assert abs(sum(v for k, v in b.items() if k != "total" and v is not None) - b["total"]) < 0.1, b
        # what `appliance ls` shows of it: each lease counted (the first two deleted at their handovers), and the
        # newest step of the training's total
        # all closed: the first two at their handovers, the last once the run finished, and a next lease booked ahead
        # for the third job (counted from the moment Blazar made it) when the run's end abandoned it
        leases = final["leases"]
        assert {j["lease_id"] for j in jobs} <= set(leases) and all(e["closed"] for e in leases.values()), leases
        # booked ahead and not used: the next lease the killed controller booked (its follower makes the next
        # cluster afresh), and the third job's, if booked, abandoned at the run's end
        ahead = set(leases) - {j["lease_id"] for j in jobs}
        assert len(ahead) <= 2 and ahead <= {e.get("lease_id") for e in final["asked"].values()}, final["asked"]
        following = [e for e in ev if e["event"] == "following"]  # the second job, followed to its lease's end
        assert [e["job_id"] for e in following] == [jobs[1]["job_id"]] and not [e for e in ev if e["event"] == "waiting"]
        assert [e.get("followed") for e in ev if e["event"] == "job end"] == [None, True, None]
        assert find_cluster("cklease") is None  # finished: its cluster and lease went (lease.keep_when_done: false)
        assert final["node_hours"]["spent"] > 0 and final["estimate"]["step"] == final["estimate"]["total_steps"]
        assert not [x for x in sites.open_site("local").cloud.list_app_creds()  # the controller's went with it
                    if x["name"].startswith("appliance-run-cklease-")]
        shown = []  # `appliance logs RUN --url`: the last job's output, from the store (as on any other machine)
        assert managed.store_logs("cklease", url="swift://ckpts/", lines=0, out=shown.append) == jobs[-1]["job_id"]
        assert any("[0|" in line for line in shown), shown[-5:]
    finally:
        pid = (state().get("controller") or {}).get("pid")
        if pid and state().get("status") not in ("finished", "failed", "stopped", "cancelled"):
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)  # a failed test leaves no controller behind
        released.unlink(missing_ok=True)
        flows.down("cklease")
        flows.down("cklease_h")


@pytest.mark.slow
def test_a_controller_killed_mid_handover_is_started_again_and_leaves_no_orphan_lease(cloud, reference_long,
                                                                                         tmp_path):
    """The fault matrix of a cold handover (appliance/killpoints.py), in one run, each controller killed with -9
    and `appliance run SPEC` typed again: the first once the handover's lease is in the run's state and before
    Blazar is asked; the second just after Blazar made it and before its answer was recorded anywhere; the third,
    which finds that lease by its recorded name and boots on it, once it holds the run's lock for the new job and
    before the job starts. The fourth takes the run over at once (the dead controller's process is gone, and no job
    runs on the head: no 300 s wait on the lock of a job that never started), finishes the handover on the lease
    already made, its downtime on the timeline, and the run ends: two leases in all (none left behind), one job at
    a time, the final weights the uninterrupted run's."""
    import signal
    import socket
    import subprocess
    import sys

    from appliance.cluster import find_cluster
    from appliance.flows import managed

    # limits.node_hours 3.5: the first lease (1 h on 2 nodes) leaves 1.5, so the second is cut to 45 minutes
    spec_path = digits_spec(tmp_path, "ckctl", url="swift://ckpts/", every=50, epochs=LONG,
                            extra="lease: {duration: 1h, stop_margin: 60s}\nlimits: {node_hours: 3.5}\n")

    def start(kill_at: str | None = None) -> int:
        env = {**os.environ, **({"APPLIANCE_KILL_AT": kill_at} if kill_at else {})}
        p = subprocess.run([sys.executable, "-m", "appliance.cli", "run", spec_path, "--json"], capture_output=True,
                           text=True, timeout=120, env=env)
        assert p.returncode == 0, p.stderr
        return json.loads(p.stdout)["pid"]

    def killed(pid: int, where: str) -> None:
        wait_for(f"the controller killed {where}", lambda: managed.gone_here(f"{socket.gethostname()}:{pid}:"))

    site = sites.open_site("local")
    cs = CheckpointStore("swift://ckpts/", "ckctl", site.store_creds())
    localcloud.admin("DELETE", "/requests")
    pid = start("lease-asked:2")  # the run's second lease: the handover's
    reader = managed._control_of("ckctl", None, "local", None)
    state = lambda: managed.read_timeline(reader) or {}  # noqa: E731
    try:
        cl = wait_for("the first commit", lambda: cs.committed() and find_cluster("ckctl"))
        first = cl.lease_id
        localcloud.admin("POST", "/advance", {"seconds": lease_left(cl) - 45})
        killed(pid, "with the handover's lease recorded and not asked for")
        pid = start("lease-made")
        killed(pid, "with the handover's lease made and not answered")
        pid = start("job-lock")
        killed(pid, "with the run's lock taken for a job it never started")
        pid = start()
        final = wait_for("the run to finish", lambda: (s := state()).get("status") in ("finished", "failed", "stopped")
                         and s)
        assert final["status"] == "finished", final["events"][-4:]
        ev = final["events"]
        controllers = [e for e in ev if e["event"] == "controller"]
        assert len(controllers) == 4 and [c["took_over"] for c in controllers[1:]] == [c["id"] for c in controllers[:3]]
        after = ev[ev.index(controllers[3]):]  # the third took the run over at once: no wait on the dead job's lock
        assert [e["event"] for e in after if e["event"] in ("job not started", "waiting")] == ["job not started"]
        downs = [e for e in after if e["event"] == "downtime"]
        assert len(downs) == 1 and downs[0]["takeover"] and not downs[0]["warm"], downs
        made = [r for r in localcloud.admin("GET", "/requests")["requests"] if r["method"] == "POST"
                and r["path"].rstrip("/").endswith("/leases") and (r["body"] or {}).get("name", "").startswith("ckctl-")]
        assert len(made) == 2, made  # the lease made before the second kill was used, no third one
        asked = final["asked"]  # the first controller's record of a lease it never asked for: closed, not counted
        assert [e for e in asked.values() if not e.get("lease_id") and not e.get("closed")] == [], asked
        assert len([e for e in asked.values() if e.get("lease_id")]) == 2, asked
        leases = final["leases"]  # both counted, the first by the controller that was killed
        assert len(leases) == 2 and leases[first]["closed"] and final["node_hours"]["limit"] == 3.5, leases
        second = leases[[e for e in ev if e["event"] == "job"][-1]["lease_id"]]
        minutes = (dt.datetime.fromisoformat(second["end"][:-1]) - dt.datetime.fromisoformat(second["start"][:-1]))
        assert dt.timedelta(minutes=44) <= minutes <= dt.timedelta(minutes=46), second
        # no orphan: the run's leases are gone, the second with its cluster once the run finished
        assert [x.id for x in site.cloud.list_leases() if x.name.startswith("ckctl-") and x.status != "DELETED"] == []
        assert find_cluster("ckctl") is None
        jobs = runs.load("ckctl")["jobs"]
        assert [j["status"] for j in jobs] == ["stopped", "not started", "complete"], jobs
        ran = [jobs[0], jobs[2]]
        assert ran[0]["ended"] <= ran[1]["started"]  # never two jobs at once
        assert ran[1]["first_step"] == ran[0]["last_step"]
        assert _job_sha("ckctl", ran[-1]["job_id"]) == reference_long
        # the store credential made for the job that never started went with the takeover, not a week later
        made = [r["body"]["application_credential"]["name"] for r in localcloud.admin("GET", "/requests")["requests"]
                if r["method"] == "POST" and r["path"].endswith("/application_credentials")
                and r["body"]["application_credential"]["name"].startswith(f"appliance-ckctl-{jobs[1]['job_id']}-")]
        assert len(made) == 1, made  # it had one
        assert not [x for x in site.cloud.list_app_creds() if x["name"] in made]
    finally:
        if state().get("status") not in ("finished", "failed", "stopped", "cancelled"):
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)  # a failed test leaves no controller behind
        flows.down("ckctl")


@pytest.mark.slow
def test_hosts_taken_at_lease_ends_the_run_fails_over_to_another_site_then_waits_for_its_next_free_slot(
        cloud, reference_long, tmp_path, monkeypatch):
    """Other projects' reservations take the hosts at two lease ends. At the first, every compute_local host is held
    (the two the run does not use from now on, the run's own two from its end on): the new lease is refused
    (Blazar's NotEnoughHostsAvailable) and the run goes on on its spec's alternative, gpu_local at the local cloud's
    other site, CHI@local2 (its own Keystone, Blazar and credentials: the controller holds one of its own there too;
    the checkpoints stay in the run's own store). At the second, the gpu_local hosts there are held too, for 30
    minutes from the end: the run reads both sites' host allocations, books the earliest slot (gpu_local at
    CHI@local2, when that reservation ends), says how long the wait is, and waits for it; the cloud's clock gets
    there and the run goes on. Each from the very step it stopped at; the final weights are the uninterrupted
    run's, and no lease of the run is left at either site."""
    import subprocess
    import sys

    from appliance.cluster import find_cluster
    from appliance.flows import managed

    monkeypatch.setenv("APPLIANCE_CONTROLLER_POLL", "1")
    spec_path = digits_spec(tmp_path, "ckalt", url="swift://ckpts/", every=50, epochs=LONG,
                            extra="lease: {duration: 1h, stop_margin: 60s}\n")
    Path(spec_path).write_text(Path(spec_path).read_text().replace(
        "nodes: {count: 2, node_type: compute_local, slots: 1}",
        "nodes: {count: 2, node_type: compute_local, slots: 1, alternatives: [{node_type: gpu_local, site: "
        "CHI@local2}]}"))
    site = sites.open_site("local")
    c, c2 = site.cloud, sites.open_site("local", "CHI@local2").cloud
    cs = CheckpointStore("swift://ckpts/", "ckalt", site.store_creds())
    p = subprocess.run([sys.executable, "-m", "appliance.cli", "run", spec_path, "--json"], capture_output=True,
                       text=True, timeout=120)
    assert p.returncode == 0, p.stderr
    reader = managed._control_of("ckalt", None, "local", None)
    state = lambda: managed.read_timeline(reader) or {}  # noqa: E731
    events = lambda kind: [e for e in state().get("events", []) if e["event"] == kind]  # noqa: E731
    others = []

    def someone_else(node_type: str, start, hours: float, at=c) -> None:
        others.append((at, at.create_lease(f"someone-else-{len(others)}", node_type, 2, dt.timedelta(hours=hours),
                                           start=start).id))

    def just_after(cl):
        info = sites.for_cluster(cl).cloud.get_lease(cl.lease_id)
        return info.end.replace(second=0, microsecond=0) + dt.timedelta(minutes=1)

    try:
        cl = wait_for("the first commit", lambda: cs.committed() and find_cluster("ckalt"))
        someone_else("compute_local", None, 3)  # the two idle ones, now
        someone_else("compute_local", just_after(cl), 3)  # the run's own two, from its end
        localcloud.admin("POST", "/advance", {"seconds": lease_left(cl) - 45})
        stopped = wait_for("the job on gpu_local to commit", lambda: (j := events("job"))[1:] and
                           j[-1]["node_type"] == "gpu_local" and cs.committed()[0].step > events("job end")[0]["step"]
                           and find_cluster("ckalt"))
        assert stopped.site.region == "CHI@local2" and c.get_lease(stopped.lease_id) is None  # a lease of the other
        someone_else("gpu_local", just_after(stopped), 0.5, c2)  # the run's gpu hosts, for 30 minutes from its end
        localcloud.admin("POST", "/advance", {"seconds": lease_left(stopped) - 45})
        waiting = wait_for("the wait for a slot", lambda: events("waiting for hosts"))[0]
        assert waiting["node_type"] == "gpu_local" and waiting["site"] == "CHI@local2", waiting
        assert 30 * 60 <= waiting["wait_s"] <= 35 * 60, waiting
        start = dt.datetime.fromisoformat(waiting["start"].replace("Z", ""))
        localcloud.admin("POST", "/advance", {"seconds": (start - c.now()).total_seconds() + 5})
        final = wait_for("the run to finish", lambda: (s := state()).get("status") in ("finished", "failed", "stopped",
                                                                                      "parked") and s)
        assert final["status"] == "finished", final["events"][-5:]
        ev = final["events"]
        assert [e["node_type"] for e in ev if e["event"] == "no hosts"] == ["compute_local", "compute_local",
                                                                             "gpu_local"]
        assert [(e["node_type"], e["site"]) for e in ev if e["event"] == "job"] == [
            ("compute_local", "local"), ("gpu_local", "CHI@local2"), ("gpu_local", "CHI@local2")]
        assert [e["node_type"] for e in ev if e["event"] == "hosts free"] == ["gpu_local"]
        rec = runs.load("ckalt")
        jobs = rec["jobs"]
        assert [j["status"] for j in jobs] == ["stopped", "stopped", "complete"]
        assert all(b["first_step"] == a["last_step"] for a, b in zip(jobs, jobs[1:]))  # 0 steps lost
        assert _job_sha("ckalt", jobs[-1]["job_id"]) == reference_long
        shown = CliRunner().invoke(cli_main, ["ls", "ckalt"]).output
        assert "no hosts free now: gpu_local at CHI@local2 booked from" in shown, shown
        assert "gpu_local at CHI@local2 free after" in shown, shown
        mine = [x for at in (c, c2) for x in at.list_leases() if x.name.startswith("ckalt")]
        assert not [x for x in mine if x.status not in ("TERMINATED", "DELETED")], mine  # released at both sites
    finally:
        for at, lid in others:
            at.delete_lease(lid)
        flows.down("ckalt")


@pytest.mark.slow
def test_admin_termination_resumes_from_the_last_commit(cloud, reference_long, tmp_path, said):
    spec_path = digits_spec(tmp_path, "ckgone", url="swift://ckpts/", every=50, epochs=LONG,
                            extra="lease: {duration: 1h}\n")
    cl = flows.up(spec_path)
    try:
        out = Lines()
        out.on("[checkpoint] step 100 committed",
               lambda line: localcloud.admin("POST", "/advance", {"seconds": lease_left(cl) + 60}))
        res = train(load_spec(spec_path), cl, out=out, heartbeat=2.0)
        assert res.exit_code != 0 and res.stopped is None
        last = max(c["step"] for c in res.commits)
        assert 100 <= last < LONG * 22
        said.clear()
        res2 = resume("ckgone", out=said.append)
        assert res2.exit_code == 0, res2.failure
        assert res2.resumed["step"] == last  # lost work <= one interval: what ran after the last commit
        assert sha(res2) == reference_long
        rec = runs.load("ckgone")
        assert rec["node_seconds_lost"] > 0 and rec["status"] == "complete"
    finally:
        flows.down("ckgone")


@pytest.mark.slow
def test_watchdog_extends_the_lease_when_the_spec_allows(cloud, reference_long, tmp_path):
    spec_path = digits_spec(tmp_path, "ckext", url="swift://ckpts/", every=200, epochs=LONG,
                            extra="lease: {duration: 1h, stop_margin: 60s, extend: true}\n")
    cl = flows.up(spec_path)
    try:
        out = Lines()
        # 400 s before the end: past the launcher's extension point (ahead of the node-side 10-min margin), not yet
        # at rank 0's own vendordata margin (5 min), which would stop the job had the extension come too late
        out.on(f"epoch 1/{LONG} ", lambda line: localcloud.admin("POST", "/advance", {"seconds": lease_left(cl) - 400}))
        res = train(load_spec(spec_path), cl, out=out)
        # not stopped: the lease was extended and the run finished
        assert res.exit_code == 0, (res.failure, res.stopped, [x for x in out.lines if "[watchdog]" in x
                                                               or "vendordata" in x or "lease" in x])
        assert res.stopped is None and out.has("[watchdog] extended lease")
        assert not out.has("lease end (vendordata)")
        assert lease_left(cl) > 3000  # one more hour
        assert sha(res) == reference_long
    finally:
        flows.down("ckext")


@pytest.mark.slow
def test_an_unchanged_keras_script_survives_the_lease_end(cloud, tmp_path, said):
    """Issue 13's first test: an ordinary Keras + Horovod script (examples/plain_fit, in the shape of Horovod's
    MNIST example: `.repeat().shuffle().batch()` with steps_per_epoch, rank 0's progress bar and ModelCheckpoint),
    nothing of the appliance in it, `checkpoint.url` in the spec. The lease end arrives mid-run: every rank stops
    after the same step with a committed checkpoint, the lease ends, and `appliance resume` continues it on a new
    lease with 0 steps lost."""
    epochs, steps = 40, 28
    p = tmp_path / "plain.yaml"
    p.write_text("\n".join([
        "name: ckplain", "cloud: local", "nodes: {count: 2, node_type: compute_local, slots: 1}",
        "image: appliance-cpu", "train:", f"  code: {ROOT / 'examples' / 'plain_fit'}",
        f"  command: python train.py --data repeat --epochs {epochs}",
        '  env: {"APPLIANCE_STOP_CHECK_SECONDS": "0.05"}',
        "checkpoint: {url: \"swift://ckpts/\", keep: 2}", "lease: {duration: 1h, stop_margin: 60s}"]) + "\n")
    cl = flows.up(str(p))
    try:
        out = Lines()
        at_epoch = random.randint(2, 10)
        out.on(f"Epoch {at_epoch}/{epochs}", lambda line: localcloud.admin("POST", "/advance",
                                                                          {"seconds": lease_left(cl) - 45}))
        res = train(load_spec(str(p)), cl, out=out)
        assert res.exit_code == 75, (res.failure, out.lines[-20:])
        assert out.has("[appliance] protected (level 2, ")
        st = res.stopped
        assert st["committed"] and st["step"] < epochs * steps
        localcloud.admin("POST", "/advance", {"seconds": 120})  # the lease ends: servers and disks go
        assert flows.status("ckplain")["lease_status"] == "TERMINATED"
        said.clear()
        res2 = resume("ckplain", out=said.append)
        assert res2.exit_code == 0, (res2.failure, said[-20:])
        assert any("new lease" in m for m in said)
        assert res2.resumed["step"] == st["step"]  # 0 steps lost beyond the stop step
        assert any(f"after {epochs * steps} optimizer steps" in m for m in said)
        assert runs.load("ckplain")["status"] == "complete"
    finally:
        flows.down("ckplain")


@pytest.mark.slow
def test_a_custom_loop_keeps_its_own_checkpoint_files_across_the_lease_end(cloud, tmp_path, said):
    """Level 3: a custom Horovod loop (examples/custom_loop) writing ./checkpoint-N.h5 itself. Nothing stops it;
    at the stop request rank 0's working directory is committed to the store, the lease ends under the job (the
    report says so and names the synced files), and `appliance resume` puts the files back on a new lease before
    the script starts: the script resumes from its newest file. (The resumed job runs a few epochs more, not to
    the first job's 400: its spec says so, as a user's may.)"""
    def loop_spec(epochs: int) -> Path:
        p = tmp_path / f"loop-{epochs}.yaml"
        p.write_text("\n".join([
            "name: ckloop", "cloud: local", "nodes: {count: 2, node_type: compute_local, slots: 1}",
            "image: appliance-cpu", "train:", f"  code: {ROOT / 'examples' / 'custom_loop'}",
            f"  command: python train.py --epochs {epochs}",
            "checkpoint: {url: \"swift://ckpts/\", keep: 2}", "lease: {duration: 1h, stop_margin: 60s}"]) + "\n")
        return p

    p = loop_spec(400)
    cl = flows.up(str(p))
    try:
        out = Lines()
        # 58 s before the end: inside the stop margin (60 s), with room for the final sync on a loaded machine (at
        # 45 s the end once came first in a full `make test` and nothing was synced)
        out.on("epoch 3/", lambda line: localcloud.admin("POST", "/advance", {"seconds": lease_left(cl) - 58}))
        # the last sync before the end is committed: the lease ends, under the running job
        out.on("the last before the lease end", lambda line: localcloud.admin("POST", "/advance", {"seconds": 120}))
        res = train(load_spec(str(p)), cl, out=out)
        assert out.has("[appliance] protected (level 3 only, ")
        assert res.exit_code != 0 and res.failure.startswith("the lease ended")
        assert "the working directory was synced" in res.failure, res.failure
        synced = [int(x.split("epoch ")[1].split("/")[0]) for x in out.lines if "] epoch " in x and "/400 loss" in x]
        assert synced, out.lines[-20:]
        said.clear()
        epochs = max(synced) + 3
        res2 = resume("ckloop", spec_path=str(loop_spec(epochs)), out=said.append)
        assert res2.exit_code == 0, (res2.failure, said[-20:])
        assert any("new lease" in m for m in said)
        resumed = [int(m.split("resuming from epoch ")[1]) for m in said if "resuming from epoch " in m]
        assert resumed and 3 <= resumed[0] <= max(synced), (resumed, max(synced))
        assert any(f"done after epoch {epochs}" in m for m in said)
    finally:
        flows.down("ckloop")


@pytest.mark.slow
def test_a_second_job_of_a_run_on_another_cluster_is_refused_by_the_store_lock(cluster2, swift, st_env,
                                                                               reference_long, tmp_path):
    """Issue 14 item 3: while a job of the run runs on one cluster, `appliance resume` of the same run on another
    cluster (here: node2 alone, another head node, so the head's own lock cannot see it) is refused by the run's lock
    in the store, with one line naming the running job, before it touches any node; the running job is undisturbed
    (bit-exact against the reference) and releases the lock when it ends."""
    from appliance.store.runlock import RunLock

    two = Cluster(name="pt-two", cloud="testbed", nodes=[cluster2.nodes[1]], key_file=cluster2.key_file,
                  known_hosts=cluster2.known_hosts, python=cluster2.python, etc_dir=cluster2.etc_dir,
                  testbed=cluster2.testbed)
    two.save()
    spec_path = digits_spec(tmp_path, "cklock", url="swift://ckpts/", epochs=LONG)
    refused: list[str] = []

    def second(line):
        try:
            resume("cklock", spec_path=spec_path, cluster_name="pt-two", out=lambda m: None)
            refused.append("not refused")
        except Exception as e:  # noqa: BLE001
            refused.append(str(e))

    out = Lines()
    out.on(f"epoch 3/{LONG} ", second)
    res = train(load_spec(spec_path), cluster2, out=out)
    assert res.exit_code == 0, res.failure
    assert len(refused) == 1 and "run 'cklock' already has a job running: cklock-" in refused[0], refused
    assert "on cluster pt-cluster (head node1)" in refused[0]
    assert sha(res) == reference_long
    cs = store_for(swift, "cklock")
    assert RunLock(cs, "", cluster="", head="").read() is None  # released at the end
