"""``dataset.mode: stream`` end to end: examples/stream/train.py (an ordinary Keras + Horovod script that reads its
data with ``open_stream``) on 2 testbed nodes through horovodrun, the packed digits in a real Swift, each node's
cache a quarter of the dataset or less. Nothing is staged; every shard a rank reads is fetched while it trains
and verified against index.json's MD5. A stop mid-epoch and a resume end on the uninterrupted run's weights, and
the resume reads nothing twice."""

import json
import random
import re
import subprocess
import sys
from pathlib import Path

import pytest

from appliance import report
from appliance.flows import resume, run_job as train
from appliance.node.stream import epoch_order, rank_share, samples_per_epoch
from appliance.spec import load_spec, parse_size
from appliance.store.objects import StoreCreds, open_store
from conftest import NETNS_OK, ROOT
from test_keras_fit import final_weights, spec_file as keras_fit_spec

pytestmark = pytest.mark.skipif(not NETNS_OK, reason="needs network namespaces")

CODE = ROOT / "examples" / "stream"
EPOCHS, BATCH, SHARD = 3, 32, 16384
URL = "swift://streamdata/digits/"


@pytest.fixture(scope="module")
def packed(swift, tmp_path_factory):
    """The digits as files, packed into tar shards of 16 KB in the test's Swift: its index."""
    from appliance.data.pack import pack

    src = tmp_path_factory.mktemp("digits-files")
    subprocess.run([sys.executable, str(CODE / "make_dataset.py"), str(src)], check=True, capture_output=True)
    store, prefix = open_store(URL, StoreCreds(auth_url=swift.auth_url, user=swift.user, key=swift.key))
    store.ensure_container()
    return pack(src, store, prefix, shard_size=SHARD)


def spec_file(tmp_path: Path, name: str, cache: str, *, url: str | None = None, env: dict | None = None) -> str:
    return keras_fit_spec(tmp_path, name, "", url=url, env=env, code=CODE,
                          command=f"python train.py --epochs {EPOCHS} --batch-size {BATCH}",
                          more=(f"dataset: {{source: {json.dumps(URL)}, mode: stream, cache: {cache}}}",))


def epochs_said(lines: list[str]) -> list[dict]:
    pat = re.compile(r"stream epoch (\d+): rank 0 read (\d+) shard\(s\), (\d+) ready when asked, (\d+) waited for "
                     r"\(([\d.]+)s\), (\d+) fetched again; cache peak ([\d.]+ [KMGT]?B) of ([\d.]+ [KMGT]?B)")
    keys = ("epoch", "read", "ready", "stalls", "waited", "refetched", "peak", "cap")
    return [{k: parse_size(v.replace(" ", "")) if k in ("peak", "cap") else float(v) for k, v in zip(keys, m.groups())}
            for m in (pat.search(x) for x in lines) if m]


@pytest.mark.slow
def test_a_dataset_four_times_the_cache_streams_to_the_end_and_resumes_mid_epoch_exactly(
        packed, cluster2, swift, st_env, tmp_path):
    total = sum(s["size"] for s in packed["shards"])
    cache = f"{total // 4 // 1000}KB"  # each node's cache: a quarter of the dataset (its 1 rank gets all of it)
    per_epoch = samples_per_epoch(packed, 2, BATCH)
    steps = per_epoch // BATCH

    from appliance.flows import RunContext, check_online, stage_to_nodes

    spec = load_spec(spec_file(tmp_path, "streamref", cache))
    staged: list[str] = []
    assert stage_to_nodes(RunContext.of(spec), cluster2, URL, "data", mode="stream", out=staged.append) == {}
    assert f"{len(packed['shards'])} shard(s), 1797 sample(s)" in staged[0] and "nothing is staged" in staged[0]
    assert check_online(spec)["dataset"]["shards"] == len(packed["shards"])
    ref: list[str] = []
    res = train(spec, cluster2, out=ref.append)
    assert res.exit_code == 0, (res.failure, ref[-30:])
    ref_sha, n = final_weights(ref)
    assert n == EPOCHS * steps
    said = epochs_said(ref)
    assert [e["epoch"] for e in said] == list(range(EPOCHS)), ref[-40:]
    for e in said:  # rank 0 read exactly the shards of its share it needed, never more than the cache at once
        mine = rank_share(epoch_order(7, int(e["epoch"]), len(packed["shards"])), 0, 2)
        need, left = 0, per_epoch
        for j in mine:
            if left <= 0:
                break
            need, left = need + 1, left - packed["shards"][j]["samples"]
        assert e["read"] == need and e["refetched"] == 0
        assert 0 < e["peak"] <= e["cap"] and abs(e["cap"] - parse_size(cache)) <= 0.05 * parse_size(cache)
    assert 4 * parse_size(cache) <= total
    assert any("stream: the ranks read" in x for x in ref)

    stop_at = random.randint(steps + 1, 2 * steps - 2)  # mid-epoch 1
    said1: list[str] = []
    res1 = train(load_spec(spec_file(tmp_path, "streamrun", cache, url="swift://streamckpt/",
                                     env={"APPLIANCE_FAULT": f"stop-at:{stop_at}"})), cluster2, out=said1.append)
    assert res1.exit_code == 75 and res1.stopped["step"] == stop_at, (res1.failure, said1[-30:])
    cluster2.save()
    out2: list[str] = []
    with report.to(out2.append):
        res2 = resume("streamrun", spec_path=spec_file(tmp_path, "streamrun", cache, url="swift://streamckpt/"),
                      cluster_name=cluster2.name, out=out2.append)
    assert res2.exit_code == 0, (res2.failure, out2[-30:])
    assert res2.resumed["step"] == stop_at
    batch = stop_at - steps
    assert any(f"the stream continues at epoch 1, batch {batch}" in x for x in out2), out2[-40:]
    assert not any("skipped the" in x for x in out2)
    assert final_weights(out2) == (ref_sha, EPOCHS * steps), f"stopped after step {stop_at}"
    # the resumed epoch read only the shards from the one holding the next sample on
    first = epochs_said(out2)[0]
    assert first["epoch"] == 1 and first["read"] < epochs_said(ref)[1]["read"] or batch * BATCH < 8
    # `appliance ls RUN` shows each job's waits for the store
    from appliance.checkpoint.runs import run_details
    from appliance.cli.views import format_stream

    job = run_details("streamrun")["jobs"][-1]
    assert job["stream"]["epochs"] == EPOCHS - 1 and job["stream"]["shards"] == sum(e["read"] for e in epochs_said(out2))
    assert "for shards from the store" in format_stream(job["stream"])
    # the job's dataset credential was on every node while it ran, and is gone from every node now
    assert any("stream: the ranks read" in x for x in out2)
    from appliance.remote import Session
    from appliance.train.launch import run_dir

    with Session(cluster2) as s:
        left = s.each(lambda r: r.run(f"ls -a {run_dir(cluster2, 'streamrun')}").out)
    assert len(left) == 2 and not any(".stream-creds" in x for x in left.values()), left


@pytest.mark.slow
def test_a_streamed_run_survives_its_lease_end_on_the_local_cloud(cloud, tmp_path, said):
    """On the local cloud (Keystone, Blazar, Nova, Ceph RGW): the packed digits in its store, every node reading them
    with the job's own application credential, as on Chameleon. The lease end arrives mid-epoch; `appliance resume`
    continues on a new lease's nodes (new disks, an empty cache) at the exact next sample and ends on the weights of
    an uninterrupted run; the job's dataset credentials are deleted."""
    from appliance import flows, localcloud, sites
    from test_checkpoint import Lines, lease_left

    src = tmp_path / "files"
    subprocess.run([sys.executable, str(CODE / "make_dataset.py"), str(src)], check=True, capture_output=True)
    index = flows.data_pack(str(src), URL, cloud="local", shard_size=SHARD)
    cache = f"{sum(s['size'] for s in index['shards']) // 4 // 1000}KB"
    epochs = 8

    def spec(name: str, url: str | None) -> str:
        return keras_fit_spec(tmp_path, name, "", url=url, env={"APPLIANCE_STOP_CHECK_SECONDS": "0.05"}, code=CODE,
                              command=f"python train.py --epochs {epochs} --batch-size {BATCH}",
                              more=(f"dataset: {{source: {json.dumps(URL)}, mode: stream, cache: {cache}}}",
                                    "lease: {duration: 1h, stop_margin: 60s}"))
    path = spec("ckstream", "swift://ckpts/")
    cl = flows.up(path)
    try:
        ref: list[str] = []
        assert train(load_spec(spec("ckstreamref", None)), cl, out=ref.append).exit_code == 0, ref[-20:]
        out = Lines()
        at_epoch = random.randint(2, epochs - 2)
        out.on(f"Epoch {at_epoch}/{epochs}", lambda line: localcloud.admin("POST", "/advance",
                                                                          {"seconds": lease_left(cl) - 45}))
        res = train(load_spec(path), cl, out=out)
        assert res.exit_code == 75 and res.stopped["committed"], (res.failure, out.lines[-20:])
        localcloud.admin("POST", "/advance", {"seconds": 120})  # the lease ends: servers and disks go
        said.clear()
        res2 = resume("ckstream", out=said.append)
        assert res2.exit_code == 0, (res2.failure, said[-20:])
        assert any("new lease" in m for m in said) and res2.resumed["step"] == res.stopped["step"]
        assert any("the stream continues at epoch" in m for m in said), said[-30:]
        assert final_weights(said) == final_weights(ref)
        left = [x["name"] for x in sites.open_site("local").cloud.list_app_creds()]
        assert not [x for x in left if x.startswith("appliance-ckstream") and "-data-" in x], left
    finally:
        flows.down("ckstream")
