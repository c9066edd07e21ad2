"""Launch a Horovod job: horovodrun on the head node, over SSH, with a scrubbed environment.

What happens, in order:
1. contextualize every node (idempotent; learns the NIC for Gloo/NCCL);
2. copy the training code to the same path on every node (<workdir>/appliance/runs/RUN/code);
3. start ``horovodrun`` **on the head node** (started elsewhere, workers cannot reach the Gloo
   rendezvous address it advertises) with ``--network-interface``, ``--start-timeout`` and an
   environment built from an allow-list: horovodrun forwards its whole environment to every rank;
4. stream every rank's output back, prefixed with rank and host. The job runs detached on the head (its own
   session, its output in <run dir>/JOB.out, its exit status in JOB.rc): when the launcher's connection drops it
   goes on, and the launcher reconnects and follows the output from the line where it stopped;
5. watch for failure: a rank that exits non-zero, or a worker whose sshd stops answering. Gloo
   usually stops the survivors by itself; if the job is still running ``grace`` seconds later,
   every process carrying this job's id is killed on every node that answers (by PID), so the
   job always ends, and the message names the rank and node.

The command's exit code is the job's.
"""

from __future__ import annotations

import json
import os
import re
import shlex
import shutil
import socket
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from .. import paths, report
from ..cluster import Cluster, Node
from ..errors import ApplianceError, JobFailed
from ..protocol import EXIT_STOPPED, Env, Line, job_files, parse, rank_environment
from ..provision.contextualize import contextualize
from ..remote import ConnectionLost, HostKeyMismatch, LocalRemote, Remote, Result, Session, SSHRemote
from ..spec import Spec


RANK_LINE = re.compile(r"^\[(\d+)\]<(stdout|stderr)>:(.*)$")
EXIT_LINE = re.compile(r"^Process (\d+) exit with status code (-?\d+)\.")
# Each rank's command runs under this wrapper, which prints the rank's own exit status as it exits: when one
# rank fails, horovodrun kills the other ranks' ssh, and ssh's 255 would hide the real status.
RANK_WRAPPER = f'"$@"; rc=$?; echo "{Line.RANK_EXIT} $rc"; exit $rc'
# Output of a rank that failed *because another rank did* (so it is not the one to blame).
COLLATERAL = re.compile(r"Horovod has been shut down|HorovodInternalError|Connection closed by peer|"
                        r"Connection reset by peer|Broken pipe|gloo/transport|Read error \[")
PROBES_IN_FLIGHT = 16  # nodes the heartbeat probes, and the reaper clears, at once (_Watch)
SYSTEM_PATH = "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"


def who(rank: int, rank_hosts: list[str]) -> str:
    """How a rank's output lines are prefixed: ``[rank|host]``."""
    return f"[{rank}|{rank_hosts[rank] if rank < len(rank_hosts) else '?'}]"

REAP_SCRIPT = r"""
id="$1"
for d in /proc/[0-9]*; do
  pid=${d#/proc/}
  if tr '\0' '\n' < "$d/environ" 2>/dev/null | grep -qxF "%s=$id"; then
    kill -9 "$pid" 2>/dev/null && echo "$pid"
  fi
done
true
""" % Env.JOB_ID


@dataclass
class JobResult:
    job_id: str
    exit_code: int
    world_size: int
    rank_hosts: list[str]
    results: dict[int, dict] = field(default_factory=dict)
    failure: str | None = None
    wall_s: float = 0.0
    log_path: str = ""
    run: str = ""
    cluster_cloud: str = ""
    stopped: dict | None = None  # rank 0's Line.STOPPED report: stopped before the lease end
    commits: list[dict] = field(default_factory=list)  # checkpoints committed during the job
    resumed: dict | None = None  # where the job resumed from
    started_at: float = 0.0
    # wall-clock times (time.time(), on the launcher): "launched" (horovodrun started, after the job's setup),
    # "resumed" (rank 0 restored the checkpoint), "first_step" (rank 0's first step done); hooks fill the last two
    timeline: dict[str, float] = field(default_factory=dict)
    resume_breakdown: dict | None = None  # `appliance resume`: seconds of each part of the downtime (flows.resume)
    abandoned: bool = False  # the launcher lost the head node and gave up: the job may still be running there

    @property
    def hostnames(self) -> list[str]:
        return sorted({r.get("hostname", "?") for r in self.results.values()})


@dataclass
class JobContext:
    """What a hook sees of the job it is added to."""

    spec: Spec
    cluster: Cluster
    head: Remote
    run_dir: str  # on the head node
    job_id: str
    restore: str | None  # the checkpoint directory the ranks resume from (None: a fresh start; "": a resume with
    # no checkpoint, only the synced working directory, level 3)
    say: Callable[[str], None]
    # set before the hooks close when the launcher lost the head node and gave up: the job may still be running
    # there, so what it needs (its credentials file, the run's lock) must stay
    abandoned: bool = False


class JobHooks:
    """Behaviour other steps add to a job, so that `train` imports none of them (as Horovod's gloo_run takes its
    behaviour as callables). Checkpoints and run records are hooks (appliance.checkpoint); `flows.run_job` adds
    them. Hooks are called in list order."""

    def prepare(self, ctx: JobContext) -> dict[str, str]:
        """Before the job: set up the head node; returns variables for the ranks. Raise to refuse the job."""
        return {}

    def started(self, ctx: JobContext) -> None:
        """The job is about to start."""

    def rank_line(self, rank: int, text: str) -> bool:
        """A line a rank printed; True when the hook consumed it (it is then not shown)."""
        return False

    def gone(self) -> bool:
        """Asked while the launcher cannot reach the head node: True when the nodes are gone for good (the lease
        ended), so reconnecting is pointless."""
        return False

    def close(self) -> None:
        """The job's processes have ended (always called, also on failure)."""

    def finish(self, result: JobResult) -> None:
        """The job's result, before it is returned; a hook may fill in or change it (exit code, failure)."""


def run_dir(cluster: Cluster, run: str) -> str:
    """The run directory on the head node: <workdir>/appliance/runs/RUN (STOP file, credentials file, code)."""
    return f"{cluster.head.workdir}/appliance/runs/{run}"


def code_dir(cluster: Cluster, run: str) -> str:
    return f"{run_dir(cluster, run)}/code"


def _probe_head(head: Remote, python: str) -> str:
    """Check the head has the stack; returns the appliance package directory there."""
    r = head.run(f"{shlex.quote(python)} -c 'import os, appliance, horovod; "
                 f"print(os.path.dirname(appliance.__file__)); print(horovod.__version__)'")
    if r.rc != 0:
        raise ApplianceError(f"the head node {head.node.name} lacks the training stack ({python}: "
                             f"{(r.err.strip().splitlines() or ['not found'])[-1]})",
                             "use the appliance image, or run `appliance up --install`")
    return r.out.splitlines()[0].strip()


def horovodrun_command(cluster: Cluster, spec: Spec, *, job_id: str, nic: str, pkg_dir: str,
                       extra_env: dict[str, str] | None = None) -> tuple[str, dict[str, str]]:
    """The shell command run on the head node, and the exact environment horovodrun gets."""
    head = cluster.head
    venv_bin = str(Path(cluster.python).parent)
    etc = cluster.config_dir(head)
    env_extra = dict(spec.train.env)
    env_extra.update({
        Env.JOB_ID: job_id,
        Env.RUN: spec.name,
        Env.RUN_DIR: run_dir(cluster, spec.name),
        Env.WORKDIR: head.workdir,
        "PYTHONPATH": f"{pkg_dir}/node/shim",
    })
    if spec.dataset is not None:
        env_extra[Env.DATA_DIR] = f"{head.workdir}/{spec.dataset.dest}"
    if extra_env:
        env_extra.update(extra_env)
    path = f"{venv_bin}:{SYSTEM_PATH}" if cluster.single_host else f"{etc}/bin:{venv_bin}:{SYSTEM_PATH}"
    home = "/root" if head.user == "root" else f"/home/{head.user}"
    try:
        env = rank_environment(path=path, home=home, nic=nic, extra=env_extra, launcher_env=os.environ)
    except ValueError as e:
        raise ApplianceError(str(e), "remove credentials from train.env") from None
    if cluster.single_host:
        hosts = f"localhost:{cluster.world_size}"
    else:
        hosts = ",".join(f"{n.name}:{n.slots}" for n in cluster.nodes)
    user_cmd = "sh -c " + shlex.quote(RANK_WRAPPER) + " rank " + \
        " ".join(shlex.quote(a) for a in shlex.split(spec.train.command))
    assigns = " ".join(f"{k}={shlex.quote(v)}" for k, v in env.items())
    # one node: horovodrun runs every rank locally and wants the loopback interface, which --network-interface
    # (the peers' NIC) would exclude; ranks talk over loopback then
    nic_arg = f"--network-interface {shlex.quote(nic)} " if len(cluster.nodes) > 1 and not cluster.single_host else ""
    # horovodrun, without the TensorFlow import it makes at every launch to ask whether Horovod has Gloo (4 s here;
    # the doctor checks the build): appliance/node/hvdrun.py
    cmd = (f"cd {shlex.quote(code_dir(cluster, spec.name))} && exec env -i {assigns} "
           f"{shlex.quote(cluster.python)} -m appliance.node.hvdrun -np {cluster.world_size} -H {hosts} "
           f"{nic_arg}--start-timeout {spec.train.start_timeout} --gloo "
           f"{user_cmd}")
    return cmd, env


class _Watch:
    """Failure detection for one job: rank exits and node liveness."""

    def __init__(self, cluster: Cluster, session: Session, job_id: str, grace: float, heartbeat: float,
                 say: Callable[[str], None]):
        self.cluster, self.session, self.job_id = cluster, session, job_id
        self.grace, self.heartbeat, self.say = grace, heartbeat, say
        self.failure: str | None = None
        self.failed_at: float | None = None
        self.exits: list[tuple[int, int]] = []  # (rank, status) in the order horovodrun reported them
        self.collateral: set[int] = set()  # ranks whose output shows they failed because a peer did
        self.own_status: dict[int, int] = {}  # exit status each rank reported itself (RANK_WRAPPER)
        self.own_order: list[int] = []  # ranks in the order their own exit reports arrived
        self.dead_nodes: set[str] = set()
        self.stop = threading.Event()  # set to abandon the head channel
        self.head_lost = threading.Event()  # the head stopped answering: the launcher reconnects (the job goes on)
        self.abandoned = False  # the launcher gave up reconnecting: the job may still be running
        self.paused = threading.Event()  # set while reconnecting: no liveness verdicts then
        self.done = threading.Event()
        self.reaped = False
        self._lock = threading.Lock()
        self._pool = None  # the heartbeat's probes (_probe)

    def fail(self, msg: str) -> None:
        with self._lock:
            if self.failure is None:
                self.failure = msg
                self.failed_at = time.monotonic()
                self.say(f"[appliance] {msg}; stopping the job")

    def _describe(self, rank: int, code: int) -> str:
        hosts = self.cluster.rank_hosts()
        host = hosts[rank] if rank < len(hosts) else "?"
        code = self.own_status.get(rank, code)
        why = (f"rank {rank} on {host} ended the job as asked (status {code})" if code == EXIT_STOPPED else
               f"rank {rank} on {host} exited with status {code}")
        if code == 255 and rank not in self.own_status:
            why += f" (lost the SSH connection to {host})"
        return why

    def rank_exit(self, rank: int, code: int) -> None:
        self.exits.append((rank, code))
        self.fail(self._describe(rank, code))

    def own_exit(self, rank: int, code: int) -> None:
        self.own_status[rank] = code
        self.own_order.append(rank)

    def verdict(self) -> str | None:
        """The failure to report: the first rank that failed on its own, then the others.

        A rank's own report (RANK_WRAPPER) arrives before horovodrun's exit line for it, so the first nonzero own
        report from a rank that did not fail because of a peer names the culprit. When every rank we heard from
        failed because of a peer, the culprit is a rank horovodrun stopped before it could report: name it.
        """
        if not self.exits:
            return self.failure
        failing = [r for r in self.own_order if self.own_status[r] != 0] + [r for r, _ in self.exits]
        failing = list(dict.fromkeys(failing))
        own = [r for r in failing if r not in self.collateral]
        codes = dict((r, c) for r, c in reversed(self.exits))
        if own:
            first = own[0]
            msg = self._describe(first, codes.get(first, self.own_status.get(first, 1)))
        else:
            quiet = [r for r in range(self.cluster.world_size)
                     if r not in self.collateral and self.own_status.get(r, 1) != 0]
            first = failing[0]
            msg = self._describe(first, codes.get(first, 1))
            if quiet:
                hosts = self.cluster.rank_hosts()
                first = quiet[0]
                host = hosts[first] if first < len(hosts) else "?"
                msg = (f"rank {first} on {host} failed first (its exit status was lost when horovodrun stopped "
                       f"it; the other ranks failed because of it)")
        if self.failure and self.failure.startswith("node "):
            msg = f"{self.failure}; {msg}"
        rest = [(r, c) for r, c in self.exits if r != first]
        if rest:
            msg += " (then " + ", ".join(f"rank {r}: status {c}" for r, c in rest) + ")"
        return msg

    def _node_alive(self, node: Node) -> bool:
        if node.address is None:
            return True
        head = self.session.head
        if node.via_head and isinstance(head, SSHRemote):
            try:
                ch = head.transport.open_channel("direct-tcpip", (node.address, node.port), ("127.0.0.1", 0),
                                                 timeout=3)
                ch.close()
                return True
            except Exception:
                return False
        try:
            with socket.create_connection((node.address, node.port), timeout=3):
                return True
        except OSError:
            return False

    def _probe(self, nodes: list[Node]) -> list[bool]:
        """Whether each node answers, PROBES_IN_FLIGHT at a time: a node that does not costs its 3 s timeout once
        a round, not once for every node checked after it (a round over 64 nodes took 64 round trips in turn)."""
        if len(nodes) <= 1:
            return [self._node_alive(n) for n in nodes]
        if self._pool is None:
            from concurrent.futures import ThreadPoolExecutor

            self._pool = ThreadPoolExecutor(max_workers=PROBES_IN_FLIGHT, thread_name_prefix="appliance-heartbeat")
        return list(self._pool.map(self._node_alive, nodes))

    def _round(self, misses: dict[str, int]) -> None:
        """One heartbeat: the head first (the workers are reached through it), then every worker at once; the
        first node missed twice in a row fails the job."""
        head = self.cluster.head
        remote_head = not isinstance(self.session.head, LocalRemote)
        if remote_head:
            if self._probe([head])[0]:
                misses[head.name] = 0
            else:
                # the launcher's link to the head (or the head itself) is down: the detached job may well go on;
                # the launcher reconnects and decides then. Workers are reached through the head: no verdict on
                # them this round
                misses[head.name] = misses.get(head.name, 0) + 1
                if misses[head.name] >= 2:
                    misses[head.name] = 0
                    self.head_lost.set()
                    self.stop.set()
                return
        nodes = [n for n in self.cluster.nodes if not (remote_head and n is head)]
        alive = self._probe(nodes)
        if self.paused.is_set():  # a reconnect began meanwhile: no verdicts from this round
            return
        for node, ok in zip(nodes, alive):
            misses[node.name] = 0 if ok else misses.get(node.name, 0) + 1
        for node in nodes:
            if misses[node.name] >= 2:
                self.dead_nodes.add(node.name)
                ranks = [r for r, h in enumerate(self.cluster.rank_hosts()) if h == node.name]
                self.fail(f"node {node.name} stopped answering (ranks {', '.join(map(str, ranks))})")
                return

    def run(self) -> None:
        misses: dict[str, int] = {}
        try:
            while not self.done.wait(self.heartbeat if self.failure is None else 0.5):
                if self.failure is None:
                    if not self.paused.is_set():  # a reconnect: no verdicts, and nothing failed to reap
                        self._round(misses)
                elif time.monotonic() - self.failed_at > self.grace and not self.reaped:
                    self.reap()
                    self.stop.set()
        finally:
            if self._pool is not None:
                self._pool.shutdown(wait=False)

    def reap(self) -> None:
        """Kill this job's processes on every node that answers (matched by job id, killed by PID), on
        PROBES_IN_FLIGHT nodes at once: one that hangs holds up only itself, for its 15 s."""
        from concurrent.futures import ThreadPoolExecutor

        self.reaped = True
        cmd = f"sh -c {shlex.quote(REAP_SCRIPT)} reap {shlex.quote(self.job_id)}"
        targets = [(name, remote) for name, remote in self.session.remotes.items() if name not in self.dead_nodes]

        def one(target) -> int:
            try:
                return len(target[1].run(cmd, timeout=15).out.split())
            except ApplianceError:
                return 0

        if not targets:
            return
        with ThreadPoolExecutor(max_workers=min(PROBES_IN_FLIGHT, len(targets))) as ex:
            for (name, _), n in zip(targets, ex.map(one, targets)):
                if n:
                    self.say(f"[appliance] killed {n} leftover process(es) of the job on {name}")


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
    lk = shlex.quote(f"{rd}/{RUN_LOCK}")
    r = head.run(f"mkdir -p {shlex.quote(rd)} && flock -n -E {RUN_BUSY} {lk} true", timeout=30)
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
                                 "check the run's name and cluster (`appliance runs`, `appliance status`)")
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
            elif parse(m.group(3), (Line.RANK_EXIT,)) is None:
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
    """A new session with the cluster, tried until ``limit`` seconds have passed or a hook says the nodes are gone."""
    t0 = time.monotonic()
    delay = 1.0
    while True:
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


def _follow(conn: _Connection, cluster: Cluster, watch: _Watch, hooks, say: Callable[[str], None], rd: str,
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


def train(spec: Spec, cluster: Cluster, *, out: Callable[[str], None] | None = None, grace: float = 10.0,
          heartbeat: float = 5.0, extra_env: dict[str, str] | None = None, restore: str | None = None,
          hooks: list[JobHooks] | tuple = ()) -> JobResult:
    """Run the spec's training command across the cluster. Returns when the job has ended.

    ``restore``: the checkpoint directory (same path on every node) the ranks resume from. ``hooks``: what other
    steps add to the job (checkpoints, run records: `flows.run_job` adds them)."""

    job_id = f"{spec.name}-{time.strftime('%Y%m%dT%H%M%S')}-{os.getpid()}"
    log_dir = paths.home() / "runs" / spec.name
    log_dir.mkdir(parents=True, exist_ok=True)
    log_path = log_dir / f"{job_id}.log"
    logf = open(log_path, "w", buffering=1)
    lock = threading.Lock()

    live = {"on": False}  # a progress line is drawn on the terminal (only when out is None and stdout is a tty)
    terminal = out is None and sys.stdout.isatty()

    def say(line: str) -> None:
        with lock:
            logf.write(line + "\n")
            if live["on"]:
                sys.stdout.write("\r\x1b[K")
                live["on"] = False
            (out or _stdout)(line)

    def progress(line: str) -> None:
        with lock:
            width = shutil.get_terminal_size((100, 20)).columns - 1
            sys.stdout.write("\r" + line[:width] + "\x1b[K")
            sys.stdout.flush()
            live["on"] = True

    t0 = time.monotonic()
    rank_hosts = cluster.rank_hosts() if not cluster.single_host else [cluster.head.name] * cluster.world_size
    results: dict[int, dict] = {}
    try:
        # while the job runs, the appliance's own messages (contextualize, the store's retries, the lease watch's
        # site) are lines of the job's output: in its log copy, and never drawn over the progress line
        with report.to(say), Session(cluster) as session:
            nic = contextualize(cluster, session)
            if cluster.name:
                cluster.save()
            pkg_dir = _probe_head(session.head, cluster.python)
            cdir = code_dir(cluster, spec.name)
            rd = run_dir(cluster, spec.name)
            # before anything touches the run directory: the code copy replaces the code directory, which is a
            # running job's working directory; the hooks may refuse the job (the run's lock in the store, committed
            # checkpoints of a fresh run), so they come before the copy too
            check_run_free(session.head, rd, spec.name)
            conn = _Connection(session)  # hooks reach the head through whichever connection is current
            ctx = JobContext(spec, cluster, _Head(conn), rd, job_id, restore, say)
            # the working directory is the job's checkpoint directory (level 3: rank 0 syncs what the job writes in
            # it, not the code copied there)
            code_list = f"{rd}/.appliance-code-files.json"
            env_more: dict[str, str] = {Env.CHECKPOINT_DIR: cdir, Env.CODE_FILES: code_list}
            prepared: list[JobHooks] = []
            try:
                for h in hooks:
                    prepared.append(h)
                    env_more.update(h.prepare(ctx))
                if restore:
                    env_more[Env.RESTORE] = restore
                env_more.update(extra_env or {})
                cmd, _env = horovodrun_command(cluster, spec, job_id=job_id, nic=nic, pkg_dir=pkg_dir,
                                               extra_env=env_more)
                session.each(lambda r: r.put_dir(spec.code_dir, cdir))
                say(f"[appliance] copied {spec.code_dir} to {cdir} on {len(cluster.nodes)} node(s)")
                session.head.run(f"cat > {shlex.quote(code_list)}",
                                 stdin=json.dumps(code_files(spec.code_dir)).encode(), check=True)
            except BaseException:  # the job never starts: what the hooks set up (a lock, a credentials file) goes
                for h in prepared:
                    try:
                        h.close()
                    except Exception:  # noqa: BLE001 - the refusal is what the user must see
                        pass
                raise
            say(f"[appliance] job {job_id}: {cluster.world_size} rank(s) on "
                f"{', '.join(dict.fromkeys(rank_hosts))}, NIC {nic}")
            cmd = detached_command(rd, job_id, locked_command(rd, cmd))
            watch = _Watch(cluster, session, job_id, grace, heartbeat, say)

            def on_line(stream: str, line: str) -> None:
                m = RANK_LINE.match(line)
                if m:
                    rank, text = int(m.group(1)), m.group(3)
                    if "\r" in text or "\b" in text:  # a progress bar's redraws: its final state, one clean line
                        text = clean_progress(text)
                    i = text.find("APPLIANCE_")
                    if i > 0 and not text[i - 1].isspace():  # a protocol line printed while a progress bar was open
                        say(f"{who(rank, rank_hosts)} {text[:i]}")
                        text = text[i:]
                    x = parse(text, (Line.RANK_EXIT,))
                    if x and x[1].lstrip("-").isdigit():
                        watch.own_exit(rank, int(x[1]))
                        return
                    if any(h.rank_line(rank, text) for h in hooks):
                        return
                    if COLLATERAL.search(text):
                        watch.collateral.add(rank)
                    r = parse(text, (Line.RESULT,))
                    if r and isinstance(r[1], dict):
                        results[rank] = r[1]
                    say(f"{who(rank, rank_hosts)} {text}")
                    return
                e = EXIT_LINE.match(line)
                if e and int(e.group(2)) != 0:
                    watch.rank_exit(int(e.group(1)), int(e.group(2)))
                say(f"[horovodrun] {line}")

            def on_partial(stream: str, fragment: str) -> None:
                m = RANK_LINE.match(fragment)
                if m:
                    progress(f"{who(int(m.group(1)), rank_hosts)} {clean_progress(m.group(3))}")

            lines_seen = [0]  # complete lines of the job's output consumed: where to follow from after a reconnect

            def counted(stream: str, line: str) -> None:
                lines_seen[0] += 1
                on_line(stream, line)

            if terminal:
                counted.partial = on_partial
            wt = threading.Thread(target=watch.run, daemon=True)
            wt.start()
            for h in hooks:
                h.started(ctx)
            launched_at = time.time()
            out_file, rc_file, _ = job_files(rd, job_id)
            try:
                pid = int(conn.session.head.run(cmd, timeout=60, check=True).out.split()[-1])
                rc = _follow(conn, cluster, watch, hooks, say, rd, job_id, pid, counted, lines_seen, out_file,
                             rc_file)
            except ConnectionLost:  # before the job started (or while it was being started)
                watch.fail(f"lost the connection to the head node {cluster.head.name}")
                rc = 255
            except KeyboardInterrupt:
                watch.fail("interrupted (Ctrl-C)")
                watch.reap()
                rc = 130
            finally:
                watch.done.set()
                wt.join(timeout=5)
                ctx.abandoned = watch.abandoned
                for h in hooks:
                    h.close()
                if conn.session is not session:
                    conn.session.close()
            if watch.failure and not watch.reaped:
                watch.reap()  # leave nothing behind on the nodes that answer
            if watch.failure:
                watch.failure = watch.verdict()
            if watch.failure and rc == 0:
                rc = 1
            if rc < 0:
                rc = 1
            if rc == RUN_BUSY and watch.failure is None:
                watch.failure = (f"another job of run {spec.name!r} started on {cluster.head.name} a moment before "
                                 "this one: this one did not start")
            if rc != 0 and watch.failure is None:
                watch.failure = f"horovodrun exited with status {rc}"
            wall = time.monotonic() - t0
            res = JobResult(job_id=job_id, exit_code=rc, world_size=cluster.world_size, rank_hosts=rank_hosts,
                            results=results, failure=watch.failure, wall_s=wall, log_path=str(log_path),
                            run=spec.name, cluster_cloud=cluster.cloud, started_at=time.time() - wall,
                            timeline={"launched": launched_at}, abandoned=watch.abandoned)
            for h in hooks:
                h.finish(res)
            rc = res.exit_code
            say(f"[appliance] job {job_id} ended with exit code {rc} after {wall:.1f}s"
                + (f": {res.failure}" if res.failure else ""))
            return res
    finally:
        logf.close()


_RANK_PREFIX = re.compile(r"^\[\d+\]<(?:stdout|stderr)>:")


def clean_progress(text: str) -> str:
    """A line of carriage-return redraws (Keras' progress bar, through horovodrun, which prefixes every
    ``\\r``-ended fragment with ``[rank]<stdout>:``, horovod/runner/common/util/safe_shell_exec.py) -> its last
    non-empty state, without the backspaces and prefixes."""
    frags = [_RANK_PREFIX.sub("", f).replace("\b", "").rstrip() for f in text.split("\r")]
    frags = [f for f in frags if f.strip()]
    return frags[-1] if frags else ""


def _stdout(line: str) -> None:
    sys.stdout.write(line + "\n")
    sys.stdout.flush()


def check(result: JobResult) -> JobResult:
    """Raise JobFailed (with the job's exit code) if the job failed; exit 75 when it stopped for the lease end."""
    if result.exit_code == EXIT_STOPPED and result.stopped and result.stopped.get("step") is None:
        raise JobFailed(f"stopped ({result.stopped['reason']}) with its working directory committed (manifest "
                        f"{result.stopped.get('files')})", f"continue with `appliance resume {result.run}`",
                        exit_code=EXIT_STOPPED)
    if result.exit_code == EXIT_STOPPED and result.stopped:
        raise JobFailed(f"stopped after step {result.stopped['step']} ({result.stopped['reason']}) with checkpoint "
                        f"{result.stopped['checkpoint']} committed", f"continue with `appliance resume {result.run}`",
                        exit_code=EXIT_STOPPED)
    if result.exit_code != 0:
        raise JobFailed(f"training job failed: {result.failure}", f"full log: {result.log_path}",
                        exit_code=result.exit_code)
    return result
