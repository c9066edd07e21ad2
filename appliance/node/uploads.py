"""Rank 0's commits (node/checkpointer.py): each local checkpoint uploaded by a thread of its own and committed by
its manifest (store/checkpoints.py), the newest one waiting superseding the one before it; the store reopened when
the job's credentials file is renewed; old checkpoints pruned in the store and on the node's disk. A mixin of
``Checkpointer``, whose state it shares (``_cv``, ``_pending``, ``_uploading``, ``_last_commit``, ...)."""

from __future__ import annotations

import json
import os
import shutil
import signal
import threading
import time
from pathlib import Path

from ..protocol import Env, Line, emit
from ..store.checkpoints import CheckpointStore, StoreUnavailable, ckpt_key
from ..store.runlock import fence

STOP_COMMIT_FLOOR = 30.0  # seconds a stop's checkpoint gets to commit, whatever its deadline says


class Uploads:
    def _ensure_uploader(self) -> None:
        if self._uploader is None:
            self._uploader = threading.Thread(target=self._upload_loop, name="appliance-upload", daemon=True)
            self._uploader.start()

    def _open_store(self) -> CheckpointStore:
        """The store, made again when the job's credentials file was replaced (renewed at a lease extension)."""
        if self._store is None or self._creds_file.changed():
            self._store = fence(CheckpointStore(self.url, self.run, self._creds_file.load()),
                                os.environ.get(Env.JOB_ID))
        return self._store

    def _warm_store(self) -> None:
        """The uploader's first act: authenticate and reach the store (CheckpointStore.connect), so that the first
        commit, often the stop's own, does not pay for the token and the store's first check of it (0.28 s of a
        1-s commit against the local RGW; on Chameleon a Keystone token is a round trip to another site's API).
        What fails here is said by the first upload, with its retries."""
        try:
            self._open_store().connect()
        except Exception:  # noqa: BLE001 - only a head start; the upload owns the errors
            pass

    def _upload_loop(self) -> None:
        self._warm_store()
        while True:
            with self._cv:
                while self._pending is None:
                    self._cv.wait()
                local, self._pending = self._pending, None
                self._uploading = local
            try:
                self._upload(local)
            except Exception as e:  # noqa: BLE001 - the uploader never dies: the next checkpoint is tried
                self._upload_error = f"{type(e).__name__}: {e}"
                self._log(f"checkpoint {local.name} NOT committed: {self._upload_error}")
            finally:
                with self._cv:
                    self._uploading = None
                    self._cv.notify_all()

    def _upload(self, local: Path) -> None:
        t0 = time.monotonic()
        try:
            meta = json.loads((local / "meta.json").read_text())
            self._open_store()
            fault = None
            if self._fault == f"kill-during-upload:{meta['step']}":
                def fault(i):  # test hook: a real SIGKILL of rank 0 with half a checkpoint uploaded
                    if i == 0:
                        os.kill(os.getpid(), signal.SIGKILL)
            newer = lambda: self._pending is not None  # noqa: E731  (a newer checkpoint supersedes this one)
            manifest = self._store.upload(local, meta, until=self._deadline, stop=newer, fault=fault)
        except StoreUnavailable as e:
            self._upload_error = str(e)
            self._log(f"checkpoint {local.name} NOT committed: {e}")
            return
        except Exception as e:  # never let the uploader kill training
            self._upload_error = f"{type(e).__name__}: {e}"
            self._log(f"checkpoint {local.name} NOT committed: {self._upload_error}")
            return
        upload_s = time.monotonic() - t0
        self._commit_s.append(getattr(self, "_save_s", 0.0) + upload_s)
        with self._cv:
            self._last_commit, self._last_commit_local = manifest, local.name
        self._upload_error = None
        size = sum(f["size"] for f in manifest["files"].values())
        emit(Line.CKPT, {"step": meta["step"], "name": manifest["name"], "bytes": size, "committed": True,
                            "save_s": round(getattr(self, "_save_s", 0.0), 3), "upload_s": round(upload_s, 3)})
        try:
            self._store.prune(self.keep)
        except Exception as e:
            self._log(f"pruning old checkpoints failed ({type(e).__name__}); will retry after the next commit")
        self._prune_local()

    def _prune_local(self) -> None:
        """Local checkpoints: keep the one uploading, the one waiting, and the newest committed; without a
        store, only the newest. Superseded uncommitted ones go, so a long store outage cannot fill the disk."""
        with self._cv:  # what to keep and what there is, seen at one moment (_publish)
            keep = {p.name for p in (self._pending, self._uploading) if p is not None}
            if self._last_commit_local:
                keep.add(self._last_commit_local)
            local = sorted((p for p in self.local_dir.glob("ckpt-*") if ckpt_key(p.name)),
                           key=lambda p: ckpt_key(p.name))
        if not self.url and local:
            keep = {local[-1].name}
        for p in local:
            if p.name not in keep:
                shutil.rmtree(p, ignore_errors=True)

    def _wait_uploads(self, until: float | None) -> bool:
        """Rank 0: wait until nothing is queued or uploading; False on timeout."""
        with self._cv:
            while self._pending is not None or self._uploading is not None:
                left = None if until is None else until - time.time()
                if left is not None and left <= 0:
                    return False
                self._cv.wait(timeout=left)
        return True

    def _wait_stop_commit(self) -> bool:
        """Rank 0 at a stop: wait for the stop's checkpoint to commit, until the stop's deadline but at least
        STOP_COMMIT_FLOOR seconds. A deadline already past (a lease end read late, or from a stale vendordata
        cache) gave the upload no time at all, and the job said "NOT committed" for a checkpoint that committed
        half a second later (make bench-ckpt, 2026-11-24): the store may well still be there, so it gets the try."""
        return self._wait_uploads(max(self._deadline or 0.0, time.time() + STOP_COMMIT_FLOOR))
