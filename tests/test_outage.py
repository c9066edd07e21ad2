"""A control-plane outage of minutes in the middle of a managed run, on the local cloud: its whole API (Keystone,
Blazar, Nova, the metadata service) frozen with SIGSTOP for longer than any client waits for an answer (60 s), as
when a site's Keystone hangs. Chameleon's Keystone is one service for the whole site; its outages are ordinary.

The job (a light script, level 3: its working directory synced) goes on; its tokens live 20 s, so the syncer's
next token request meets the frozen Keystone. Nothing may take the outage for a lease end (no false recovery: one
job), and the syncer's thread must outlive it: a file the script writes after the outage is committed while the
job still runs, not only at its exit. Its controller renews its own store token as it expires. Then `appliance
cancel RUN` is typed on another machine (its own APPLIANCE_HOME: only the run's store in common): the job, which
looks at no stop file, has its working directory committed and is ended; the run is cancelled, its lease gone,
and the controller releases the run's lock with its renewed token."""

import json
import os
import signal
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import pytest

from conftest import NETNS_OK

pytestmark = pytest.mark.skipif(not NETNS_OK, reason="needs network namespaces")

FREEZE_S = 75  # longer than a client's read timeout (60 s, store/httpget.py, store/swift.py)

JOB = '''
import sys, time
from pathlib import Path
after, release = Path(sys.argv[1]), Path(sys.argv[2])
i = 0
while not release.exists():  # a new file every 2 s, each written once (the syncer takes a file once it is still)
    # (a custom loop that looks at no stop file: a stop commits its working directory, then its syncer ends it)
    if i % 4 == 0:
        Path(f"tick-{i // 4:04d}.txt").write_text(str(i))
    if after.exists() and not Path("after.txt").exists():
        Path("after.txt").write_text("written after the outage")
    i += 1
    time.sleep(0.5)
'''


@pytest.mark.slow
# a thread of the controller that dies (the cancel's enforcer read the run's lock with a store token from the run's
# start, expired: tokens live 20 s here, a day on Chameleon) fails the test
@pytest.mark.filterwarnings("error::pytest.PytestUnhandledThreadExceptionWarning")
def test_a_frozen_control_plane_mid_run_is_no_lease_end_and_the_syncer_outlives_it(cloud, tmp_path, monkeypatch):
    from appliance import flows, report, sites
    from appliance.checkpoint.runs import run_details
    from appliance.cluster import find_cluster
    from appliance.store.filesync import FileSet
    from test_checkpoint import wait_for

    (tmp_path / "code").mkdir()
    (tmp_path / "code" / "job.py").write_text(JOB)
    marks = Path(tempfile.gettempdir()) / f"appliance-outage-{os.urandom(4).hex()}"  # the ranks' user sees them
    after, release = marks.with_name(marks.name + "-after"), marks.with_name(marks.name + "-release")
    spec = tmp_path / "ko.yaml"
    spec.write_text(f"name: ko\ncloud: local\nnodes: {{count: 1, node_type: compute_local}}\nimage: appliance-cpu\n"
                    f"train: {{code: {tmp_path / 'code'}, command: python job.py {after} {release}, "
                    "env: {APPLIANCE_FILES_EVERY_SECONDS: '2'}}\ncheckpoint: {url: 'swift://ckpts/'}\n")
    sites.open_site("local").store_creds()  # the store is up before the run and this test read it
    lifetime = cloud.admin("GET", "/tokens")["seconds"]
    cloud.admin("POST", "/tokens", {"seconds": 20})
    monkeypatch.setenv("APPLIANCE_CONTROLLER_POLL", "0.5")

    def synced() -> set[str]:
        try:  # a new token each look: they live 20 s
            body = FileSet("swift://ckpts/", "ko", sites.open_site("local").store_creds()).newest_good()
        except FileNotFoundError:
            return set()
        return set(body["files"]) if body else set()

    lines: list[str] = []
    result: dict = {}
    run = threading.Thread(target=lambda: result.update(r=flows.run_managed(str(spec), out=lines.append)),
                           daemon=True)
    pid = cloud._pid()
    try:
        with report.to(lines.append):
            run.start()
            wait_for("a first sync", lambda: any(f.startswith("tick-") for f in synced()), every=0.5)
            os.kill(pid, signal.SIGSTOP)
            try:
                time.sleep(FREEZE_S)  # the outage itself: nothing to wait on but the time
            finally:
                os.kill(pid, signal.SIGCONT)
            after.touch()
            wait_for("the file written after the outage, synced while the job runs", lambda: "after.txt" in synced(),
                     every=0.5)
            assert run.is_alive() and not result, lines[-20:]
            before = synced()
            # `appliance cancel ko --url swift://ckpts/` on another machine: the cloud's clouds.yaml, nothing else
            other = tmp_path / "elsewhere"
            other.mkdir()
            for name in ("localcloud", "localcloud-clock.json"):
                (other / name).symlink_to(Path(os.environ["APPLIANCE_HOME"]) / name)
            p = subprocess.run([sys.executable, "-m", "appliance.cli", "cancel", "ko", "--url", "swift://ckpts/",
                                "--json"], capture_output=True, text=True, timeout=120,
                               env={**os.environ, "APPLIANCE_HOME": str(other)})
            assert p.returncode == 0, p.stderr
            assert json.loads(p.stdout)["run"] == "ko"
            run.join(300)
    finally:
        os.kill(pid, signal.SIGCONT)
        cloud.admin("POST", "/tokens", {"seconds": lifetime})
        after.unlink(missing_ok=True)
        release.unlink(missing_ok=True)
    assert result["r"].exit_code == 75, (result["r"].failure, lines[-30:])  # stopped with its files committed
    assert [j["status"] for j in run_details("ko")["jobs"]] == ["stopped"], json.dumps(run_details("ko"))[:2000]
    state = flows.timeline("ko", url="swift://ckpts/")
    assert state["status"] == "cancelled" and not state["controller_alive"], state["events"][-5:]
    ends = [e for e in state["events"] if e["event"] == "job end"]
    assert len(ends) == 1 and not ends[0]["lease_end"], ends  # no false lease end, then or at the cancel
    assert len(synced()) > len(before)  # the files written since, committed at the stop
    assert find_cluster("ko") is None  # its cluster went, and its lease (below)
    assert not [x for x in sites.open_site("local").cloud.list_leases() if x.name.startswith("ko-")
                and x.status not in ("DELETED", "TERMINATED")]
    bad = [i for i, x in enumerate(lines) if "Traceback" in x or "died" in x]
    assert not bad, lines[bad[0] - 5:bad[0] + 25] if bad else None
    # the controller's lock is released at the end, with the store credentials it renewed on the way
    assert not [x for x in lines if "could not release the controller lock" in x], lines[-20:]
