"""`appliance bench`: scaling arithmetic, bad arguments, and a real run on 1 and 2 testbed nodes."""

import json

import pytest

from appliance.bench import BenchConfig, bench_spec, node_counts, overhead, run_bench, scaling
from appliance.cluster import Cluster, Node, load_cluster
from appliance.errors import ApplianceError
from appliance.spec import load_spec
from conftest import ROOT, needs_netns, write_spec


def _cell(model, batch, agg, ranks):
    return {"model": model, "batch": batch, "aggregate": agg, "ranks": ranks, "allreduce_share": 0.1,
            "per_rank_spread": 0.0, "step_ms": 1.0, "local_step_ms": 0.9}


def test_scaling_efficiency_is_measured_aggregate_over_n_times_one_node():
    runs = [{"nodes": 1, "cells": [_cell("cnn", 32, 100.0, 1)]},
            {"nodes": 2, "cells": [_cell("cnn", 32, 180.0, 2)]},
            {"nodes": 4, "cells": [_cell("cnn", 32, 300.0, 4)]}]
    by_n = {s["nodes"]: s for s in scaling(runs)}
    assert by_n[1]["speedup"] == 1.0 and by_n[1]["efficiency"] == 1.0
    assert by_n[2]["speedup"] == pytest.approx(1.8) and by_n[2]["efficiency"] == pytest.approx(0.9)
    assert by_n[4]["speedup"] == pytest.approx(3.0) and by_n[4]["efficiency"] == pytest.approx(0.75)
    # without a 1-node run the baseline is the fewest nodes measured
    by_n = {s["nodes"]: s for s in scaling(runs[1:])}
    assert by_n[4]["efficiency"] == pytest.approx(300 * 2 / (180 * 4))


def test_node_counts_and_bad_config():
    nodes = [Node(f"n{i}", f"10.0.0.{i}", None, "/tmp") for i in range(1, 6)]
    cl = Cluster(name="c", cloud="testbed", nodes=nodes)
    assert node_counts(BenchConfig(), cl) == [1, 2, 4, 5]
    assert node_counts(BenchConfig(nodes=[2, 1, 2]), cl) == [1, 2]
    with pytest.raises(ApplianceError, match="cannot bench on 6"):
        node_counts(BenchConfig(nodes=[6]), cl)
    with pytest.raises(ApplianceError, match="unknown model"):
        BenchConfig(models=["vgg"])
    with pytest.raises(ApplianceError, match="positive batch"):
        BenchConfig(batch_sizes=[0])
    sub = cl.subset(2)
    assert [n.name for n in sub.nodes] == ["n1", "n2"] and sub.is_subset and not cl.is_subset


def test_bench_spec_replaces_the_job_only(tmp_path):
    spec = load_spec(write_spec(tmp_path, "python train.py", code=ROOT / "examples" / "digits", name="digits",
                                extra="checkpoint: {url: 'file:///tmp/x', every_steps: 5}\n"))
    b = bench_spec(spec, BenchConfig(models=["mlp"], batch_sizes=[8]))
    assert b.name == "digits-bench" and b.nodes == spec.nodes and b.cloud == spec.cloud
    assert b.checkpoint.url is None and b.dataset is None
    assert b.train.command.startswith("python synthetic.py --models mlp --batch-sizes 8 ")
    assert (b.code_dir / "synthetic.py").exists()


def test_a_bench_on_part_of_a_cluster_puts_the_whole_back_quietly_and_writes_its_report(tmp_path, monkeypatch,
                                                                                          said):
    """The benchmark's steps with a fake job runner (the job itself runs in the e2e test below): benching 1 node
    of 2 contextualizes the whole cluster again at the end, without a word, and writes bench.md. It failed in
    `make test` when the bench package's own `report` module shadowed the reporter (AttributeError)."""
    from types import SimpleNamespace

    import appliance.bench.report  # noqa: F401 - imported first, as the CLI does: it becomes the package's `report`
    from appliance.provision import contextualize as ctx_mod
    from appliance.report import get

    spec = load_spec(write_spec(tmp_path, "python train.py", code=ROOT / "examples" / "digits", name="bq"))
    nodes = [Node(f"n{i}", f"10.0.0.{i}", None, "/tmp") for i in (1, 2)]
    cluster = Cluster(name="bq", cloud="testbed", nodes=nodes)
    put_back = []

    def contextualize(cl, session=None):
        get("appliance.provision.contextualize").info("contextualized 2 node(s)")
        put_back.append(len(cl.nodes))

    def job(bspec, part, out=None):
        cell = _cell("mlp", 8, 100.0, part.world_size) | {"device": "CPU"}
        return SimpleNamespace(job_id="j", exit_code=0, wall_s=1.0, log_path="x.log", failure=None,
                               results={0: {"hosts": ["n1"], "bench": [cell]}})

    monkeypatch.setattr(ctx_mod, "contextualize", contextualize)
    monkeypatch.setattr("appliance.bench.report.plots", lambda rep, out_dir: [])
    rep = run_bench(spec, cluster, BenchConfig(models=["mlp"], batch_sizes=[8], nodes=[1]), out_dir=tmp_path / "o",
                    run_job=job)
    assert put_back == [2] and not [m for m in said if "contextualized" in m]
    assert any(m.startswith("[bench] 1 node(s)") for m in said)
    assert rep["runs"][0]["nodes"] == 1 and (tmp_path / "o" / "bench.md").exists()


@pytest.mark.slow
@needs_netns
def test_bench_on_one_and_two_nodes(cluster2, tmp_path):
    spec = load_spec(write_spec(tmp_path, "python train.py", code=ROOT / "examples" / "digits", name="bt"))
    cluster2.save()
    before = load_cluster(cluster2.name)
    cfg = BenchConfig(models=["mlp"], batch_sizes=[8, 32], steps=5, warmup=2)
    lines = []
    rep = run_bench(spec, cluster2, cfg, out_dir=tmp_path / "out", out=lines.append)
    assert [r["nodes"] for r in rep["runs"]] == [1, 2], "\n".join(lines[-30:])
    assert rep["runs"][1]["hosts"] == ["node1", "node2"]  # both ranks took part, on two hosts
    cells = {(s["model"], s["batch"], s["nodes"]): s for s in rep["scaling"]}
    assert set(cells) == {("mlp", 8, 1), ("mlp", 32, 1), ("mlp", 8, 2), ("mlp", 32, 2)}
    for (_, b, n), s in cells.items():
        assert s["aggregate"] > 0 and s["ranks"] == n
        assert s["efficiency"] == pytest.approx(s["aggregate"] / (n * cells[("mlp", b, 1)]["aggregate"]))
        assert 0 <= s["allreduce_share"] < 1
    assert all(c["per_rank_spread"] >= 0 and len(c["per_rank"]) == 2 for c in rep["runs"][1]["cells"])
    assert rep["note"] and "not the hardware" in rep["note"]  # the CPU testbed says what it measures
    out = tmp_path / "out"
    assert json.loads((out / "bench.json").read_text())["scaling"] == rep["scaling"]
    assert "| mlp | 32 | 2 | 2 |" in (out / "bench.md").read_text()
    for png in ("bench-throughput.png", "bench-scaling.png"):
        assert (out / png).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    # the 1-node job did not shrink the cluster's record
    assert [n.name for n in load_cluster(cluster2.name).nodes] == [n.name for n in before.nodes]

    ov = overhead(spec, cluster2, BenchConfig(models=["mlp"], batch_sizes=[16], steps=5, warmup=2), repeats=1,
                  out=lines.append)
    assert ov["samples_per_s"]["appliance"][0] > 0 and ov["samples_per_s"]["bare"][0] > 0
    assert ov["ratio"] == pytest.approx(ov["best"]["appliance"] / ov["best"]["bare"], rel=1e-3)


def test_bench_stage_refuses_a_memstore_larger_than_the_machine():
    """Issue 62: `make bench-stage STORE=rgw` sized its in-memory store past a 24 GB machine's memory; the kernel
    killed the OSD mid-run and the checkpoint upload after it waited 20+ minutes. It now says so before it starts."""
    import importlib
    import sys

    sys.path.insert(0, str(ROOT / "bench"))
    try:
        sb = importlib.import_module("stage_bench")
    finally:
        sys.path.remove(str(ROOT / "bench"))
    meminfo = "MemTotal:       24000000 kB\nMemFree:  1000 kB\nMemAvailable:   20000000 kB\n"
    assert sb.memory_problem(8 << 30, meminfo) is None
    why = sb.memory_problem(int(19.4 * 2**30), meminfo)
    assert why and "19.4 GiB in memory" in why and "19.1 GiB available" in why, why


def test_bench_stream_finds_the_shortest_step_local_disk_feeds():
    """`make bench-stream` runs at the highest demand local disk feeds: the step grows from the unpaced rate's by a
    factor until local disk's input wait is within the goal; none in the tries is one line, not a traceback."""
    import importlib
    import sys

    sys.path.insert(0, str(ROOT / "bench"))
    try:
        sd = importlib.import_module("stream_decode")
    finally:
        sys.path.remove(str(ROOT / "bench"))
    waits = {100: 0.30, 110: 0.08, 121: 0.04, 133: 0.01}
    step, tried = sd.find_step(lambda ms: waits[round(ms)], 100, 0.05, 1.1, 8)
    assert round(step) == 121 and [round(s) for s, _ in tried] == [100, 110, 121]
    with pytest.raises(SystemExit, match=r"stayed above 5% up to a step of 110 ms \(30.0%, 8.0%\)"):
        sd.find_step(lambda ms: waits[round(ms)], 100, 0.05, 1.1, 2)
