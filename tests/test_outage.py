"""A control-plane outage of minutes in the middle of a managed run, on the local cloud: its whole API (Keystone,
Blazar, Nova, the metadata service) frozen with SIGSTOP for longer than any client waits for an answer (60 s), as
when a site's Keystone hangs. Chameleon's Keystone is one service for the whole site; its outages are ordinary.

The job (a light script, level 3: its working directory synced) goes on; its tokens live 20 s, so the syncer's
next token request meets the frozen Keystone. Nothing may take the outage for a lease end (no false recovery: one
job, complete), and the syncer's thread must outlive it: a file the script writes after the outage is committed
while the job still runs, not only at its exit. Its controller renews its own store token as it expires and
releases the run's lock at the end with it."""

import json
import os
import signal
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
    if i % 4 == 0:
        Path(f"tick-{i // 4:04d}.txt").write_text(str(i))
    if after.exists() and not Path("after.txt").exists():
        Path("after.txt").write_text("written after the outage")
    i += 1
    time.sleep(0.5)
'''


@pytest.mark.slow
def test_a_frozen_control_plane_mid_run_is_no_lease_end_and_the_syncer_outlives_it(cloud, tmp_path, monkeypatch):
    from appliance import flows, report, sites
    from appliance.checkpoint.runs import run_details
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
            release.touch()
            run.join(300)
    finally:
        os.kill(pid, signal.SIGCONT)
        cloud.admin("POST", "/tokens", {"seconds": lifetime})
        after.unlink(missing_ok=True)
        release.unlink(missing_ok=True)
    assert result["r"].exit_code == 0, (result["r"].failure, lines[-30:])
    assert [j["status"] for j in run_details("ko")["jobs"]] == ["complete"], json.dumps(run_details("ko"))[:2000]
    assert not [x for x in lines if "Traceback" in x or "died" in x], lines
    # the controller's lock is released at the end, with the store credentials it renewed on the way
    assert not [x for x in lines if "could not release the controller lock" in x], lines[-20:]
