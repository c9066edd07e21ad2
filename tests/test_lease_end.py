"""Lease ends: the watchdog stops the job before the end, admin termination, `appliance resume` on a new lease,
and managed runs (`appliance run`) across lease ends, handovers and killed controllers, on the local cloud.

Real parts throughout, as in test_checkpoint.py (whose helpers these tests share): the digits example on 2 nodes,
a real Swift, the local cloud's Blazar leases whose end deletes the servers. Every resumed run is compared with an
uninterrupted run of the same seed and world size: the final weights must be bit-identical.
"""

import contextlib
import dataclasses
import datetime as dt
import json
import os
import random
import tempfile
import time
from pathlib import Path

import pytest
import yaml
from click.testing import CliRunner

from appliance import flows, localcloud, sites
from appliance.checkpoint import runs
from appliance.cli import main as cli_main
from appliance.flows import resume
from appliance.flows import run_job as train
from appliance.spec import load_spec
from appliance.store.checkpoints import CheckpointStore
from conftest import ROOT, NETNS_OK, digits_code
from test_checkpoint import LONG, Lines, digits_spec, lease_left, sha, wait_for
from keras3_job import K3_EPOCHS, LOAD_BEST, keras3_spec, keras3_weights

pytestmark = pytest.mark.skipif(not NETNS_OK, reason="needs network namespaces")


@pytest.fixture(scope="module")
def reference_long(cluster2, tmp_path_factory):
    res = train(load_spec(digits_spec(tmp_path_factory.mktemp("ref30"), "ckref30", url=None, epochs=LONG)), cluster2,
                out=lambda line: None)
    assert res.exit_code == 0, res.failure
    return sha(res)



def _another_machine(home1: Path, home: Path) -> Path:
    """The APPLIANCE_HOME of another machine: the cloud's clouds.yaml and key pair, nothing of the run."""
    home.mkdir()
    for name in ("localcloud", "localcloud-clock.json"):
        (home / name).symlink_to(home1 / name)
    return home


def _run_elsewhere(spec_path: str, home: Path):
    """`appliance run SPEC` on another machine (a pid namespace of its own, kept by its shell's sleep: it cannot
    tell whether this machine's controller lives), typed again every 2 s while the run's lock is fresh. Returns the
    namespace's shell, when its controller held the run, and how many times it was refused."""
    import subprocess
    import sys

    env = {**os.environ, "APPLIANCE_HOME": str(home)}
    refused = 0
    while True:
        ns = subprocess.Popen(["unshare", "--pid", "--fork", "--kill-child", "sh", "-c",
                               f"{sys.executable} -m appliance.cli run {spec_path} --json && exec sleep 3600"],
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env,
                              start_new_session=True)
        line = ns.stdout.readline()
        if line.startswith("{"):
            return ns, time.time(), refused
        err = ns.stderr.read()
        ns.wait()
        assert "already has a controller" in err, err
        refused += 1
        assert refused < 20, err
        time.sleep(2)  # typed again a moment later, as a user would


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
    itself is killed -9 while the job trains, and `appliance run SPEC` typed on another machine (its own
    APPLIANCE_HOME and pid namespace), refused while the dead controller's lock is fresh, takes the run over from
    the store, follows that job without stopping it, makes its next cluster meanwhile, and hands it over warm when
    its lease's end takes its nodes. The spec asks for a warm handover
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
    monkeypatch.setenv("APPLIANCE_CONTROLLER_LOCK_TTL", "20")  # stale 20 s after its last heartbeat (every 4 s)
    monkeypatch.setenv("APPLIANCE_CONTROLLER_LOCK_INTERVAL", "4")
    home1 = Path(os.environ["APPLIANCE_HOME"])
    home2 = _another_machine(home1, tmp_path / "home2")
    elsewhere = None
    # the second lease's job waits after its 120th step (past the commit the test waits for) until `released`
    # exists, so that it is still there when its controller has been killed, another follows it, and its lease
    # ends (the whole training is ~20 s here); the first and third pass, the file there; the weights are the same
    released = Path(tempfile.gettempdir()) / f"appliance-released-{os.urandom(4).hex()}"  # the ranks' user sees it
    released.touch()
    spec_path = digits_spec(tmp_path, "cklease", url="swift://ckpts/", every=50, epochs=LONG,
                            env={"APPLIANCE_FAULT": f"hold-after:120:{released}"},
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
            # commits: the training is 660 steps, ~20 s here, and each lease end takes a few seconds of polls; the
            # second job commits in its first 119 steps, every 50, then holds)
            target = stopped_at + 50 * random.randint(1, 3 - lease)

            def committed_here():
                jobs = events("job")
                done = cs.committed()
                return len(jobs) == lease and done and done[0].step >= target and find_cluster(jobs[-1]["cluster"])

            cl = wait_for(f"a commit at step >= {target} on lease {lease}", committed_here, every=0.2)
            if lease == 2:  # the controller is killed -9 while the job trains (the laptop was lost): the job goes
                # on, detached on its head; `appliance run SPEC` on another machine follows it once the dead
                # controller's lock is stale, and makes its next cluster meanwhile
                booked = wait_for("the next lease booked by this controller", lambda: events("next lease")[1:])
                dead = state()["controller"]["pid"]
                os.kill(dead, signal.SIGKILL)
                wait_for("the controller's end", lambda: managed.gone_here(f"{socket.gethostname()}:{dead}:"))
                job = events("job")[-1]["job_id"]
                elsewhere, _, refused = _run_elsewhere(spec_path, home2)
                assert refused, "taken over while the dead controller's lock was fresh"
                monkeypatch.setenv("APPLIANCE_HOME", str(home2))  # this test reads the other machine's records on
                wait_for("the new controller to follow the job", lambda: events("following"), every=0.2)
                assert events("following")[0]["job_id"] == job and not events("job end")[1:]  # not stopped

                def booked_by_the_follower():  # before the cloud's clock jumps past the start it asks for
                    kinds = [e["event"] for e in state().get("events", [])]
                    return [k for k in kinds[kinds.index("following"):] if k in ("next lease", "next cluster failed")]

                assert wait_for("the follower's next lease", booked_by_the_follower, every=0.2)[0] == "next lease", \
                    state()["events"][-3:]
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
            if lease == 1:  # the second job holds (it starts training 10+ s after this end: horovodrun, imports)
                released.unlink()
            else:
                released.touch()  # the third goes on
        final = wait_for("the run to finish", lambda: (s := state()).get("status") not in (None, "running", "handover",
                                                                                          "starting") and s)
        assert final["status"] == "finished", final["events"][-4:]
        # the controller writes "finished", then takes its end steps (its lock, its credential) and exits
        wait_for("the controller's end", lambda: not state()["controller_alive"])  # its lock released
        ev = final["events"]
        jobs = [e for e in ev if e["event"] == "job"]
        assert len({j["lease_id"] for j in jobs}) == 3 and [j["restore"] for j in jobs] == [False, True, True]
        assert [j["cluster"] for j in jobs] == ["cklease", "cklease_h", "cklease"]  # the two names take turns
        rec = runs.load("cklease")  # the other machine's records: the job it followed, and the one it launched
        assert [j["status"] for j in rec["jobs"]] == ["stopped", "complete"] and rec["status"] == "complete"
        monkeypatch.setenv("APPLIANCE_HOME", str(home1))
        first = runs.load("cklease")["jobs"][0]  # this machine's: the first job
        monkeypatch.setenv("APPLIANCE_HOME", str(home2))
        assert first["status"] == "stopped" and rec["jobs"][0]["job_id"] == jobs[1]["job_id"]
        ran = [first, *rec["jobs"]]
        for before, after in zip(ran, ran[1:]):
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
        assert [j.get("resume_breakdown") for j in ran[1:]] == [d["breakdown"] for d in downs]
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
        # the next lease the killed controller booked is the third job's: the controller on the other machine kept
        # it (its hosts are the run's) rather than booking another; booked ahead and not used: the third job's next
        # one, if booked, abandoned at the run's end
        assert jobs[2]["lease_id"] == booked[0]["lease_id"] and events("lease adopted"), ev[-12:]
        ahead = set(leases) - {j["lease_id"] for j in jobs}
        assert len(ahead) <= 1 and ahead <= {e.get("lease_id") for e in final["asked"].values()}, final["asked"]
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
        if elsewhere is not None:  # the other machine's namespace, and its controller if still there
            with contextlib.suppress(ProcessLookupError):
                os.killpg(elsewhere.pid, signal.SIGKILL)
            elsewhere.wait()
        elif pid and state().get("status") not in ("finished", "failed", "stopped", "cancelled"):
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)  # a failed test leaves no controller behind
        released.unlink(missing_ok=True)
        for home in (home2, home1):
            monkeypatch.setenv("APPLIANCE_HOME", str(home))
            flows.down("cklease")
            flows.down("cklease_h")


@pytest.mark.slow
def test_a_controller_killed_mid_handover_is_started_again_and_leaves_no_orphan_lease(cloud, reference_long,
                                                                                         tmp_path, monkeypatch):
    """The fault matrix of a cold handover (appliance/killpoints.py), in one run, each controller killed with -9
    and `appliance run SPEC` typed again: the first once the handover's lease is in the run's state and before
    Blazar is asked; the second just after Blazar made it and before its answer was recorded anywhere; the third,
    which finds that lease by its recorded name and boots on it, once it holds the run's lock for the new job and
    before the job starts; Blazar's API is away for two of its reads meanwhile (HAProxy's 503). The fourth is typed
    on another machine (its own APPLIANCE_HOME with the cloud's credentials and key, its own pid namespace: it
    cannot tell whether the first machine's controller lives): refused while the dead controller's lock is fresh, it
    takes the run over once the lock is stale (a short ttl here; 300 s by default) and starts the next job within
    2 minutes of that (no job runs on the head: no wait on the lock of a job that never started), on the lease
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

    ttl = 30  # the controllers' lock: stale 30 s after its last heartbeat (every 5 s)
    monkeypatch.setenv("APPLIANCE_CONTROLLER_LOCK_TTL", str(ttl))
    monkeypatch.setenv("APPLIANCE_CONTROLLER_LOCK_INTERVAL", "5")

    def start(kill_at: str | None = None) -> int:
        env = {**os.environ, **({"APPLIANCE_KILL_AT": kill_at} if kill_at else {})}
        p = subprocess.run([sys.executable, "-m", "appliance.cli", "run", spec_path, "--json"], capture_output=True,
                           text=True, timeout=120, env=env)
        assert p.returncode == 0, p.stderr
        return json.loads(p.stdout)["pid"]

    home1 = Path(os.environ["APPLIANCE_HOME"])
    home2 = _another_machine(home1, tmp_path / "home2")

    def killed(pid: int, where: str) -> None:
        wait_for(f"the controller killed {where}", lambda: managed.gone_here(f"{socket.gethostname()}:{pid}:"))

    site = sites.open_site("local")
    cs = CheckpointStore("swift://ckpts/", "ckctl", site.store_creds())
    localcloud.admin("DELETE", "/requests")
    pid = start("lease-asked:2")  # the run's second lease: the handover's
    reader = managed._control_of("ckctl", None, "local", None)
    state = lambda: managed.read_timeline(reader) or {}  # noqa: E731
    elsewhere = None
    try:
        cl = wait_for("the first commit", lambda: cs.committed() and find_cluster("ckctl"))
        first = cl.lease_id
        localcloud.admin("POST", "/advance", {"seconds": lease_left(cl) - 45})
        killed(pid, "with the handover's lease recorded and not asked for")
        pid = start("lease-made")
        killed(pid, "with the handover's lease made and not answered")
        localcloud.admin("POST", "/faults", {"503 GET /reservation/v1/leases": 2})  # its lookup and its poll
        pid = start("job-lock")
        killed(pid, "with the run's lock taken for a job it never started")
        assert localcloud.admin("POST", "/faults", {})["503 GET /reservation/v1/leases"] == 0  # asked again
        last_beat = time.time()  # no later than its last heartbeat: the lock is stale from last_beat + ttl
        elsewhere, took, _ = _run_elsewhere(spec_path, home2)
        assert took >= last_beat + ttl - 6  # refused while the lock was fresh (its last heartbeat <= 5 s before)
        final = wait_for("the run to finish", lambda: (s := state()).get("status") in ("finished", "failed", "stopped")
                         and s)
        assert final["status"] == "finished", final["events"][-4:]
        ev = final["events"]
        controllers = [e for e in ev if e["event"] == "controller"]
        assert len(controllers) == 4 and [c["took_over"] for c in controllers[1:]] == [c["id"] for c in controllers[:3]]
        assert controllers[3]["id"].split(":")[-1] != controllers[2]["id"].split(":")[-1]  # another machine's
        started = [e for e in ev[ev.index(controllers[3]):] if e["event"] == "job"]
        assert started and started[0]["at"] - (last_beat + ttl) < 120, (started, last_beat)
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
        jobs1 = runs.load("ckctl")["jobs"]  # the first machine's records: its job, and the one it never started
        monkeypatch.setenv("APPLIANCE_HOME", str(home2))  # the other machine's: the run's end
        assert find_cluster("ckctl") is None and find_cluster("ckctl_h") is None
        jobs2 = runs.load("ckctl")["jobs"]
        assert jobs1[0]["status"] == "stopped" and jobs2[-1]["status"] == "complete", (jobs1, jobs2)
        ran = [jobs1[0], jobs2[-1]]
        assert ran[0]["ended"] <= ran[1]["started"]  # never two jobs at once
        assert ran[1]["first_step"] == ran[0]["last_step"]
        assert _job_sha("ckctl", ran[-1]["job_id"]) == reference_long
        # the store credential made for the job that never started went with the takeover, not a week later
        never = [e["job_id"] for e in after if e["event"] == "job not started"][0]
        made = [r["body"]["application_credential"]["name"] for r in localcloud.admin("GET", "/requests")["requests"]
                if r["method"] == "POST" and r["path"].endswith("/application_credentials")
                and r["body"]["application_credential"]["name"].startswith(f"appliance-ckctl-{never}-")]
        assert len(made) == 1, made  # it had one
        assert not [x for x in site.cloud.list_app_creds() if x["name"] in made]
    finally:
        if state().get("status") not in ("finished", "failed", "stopped", "cancelled"):
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)  # a failed test leaves no controller behind
        if elsewhere is not None:  # the other machine's namespace, and its controller if still there
            with contextlib.suppress(ProcessLookupError):
                os.killpg(elsewhere.pid, signal.SIGKILL)
            elsewhere.wait()
        for home in (home2, home1):
            monkeypatch.setenv("APPLIANCE_HOME", str(home))
            flows.down("ckctl")
            flows.down("ckctl_h")


@pytest.mark.slow
def test_hosts_taken_at_lease_ends_the_run_fails_over_to_another_site_then_waits_for_its_next_free_slot(
        cloud, reference_long, tmp_path, monkeypatch):
    """Other projects' reservations take the hosts at two lease ends, of a run with warm handovers (lease.overlap).
    Before the run starts, two compute_local hosts are held for hours, the other two (the run's own) from shortly
    after its first lease's end: the next lease, booked ahead to start during the overlap, is refused for
    compute_local (the run's own hosts are busy until the end it overlaps) and is booked on the spec's alternative,
    gpu_local at the local cloud's other site, CHI@local2 (its own Keystone, Blazar and credentials: the controller
    holds one of its own there too; the checkpoints stay in the run's own store); the cluster there is made while
    the job trains, and the handover is warm. At the second end, the gpu_local hosts there are held too, for 30
    minutes from the end: no next lease anywhere, so the handover is cold: the run reads both sites' host
    allocations, books the earliest slot (gpu_local at CHI@local2, when that reservation ends), says how long the
    wait is, and waits for it; the cloud's clock gets there and the run goes on. Each from the very step it stopped
    at; the final weights are the uninterrupted run's, and no lease of the run is left at either site."""
    import subprocess
    import sys

    from appliance.cluster import find_cluster
    from appliance.flows import managed

    monkeypatch.setenv("APPLIANCE_CONTROLLER_POLL", "1")
    # the second job waits after its 100th step (past a commit) until `released` exists, so that it is still there
    # when the test has taken the hosts of its next lease and moved the cloud's clock to its end (the training is
    # ~20 s here); the first and third pass, the file there
    released = Path(tempfile.gettempdir()) / f"appliance-released-{os.urandom(4).hex()}"  # the ranks' user sees it
    released.touch()
    spec_path = digits_spec(tmp_path, "ckalt", url="swift://ckpts/", every=50, epochs=LONG,
                            env={"APPLIANCE_FAULT": f"hold-after:100:{released}"},
                            extra="lease: {duration: 1h, stop_margin: 60s, overlap: 15m}\n")
    Path(spec_path).write_text(Path(spec_path).read_text().replace(
        "nodes: {count: 2, node_type: compute_local, slots: 1}",
        "nodes: {count: 2, node_type: compute_local, slots: 1, alternatives: [{node_type: gpu_local, site: "
        "CHI@local2}]}"))
    site = sites.open_site("local")
    c, c2 = site.cloud, sites.open_site("local", "CHI@local2").cloud
    cs = CheckpointStore("swift://ckpts/", "ckalt", site.store_creds())
    others = []

    def someone_else(node_type: str, start, hours: float, at=c) -> None:
        others.append((at, at.create_lease(f"someone-else-{len(others)}", node_type, 2, dt.timedelta(hours=hours),
                                           start=start).id))

    try:
        someone_else("compute_local", None, 3)  # two of the four, now
        # the other two (the run's own) from 5 minutes after the end of the run's first lease (1 h from about now)
        someone_else("compute_local", c.now().replace(second=0, microsecond=0) + dt.timedelta(minutes=65), 3)
        p = subprocess.run([sys.executable, "-m", "appliance.cli", "run", spec_path, "--json"], capture_output=True,
                           text=True, timeout=120)
        assert p.returncode == 0, p.stderr
        reader = managed._control_of("ckalt", None, "local", None)
        state = lambda: managed.read_timeline(reader) or {}  # noqa: E731
        events = lambda kind: [e for e in state().get("events", []) if e["event"] == kind]  # noqa: E731

        def just_after(cl):
            info = sites.for_cluster(cl).cloud.get_lease(cl.lease_id)
            return info.end.replace(second=0, microsecond=0) + dt.timedelta(minutes=1)

        cl = wait_for("the first commit", lambda: cs.committed() and find_cluster("ckalt"))
        localcloud.admin("POST", "/advance", {"seconds": lease_left(cl) - 45})
        wait_for("the first job's stop for its lease's end", lambda: events("job end"), every=0.2)
        released.unlink()  # the second job holds (it starts training 5+ s after this end: horovodrun, imports)
        stopped = wait_for("the job on gpu_local to commit", lambda: (j := events("job"))[1:] and
                           j[-1]["node_type"] == "gpu_local" and cs.committed()[0].step > events("job end")[0]["step"]
                           and find_cluster(j[-1]["cluster"]), every=0.2)
        assert stopped.site.region == "CHI@local2" and c.get_lease(stopped.lease_id) is None  # a lease of the other
        someone_else("gpu_local", just_after(stopped), 0.5, c2)  # the run's gpu hosts, for 30 minutes from its end
        localcloud.admin("POST", "/advance", {"seconds": lease_left(stopped) - 45})
        released.touch()  # the second job goes on, and stops for its lease's end; the third passes
        waiting = wait_for("the wait for a slot", lambda: events("waiting for hosts"))[0]
        assert waiting["node_type"] == "gpu_local" and waiting["site"] == "CHI@local2", waiting
        assert 30 * 60 <= waiting["wait_s"] <= 35 * 60, waiting
        start = dt.datetime.fromisoformat(waiting["start"].replace("Z", ""))
        localcloud.admin("POST", "/advance", {"seconds": (start - c.now()).total_seconds() + 5})
        final = wait_for("the run to finish", lambda: (s := state()).get("status") in ("finished", "failed", "stopped",
                                                                                      "parked") and s)
        assert final["status"] == "finished", final["events"][-5:]
        ev = final["events"]
        # the first next lease: compute_local refused, the alternative booked; the second: none anywhere, so cold
        assert [e["node_type"] for e in ev if e["event"] == "next lease refused"] == ["compute_local", "compute_local",
                                                                                       "gpu_local"]
        # (the third job's, if booked by the time the run ended, was abandoned: no lease is left, below)
        assert [(e["node_type"], e.get("site")) for e in ev if e["event"] == "next lease"][:1] == [
            ("gpu_local", "CHI@local2")]
        assert [e["node_type"] for e in ev if e["event"] == "no hosts"] == ["compute_local", "gpu_local"]
        assert [d["warm"] for d in ev if d["event"] == "downtime"] == [True, False]
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
        released.unlink(missing_ok=True)
        for at, lid in others:
            at.delete_lease(lid)
        flows.down("ckalt")
        flows.down("ckalt_h")


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
def test_watchdog_extends_the_lease_and_a_second_job_on_another_cluster_is_refused_by_the_store_lock(
        cloud, reference_long, tmp_path):
    """lease.extend: the launcher extends the lease ahead of the node-side margin and the job runs to its end.
    Meanwhile (issue 14 item 3) `appliance resume` of the same run on another cluster (a record of the second node
    alone: another head node, so the head's own lock cannot see the job) is refused by the run's lock in the store,
    with one line naming the running job, before it touches any node; the running job is undisturbed (bit-exact
    against the reference) and releases the lock when it ends."""
    from appliance.cluster import delete_cluster
    from appliance.store.runlock import RunLock

    spec_path = digits_spec(tmp_path, "ckext", url="swift://ckpts/", every=200, epochs=LONG,
                            extra="lease: {duration: 1h, stop_margin: 60s, extend: true}\n")
    cl = flows.up(spec_path)
    refused: list[str] = []

    def second(line):
        two = dataclasses.replace(cl, name="ckext-two", nodes=[cl.nodes[1]], lease_id=None, reservation_id=None,
                                  lease_end=None, floating_ip=None)
        two.save()
        try:
            resume("ckext", spec_path=spec_path, cluster_name="ckext-two", out=lambda m: None)
            refused.append("not refused")
        except Exception as e:  # noqa: BLE001
            refused.append(str(e))
        finally:
            delete_cluster("ckext-two")  # its record only: the node is the job's

    try:
        out = Lines()
        # 400 s before the end: past the launcher's extension point (ahead of the node-side 10-min margin), not yet
        # at rank 0's own vendordata margin (5 min), which would stop the job had the extension come too late
        out.on(f"epoch 1/{LONG} ", lambda line: localcloud.admin("POST", "/advance", {"seconds": lease_left(cl) - 400}))
        out.on("[checkpoint] step 200 committed", second)  # a resume needs a commit to resume from
        res = train(load_spec(spec_path), cl, out=out)
        # not stopped: the lease was extended and the run finished
        assert res.exit_code == 0, (res.failure, res.stopped, [x for x in out.lines if "[watchdog]" in x
                                                               or "vendordata" in x or "lease" in x])
        assert res.stopped is None and out.has("[watchdog] extended lease")
        assert not out.has("lease end (vendordata)")
        assert lease_left(cl) > 3000  # one more hour
        assert sha(res) == reference_long
        assert len(refused) == 1 and "run 'ckext' already has a job running: ckext-" in refused[0], refused
        assert "on cluster ckext (head " in refused[0], refused
        cs = CheckpointStore("swift://ckpts/", "ckext", sites.open_site("local").store_creds())
        assert RunLock(cs, "", cluster="", head="").read() is None  # released at the end
    finally:
        flows.down("ckext")


@pytest.mark.slow
def test_an_unchanged_keras_script_survives_the_lease_end(cloud, tmp_path, said):
    """Issue 13's first test: an ordinary Keras + Horovod script (examples/plain_fit, in the shape of Horovod's
    MNIST example: `.repeat().shuffle().batch()` with steps_per_epoch, rank 0's progress bar and ModelCheckpoint),
    nothing of the appliance in it, `checkpoint.url` in the spec. The lease end arrives mid-run: every rank stops
    after the same step with a committed checkpoint, the lease ends, and `appliance resume` continues it on a new
    lease with 0 steps lost, at the step it stopped after (the epochs before replayed), to the uninterrupted run's
    weights, bit for bit (the run without checkpoint.url, on the first lease's nodes)."""
    from test_keras_fit import final_weights

    epochs, steps = 15, 28

    def spec(name: str, url: bool) -> Path:
        p = tmp_path / f"{name}.yaml"
        p.write_text("\n".join([
            f"name: {name}", "cloud: local", "nodes: {count: 2, node_type: compute_local, slots: 1}",
            "image: appliance-cpu", "train:", f"  code: {digits_code('plain_fit')}",
            f"  command: python train.py --data repeat --epochs {epochs}",
            '  env: {"APPLIANCE_STOP_CHECK_SECONDS": "0.05"}',
            *(["checkpoint: {url: \"swift://ckpts/\", keep: 2}"] if url else []),
            "lease: {duration: 1h, stop_margin: 60s}"]) + "\n")
        return p

    p = spec("ckplain", url=True)
    cl = flows.up(str(p))
    try:
        ref: list[str] = []
        assert train(load_spec(str(spec("ckplainref", url=False))), cl, out=ref.append).exit_code == 0, ref[-20:]
        out = Lines()
        at_epoch = random.randint(2, 8)
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
        epoch, batch = divmod(st["step"], steps)
        assert any("skipped the" in m and f"(epoch {epoch}, batch {batch})" in m for m in said), said[-30:]
        assert final_weights(said) == final_weights(ref) and final_weights(ref)[1] == epochs * steps
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


# ---------------------------------------------------------------------------------------------
# Keras 3 (issue 79): Horovod's MNIST example in Keras 3 idioms (examples/keras3_digits), as any script

@pytest.fixture(scope="module")
def keras3_reference(cluster2, tmp_path_factory):
    """The uninterrupted run of examples/keras3_digits on 2 nodes: the ranks end with equal weights."""
    out = Lines()
    res = train(load_spec(keras3_spec(tmp_path_factory.mktemp("k3ref"), "k3ref", url=None)), cluster2, out=out)
    assert res.exit_code == 0, (res.failure, out.lines[-20:])
    w = keras3_weights(out.lines)
    assert sorted(w) == [0, 1] and w[0] == w[1] and w[0][1] == K3_EPOCHS * 28, w  # the ranks' weights equal
    return w[0][0]


@pytest.mark.slow
def test_a_keras3_script_crosses_a_lease_end_as_a_managed_run(cloud, keras3_reference, tmp_path, said):
    """examples/keras3_digits (import keras, keras.ops in its loss, a SeedGenerator layer, Dropout, AdamW, rank 0's
    ModelCheckpoint("best.keras")), nothing of the appliance in it, `appliance run` (foreground here): Keras 3 is
    chosen from its code; the lease end comes mid-run, every rank stops after the same step with a committed
    checkpoint (Keras 3's format inside, the same layout), the run goes on on a new lease from that step, and ends
    on the uninterrupted run's weights (Dropout and SeedGenerator states per rank included); `appliance ls --plot`
    draws one curve with the resume marked, and best.keras, synced with the working directory, loads in a Python
    without Horovod or the appliance."""
    import subprocess
    import sys

    from appliance.cluster import find_cluster
    from appliance.store.filesync import FileSet

    spec = keras3_spec(tmp_path, "k3lease", url="swift://ckpts/")
    out = Lines()
    at_epoch = random.randint(2, 3)
    out.on(f"Epoch {at_epoch}/{K3_EPOCHS}", lambda line: localcloud.admin(  # the lease's end: 45 s away
        "POST", "/advance", {"seconds": lease_left(find_cluster("k3lease")) - 45}))
    try:
        res = flows.run_managed(spec, out=out)
        assert res is not None and res.exit_code == 0, (res and res.failure, out.lines[-20:])
        assert any("Keras 3: train.keras: auto, model.py:" in x for x in said + out.lines), said[:20]
        rec = runs.load("k3lease")
        jobs = rec["jobs"]
        assert [j["status"] for j in jobs] == ["stopped", "complete"], jobs
        assert jobs[1]["first_step"] == jobs[0]["last_step"] < K3_EPOCHS * 28  # 0 committed steps lost
        w = keras3_weights(out.lines)
        assert w[0] == w[1] == (keras3_reference, K3_EPOCHS * 28), (w, keras3_reference)
        cs = CheckpointStore("swift://ckpts/", "k3lease", sites.open_site("local").store_creds())
        assert cs.read_manifest(cs.committed()[0])["meta"]["keras"] == "3"
        d = flows.plot_run("k3lease", str(tmp_path / "m.png"), spec_path=spec)
        assert d["resumed_at"] == [jobs[0]["last_step"]] and d["steps"] == [1, K3_EPOCHS * 28], d
        fs = FileSet("swift://ckpts/", "k3lease", sites.open_site("local").store_creds())
        body = fs.newest_good()
        assert body is not None and "best.keras" in body["files"], body
        fs.pull(body, tmp_path / "files")
        p = subprocess.run([sys.executable, "-I", "-c", LOAD_BEST, str(tmp_path / "files" / "best.keras"),
                            str(digits_code("keras3_digits"))], capture_output=True, text=True, timeout=120,
                           env={**os.environ, "TF_CPP_MIN_LOG_LEVEL": "3"}, cwd="/")
        assert p.returncode == 0 and p.stdout.split()[-3:] == ["AdamW", "False", "False"], p.stderr[-2000:]
    finally:
        flows.down("k3lease")
