"""The launcher's side of checkpointing, for one job: a `train` hook (flows.run_job adds it).

Before the job: the ranks' settings go into their environment (URL, interval, keep, resize policy, STOP file,
spec and code hashes: never a secret); the object-store credentials, scoped (on a Keystone site with a swift://
URL an application credential of the job's own, deleted when the job ends: Site.job_store_creds), go into a
0600 file on the head node that only rank 0 reads, removed when the job ends; a stale STOP file is removed; the
spec is saved next to the checkpoints so `appliance resume` works from any machine.
During the job: the lease watchdog runs, rank 0's ``Line.CKPT`` / ``Line.STOPPED`` / ``Line.RESUMED`` lines
(appliance.protocol) are collected (and feed the watchdog's margin), SIGTERM becomes a stop request.
"""

from __future__ import annotations

import hashlib
import json
import re
import shlex
import signal
import tempfile
import threading
import time
from collections.abc import Callable
from pathlib import Path

from .. import killpoints
from ..errors import ApplianceError
from ..protocol import EXIT_STOPPED, RUN_MARKER, Env, Line, parse
from ..sites import Site, open_site
from ..store.filesync import FileSet
from ..store.runlock import INTERVAL, LOCK, TTL, RunLock
from ..store.checkpoints import CheckpointStore, retrying
from ..store.objects import StoreRefused
from ..train.launch import JobContext, JobHooks, JobResult


def code_hash(code_dir: str) -> str:
    h = hashlib.sha256()
    root = Path(code_dir)
    for p in sorted(root.rglob("*")):
        if p.is_file() and "__pycache__" not in p.parts:
            h.update(p.relative_to(root).as_posix().encode() + b"\0" + p.read_bytes() + b"\0")
    return h.hexdigest()[:16]


class JobCheckpoints(JobHooks):
    """``site``: the spec's site (its store credentials, its leases); ``lease_site``: the site of the cluster's lease,
    watched while the job runs (None: a cluster without a lease). Both resolved once by the workflow (flows)."""

    def __init__(self, site: Site, lease_site: Site | None = None, extend_by=None, on_first_step=None,
                 launcher: str | None = None, on_extended: Callable[[object], None] | None = None):
        self.site, self.lease_site = site, lease_site
        self.on_extended = on_extended  # told the new lease end after the job's own credential is renewed
        self.launcher = launcher  # a managed run's controller id, in the run's lock (RunLock.launcher)
        self.extend_by = extend_by  # a managed run's rule for the watchdog's extensions (LeaseWatch.extend_by)
        # told (timeline, resumed) once rank 0's first step is done, in a thread of its own (a resume's downtime)
        self.on_first_step: Callable[[dict, dict | None], None] | None = on_first_step
        self.say: Callable[[str], None] = print
        self.creds_file: str | None = None
        self._withdraw_creds: Callable[[], None] | None = None  # deletes the job's application credential
        self._head_beats = False  # the head node renews the run's lock (node/lockbeat.py)
        self.commits: list[dict] = []
        self.files: list[dict] = []  # rank 0's working-directory syncs (level 3)
        self.lock: RunLock | None = None  # the store-level lease on the run (store/runlock.py)
        self.stopped: dict | None = None
        self.resumed: dict | None = None
        self.resumed_at: float | None = None  # when rank 0's RESUMED line arrived (time.time())
        self.first_step_at: float | None = None  # when its FIRST_STEP line arrived
        self.launched_at: float | None = None
        self.stop_requested: dict | None = None
        self.watch = None
        self.ctx: JobContext | None = None
        self._old_sigterm = self._old_sigint = None
        self._lock = threading.Lock()

    def prepare(self, ctx: JobContext) -> dict[str, str]:
        """Set up the head node; returns the ranks' extra environment. A fresh job (no ``ctx.restore``) starts at
        step 0, so the run must not have committed checkpoints already: its own would sort (by step) behind them
        and be pruned as soon as they were committed."""
        self.spec, self.cluster, self.head, self.run_dir, self.say = ctx.spec, ctx.cluster, ctx.head, ctx.run_dir, ctx.say
        self.ctx = ctx
        self.stop_file = f"{ctx.run_dir}/STOP"
        fresh = ctx.restore is None
        spec, ck = self.spec, self.spec.checkpoint
        env = {Env.STOP_FILE: self.stop_file, Env.SPEC_HASH: spec.digest or "",
               Env.CODE_HASH: code_hash(spec.code_dir)}
        rd = shlex.quote(self.run_dir)
        self.head.run(f"mkdir -p {rd} && touch {rd}/{RUN_MARKER}", check=True)
        self.say(protection_line(spec, self.cluster))
        if self.cluster.single_host:  # the ranks run on this machine: no node-side look at any metadata service
            env[Env.VENDORDATA_URL] = ""
        if not ck.url:
            self._clear_stop()
            return env
        env.update({Env.CKPT_URL: ck.url, Env.CKPT_KEEP: str(ck.keep), Env.CKPT_RESIZE: ck.resize,
                    Env.CKPT_AUTO: "1" if ck.auto else "0"})
        if ck.every_steps:
            env[Env.CKPT_EVERY_STEPS] = str(ck.every_steps)
        if ck.every_minutes:
            env[Env.CKPT_EVERY_MINUTES] = str(ck.every_minutes)
        creds, self._withdraw_creds = self.site.job_store_creds(ck.url, name=f"appliance-{spec.name}-{ctx.job_id}",
                                                                lease_end=ctx.cluster.lease_end_at, say=self.say)
        try:
            return self._prepare_store(ctx, env, creds, fresh)
        except BaseException:
            self._withdraw()  # a refused job leaves no credential behind
            raise

    def _prepare_store(self, ctx: JobContext, env: dict[str, str], creds, fresh: bool) -> dict[str, str]:
        spec, ck = self.spec, self.spec.checkpoint
        old, cs = [], None
        try:
            cs = CheckpointStore(ck.url, spec.name, creds)
            retrying(cs.ensure_container, what="create the checkpoint container", attempts=4)
            old = cs.committed() if fresh else []
            synced = FileSet(ck.url, spec.name, creds).manifests() if fresh else []
        except StoreRefused as e:  # no commit of the job could ever succeed: refused before it starts, not after
            raise ApplianceError(f"checkpoint.url {ck.url}: {e.message}; the job was not started", e.fix) from None
        except Exception as e:  # the store may come back: the job can still run; rank 0 retries its uploads
            self.say(f"[appliance] warning: cannot reach {ck.url} yet ({type(e).__name__}: {e})")
            cs, synced = None, []
        if not fresh:
            env[Env.FILES_RESTORE] = "1"  # rank 0 restores the synced working directory before the script runs
        if synced and not old:
            where = f"{ck.url.rstrip('/')}/{spec.name}/"
            raise ApplianceError(f"run {spec.name!r} already has synced files in {where}files/ (manifest "
                                 f"{synced[0]}); a new job would start without them and prune them",
                                 f"continue the run with `appliance resume {spec.name}`, or start it over: "
                                 f"`appliance data rm {where} --yes`, or give the spec a new name")
        if old:  # checked before anything is written, so a refused job changes nothing
            where = f"{ck.url.rstrip('/')}/{spec.name}/"
            raise ApplianceError(f"run {spec.name!r} already has {len(old)} committed checkpoint(s) in {where} "
                                 f"(newest {old[0].name}); a new job would start at step 0 and its checkpoints would "
                                 f"be pruned behind those",
                                 f"continue the run with `appliance resume {spec.name}`, or start it over: "
                                 f"`appliance data rm {where} --yes`, or give the spec a new name")
        if cs is not None:
            self._take_run_lock(cs, ctx)
        self._clear_stop()  # only now: a refused job leaves a running job's STOP request alone
        if creds is not None:
            self.creds_file = f"{self.run_dir}/.store-creds.json"
            self._write_creds(creds)
            env[Env.CKPT_CREDS] = self.creds_file
        if cs is not None and spec.path and Path(spec.path).exists():
            text = Path(spec.path).read_text()
            try:
                retrying(lambda: cs.put_text("spec.yaml", text, Path(spec.path).parent), what="save the spec",
                         attempts=4)
            except Exception as e:
                self.say(f"[appliance] warning: could not write the spec to {ck.url} ({type(e).__name__}: {e})")
        return env

    def _clear_stop(self) -> None:
        self.head.run(f"rm -f {shlex.quote(self.stop_file)}", check=True)

    def _other_lease_site(self) -> str | None:
        """The region of the job's lease when it is not the run's own site's (a managed run's alternative)."""
        ls = self.lease_site
        return ls.region if ls is not None and ls is not self.site and ls.region != self.site.region else None

    def _take_run_lock(self, cs: CheckpointStore, ctx: JobContext) -> None:
        """The store-level lease on the run (store/runlock.py): refuse the job while another job of the run, on any
        cluster, keeps its lock alive; take over a lock whose launcher stopped renewing it."""
        import os

        lock = RunLock(cs, ctx.job_id, cluster=ctx.cluster.name or "?", head=ctx.head.node.name,
                       interval=float(os.environ.get("APPLIANCE_RUN_LOCK_INTERVAL") or INTERVAL),
                       ttl=float(os.environ.get("APPLIANCE_RUN_LOCK_TTL") or TTL), lease_id=ctx.cluster.lease_id,
                       lease_site=self._other_lease_site(), launcher=self.launcher)
        try:
            holder, stale = lock.acquire(tempfile.gettempdir(), ended=lambda jid: job_ended_here(ctx.spec.name, jid),
                                         lease_over=lease_over_for(self.site))
        except Exception as e:  # noqa: BLE001 - the store is down: the job runs, as it does without a store
            self.say(f"[appliance] warning: could not take the run's lock in {self.spec.checkpoint.url} "
                     f"({type(e).__name__}: {e}); a second job of this run elsewhere would not be refused")
            return
        if holder is not None:
            raise run_busy(self.spec, holder)
        if stale is not None:
            self.say(f"[appliance] took over the run's lock from job {stale.get('job_id')} (cluster "
                     f"{stale.get('cluster')}), whose launcher stopped renewing it "
                     f"{lock.age(stale):.0f}s ago")
        self.lock, self._beat_stop = lock, threading.Event()
        killpoints.here("job-lock")  # the fault matrix: a launcher killed between the lock and the job's start

        def beat():
            while not self._beat_stop.wait(self.lock.interval):
                try:
                    if not self.lock.heartbeat(tempfile.gettempdir()):
                        self.say("[appliance] warning: the run's lock was taken by another job; this job commits "
                                 "and prunes nothing more (docs/checkpoints.md, the run lock)")
                        return
                except Exception:  # noqa: BLE001 - retried at the next beat; the ttl allows several misses
                    pass

        threading.Thread(target=beat, name="appliance-run-lock", daemon=True).start()

    def started(self, ctx: JobContext) -> None:
        self.launched_at = time.time()
        if self.lock is not None:  # in the lock from its next heartbeat on (RunLock.started)
            self.lock.started = True
        self._start_lock_beat(ctx)
        site = self.lease_site if self.cluster.lease_id else None
        if site is not None:
            from .watchdog import LeaseWatch

            try:
                self.watch = LeaseWatch(self.spec, self.cluster, self.request_stop, self.say, site=site,
                                        on_extended=self._extended, extend_by=self.extend_by).start()
            except ApplianceError as e:
                self.say(f"[watchdog] not watching the lease: {e}")
        if threading.current_thread() is threading.main_thread():
            self._old_sigterm = signal.signal(signal.SIGTERM, lambda *a: threading.Thread(
                target=self.user_stop, args=("SIGTERM to appliance train",), daemon=True).start())
            # a launcher started with SIGINT ignored (a background job of a shell, nohup) keeps ignoring it
            if self.spec.checkpoint.url and signal.getsignal(signal.SIGINT) is not signal.SIG_IGN:
                self._old_sigint = signal.signal(signal.SIGINT, self._on_ctrl_c)

    def _on_ctrl_c(self, *_) -> None:
        """The first Ctrl-C stops the job as SIGTERM does: a checkpoint at the next step, exit 75, resumable. It
        killed the job, and the work since its last checkpoint was lost. A second Ctrl-C is the old one."""
        signal.signal(signal.SIGINT, self._old_sigint)
        # nothing else here: the handler runs in the main thread wherever it was, possibly inside the launcher's
        # output lock (say), which a say from here would wait on forever (make test hung so, 600 s)
        threading.Thread(target=self._stop_for_ctrl_c, daemon=True).start()

    def _stop_for_ctrl_c(self) -> None:
        if self._files_only():
            self.say(f"[appliance] Ctrl-C: the job's working directory is committed now and the job ends (then "
                     f"`appliance resume {self.spec.name}` puts the files back); Ctrl-C again stops it at once, "
                     "losing what it wrote since the last sync")
        else:
            self.say(f"[appliance] Ctrl-C: the job saves a checkpoint at its next step and stops (then `appliance "
                     f"resume {self.spec.name}`); Ctrl-C again stops it at once, losing the work since its last "
                     "checkpoint")
        self.user_stop("Ctrl-C to appliance train")

    def _files_only(self) -> bool:
        """Level 3 only: nothing in the job stops it at a step; its synced working directory is what it keeps."""
        return protection_level(self.spec.code_dir, self.spec.checkpoint.auto) == "none"

    def user_stop(self, reason: str) -> None:
        """A stop the user asked for (Ctrl-C, SIGTERM to appliance train). A level-3-only job has nothing that
        stops at a step: rank 0's syncer commits the working directory and then ends the job (node/filesync.py).
        The lease watchdog's stop does not end such a job: it syncs, and keeps training (and syncing every
        minute) until the lease ends."""
        self.request_stop({"reason": reason, **({"end": "after-sync"} if self._files_only() else {})})

    def _restore_signals(self) -> None:
        for sig, old in ((signal.SIGTERM, self._old_sigterm), (signal.SIGINT, self._old_sigint)):
            if old is not None:
                signal.signal(sig, old)
        self._old_sigterm = self._old_sigint = None

    def _start_lock_beat(self, ctx: JobContext) -> None:
        """The head node renews the run's lock while the job runs and releases it when the job ends, whether or not
        this launcher is still there (node/lockbeat.py, detached like the job; its output in RUN_DIR/JOB.lockbeat)."""
        if self.lock is None:
            return
        args = ["--url", self.spec.checkpoint.url, "--run", self.spec.name, "--job", ctx.job_id,
                "--run-dir", ctx.run_dir, "--cluster", self.lock.cluster, "--head", self.lock.head,
                "--interval", f"{self.lock.interval:g}", "--ttl", f"{self.lock.ttl:g}"]
        if self.creds_file:
            args += ["--creds", self.creds_file]  # the file's path: the secret stays in the 0600 file
        py = shlex.quote(self.cluster.python)
        log = shlex.quote(f"{ctx.run_dir}/{ctx.job_id}.lockbeat")
        inner = f"{py} -m appliance.node.lockbeat {' '.join(shlex.quote(a) for a in args)} > {log} 2>&1 < /dev/null"
        try:
            r = self.head.run(f"cd / && if {py} -c 'import appliance.node.lockbeat' 2>/dev/null; then "
                              f"setsid sh -c {shlex.quote(inner)} > /dev/null 2>&1 < /dev/null & echo started; "
                              f"else echo missing; fi", timeout=60)
            ok = "started" in r.out
        except ApplianceError:
            ok = False
        self._head_beats = ok
        if not ok:
            self.say(f"[appliance] warning: the head node does not renew the run's lock (its appliance predates "
                     f"appliance.node.lockbeat, or it did not start): the lock is renewed only while this launcher "
                     f"is connected, and expires {self.lock.ttl:.0f}s after it goes")

    def request_stop(self, req: dict) -> None:
        """Ask the job to stop at the next step: the STOP file on the head node."""
        with self._lock:
            if self.stop_requested:
                return
            self.stop_requested = req
        req = dict(req)
        req.setdefault("deadline", time.time() + 600)
        self.say(f"[appliance] asking the job to stop: {req['reason']}")
        t0 = time.monotonic()
        try:
            self.head.run(f"cat > {shlex.quote(self.stop_file)}.tmp && mv {shlex.quote(self.stop_file)}.tmp "
                          f"{shlex.quote(self.stop_file)}", stdin=json.dumps(req).encode(), timeout=30, check=True)
        except ApplianceError as e:
            self.say(f"[appliance] could not ask the job to stop: {e}")
            return
        self.say(f"[appliance] stop request on the head node ({time.monotonic() - t0:.2f}s)")

    def rank_line(self, rank: int, text: str) -> bool:
        """Consume rank 0's checkpoint lines; True if the line was one."""
        got = parse(text, (Line.CKPT, Line.STOPPED, Line.RESUMED, Line.FILES, Line.FIRST_STEP)) if rank == 0 else None
        if got is not None:
            kind, body = got
            if kind == Line.FIRST_STEP:
                self.first_step_at = time.time()
                self.say(f"[checkpoint] training: step {body.get('step')} done, "
                         f"{self.first_step_at - (self.launched_at or self.first_step_at):.1f}s after horovodrun "
                         "started")
                if self.on_first_step is not None:
                    tl = {"launched": self.launched_at, "resumed": self.resumed_at, "first_step": self.first_step_at}
                    threading.Thread(target=self.on_first_step, args=(tl, self.resumed), daemon=True).start()
            elif kind == Line.FILES:
                body["at"] = time.time()
                self.files.append(body)
                self.say(f"[checkpoint] synced the working directory: {body['files']} file(s), {body['bytes']} bytes "
                         f"committed (manifest {body['seq']}, {body['seconds']}s"
                         + {"stop": ", the last before the lease end)", "exit": ", as rank 0 exited)"}.get(
                             body.get("final") or "", ")"))
            elif kind == Line.CKPT:
                body["at"] = time.time()
                self.commits.append(body)
                if self.watch is not None:
                    self.watch.commit_s.append(body.get("save_s", 0) + body.get("upload_s", 0))
                self.say(f"[checkpoint] step {body['step']} committed ({body['bytes']} bytes, "
                         f"save {body['save_s']}s + upload {body['upload_s']}s)")
            elif kind == Line.STOPPED:
                self.stopped = body
                if body.get("step") is None and body.get("committed"):  # level 3: the syncer ended the job
                    self.say(f"[checkpoint] stopped ({body['reason']}) with the working directory committed "
                             f"(manifest {body.get('files')})")
                elif body.get("committed"):
                    self.say(f"[checkpoint] stopped after step {body['step']} ({body['reason']}); "
                             f"checkpoint {body['checkpoint']} committed in {body['seconds']}s")
                else:
                    self.say(f"[checkpoint] STOPPED AFTER STEP {body['step']} BUT THE CHECKPOINT WAS NOT "
                             f"COMMITTED: {body.get('error')}; it is kept on the head node at {body.get('local')}"
                             " — copy it off before the lease ends")
            else:
                self.resumed = body
                self.resumed_at = time.time()
                msg = (f"[checkpoint] resumed at step {body['step']} (epoch {body['epoch']}, batch "
                       f"{body['batch']}) on {body['world_size']} rank(s)")
                if not body.get("bit_exact"):
                    msg += (f"; the checkpoint was made on {body['checkpoint_world_size']}: policy "
                            f"{body.get('policy')}, global batch {body.get('old_global_batch')} -> "
                            f"{body.get('global_batch')}, learning-rate factor {body.get('old_lr_scale')} -> "
                            f"{body.get('lr_scale')} (not bit-exact across world sizes)")
                for k in ("spec_hash_changed", "code_hash_changed"):
                    if body.get(k):
                        msg += f"; note: the {k.split('_')[0]} changed since the checkpoint"
                self.say(msg)
            return True
        return False

    def close(self) -> None:
        if self.watch is not None:
            self.watch.close()
        if self.ctx is not None and self.ctx.abandoned:  # the job may still run: it keeps its credentials and lock
            if self.lock is not None:
                self._beat_stop.set()
                if self._head_beats:
                    self.say(f"[appliance] the run's lock in {self.spec.checkpoint.url} stays: {self.head.node.name} "
                             "renews it while the job runs and releases it when the job ends")
                else:
                    self.say(f"[appliance] the run's lock in {self.spec.checkpoint.url} stays: no other job takes "
                             f"the run until {self.lock.ttl:.0f}s after this launcher's last heartbeat (and none on "
                             f"{self.head.node.name} while the job holds the run directory there)")
                self.lock = None
            self._restore_signals()
            return
        if self.lock is not None:
            self._beat_stop.set()
            try:
                self.lock.release()
            except Exception as e:  # noqa: BLE001
                self.say(f"[appliance] warning: could not release the run's lock ({type(e).__name__}); it expires "
                         f"{self.lock.ttl:.0f}s after its last heartbeat")
            self.lock = None
        self._restore_signals()
        if self.creds_file:
            try:
                self.head.run(f"rm -f {shlex.quote(self.creds_file)}", timeout=15)
            except ApplianceError:
                self.say(f"[appliance] warning: could not remove {self.creds_file} on the head node")
        self._withdraw()

    def _write_creds(self, creds) -> None:
        """The head node's credentials file (0600 from its first byte; never in argv or the job's environment),
        written beside it and renamed over it, so a reader sees the old file or the new one whole."""
        body = json.dumps({k: v for k, v in creds.__dict__.items() if v not in (None, {})}).encode()
        tmp = f"{self.creds_file}.new"
        self.head.run(f"umask 077 && cat > {shlex.quote(tmp)} && mv -f {shlex.quote(tmp)} "
                      f"{shlex.quote(self.creds_file)}", stdin=body, check=True)

    def _extended(self, lease_end) -> None:
        self.renew_creds(lease_end)
        if self.on_extended is not None:
            self.on_extended(lease_end)

    def renew_creds(self, lease_end) -> None:
        """The lease was extended: a store credential for the job that outlives the new end (it expires
        APP_CRED_AFTER_LEASE after the end known when it was made: a run extended twice got 401 on its commits;
        issue 52), written over the head node's credentials file in one rename (rank 0 and the file syncer read it
        again before their next commit). The one it replaces stays valid until the job ends, then both go."""
        if self.creds_file is None or self._withdraw_creds is None or self.ctx is None:
            return  # no credential of the job's own (Swift v1 or the user's S3 keys: they do not expire)
        spec = self.spec
        creds, withdraw = self.site.job_store_creds(spec.checkpoint.url, name=f"appliance-{spec.name}-{self.ctx.job_id}",
                                                    lease_end=lease_end, say=self.say)
        if withdraw is None:
            return
        self._write_creds(creds)
        old = self._withdraw_creds

        def both() -> None:
            try:
                withdraw()
            finally:
                old()
        self._withdraw_creds = both
        self.say(f"[appliance] the job's store credential renewed to outlive the lease's new end "
                 f"({lease_end:%Y-%m-%d %H:%M} UTC)")

    def _withdraw(self) -> None:
        """Delete the job's application credential (the job is over: nothing on the nodes needs it)."""
        withdraw, self._withdraw_creds = self._withdraw_creds, None
        if withdraw is None:
            return
        try:
            withdraw()
        except Exception as e:  # noqa: BLE001 - it expires by itself a week after the lease end
            self.say(f"[appliance] warning: could not delete the job's application credential ({e}); it expires "
                     "7 days after the lease end")

    def gone(self) -> bool:
        """The launcher lost the head node: are the nodes gone with the lease (stop reconnecting)?"""
        return self.lease_ended() is not None

    def lease_ended(self) -> str | None:
        """When the job failed: " at END UTC" (or "") if its lease has ended, None if not or unknown."""
        w = self.watch
        if w is None or not self.cluster.lease_id:
            return None
        try:
            info, now = w.site.cloud.lease_at(self.cluster.lease_id)
        except Exception:  # noqa: BLE001 - the verdict stays as it was
            return None
        if info is None:
            return ""
        if info.over(now):
            return f" at {info.end:%Y-%m-%d %H:%M} UTC"
        return None

    def finish(self, result: JobResult) -> None:
        """A stop before the lease end is exit 75 (resumable) when its checkpoint was committed, a failure if not.
        A job that failed because its lease ended under it says so, with what survives."""
        result.stopped, result.commits, result.resumed = self.stopped, self.commits, self.resumed
        if self.stopped is not None and self.stopped.get("step") is None and self.stopped.get("committed"):
            # level 3: rank 0 ended the job (EXIT_STOPPED) once its files were committed; the other ranks' ends,
            # and the launcher's "rank 0 ... status 75" verdict, follow from that
            result.failure = None
        result.timeline.update({k: v for k, v in (("resumed", self.resumed_at), ("first_step", self.first_step_at))
                                if v is not None})
        result.lease_end = self.stopped is not None and stopped_for_lease(self.stopped)
        if result.failure is not None and self.stopped is None:
            when = self.lease_ended()
            if when is not None:
                result.lease_end = True
                steps = [c["step"] for c in self.commits] + ([self.resumed["step"]] if self.resumed else [])
                name = self.spec.name
                if steps:
                    tail = (f"work after step {max(steps)} is lost; the newest committed checkpoint is step "
                            f"{max(steps)}: `appliance resume {name}` continues from it on a new lease")
                elif self.files:
                    f = self.files[-1]
                    tail = (f"no checkpoint was committed, but the working directory was synced "
                            f"{time.strftime('%H:%M:%S', time.gmtime(f['at']))} UTC ({f['files']} file(s), manifest "
                            f"{f['seq']}): `appliance resume {name}` puts those files back on a new lease, and the "
                            "script resumes from them")
                elif self.spec.checkpoint.url:
                    tail = ("no checkpoint was committed, so the run is lost (docs/checkpoints.md: what protects a "
                            "job)")
                else:
                    tail = "the spec has no checkpoint.url, so the run is lost: set it (docs/checkpoints.md)"
                result.failure = f"the lease ended{when} before the job finished ({result.failure}); {tail}"
        if self.stopped is not None and result.failure is None:
            if self.stopped.get("committed"):
                result.exit_code = EXIT_STOPPED
            else:
                result.exit_code = result.exit_code or 1
                result.failure = (f"stopped after step {self.stopped['step']} ({self.stopped['reason']}) but the "
                                  f"checkpoint was NOT committed: {self.stopped.get('error')}; it is kept on "
                                  f"{self.cluster.head.name} at {self.stopped.get('local')}")


def stopped_for_lease(stopped: dict) -> bool:
    """Whether rank 0's stop report is a stop for the lease end: the reasons the launcher's watchdog ("lease ID ends
    ..."), the vendordata ("lease end (vendordata)") and the node's watchdog ("lease end (node watchdog)") give; a
    user's SIGTERM or Ctrl-C is not one."""
    return str(stopped.get("reason", "")).startswith("lease")


def run_busy(spec, holder: dict) -> ApplianceError:
    age = time.time() - float(holder.get("heartbeat", 0))
    return ApplianceError(
        f"run {spec.name!r} already has a job running: {holder.get('job_id')} on cluster {holder.get('cluster')} "
        f"(head {holder.get('head')}), alive {age:.0f}s ago by its lock in "
        f"{spec.checkpoint.url.rstrip('/')}/{spec.name}/{LOCK}",
        f"wait for it to end, or stop it (`appliance down {holder.get('cluster')}`); if its launcher died, the lock "
        f"expires {float(holder.get('ttl', TTL)):.0f}s after its last heartbeat and `appliance resume {spec.name}` "
        "takes it over")


def live_job(spec, cs: CheckpointStore, site: Site) -> dict | None:
    """The lock of the run's job that is alive (renewed within its ttl, not ended as far as this machine knows, its
    lease not over), else None. ``site``: the spec's, whose leases are asked whether the job still has nodes."""
    lock = RunLock(cs, "", cluster="", head="")
    cur = lock.read()
    alive = cur and lock.alive(cur, ended=lambda jid: job_ended_here(spec.name, jid), lease_over=lease_over_for(site))
    return cur if alive else None


def refuse_if_running(spec, cs: CheckpointStore, site: Site) -> None:
    """`appliance resume`, before it stages anything: refuse while another job of the run keeps its lock alive (a
    running job prunes the very checkpoints a second one would stage)."""
    cur = live_job(spec, cs, site)
    if cur:
        raise run_busy(spec, cur)


def lease_over_for(site: Site):
    """``lease_over(lease_id, region)`` on ``site`` (or on the site ``region`` of its cloud: a job of the run at
    another site): Blazar no longer has the lease, or its end has passed by the cloud's own clock (at the end Blazar
    deletes every server of the lease, so a job on them is gone: a lock it left need not be waited out; issue 52).
    False when the site cannot tell (no credentials, an error): the lock's ttl decides then."""
    def over(lease_id: str, region: str | None = None) -> bool:
        try:
            at = site if region in (None, site.region) else open_site(site.kind, region)
            info, now = at.cloud.lease_at(lease_id)
        except Exception:  # noqa: BLE001 - cannot tell: not over
            return False
        return info is None or info.over(now)
    return over


def job_ended_here(run: str, job_id: str) -> bool:
    """This machine's run record says the job has ended (any status but running)."""
    from . import runs

    return any(j.get("job_id") == job_id and j.get("status") not in (None, "running", "lost")
               for j in (runs.load(run) or {}).get("jobs", []))


def protection_level(code_dir: str, auto: bool = True) -> str:
    """Which of docs/checkpoints.md's levels the training code gets, read from its Python files:
    "loop" (Checkpointer.epochs()), "callback" (the appliance's Keras callback in model.fit), "auto" (a plain
    Model.fit the ranks' shim hooks: checkpoint.auto), or "none" (no Model.fit: a custom training loop)."""
    try:
        text = "\n".join(p.read_text(errors="replace") for p in Path(code_dir).rglob("*.py")
                         if "__pycache__" not in p.parts)
    except OSError:
        return "none"
    if ".epochs(" in text and "Checkpointer" in text:
        return "loop"
    if "appliance.checkpoint" in text and ("callback(" in text or ".callback" in text):
        return "callback"
    if auto and re.search(r"\.fit\(", text):
        return "auto"
    return "none"


def protection_line(spec, cluster) -> str:
    """One line at launch: what protects this job from the lease end, or a warning that nothing does."""
    ck = spec.checkpoint
    ends = f" (the lease ends {cluster.lease_end[:16].replace('T', ' ')} UTC)" if cluster.lease_end else ""
    if not ck.url:
        return (f"[appliance] warning: no checkpoint.url in the spec: nothing saves this run before the lease "
                f"end{ends}; it would be lost (fix: set checkpoint.url, docs/checkpoints.md)")
    level = protection_level(spec.code_dir, ck.auto)
    where = f"{ck.url.rstrip('/')}/{spec.name}/"
    if level == "none":
        why = ("checkpoint.auto is false and the code does not use the appliance's callback" if not ck.auto else
               "the code never calls Model.fit (a custom training loop?) nor uses the Checkpointer")
        return (f"[appliance] protected (level 3 only, the synced working directory): {why}, so nothing stops the "
                f"job before the lease end{ends}; the files it writes in its working directory (e.g. "
                f"./checkpoint-N.h5) are committed to {where}files/ every minute and when the stop comes, and "
                f"`appliance resume {spec.name}` puts them back before the script starts; the script must resume "
                "from them itself. For a stop after the same step on every rank: pass "
                "appliance.checkpoint.keras.callback() to model.fit, or use Checkpointer.epochs() "
                "(docs/checkpoints.md)")
    how = {"loop": "level 1, the Checkpointer's loop",
           "callback": "level 1, the appliance's callback in model.fit",
           "auto": "level 2, the appliance's callback added to Model.fit by checkpoint.auto, no code changes"}[level]
    return (f"[appliance] protected ({how}): commits to {where} and stops every rank after the same step before the "
            f"lease end{ends}; `appliance resume {spec.name}` continues it")

