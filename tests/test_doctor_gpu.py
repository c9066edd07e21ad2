"""`appliance doctor --gpu` (issue 76): the verdicts on GPU-like job output (fakes: this machine has no GPU), the
cluster-wide checks through a fake launcher, the report and the CLI. The slow tests run
the device-agnostic checks for real on the CPU: the bit-exact resume (and its failures), the CPU restore, and the
NCCL job and the benchmark through `appliance train`'s launch path."""

import json
import sys

import pytest
from click.testing import CliRunner

from appliance.cli import main
from appliance.cluster import Cluster, Node
from appliance.flows import gpucheck
from appliance.node import doctor, doctor_report, gpudoctor
from appliance.node.doctor import Check
from appliance.train.launch import JobResult
from conftest import ROOT, needs_netns

V = "NCCL version 2.21.5+cuda12.4"
LIB = "/v/lib/python3.11/site-packages/nvidia/nccl/lib/libnccl.so.2"
EAGER = ("FailedPreconditionError: {{function_node __wrapped__Timestamp_device_/job:localhost/replica:0/task:0/"
         "device:CPU:0}} Timestamp cannot be called when determinism is enabled [Op:Timestamp]")
GRAPH = ("FailedPreconditionError: Graph execution error:\n\nDetected at node Timestamp defined at (most recent call "
         "last):\n  File \"gpujobs.py\", line 228, in <module>\n\nTimestamp cannot be called when determinism is "
         "enabled\n\t [[{{node Timestamp}}]] [Op:__inference_step_1293]")


def rank(r, size, **kw):
    out = {"rank": r, "size": size, "host": f"node{r}", "sum": [size * (size + 1) / 2] * 4, "broadcast": [7.0] * 4,
           "device": "/job:localhost/replica:0/task:0/device:GPU:0", "nccl_libs": [LIB]}
    return {**out, **kw}


# -- verdicts ---------------------------------------------------------------------------------------------------------

def test_allreduce_verdict_passes_on_gpu_and_fails_on_wrong_sums_cpu_tensors_errors_and_silence():
    ok = gpudoctor.allreduce_verdict({0: rank(0, 2), 1: rank(1, 2)}, 2, "2 ranks")
    assert ok.status == "ok" and "allreduce sum = 3, broadcast from rank 0 = 7" in ok.detail
    bad = gpudoctor.allreduce_verdict({0: rank(0, 2), 1: rank(1, 2, sum=[2.0] * 4)}, 2, "2 ranks")
    assert bad.status == "fail" and "rank 1: allreduce sum 2.0" in bad.detail
    cpu = gpudoctor.allreduce_verdict({0: rank(0, 1, device="/device:CPU:0")}, 1, "1 rank")
    assert cpu.status == "fail" and "not the GPU" in cpu.detail and "HOROVOD_GPU_OPERATIONS=NCCL" in cpu.fix
    err = gpudoctor.allreduce_verdict({0: {"error": "NcclError: unhandled system error", "host": "n2"}}, 1, "1 rank")
    assert err.status == "fail" and err.detail == "rank 0 on n2: NcclError: unhandled system error"
    missing = gpudoctor.allreduce_verdict({0: rank(0, 2)}, 2, "2 ranks")
    assert missing.status == "fail" and "rank(s) 1 reported nothing" in missing.detail
    shared = gpudoctor.allreduce_verdict({0: rank(0, 1, shared_gpu=True)}, 1, "1 rank")
    assert "ranks share a GPU on node0" in shared.detail


@pytest.mark.parametrize("outputs, libs, versions, want", [
    ({0: f"{V}\n", 1: "x\n"}, [[LIB], [LIB]], ["2.21.5", "2.21.5"], "ok"),  # the communicator's rank 0 prints it
    ({0: "", 1: ""}, [[LIB], [LIB]], ["2.21.5", "2.21.5"], "NCCL printed no version"),
    ({0: f"{V}\n{V}\n", 1: ""}, [[LIB], [LIB]], ["2.21.5", "2.21.5"], "rank 0 on node0: NCCL started 2 times"),
    ({0: f"{V}\n", 1: ""}, [[LIB], []], ["2.21.5", None], "0 libnccl mapped (none: NCCL is compiled into Horovod"),
    ({0: f"{V}\n", 1: ""}, [[LIB], [LIB, "/usr/lib/libnccl.so.2"]], ["2.21.5", None], "2 libnccl mapped"),
    ({0: f"{V}\n", 1: ""}, [[LIB], [LIB]], ["2.21.5", "2.28.9"], "the ranks run different NCCLs: 2.21.5, 2.28.9"),
])
def test_runtime_verdict_wants_one_version_line_and_one_libnccl_per_rank(outputs, libs, versions, want):
    results = {r: rank(r, 2, nccl_libs=libs[r], nccl_version=versions[r]) for r in (0, 1)}
    c = gpudoctor.runtime_verdict(results, outputs, 2, "2 ranks")
    if want == "ok":
        assert c.status == "ok" and c.detail.startswith("NCCL 2.21.5+cuda12.4 started once; one libnccl in each of "
                                                        "2 rank(s) (2.21.5): "), c
        assert c.data == {"nccl_version": "2.21.5+cuda12.4", "libnccl": [LIB]}
    else:
        assert c.status == "fail" and want in c.detail, c


def test_the_op_tensorflow_refuses_is_named_from_eager_and_graph_errors():
    for err in (EAGER, GRAPH):
        assert gpudoctor.op_of(err) == "Timestamp"
        assert gpudoctor.first_line(err).endswith("Timestamp cannot be called when determinism is enabled")
    c = gpudoctor.resume_verdict({"error": GRAPH}, None)
    assert c.status == "fail" and c.detail.startswith("op Timestamp under op determinism: ")
    assert "docs/resume.md" in c.fix


def test_resume_and_cpu_verdicts():
    b = {"steps": 8, "split": 3, "device": "NVIDIA A100", "variables": 8, "differ": [], "max_abs_diff": 0.0}
    assert gpudoctor.resume_verdict({}, b).status == "ok"
    c = gpudoctor.resume_verdict({}, {**b, "differ": ["dense/kernel:0"], "max_abs_diff": 0.02})
    assert c.status == "fail" and "1 of 8 variables" in c.detail and "dense/kernel:0 first" in c.detail
    near = {"gpus_visible": 0, "max_abs_diff": 3e-6, "scale": 2.0}
    assert gpudoctor.cpu_verdict(near, "NVIDIA A100").status == "ok"
    assert gpudoctor.cpu_verdict({**near, "max_abs_diff": 0.01}, "NVIDIA A100").status == "fail"
    assert gpudoctor.cpu_verdict({**near, "gpus_visible": 1}, "NVIDIA A100").status == "fail"
    assert gpudoctor.cpu_verdict(None, "?").status == "skip"


def test_the_one_rank_nccl_check_runs_the_job_with_nccl_debug_and_skips_without_a_gpu(monkeypatch):
    seen = {}

    def fake_job(python, args, env=None, timeout=300):
        seen.update(args=args, env=env)
        return rank(0, 1, host="n", nccl_version="2.21.5"), f"{V}\nAPPLIANCE_RESULT {{}}\n", 7.0
    monkeypatch.setattr(gpudoctor, "job", fake_job)
    p = {"tensorflow": "2.18.1", "horovod": "0.28.1"}
    checks = gpudoctor.nccl_one_rank("/v/bin/python", p, gpus=1)
    assert [c.status for c in checks] == ["ok", "ok"] and seen["args"] == ["nccl"]
    assert seen["env"] == {"NCCL_DEBUG": "VERSION"} and checks[0].seconds == 7.0
    assert [(c.status, c.detail) for c in gpudoctor.nccl_one_rank("/v/bin/python", p, gpus=0)] == [
        ("skip", "no GPU"), ("skip", "no GPU")]


# -- the checks that need every rank, through a fake launcher -------------------------------------------------------

def cluster2(slots=1):
    nodes = [Node(f"node{i}", f"10.0.0.{i}", f"10.0.0.{i}", "/w", slots=slots) for i in (1, 2)]
    return Cluster(name="c", cloud="chameleon", nodes=nodes, python="/v/bin/python")


class FakeLaunch:
    """train.launch.train's surface: every job's spec and cluster view kept, GPU-like results returned."""

    def __init__(self, per_gpu=100.0, scaling=0.9, fail=()):
        self.jobs, self.per_gpu, self.scaling, self.fail = [], per_gpu, scaling, fail

    def __call__(self, spec, cluster, out=None, hooks=()):
        self.jobs.append((spec, cluster))
        n = cluster.world_size
        res = JobResult(job_id="j", exit_code=0, world_size=n, rank_hosts=cluster.rank_hosts(), log_path="/l.log")
        if spec.name in self.fail:
            res.exit_code, res.failure = 1, "rank 0 on node1 exited with status 1"
        elif spec.name == "doctor-nccl":
            for h in hooks:
                h.rank_line(0, V)  # NCCL's rank 0 says its version
            res.results = {r: rank(r, n, nccl_version="2.21.5") for r in range(n)}
        else:
            agg = self.per_gpu * n * (self.scaling if n > 1 else 1.0)
            res.results[0] = {"bench": [{"model": "resnet50", "batch": 32, "ranks": n, "aggregate": agg,
                                         "device": "NVIDIA A100-PCIE-40GB"}]}
        return res


@pytest.fixture
def no_contextualize(monkeypatch):
    done = []
    monkeypatch.setattr(gpucheck, "_contextualize", done.append)
    return done


def test_every_rank_and_the_bench_on_1_and_all_gpus(no_contextualize):
    launch, cl = FakeLaunch(), cluster2()
    checks = {c.name: c for c in gpucheck.cluster_checks(cl, {"node1": 2, "node2": 2}, launch)}
    assert checks["ranks per node"].detail == "nodes.slots 1 uses 1 of 2 GPUs per node (these checks use all of them)"
    assert checks["bench (1 GPU)"].detail.startswith("100.0 samples/s: resnet50, batch 32 per rank, 1 rank(s)")
    assert checks["nccl allreduce (4 ranks)"].status == "ok" and checks["nccl at run time (4 ranks)"].status == "ok"
    assert "scaling efficiency 0.90 (1.0 = linear)" in checks["bench (4 GPUs)"].detail
    assert [(s.name, c.world_size, [n.slots for n in c.nodes]) for s, c in launch.jobs] == [
        ("doctor-bench", 1, [1]), ("doctor-nccl", 4, [2, 2]), ("doctor-bench", 4, [2, 2])]
    assert launch.jobs[1][0].train.env == {"NCCL_DEBUG": "VERSION"}
    assert launch.jobs[0][0].train.command.startswith(f"timeout -k 10 {gpucheck.JOB_LIMIT} python synthetic.py")
    assert no_contextualize == [cl]  # the views' files replaced by the whole cluster's
    assert cl.nodes[0].slots == 1  # the record itself is untouched


def test_without_a_gpu_the_cluster_checks_skip(no_contextualize):
    launch = FakeLaunch()
    checks = gpucheck.cluster_checks(cluster2(), {"node1": 0, "node2": 0}, launch)
    assert [(c.name, c.status, c.detail) for c in checks] == [(n, "skip", "no GPU") for n in gpucheck.NAMES]
    assert not launch.jobs


def test_more_slots_than_gpus_and_a_failed_bench_fail(no_contextualize):
    checks = {c.name: c for c in gpucheck.cluster_checks(cluster2(slots=2), {"node1": 1, "node2": 1},
                                                        FakeLaunch(fail=("doctor-bench",)))}
    assert checks["ranks per node"].status == "fail" and "set nodes.slots to 1" in checks["ranks per node"].fix
    assert checks["bench (1 GPU)"].status == "fail" and checks["bench (1 GPU)"].fix == "its log: /l.log"
    assert "scaling" not in checks["bench (2 GPUs)"].detail


def test_a_node_without_gpus_in_a_gpu_cluster_fails_and_the_others_run(no_contextualize):
    launch = FakeLaunch()
    checks = {c.name: c for c in gpucheck.cluster_checks(cluster2(), {"node1": 2, "node2": 0}, launch)}
    assert checks["ranks per node"].status == "fail" and "node2 has no GPU" in checks["ranks per node"].detail
    assert [[n.name for n in c.nodes] for _, c in launch.jobs] == [["node1"]] * 3
    assert checks["nccl allreduce (2 ranks)"].status == "ok"


def test_a_job_that_cannot_start_is_a_failed_line_not_a_traceback(no_contextualize):
    from appliance.errors import ApplianceError

    def refuse(spec, cluster, **kw):
        raise ApplianceError("the head node node1 lacks the training stack", "use the appliance image")
    checks = {c.name: c for c in gpucheck.cluster_checks(cluster2(), {"node1": 1, "node2": 1}, refuse)}
    assert checks["bench (1 GPU)"].detail == "the job did not start: the head node node1 lacks the training stack"
    assert checks["nccl allreduce (2 ranks)"].fix == "use the appliance image"
    assert checks["nccl at run time (2 ranks)"].status == "skip" and checks["bench (2 GPUs)"].status == "fail"


def test_one_gpu_in_all_runs_the_bench_once(no_contextualize):
    cl = gpucheck.this_machine("/v/bin/python", 1)
    checks = {c.name: c for c in gpucheck.cluster_checks(cl, {cl.head.name: 1}, FakeLaunch())}
    assert checks["bench (1 GPU)"].status == "ok" and checks["nccl allreduce (all ranks)"].status == "skip"
    assert "ranks per node" not in checks and no_contextualize == []


# -- the report and the CLI -------------------------------------------------------------------------------------------

INFO = {"host": "gpu1", "versions": {"tensorflow": "2.18.1", "nccl (run time)": "2.21.5+cuda12.4"},
        "gpus": [{"index": "0", "name": "NVIDIA A100-PCIE-40GB"}], "nvidia_smi": "| NVIDIA-SMI 560.35.03 |\n"}


def fake_examine(checks):
    return lambda python=None, etc=None, allreduce=True, gpu=False: (checks, INFO)


def test_the_report_holds_every_check_versions_and_nvidia_smi(tmp_path):
    nodes = {"gpu1": ([Check("python", "ok", "3.12.3"), Check("resume bit-exact", "fail", "differ", "ask", 9.5)],
                      INFO)}
    rep = doctor_report.build(nodes, [Check("bench (1 GPU)", "ok", "100 samples/s", seconds=40.0)], cluster="c",
                              command="appliance doctor --gpu --cluster c", seconds=81.2)
    j, md = doctor_report.write(rep, tmp_path / "r")
    assert j.name == "r.json" and md.name == "r.md"
    back = json.loads(j.read_text())
    assert back["verdict"] == "fail" and back["failed"] == ["resume bit-exact"] and back["seconds"] == 81.2
    assert back["nodes"]["gpu1"]["info"]["gpus"][0]["name"] == "NVIDIA A100-PCIE-40GB"
    text = md.read_text()
    for part in ("# appliance doctor --gpu: FAIL", "## Node gpu1", "| fail | resume bit-exact | differ (fix: ask) | 9.5 |",
                 "| nccl (run time) | 2.21.5+cuda12.4 |", "```\n| NVIDIA-SMI 560.35.03 |\n```", "## Every rank"):
        assert part in text, part


def test_doctor_gpu_on_this_machine_writes_the_report_and_says_its_path(tmp_path, monkeypatch):
    monkeypatch.setattr(doctor, "examine", fake_examine([Check("python", "ok", "3.12.3")]))
    launch = FakeLaunch()
    monkeypatch.setattr(gpucheck, "train_job", launch)
    path = tmp_path / "rep.json"
    r = CliRunner().invoke(main, ["doctor", "--gpu", "--report", str(path)])
    assert r.exit_code == 0, r.output
    lines = r.output.splitlines()
    assert "every rank:" in lines and any("ok   bench (1 GPU)" in line for line in lines)
    assert lines[-1].startswith("pass after") and lines[-1].endswith(f"the report: {path} (readable: "
                                                                      f"{path.with_suffix('.md')})")
    assert json.loads(path.read_text())["command"] == "appliance doctor --gpu"
    assert [c.world_size for _, c in launch.jobs] == [1]  # this machine has one GPU (INFO): one bench


def test_doctor_gpu_json_and_a_failing_check_exits_1(tmp_path, monkeypatch):
    monkeypatch.setattr(doctor, "examine", fake_examine([Check("nccl linkage", "fail", "compiled in", "rebuild")]))
    monkeypatch.setattr(gpucheck, "train_job", FakeLaunch())
    r = CliRunner().invoke(main, ["doctor", "--gpu", "--json", "--report", str(tmp_path / "x.json")])
    assert r.exit_code == 1
    rep = json.loads(r.output)
    assert rep["verdict"] == "fail" and rep["report"]["markdown"] == str(tmp_path / "x.md")
    r = CliRunner().invoke(main, ["doctor", "--report", str(tmp_path / "y.json")])
    assert r.exit_code == 2 and "--report goes with --gpu" in r.output


# -- for real, on the CPU ---------------------------------------------------------------------------------------------

@pytest.mark.slow
def test_the_resume_check_passes_and_can_fail_on_this_cpu():
    """Three runs of the real jobs (TensorFlow on the CPU): exact; a second process with another seed (other batches
    after the restore) fails; an op TensorFlow refuses under op determinism fails and is named."""
    p = doctor.probe(sys.executable)
    ok, on_cpu = gpudoctor.resume_checks(sys.executable, p)
    assert ok.status == "ok" and "bit for bit" in ok.detail and ok.detail.endswith("CPU)"), ok
    assert on_cpu.status == "ok" and "loads in a new CPU-only process" in on_cpu.detail, on_cpu
    other, _ = gpudoctor.resume_checks(sys.executable, p, seeds=(1, 2))
    assert other.status == "fail" and "weights differ from 8 uninterrupted steps'" in other.detail, other
    refused, skipped = gpudoctor.resume_checks(sys.executable, p, inject="timestamp")
    assert refused.status == "fail" and refused.detail.startswith("op Timestamp under op determinism"), refused
    assert skipped.status == "skip"


@pytest.mark.slow
def test_the_nccl_job_and_the_bench_through_the_launch_path_on_this_cpu(monkeypatch):
    """The every-rank jobs as `appliance train` starts them (horovodrun, 2 ranks on this machine): the nccl job with
    CPU tensors (Gloo) gets the right sums, and its verdict fails, since they are not on a GPU; the benchmark (a
    small MLP here) gives samples/s on 1 and 2 ranks."""
    import dataclasses

    def cpu_ok(spec, cluster, **kw):
        if spec.name == "doctor-nccl":
            spec = dataclasses.replace(spec, train=dataclasses.replace(spec.train,
                                                                       command=spec.train.command + " --allow-cpu"))
        return gpucheck.train_job(spec, cluster, **kw)

    cl = gpucheck.this_machine(sys.executable, 2)
    allreduce, runtime = gpucheck.nccl_every_rank(cl, cpu_ok)
    assert [(r["sum"], r["broadcast"]) for r in allreduce.data["results"].values()] == [([3.0] * 4, [7.0] * 4)] * 2
    assert allreduce.status == "fail" and "not the GPU" in allreduce.detail
    monkeypatch.setattr(gpucheck, "BENCH", dataclasses.replace(gpucheck.BENCH, models=["mlp"], batch_sizes=[8],
                                                               steps=2, warmup=1))
    one, both = (gpucheck.bench(c, cpu_ok, label) for c, label in ((gpucheck.view(cl, {cl.head.name: 1}), "1 GPU"),
                                                                  (cl, "2 GPUs")))
    gpucheck.efficiency(one, both)
    assert one.status == "ok" and both.status == "ok" and "scaling efficiency" in both.detail, (one, both)


@pytest.mark.slow
@needs_netns
def test_doctor_gpu_on_a_cluster_of_cpu_nodes(cluster2, tmp_path):
    """`appliance doctor --gpu --cluster NAME` over SSH on the 2-node testbed: every node's lines and versions come
    back, the device-agnostic checks pass on each node's CPU, the GPU ones say `no GPU`, and the report is written."""
    import dataclasses

    # the nodes run this checkout's appliance package (the venv's may be installed from another one)
    py = tmp_path / "python"
    py.write_text(f"#!/bin/sh\nPYTHONPATH={ROOT} exec {sys.executable} \"$@\"\n")
    py.chmod(0o755)
    cl = dataclasses.replace(cluster2, name="pt-doctor", python=str(py))
    cl.save()
    r = CliRunner().invoke(main, ["doctor", "--gpu", "--cluster", cl.name, "--no-allreduce", "--report",
                                  str(tmp_path / "rep.json")])
    assert r.exit_code == 0, r.output
    rep = json.loads((tmp_path / "rep.json").read_text())
    assert sorted(rep["nodes"]) == sorted(n.name for n in cl.nodes) and rep["cluster"] == cl.name
    for name, node in rep["nodes"].items():
        checks = {c["name"]: c for c in node["checks"]}
        assert checks["resume bit-exact"]["status"] == "ok" and checks["weights on the CPU"]["status"] == "ok", name
        assert checks["nccl allreduce (1 rank)"]["detail"] == "no GPU"
        assert node["info"]["versions"]["tensorflow"] == "2.18.1"
    assert [c["detail"] for c in rep["cluster_checks"]] == ["no GPU"] * 3
    print(r.output)
