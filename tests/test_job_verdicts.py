"""A job's verdicts in the fast tier: which rank failed (train.watch.Watch), and what the checkpoint hook makes of
rank 0's reports (exit 75 for a committed stop, a failure for an uncommitted one), with a fake head node
(tests/fakes.py). The same paths run end to end in test_train.py and test_checkpoint.py."""

import json

from appliance.checkpoint.job import JobCheckpoints
from appliance.cluster import Cluster, Node
from appliance.errors import ApplianceError
from appliance.sites import open_site
from appliance.protocol import EXIT_STOPPED, Line, format_line
from appliance.train.launch import JobResult
from fakes import FakeRemote


def _watch(ranks=3):
    from appliance.cluster import Cluster, Node
    from appliance.train.watch import Watch as _Watch
    nodes = [Node(name=f"n{i}", private_ip=f"10.0.0.{i}", address=None, workdir="/w") for i in range(ranks)]
    return _Watch(Cluster(name="x", cloud="testbed", nodes=nodes), None, "job", 1, 1, lambda m: None)


def test_verdict_names_the_rank_that_failed_on_its_own():
    # horovodrun reports the collateral rank first; the rank's own report says who failed first
    w = _watch()
    w.collateral.add(0)
    w.own_exit(2, 3)
    w.rank_exit(0, 1)
    w.own_exit(0, 1)
    w.rank_exit(2, 3)
    assert w.verdict() == "rank 2 on n2 exited with status 3 (then rank 0: status 1)"


def test_verdict_when_the_culprit_never_reported():
    # the culprit was stopped by horovodrun before its own report or exit line came through (seen in CI)
    w = _watch(2)
    w.collateral.add(0)
    w.own_exit(0, 1)
    w.rank_exit(0, 1)
    v = w.verdict()
    assert v.startswith("rank 1 on n1 failed first"), v
    assert v.endswith("(then rank 0: status 1)"), v


def test_verdict_without_collateral_is_the_first_exit():
    w = _watch(2)
    w.rank_exit(1, 255)
    assert w.verdict().startswith("rank 1 on n1 exited with status 255 (lost the SSH connection"), w.verdict()


def _hook(tmp_path):
    node = Node("head", "10.0.0.1", "10.0.0.1", "/w")
    head = FakeRemote(node)
    hook = JobCheckpoints(open_site("local"))
    hook.cluster, hook.head, hook.say = Cluster(name="", cloud="testbed", nodes=[node]), head, lambda m: None
    hook.stop_file = "/w/appliance/runs/r/STOP"
    return hook, head


def _result(rc=0, failure=None):
    return JobResult(job_id="j", exit_code=rc, world_size=2, rank_hosts=["head", "head"], failure=failure)


def test_a_committed_stop_is_exit_75(tmp_path):
    hook, _ = _hook(tmp_path)
    body = {"step": 40, "reason": "lease end", "committed": True, "checkpoint": "ckpt-000000040", "seconds": 0.4}
    assert hook.rank_line(0, format_line(Line.STOPPED, body))
    res = _result()
    hook.finish(res)
    assert res.exit_code == EXIT_STOPPED and res.failure is None and res.stopped["step"] == 40


def test_a_stop_for_the_lease_end_is_told_from_a_users_stop(tmp_path):
    """A managed run (`appliance run`) goes on on a new lease after a job that ended for its lease, and stops after
    a user's stop: the reasons the launcher's watchdog, the vendordata and the node's watchdog give are lease ends;
    SIGTERM and Ctrl-C are not."""
    for reason, lease_end in (("lease 1f2e ends 2026-12-01 10:00 UTC", True), ("lease end (vendordata)", True),
                              ("lease end (node watchdog)", True), ("SIGTERM to appliance train", False),
                              ("Ctrl-C in appliance train", False)):
        hook, _ = _hook(tmp_path)
        hook.rank_line(0, format_line(Line.STOPPED, {"step": 40, "reason": reason, "committed": True,
                                                     "checkpoint": "ckpt-000000040", "seconds": 0.4}))
        res = _result()
        hook.finish(res)
        assert res.exit_code == EXIT_STOPPED and res.lease_end is lease_end, reason


def test_an_uncommitted_stop_is_a_failure_that_says_where_the_checkpoint_is(tmp_path):
    hook, _ = _hook(tmp_path)
    body = {"step": 40, "reason": "lease end", "committed": False, "error": "store unreachable",
            "local": "/w/appliance/runs/r/ckpt-000000040"}
    hook.rank_line(0, format_line(Line.STOPPED, body))
    res = _result()
    hook.finish(res)
    assert res.exit_code == 1 and "NOT committed" in res.failure and body["local"] in res.failure


def test_only_rank_0s_well_formed_reports_are_consumed(tmp_path):
    hook, _ = _hook(tmp_path)
    assert not hook.rank_line(1, format_line(Line.CKPT, {"step": 1}))  # another rank: shown, not consumed
    assert not hook.rank_line(0, Line.CKPT + " {not json")  # shown as is
    assert hook.rank_line(0, format_line(Line.CKPT, {"step": 5, "name": "c", "bytes": 1, "save_s": 0.1,
                                                     "upload_s": 0.2}))
    res = _result()
    hook.finish(res)
    assert [c["step"] for c in res.commits] == [5] and res.exit_code == 0


def test_a_failed_job_keeps_its_own_verdict(tmp_path):
    hook, _ = _hook(tmp_path)
    hook.rank_line(0, format_line(Line.STOPPED, {"step": 3, "reason": "x", "committed": True, "checkpoint": "c",
                                                 "seconds": 1}))
    res = _result(rc=1, failure="rank 1 on head exited with status 1")
    hook.finish(res)
    assert res.exit_code == 1 and res.failure.startswith("rank 1")


def test_a_stop_request_is_written_atomically_once(tmp_path):
    hook, head = _hook(tmp_path)
    hook.request_stop({"reason": "lease ends"})
    hook.request_stop({"reason": "again"})
    assert len(head.commands) == 1
    cmd, stdin = head.commands[0]
    assert "STOP.tmp" in cmd and "mv " in cmd and json.loads(stdin)["reason"] == "lease ends"


def test_an_unreachable_head_is_said_not_raised(tmp_path):
    hook, head = _hook(tmp_path)
    said = []
    hook.say = said.append
    head.fail = ApplianceError("node head stopped answering")
    hook.request_stop({"reason": "lease ends"})
    assert any("could not ask the job to stop" in m for m in said)


def _ended_hook(tmp_path, *, url="swift://ckpts/"):
    import datetime as dt
    from types import SimpleNamespace

    from fakes import FakeSite

    hook, head = _hook(tmp_path)
    site = FakeSite()
    info = site.cloud.create_lease("l", "compute_local", 1, dt.timedelta(hours=1))
    hook.cluster.lease_id = info.id
    hook.watch = SimpleNamespace(site=site, commit_s=[])
    hook.spec = SimpleNamespace(name="myrun", checkpoint=SimpleNamespace(url=url))
    site.cloud.clock = info.end + dt.timedelta(minutes=1)  # the lease has ended
    return hook


def test_a_job_cut_by_the_lease_end_says_so_and_what_survives(tmp_path):
    """Issue 13: it used to read "node ... stopped answering" only."""
    hook = _ended_hook(tmp_path)
    hook.rank_line(0, format_line(Line.CKPT, {"step": 60, "name": "c", "bytes": 1, "save_s": 0.1, "upload_s": 0.2}))
    res = _result(rc=1, failure="node head stopped answering (ranks 0, 1)")
    hook.finish(res)
    assert res.failure.startswith("the lease ended at ") and "stopped answering" in res.failure
    assert "newest committed checkpoint is step 60" in res.failure and "appliance resume myrun" in res.failure
    assert res.lease_end  # a managed run goes on on a new lease


def test_a_job_cut_by_the_lease_end_without_a_commit_is_lost_and_says_why(tmp_path):
    hook = _ended_hook(tmp_path)
    res = _result(rc=1, failure="node head stopped answering (ranks 0, 1)")
    hook.finish(res)
    assert "the run is lost" in res.failure and "docs/checkpoints.md" in res.failure


def test_launch_says_which_protection_applies(tmp_path):
    from types import SimpleNamespace

    from appliance.checkpoint.job import protection_line

    code = tmp_path / "code"
    code.mkdir()
    (code / "train.py").write_text("model.fit(ds, epochs=60)\n")  # an unchanged Horovod example
    cl = SimpleNamespace(lease_end="2026-11-24T12:00:00")
    spec = SimpleNamespace(name="r", code_dir=str(code), checkpoint=SimpleNamespace(url=None, auto=True))
    assert "warning: no checkpoint.url" in protection_line(spec, cl) and "2026-11-24 12:00" in protection_line(spec, cl)
    spec.checkpoint.url = "swift://ckpts/"
    assert protection_line(spec, cl).startswith("[appliance] protected (level 2, ")  # the shim hooks Model.fit
    spec.checkpoint.auto = False
    assert "(level 3 only, " in protection_line(spec, cl) and "checkpoint.auto is false" in protection_line(spec, cl)
    (code / "train.py").write_text("from appliance.checkpoint import keras\nmodel.fit(ds, callbacks=[keras.callback()])\n")
    assert protection_line(spec, cl).startswith("[appliance] protected (level 1, the appliance's callback")
    (code / "train.py").write_text("from appliance.checkpoint.keras import Checkpointer\nfor e, f in ck.epochs(m, 3, 9):\n")
    assert protection_line(spec, cl).startswith("[appliance] protected (level 1, the Checkpointer's loop")
    spec.checkpoint.auto = True
    (code / "train.py").write_text("with hvd.DistributedGradientTape(tf.GradientTape()) as tape:\n")  # a custom loop
    assert "(level 3 only, " in protection_line(spec, cl) and "never calls Model.fit" in protection_line(spec, cl)



def _watch_of(n: int):
    from types import SimpleNamespace

    from appliance.train.watch import Watch as _Watch

    nodes = [Node(name=f"n{i}", private_ip=f"10.0.0.{i}", address=f"10.0.0.{i}", workdir="/w") for i in range(n)]
    said = []
    w = _Watch(Cluster(name="x", cloud="testbed", nodes=nodes), SimpleNamespace(head=object(), remotes={}), "job", 1,
               0.001, said.append)
    return w, said


def test_the_heartbeat_asks_the_workers_at_once():
    """Goal 4 of issue 16: the heartbeat asked the nodes one after the other every 5 s, so one that did not answer
    held up the check of every node after it for its 3 s timeout, and a round over 64 nodes took 64 round trips.
    Here 8 workers answer only when all 8 are asked together (a barrier): asked in turn, the first waits 5 s, is
    taken for dead, and the job is failed."""
    import threading

    w, said = _watch_of(9)
    barrier, rounds = threading.Barrier(8, timeout=5), [0]

    def alive(node):
        if node.name == "n0":  # the head, asked first, alone
            rounds[0] += 1
            if rounds[0] == 4:
                w.done.set()
            return True
        try:
            barrier.wait()
            return True
        except threading.BrokenBarrierError:
            return False

    w._node_alive = alive
    fail = w.fail
    w.fail = lambda msg: (fail(msg), w.done.set())  # a verdict ends the watch here
    w.run()
    assert rounds[0] == 4 and w.failure is None, said


def test_the_heartbeat_names_the_worker_that_stopped_and_gives_no_verdict_without_the_head():
    w, said = _watch_of(4)
    down = {"n2"}
    w._node_alive = lambda node: node.name not in down
    misses = {}
    w._round(misses)
    assert w.failure is None  # once is not enough
    w._round(misses)
    assert w.failure == "node n2 stopped answering (ranks 2)" and w.dead_nodes == {"n2"}
    w, said = _watch_of(4)
    down = {"n0", "n2"}  # the head too: the workers are reached through it, so no verdict on them
    w._node_alive = lambda node: node.name not in down
    misses = {}
    w._round(misses)
    w._round(misses)
    assert w.failure is None and w.head_lost.is_set() and not w.dead_nodes


def test_a_level3_job_ended_after_its_files_were_committed_is_exit_75(tmp_path):
    """Rank 0's syncer ends a level-3-only job after a user's stop (node/filesync.py): rank 0 exits EXIT_STOPPED and
    horovodrun stops the others, which the launcher sees as rank exits; with the syncer's report it is the stop the
    user asked for (exit 75, resumable), not a failure."""
    import pytest

    from appliance.errors import JobFailed
    from appliance.train.launch import check

    hook, _ = _hook(tmp_path)
    said = []
    hook.say = said.append
    body = {"step": None, "committed": True, "reason": "Ctrl-C to appliance train", "files": 4,
            "checkpoint": "files/manifest-4", "seconds": 0}
    assert hook.rank_line(0, format_line(Line.STOPPED, body))
    assert said == ["[checkpoint] stopped (Ctrl-C to appliance train) with the working directory committed "
                    "(manifest 4)"]
    res = _result(rc=1, failure="rank 0 on head ended the job as asked (status 75) (then rank 1: status 143)")
    hook.finish(res)
    assert res.exit_code == EXIT_STOPPED and res.failure is None
    res.run = "r"
    with pytest.raises(JobFailed, match=r"stopped \(Ctrl-C to appliance train\) with its working directory committed "
                                        r"\(manifest 4\)") as e:
        check(res)
    assert e.value.exit_code == EXIT_STOPPED


def test_a_users_stop_asks_a_level3_job_to_end_after_its_sync_and_the_watchdogs_does_not(tmp_path):
    hook, head = _hook(tmp_path)
    code = tmp_path / "code"
    code.mkdir()
    (code / "train.py").write_text("for step in range(10):\n    tape.gradient(loss, vars)\n")  # a custom loop
    hook.spec = type("S", (), {"name": "r", "code_dir": str(code),
                               "checkpoint": type("C", (), {"auto": True, "url": "file:///x/"})()})()
    hook.user_stop("Ctrl-C to appliance train")
    req = json.loads(head.commands[-1][1])
    assert (req["reason"], req.get("end")) == ("Ctrl-C to appliance train", "after-sync")
    hook, head = _hook(tmp_path)
    hook.request_stop({"reason": "the lease ends in 300 s"})  # the watchdog's: the job syncs and trains on
    assert "end" not in json.loads(head.commands[-1][1])
    (code / "train.py").write_text("model.fit(ds, epochs=3)\n")  # level 2: the Checkpointer stops it at a step
    hook, head = _hook(tmp_path)
    hook.spec = type("S", (), {"name": "r", "code_dir": str(code),
                               "checkpoint": type("C", (), {"auto": True, "url": "file:///x/"})()})()
    hook.user_stop("SIGTERM to appliance train")
    req = json.loads(head.commands[-1][1])
    assert (req["reason"], req.get("end")) == ("SIGTERM to appliance train", None)


def test_a_reconnect_reaps_nothing():
    """The launcher lost its connection to the head and reconnects (the watch paused, no failure): the watch reaped
    the job on every node that still answered, as if it had failed (its wait for the grace counted from no failure
    at all), and the job that was meant to go on ended with status 137 (test_train.py's connection-drop test, in 1
    of ~14 runs: those where the 5 s heartbeat fell inside the reconnect; node2's own connection was not cut, and
    its reap saw the head's horovodrun, the testbed's nodes sharing one PID namespace)."""
    import threading

    class Rounds(threading.Event):  # the watch's loop, a fixed number of times, without waiting
        def __init__(self, n):
            super().__init__()
            self.n = n

        def wait(self, timeout=None):
            self.n -= 1
            return self.n < 0

    w, said = _watch_of(3)
    reaps = []

    def reap():
        w.reaped = True
        reaps.append(1)

    w.reap = reap
    w._round = lambda misses: reaps.append("round")  # no verdicts while paused either
    w.paused.set()
    w.done = Rounds(5)
    w.run()
    assert reaps == [] and not w.stop.is_set(), said
    # a failure the watch saw before (or during) the reconnect is still reaped once its grace is over
    w.done = Rounds(5)
    w.fail("rank 1 on n1 exited with status 3")
    w.failed_at -= 2 * w.grace
    w.run()
    assert reaps == [1] and w.stop.is_set()


def test_a_head_gone_with_its_lease_is_not_connected_to_again(monkeypatch):
    """The launcher lost the head, whose lease has ended: the nodes were deleted with it, so it stops at once. It
    used to try an SSH connection first, which a deleted node never answers: its 15 s connect timeout, each time."""
    from types import SimpleNamespace

    import pytest

    from appliance.train import headjob

    tried = []
    monkeypatch.setattr(headjob, "Session", lambda cluster: tried.append(cluster) or pytest.fail("connected"))
    cluster = SimpleNamespace(head=SimpleNamespace(name="node-1"))
    with pytest.raises(headjob._NodesGone, match="node-1 is gone with its lease"):
        headjob._reconnect(cluster, [SimpleNamespace(gone=lambda: True)], lambda m: None, 300)
    assert not tried


def test_tensorflows_harmless_nodedef_line_is_not_shown_and_the_rest_is(tmp_path):
    """TensorFlow 2.18 logs at error level, on every rank using tf.data with op determinism, that a rewritten node
    has an attribute its op lacks ("Unknown attributes will be ignored"): the launcher does not show it (issue 61)."""
    from appliance.train.launch import _Lines, _Output
    from appliance.train.watch import Watch

    shown = []
    out = _Output(tmp_path / "job.log", shown.append)
    lines = _Lines(Watch.__new__(Watch), [], out, ["node1"])
    tf_line = ("2026-12-02 06:55:13.031803: E tensorflow/core/framework/node_def_util.cc:676] NodeDef mentions "
               "attribute use_unbounded_threadpool which is not in the op definition: Op<name=MapDataset; ...>")
    lines("stdout", f"[0]<stderr>:{tf_line}")
    lines("stdout", "[0]<stdout>:epoch 1/3 loss=0.5")
    assert shown == ["[0|node1] epoch 1/3 loss=0.5"]
