"""``dataset.mode: stream`` end to end, on the local cloud (Keystone, Blazar, Nova, Ceph RGW): examples/stream/train.py
(an ordinary Keras + Horovod script that reads its data with ``open_stream``) on 2 nodes through horovodrun, the
packed digits in the cloud's store, each node's data disk a quarter of the dataset and the cache its default (half
of what is free there). Nothing is staged; every shard a rank reads is fetched while it trains, with the job's own
application credential on every node (as on Chameleon), and verified against index.json's MD5. In a managed run
(`appliance run`) the lease end arrives mid-epoch; the run goes on by itself on a new lease's nodes (new disks, an
empty cache) at the exact next sample, reads nothing twice, and ends on the weights of an uninterrupted run. Begun
on 2 ranks and resumed on 4 with the global batch kept (``checkpoint.resize: batch``), a run follows the
uninterrupted run's loss curve."""

import json
import random
import re
import subprocess
import sys
from pathlib import Path

import pytest

from appliance.flows import run_job as train
from appliance.node.stream_order import WINDOW, Order, reads
from appliance.spec import load_spec, parse_size
from conftest import NETNS_OK, ROOT
from test_keras_fit import final_weights, spec_file as keras_fit_spec

pytestmark = pytest.mark.skipif(not NETNS_OK, reason="needs network namespaces")

CODE = ROOT / "examples" / "stream"
EPOCHS, BATCH, SHARD = 8, 32, 16384
ACCURACY_FLOOR = 0.9  # rank 0's training accuracy in the last epoch (Keras' progress line)
# each epoch's loss after a resume on another world size, as a share of the uninterrupted run's (measured: 0.4-2.2%)
LOSS_TOLERANCE = 0.1
URL = "swift://streamdata/digits/"


def spec_file(tmp_path: Path, name: str, *, url: str | None = None, epochs: int = EPOCHS, env: dict | None = None,
              cache: int | None = None) -> str:
    return keras_fit_spec(tmp_path, name, "", url=url, env={"APPLIANCE_STOP_CHECK_SECONDS": "0.05", **(env or {})},
                          code=CODE, command=f"python train.py --epochs {epochs} --batch-size {BATCH}",
                          more=(f"dataset: {{source: {json.dumps(URL)}, mode: stream"
                                + (f", cache: {cache}B}}" if cache else "}"),
                                "lease: {duration: 1h, stop_margin: 60s, keep_when_done: true}"))


def epoch_metrics(lines: list[str]) -> list[tuple[float, float]]:
    """Rank 0's Keras (loss, accuracy) of each epoch (the last line of its progress bar), in order."""
    pat = re.compile(r"^\[0\|[^]]+\] (\d+)/\1 \[=+\] - .*? loss: ([\d.]+) - accuracy: ([\d.]+)")
    return [(float(m.group(2)), float(m.group(3))) for m in map(pat.search, lines) if m]


def resumed_on_4_ranks(cl, tmp_path: Path, disk: int, steps: int, ref_loss: list[float]) -> None:
    """The uninterrupted run's first 4 epochs (``ref_loss``: its loss each epoch) with ``checkpoint.resize: batch``,
    stopped with a commit after a step of epoch 0 on the cluster's 2 ranks, resumed on the same 2 nodes with 2 ranks
    each (4 ranks, 16 samples a rank: the global batch of 64 kept; each node's cache 0.8 of its data disk, so each
    of its ranks holds the 16 shards the shuffle mixes). The same global batches (tests/test_stream.py checks every
    step), so each whole epoch after the resume has about the uninterrupted run's loss (not bit-exact: the ranks'
    sums and dropout draws differ)."""
    from appliance import report
    from appliance.flows import resume
    from appliance.flows.gpucheck import view

    def spec(env: dict | None = None) -> Path:
        p = Path(spec_file(tmp_path, "ckresize", url="swift://ckpts/", epochs=4, cache=disk * 4 // 5, env=env))
        p.write_text(p.read_text().replace("keep: 2}", "keep: 2, resize: batch}"))
        return p

    stop = random.randint(4, steps - 4)
    res = train(load_spec(spec({"APPLIANCE_FAULT": f"stop-at:{stop}"})), cl, out=lambda m: None)
    assert res.exit_code == 75 and res.stopped["committed"] and res.stopped["step"] == stop, res.failure
    path = spec()
    four = view(cl, {n.name: 2 for n in cl.nodes})  # never saved as the cluster's record
    node_type = load_spec(str(path)).nodes.node_type
    out: list[str] = []
    with report.to(out.append):
        res = resume("ckresize", spec_path=str(path), out=out.append, acquire=lambda phases: (four, node_type))
    assert res.exit_code == 0, (res.failure, out[-30:])
    assert res.resumed["step"] == stop and res.resumed["world_size"] == 4, res.resumed
    assert res.resumed["checkpoint_world_size"] == 2 and final_weights(out)[1] == 4 * steps
    assert any("the stream keeps the run's global batch of 64 (checkpoint.resize: batch): 16 a rank on 4 "
               "rank(s), not 32" in x for x in out), out[-30:]
    assert any(f"the stream continues at epoch 0, batch {stop}" in x for x in out), out[-30:]
    loss = [x[0] for x in epoch_metrics(out)]
    assert len(ref_loss) == EPOCHS and len(loss) == 4, (ref_loss, loss)
    for a, b in zip(ref_loss[1:4], loss[1:]):  # epochs 1-3, read whole on 4 ranks
        assert abs(a - b) <= LOSS_TOLERANCE * a, (f"stopped after step {stop}", ref_loss, loss)


def epochs_said(lines: list[str]) -> list[dict]:
    pat = re.compile(r"stream epoch (\d+): rank 0 read (\d+) shard\(s\), (\d+) ready when asked, (\d+) waited for "
                     r"\(([\d.]+)s\), (\d+) fetched again; cache peak ([\d.]+ [KMGT]?B) of ([\d.]+ [KMGT]?B)")
    keys = ("epoch", "read", "ready", "stalls", "waited", "refetched", "peak", "cap")
    return [{k: parse_size(v.replace(" ", "")) if k in ("peak", "cap") else float(v) for k, v in zip(keys, m.groups())}
            for m in (pat.search(x) for x in lines) if m]


def order_of(index: dict) -> Order:
    """The run's order: seed 7, 2 ranks (the first job's: 2 canonical shares), the default shuffle window."""
    return Order(tuple(s["samples"] for s in index["shards"]), 7, 2 * BATCH, 2, WINDOW)


def shards_needed(index: dict, epoch: int, per_epoch: int, since_start: bool = False) -> int:
    """How many shards rank 0 starts reading in (Keras) ``epoch``, of ``per_epoch`` samples: its cache's reads, by a
    stream started at that epoch; ``since_start``: by one reading since step 0 (a shard whose visit began in the
    epoch before and goes on into this one is not read again)."""
    if since_start:
        it = reads(order_of(index), 0, 2, 0)
        return [sum(next(it)[3] for _ in range(per_epoch)) for _ in range(epoch + 1)][epoch]
    it = reads(order_of(index), 0, 2, epoch * per_epoch // BATCH)
    return sum(next(it)[3] for _ in range(per_epoch))


@pytest.mark.slow
def test_a_dataset_four_times_the_nodes_data_disks_streams_across_a_lease_end_and_resumes_exactly(cloud, tmp_path,
                                                                                                    said, monkeypatch):
    from appliance import flows, localcloud, sites
    from appliance.checkpoint.runs import run_details
    from appliance.cli.views import format_stream
    from appliance.cluster import find_cluster
    from appliance.flows import RunContext, check_online, stage_to_nodes
    from test_checkpoint import Lines, lease_left

    src = tmp_path / "files"
    subprocess.run([sys.executable, str(CODE / "make_dataset.py"), str(src)], check=True, capture_output=True)
    index = flows.data_pack(str(src), URL, cloud="local", shard_size=SHARD)
    total = sum(s["size"] for s in index["shards"])
    disk = total // 4 // 4096 * 4096  # each node's data disk (/mnt/local/data, where dataset.dest puts it): a quarter of the dataset
    per_epoch = order_of(index).steps_per_epoch * BATCH
    steps = per_epoch // BATCH
    path = spec_file(tmp_path, "ckstream", url="swift://ckpts/")
    localcloud.admin("POST", "/terms", {"data_disk": disk})  # the nodes booted from now on have one
    try:
        cl = flows.up(path)
    finally:
        localcloud.admin("POST", "/terms", {"data_disk": None})  # the next lease's nodes: the term is set again below
    try:
        from appliance.remote import Session

        with Session(cl) as s:
            sizes = s.each(lambda r: r.run("df -B1 --output=size /mnt/local/data | tail -1").out.strip())
        assert [int(x) for x in sizes.values()] == [disk] * 2, sizes
        spec = load_spec(spec_file(tmp_path, "ckstreamref"))
        staged: list[str] = []
        assert stage_to_nodes(RunContext.of(spec), cl, URL, "data", mode="stream", out=staged.append) == {}
        assert f"{len(index['shards'])} shard(s), 1797 sample(s)" in staged[0] and "nothing is staged" in staged[0]
        assert check_online(spec)["dataset"]["shards"] == len(index["shards"])

        ref: list[str] = []  # uninterrupted (no checkpoint.url)
        res = train(spec, cl, out=ref.append)
        assert res.exit_code == 0, (res.failure, ref[-30:])
        assert final_weights(ref)[1] == EPOCHS * steps
        said_ref = epochs_said(ref)
        assert [e["epoch"] for e in said_ref] == list(range(EPOCHS)), ref[-40:]
        for e in said_ref:  # rank 0 read exactly the shards it needed, never holding more than the cache
            assert e["read"] == shards_needed(index, int(e["epoch"]), per_epoch, since_start=True)
            assert e["refetched"] == 0
            assert 0 < e["peak"] <= e["cap"] and abs(e["cap"] - disk / 2) <= 0.05 * disk  # half the free disk
        assert 4 * disk <= total
        assert epoch_metrics(ref)[-1][1] >= ACCURACY_FLOOR, epoch_metrics(ref)

        resumed_on_4_ranks(cl, tmp_path, disk, steps, [x[0] for x in epoch_metrics(ref)])

        # the managed run (`appliance run SPEC --foreground`): its lease's end comes mid-epoch (the cloud's clock
        # jumps to 45 s before it, inside the 60 s stop margin): the job stops after a step with a commit, and the
        # run goes on by itself on a new lease's nodes (new data disks, an empty cache)
        out = Lines()
        at_epoch = random.randint(2, EPOCHS - 2)
        out.on(f"Epoch {at_epoch}/{EPOCHS}", lambda line: localcloud.admin("POST", "/advance",
                                                                          {"seconds": lease_left(cl) - 45}))
        monkeypatch.setenv("APPLIANCE_CONTROLLER_POLL", "0.5")
        said.clear()
        localcloud.admin("POST", "/terms", {"data_disk": disk})
        try:
            res2 = flows.run_managed(path, out=out)
        finally:
            localcloud.admin("POST", "/terms", {"data_disk": None})
        said += out.lines
        assert res2.exit_code == 0, (res2.failure, said[-20:])
        jobs = run_details("ckstream")["jobs"]
        assert [j["status"] for j in jobs] == ["stopped", "complete"], jobs
        stop = jobs[0]["last_step"]
        assert jobs[1]["first_step"] == stop and res2.resumed["step"] == stop  # 0 steps lost
        assert find_cluster("ckstream").lease_id != cl.lease_id  # a new lease's nodes
        epoch, batch = divmod(stop, steps)
        assert epoch == at_epoch - 1 and any(f"the stream continues at epoch {epoch}, batch {batch}" in m
                                             for m in said), said[-30:]
        assert not any("skipped the" in m for m in said)
        assert final_weights(out.lines) == final_weights(ref), f"stopped after step {stop}"
        second = out.lines[next(i for i, x in enumerate(out.lines) if "the stream continues at" in x):]
        assert all(0 < e["peak"] <= e["cap"] <= disk / 2 * 1.05 for e in epochs_said(second))  # new nodes, new disks
        first = epochs_said(second)[0]  # the resumed epoch read only from the shard of the next sample on
        assert first["epoch"] == epoch and first["read"] <= shards_needed(index, epoch, per_epoch)
        job = jobs[-1]  # `appliance ls RUN` shows the job's waits for the store
        assert job["stream"]["epochs"] == EPOCHS - epoch
        assert job["stream"]["shards"] == sum(e["read"] for e in epochs_said(second))
        assert "for shards from the store" in format_stream(job["stream"])
        # the bytes each epoch read from the store (every rank): at least rank 0's, at most the job's epochs' worth
        # of the whole dataset (the cache here holds a fraction of it: little is kept from one epoch to the next)
        rank0 = job["stream"]["rank0_store_bytes"]
        assert len(rank0) == EPOCHS - epoch and job["stream"]["dataset_bytes"] == total
        assert sum(rank0) < job["stream"]["store_bytes"] <= (EPOCHS - epoch + 1) * total
        assert "from the store" in next(x for x in second if f"stream epoch {epoch + 1}:" in x)
        from appliance.train.launch import run_dir

        now = find_cluster("ckstream")  # the new lease's nodes: the job's credentials file is gone from each
        with Session(now) as s:
            there = s.each(lambda r: r.run(f"ls -a {run_dir(now, 'ckstream')}").out)
        assert len(there) == 2 and all("code" in x and ".stream-creds" not in x for x in there.values()), there
        left = [x["name"] for x in sites.open_site("local").cloud.list_app_creds()]  # the dataset credentials: gone
        assert not [x for x in left if x.startswith("appliance-ckstream") and "-data-" in x], left
    finally:
        flows.down("ckstream")
