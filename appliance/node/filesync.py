"""Level 3 of docs/checkpoints.md on the head node: rank 0's working directory, synced to the store.

The job's working directory is ``$APPLIANCE_CHECKPOINT_DIR`` (the run's code directory on every node), so a script's
relative paths (``./checkpoint-{epoch}.h5``, ``./logs/``) land in it. In rank 0 (``HOROVOD_RANK=0``) the start-up
shim starts a ``Syncer``, which:

- at start, on a resume (``APPLIANCE_FILES_RESTORE=1``), restores the newest synced manifest into the directory
  **before the script runs** (its "resume from the newest file" logic then finds them);
- every ``APPLIANCE_FILES_EVERY_SECONDS`` (default 60), as soon as the STOP file appears (the lease end is near), and
  when the process exits, commits the directory's **complete** files: a file is taken once its size and mtime were
  the same at two scans (at the exit: one second apart), and only if it did not change while it was hashed.
  The code the launcher copied there (``$APPLIANCE_CODE_FILES``), ``__pycache__`` and dot-files of the appliance
  are not synced. Each commit prints ``APPLIANCE_FILES {...}``.

One syncer per run directory (a lock file), so a script's worker processes, which inherit the environment, start none.
"""

from __future__ import annotations

import atexit
import fcntl
import json
import os
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path

from .. import report
from ..protocol import EXIT_STOPPED, Env, Line, emit
from ..store.filesync import FileSet
from ..store.objects import md5_file
from ..store.runlock import fence
from .creds import CredsFile

SKIP_DIRS = {"__pycache__", ".git", ".ipynb_checkpoints"}
RESTORE_FAILED = 3  # rank 0's exit status when the synced files could not be read back (the job then fails)


def note(msg: str) -> None:
    """A `[checkpoint]` line in the job's output (the file syncer's and the Checkpointer's)."""
    print(f"[checkpoint] {msg}", flush=True)


class Syncer:
    poll_s = 1.0  # how often the STOP file and the interval are looked at
    quiet_s = 1.0  # a final sync takes a file unchanged over this long as complete

    def __init__(self, root: Path, fs: FileSet, *, every_s: float, stop_file: Path | None, exclude: set[str],
                 keep: int = 2):
        self.root, self.fs, self.every_s, self.stop_file, self.exclude, self.keep = \
            root, fs, every_s, stop_file, exclude, keep
        report.default(note)  # the object store's notes (retries, pruning) in the job's output
        self.seen: dict[str, tuple[int, int]] = {}  # rel -> (size, mtime_ns) at the last scan
        self.hashes: dict[tuple[str, int, int], str] = {}
        self.pushed: dict[str, str] | None = None  # rel -> md5 of the last commit
        self.seq = 0
        self.lock = threading.Lock()
        self.done = threading.Event()

    def scan(self) -> dict[str, tuple[int, int]]:
        out = {}
        for dirpath, dirnames, filenames in os.walk(self.root):
            dirnames[:] = [d for d in dirnames if d not in SKIP_DIRS and not d.startswith(".appliance")]
            for n in filenames:
                p = Path(dirpath) / n
                rel = p.relative_to(self.root).as_posix()
                if n.startswith(".appliance") or rel in self.exclude or p.is_symlink():
                    continue
                try:
                    st = p.stat()
                except OSError:
                    continue
                out[rel] = (st.st_size, st.st_mtime_ns)
        return out

    def sync(self, final: bool = False, why: str = "") -> dict | None:
        """One commit of the complete files (None when nothing changed since the last one). ``final``: no later
        scan will come (``why``: "stop" when the STOP file appeared, "exit" when the process ends)."""
        with self.lock:
            now = self.scan()
            if final:  # no later scan will come: a moment of quiet (quiet_s) makes a file complete
                time.sleep(self.quiet_s)
                again = self.scan()
                stable = {r: v for r, v in again.items() if now.get(r) == v}
            else:
                stable = {r: v for r, v in now.items() if self.seen.get(r) == v}
            self.seen = now
            files = {}
            for rel, (size, mtime) in stable.items():
                key = (rel, size, mtime)
                if key not in self.hashes:
                    try:
                        md5 = md5_file(self.root / rel)
                        st = (self.root / rel).stat()
                    except OSError:
                        continue
                    if (st.st_size, st.st_mtime_ns) != (size, mtime):
                        continue  # written to while hashed: the next sync takes it
                    self.hashes[key] = md5
                files[rel] = {"md5": self.hashes[key], "size": size}
            # a file seen before but changing now keeps its last committed version in the manifest
            for rel, f in (self._last_files or {}).items():
                if rel not in files and rel in now:
                    files[rel] = f
            if self.pushed is not None and {r: f["md5"] for r, f in files.items()} == self.pushed:
                return None
            if not files and self.pushed is None:
                return None
            if self.reopen is not None:
                self.fs = self.reopen(self.fs)  # a store made again when the job's credentials were renewed
            if self.seq == 0:  # after the newest manifest of the run, whatever state it is in
                self.seq = max(self.fs.manifests() or [0])
            self.seq += 1
            t0 = time.monotonic()
            try:
                body = self.fs.push(self.root, files, self.seq, until=time.time() + 300)
            except Exception as e:  # never let the syncer kill training
                note(f"synced files NOT committed: {type(e).__name__}: {e}")
                self.failed = True
                return None
            self.pushed = {r: f["md5"] for r, f in files.items()}
            self._last_files = files
            emit(Line.FILES, {"seq": self.seq, "files": len(files), "bytes": sum(f["size"] for f in files.values()),
                              "seconds": round(time.monotonic() - t0, 3), "final": why})
            try:
                self.fs.prune(self.keep)
            except Exception as e:  # noqa: BLE001
                note(f"pruning synced files failed ({type(e).__name__}); retried after the next commit")
            return body

    _last_files: dict | None = None
    failed = False  # the last commit failed
    reopen: Callable[[FileSet], FileSet] | None = None  # the FileSet to use now (node/creds.py)

    def _end_asked(self) -> str | None:
        """The stop request's reason when it asks for the job's end once its files are committed: a job that
        nothing else stops (level 3 only) whose user pressed Ctrl-C or sent SIGTERM to `appliance train`
        (checkpoint/job.py)."""
        try:
            req = json.loads(self.stop_file.read_text())
        except (OSError, ValueError, AttributeError):
            return None
        return str(req.get("reason") or "asked") if isinstance(req, dict) and req.get("end") == "after-sync" else None

    def _end_job(self, reason: str) -> None:
        """Rank 0 reports the stop (Line.STOPPED, no step: the files are the job's own) and ends with EXIT_STOPPED;
        horovodrun then stops the other ranks, and the launcher reports exit 75 (resumable), not a failure.
        Before, the first Ctrl-C of such a job synced its files and left it running; only a second Ctrl-C stopped
        it, as a kill."""
        emit(Line.STOPPED, {"step": None, "committed": True, "reason": reason, "files": self.seq,
                            "checkpoint": f"files/manifest-{self.seq}", "seconds": 0})
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(EXIT_STOPPED)

    def restore(self) -> None:
        """The newest synced manifest's files into the directory. A store that does not answer raises (the job must
        not start without them: its syncs would number after them and its prunes delete them)."""
        body = self.fs.newest_good()
        if body is None:
            found = self.fs.manifests()
            if found:
                note(f"no synced manifest of the {len(found)} in the store verifies: the job starts without them")
            return
        self.seq = int(body["seq"])
        got = self.fs.pull(body, self.root, skip=lambda rel: rel in self.exclude)
        self.pushed = {r: f["md5"] for r, f in body["files"].items()}
        self._last_files = {r: {"md5": f["md5"], "size": f["size"]} for r, f in body["files"].items()}
        note(f"restored {len(got)} synced file(s) of manifest {body['seq']} into {self.root}")

    def run(self) -> None:
        next_at = time.monotonic() + self.every_s
        stopped = False
        while not self.done.wait(self.poll_s):
            if not stopped and self.stop_file is not None and self.stop_file.exists():
                stopped = True  # the lease end is near, or the user asked: commit now
                self.failed = False
                self.attempt(final=True, why="stop")
                reason = None if self.failed else self._end_asked()
                if reason is not None:
                    self._end_job(reason)
                next_at = time.monotonic() + self.every_s
            elif time.monotonic() >= next_at:
                self.attempt()
                next_at = time.monotonic() + self.every_s

    def attempt(self, final: bool = False, why: str = "") -> dict | None:
        """`sync`, in the syncer's thread: whatever fails (the store, or Keystone for its token, not answering for
        longer than a read waits: an outage of the site's control plane) is said and tried again at the next scan;
        the thread goes on, so files written after an outage are synced too."""
        try:
            return self.sync(final=final, why=why)
        except Exception as e:  # noqa: BLE001 - never let the syncer die, nor kill training
            note(f"synced files NOT committed ({type(e).__name__}: {e}); tried again in {self.every_s:.0f}s")
            self.failed = True
            return None


def start_in_rank0() -> Syncer | None:
    """From the ranks' start-up shim: rank 0 of a job with checkpoint.url syncs its working directory."""
    env = os.environ
    root, url = env.get(Env.CHECKPOINT_DIR), env.get(Env.CKPT_URL)
    if env.get("HOROVOD_RANK") != "0" or not root or not url or env.get(Env.FILES_SYNC, "1") == "0":
        return None
    run_dir = Path(env.get(Env.RUN_DIR) or root)
    try:
        fh = open(run_dir / ".appliance-files.lock", "a")
        fcntl.flock(fh, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError:
        return None  # another process of this job syncs already (a worker process inherited the environment)
    creds_file = CredsFile()
    exclude = set()
    if env.get(Env.CODE_FILES) and os.path.exists(env[Env.CODE_FILES]):
        exclude = set(json.loads(Path(env[Env.CODE_FILES]).read_text()))
    def open_fs() -> FileSet:
        fs = FileSet(url, env.get(Env.RUN, "run"), creds_file.load())
        fence(fs.cs, env.get(Env.JOB_ID))  # a job that lost the run's lock commits and prunes no synced files
        return fs

    s = Syncer(Path(root), open_fs(),
               every_s=float(env.get(Env.FILES_EVERY_SECONDS) or 60), exclude=exclude,
               stop_file=Path(env[Env.STOP_FILE]) if env.get(Env.STOP_FILE) else None,
               keep=int(env.get(Env.CKPT_KEEP) or 2))
    s._lock_fh = fh
    s.reopen = lambda fs: open_fs() if creds_file.changed() else fs
    if env.get(Env.FILES_RESTORE) == "1":
        try:
            s.restore()
        except Exception as e:  # noqa: BLE001 - the job stops before the script runs: it would overwrite them
            note(f"synced files NOT restored: {type(e).__name__}: {e}; the job stops here so that nothing of the "
                 f"run's synced files is written over (fix: `appliance resume {env.get(Env.RUN, 'RUN')}` once the "
                 "object store answers)")
            sys.stdout.flush()
            os._exit(RESTORE_FAILED)
    threading.Thread(target=s.run, name="appliance-filesync", daemon=True).start()

    def at_exit():
        s.done.set()
        s.sync(final=True, why="exit")

    atexit.register(at_exit)
    return s
