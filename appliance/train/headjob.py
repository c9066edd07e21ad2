"""The job on the head node: where its files live, how it is started detached (its own session, its output in
<run dir>/JOB.out, its exit status in JOB.rc), and how the launcher follows its output, reconnecting when the
connection drops (the job goes on without the launcher). Also `appliance logs`."""

from __future__ import annotations

import json
import os
import re
import shlex
import time
from collections.abc import Callable
from pathlib import Path

from ..cluster import Cluster, Node
from ..errors import ApplianceError
from ..protocol import Line, job_files, parse
from ..remote import ConnectionLost, HostKeyMismatch, Remote, Result, Session
from .watch import Watch

RANK_LINE = re.compile(r"^\[(\d+)\]<(stdout|stderr)>:(.*)$")
EXIT_LINE = re.compile(r"^Process (\d+) exit with status code (-?\d+)\.")


# Lines of a rank's output that say nothing about the job and are not shown (the job's log on the head node keeps
# them; docs/troubleshooting.md says which and why): TensorFlow 2.18's error-level note, on every rank that uses
# tf.data with op determinism on, that a rewritten dataset node carries an attribute its op does not define
# (tensorflow core/framework/node_def_util.cc: "Unknown attributes will be ignored").
HIDDEN = re.compile(r"NodeDef mentions attribute use_unbounded_threadpool which is not in the op definition")


def hidden(text: str) -> bool:
    return HIDDEN.search(text) is not None


def who(rank: int, rank_hosts: list[str]) -> str:
    """How a rank's output lines are prefixed: ``[rank|host]``."""
    return f"[{rank}|{rank_hosts[rank] if rank < len(rank_hosts) else '?'}]"


def run_dir(cluster: Cluster, run: str) -> str:
    """The run directory on the head node: <workdir>/appliance/runs/RUN (STOP file, credentials file, code)."""
    return f"{cluster.head.workdir}/appliance/runs/{run}"


def ask_to_stop(cluster: Cluster, run: str, reason: str) -> None:
    """Ask the run's job on ``cluster`` to stop at its next step (with a checkpoint), from any process: the STOP file
    in its run directory on the head node, as the job's own launcher writes it (checkpoint.job request_stop)."""
    stop = shlex.quote(f"{run_dir(cluster, run)}/STOP")
    with Session(cluster) as session:
        session.head.run(f"cat > {stop}.tmp && mv {stop}.tmp {stop}", check=True, timeout=30,
                         stdin=json.dumps({"reason": reason, "deadline": time.time() + 600}).encode())


def code_dir(cluster: Cluster, run: str) -> str:
    return f"{run_dir(cluster, run)}/code"


RUN_LOCK = ".lock"  # in the run directory on the head node: held (flock) by the running job's process tree
RUN_BUSY = 73  # flock's exit status when the run's lock is taken (flock -E)


def code_files(code: str, exclude: tuple[str, ...] = ("__pycache__", ".git")) -> list[str]:
    """The files `put_dir` copies into the code directory (relative paths)."""
    root = Path(code)
    return sorted(p.relative_to(root).as_posix() for p in root.rglob("*")
                  if p.is_file() and not set(p.relative_to(root).parts) & set(exclude))


def check_run_free(head: Remote, rd: str, run: str) -> None:
    """Refuse a second job of the same run on this cluster before it touches anything: the two would share the run
    directory, its STOP file and credentials, and prune each other's checkpoints."""
    r = _try_run_lock(head, rd)
    if r.rc == RUN_BUSY:
        raise ApplianceError(f"run {run!r} already has a job running on {head.node.name} (its run directory {rd} is "
                             "locked by that job's processes)",
                             f"wait for it to end; or ask it to stop with a checkpoint: `ssh {head.node.name} "
                             f"touch {rd}/STOP`; or give this spec another name")
    if r.rc != 0:
        err = r.err.strip()[-200:]
        fix = (f"the login user {head.node.user} must own the work directory: `appliance up` again gives it (or "
               f"`sudo chown -R {head.node.user}: {rd.rsplit('/runs/', 1)[0]}` on {head.node.name})"
               if "Permission denied" in err else "the node needs flock (util-linux)")
        raise ApplianceError(f"cannot check the run lock on {head.node.name}: {err}", fix)


def _try_run_lock(head: Remote, rd: str) -> Result:
    """Take and drop the run directory's lock on the head: exit 0 when free, RUN_BUSY while a job's processes hold
    it (locked_command)."""
    return head.run(f"mkdir -p {shlex.quote(rd)} && flock -n -E {RUN_BUSY} {shlex.quote(rd + '/' + RUN_LOCK)} true",
                    timeout=30)


def job_runs(cluster: Cluster, run: str) -> bool | None:
    """Whether a job of ``run`` runs on the cluster's head node now: a process holds the run directory's lock
    (locked_command). None when the head cannot be asked (it does not answer, its servers are gone)."""
    try:
        with Session(cluster) as session:
            r = _try_run_lock(session.head, run_dir(cluster, run))
    except Exception:  # noqa: BLE001 - cannot tell: the caller waits, as for a job that runs
        return None
    return True if r.rc == RUN_BUSY else False if r.rc == 0 else None


def job_end(cluster: Cluster, run: str, job_id: str) -> dict | None:
    """How a detached job of ``run`` ended, from its files on the head node: {"rc": its exit status, "stopped":
    rank 0's stop report (Line.STOPPED: a stop before the lease end; its ranks then exit 0), "resumed": rank 0's
    resume report (Line.RESUMED)}. None when it has not ended (no .rc file) or the head cannot be asked."""
    out_file, rc_file, _ = job_files(run_dir(cluster, run), job_id)
    cmd = (f"cat {shlex.quote(rc_file)} && grep -a -E '^\\[0\\]<stdout>:({Line.STOPPED}|{Line.RESUMED}) ' "
           f"{shlex.quote(out_file)}; true")
    try:
        with Session(cluster) as session:
            r = session.head.run(cmd, timeout=30)
    except Exception:  # noqa: BLE001 - cannot tell
        return None
    return parse_end(r.out)


def parse_end(text: str) -> dict | None:
    """job_end's answer from what the head printed: the .rc file's status, then rank 0's report lines."""
    first, *rest = text.splitlines() or [""]
    if not first.strip().lstrip("-").isdigit():
        return None
    end: dict = {"rc": int(first.strip()), "stopped": None, "resumed": None}
    for line in rest:
        m = RANK_LINE.match(line)
        got = parse(m.group(3), (Line.STOPPED, Line.RESUMED)) if m else None
        if got and isinstance(got[1], dict):
            end["stopped" if got[0] == Line.STOPPED else "resumed"] = got[1]
    return end


def locked_command(rd: str, cmd: str) -> str:
    """The job's command holding the run's lock for as long as any of its processes lives (the lock's descriptor is
    inherited by horovodrun and the ranks), whatever happens to the launcher's connection."""
    return f"flock -n -E {RUN_BUSY} {shlex.quote(rd + '/' + RUN_LOCK)} sh -c {shlex.quote(cmd)}"


def detached_command(rd: str, job_id: str, cmd: str) -> str:
    """Start ``cmd`` in a session of its own on the head node, not tied to this SSH connection (no hangup, no pipe
    that breaks when the launcher goes away); prints the PID that lives as long as the job."""
    out, rc, pid = (shlex.quote(f) for f in job_files(rd, job_id))
    inner = f"echo $$ > {pid}; {cmd} > {out} 2>&1 < /dev/null; echo $? > {rc}.tmp && mv {rc}.tmp {rc}"
    return f"cd / && setsid sh -c {shlex.quote(inner)} > /dev/null 2>&1 < /dev/null & echo $!"


def follow_command(rd: str, job_id: str, pid: int | str, first_line: int | str) -> str:
    """The job's output from line ``first_line`` (1: all; "-N": the last N), as it is written, until the job's
    process (``pid``: a number or a shell expression) is gone; tail looks for it every 0.1 s (``-s``), new lines
    come at once (inotify)."""
    out = job_files(rd, job_id)[0]
    first = str(first_line) if str(first_line).startswith("-") else f"+{first_line}"
    return f"tail -n {first} -s 0.1 --pid={pid} -F {shlex.quote(out)} 2>/dev/null; true"


def newest_job(head: Remote, rd: str) -> str | None:
    """The id of the newest job whose output is in the run directory on the head node."""
    r = head.run(f"cd {shlex.quote(rd)} 2>/dev/null && ls -t -- *.out 2>/dev/null | head -n 1", timeout=30)
    name = r.out.strip()
    return name[:-len(".out")] if name.endswith(".out") else None


def job_log(cluster: Cluster, run: str, *, job_id: str | None = None, lines: int = 50, follow: bool = False,
            out: Callable[[str], None] = print) -> str:
    """`appliance logs RUN`: the last ``lines`` lines (0: all) of the run's newest job (or ``job_id``) from the head
    node, where the detached job writes them; ``follow``: until the job ends. Returns the job id."""
    rd = run_dir(cluster, run)
    with Session(cluster) as session:
        job_id = job_id or newest_job(session.head, rd)
        if job_id is None:
            raise ApplianceError(f"no job output of run {run!r} on {cluster.head.name} (in {rd})",
                                 "check the run's name and cluster (`appliance ls`, `appliance status`)")
        out_file, rc_file, pid_file = (shlex.quote(f) for f in job_files(rd, job_id))
        cmd = f"tail -n {f'-{lines}' if lines > 0 else '+1'} {out_file}"
        if follow:  # without a PID file (a job from before jobs recorded it): what is there
            cmd = (f"if [ -s {pid_file} ]; then {follow_command(rd, job_id, f'$(cat {pid_file})', -lines or 1)}; "
                   f"else {cmd}; fi")
        hosts = cluster.rank_hosts()

        def show(stream: str, line: str) -> None:  # as `appliance train` shows them: [rank|host] text
            m = RANK_LINE.match(line)
            if m is None:
                out(f"[horovodrun] {line}")
            elif parse(m.group(3), (Line.RANK_EXIT,)) is None and not hidden(m.group(3)):
                rank = int(m.group(1))
                out(f"{who(rank, hosts)} {m.group(3)}")

        r = session.head.run(cmd, on_line=show)
        if r.rc != 0:
            raise ApplianceError(f"cannot read the output of job {job_id} on {cluster.head.name}: "
                                 f"{r.err.strip()[-200:]}")
        st = session.head.run(f"cat {rc_file} 2>/dev/null || echo running", timeout=30).out.strip()
        out(f"[appliance] job {job_id} on {cluster.head.name}: "
            + ("still running" if st == "running" else f"ended with exit code {st}"))
    return job_id


def reconnect_seconds() -> float:
    """How long the launcher tries to reach the head node again after losing it (APPLIANCE_RECONNECT_SECONDS)."""
    try:
        return max(0.0, float(os.environ.get("APPLIANCE_RECONNECT_SECONDS", "300")))
    except ValueError:
        return 300.0


class _Connection:
    """The launcher's current session with the cluster; replaced when it reconnects."""

    def __init__(self, session: Session):
        self.session = session


class _Head(Remote):
    """The head node through the launcher's current connection, so hooks keep working after a reconnect."""

    def __init__(self, conn: _Connection):
        self._conn = conn

    @property
    def node(self) -> Node:  # type: ignore[override]
        return self._conn.session.head.node

    def run(self, command: str, **kw) -> Result:
        return self._conn.session.head.run(command, **kw)


class _NodesGone(ApplianceError):
    """The head cannot be reached because the lease ended: the job is gone with its nodes."""


def _reconnect(cluster: Cluster, hooks, say: Callable[[str], None], limit: float) -> Session:
    """A new session with the cluster, tried until ``limit`` seconds have passed or a hook says the nodes are gone:
    asked before each try too, since a node deleted with its lease answers nothing, and a try waits out its
    connect timeout (15 s) before it fails."""
    t0 = time.monotonic()
    delay = 1.0
    while True:
        if any(h.gone() for h in hooks):
            raise _NodesGone(f"{cluster.head.name} is gone with its lease: the lease has ended")
        try:
            return Session(cluster)
        except HostKeyMismatch:
            raise
        except ApplianceError as e:
            if any(h.gone() for h in hooks):
                raise _NodesGone(f"{e.message}; the lease has ended") from None
            if time.monotonic() - t0 + delay > limit:
                raise ApplianceError(f"{e.message}; gave up after {limit:.0f}s") from None
            say(f"[appliance] the head node does not answer yet ({e.message}); trying again in {delay:.0f}s")
            time.sleep(delay)  # waiting for a network or a node to come back: there is nothing to wait on
            delay = min(delay * 2, 30.0)


def follow(conn: _Connection, cluster: Cluster, watch: Watch, hooks, say: Callable[[str], None], rd: str,
            job_id: str, pid: int, on_line, lines_seen: list[int], out_file: str, rc_file: str) -> int:
    """Follow the detached job's output until it ends, reconnecting when the head connection drops; its exit
    status (255 when the head could not be reached again: the job may still run there)."""
    head_name = cluster.head.name
    while True:
        lost = None
        try:
            r = conn.session.head.run(follow_command(rd, job_id, pid, lines_seen[0] + 1), on_line=on_line,
                                      stop=watch.stop)
            if r.rc != 0 and not watch.stop.is_set():  # the follow command always exits 0 when it ends
                lost = "the connection closed"
        except ConnectionLost as e:
            lost = e.message
        if lost is None and not watch.head_lost.is_set():
            break  # the job's process is gone (or the watch stopped following after it killed the job)
        watch.paused.set()
        limit = reconnect_seconds()
        say(f"[appliance] lost the connection to the head node {head_name} ({lost or 'it stopped answering'}); "
            f"the job goes on there without this launcher; reconnecting (for up to {limit:.0f}s)")
        t0 = time.monotonic()
        try:
            new = _reconnect(cluster, hooks, say, limit)
        except ApplianceError as e:
            # _NodesGone: the job ended with its nodes, nothing of it is left to keep; otherwise it may still run
            watch.abandoned = not isinstance(e, _NodesGone)
            watch.fail(f"lost the connection to the head node {head_name} ({e.message})"
                       + (f"; if the node is still up the job may still be running there: its output is in "
                          f"{out_file} on {head_name}" if watch.abandoned else ""))
            watch.reaped = True  # nothing to reach (and nothing to kill in what may be a healthy job)
            return 255
        old, conn.session, watch.session = conn.session, new, new
        old.close()
        watch.head_lost.clear()
        watch.stop.clear()
        watch.paused.clear()
        say(f"[appliance] reconnected to {head_name} after {time.monotonic() - t0:.1f}s; the job's output follows "
            f"from line {lines_seen[0] + 1}")
    r = conn.session.head.run(f"cat {shlex.quote(rc_file)} 2>/dev/null", timeout=30)
    code = r.out.strip()
    if code.lstrip("-").isdigit():
        return int(code)
    if watch.failure is None:
        watch.fail(f"the job's exit status was not recorded ({rc_file} on {head_name} is missing)")
    return 1
