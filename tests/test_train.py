"""Real Horovod jobs over SSH across testbed nodes: the digits example, failures, the rank environment."""

import textwrap
import threading
import time
from pathlib import Path

import pytest

from appliance import testbed
from appliance.cluster import from_testbed
from appliance.errors import ApplianceError
from appliance.provision.contextualize import cluster_key, contextualize
from appliance.remote import Session
from appliance.spec import load_spec
from appliance.protocol import denied_names
from appliance.flows import run_job as train
from conftest import digits_code, needs_netns, tb_name, write_spec

pytestmark = [pytest.mark.slow, needs_netns]


def test_digits_across_two_nodes(cluster2, tmp_path):
    spec = load_spec(write_spec(tmp_path, "python train.py --data . --epochs 20", code=digits_code(),
                                name="digits"))
    lines = []
    res = train(spec, cluster2, out=lines.append)
    assert res.exit_code == 0, "\n".join(lines[-30:])
    assert sorted(res.results) == [0, 1]
    assert res.hostnames == ["node1", "node2"]  # both ranks ran, on two distinct hosts
    assert len({r["weights_sha256"] for r in res.results.values()}) == 1  # identical final weights
    assert res.results[0]["val_accuracy"] >= 0.95
    assert any(line.startswith("[1|node2] ") for line in lines)  # rank-prefixed streaming


def test_contextualize_is_idempotent_and_ssh_is_strict(cluster2):
    contextualize(cluster2)
    contextualize(cluster2)
    _, pub = cluster_key(cluster2)
    with Session(cluster2) as s:
        r = s["node1"].run("grep -c 'BEGIN appliance cluster' /etc/hosts; grep -cxF %r /root/.ssh/authorized_keys; "
                           "PATH=/mnt/local/appliance/etc/bin:$PATH ssh -o StrictHostKeyChecking=no node2 hostname; "
                           "cat /mnt/local/appliance/etc/hostfile" % pub, check=True)
    out = r.out.splitlines()
    assert out[0] == "1" and out[1] == "1"  # one managed block, key authorized once
    assert out[2] == "node2"  # node-to-node SSH with the cluster key and pinned host keys
    assert out[3:] == ["node1 slots=1", "node2 slots=1"]


def test_ranks_get_no_credentials(cluster2, jobs_dir, tmp_path, monkeypatch):
    secrets = {"OS_PASSWORD": "pw-123456", "AWS_SECRET_ACCESS_KEY": "aws-987654", "OS_TOKEN": "tok-55555",
               "SERVICE_TOKEN": "svc-4444", "DB_PASSWORD": "db-3333"}
    for k, v in secrets.items():
        monkeypatch.setenv(k, v)
    spec = load_spec(write_spec(tmp_path, "python dump_env.py", code=jobs_dir, name="envdump"))
    lines = []
    res = train(spec, cluster2, out=lines.append)
    assert res.exit_code == 0, "\n".join(lines[-30:])
    assert sorted(res.results) == [0, 1]
    for r in res.results.values():
        assert not denied_names(dict.fromkeys(r["env"], "")), r["env"]
        assert "HOROVOD_RANK" in r["env"] and "TF_USE_LEGACY_KERAS" in r["env"]
    log = Path(res.log_path).read_text()
    for v in secrets.values():
        assert v not in log


def test_rank_crash_stops_job_and_names_rank(cluster2, jobs_dir, tmp_path):
    spec = load_spec(write_spec(tmp_path, "python loop.py --crash-rank 1 --crash-step 20", code=jobs_dir,
                                name="crash"))
    t0 = time.monotonic()
    res = train(spec, cluster2, out=lambda line: None)
    assert res.exit_code != 0
    assert time.monotonic() - t0 < 120
    # the rank that failed on its own is named (rank 0 failed too, because of it); its status is the one it
    # reported itself (3), unless horovodrun cut its ssh before that line arrived
    assert res.failure.startswith("rank 1 on node2 "), res.failure
    assert not res.failure.startswith("rank 0"), res.failure


def test_killed_node_stops_job_within_60s(jobs_dir, tmp_path):
    tb = testbed.up(tb_name("pk"), 2)
    try:
        cl = from_testbed(tb, name="pk-cluster")
        spec = load_spec(write_spec(tmp_path, "python loop.py", code=jobs_dir, name="killnode"))
        killed_at = {}

        def out(line):
            if "step 30 " in line and "t" not in killed_at:
                killed_at["t"] = time.monotonic()
                threading.Thread(target=testbed.kill_node, args=(tb.name, "node2")).start()

        res = train(spec, cl, out=out)
        ended = time.monotonic()
        assert "t" in killed_at, "the job never reached step 30"
        assert res.exit_code != 0
        assert ended - killed_at["t"] < 60
        assert "node2" in res.failure
    finally:
        testbed.down(tb.name)
    assert not testbed.status(tb.name)["nodes"]


def test_the_job_goes_on_when_the_launchers_connection_drops(cluster2, tb2, jobs_dir, tmp_path):
    """Issue 14 item 3: the launcher lost its SSH connection to the head (a network outage, a laptop put to sleep)
    and the job went with it: horovodrun ran in the connection's session and its output pipe broke; the launcher
    called the job failed. The job now runs detached on the head: the launcher reconnects and follows its output
    from the line where it stopped, no line lost or shown twice."""
    # 1,200 steps (~15 s) after the cut at step 300: the reconnect takes 0.2-2 s
    spec = load_spec(write_spec(tmp_path, "python loop.py --steps 1500", code=jobs_dir, name="cut"))
    cut = {}
    lines = []

    def out(line):
        lines.append(line)
        if line.startswith("[0|") and "step 300 " in line and "n" not in cut:
            cut["n"] = 0
            t = threading.Thread(target=lambda: cut.update(n=testbed.cut_connections(tb2.name, "node1")))
            t.start()
            cut["t"] = t

    # the watch's heartbeat every 50 ms, not 5 s: its loop wakes during the reconnect (0.2-0.5 s here), where it
    # reaped the job as if it had failed (test_job_verdicts.py::test_a_reconnect_reaps_nothing) in ~1 run of 14
    res = train(spec, cluster2, out=out, heartbeat=0.05)
    cut["t"].join()
    assert cut["n"] > 0, "no connection of the launcher's was cut"
    assert res.exit_code == 0, (res.failure, [x for x in lines if "[appliance]" in x or "horovodrun" in x])
    assert any("lost the connection to the head node node1" in x for x in lines), lines[-30:]
    assert any("reconnected to node1" in x for x in lines)
    steps = [int(x.split("step ")[1].split()[0]) for x in lines if x.startswith("[0|") and "] step " in x]
    assert steps == list(range(0, 1500, 10)), steps  # every line once, in order, across the reconnect
    assert sorted(res.results) == [0, 1]
    # the output stays on the head node: `appliance logs RUN` shows it from any launcher (-f: to the job's end)
    from appliance import flows

    shown = []
    assert flows.logs("cut", cluster2.name, lines=0, follow=True, out=shown.append) == res.job_id
    assert [x for x in shown if x.startswith("[0|node1] step ")] == [x for x in lines if x.startswith("[0|node1] step ")]
    assert shown[-1] == f"[appliance] job {res.job_id} on node1: ended with exit code 0"
    last = []
    flows.logs("cut", cluster2.name, lines=6, out=last.append)  # the results, each rank's exit line (not shown)
    assert any(x.startswith("[0|node1] APPLIANCE_RESULT") for x in last), last
    assert not any("APPLIANCE_RANK_EXIT" in x for x in last), last


def test_single_host_mode_trains(tmp_path):
    tb = testbed.up(tb_name("sh"), 2, mode="single-host")
    try:
        cl = from_testbed(tb, name="sh-cluster")
        spec = load_spec(write_spec(tmp_path, "python train.py --data . --epochs 3", code=digits_code(),
                                    name="single"))
        res = train(spec, cl, out=lambda line: None)
        assert res.exit_code == 0
        assert sorted(res.results) == [0, 1]
        assert len({r["weights_sha256"] for r in res.results.values()}) == 1
    finally:
        testbed.down(tb.name)


def test_code_copy_skips_virtualenvs_and_caches(tmp_path):
    import io
    import tarfile

    from appliance.remote import _tar_dir
    for rel in ("train.py", "pkg/mod.py", ".venv/lib/big.so", ".venv-tools/bin/x", "__pycache__/m.pyc", ".git/HEAD"):
        (tmp_path / rel).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / rel).write_text("x")
    names = tarfile.open(fileobj=io.BytesIO(_tar_dir(tmp_path, ("__pycache__", ".git")))).getnames()
    assert sorted(n for n in names if n.endswith(".py")) == ["./pkg/mod.py", "./train.py"]
    assert not [n for n in names if ".venv" in n or "__pycache__" in n or ".git" in n]


def test_a_second_job_of_the_same_run_is_refused_and_the_first_goes_on(cluster2, jobs_dir, tmp_path):
    """Issue 14 item 3: two jobs of one run shared the run directory, its STOP file and credentials. The run's lock
    on the head node is held by the running job's processes; a second job is refused before it touches anything."""
    import threading

    from appliance.errors import ApplianceError

    spec = load_spec(write_spec(tmp_path, "python loop.py --steps 400", code=jobs_dir, name="twice"))
    started = threading.Event()
    first = {}

    def out(line):
        if "step 10 " in line:
            started.set()

    t = threading.Thread(target=lambda: first.setdefault("res", train(spec, cluster2, out=out)))
    t.start()
    try:
        assert started.wait(120)
        with pytest.raises(ApplianceError, match=r"run 'twice' already has a job running on node1"):
            train(spec, cluster2, out=lambda line: None)
    finally:
        t.join(300)
    assert first["res"].exit_code == 0, first["res"].failure
    # and once it ended, the run is free again
    assert train(load_spec(write_spec(tmp_path, "python loop.py --steps 20", code=jobs_dir, name="twice")),
                 cluster2, out=lambda line: None).exit_code == 0


def _wheel(path: Path, name: str, version: str, source: str) -> Path:
    """A pure-Python wheel, as pip builds one (PEP 427), made by hand: no build step and no index needed."""
    import zipfile

    whl = path / f"{name}-{version}-py3-none-any.whl"
    info = f"{name}-{version}.dist-info"
    files = {f"{name}/__init__.py": source,
             f"{info}/METADATA": f"Metadata-Version: 2.1\nName: {name}\nVersion: {version}\n",
             f"{info}/WHEEL": "Wheel-Version: 1.0\nGenerator: tests\nRoot-Is-Purelib: true\nTag: py3-none-any\n"}
    files[f"{info}/RECORD"] = "".join(f"{f},,\n" for f in [*files, f"{info}/RECORD"])
    with zipfile.ZipFile(whl, "w") as z:
        for f, text in files.items():
            z.writestr(f, text)
    return whl


def test_the_scripts_own_packages_are_installed_on_every_node_beside_the_stack(cluster2, tmp_path):
    """Issue 61: train.requirements, pip-installed on every node before the job (here from a wheel shipped with the
    code: the testbed has no index), importable by every rank; the stack's own versions are kept: a requirement that
    would change numpy fails before the job, in one line naming the node."""
    code = tmp_path / "code"
    code.mkdir()
    _wheel(code, "mypkg", "0.1", "VALUE = 'from the requirements'\n")
    (code / "requirements.txt").write_text("--no-index\n--find-links .\nmypkg==0.1\n")
    (code / "job.py").write_text(textwrap.dedent("""\
        import json, os
        import mypkg
        print("APPLIANCE_RESULT " + json.dumps({"rank": int(os.environ["HOROVOD_RANK"]), "mypkg": mypkg.VALUE,
              "from": os.path.dirname(mypkg.__file__)}), flush=True)
        """))
    spec = load_spec(write_spec(tmp_path, "python job.py", code=code, name="pkgs",
                                extra="  requirements: requirements.txt\n"))
    lines = []
    res = train(spec, cluster2, out=lines.append)
    assert res.exit_code == 0, "\n".join(lines[-30:])
    assert {r: v["mypkg"] for r, v in res.results.items()} == {0: "from the requirements", 1: "from the requirements"}
    assert all("/appliance/runs/pkgs/packages/" in v["from"] for v in res.results.values()), res.results
    assert any("installed the packages of requirements.txt on 2 node(s)" in x for x in lines), lines[-20:]
    (code / "requirements.txt").write_text("--no-index\n--find-links .\nmypkg==0.1\nnumpy==1.0\n")
    with pytest.raises(ApplianceError) as e:
        train(load_spec(spec.path), cluster2, out=lines.append)
    msg = str(e.value)
    assert msg.startswith("train.requirements: requirements.txt did not install on node") and "\n" not in msg, msg
