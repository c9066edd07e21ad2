"""The controller of a managed run (`appliance run SPEC`): its lock, timeline and cancel request in the object
store, ``URL/RUN/controller/`` (managed.py says where it runs and why), and its hook on each job."""

from __future__ import annotations

import datetime as dt
import json
import os
import queue
import socket
import subprocess
import tempfile
import threading
import time
from collections.abc import Callable

from .. import report
from ..checkpoint import runs
from ..checkpoint.runs import RunStatus
from ..cluster import Cluster
from ..errors import ApplianceError
from ..spec import Spec
from ..store.checkpoints import CheckpointStore, retrying
from ..store.base import StoreRefused
from ..store.runlock import INTERVAL, TTL, RunLock
from ..train.launch import JobContext, JobHooks, JobResult
from .credential import EXPIRES_ENV
from .ettr import job_end_marks
from .runcluster import to_state

log = report.get(__name__)

CONTROL = "controller"  # URL/RUN/controller/
LOG_TAIL = 256 << 10  # bytes of the newest job's output kept in the store, for `appliance logs RUN --url`
ASK_WAIT = float(os.environ.get("APPLIANCE_ASK_WAIT") or 600)  # s a lease's record may wait for the store
LOG_EVERY = 60.0  # seconds between two copies of it at most (a chatty job: ~15 MB an hour to the store)
NOTIFIED = ("downtime", "next cluster failed", "no hosts", "waiting for hosts", "stuck", "cancel", "end", "limit",
            "no SUs", "lease deleted")


# -- the controller's record in the store -------------------------------------------------------------


class Control:
    """The run's controller: its lock, state and cancel request in ``URL/RUN/controller/``. ``creds``: the store
    credentials of the run's checkpoint.url."""

    def __init__(self, spec: Spec, creds, *, poll: float | None = None, renew: Callable | None = None):
        self.run = spec.name
        self.cs = CheckpointStore(spec.checkpoint.url, f"{spec.name}/{CONTROL}", creds)
        # renew(): new store credentials (_store)
        self._url, self._renew, self._creds = spec.checkpoint.url, renew, creds
        host = socket.gethostname()
        # host:pid:start.random:machine (gone_here: runs.process_gone)
        self.id = f"{host}:{os.getpid()}:{int(time.time())}.{os.urandom(3).hex()}:{runs.machine_tag()}"
        self.lock = RunLock(self.cs, self.id, cluster=host, head=str(os.getpid()),
                            interval=float(os.environ.get("APPLIANCE_CONTROLLER_LOCK_INTERVAL") or INTERVAL),
                            ttl=float(os.environ.get("APPLIANCE_CONTROLLER_LOCK_TTL") or TTL))
        self.poll = poll if poll is not None else float(os.environ.get("APPLIANCE_CONTROLLER_POLL") or 15.0)
        self.state: dict = {"run": self.run, "status": RunStatus.STARTING, "events": []}
        self.notify_to = spec.notify
        self._events: queue.Queue = queue.Queue()  # for the notify hook, in order
        self._notifier: threading.Thread | None = None
        self.cancel: dict | None = None
        self.on_cancel: Callable[[dict], None] | None = None  # told of a cancel (flows/stopping.py: the bound)
        self.took_over: str | None = None  # the controller this one took the run over from (its lock was stale)
        self.lost = False  # another controller took the lock over: this one writes and starts nothing more (fenced)
        self._stop_job: Callable[[str], None] | None = None  # the running job's stop (JobCheckpoints.user_stop)
        self.on_job: Callable[[Cluster, Spec], None] | None = None  # told of each job's cluster as it starts
        self.on_job_end: Callable[[JobResult], None] | None = None  # told of each job's result as it ends
        self.on_first_step: Callable[[str, dict], None] | None = None  # (job id, a resume's downtime by phase)
        self.on_ask: Callable | None = None  # told of each lease the run asks for (leases.Asked; set by the run)
        self.job_id: str | None = None  # the job that runs now
        # how far the job's watchdog may extend its lease ending at a given date (None: not at all, and why)
        self.extend_by: Callable[[str, dt.datetime], tuple[dt.timedelta | None, str]] | None = None
        self._done = threading.Event()
        self.changed = threading.Event()  # set on a cancel: whoever waits looks again at once
        self._mu = threading.Lock()
        self._writing = threading.Lock()
        self._log: tuple[str, int, int] = ("", 0, 0)  # the job log shipped: its name, bytes counted, lines in them
        self._missed: list[float] | None = None  # lock renewals failing: [since, last said] (monotonic)

    def _store(self, fn):
        """``fn()``, once more with new store credentials when the store refused the ones it had: a bare Keystone
        token lives a day, and a controller runs for weeks (its writes were lost after the first day)."""
        try:
            return fn()
        except StoreRefused:
            if self._renew is None:
                raise
            self._creds = self._renew()
            self.cs = CheckpointStore(self._url, f"{self.run}/{CONTROL}", self._creds)
            self.lock.cs = self.cs
            return fn()

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
        for k in ("leases", "progress", "asked", "cluster"):  # the run's ledger, pace, leases asked for (budget.py,
            # leases.py) and current cluster (runcluster.py), kept across controllers
            if isinstance(old.get(k), dict):
                self.state[k] = old[k]
        own = os.environ.get(EXPIRES_ENV)  # when the controller's own credential expires (credential.py)
        self.record("controller", id=self.id, host=self.lock.cluster, pid=os.getpid(),
                    **({"took_over": stale.get("job_id")} if stale else {}),
                    **({"credential_expires": own} if own else {}))
        if stale:
            self.took_over = str(stale.get("job_id"))
            log.info(f"[run] took over run {self.run} from controller {stale.get('job_id')}, gone "
                     f"{self.lock.age(stale):.0f}s")
        threading.Thread(target=self._beat, name="appliance-controller", daemon=True).start()

    def close(self, status: RunStatus) -> None:
        self._done.set()
        self.ship_log()
        self._to(status, "end", {"status": status})
        if self._notifier is not None:  # the last word reaches the hook before the controller exits
            self._events.put(None)
            self._notifier.join(timeout=120)
        try:
            self._store(self.lock.release)
        except Exception as e:  # noqa: BLE001 - the lock then expires after its ttl
            log.info(f"[run] warning: could not release the controller lock ({type(e).__name__}: {e}); it "
                     f"expires {self.lock.ttl:.0f}s after its last heartbeat")

    def _beat(self) -> None:
        """Renew the lock every interval; look for a cancel request every poll; copy the job's output to the store
        every LOG_EVERY (ship_log)."""
        last, shipped = time.monotonic(), float("-inf")
        while not self._done.wait(self.poll):
            try:
                if self.cancel is None:
                    self._look_for_cancel()
                if time.monotonic() - shipped >= LOG_EVERY:
                    shipped = time.monotonic()
                    self.ship_log()
            except Exception as e:  # noqa: BLE001 - the heartbeat below must go on, whatever this was
                log.info(f"[run] warning: the controller's poll failed ({type(e).__name__}: {e}); again next poll")
            if time.monotonic() - last >= self.lock.interval:
                last = time.monotonic()
                if not self._heartbeat():
                    self._lose(self.lock.lost_to or {})
                    return

    def _heartbeat(self) -> bool:
        """One renewal of the lock: False when another controller holds it. A renewal that fails is tried again at
        the next beat (the ttl allows several misses) and said: at the first miss, then every third of the ttl,
        with how long the lock has left, and once more when a renewal works again."""
        try:
            held = self._store(lambda: self.lock.heartbeat(tempfile.gettempdir()))
        except Exception as e:  # noqa: BLE001 - whatever it was, the next beat tries again
            now = time.monotonic()
            if self._missed is None:
                self._missed = [now, float("-inf")]  # since, said at
            since, said = self._missed
            if now - said >= self.lock.ttl / 3:
                self._missed[1] = now
                left = self.lock.ttl - (now - since) - self.lock.interval
                log.info(f"[run] warning: the controller could not renew its lock ({type(e).__name__}: {e}); "
                         f"again every {self.lock.interval:.0f}s; "
                         + (f"it goes stale in {left:.0f}s" if left > 0 else "it may be stale")
                         + " if this goes on, and another controller could then take the run over")
            return True
        if self._missed is not None:
            log.info(f"[run] the controller renews its lock again, after "
                     f"{time.monotonic() - self._missed[0]:.0f}s of failures")
            self._missed = None
        return held

    def ship_log(self) -> None:
        """The newest job's output as this machine's launcher showed it (its last LOG_TAIL bytes, from a line's
        start) into the store, ``logs/JOB.log``, with ``logs/JOB.json`` saying which line it starts at: `appliance
        logs RUN --url URL` reads it from any machine. Only when it has grown; a failure waits for the next poll."""
        copies = sorted(runs.record_dir(self.run).glob(f"{self.run}-*.log"), key=lambda p: p.stat().st_mtime)
        if not copies:
            return
        path = copies[-1]
        try:
            with open(path, "rb") as f:
                size = os.fstat(f.fileno()).st_size
                name, counted, lines = self._log if self._log[0] == path.name else (path.name, 0, 0)
                if size == counted:
                    return
                f.seek(counted)
                new = f.read(size - counted)
                start = max(0, size - LOG_TAIL)
                f.seek(start)
                tail = f.read(size - start)
            if start:  # from the first whole line
                cut = tail.find(b"\n") + 1
                tail, start = tail[cut:], start + cut
            total = lines + new.count(b"\n")
            first = total - tail.count(b"\n")
            tmp = tempfile.gettempdir()
            self._store(lambda: self.cs.put_text(f"logs/{path.stem}.log", tail.decode(errors="replace"), tmp))
            self._store(lambda: self.cs.put_text(f"logs/{path.stem}.json", json.dumps(
                {"job_id": path.stem, "first_line": first, "at": time.time()}), tmp))
            self._log = (path.name, size, total)
        except Exception as e:  # noqa: BLE001 - the next poll tries again
            log.debug(f"[run] the job's log was not shipped to the store ({type(e).__name__}: {e})")

    def _look_for_cancel(self) -> None:
        try:
            req = self._store(lambda: self.cs.read_json("cancel.json"))
        except FileNotFoundError:
            return
        except Exception:  # noqa: BLE001 - the store did not answer: asked again at the next poll
            return
        if isinstance(req, dict) and req.get("controller") == self.id:  # anything else is not a request to us
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
        if self.on_cancel is not None:
            self.on_cancel(req)

    def wait_closed(self, seconds: float) -> bool:
        """Wait up to ``seconds``; True once the controller is closed (its run has ended)."""
        return self._done.wait(seconds)

    def run_store(self) -> CheckpointStore:
        """The run's own store (URL/RUN/: its job's lock, the stop request), with the controller's credentials."""
        return CheckpointStore(self._url, self.run, self._creds)

    # the timeline

    # the run's status: one method per transition (runs.NEXT), each an event on the timeline

    def running(self, event: str = "job", **fields) -> None:
        """A job of the run trains: launched by this controller ("job"), or followed ("following": takeover.py)."""
        self._to(RunStatus.RUNNING, event, fields)

    def handing_over(self, **fields) -> None:
        """A job ended with its lease: the next cluster, then the resume (managed._Run.handover)."""
        self._to(RunStatus.HANDOVER, "handover", fields)

    def parked(self, event: str = "parked", **fields) -> None:
        """No hosts within lease.wait ("parked": handover.wait_for_slot), or no SUs ("no SUs"): no lease held."""
        self._to(RunStatus.PARKED, event, fields)

    def waiting(self, **fields) -> None:
        """The cloud does not answer while the run asks it for its next cluster ("cloud away", with the error):
        the run waits with its checkpoint (recovery.Recovery.next_cluster)."""
        self._to(RunStatus.WAITING, "cloud away", fields)

    def _to(self, state: RunStatus, event: str, fields: dict) -> None:
        now = self.state["status"]
        if state not in runs.NEXT.get(now, ()):  # a transition no controller makes: said, and the status stays
            log.info(f"[run] warning: {event}: run {self.run} cannot go from {now} to {state}; its status stays {now}")
            self.record(event, **fields)
            return
        self.record(event, state=state, **fields)

    def record(self, event: str, *, state: RunStatus | None = None, **fields) -> None:
        """Add an event to the run's timeline and write it to the store (a failure is said, not raised: the
        run goes on; the next event writes the whole state again). ``state``: the run's new status, through the
        transitions above (and close) only."""
        entry = {"at": round(time.time(), 3), "event": event, **fields}
        if event in NOTIFIED:
            self.notify(entry)
        with self._mu:
            self.state["events"].append(entry)
            if state is not None:
                self.state["status"] = state
            self.state["controller"] = {"id": self.id, "host": self.lock.cluster, "pid": os.getpid()}
        try:
            if self.fenced():  # another controller holds the run and writes its state now: this one's is not written
                log.debug(f"[run] (not in the run's state: another controller holds it) {event} {fields}")
                return
        except Exception as e:  # noqa: BLE001 - not known to hold the run: nothing written, the next event asks again
            log.info(f"[run] warning: the run's state is not written: could not read its lock ({type(e).__name__}: "
                     f"{e})")
            return
        if state is not None:  # `appliance ls` on this machine lists the run by its controller's word
            try:
                runs.mark_status(self.run, state, self.id)
            except OSError as e:
                log.info(f"[run] warning: could not write the run's record here ({e})")
        try:
            self._write()
        except Exception as e:  # noqa: BLE001
            log.info(f"[run] warning: could not write the run's state to the store ({type(e).__name__}: {e})")

    def _write(self, patient: bool = False) -> None:
        """The state to the store; ``patient``: for up to ASK_WAIT (a lease waits for its record: a store outage of
        minutes at a handover delays it, rather than failing the run), else 3 tries."""
        with self._writing:  # one write at a time, each of the newest state: an older one never lands last
            with self._mu:
                text = json.dumps(self.state, indent=1, sort_keys=True)
            wait = {"until": time.time() + ASK_WAIT} if patient else {"attempts": 3}
            self._store(lambda: retrying(lambda: self.cs.put_text("state.json", text, tempfile.gettempdir()),
                                         what="write the run's controller state", **wait))

    def asked(self, name: str, entry: dict) -> None:
        """A lease the run asks for, or Blazar's answer to it (leases.py): into the state, written to the store
        now. A write that fails raises, and the lease is not asked for: what costs SUs is recorded first."""
        if self.fenced():  # a store that does not answer raises: no lease without its record
            raise ApplianceError(f"another controller holds run {self.run} now: this one asks for no lease")
        with self._mu:
            self.state.setdefault("asked", {})[name] = {**entry, "at": round(time.time(), 3)}
        self._write(patient=True)

    def fenced(self) -> bool:
        """Whether another controller holds the run now (this one writes its state and asks for leases no more),
        asked of the store before each write and each lease: the heartbeat that finds it out may be a minute away,
        or more (a laptop suspended past the lock's ttl wakes with its heartbeat not yet due: time.monotonic does
        not count a suspend). Its cost: one listing of the lock's generations and one GET of the newest
        (RunLock.taken_by). A controller that took no lock (a reader of the run) is not fenced. A store that does
        not answer raises StoreUnavailable: neither held nor lost."""
        if self.lost or not self.lock.generation:
            return self.lost
        other = self._store(self.lock.taken_by)
        if other is not None:
            self._lose(other)
        return self.lost

    def _lose(self, holder: dict) -> None:
        """``lost`` set, and said once: which controller holds the run now, and where."""
        with self._mu:
            said, self.lost = self.lost, True
        if said:
            return
        if holder.get("job_id") == self.id:  # its own generation, released by close: no other controller's
            why = f"this controller released run {self.run}'s lock"
        elif holder.get("job_id"):
            why = (f"another controller holds run {self.run} now: {holder['job_id']}, on {holder.get('cluster')} "
                   f"(pid {holder.get('head')}{', since released' if holder.get('released') else ''})")
        else:
            why = f"run {self.run}'s controller lock is gone from the store"
        log.info(f"[run] {why}: this controller writes its state, asks for leases and starts nothing more")

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

    def first_step(self, breakdown: dict) -> None:
        """A resumed job's first step is done: its downtime, phase by phase (flows.resume)."""
        if self.on_first_step is not None and self.job_id is not None:
            self.on_first_step(self.job_id, breakdown)

    def update(self, **fields) -> None:
        """Set fields of the run's state (its ledger, its pace): written to the store with the next event."""
        with self._mu:
            self.state.update(fields)

    def hook(self, stop: Callable[[str], None]) -> JobHooks:
        """The job's hook: its lease and hosts on the timeline; a cancel stops it."""
        return _ControlHook(self, stop)


class _ControlHook(JobHooks):
    def __init__(self, control: Control, stop: Callable[[str], None]):
        self.control, self.stop = control, stop

    def started(self, ctx: JobContext) -> None:
        c, cl = self.control, ctx.cluster
        c.update(cluster={**to_state(cl), "by": c.id})  # any machine can take the run over from it (runcluster.py)
        c.running("job", job_id=ctx.job_id, cluster=cl.name, site=cl.site.region or cl.cloud,
                  node_type=ctx.spec.nodes.node_type, hosts=[n.name for n in cl.nodes], lease_id=cl.lease_id,
                  lease_end=cl.lease_end, restore=bool(ctx.restore))
        with c._mu:
            c._stop_job = self.stop
            c.job_id = ctx.job_id
            asked = c.cancel is not None
        if asked:  # cancelled while the job was being set up
            self.stop("appliance cancel")
        elif c.on_job is not None:
            c.on_job(cl, ctx.spec)

    def finish(self, result: JobResult) -> None:
        c = self.control
        with c._mu:
            c._stop_job = None
        if c.on_job_end is not None:
            c.on_job_end(result)
        step = (result.stopped or {}).get("step")
        if step is None and result.commits:
            step = max(x["step"] for x in result.commits)
        c.record("job end", job_id=result.job_id, exit_code=result.exit_code, lease_end=bool(result.lease_end),
                 step=step, failure=result.failure, **job_end_marks(result))  # its ETTR (ettr.py)


def gone_here(controller_id: str) -> bool:
    """A controller of this machine whose process is gone (its lock need not wait for its ttl)."""
    return runs.process_gone(controller_id)


def busy(run: str, holder: dict) -> ApplianceError:
    age = time.time() - float(holder.get("heartbeat", 0))
    return ApplianceError(f"run {run} already has a controller: {holder.get('cluster')} pid {holder.get('head')}, "
                          f"alive {age:.0f}s ago", f"watch it with `appliance ls {run}`, stop it with `appliance "
                          f"cancel {run}`; a controller that is gone is taken over {float(holder.get('ttl', TTL)):.0f}s"
                          " after its last heartbeat")


def read_timeline(c: Control) -> dict | None:
    try:
        state = retrying(lambda: c.cs.read_json("state.json"), what="read the run's controller state", attempts=4)
    except FileNotFoundError:
        return None
    holder = c.lock.read()
    state["controller_alive"] = bool(holder and c.lock.alive(holder, ended=gone_here))
    if holder:
        state["controller_heartbeat_age_s"] = round(c.lock.age(holder))
    return state


def read_logs(c: Control, run: str, *, lines: int, follow: bool, out: Callable[[str], None], poll: float) -> str:
    """managed.store_logs, from the run's controller record ``c``."""
    metas = [o.name for o in c.cs.store.list(c.cs.prefix + "logs/") if o.name.endswith(".json")]
    if not metas:
        raise ApplianceError(f"run {run} has no job output in its store", "a managed run's controller puts its "
                             "newest job's output there as it runs (`appliance run`); `appliance ls RUN` shows it")
    newest = max((c.cs.read_json(m[len(c.cs.prefix):]) for m in metas), key=lambda m: m.get("at", 0))
    job, printed = newest["job_id"], None
    out(f"[appliance] job {job}: its output as the run's controller shipped it to the store")
    while True:
        meta = c.cs.read_json(f"logs/{job}.json")
        buf = bytearray()
        c.cs.store.get(f"{c.cs.prefix}logs/{job}.log", buf.extend)
        whole = bytes(buf).decode(errors="replace").split("\n")[:-1]  # whole lines only: the last may be partial
        first = int(meta["first_line"])
        if printed is None:
            printed = first + max(0, len(whole) - lines) if lines > 0 else first
        for i, line in enumerate(whole):
            if first + i >= printed:
                out(line)
        printed = max(printed, first + len(whole))
        if not follow:
            return job
        ended = [e for e in (read_timeline(c) or {}).get("events", []) if e.get("event") == "job end"
                 and e.get("job_id") == job]
        if ended:
            out(f"[appliance] job {job} ended (exit {ended[-1].get('exit_code')})")
            return job
        time.sleep(poll)  # polling the store for new lines: nothing to wait on
