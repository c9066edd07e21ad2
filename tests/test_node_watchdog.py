"""The node watchdog runs as root and writes into run directories named by any process's environment (issue 14,
item 9): it acts only on directories the launcher made, owned by the job's user, and follows no link."""

import json
import os
import time

from appliance.node.watchdog import node_watch, request_stop
from appliance.protocol import RUN_MARKER


def job(tmp_path, run_dir, name="101"):
    """A fake process table with one process naming ``run_dir``, and a lease ending within the margin."""
    proc = tmp_path / "proc"
    (proc / name).mkdir(parents=True, exist_ok=True)
    (proc / name / "environ").write_bytes(f"PATH=/bin\0APPLIANCE_RUN_DIR={run_dir}\0".encode())
    vd = tmp_path / "vd.json"
    end = time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(time.time() + 60))
    vd.write_text(json.dumps({"chameleon": {"lease_end": end}}))
    return dict(margin=600, once=True, vendordata=[str(vd)], live=None, proc=str(proc))


def run_dir(tmp_path, marked=True):
    d = tmp_path / "home" / "appliance" / "runs" / "r"
    d.mkdir(parents=True)
    if marked:
        (d / RUN_MARKER).touch()
    return d


def test_a_marked_run_directory_gets_its_stop_file(tmp_path):
    d = run_dir(tmp_path)
    assert node_watch(**job(tmp_path, d)) == [str(d)]
    assert json.loads((d / "STOP").read_text())["reason"] == "lease end (node watchdog)"
    assert [p.name for p in d.iterdir() if p.name.startswith(".STOP")] == []


def test_a_symlinked_run_directory_is_not_followed(tmp_path, said):
    d = run_dir(tmp_path)
    link = tmp_path / "link"
    link.symlink_to(d)
    said.clear()
    assert node_watch(**job(tmp_path, link)) == []
    assert not (d / "STOP").exists() and "without following links" in said[0]


def test_a_planted_temporary_link_is_not_written_through(tmp_path):
    d = run_dir(tmp_path)
    victim = tmp_path / "victim"
    victim.write_text("precious")
    for name in (".STOP.tmp", f".STOP.{os.getpid()}.tmp"):
        (d / name).symlink_to(victim)
    assert request_stop(str(d), {os.getuid()}, {"reason": "x"}) is None
    assert victim.read_text() == "precious" and json.loads((d / "STOP").read_text())["reason"] == "x"


def test_a_planted_stop_link_is_left_alone(tmp_path):
    d = run_dir(tmp_path)
    victim = tmp_path / "victim"
    victim.write_text("precious")
    (d / "STOP").symlink_to(victim)
    assert request_stop(str(d), {os.getuid()}, {"reason": "x"}) == "a stop was already asked for"
    assert victim.read_text() == "precious"


def test_an_unmarked_directory_is_not_touched(tmp_path, said):
    d = run_dir(tmp_path, marked=False)
    said.clear()
    assert node_watch(**job(tmp_path, d)) == []
    assert not (d / "STOP").exists() and "not a run directory the appliance made" in said[0]


def test_a_directory_of_another_user_is_not_touched(tmp_path):
    d = run_dir(tmp_path)
    assert request_stop(str(d), {os.getuid() + 4242}, {"reason": "x"}).startswith("owned by uid")
    assert not (d / "STOP").exists()


def test_a_relative_or_dotted_path_is_refused(tmp_path):
    d = run_dir(tmp_path)
    assert request_stop("home/appliance/runs/r", {os.getuid()}, {}) == "not an absolute, normal path"
    assert request_stop(f"{d}/../r", {os.getuid()}, {}) == "not an absolute, normal path"


class _Vendordata:
    """A metadata service on loopback serving ``vendor_data2.json`` with a settable lease end."""

    def __init__(self, end: float | None, delay: float = 0.0):
        import threading
        from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

        outer = self
        self.end, self.delay = end, delay  # delay: a slow metadata service (Nova waits up to 5 + 5 s on vendordata)

        class H(BaseHTTPRequestHandler):
            def log_message(self, *a):
                pass

            def do_GET(self):
                threading.Event().wait(outer.delay)  # the service's own slowness, not a wait for another thread
                doc = {"chameleon": {"lease_end": time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(outer.end))}}
                body = json.dumps(doc).encode()
                self.send_response(200)
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

        self.httpd = ThreadingHTTPServer(("127.0.0.1", 0), H)
        self.url = f"http://127.0.0.1:{self.httpd.server_address[1]}/openstack/latest/vendor_data2.json"
        threading.Thread(target=self.httpd.serve_forever, kwargs={"poll_interval": 0.01}, daemon=True).start()

    def close(self):
        self.httpd.shutdown()
        self.httpd.server_close()


def test_an_extended_lease_is_read_live_not_from_the_hourly_cache(tmp_path):
    """Issue 12 item 3: the CC images refresh the vendordata cache hourly; after an extension it still shows the
    old end. The node watchdog must read the live document and leave the job running."""
    from appliance.node.vendordata import reset_live_backoff

    run_dir = tmp_path / "run"
    run_dir.mkdir()
    (run_dir / RUN_MARKER).write_text("")
    kw = job(tmp_path, str(run_dir))  # the cache: the old end, within the margin
    live = _Vendordata(time.time() + 7200)  # the extended end
    try:
        reset_live_backoff()
        kw["live"] = live.url
        assert node_watch(**kw) == []
        assert not (run_dir / "STOP").exists()
        live.end = time.time() + 60  # the live end is near too: stop
        reset_live_backoff()
        assert node_watch(**kw) == [str(run_dir)]
    finally:
        live.close()


def test_the_cache_is_the_fallback_when_the_metadata_service_is_down(tmp_path):
    from appliance.node.vendordata import reset_live_backoff

    run_dir = tmp_path / "run"
    run_dir.mkdir()
    (run_dir / RUN_MARKER).write_text("")
    kw = job(tmp_path, str(run_dir))
    reset_live_backoff()
    kw["live"] = "http://127.0.0.1:9/openstack/latest/vendor_data2.json"  # nothing listens (discard port)
    assert node_watch(**kw) == [str(run_dir)]
    reset_live_backoff()


def test_the_launcher_can_turn_the_live_vendordata_off(monkeypatch, tmp_path):
    """Single-host mode: the ranks run on the launcher's machine; no look at its cloud's metadata service (tests
    contact only loopback and the testbed's own namespaces)."""
    from appliance.node import vendordata
    from appliance.protocol import Env

    def no_live(url, timeout=None):
        raise AssertionError(f"asked {url}")

    monkeypatch.setattr(vendordata, "live_lease_end", no_live)
    monkeypatch.setenv(Env.VENDORDATA_URL, "")
    assert vendordata.live_url() is None
    assert vendordata.vendordata_lease_end([str(tmp_path / "none")]) is None
    monkeypatch.delenv(Env.VENDORDATA_URL)
    assert vendordata.live_url() == vendordata.LIVE_URL


def test_a_slow_metadata_service_does_not_stop_a_job_whose_lease_was_extended(tmp_path, monkeypatch):
    """Issue 52 item 6: the live read timed out after 2 s, where Nova gives a dynamic vendordata target 5 s to connect
    and 5 to answer; rank 0 then stopped on the hourly cache's old end with no second look, though the lease had
    been extended. An end from the cache that would stop the job is asked live again, with Nova's patience."""
    import threading

    from appliance.node import vendordata
    from appliance.node.checkpointer import Checkpointer

    monkeypatch.setattr(vendordata, "LIVE_TIMEOUT", 0.05)  # below the service's delay: a routine read times out
    monkeypatch.setattr(vendordata, "RECHECK_TIMEOUT", 10.0)
    cache = tmp_path / "vendordata2.json"
    old_end = time.time() + 60
    cache.write_text(json.dumps({"chameleon": {"lease_end": time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(old_end))}}))
    monkeypatch.setattr(vendordata, "VENDORDATA", (str(cache),))
    live = _Vendordata(time.time() + 7 * 86400, delay=0.25)  # extended, and slower than a routine read waits
    try:
        vendordata.reset_live_backoff()
        near = lambda e: time.time() >= e - 600  # noqa: E731
        assert vendordata.vendordata_lease_end((str(cache),), live.url, near=near) > old_end + 86400
        # rank 0's stop check, on the same service
        monkeypatch.setenv("APPLIANCE_VENDORDATA_URL", live.url)
        monkeypatch.setattr("appliance.node.checkpointer.vendordata_lease_end",
                            lambda **kw: vendordata.vendordata_lease_end((str(cache),), **kw))
        ck = Checkpointer.__new__(Checkpointer)  # only the stop check: no model, no Horovod
        # rank 0 reads vendordata off the training thread (_read_vendordata, once a minute): here one read by hand
        ck._local_reason, ck._fault, ck.step, ck.rank, ck._vd_next, ck._commit_s = None, "", 5, 0, 1.0, []
        ck._vd_end = None
        ck.stop_file = tmp_path / "STOP"
        ck._cv = threading.Condition()
        vendordata.reset_live_backoff()
        ck._read_vendordata_once()
        assert ck._local_stop() is False and ck._local_reason is None
        live.end = time.time() + 30  # the live end is near too: stop
        vendordata.reset_live_backoff()
        ck._read_vendordata_once()
        assert ck._local_stop() is True and ck._local_reason == "lease end (vendordata)"
    finally:
        live.close()
        vendordata.reset_live_backoff()
