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
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from .. import killpoints, paths, report
from ..cluster import Cluster
from ..errors import ApplianceError, JobFailed
from ..protocol import EXIT_STOPPED, Env, Line, job_files, parse, rank_environment
from ..provision.contextualize import contextualize
from ..remote import ConnectionLost, Remote, Session
from ..sites import rank_env
from ..spec import Spec, keras_choice, keras_line
from .headjob import (EXIT_LINE, RANK_LINE, RUN_BUSY, _Connection, _Head, check_run_free, code_dir, code_files,
                      detached_command, follow, hidden, locked_command, run_dir, who)
from . import packages
from .watch import COLLATERAL, Watch


# Each rank's command runs under this wrapper, which prints the rank's own exit status as it exits: when one
# rank fails, horovodrun kills the other ranks' ssh, and ssh's 255 would hide the real status.
RANK_WRAPPER = f'"$@"; rc=$?; echo "{Line.RANK_EXIT} $rc"; exit $rc'
SYSTEM_PATH = "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"


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
    # the job ended for its lease's end: stopped before it (the launcher's watchdog, the vendordata, the node's
    # watchdog), or the end took its nodes; hooks set it (a managed run continues on a new lease then)
    lease_end: bool = False
    # dataset.mode stream: rank 0's waits for the store over the job's whole epochs (data/stream.py JobStream)
    stream: dict | None = None

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
    nodes: Session | None = None  # every node, for a hook that puts something on each (the stream's credentials)


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
                       extra_env: dict[str, str] | None = None, site: str | None = None) -> tuple[str, dict[str, str]]:
    """The shell command run on the head node, and the exact environment horovodrun gets: what the cluster's
    machines want (sites.rank_env) unless the spec's train.env says otherwise."""
    head = cluster.head
    venv_bin = str(Path(cluster.python).parent)
    etc = cluster.config_dir(head)
    env_extra = {**rank_env(cluster), **spec.train.env}
    keras = keras_choice(spec)[0]  # it wins over train.env's TF_USE_LEGACY_KERAS
    env_extra.update({
        "TF_USE_LEGACY_KERAS": "1" if keras == "2" else "0",
        Env.KERAS: keras,
        Env.JOB_ID: job_id,
        Env.RUN: spec.name,
        Env.RUN_DIR: run_dir(cluster, spec.name),
        Env.WORKDIR: head.workdir,
        "PYTHONPATH": f"{pkg_dir}/node/shim" + (f":{site}" if site else ""),  # site: train.requirements
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


class _Output:
    """Where the job's lines go: the launcher's log copy (~/.appliance/runs/RUN/JOB.log) and ``out`` (default: the
    terminal, where a rank's progress bar is drawn on one line that later lines replace)."""

    def __init__(self, log_path: Path, out: Callable[[str], None] | None):
        self.path, self.out = log_path, out
        self.file = open(log_path, "w", buffering=1)
        self.terminal = out is None and sys.stdout.isatty()
        self._live = False  # a progress line is drawn
        self._lock = threading.Lock()

    def say(self, line: str) -> None:
        with self._lock:
            self.file.write(line + "\n")
            if self._live:
                sys.stdout.write("\r\x1b[K")
                self._live = False
            (self.out or _stdout)(line)

    def progress(self, line: str) -> None:
        with self._lock:
            width = shutil.get_terminal_size((100, 20)).columns - 1
            sys.stdout.write("\r" + line[:width] + "\x1b[K")
            sys.stdout.flush()
            self._live = True


class _Lines:
    """horovodrun's output, line by line: a rank's own exit report and horovodrun's exit lines go to the watch, the
    hooks take their protocol lines, APPLIANCE_RESULT lines are kept, the rest is shown as ``[rank|host] text``.
    Counts the lines, so a reconnect follows from the next one."""

    def __init__(self, watch: Watch, hooks, output: _Output, rank_hosts: list[str]):
        self.watch, self.hooks, self.output, self.rank_hosts = watch, hooks, output, rank_hosts
        self.results: dict[int, dict] = {}
        self.seen = [0]  # complete lines consumed (a list: headjob.follow advances it)
        if output.terminal:
            self.partial = self._partial

    def __call__(self, stream: str, line: str) -> None:
        self.seen[0] += 1
        m = RANK_LINE.match(line)
        if m:
            self._rank_line(int(m.group(1)), m.group(3))
            return
        e = EXIT_LINE.match(line)
        if e and int(e.group(2)) != 0:
            self.watch.rank_exit(int(e.group(1)), int(e.group(2)))
        self.output.say(f"[horovodrun] {line}")

    def _rank_line(self, rank: int, text: str) -> None:
        say = self.output.say
        if "\r" in text or "\b" in text:  # a progress bar's redraws: its final state, one clean line
            text = clean_progress(text)
        i = text.find("APPLIANCE_")
        if i > 0 and not text[i - 1].isspace():  # a protocol line printed while a progress bar was open
            say(f"{who(rank, self.rank_hosts)} {text[:i]}")
            text = text[i:]
        x = parse(text, (Line.RANK_EXIT,))
        if x and x[1].lstrip("-").isdigit():
            self.watch.own_exit(rank, int(x[1]))
            return
        if any(h.rank_line(rank, text) for h in self.hooks):
            return
        if hidden(text):
            return
        if COLLATERAL.search(text):
            self.watch.collateral.add(rank)
        r = parse(text, (Line.RESULT,))
        if r and isinstance(r[1], dict):
            self.results[rank] = r[1]
        say(f"{who(rank, self.rank_hosts)} {text}")

    def _partial(self, stream: str, fragment: str) -> None:
        m = RANK_LINE.match(fragment)
        if m:
            self.output.progress(f"{who(int(m.group(1)), self.rank_hosts)} {clean_progress(m.group(3))}")


def _prepare(spec: Spec, cluster: Cluster, session: Session, ctx: JobContext, hooks, extra_env, nic: str) -> str:
    """Everything before the job starts: the hooks' setup (they may refuse the job), the code copied to every node.
    Returns the command that starts the job detached on the head node. When it raises, the hooks that were set up
    are closed (a lock, a credentials file)."""
    cdir, rd = code_dir(cluster, spec.name), ctx.run_dir
    pkg_dir = _probe_head(session.head, cluster.python)
    # the working directory is the job's checkpoint directory (level 3: rank 0 syncs what the job writes in it, not
    # the code copied there)
    code_list = f"{rd}/.appliance-code-files.json"
    env_more: dict[str, str] = {Env.CHECKPOINT_DIR: cdir, Env.CODE_FILES: code_list}
    prepared: list[JobHooks] = []
    try:
        for h in hooks:
            prepared.append(h)
            env_more.update(h.prepare(ctx))
        if ctx.restore:
            env_more[Env.RESTORE] = ctx.restore
        env_more.update(extra_env or {})
        session.each(lambda r: r.put_dir(spec.code_dir, cdir))
        ctx.say(f"[appliance] copied {spec.code_dir} to {cdir} on {len(cluster.nodes)} node(s)")
        ctx.say(f"[appliance] {keras_line(spec)}")
        site = packages.install(session, cluster.python, cdir, spec.train.requirements, f"{rd}/packages",
                                ctx.say) if spec.train.requirements else None
        cmd, _env = horovodrun_command(cluster, spec, job_id=ctx.job_id, nic=nic, pkg_dir=pkg_dir,
                                       extra_env=env_more, site=site)
        session.head.run(f"cat > {shlex.quote(code_list)}", stdin=json.dumps(code_files(spec.code_dir)).encode(),
                         check=True)
    except BaseException:  # the job never starts: what the hooks set up goes
        for h in prepared:
            try:
                h.close()
            except Exception:  # noqa: BLE001 - the refusal is what the user must see
                pass
        raise
    return detached_command(rd, ctx.job_id, locked_command(rd, cmd))


def _run(conn: _Connection, cluster: Cluster, watch: Watch, hooks, ctx: JobContext, cmd: str, lines: _Lines) -> int:
    """Start the job, follow it to its end (reconnecting as needed); its exit status. The watch runs beside it; the
    hooks are told it started, and closed when it ended whatever happened."""
    wt = threading.Thread(target=watch.run, daemon=True)
    wt.start()
    for h in hooks:
        h.started(ctx)
    out_file, rc_file, _ = job_files(ctx.run_dir, ctx.job_id)
    session = conn.session
    try:
        pid = int(conn.session.head.run(cmd, timeout=60, check=True).out.split()[-1])
        killpoints.here("job-started")  # the fault matrix: a launcher killed while its job runs on
        return follow(conn, cluster, watch, hooks, ctx.say, ctx.run_dir, ctx.job_id, pid, lines, lines.seen,
                      out_file, rc_file)
    except ConnectionLost:  # before the job started (or while it was being started)
        watch.fail(f"lost the connection to the head node {cluster.head.name}")
        return 255
    except KeyboardInterrupt:
        watch.fail("interrupted (Ctrl-C)")
        watch.reap()
        return 130
    finally:
        watch.done.set()
        wt.join(timeout=5)
        ctx.abandoned = watch.abandoned
        for h in hooks:
            h.close()
        if conn.session is not session:
            conn.session.close()


def _exit_verdict(watch: Watch, rc: int, spec: Spec, cluster: Cluster) -> int:
    """The job's exit code and ``watch.failure``, once its processes have ended (what is left of them reaped)."""
    if watch.failure and not watch.reaped:
        watch.reap()  # leave nothing behind on the nodes that answer
    if watch.failure:
        watch.failure = watch.verdict()
    if (watch.failure and rc == 0) or rc < 0:
        rc = 1
    if rc == RUN_BUSY and watch.failure is None:
        watch.failure = (f"another job of run {spec.name!r} started on {cluster.head.name} a moment before this one: "
                         "this one did not start")
    if rc != 0 and watch.failure is None:
        watch.failure = f"horovodrun exited with status {rc}"
    return rc


def train(spec: Spec, cluster: Cluster, *, out: Callable[[str], None] | None = None, grace: float = 10.0,
          heartbeat: float = 5.0, extra_env: dict[str, str] | None = None, restore: str | None = None,
          hooks: list[JobHooks] | tuple = ()) -> JobResult:
    """Run the spec's training command across the cluster. Returns when the job has ended.

    ``restore``: the checkpoint directory (same path on every node) the ranks resume from. ``hooks``: what other
    steps add to the job (checkpoints, run records: `flows.run_job` adds them)."""
    job_id = f"{spec.name}-{time.strftime('%Y%m%dT%H%M%S')}-{os.getpid()}"
    log_dir = paths.home() / "runs" / spec.name
    log_dir.mkdir(parents=True, exist_ok=True)
    output = _Output(log_dir / f"{job_id}.log", out)
    say = output.say
    t0 = time.monotonic()
    rank_hosts = cluster.rank_hosts() if not cluster.single_host else [cluster.head.name] * cluster.world_size
    try:
        # while the job runs, the appliance's own messages (contextualize, the store's retries, the lease watch's
        # site) are lines of the job's output: in its log copy, and never drawn over the progress line
        with report.to(say), Session(cluster) as session:
            nic = contextualize(cluster, session)
            if cluster.name:
                cluster.save()
            rd = run_dir(cluster, spec.name)
            # before anything touches the run directory: the code copy replaces the code directory, which is a
            # running job's working directory; the hooks may refuse the job (the run's lock in the store, committed
            # checkpoints of a fresh run), so they come before the copy too
            check_run_free(session.head, rd, spec.name)
            conn = _Connection(session)  # hooks reach the head through whichever connection is current
            ctx = JobContext(spec, cluster, _Head(conn), rd, job_id, restore, say, nodes=session)
            cmd = _prepare(spec, cluster, session, ctx, hooks, extra_env, nic)
            say(f"[appliance] job {job_id}: {cluster.world_size} rank(s) on "
                f"{', '.join(dict.fromkeys(rank_hosts))}, NIC {nic}")
            watch = Watch(cluster, session, job_id, grace, heartbeat, say)
            lines = _Lines(watch, hooks, output, rank_hosts)
            launched_at = time.time()
            rc = _exit_verdict(watch, _run(conn, cluster, watch, hooks, ctx, cmd, lines), spec, cluster)
            wall = time.monotonic() - t0
            res = JobResult(job_id=job_id, exit_code=rc, world_size=cluster.world_size, rank_hosts=rank_hosts,
                            results=lines.results, failure=watch.failure, wall_s=wall, log_path=str(output.path),
                            run=spec.name, cluster_cloud=cluster.cloud, started_at=time.time() - wall,
                            timeline={"launched": launched_at}, abandoned=watch.abandoned)
            for h in hooks:
                h.finish(res)
            say(f"[appliance] job {job_id} ended with exit code {res.exit_code} after {wall:.1f}s"
                + (f": {res.failure}" if res.failure else ""))
            return res
    finally:
        output.file.close()


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
