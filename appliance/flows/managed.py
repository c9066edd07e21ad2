"""`appliance run SPEC`: a run to its end across leases, and the controller that drives it (issue 52).

Where the controller lives: in a process of its own on the machine that typed `appliance run` (``start``: a new
session, so closing the terminal or killing the shell that started it leaves it running), with everything another
machine needs in the object store beside the run's checkpoints, ``URL/RUN/controller/``:

- ``lock/<generation>.json``: the controller's lease on the run (store/runlock.py, the same rules as a job's):
  one controller per run; a second `appliance run SPEC` is refused while the first renews it; a controller that is
  gone (its machine off) is taken over once its heartbeat is older than the lock's ttl (at once on the machine that
  ran it, which can see its process is gone);
- ``state.json``: what the run did, lease by lease (the timeline `appliance runs RUN` shows, from any machine);
- ``cancel.json``: `appliance cancel RUN` asks the controller that holds the lock to stop the run: its job stops
  with a checkpoint at the next step and the run's cluster goes (its lease with it).

Why not on the head node: the head is deleted at its lease end, so a controller there has to move to the next
cluster's head before the end, which needs the next lease to start before the current one ends (a warm handover,
lease.overlap: handover.py) and a credential on the node that can book leases, which the nodes do not get. A
machine that stays up (a Chameleon KVM instance, a lab server) runs the controller through any number of lease
ends today.
"""

from __future__ import annotations

import json
import os
import queue
import socket
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable

from .. import report
from ..checkpoint import runs
from ..checkpoint.resume import find_spec
from ..cluster import Cluster, find_cluster
from ..errors import ApplianceError, NoHosts, SpecError
from ..provision import lifecycle
from ..spec import Spec, duration_seconds
from ..store.checkpoints import CheckpointStore, retrying
from ..store.runlock import INTERVAL, TTL, RunLock
from ..train.launch import JobContext, JobHooks, JobResult
from .handover import Warm, other_name, overlap_cost, wait_for_slot

log = report.get(__name__)

CONTROL = "controller"  # URL/RUN/controller/
READY_FD = "APPLIANCE_CONTROLLER_READY_FD"  # start(): the pipe the detached controller says "ready" on
NOTIFIED = ("downtime", "next cluster failed", "no hosts", "waiting for hosts", "stuck", "cancel", "end")  # notify


def _flows():
    from .. import flows  # the package's own verbs (run_job, resume: tests stand in for them there)

    return flows


# -- the controller's record in the store -------------------------------------------------------------


class Control:
    """The run's controller: its lock, state and cancel request in ``URL/RUN/controller/``. ``creds``: the store
    credentials of the run's checkpoint.url."""

    def __init__(self, spec: Spec, creds, *, poll: float | None = None):
        self.run = spec.name
        self.cs = CheckpointStore(spec.checkpoint.url, f"{spec.name}/{CONTROL}", creds)
        host = socket.gethostname()
        self.id = f"{host}:{os.getpid()}:{int(time.time())}.{os.urandom(3).hex()}"  # host:pid:... (gone_here)
        self.lock = RunLock(self.cs, self.id, cluster=host, head=str(os.getpid()),
                            interval=float(os.environ.get("APPLIANCE_CONTROLLER_LOCK_INTERVAL") or INTERVAL),
                            ttl=float(os.environ.get("APPLIANCE_CONTROLLER_LOCK_TTL") or TTL))
        self.poll = poll if poll is not None else float(os.environ.get("APPLIANCE_CONTROLLER_POLL") or 15.0)
        self.state: dict = {"run": self.run, "status": "starting", "events": []}
        self.notify_to = spec.notify
        self._events: queue.Queue = queue.Queue()  # for the notify hook, in order
        self._notifier: threading.Thread | None = None
        self.cancel: dict | None = None
        self.lost = False  # another controller took the lock over: this one starts nothing more
        self._stop_job: Callable[[str], None] | None = None  # the running job's stop (JobCheckpoints.user_stop)
        self.on_job: Callable[[Cluster], None] | None = None  # told of each job's cluster as the job starts
        self._done = threading.Event()
        self.changed = threading.Event()  # set on a cancel: whoever waits looks again at once
        self._mu = threading.Lock()
        self._writing = threading.Lock()

    # taking the run, and giving it back

    def take(self) -> None:
        """Hold the run's controller lock, or raise: another controller renews it."""
        holder, stale = self.lock.acquire(tempfile.gettempdir(), ended=gone_here)
        if holder is not None:
            raise busy(self.run, holder)
        try:  # the timeline so far (a store that does not answer is an error here: its timeline is not lost)
            old = retrying(lambda: self.cs.read_json("state.json"), what="read the run's controller state", attempts=4)
        except FileNotFoundError:  # the run's first controller
            old = {}
        except json.JSONDecodeError:  # not readable: the timeline starts again
            old = {}
        self.state["events"] = list(old.get("events") or [])
        self.record("controller", id=self.id, host=self.lock.cluster, pid=os.getpid(),
                    **({"took_over": stale.get("job_id")} if stale else {}))
        if stale:
            log.info(f"[run] took over run {self.run} from controller {stale.get('job_id')}, gone "
                     f"{time.time() - float(stale.get('heartbeat', 0)):.0f}s")
        threading.Thread(target=self._beat, name="appliance-controller", daemon=True).start()

    def close(self, status: str) -> None:
        self._done.set()
        self.record("end", status=status, state=status)
        if self._notifier is not None:  # the last word reaches the hook before the controller exits
            self._events.put(None)
            self._notifier.join(timeout=120)
        try:
            self.lock.release()
        except Exception as e:  # noqa: BLE001 - the lock then expires after its ttl
            log.info(f"[run] warning: could not release the controller lock ({type(e).__name__}: {e}); it "
                     f"expires {self.lock.ttl:.0f}s after its last heartbeat")

    def _beat(self) -> None:
        """Renew the lock every interval; look for a cancel request every poll."""
        last = time.monotonic()
        while not self._done.wait(self.poll):
            if self.cancel is None:
                self._look_for_cancel()
            if time.monotonic() - last >= self.lock.interval:
                last = time.monotonic()
                try:
                    if not self.lock.heartbeat(tempfile.gettempdir()):
                        self.lost = True
                        log.info(f"[run] another controller took run {self.run} over: this one starts nothing more")
                        return
                except Exception:  # noqa: BLE001 - retried at the next beat; the ttl allows several misses
                    pass

    def _look_for_cancel(self) -> None:
        try:
            req = self.cs.read_json("cancel.json")
        except FileNotFoundError:
            return
        except Exception:  # noqa: BLE001 - the store did not answer: asked again at the next poll
            return
        if req.get("controller") == self.id:
            self.cancelled(req)

    def cancelled(self, req: dict) -> None:
        with self._mu:
            if self.cancel is not None:
                return
            self.cancel = req
            stop = self._stop_job
        self.changed.set()
        log.info(f"[run] cancel of run {self.run} asked from {req.get('by', '?')}: the job stops with a checkpoint "
                 "and the run's cluster goes")
        self.record("cancel", by=req.get("by"))
        if stop is not None:
            stop("appliance cancel")

    # the timeline

    def record(self, event: str, *, state: str | None = None, **fields) -> None:
        """Add an event to the run's timeline and write it to the store (a failure is said, not raised: the
        run goes on; the next event writes the whole state again)."""
        entry = {"at": round(time.time(), 3), "event": event, **fields}
        if event in NOTIFIED:
            self.notify(entry)
        with self._mu:
            self.state["events"].append(entry)
            if state is not None:
                self.state["status"] = state
            self.state["controller"] = {"id": self.id, "host": self.lock.cluster, "pid": os.getpid()}
        with self._writing:  # one write at a time, each of the newest state: an older one never lands last
            with self._mu:
                text = json.dumps(self.state, indent=1, sort_keys=True)
            try:
                retrying(lambda: self.cs.put_text("state.json", text, tempfile.gettempdir()),
                         what="write the run's controller state", attempts=3)
            except Exception as e:  # noqa: BLE001
                log.info(f"[run] warning: could not write the run's state to the store ({type(e).__name__}: {e})")

    def notify(self, event: dict) -> None:
        """The spec's ``notify``, told of ``event`` by a thread of its own, in order (a slow or failing hook never
        holds the run up): an https:// URL is POSTed the event as JSON; a command gets it as JSON on stdin (and its
        name in APPLIANCE_EVENT). A failure is said, without the hook itself (a URL may hold a token)."""
        if not self.notify_to:
            return
        if self._notifier is None:
            self._notifier = threading.Thread(target=self._notify_loop, name="appliance-notify", daemon=True)
            self._notifier.start()
        self._events.put(event)

    def _notify_loop(self) -> None:
        hook = self.notify_to
        while (event := self._events.get()) is not None:
            body = json.dumps({"run": self.run, **event}).encode()
            try:
                if hook.startswith("https://"):
                    import urllib.request

                    req = urllib.request.Request(hook, data=body, headers={"Content-Type": "application/json"})
                    urllib.request.urlopen(req, timeout=30).close()
                else:
                    p = subprocess.run(hook, shell=True, input=body, capture_output=True, timeout=60,
                                       env={**os.environ, "APPLIANCE_EVENT": str(event.get("event"))})
                    if p.returncode != 0:
                        raise RuntimeError(f"exit {p.returncode}")
            except Exception as e:  # noqa: BLE001
                log.info(f"[run] the spec's notify hook failed on {event.get('event')}: {type(e).__name__}: "
                         f"{str(e)[:120]}")

    def hook(self, stop: Callable[[str], None]) -> JobHooks:
        """The job's hook: its lease and hosts on the timeline; a cancel stops it."""
        return _ControlHook(self, stop)


class _ControlHook(JobHooks):
    def __init__(self, control: Control, stop: Callable[[str], None]):
        self.control, self.stop = control, stop

    def started(self, ctx: JobContext) -> None:
        c, cl = self.control, ctx.cluster
        c.record("job", state="running", job_id=ctx.job_id, cluster=cl.name, site=cl.site.region or cl.cloud,
                 node_type=ctx.spec.nodes.node_type, hosts=[n.name for n in cl.nodes], lease_id=cl.lease_id,
                 lease_end=cl.lease_end, restore=bool(ctx.restore))
        with c._mu:
            c._stop_job = self.stop
            asked = c.cancel is not None
        if asked:  # cancelled while the job was being set up
            self.stop("appliance cancel")
        elif c.on_job is not None:
            c.on_job(cl)

    def finish(self, result: JobResult) -> None:
        c = self.control
        with c._mu:
            c._stop_job = None
        step = (result.stopped or {}).get("step")
        if step is None and result.commits:
            step = max(x["step"] for x in result.commits)
        c.record("job end", job_id=result.job_id, exit_code=result.exit_code, lease_end=bool(result.lease_end),
                 step=step, failure=result.failure)


def gone_here(controller_id: str) -> bool:
    """A controller of this machine whose process is gone (its lock need not wait for its ttl)."""
    host, _, rest = controller_id.partition(":")
    pid = rest.partition(":")[0]
    if host != socket.gethostname() or not pid.isdigit():
        return False
    try:
        os.kill(int(pid), 0)
    except ProcessLookupError:
        return True
    except PermissionError:  # another user's process of that pid: not ours, so ours is gone
        return True
    try:  # killed, and not yet reaped by its parent (init, once `appliance run` has returned): a zombie
        return open(f"/proc/{pid}/stat").read().rsplit(")", 1)[1].split()[0] in ("Z", "X")
    except (OSError, IndexError):  # no /proc (macOS): the pid answers, so it runs
        return False


def busy(run: str, holder: dict) -> ApplianceError:
    age = time.time() - float(holder.get("heartbeat", 0))
    return ApplianceError(f"run {run} already has a controller: {holder.get('cluster')} pid {holder.get('head')}, "
                          f"alive {age:.0f}s ago", f"watch it with `appliance runs {run}`, stop it with `appliance "
                          f"cancel {run}`; a controller that is gone is taken over {float(holder.get('ttl', TTL)):.0f}s"
                          " after its last heartbeat")


# -- the run --------------------------------------------------------------------------------------


def run_managed(spec_path: str, *, spec: Spec | None = None, max_restarts: int = 0,
                out: Callable[[str], None] | None = None) -> JobResult | None:
    """`appliance run SPEC --foreground` (and the detached controller `appliance run SPEC` starts): the run to its
    end across leases, with nobody at the lease ends. The first job runs on the run's own cluster (`appliance up`,
    made or reused; the dataset staged, only what is missing), or resumes when the run has committed work already.
    Then, until a job ends with 0:
    - it ended for its lease's end (stopped before it with a commit, or the end took its nodes): the run resumes
      on the next cluster, made while the job trained (lease.overlap: handover.Warm), or on a new lease once the
      old cluster has gone (its hosts free for it); without the hosts, on nodes.alternatives, or at the earliest
      free slot within lease.wait, or it parks;
    - it failed otherwise: resumed on the same cluster up to ``max_restarts`` times in a row (a crash is most
      often the script's own and would happen again), then its failure is the run's;
    - its user stopped it (SIGTERM, Ctrl-C) or cancelled the run (`appliance cancel RUN`): the run stops there;
      a cancel also takes the run's cluster down.
    Returns the last job's result (None: the run had finished already). ``spec``: the spec already loaded (the
    first job's; the resumes read ``spec_path``)."""
    flows = _flows()
    spec = spec or flows.check(spec_path)
    if not spec.checkpoint.url:
        raise SpecError(f"{spec.path}: a managed run keeps its checkpoints and its state in the object store, and "
                        "the spec has no checkpoint.url", "add `checkpoint: {url: swift://CONTAINER/}` (or s3://)")
    ctx = flows.RunContext.of(spec)
    control = Control(spec, ctx.creds(spec.checkpoint.url))
    control.take()
    runs.mark_managed(spec)
    _ready(control)
    if duration_seconds(spec.lease.overlap):
        log.info(f"[run] warm handover: each next lease starts {spec.lease.overlap} before the current one ends, "
                 f"which costs {overlap_cost(spec):.2f} node-hours per lease end ({spec.nodes.count} node(s))")
    status = "failed"
    run = _Run(ctx, control, max_restarts, out)
    try:
        res = run.loop()
        status = ("cancelled" if control.cancel else "parked" if run.parked
                  else "finished" if res is None or res.exit_code == 0
                  else "stopped" if (res.stopped or {}).get("committed") else "failed")
        return res
    finally:
        if run.warm is not None:
            run.warm.abandon()  # booked or made and not used: it goes
        control.close(status)


class _Run:
    """The loop of a managed run: its jobs, and what follows each."""

    def __init__(self, ctx, control: Control, max_restarts: int, out):
        self.ctx, self.control, self.max_restarts, self.out = ctx, control, max_restarts, out
        self.spec = ctx.spec
        self.current = _current_cluster(self.spec)  # the cluster of the run's newest job
        self.warm: Warm | None = None
        self.parked = False  # no hosts within lease.wait: the run stopped with its checkpoint
        control.on_job = self.job_started

    def job_started(self, cluster: Cluster) -> None:
        """A job starts on ``cluster``: with lease.overlap, its next cluster is made meanwhile (handover.Warm)."""
        self.current = cluster.name
        if self.warm is not None:  # made for a cluster that is not used (a restart on the same one): it goes
            self.warm.abandon()
            self.warm = None
        if duration_seconds(self.spec.lease.overlap) and cluster.lease_id and cluster.lease_end_at:
            self.warm = Warm(self.ctx, cluster, self.control.record, _flows().stage_to_nodes,
                             self.control.poll).start()

    def resume(self, **kw) -> JobResult | None:
        return _flows().resume(self.spec.name, spec_path=self.spec.path, out=self.out, control=self.control, **kw)

    def loop(self) -> JobResult | None:
        spec, control = self.spec, self.control
        res = self.first_job()
        restarts = stuck = 0
        while res is not None and res.exit_code != 0 and control.cancel is None and not control.lost:
            if res.lease_end:
                restarts = 0
                stuck = stuck + 1 if _steps_made(res) <= 1 else 0
                if stuck >= 2:  # each new lease would be stopped again as soon as it starts: lease after lease
                    log.info(f"[run] error: job {res.job_id} stopped for its lease end after {_steps_made(res)} "
                             f"step(s), as the one before it: the jobs start too close to their lease's end (fix: "
                             f"a longer lease.duration than {spec.lease.duration}, or a shorter lease.stop_margin "
                             f"than {spec.lease.stop_margin}; then `appliance run {spec.path}`)")
                    control.record("stuck", job_id=res.job_id)
                    break
                res = self.handover(res)
            elif res.stopped is not None and res.stopped.get("committed"):
                log.info(f"[run] job {res.job_id} was stopped ({res.stopped.get('reason')}): run {spec.name} stops "
                         f"here; `appliance run {spec.path}` continues it")
                break
            elif restarts < self.max_restarts and not res.abandoned:
                restarts += 1
                log.info(f"[run] job {res.job_id} failed ({res.failure}); restart {restarts} of {self.max_restarts}, "
                         "from the newest committed checkpoint")
                res = self.resume(cluster_name=self.current if self.current != spec.name else None)
            else:
                break
        if control.cancel is not None:
            for name in dict.fromkeys((self.current, spec.name)):
                if name and find_cluster(name) is not None:
                    log.info(f"[run] run {spec.name} cancelled: its cluster {name} goes")
                    lifecycle.down(name, self.ctx.site)
        return res

    def handover(self, res: JobResult) -> JobResult | None:
        """The job ended with its lease: onto the next cluster made meanwhile (warm), else a new lease (cold)."""
        spec, site = self.spec, self.ctx.site
        warm, self.warm = self.warm, None
        nxt = warm.ready() if warm is not None else None
        old = self.current
        self.control.record("handover", state="handover", after=res.job_id, warm=nxt is not None)
        if nxt is not None:
            log.info(f"[run] job {res.job_id} ended with its lease: run {spec.name} goes on on {nxt.name}, up and "
                     "staged already")
            gone = threading.Thread(target=lifecycle.down, args=(old, site), daemon=True)
            gone.start()  # the old cluster goes while the checkpoint is staged on the new one
            res = self.resume(cluster_name=nxt.name)
            gone.join()
        else:
            if warm is not None:
                warm.abandon()
            log.info(f"[run] job {res.job_id} ended with its lease: run {spec.name} goes on on a new lease")
            if old and old != spec.name and find_cluster(old) is not None:
                lifecycle.down(old, site)  # resume(new_lease) takes down the one named RUN itself
            res = self.cold()
        if res is not None and res.resume_breakdown:
            self.control.record("downtime", job_id=res.job_id, warm=nxt is not None, breakdown=res.resume_breakdown)
        return res

    def cold(self) -> JobResult | None:
        """A resume on a new lease: of the spec's node type; when Blazar has not the hosts, of each of
        nodes.alternatives in order; when none has them now, of the earliest slot of any within lease.wait (booked
        and waited for, the wait on the timeline). None: no slot within the wait (the run parks)."""
        spec = self.spec
        types = [spec.nodes.node_type, *spec.nodes.alternatives]
        for nt in types:
            try:
                return self.resume(new_lease=True, node_type=None if nt == spec.nodes.node_type else nt)
            except NoHosts as e:
                log.info(f"[run] no {spec.nodes.count} x {nt} free for the next lease ({e.message})"
                         + (f"; trying {types[types.index(nt) + 1]}" if nt != types[-1] else ""))
                self.control.record("no hosts", node_type=nt)
        nt = wait_for_slot(self.ctx, self.control, types)
        if nt is None:
            self.parked = True
            return None
        return self.resume(node_type=None if nt == spec.nodes.node_type else nt)

    def first_job(self) -> JobResult | None:
        """A managed run's first job: a resume when the run has committed work, else a fresh job on its own
        cluster."""
        flows, ctx, spec, control = _flows(), self.ctx, self.spec, self.control
        _wait_for_live_job(ctx, control)
        if control.cancel is not None:
            return None
        other = other_name(spec.name, self.current)
        if self.current and other != self.current and find_cluster(other) is not None:
            lifecycle.down(other, ctx.site)  # a next cluster a killed controller made and never used
        if _has_committed_work(ctx):
            log.info(f"[run] run {spec.name} has committed work: resuming it")
            cl = find_cluster(self.current) if self.current and self.current != spec.name else None
            return self.resume(cluster_name=cl.name if cl is not None and _lease_runs(ctx, cl) else None)
        cluster = lifecycle.up(ctx.site, spec)  # idempotent: the run's own cluster while its lease runs
        if spec.dataset is not None:
            flows.stage_to_nodes(ctx, cluster, spec.dataset.source, spec.dataset.dest, mode=spec.dataset.mode,
                                 out=self.out)
        return flows.run_job(spec, cluster, run=ctx, out=self.out, control=control)


def _steps_made(res: JobResult) -> int:
    """Steps a job made: from where it resumed (0 for a fresh job) to where it stopped (or its last commit, when
    the lease end took its nodes)."""
    stop = (res.stopped or {}).get("step")
    if stop is None and res.commits:
        stop = max(c["step"] for c in res.commits)
    start = (res.resumed or {}).get("step") or 0
    return max(0, int(stop) - int(start)) if stop is not None else 0


def _current_cluster(spec: Spec) -> str | None:
    """The cluster of the run's newest job, from its record on this machine (RUN or RUN-h)."""
    return (runs.load(spec.name) or {}).get("cluster") or None


def _lease_runs(ctx, cluster: Cluster) -> bool:
    from ..checkpoint.job import lease_over_for

    return bool(cluster.lease_id) and not lease_over_for(ctx.site)(cluster.lease_id)


def _live_job(ctx) -> dict | None:
    from ..checkpoint.job import live_job

    try:
        return live_job(ctx.spec, ctx.checkpoints, ctx.site)
    except FileNotFoundError:  # no container yet: a new run
        return None


def _wait_for_live_job(ctx, control: Control) -> None:
    """A controller that starts while a job of the run still runs (its controller was killed, the laptop slept: the
    job went on, detached on its head node) waits for that job to end, by the run's lock, and takes the run from
    there; a resume now would be refused. A cancel meanwhile asks that job to stop (its STOP file)."""
    from ..train.headjob import ask_to_stop

    said = stop_asked = False
    while (job := _live_job(ctx)) is not None:
        if not said:
            said = True
            age = time.time() - float(job.get("heartbeat", 0))
            log.info(f"[run] job {job.get('job_id')} of run {ctx.spec.name} still runs on cluster {job.get('cluster')} "
                     f"(its lock renewed {age:.0f}s ago): waiting for it to end")
            control.record("waiting", job_id=job.get("job_id"), cluster=job.get("cluster"))
        if control.cancel is not None and not stop_asked:
            stop_asked = True
            cl = find_cluster(str(job.get("cluster")))
            try:
                if cl is not None:
                    ask_to_stop(cl, ctx.spec.name, "appliance cancel")
            except ApplianceError as e:
                log.info(f"[run] could not ask job {job.get('job_id')} to stop: {e}")
        control.changed.wait(control.poll)  # the next look at the lock, or at once on a cancel
        control.changed.clear()


def _has_committed_work(ctx) -> bool:
    """Committed checkpoints or synced files of the run in its store. A store that is not reachable is an error
    here, not "none" (a fresh job over committed work would be refused anyway, after a lease was paid for)."""
    cs = ctx.checkpoints
    if cs is None:
        return False
    try:
        if cs.committed():
            return True
    except FileNotFoundError:  # no container yet: a new run
        return False
    return _flows().synced_files(ctx) is not None


# -- the detached controller, and what any machine can ask of it ---------------------------------------


def _ready(control: Control) -> None:
    """Tell the `appliance run` that started this controller (start) that it holds the run."""
    fd = os.environ.pop(READY_FD, None)
    if fd and fd.isdigit():
        try:
            os.write(int(fd), f"ok {control.id}\n".encode())
            os.close(int(fd))
        except OSError:  # the starter is gone (killed): nothing to tell
            pass


def start(spec_path: str, *, max_restarts: int = 0) -> dict:
    """`appliance run SPEC`: the controller in a process of its own (a new session: it outlives the terminal and
    the shell that typed the command), its output in ~/.appliance/runs/RUN/controller.log. Returns once it holds
    the run (its lock in the store), or raises with its own error line."""
    spec = _flows().check(spec_path)
    where = runs.record_dir(spec.name)
    where.mkdir(parents=True, exist_ok=True)
    log_path = where / "controller.log"
    r, w = os.pipe()
    cmd = [sys.executable, "-m", "appliance.cli", "run", os.path.abspath(spec_path), "--foreground",
           "--max-restarts", str(max_restarts)]
    with open(log_path, "ab") as f:
        f.write(f"\n== {time.strftime('%Y-%m-%d %H:%M:%S')} {' '.join(cmd[3:])}\n".encode())
        f.flush()
        p = subprocess.Popen(cmd, stdin=subprocess.DEVNULL, stdout=f, stderr=subprocess.STDOUT, pass_fds=(w,),
                             start_new_session=True, env={**os.environ, READY_FD: str(w)})
    os.close(w)
    with os.fdopen(r, "rb") as pipe:
        said = pipe.read().decode(errors="replace")  # until the controller says ready, or exits
    if not said.startswith("ok "):
        rc = p.wait()
        lines = [x for x in log_path.read_text(errors="replace").splitlines() if x.strip()]
        last = lines[-1] if lines else f"exit {rc}"
        raise ApplianceError(f"the controller of run {spec.name} did not start: {last.removeprefix('error: ')}",
                             f"its log: {log_path}")
    return {"run": spec.name, "controller": said.split()[1], "pid": p.pid, "log": str(log_path)}


def _control_of(run: str, url: str | None, cloud: str, site_name: str | None) -> Control:
    """A reader of RUN's controller record (from this machine's run record, or ``url``)."""
    flows = _flows()
    spec = find_spec(run, None, url, creds=flows.data_creds(url, cloud, site_name) if url else None)
    if not spec.checkpoint.url:
        raise ApplianceError(f"run {run} has no checkpoint.url: it has no controller", "`appliance runs` lists runs")
    return Control(spec, flows.RunContext.of(spec).creds(spec.checkpoint.url))


def cancel(run: str, *, url: str | None = None, cloud: str = "local", site_name: str | None = None) -> dict:
    """`appliance cancel RUN`: ask the run's live controller (on any machine) to stop the run."""
    c = _control_of(run, url, cloud, site_name)
    holder = c.lock.read()
    if holder is None or not c.lock.alive(holder, ended=gone_here):
        raise ApplianceError(f"run {run} has no live controller, so nothing to cancel", "a job started with "
                             "`appliance train` stops with Ctrl-C there; `appliance runs` shows the run")
    req = {"controller": holder["job_id"], "at": time.time(), "by": socket.gethostname()}
    c.cs.put_text("cancel.json", json.dumps(req), tempfile.gettempdir())
    return {"run": run, "controller": holder["job_id"], "host": holder.get("cluster"), "pid": holder.get("head")}


def timeline(run: str, *, url: str | None = None, cloud: str = "local", site_name: str | None = None) -> dict | None:
    """The run's controller state from the store (None: it never had a controller), with whether one is alive."""
    return read_timeline(_control_of(run, url, cloud, site_name))


def read_timeline(c: Control) -> dict | None:
    try:
        state = retrying(lambda: c.cs.read_json("state.json"), what="read the run's controller state", attempts=4)
    except FileNotFoundError:
        return None
    holder = c.lock.read()
    state["controller_alive"] = bool(holder and c.lock.alive(holder, ended=gone_here))
    if holder:
        state["controller_heartbeat_age_s"] = round(time.time() - float(holder.get("heartbeat", 0)))
    return state
