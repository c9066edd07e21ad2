"""The training side: checkpoints and the collective stop, for tf.keras + Horovod scripts.

Use in a training script (see examples/digits/train.py)::

    from appliance.checkpoint.keras import Checkpointer

    ckpt = Checkpointer(seed=args.seed, batch_size=args.batch_size)   # reads the run's settings from the env
    bs, lr = ckpt.batch_size, args.lr * ckpt.lr_scale                  # as the resize policy says
    ... build model and optimizer ...
    for epoch, first in ckpt.epochs(model, args.epochs, steps_per_epoch):
        perm = np.random.RandomState(args.seed + epoch).permutation(n)   # epoch order from (seed, epoch)
        mine = perm[rank::size][: steps_per_epoch * bs][first * bs:]      # skip what was done
        model.fit(tf.data.Dataset.from_tensor_slices((x[mine], y[mine])).batch(bs),
                  epochs=epoch + 1, initial_epoch=epoch, callbacks=[..., ckpt.callback])
    ckpt.close()                                                         # final checkpoint, committed

What it does:
- restores the newest committed checkpoint that `appliance resume` staged (``APPLIANCE_RESTORE``): model
  weights, optimizer slots and step, RNG states, data position (epoch, batch), metrics so far;
- twice a second (every K steps, K calibrated at start) one tiny allreduce decides together whether to
  stop (a STOP request from the lease watchdog, SIGTERM on any rank, or the lease end read from
  Chameleon's vendordata on the head node), so every rank stops after the same step;
- rank 0 saves every N steps / M minutes: a local write with an atomic rename, then a background upload
  committed by a manifest written last (appliance/checkpoint/store.py); training goes on meanwhile;
- on a stop, rank 0 saves, uploads and verifies before the deadline, every rank waits for it, rank 0
  prints ``APPLIANCE_STOPPED {...}`` and the process exits 0 (`appliance train` then exits 75).
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import sys
import threading
import time
from pathlib import Path


from .. import report
from ..protocol import VENDORDATA_MARGIN, Env, Line, emit, keras_switch
from ..store.checkpoints import CheckpointStore, ckpt_name
from .creds import CredsFile
from .filesync import note
from .metrics import Metrics
from .rngstate import (generator_states, keras_of, layer_generators, model_state, rng_state, set_generator_states,
                       set_rng_state)
from .stream import stream_record
from .uploads import Uploads
from .vendordata import vendordata_lease_end

CALIBRATION = 20  # steps timed after each start to pick the stop-check interval
STOP_CHECK_SECONDS = 0.5  # between collective stop checks (APPLIANCE_STOP_CHECK_SECONDS overrides)


def _is_io_error(e: BaseException) -> bool:
    """An error of the node's disk: OSError (ENOSPC, EIO) or TensorFlow's I/O error types."""
    if isinstance(e, OSError):
        return True
    names = {c.__name__ for c in type(e).__mro__}
    return "OpError" in names and bool(names & {"ResourceExhaustedError", "UnknownError", "InternalError",
                                                  "DataLossError", "PermissionDeniedError", "FailedPreconditionError"})


class Checkpointer(Uploads, Metrics):
    """Checkpoint/restore/stop for one rank. Settings come from the environment `appliance train` sets;
    arguments override them."""

    def __init__(self, *, seed: int | None = None, batch_size: int | None = None, url: str | None = None,
                 every_steps: int | None = None, every_minutes: float | None = None, keep: int | None = None, run_dir: str | None = None,
                 restore_dir: str | None = None, resize: str | None = None, exit_on_stop: bool = True):
        import horovod.tensorflow as hvd_tf

        _note_made()
        report.default(note)  # the object store's notes (retries, pruning) in the job's output, as the Checkpointer's
        env = os.environ
        self._hvd = hvd_tf
        self.rank, self.size = hvd_tf.rank(), hvd_tf.size()
        self.seed = seed
        self.url = url if url is not None else env.get(Env.CKPT_URL) or None
        self.every_steps = every_steps if every_steps is not None else int(env.get(Env.CKPT_EVERY_STEPS) or 0)
        self.every_s = 60 * (every_minutes if every_minutes is not None
                             else float(env.get(Env.CKPT_EVERY_MINUTES) or 0))
        self.keep = keep if keep is not None else int(env.get(Env.CKPT_KEEP) or 3)
        self.run = env.get(Env.RUN, "run")
        self.run_dir = Path(run_dir or env.get(Env.RUN_DIR) or f"./appliance-run-{self.run}")
        self.local_dir = self.run_dir / "checkpoints"
        self.metrics_dir = self.run_dir / "metrics"
        self.stop_file = Path(env.get(Env.STOP_FILE) or self.run_dir / "STOP")
        self.exit_on_stop = exit_on_stop
        self.resize = resize or env.get(Env.CKPT_RESIZE) or "lr"
        restore = restore_dir if restore_dir is not None else env.get(Env.RESTORE)
        self.restore_dir = Path(restore) if restore else None
        self.meta = None
        if self.restore_dir:
            self.meta = json.loads((self.restore_dir / "meta.json").read_text())
        self.requested_batch = batch_size
        old = (self.meta or {}).get("world_size", self.size)
        self.resized = bool(self.meta) and old != self.size
        if self.meta and self.resize == "batch" and batch_size is not None:
            g = self.meta["global_batch"]
            if g % self.size:
                raise SystemExit(f"checkpoint.resize: batch keeps the global batch {g}, which {self.size} ranks "
                                 "cannot split evenly; use resize: lr or another node count")
            self.batch_size, self.lr_scale = g // self.size, float(self.meta.get("lr_scale", old))
        else:
            self.batch_size, self.lr_scale = batch_size, float(self.size)
        self.mode: str | None = None  # "loop" (epochs()) or "fit" (the callback in a plain Model.fit)
        self.model = None
        self.step = 0
        self.epoch, self.first, self.offset = 0, 0, 0
        self.stopped = False
        self._first_step_said = False
        self._steps_here = 0  # this job's own steps, counted for the hold-after test hook only
        self.stop_reason: str | None = None
        self._stop_decided_at: float | None = None  # wall time of the check that agreed to stop
        self._stop_marks: dict = {}
        self._checked_epoch: int | None = None  # the epoch whose first step was checked for a stop
        self._local_reason: str | None = None
        self._last_save = time.monotonic()
        self.save_failures = 0  # periodic saves the node's disk refused (the run went on)
        if self.rank == 0:
            self._clean_tmp()  # partial directories of a run killed while saving
        self._store: CheckpointStore | None = None
        self._creds_file = CredsFile()
        self._pending: Path | None = None
        self._cv = threading.Condition()
        self._uploader: threading.Thread | None = None
        self._uploading: Path | None = None
        self._last_commit: dict | None = None
        self._last_commit_local: str | None = None  # its directory on the node
        self._upload_error: str | None = None
        self._commit_s: list[float] = []
        self._writer = None
        self._csv = None
        self._fault = env.get("APPLIANCE_FAULT", "")
        self._deadline: float | None = None
        self._vd_next = 0.0  # 1.0 once rank 0's vendordata reader runs
        self._vd_end: float | None = None
        self.check_seconds = float(env.get(Env.STOP_CHECK_SECONDS) or STOP_CHECK_SECONDS)
        self.check_every = 1  # steps between collective stop checks, agreed after calibration
        self._checked_at = -1
        self._calib_from, self._calib_at, self._next_check, self._t_calib = 0, CALIBRATION, 0, time.monotonic()
        self._rank_marks: list[dict] = []  # every rank's timings at the stop's gather
        signal.signal(signal.SIGTERM, self._on_signal)
        self.callback = _make_callback(self)
        if self.rank == 0 and self.url:
            self._ensure_uploader()  # it reaches the store now, not at the first commit (_warm_store)

    # -- stop requests -------------------------------------------------------------------------------------
    def _on_signal(self, signum, frame):
        self._local_reason = "SIGTERM"

    def _local_stop(self) -> bool:
        if self._local_reason:
            return True
        if self._fault == f"stop-at:{self.step}":  # test hook: a stop asked for after exactly this step
            self._local_reason = "stop requested (test)"
            return True
        if self.stop_file.exists():
            try:
                req = json.loads(self.stop_file.read_text() or "{}")
            except (OSError, ValueError):
                req = {}
            self._local_reason = req.get("reason") or "stop requested"
            if req.get("deadline"):
                self._deadline = float(req["deadline"])
            return True
        if self.rank == 0:  # Chameleon's own lease end, on the node: read once a minute off the training thread
            if self._vd_next == 0.0:
                self._vd_next = 1.0
                threading.Thread(target=self._read_vendordata, name="appliance-vendordata", daemon=True).start()
            end, margin = self._vd_end, self._vd_margin()
            if end is not None and time.time() >= end - margin:
                self._local_reason = "lease end (vendordata)"
                self._deadline = end - 30
                return True
        return False

    def _vd_margin(self) -> float:
        return max(VENDORDATA_MARGIN, 3 * max(self._commit_s or [0.0]))

    def _read_vendordata(self) -> None:
        """Rank 0's lease end from vendordata, once a minute, for ``_local_stop`` (an HTTP read of the metadata
        service: on the training thread it was most of the callback's time in a fast model's first steps)."""
        while not self.stopped:
            self._read_vendordata_once()
            time.sleep(60)  # the metadata service's cache is hourly; a lease end is minutes away when it matters

    def _read_vendordata_once(self) -> None:
        try:
            self._vd_end = vendordata_lease_end(near=lambda e: time.time() >= e - self._vd_margin())
        except Exception:  # noqa: BLE001 - no vendordata is no lease end; the watchdog still acts
            pass

    def _time_save_due(self) -> int:
        """Rank 0's clock says a periodic save is due (carried to every rank by the stop check)."""
        return int(self.rank == 0 and bool(self.every_s) and time.monotonic() - self._last_save >= self.every_s)

    def _collective_stop(self, epoch_start: bool = False) -> tuple[bool, bool]:
        """(stop, save) agreed by all ranks: one allreduce (max of 0/1 flags) at agreed steps. The first
        CALIBRATION steps after a start check 1, 2, 4, 8 and 16 steps in, while rank 0 times them; at the last of
        them the ranks agree (the same allreduce carries rank 0's answer) on K, the steps per ``check_seconds``; from
        then on every K-th step checks. Every rank reaches the same decision at the same step, and the check costs
        one tiny allreduce per half second (its cost per call: bench/results/ckpt.md); a stop waits 0.25 s for it
        on average. The first step of every epoch checks too (``epoch_start``): K steps are timed in the middle of an
        epoch, while what lies between two epochs (validation, other callbacks, in a loop the next ``fit``'s start)
        is not in any step, and a stop asked then waited for it and then up to K more steps (1.6 s in make
        bench-ckpt, where each epoch is a new ``fit``). The same allreduce carries rank 0's "a timed save is due",
        so that every rank takes part in every save (each rank's RNG state goes into it)."""
        import tensorflow as tf

        s = self.step
        self._checked_at = s
        if s == self._calib_from + 3 and self.rank == 0:
            self._t_calib = time.monotonic()
        if s < self._calib_at:
            # checks 1, 2, 4, 8 and 16 steps after the start: a stop asked meanwhile waits at most as many steps as
            # have run, in a few collectives, so a fast model's first steps are not slowed (Keras times them). The
            # stop-at:N test hook lands its stop exactly at N on every rank, as it asks.
            since = s - self._calib_from
            if since & (since - 1) and not epoch_start and self._fault != f"stop-at:{s}":
                self._checked_at = -1
                return False, False
        elif s == self._calib_at:
            k = 0
            if self.rank == 0:
                per_step = (time.monotonic() - self._t_calib) / max(1, s - self._calib_from - 3)
                k = max(1, min(1000, int(self.check_seconds / max(per_step, 1e-6))))
            v = self._hvd.allreduce(tf.constant([1 if self._local_stop() else 0, k, self._time_save_due()],
                                                dtype=tf.int32), op=self._hvd.Max, name="appliance.stop.calibrate")
            self.check_every = int(v[1])
            self._next_check = s + self.check_every
            return int(v[0]) > 0, int(v[2]) > 0
        elif s < self._next_check and not epoch_start:
            self._checked_at = -1
            return False, False
        else:
            self._next_check = s + self.check_every
        flag = tf.constant([1 if self._local_stop() else 0, self._time_save_due()], dtype=tf.int32)
        v = self._hvd.allreduce(flag, op=self._hvd.Max, name="appliance.stop")
        return int(v[0]) > 0, int(v[1]) > 0

    # -- the loop ------------------------------------------------------------------------------------------
    def epochs(self, model, total_epochs: int, steps_per_epoch: int, optimizer=None):
        """Yield (epoch, first_batch) from the restored position to the end; handles a stop."""
        self.mode = "loop"
        self.model, self.optimizer = model, optimizer or model.optimizer
        self.steps_per_epoch = steps_per_epoch
        self.total_epochs = total_epochs
        self._state = model_state(model, self.optimizer)
        epoch, first = self._restore()
        self._calib_from, self._calib_at = self.step, self.step + CALIBRATION
        start = epoch
        while epoch < total_epochs:
            # between two fits (the last one's teardown, the rest of the loop's body, the next one's start: 0.2 to
            # 1.9 s in make bench-ckpt, in no step) every rank checks once more, and a stop saves here, at (epoch, 0)
            if epoch != start and self._collective_stop(epoch_start=True)[0]:
                self._stop_now()
                return
            self.epoch, self.first = epoch, first
            yield epoch, first
            if self.stopped:  # saved and committed at the step that stopped (after_step); not exit_on_stop
                return
            epoch, first = epoch + 1, 0

    def attach_fit(self, model, params: dict) -> None:
        """A plain ``Model.fit`` starts (the callback's on_train_begin): restore the newest checkpoint into the model
        and make Keras start at its (epoch, batch), the consumed batches skipped (appliance/node/keras_fit.py; on
        Keras 3 appliance/node/keras3_fit.py)."""
        from . import keras3_fit, keras_fit

        keras3 = keras3_fit.is_keras3_model(model)
        if not keras3:
            keras_fit.install_data_hooks()  # the ranks' shim did it at import; this is for scripts run elsewhere
        again = self.mode == "fit"
        self.mode = "fit"
        self.model, self.optimizer = model, model.optimizer
        self.steps_per_epoch = int(params.get("steps") or 0)
        self.total_epochs = int(params.get("epochs") or 0)
        self._state = model_state(model, self.optimizer)
        if again:  # the same callback in another fit: the step count goes on, nothing is restored twice
            return
        if self.meta and not (model.built if keras3 else keras_fit.build_from_data(model)):
            self._log("the model is not built before its first step (no input shape), so its checkpoint is "
                      "restored as its variables appear; give the model an Input layer for an exact resume")
        epoch, first = self._restore()
        self._calib_from, self._calib_at = self.step, self.step + CALIBRATION
        self.epoch, self.first = epoch, 0
        keras_fit.training_stream(model)  # a stream the fit reads: its position goes with each save
        if self.meta and keras3:
            keras3_fit.resume_at(model, epoch, first, self._log if self.rank == 0 else (lambda m: None))
        elif self.meta:
            model._training_state = keras_fit.ResumeAt(epoch, first)
            model._appliance_skip = (epoch, first, self._log if self.rank == 0 else (lambda m: None),
                                     self.meta.get("stream"))

    def end_fit(self) -> None:
        """A plain ``Model.fit`` returned normally (all epochs, or another callback stopped it): the final
        checkpoint, committed."""
        if isinstance(getattr(self.model, "_training_state", None), _resume_type()):
            self.model._training_state = None
        elif self.model is not None and keras_of(self.model) == "3":
            from .keras3_fit import end_fit

            end_fit(self.model)
        if not self.stopped:
            self.close()

    def _restore(self) -> tuple[int, int]:
        if self.rank == 0:
            self._open_metrics(restore=self.restore_dir)
        if not self.meta:
            return 0, 0
        t0 = time.monotonic()
        m = self.meta
        refused = keras_switch(m.get("keras"), keras_of(self.model))
        if refused:  # the launcher refuses it before the job (appliance/checkpoint/resume.py); a script run by hand
            print(f"[appliance] error: {refused}", file=sys.stderr, flush=True)
            raise SystemExit(1)
        self._state.read(self.restore_dir)
        per_rank = m.get("rng_ranks") or []
        mine = per_rank[self.rank] if len(per_rank) == self.size else m["rng"]  # a resize: rank 0's for all
        set_rng_state(mine)
        gens, states = layer_generators(self.model), mine.get("layers")
        layers_restored = states is not None and len(states) == len(gens)
        if layers_restored:
            set_generator_states(gens, states)
        self.step = int(m["step"])
        epoch, first = int(m["epoch"]), int(m["offset"])
        info = {"step": self.step, "epoch": epoch, "batch": first, "world_size": self.size,
                "checkpoint_world_size": m["world_size"], "bit_exact": not self.resized,
                "restore_s": round(time.monotonic() - t0, 3)}
        if gens and not layers_restored:
            info.update({"bit_exact": False, "note": f"{len(gens)} random layer(s) but the checkpoint has "
                         f"{len(states or [])} generator state(s): their random draws differ after the resume"})
        if self.resized and self.batch_size is None:  # a plain Model.fit: the same fraction of the epoch
            old_spe = int(m.get("steps_per_epoch") or 0)
            if old_spe and self.steps_per_epoch:
                first = min(self.steps_per_epoch, first * self.steps_per_epoch // old_spe)
            info.update({"batch": first, "policy": "lr (fit: same fraction of the epoch)"})
        elif self.resized:
            done = first * m["global_batch"]  # samples of this epoch already trained on
            first = min(done // (self.batch_size * self.size), self.steps_per_epoch)
            info.update({"batch": first, "policy": self.resize, "batch_size": self.batch_size,
                         "global_batch": self.batch_size * self.size, "old_global_batch": m["global_batch"],
                         "lr_scale": self.lr_scale, "old_lr_scale": m.get("lr_scale")})
        if self.steps_per_epoch and first >= self.steps_per_epoch:
            epoch, first = epoch + 1, 0
        for k in ("spec_hash", "code_hash"):
            if m.get(k) and os.environ.get(f"APPLIANCE_{k.upper()}") not in (None, "", m.get(k)):
                info[f"{k}_changed"] = True
        if self.rank == 0:
            emit(Line.RESUMED, info)
        return epoch, first

    def after_step(self, batch: int, logs: dict | None) -> None:
        self.step += 1
        if self._fault.startswith("hold-"):
            self._fault_hold()
        if not self._first_step_said and self.rank == 0:  # the launcher times a resume's downtime up to here
            self._first_step_said = True
            emit(Line.FIRST_STEP, {"step": self.step})
        self.offset = self.first + batch + 1
        epoch_start = self._checked_epoch != self.epoch  # the same on every rank: they run the same epochs
        self._checked_epoch = self.epoch
        stop, timed = self._collective_stop(epoch_start)
        if self.rank == 0 and (self._checked_at == self.step or stop):  # about once per check interval
            self._log_metrics(logs or {}, every=1)
        due = (self.every_steps and self.step % self.every_steps == 0) or timed  # the same on every rank
        if due and not stop:
            self._periodic_save()
        if stop:
            self._stop_now()

    def _fault_hold(self) -> None:
        """Test hooks (``_hold``): every rank waits after this step, before any collective of it, until the file
        exists; ``hold-at:STEP:PATH`` at the run's step STEP, ``hold-after:N:PATH`` after this job's N-th step."""
        self._steps_here += 1
        if self._fault.startswith((f"hold-at:{self.step}:", f"hold-after:{self._steps_here}:")):
            _hold(self._fault.split(":", 2)[2])

    def _stop_now(self) -> None:
        """Every rank, at the check that agreed to stop: save, commit, report (``_finish_stop``), now. In the loop
        as in a plain fit, this is before Keras ends the epoch (validation: a whole pass over the validation
        data), then the fit (its data pipeline's teardown: 0.2-1.9 s in make bench-ckpt, 2026-11-25), and before
        the rest of the loop's body; the loop used to wait for all of it."""
        self.stopped = True
        self._stop_decided_at = round(time.time(), 3)  # the check that agreed (the benchmark splits the stop here)
        self._stop_marks = {"uploading_at_stop": self._uploading.name if self._uploading else None}
        self.stop_reason = self._local_reason or "a peer asked to stop"
        self.model.stop_training = True
        self._finish_stop()

    def epoch_end(self, epoch: int, logs: dict | None) -> None:
        if self.rank == 0 and not self.stopped:  # a stopped epoch is not a finished one
            self._log_metrics({k: v for k, v in (logs or {}).items()}, every=1, epoch_end=True)

    # -- saving --------------------------------------------------------------------------------------------
    def _position(self) -> tuple[int, int]:
        if self.steps_per_epoch and self.offset >= self.steps_per_epoch:
            return self.epoch + 1, 0
        return self.epoch, self.offset

    def _periodic_save(self) -> None:
        """A periodic save that fails on the node's disk (full, I/O error) does not end the run: say so loudly,
        clean the partial directory, keep training, and try again at the next interval. Older checkpoints, local
        and committed, are untouched."""
        states = self._gather_rng()
        if self.rank != 0:
            self._last_save = time.monotonic()
            return
        try:
            self.save(states)
        except Exception as e:
            if not _is_io_error(e):
                raise
            self.save_failures += 1
            self._last_save = time.monotonic()
            self._clean_tmp()
            self._log(f"CHECKPOINT NOT SAVED at step {self.step}: {type(e).__name__}: {str(e)[:200]}; training goes "
                      f"on and the next save is tried at the next interval (free space in {self.local_dir})")

    def _clean_tmp(self) -> None:
        """Partial checkpoint directories (a failed save, or a run killed while saving)."""
        for p in self.local_dir.glob(".tmp-ckpt-*"):
            shutil.rmtree(p, ignore_errors=True)

    def _own_rng(self) -> dict:
        """This rank's RNG states: Python, NumPy, TensorFlow's global generator, the random layers' generators."""
        return dict(rng_state(), layers=generator_states(self.model))

    def _gather_rng(self, marks: dict | None = None) -> list[dict]:
        """Every rank: its RNG states (Python, NumPy, TensorFlow's global generator, the random layers'
        generators), gathered on every rank; a checkpoint keeps each rank's, so a resume on the same world size
        gives each rank its own. ``marks``: this rank's timings, carried along (``self._rank_marks``: every
        rank's), not kept in the states."""
        mine = self._own_rng()
        if self.size == 1:
            self._rank_marks = [marks or {}]
            return [mine]
        got = list(self._hvd.allgather_object({"rng": mine, "marks": marks or {}}, name="appliance.rng"))
        self._rank_marks = [g["marks"] for g in got]
        return [g["rng"] for g in got]

    def save(self, states: list[dict] | None = None, *, complete: bool = False) -> Path:
        """Rank 0: write the full state locally (atomic rename) and queue it for upload. ``states``: every rank's
        RNG states (``_gather_rng``, which all ranks must call); without it, rank 0's alone."""
        states = states or [self._own_rng()]
        t0 = time.monotonic()
        epoch, offset = self._position()
        final = self._local_name(self.step)
        tmp = self.local_dir / f".tmp-{final.name}"
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir(parents=True)
        self._state.write(tmp)
        meta = {"step": self.step, "epoch": epoch, "offset": offset, "seed": self.seed,
                "world_size": self.size, "batch_size": self.batch_size,
                "global_batch": self.batch_size and self.batch_size * self.size,
                "lr_scale": self.lr_scale, "steps_per_epoch": self.steps_per_epoch, "total_epochs": self.total_epochs,
                "complete": complete, "run": self.run, "saved_at": time.time(),
                "spec_hash": os.environ.get(Env.SPEC_HASH, ""),
                "code_hash": os.environ.get(Env.CODE_HASH, ""), "rng": states[0], "rng_ranks": states,
                "mode": self.mode, "stream": stream_record(epoch, offset, self.steps_per_epoch or None),
                "keras": keras_of(self.model)}
        if self._writer is not None:
            self._writer.flush()
        if self._csv is not None:
            self._csv[0].flush()
        if self.metrics_dir.exists():
            shutil.copytree(self.metrics_dir, tmp / "metrics")
        (tmp / "meta.json").write_text(json.dumps(meta, sort_keys=True))
        self._publish(tmp, final)
        self._last_save = time.monotonic()
        self._save_s = time.monotonic() - t0
        if self.url:
            self._ensure_uploader()
        self._prune_local()
        return final

    def _publish(self, tmp: Path, final: Path) -> None:
        """The saved directory under its name and queued for upload, in one step under the uploader's lock, which a
        prune lists under too: a prune never deletes a checkpoint that is being queued (one did, between its
        listing and this rename, and the uploader died on its missing meta.json: make test, 2026-11-29)."""
        with self._cv:
            # atomic: a checkpoint directory is whole or absent, also after kill -9. Not fsynced: a node that loses
            # power is gone with its disk at the lease end anyway; durability is the store's job (the commit)
            os.rename(tmp, final)
            if self.url:
                self._pending = final  # replaces an older one still waiting: the newest state goes first
                self._cv.notify_all()

    def _local_name(self, step: int) -> Path:
        """A directory no earlier save used: a re-save of a step (a periodic save at the last step, then close()'s;
        a stop right after a save) never replaces one the uploader may be reading (ckpt-<step>.<n>, as in the
        store: store/checkpoints.py free_name)."""
        base = self.local_dir / ckpt_name(step)
        path, n = base, 0
        while path.exists():
            n += 1
            path = base.with_name(f"{base.name}.{n}")
        return path

    def _log(self, msg: str) -> None:
        note(msg)

    def _finish_stop(self) -> None:
        """Every rank: rank 0 saves + commits; all wait for it; rank 0 reports; exit 0."""
        import tensorflow as tf

        marks = dict(self._stop_marks, finish_at=round(time.time(), 3))  # where the stop's time goes (bench)
        states = self._gather_rng({"finish_at": marks["finish_at"]})
        if self.rank == 0:
            if self._deadline is None:
                self._deadline = time.time() + 600
            t0 = time.monotonic()
            marks["gathered_at"] = round(time.time(), 3)
            marks["last_rank_at"] = max(m.get("finish_at") or 0 for m in self._rank_marks)
            save_error = None
            try:
                local = self.save(states)
            except Exception as e:  # the disk refused the stop's save: report it, older checkpoints stand
                if not _is_io_error(e):
                    raise
                self._clean_tmp()
                local, save_error = None, f"the save failed on the node's disk: {type(e).__name__}: {e}"
            committed = local is not None
            marks["saved_at"] = round(time.time(), 3)
            if self.url and committed:
                committed = self._wait_stop_commit() and self._last_commit is not None and \
                    self._last_commit["step"] == self.step
            name = self._last_commit["name"] if committed and self.url else local.name if local else None
            body = {"step": self.step, "epoch": self._position()[0], "reason": self.stop_reason,
                    "committed": committed, "checkpoint": name,
                    "seconds": round(time.monotonic() - t0, 2),
                    "decided_at": self._stop_decided_at, **marks}
            if not committed:
                body.update({"local": str(local or self.local_dir),
                             "error": save_error or self._upload_error or "upload did not finish in time"})
            body["reported_at"] = round(time.time(), 3)
            emit(Line.STOPPED, body)
        self._hvd.allreduce(tf.constant([0]), name="appliance.stopped")  # everyone waits for rank 0's commit
        self._close_metrics()
        if self.exit_on_stop:
            sys.stdout.flush()
            sys.exit(0)

    def close(self) -> None:
        """After the last epoch: a final checkpoint (marked complete), committed before returning."""
        import tensorflow as tf

        states = self._gather_rng()
        if self.rank == 0:
            self.save(states, complete=True)
            if self.url and not self._wait_uploads(time.time() + 600):
                self._log("the final checkpoint did not commit within 10 minutes")
        self._hvd.allreduce(tf.constant([0]), name="appliance.closed")
        self._close_metrics()

def _resume_type():
    from .keras_fit import ResumeAt

    return ResumeAt


class ApplianceCallback:
    """Marker base: a Keras callback of the appliance's (the autolog adds none where one is present)."""

    _appliance = True


def _hold(path: str) -> None:
    """The hold test hooks (``Checkpointer._fault_hold``): the job stays at a step until PATH exists (a job that
    outlives its controller's restart, tests/test_lease_end.py); nothing of the training changes."""
    while not os.path.exists(path):
        time.sleep(0.1)  # polling a file the test makes: there is nothing to wait on across the nodes


def _make_callback(owner: Checkpointer):
    import tensorflow as tf

    from . import keras_fit

    class ApplianceCheckpoint(tf.keras.callbacks.Callback, ApplianceCallback):
        """Keras side of the Checkpointer. In ``Checkpointer.epochs()`` (the loop) it reports steps and epoch
        ends; in a plain ``model.fit`` it also restores at the start and commits at the end. It takes the step's
        logs as tensors (``_supports_tf_logs``): Keras then does not wait for them at every step to hand them over
        as numbers, a wait it would count as the callback's time; they are read only at the steps that log them."""

        def __init__(self):
            super().__init__()
            self._supports_tf_logs = True

        def on_train_begin(self, logs=None):
            if owner.mode != "loop":
                owner.attach_fit(self.model, self.params)

        def on_epoch_begin(self, epoch, logs=None):
            if owner.mode == "fit":
                owner.epoch, owner.first = epoch, 0

        def on_train_batch_end(self, batch, logs=None):
            t0 = time.perf_counter()
            try:
                owner.after_step(batch, logs)
            finally:  # the appliance's own cost, not counted as the script's by Keras' slowness check
                keras_fit.own_time(time.perf_counter() - t0)

        def on_epoch_end(self, epoch, logs=None):
            owner.epoch_end(epoch, logs)

        def on_train_end(self, logs=None):
            if owner.mode == "fit":
                owner.end_fit()

    return ApplianceCheckpoint()


def callback(**kwargs):
    """Level 1: the appliance's Keras callback for a plain ``model.fit(..., callbacks=[..., callback()])``.
    Keyword arguments as ``Checkpointer`` (all optional: the spec's settings come through the environment)."""
    return Checkpointer(**kwargs).callback


_AUTO: dict = {}


def _note_made() -> None:
    """A Checkpointer is being made: by the script itself, unless `auto_callback` is making its own."""
    if not _AUTO.get("making"):
        _AUTO["script"] = True


def made_by_script() -> bool:
    """Whether the script made a Checkpointer of its own in this process (checkpoint.auto then steps aside)."""
    return bool(_AUTO.get("script"))


def auto_callback():
    """Level 2: the callback the rank's start-up shim adds to a plain ``Model.fit`` (one per process)."""
    import horovod.tensorflow as hvd_tf

    if not hvd_tf.is_initialized():
        hvd_tf.init()
    if "cb" not in _AUTO:
        _AUTO["making"] = True
        try:
            _AUTO["cb"] = Checkpointer(seed=None, batch_size=None).callback
        finally:
            _AUTO.pop("making", None)
    return _AUTO["cb"]
