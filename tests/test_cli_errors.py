"""Bad credentials and unreachable endpoints, as a user meets them: the `appliance` command, one line on stderr
with the fix and a non-zero exit (fast tier: nothing listens where the clouds.yaml points)."""

import json
import os
import shutil
import socket
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest


def _closed_port() -> int:
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
    s.close()
    return port


def test_an_unreachable_keystone_is_one_short_line(tmp_path):
    """keystoneauth's own warning ("Failed to discover available identity versions ...") came first, and the
    error carried urllib3's whole chain (HTTPConnectionPool ... Max retries exceeded ... NewConnectionError)."""
    url = f"http://127.0.0.1:{_closed_port()}/v3"
    (tmp_path / "clouds.yaml").write_text(f"""clouds:
  dead:
    auth: {{auth_url: "{url}", username: u, password: p, project_name: x, user_domain_name: Default,
            project_domain_name: Default}}
    region_name: CHI@UC
    identity_api_version: 3
""")
    # no retries: the line is what this checks (a refused connection is asked again 5 times, ~15 s per request,
    # tests/test_cloud_retries.py)
    env = {**os.environ, "OS_CLIENT_CONFIG_FILE": str(tmp_path / "clouds.yaml"), "OS_CLOUD": "dead",
           "APPLIANCE_HOME": str(tmp_path / "home"), "APPLIANCE_CLOUD_RETRIES": "0"}
    r = subprocess.run([sys.executable, "-m", "appliance.cli", "lease", "list", "--cloud", "chameleon"],
                       capture_output=True, text=True, env=env, timeout=120)
    assert r.returncode == 1 and r.stdout == ""
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1, r.stderr
    assert lines[0].startswith(f"error: cannot reach Keystone at {url} for clouds.yaml entry 'dead' "
                               "(Connection refused)"), lines[0]
    assert "fix: check auth_url" in lines[0] and len(lines[0]) < 200, lines[0]


@pytest.mark.parametrize("scheme", ["swift", "s3"])
def test_an_object_store_that_does_not_answer_is_said_while_waiting_and_then_in_one_line(scheme, monkeypatch, said,
                                                                                        virtual_time):
    """`appliance data ls` against an endpoint where nothing listens: two silent minutes of retries, then an
    unexpected error (`ConnectionError: HTTPConnectionPool(...)`, `EndpointConnectionError: ...`, "report it")."""
    from appliance.data import listing
    from appliance.errors import ApplianceError
    from appliance.store import base as store_base
    from appliance.store.objects import StoreCreds

    monkeypatch.setattr(store_base, "LIST_DEADLINE", 3.0)
    clock = virtual_time(store_base)  # the backoff's waits, not sat out
    url = f"http://127.0.0.1:{_closed_port()}"
    creds = StoreCreds(auth_url=f"{url}/auth/v1.0", user="u", key="k") if scheme == "swift" else \
        StoreCreds(s3_endpoint=url, s3_access_key="a", s3_secret_key="b")
    said.clear()
    with pytest.raises(ApplianceError) as e:
        listing(f"{scheme}://data/x/", creds=creds)
    assert str(e.value).startswith(f"cannot reach the object store at {url}") and "(Connection refused)" in str(e.value)
    assert "and the network" in e.value.fix
    assert len(said) == 1 and said[0].startswith(f"object store at {url}") and "asking again for up to" in said[0]
    assert clock.slept > 0  # asked again after a backoff, not given up at the first refusal


def test_the_stager_says_a_store_that_does_not_answer_in_one_line(tmp_path, monkeypatch, capsys, virtual_time):
    """On a node the same failure was `ConnectionError: HTTPConnectionPool(...)` with no fix, after two silent
    minutes of retries."""
    import io
    import json

    from appliance.node import stage_main
    from appliance.protocol import Line, parse
    from appliance.store import base as store_base

    monkeypatch.setattr(store_base, "LIST_DEADLINE", 0.5)
    virtual_time(store_base)
    url = f"http://127.0.0.1:{_closed_port()}"
    job = {"url": "swift://data/x/", "dest": str(tmp_path / "d"), "mode": "full", "rank": 0, "nodes": 1,
           "creds": {"auth_url": f"{url}/auth/v1.0", "user": "u", "key": "k"}}
    monkeypatch.setattr("sys.stdin", io.StringIO(json.dumps(job)))
    assert stage_main.main() == 1
    lines = [parse(x, (Line.NOTE, Line.ERROR)) for x in capsys.readouterr().out.splitlines()]
    notes = [b for k, b in filter(None, lines) if k == Line.NOTE]
    errors = [b for k, b in filter(None, lines) if k == Line.ERROR]
    assert len(notes) == 1 and "did not answer (Connection refused: asking again" in notes[0], notes
    assert errors == [{"message": f"cannot reach the object store at {url}/auth/v1.0 (Connection refused)",
                       "fix": "check ST_AUTH (or the object-store endpoint in OS_CLOUD's catalog) and the network",
                       "unavailable": True}]  # no answer: the store is away, not the data missing (a managed run waits)


def test_resume_from_a_url_that_holds_no_such_run_says_so(tmp_path):
    """`appliance resume RUN --url URL` with a typo in RUN or URL: `FileNotFoundError: ...spec.yaml`, "report it"."""
    from appliance.checkpoint.resume import find_spec
    from appliance.errors import ApplianceError

    (tmp_path / "ckpts" / "digits").mkdir(parents=True)
    with pytest.raises(ApplianceError, match=rf"no run 'digit' at file://{tmp_path}/ckpts/: "
                                             rf"file://{tmp_path}/ckpts/digit/spec.yaml is not there") as e:
        find_spec("digit", url=f"file://{tmp_path}/ckpts/")
    assert "appliance data ls" in e.value.fix


def test_a_checkpoint_container_that_is_gone_is_one_line(tmp_path, monkeypatch):
    """Issue 49: after `appliance cloud stop` emptied the local store, `appliance ls RUN --plot` (and resume) failed
    with an internal FileNotFoundError: the container is not there, which is said with the fix."""
    from appliance.checkpoint import resume
    from appliance.errors import ApplianceError
    from appliance.spec import load_spec
    from appliance.store.checkpoints import CheckpointStore
    from conftest import write_spec

    spec = load_spec(write_spec(tmp_path, "python x.py", code=tmp_path, name="gone",
                                extra=f"checkpoint: {{url: 'file://{tmp_path}/ck/'}}\n"))

    def no_container(self):
        raise FileNotFoundError("swift://ckpts/")

    monkeypatch.setattr(CheckpointStore, "newest_good", no_container)
    with pytest.raises(ApplianceError, match="run 'gone' has no checkpoint: .* has no directory") as e:
        resume.choose_checkpoint(spec, CheckpointStore(spec.checkpoint.url, spec.name, None))
    assert "cloud stop" in e.value.fix and "\n" not in str(e.value)


def test_resume_from_a_url_keeps_one_spec_with_the_run_record_and_nothing_in_tmp(tmp_path, monkeypatch):
    """`appliance resume RUN --url URL` from a machine with no record of RUN made a /tmp/appliance-spec-* directory
    per call (and one when the run was not there) and never removed it: 33 were left by one test session."""
    from appliance.checkpoint import runs
    from appliance.checkpoint.resume import find_spec
    from appliance.errors import ApplianceError

    scratch = tmp_path / "tmp"
    scratch.mkdir()
    monkeypatch.setattr(tempfile, "tempdir", str(scratch))  # where tempfile would put it
    url = f"file://{tmp_path}/ckpts/"
    (tmp_path / "ckpts" / "urlrun").mkdir(parents=True)
    text = "name: urlrun\ncloud: local\nnodes: {count: 1, node_type: compute_local}\nimage: appliance-cpu\n" \
           f"train: {{code: {tmp_path}, command: python train.py}}\ncheckpoint: {{url: {json.dumps(url)}}}\n"
    (tmp_path / "ckpts" / "urlrun" / "spec.yaml").write_text(text)
    for _ in range(2):  # a second resume replaces the copy
        spec = find_spec("urlrun", url=url)
        assert spec.name == "urlrun" and spec.checkpoint.url == url
        assert Path(spec.path) == runs.record_dir("urlrun") / "spec.yaml"
        assert Path(spec.path).read_text() == text
    with pytest.raises(ApplianceError, match="no run 'nosuch'"):
        find_spec("nosuch", url=url)
    with pytest.raises(ApplianceError, match="is not a run name"):
        find_spec("../urlrun", url=url)
    # a spec of another run under this run's name is refused, and replaces nothing
    (tmp_path / "ckpts" / "other").mkdir()
    (tmp_path / "ckpts" / "other" / "spec.yaml").write_text(text)
    with pytest.raises(ApplianceError, match="is the spec of run 'urlrun', not 'other'"):
        find_spec("other", url=url)
    assert not runs.record_dir("other").exists()
    (tmp_path / "ckpts" / "other" / "spec.yaml").write_text("name: [")  # not a spec: the same
    with pytest.raises(ApplianceError):
        find_spec("other", url=url)
    assert not runs.record_dir("other").exists()
    assert list(scratch.iterdir()) == []


def test_down_says_which_job_it_would_cut_short(appliance_home):
    """`appliance down` of a cluster with a job running on it asked only about servers and disks; the job's work
    since its last checkpoint went with them."""
    import time

    from click.testing import CliRunner

    from appliance.checkpoint import runs
    from appliance.cli import main

    runs.save({"run": "busy", "status": "running", "cluster": "c1", "step": 0, "last_checkpoint": None,
               "jobs": [{"job_id": "j1", "started": time.time(), "status": "running"}]})
    runs.save({"run": "done", "status": "complete", "cluster": "c1", "step": 9, "last_checkpoint": None,
               "jobs": [{"job_id": "j0", "started": time.time(), "status": "complete"}]})
    try:
        r = CliRunner().invoke(main, ["down", "c1"], input="n\n")
    finally:
        for run in ("busy", "done"):
            shutil.rmtree(runs.record_dir(run))
    assert r.exit_code == 1  # aborted: nothing deleted
    assert "run busy has a job running on it" in r.output and "Ctrl-C in its `appliance train`" in r.output
    assert "run done" not in r.output


def test_train_says_a_dataset_that_is_not_staged_before_the_job_starts(tmp_path, appliance_home, monkeypatch):
    """`appliance train` with a dataset that `appliance stage` never put on a node started the job, and each rank's
    script failed on its own (a traceback per rank, after Horovod's start)."""
    from appliance import flows
    from appliance.cluster import Cluster, Node
    from appliance.errors import ApplianceError
    from conftest import write_spec

    nodes = [Node(f"n{i}", "127.0.0.1", None, str(tmp_path / f"n{i}")) for i in (1, 2)]
    (tmp_path / "n1" / "data" / "digits").mkdir(parents=True)
    (tmp_path / "n1" / "data" / "digits" / "x.npz").write_bytes(b"x")
    Cluster(name="stg", cloud="testbed", nodes=nodes).save()
    spec = write_spec(tmp_path, "python x.py", code=tmp_path, name="stg",
                      extra="dataset: {source: 'swift://digits-data/v1/', dest: data/digits}\n")
    monkeypatch.setattr(flows, "run_job", lambda *a, **kw: pytest.fail("the job started"))
    with pytest.raises(ApplianceError, match=r"dataset.dest data/digits is empty or missing on n2: the job would "
                                             r"find no data \(fix: stage it first: `appliance stage "):
        flows.train_spec(spec, "stg")


def test_logs_of_a_run_whose_nodes_are_gone_show_this_machines_copy(appliance_home):
    """After the lease end (or `appliance down`) the head node, and the job's output on it, are gone:
    `appliance logs RUN` said `no cluster named ...`, though `appliance train` keeps what it showed on this
    machine (~/.appliance/runs/RUN/JOB.log)."""
    from appliance import flows, paths
    from appliance.checkpoint import runs

    runs.save({"run": "gonelog", "status": "stopped", "cluster": "gonelog", "step": 40, "last_checkpoint": None,
               "jobs": []})
    d = paths.home() / "runs" / "gonelog"
    (d / "gonelog-20261125T050000-1.log").write_text("[0|n1] epoch 1\n[0|n1] epoch 2\n[appliance] job ended\n")
    said = []
    from click.testing import CliRunner

    from appliance.cli import main
    try:
        assert flows.logs("gonelog", lines=2, out=said.append) == "gonelog-20261125T050000-1"
        js = json.loads(CliRunner().invoke(main, ["logs", "gonelog", "-n", "1", "--json"]).stdout)
    finally:
        shutil.rmtree(d)
    assert js["run"] == "gonelog" and js["lines"][-1] == "[appliance] job ended", js
    assert said[0].startswith("[appliance] not from the head node (no cluster named 'gonelog'): this machine's copy")
    assert said[1:] == ["[0|n1] epoch 2", "[appliance] job ended"]


def test_check_online_asks_the_store_before_a_lease_is_paid_for(tmp_path):
    """A dataset URL with a typo was found only by `appliance stage`, after the lease and the nodes' boot (10-20
    minutes on Chameleon's bare metal); `appliance check` read the spec alone. `--online` asks the store: how many
    objects the URL names, whether checkpoint.url answers, and whether the run already has checkpoints."""
    from click.testing import CliRunner

    from appliance.cli import main
    from appliance.store.checkpoints import MANIFEST
    from conftest import write_spec

    code = tmp_path / "code"
    code.mkdir()
    (code / "x.py").write_text("")
    data = tmp_path / "store" / "data"
    data.mkdir(parents=True)
    for n in ("a.bin", "b.bin"):
        (data / n).write_bytes(b"x" * 1000)
    ckpt = tmp_path / "ckpt"

    def check(source: str, *more: str):
        spec = write_spec(tmp_path, "python x.py", code=code, name="onl",
                          extra=f"dataset: {{source: '{source}', dest: data}}\n"
                                f"checkpoint: {{url: 'file://{ckpt}/', every_steps: 5}}\n")
        r = CliRunner().invoke(main, ["check", str(spec), *more], env={"APPLIANCE_HOME": str(tmp_path)})
        r.returncode = r.exit_code
        return r

    r = check(f"file://{data}/", "--online")
    assert r.returncode == 0, r.stderr
    assert f"  dataset.source file://{data}/: 2 object(s), 2.0 KB" in r.stdout
    assert f"  checkpoint.url file://{ckpt}/: reachable, no checkpoint of run 'onl' yet" in r.stdout
    typo = f"file://{tmp_path}/store/dat/"
    assert check(typo).returncode == 0  # offline: the spec alone is fine
    r = check(typo, "--online")
    assert r.returncode == 1 and r.stdout == ""
    assert len(r.stderr.strip().splitlines()) == 1 and r.stderr.startswith(
        f"error: {typo}: no object under it; a lease would stage nothing (fix: check the dataset URL"), r.stderr
    (ckpt / "onl" / "ckpt-000000010").mkdir(parents=True)
    (ckpt / "onl" / "ckpt-000000010" / MANIFEST).write_text("{}")
    r = check(f"file://{data}/", "--online")
    assert r.returncode == 0 and ("run 'onl' has 1 committed checkpoint(s), newest ckpt-000000010: `appliance "
                                  "resume onl` continues it") in r.stdout, r.stdout


def test_training_code_too_big_is_refused_before_its_bytes_are_read(tmp_path):
    """Issue 49: `train.code: /` was tarred whole in memory before the cap was checked (`appliance check` ran over a
    minute and was killed). A tree past the cap is refused at the file that passes it, before reading that file: a
    sparse 100 GiB file (compresses to almost nothing) was read whole, then passed."""
    from appliance.errors import ApplianceError
    from appliance.remote import pack_code

    code = tmp_path / "code"
    code.mkdir()
    (code / "train.py").write_text("print('hi')\n")
    with open(code / "huge.bin", "wb") as fh:
        fh.truncate(100 * 2**30)
    with pytest.raises(ApplianceError, match="too big to copy as training code") as ei:
        pack_code(code)
    assert "GiB of files" in str(ei.value) and "\n" not in str(ei.value)


def test_the_cluster_key_is_never_readable_by_others_on_its_way(tmp_path, monkeypatch):
    """Issue 49: the head node's cluster key was copied (at the umask's mode), then chmod-ed to 0600: a window in
    which another user could read it. Every file made on the way is 0600 from its first byte."""
    import json as _json
    import os
    import socket
    import stat

    from appliance.cluster import from_node_config

    home = tmp_path / "user"
    (home / ".ssh").mkdir(parents=True)
    (home / ".ssh" / "id_appliance").write_text("PRIVATE KEY\n")
    (home / ".ssh" / "id_appliance.pub").write_text("ssh-ed25519 AAAA\n")
    monkeypatch.setenv("HOME", str(home))
    monkeypatch.setenv("APPLIANCE_HOME", str(tmp_path / "appl"))
    cfg = tmp_path / "cluster.json"
    cfg.write_text(_json.dumps({"name": "hc", "head": socket.gethostname(),
                                "nodes": [{"name": socket.gethostname(), "ip": "127.0.0.1"}]}))
    opened = []
    real_open = os.open

    def spy(path, flags, mode=0o777, *a, **kw):
        if flags & os.O_CREAT:
            opened.append((str(path), mode))
        return real_open(path, flags, mode, *a, **kw)

    monkeypatch.setattr(os, "open", spy)
    old = os.umask(0o022)
    try:
        from_node_config(cfg)
    finally:
        os.umask(old)
    key = tmp_path / "appl" / "clusters" / "hc.id_ed25519"
    assert key.read_text() == "PRIVATE KEY\n" and stat.S_IMODE(key.stat().st_mode) == 0o600
    made = [m for p, m in opened if "hc.id_ed25519" in p and not p.endswith(".pub")]
    assert made and all(m == 0o600 for m in made), opened
