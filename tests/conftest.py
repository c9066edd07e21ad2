"""Fixtures: an isolated APPLIANCE_HOME, and testbeds that are removed even when a test fails."""

from __future__ import annotations

import contextlib
import os
import sys
import tempfile
import textwrap
import threading
from pathlib import Path

import pytest

from appliance import report, testbed

ROOT = Path(__file__).resolve().parents[1]
NETNS_OK, NETNS_WHY = testbed.namespaces_available()
needs_netns = pytest.mark.skipif(not NETNS_OK, reason=f"network namespaces unavailable: {NETNS_WHY}")
# Testbeds are machine-wide (namespaces, bridges, links): each pytest-xdist worker (`make test` runs a few) has
# its own names, gw0 -> pt0, pk0, ...; a run without workers uses the bare names.
_WORKER = os.environ.get("PYTEST_XDIST_WORKER", "")
_SUFFIX = _WORKER[2:] if _WORKER.startswith("gw") else ""


def tb_name(base: str) -> str:
    """This test process's name for testbed ``base``."""
    return base + _SUFFIX


# Testbed names the tests use; swept before the session in case an earlier run was killed.
TEST_TESTBEDS = tuple(tb_name(n) for n in ("pt", "pk", "lc", "sh"))


def _has_e2e(session) -> bool:
    return any(item.get_closest_marker("e2e") for item in session.items)


@pytest.fixture(scope="session", autouse=True)
def one_session_at_a_time(request):
    """Testbed names are machine-wide: two sessions with end-to-end tests at once would sweep each other's nodes
    (one lock per worker name: the workers of one run use different names). A fast-tier session (`-m "not e2e"`)
    touches no testbed, so it runs beside one."""
    import fcntl

    if not _has_e2e(request.session):
        yield
        return
    fh = open(f"/tmp/appliance-tests{_SUFFIX}.lock", "w")
    try:
        fcntl.flock(fh, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        pytest.exit("another appliance test session is running on this machine (testbeds share names); "
                    "wait for it to finish", returncode=3)
    yield
    fh.close()


@pytest.fixture(scope="session", autouse=True)
def appliance_home(request, tmp_path_factory, one_session_at_a_time):
    home = tmp_path_factory.mktemp("appliance-home")
    old = os.environ.get("APPLIANCE_HOME")
    os.environ["APPLIANCE_HOME"] = str(home)
    if NETNS_OK and _has_e2e(request.session):
        for name in TEST_TESTBEDS:
            testbed.down(name)
    yield home
    if old is None:
        os.environ.pop("APPLIANCE_HOME", None)
    else:
        os.environ["APPLIANCE_HOME"] = old


@pytest.fixture(scope="session", autouse=True)
def autograph_files():
    """TensorFlow's autograph writes each converted function to /tmp/__autograph_generated_file*.py and removes it
    in an atexit handler (tensorflow/python/autograph/pyct/loader.py load_source), which a process killed by a
    signal (the ranks the tests kill, horovodrun's ending of the others) never runs: ~250 were left per full run.
    Those written during this session go with it."""
    import glob
    import time

    t0 = time.time()
    yield
    for f in glob.glob(os.path.join(tempfile.gettempdir(), "__autograph_generated_file*.py")):
        with contextlib.suppress(OSError):
            if os.stat(f).st_mtime >= t0:
                os.unlink(f)


def make_testbed(name: str, nodes: int):
    tb = testbed.up(name, nodes)
    return tb


@pytest.fixture(scope="session")
def tb2():
    """A 2-node testbed shared by the multi-node tests that do not break it."""
    if not NETNS_OK:
        pytest.skip(f"network namespaces unavailable: {NETNS_WHY}")
    tb = make_testbed(tb_name("pt"), 2)
    try:
        yield tb
    finally:
        testbed.down(tb.name)


@pytest.fixture(scope="session")
def cluster2(tb2):
    from appliance.cluster import from_testbed

    return from_testbed(tb2, name="pt-cluster")


_WITH_DIGITS: dict[str, Path] = {}


def digits_code(example: str = "digits") -> Path:
    """examples/EXAMPLE's train.py (and its other modules) with the digits beside it (digits.npz, as examples/digits/make_dataset.py writes it
    for `make deploy`), one copy per test process. The digits example reads it with ``--data .``, plain_fit whenever
    it is there: the same images as scikit-learn's (the same weights), and the ranks do not import scikit-learn
    (1.9 s of CPU per rank start here)."""
    import atexit
    import shutil
    import subprocess

    if example not in _WITH_DIGITS:
        d = Path(tempfile.mkdtemp(prefix=f"appliance-{example}-"))
        atexit.register(shutil.rmtree, d, True)
        os.chmod(d, 0o755)  # the ranks' user reads it on the testbed's nodes
        for f in (ROOT / "examples" / example).glob("*.py"):  # train.py and the modules beside it
            if f.name != "make_dataset.py":
                shutil.copy(f, d / f.name)
        subprocess.run([sys.executable, str(ROOT / "examples" / "digits" / "make_dataset.py"), str(d)], check=True,
                       capture_output=True)
        _WITH_DIGITS[example] = d
    return _WITH_DIGITS[example]


def write_spec(dirpath: Path, command: str, *, code: Path, name: str = "t", nodes: int = 2, slots: int = 1,
               extra: str = "") -> Path:
    p = dirpath / f"{name}.yaml"
    p.write_text(textwrap.dedent(f"""\
        name: {name}
        cloud: local
        nodes: {{count: {nodes}, slots: {slots}}}
        train:
          code: {code}
          command: {command}
          start_timeout: 60
        """) + extra)
    return p


@pytest.fixture(scope="module")
def cloud():
    """The local cloud (Keystone, Blazar, Nova, Neutron, Glance, Heat + a real Swift), per test module."""
    from appliance import localcloud

    localcloud.start()
    try:
        yield localcloud
    finally:
        localcloud.stop()


@pytest.fixture(autouse=True)
def _messages_stay_in_their_test():
    """A sink a test's code chose for the rest of its process (report.default: a Checkpointer or file syncer made
    in the test process) ends with the test."""
    import logging

    root = logging.getLogger(report.ROOT)
    handlers, level, propagate = list(root.handlers), root.level, root.propagate
    yield
    root.handlers[:] = handlers
    root.setLevel(level)
    root.propagate = propagate


@pytest.fixture
def said():
    """What the appliance's code said (appliance.report) while the test ran, line by line."""
    lines: list[str] = []
    with report.to(lines.append):
        yield lines


@pytest.fixture
def jobs_dir(tmp_path):
    """Small Horovod programs used by the launch tests."""
    d = tmp_path / "jobs"
    d.mkdir()
    (d / "loop.py").write_text(textwrap.dedent("""\
        # Allreduce in a loop; optionally one rank crashes at a given step.
        import argparse, json, os, socket, sys, time
        import horovod.tensorflow as hvd
        import tensorflow as tf
        ap = argparse.ArgumentParser()
        ap.add_argument("--steps", type=int, default=1000000)
        ap.add_argument("--crash-rank", type=int, default=-1)
        ap.add_argument("--crash-step", type=int, default=-1)
        a = ap.parse_args()
        hvd.init()
        for step in range(a.steps):
            v = hvd.allreduce(tf.constant([float(hvd.rank())]), op=hvd.Sum)
            if step % 10 == 0:
                print(f"step {step} sum={float(v[0])} host={socket.gethostname()}", flush=True)
            if hvd.rank() == a.crash_rank and step == a.crash_step:
                print("crashing on purpose", flush=True)
                sys.exit(3)
            time.sleep(0.01)
        print("APPLIANCE_RESULT " + json.dumps({"rank": hvd.rank(), "hostname": socket.gethostname()}), flush=True)
        """))
    (d / "dump_env.py").write_text(textwrap.dedent("""\
        # Each rank reports the names of its environment variables: what horovodrun started it with (its rank
        # too), before anything is imported (TensorFlow would take 4-5 s of CPU and tell nothing more).
        import json, os, socket
        print("APPLIANCE_RESULT " + json.dumps({"rank": int(os.environ["HOROVOD_RANK"]),
              "hostname": socket.gethostname(), "env": sorted(os.environ)}), flush=True)
        """))
    return d


@pytest.fixture
def python_exe():
    return sys.executable


# The two tiers. e2e: real parts (network namespaces with sshd, the local cloud, real Swift, horovodrun, TensorFlow
# jobs); everything else is the fast tier (`pytest -m "not e2e"`, no root, well under a minute).
E2E_FIXTURES = {"tb2", "cluster2", "cloud", "swift", "st_env", "reference", "reference_long", "creds"}
E2E_TESTS: set[str] = set()  # tests that are end-to-end by what they run, not by their fixtures


# The test files that run longest go first: `make test`'s workers take one file at a time in this order (--dist
# loadfile --no-loadscope-reorder), so the long ones start early and the many short files even out the end, and
# the workers finish together (longest first). Without it xdist orders files by their number of tests, which put
# test_outage and test_stream_train last: one worker ran them alone for 2-3 minutes. The order follows the
# seconds each file took in a whole run here (2 cores): lease_end 910, checkpoint 354, keras_fit 294, image 256,
# store_guarantees 202, stream_train 198, train 195, stage 153, provision 147, doctor_gpu 113, outage 104,
# client_install 97, bench 95, keras3 94, heat 91, keras_iterators 30; every other file under 15. Except test_outage,
# third: most of its time is a frozen Keystone waited out (FREEZE_S), a core idle unless the other workers run files
# that keep both busy.
LONGEST_FIRST = ["test_lease_end.py", "test_checkpoint.py", "test_outage.py", "test_keras_fit.py", "test_image.py",
                 "test_stream_train.py", "test_train.py", "test_store_guarantees.py", "test_stage.py",
                 "test_client_install.py", "test_provision.py", "test_doctor_gpu.py", "test_keras3.py", "test_bench.py",
                 "test_heat.py", "test_fault_matrix.py"]


def pytest_collection_modifyitems(config, items):
    first = {name: i for i, name in enumerate(LONGEST_FIRST)}
    items.sort(key=lambda item: first.get(item.path.name, len(first)))  # stable: each file's own order stays
    for item in items:
        if (item.get_closest_marker("slow") or item.get_closest_marker("root")
                or E2E_FIXTURES & set(getattr(item, "fixturenames", ())) or item.originalname in E2E_TESTS):
            item.add_marker(pytest.mark.e2e)


@pytest.fixture(scope="module")
def swift(tb2, tmp_path_factory, request):
    """A real object store on the testbed's bridge, one per test module (test_stage.py has its own): OpenStack
    Swift, or Ceph RGW for a test parametrized ``@pytest.mark.parametrize("swift", ["swift", "rgw"],
    indirect=True)``. (The local cloud's own store, for tests that use ``cloud``, is RGW.)"""
    from appliance.localcloud.rgw_server import RGWServer
    from appliance.localcloud.swift_server import SwiftServer

    kind = getattr(request, "param", "swift")
    server = RGWServer if kind == "rgw" else SwiftServer
    sw = server(tmp_path_factory.mktemp(kind), bind_ip=tb2.host_ip).start()
    try:
        yield sw
    finally:
        sw.stop()


@pytest.fixture
def st_env(swift, monkeypatch):
    """Object-store credentials the way a user sets them (ST_*), for runs on the plain testbed."""
    def use(auth_url):
        monkeypatch.setenv("ST_AUTH", auth_url)
        monkeypatch.setenv("ST_USER", swift.user)
        monkeypatch.setenv("ST_KEY", swift.key)
    use(swift.auth_url)
    return use


def _delayed_acks_sent() -> int:
    """TcpExt DelayedACKs of this network namespace (/proc/net/netstat): ACKs the kernel sent when its
    delayed-ACK timer (40 ms at least, TCP_DELACK_MIN) ran out, rather than at once."""
    with open("/proc/net/netstat") as fh:
        lines = [line.split() for line in fh if line.startswith("TcpExt:")]
    return int(lines[1][lines[0].index("DelayedACKs")])


def delayed_acks(fn, n: int = 20) -> int:
    """How many ACKs the kernel delayed during ``n`` calls of ``fn``, after one call not counted (a new
    connection's first answer is ACKed at once anyway: the kernel starts in quick-ACK mode). An answer whose body
    waits for our ACK of its headers (a server that writes them apart, Nagle on: Ceph RGW's beast) costs one such
    ACK and 40 ms: n calls count n or more without quick ACKs (tcp.py), 0 with them, plus the few the namespace's
    other connections cost meanwhile (1-2 a second here with Ceph running). Counted, not timed, so a loaded
    machine neither fails nor passes it."""
    fn()
    before = _delayed_acks_sent()
    for _ in range(n):
        fn()
    return _delayed_acks_sent() - before


class VirtualClock:
    """A module's ``time`` under test: the real clocks plus every sleep(), which returns at once, so a retry's
    backoff up to its deadline is walked without waiting it out; the rest is the real time module."""

    def __init__(self):
        import time as real

        self._real, self.slept = real, 0.0

    def time(self) -> float:
        return self._real.time() + self.slept

    def monotonic(self) -> float:
        return self._real.monotonic() + self.slept

    def sleep(self, s: float) -> None:
        self.slept += max(0.0, s)

    def __getattr__(self, name):
        return getattr(self._real, name)


@pytest.fixture
def virtual_time(monkeypatch):
    """``virtual_time(module)``: that module's ``time`` is a VirtualClock (returned) for the test."""
    def use(module) -> VirtualClock:
        clock = VirtualClock()
        monkeypatch.setattr(module, "time", clock)
        return clock
    return use


@contextlib.contextmanager
def http_server(handler):
    """``http://127.0.0.1:PORT`` of a threaded http.server with ``handler``, shut down and closed on exit."""
    from http.server import ThreadingHTTPServer

    srv = ThreadingHTTPServer(("127.0.0.1", 0), handler)
    t = threading.Thread(target=srv.serve_forever, kwargs={"poll_interval": 0.01}, daemon=True)
    t.start()
    try:
        yield f"http://127.0.0.1:{srv.server_address[1]}"
    finally:
        srv.shutdown()
        srv.server_close()


