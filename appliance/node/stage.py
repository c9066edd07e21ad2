"""Stage a dataset from an object store to a local directory: fast, verified, resumable.

``stage(store, prefix, dest, ...)`` runs on one node:
1. list the objects (paged through any number), keep this node's shard (``mode='shard'``: the
   sorted names, every ``nodes``-th one from ``rank``; union over ranks = the dataset, no overlap);
2. refuse names that would escape ``dest`` (``..``, absolute paths, NUL) before writing anything;
3. skip what the manifest (``dest/.appliance-manifest.json``: name -> size, ETag, the file's mtime when
   staged) says is already here and unchanged, in the store and on disk (a file rewritten in place, even at
   the same size, has another mtime and is fetched again); check free space for the rest *before* starting
   (fail with the numbers);
4. download in parallel: one GET per small object, parallel ranged GETs for large ones; an SLO is
   fetched segment by segment and each segment checked against its MD5; an S3 multipart object part by part,
   the parts' MD5s checked against its ETag (store/parts.py); everything else is checked against its ETag
   (MD5), our uploads' objects by their CRC-32 (CRC_META); in threads over a few processes (node/fetch.py). A file
   appears under its name only once verified (downloaded into ``.appliance-staging/`` in the destination, then
   renamed);
5. retry with backoff; record each verified file in the manifest, so a killed run resumes.
One staging run at a time per directory (a lock on it): a second is refused before it changes anything.
"""

from __future__ import annotations

import fcntl
import json
import os
import shutil
import stat
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path, PurePosixPath

from ..errors import ApplianceError
from ..store.objects import ObjectInfo, Store
from . import fetch

MANIFEST = ".appliance-manifest.json"
JOURNAL = ".appliance-manifest.journal"  # one line per verified file, so a killed run loses nothing
STAGING = ".appliance-staging"  # downloads in progress, on the same file system; no object can be staged there
PREFIX = ".appliance-manifest.prefix"  # the prefix the manifest's names were staged from (their paths follow it)
RESERVED = {MANIFEST, JOURNAL, STAGING, PREFIX, f".{MANIFEST}.tmp", f".{PREFIX}.tmp"}
DISK_MARGIN = 256 * 1024**2  # leave this much free


@dataclass
class StageResult:
    files_total: int = 0
    files_fetched: int = 0
    files_skipped: int = 0
    bytes_total: int = 0
    bytes_fetched: int = 0
    retries: int = 0
    corrupt_refetched: int = 0
    files_removed: int = 0  # staged before, no longer in the store (or this node's shard): removed
    size_only: list[str] = field(default_factory=list)  # SLOs the store shows no segments of: checked by size only
    seconds: float = 0.0
    dest: str = ""
    names: list[str] = field(default_factory=list)  # this node's names (kept only when asked)

    def as_dict(self) -> dict:
        d = dict(self.__dict__)
        d["mb_per_s"] = round(self.bytes_fetched / 1e6 / self.seconds, 1) if self.seconds else 0.0
        d["files_per_s"] = round(self.files_fetched / self.seconds, 1) if self.seconds else 0.0
        return d


def safe_relpath(name: str, prefix: str = "") -> PurePosixPath:
    """The path an object is written to, relative to dest; raises ValueError on a name that would escape it, that
    names a path two ways (an empty or '.' part), that takes the stager's own files, or a part over 255 bytes."""
    rel = name[len(prefix):] if prefix and name.startswith(prefix) else name
    rel = rel.lstrip("/") if prefix else rel
    parts = rel.split("/")
    if not rel or "\x00" in rel or name.startswith("/") or rel.endswith("/") \
            or any(part in ("", ".", "..") for part in parts) or parts[0] in RESERVED \
            or any(len(part.encode()) > 255 for part in parts):
        raise ValueError(name)
    return PurePosixPath(rel)


def is_dir_marker(o: ObjectInfo, prefix: str = "") -> bool:
    """A zero-byte object named like ``folder/``: what Horizon's "Create Folder" and many tools make. It is a
    directory, as `swift download` and rclone treat it."""
    return o.name.endswith("/") and o.size == 0 and len(o.name) > len(prefix)


def plan_paths(objects: list[ObjectInfo], prefix: str) -> tuple[dict[str, PurePosixPath], list[PurePosixPath],
                                                                list[str]]:
    """(object -> path, directories to make, refused names). Refused: names safe_relpath refuses, and every name of
    a group that maps to one path or to a path that is also a directory (decided before anything is written)."""
    paths: dict[str, PurePosixPath] = {}
    dirs: list[PurePosixPath] = []
    bad: list[str] = []
    for o in objects:
        try:
            if is_dir_marker(o, prefix):
                dirs.append(safe_relpath(o.name.rstrip("/"), prefix))
            else:
                paths[o.name] = safe_relpath(o.name, prefix)
        except ValueError:
            bad.append(o.name)
    owners: dict[PurePosixPath, list[str]] = {}
    for name, p in paths.items():
        owners.setdefault(p, []).append(name)
    parents = {q for p in paths.values() for q in p.parents} | set(dirs)
    for p, names in owners.items():
        if len(names) > 1 or p in parents:
            bad.extend(names)
            for n in names:
                paths.pop(n, None)
    return paths, dirs, sorted(set(bad))


def select(objects: list[ObjectInfo], *, mode: str, rank: int, nodes: int) -> list[ObjectInfo]:
    objects = sorted(objects, key=lambda o: o.name)
    if mode == "shard":
        return objects[rank::nodes]
    return objects


def load_manifest(dest: Path) -> dict[str, list]:
    try:
        m = json.loads((dest / MANIFEST).read_text())
    except (OSError, ValueError):
        m = {}
    try:
        with open(dest / JOURNAL) as fh:
            for line in fh:
                try:
                    name, *rec = json.loads(line)  # [name, size, etag, mtime_ns] ([name, size, etag] before)
                except ValueError:
                    continue  # a line cut by a kill
                m[name] = rec
    except OSError:
        pass
    return m


def _forget_others(dest: Path, prefix: str, paths: dict[str, PurePosixPath], keep_extra: bool) -> tuple[dict, int]:
    """The manifest of what ``dest`` holds from this prefix, and how many files went: those of objects no longer in
    this stage (deleted from the store, or now another node's shard). A name is a path only relative to the prefix
    it was staged from (PREFIX): a dest last staged from another prefix has that stage's files removed (unless
    ``keep_extra``) and starts anew; one staged before PREFIX was kept forgets names outside this prefix rather than
    guessing their paths (they resolved to unrelated files under dest, which were unlinked: issue 49)."""
    manifest = load_manifest(dest)
    try:
        was = (dest / PREFIX).read_text()
    except OSError:
        was = None
    removed = 0
    same = was in (None, prefix)
    for name in [n for n in manifest if n not in paths or not same]:
        if keep_extra and same:  # kept on the node, and in the manifest: a later stage may still remove it
            continue
        if keep_extra or (was is None and not name.startswith(prefix)):
            del manifest[name]
            continue
        try:
            old = dest / safe_relpath(name, prefix if was is None else was)
            if old.is_file() and (same or PurePosixPath(old.relative_to(dest)) not in paths.values()):
                old.unlink()
                removed += 1
        except ValueError:
            pass
        del manifest[name]
    if was != prefix and (was is not None or removed or manifest):  # a fresh dest gets its files with the stage
        _save_manifest(dest, manifest, prefix)  # what is left of the old names, then the prefix they belong to
    return manifest, removed


def _unchanged(target: Path, rec: list) -> bool:
    """The staged file is as the stager left it: its size, and its mtime when the manifest has one (a file the
    job rewrote in place at the same size, e.g. an array normalised and saved over itself, was kept as staged)."""
    try:
        st = target.stat()
    except OSError:
        return False
    return stat.S_ISREG(st.st_mode) and st.st_size == rec[0] and (len(rec) < 3 or st.st_mtime_ns == rec[2])


def _save_manifest(dest: Path, m: dict, prefix: str | None = None) -> None:
    """The manifest, whole (the journal's lines folded in), and with ``prefix`` the prefix its names belong to."""
    tmp = dest / f".{MANIFEST}.tmp"
    tmp.write_text(json.dumps(m, separators=(",", ":")))
    tmp.replace(dest / MANIFEST)
    (dest / JOURNAL).unlink(missing_ok=True)
    if prefix is not None:
        tmp = dest / f".{PREFIX}.tmp"
        tmp.write_text(prefix)
        tmp.replace(dest / PREFIX)


def free_bytes(path: Path) -> int:
    st = os.statvfs(path)
    return st.f_bavail * st.f_frsize


def _fmt_bytes(n: float) -> str:
    for unit in ("B", "KB", "MB", "GB", "TB"):
        if abs(n) < 1000 or unit == "TB":
            return f"{n:.1f} {unit}" if unit != "B" else f"{int(n)} B"
        n /= 1000
    return f"{n:.1f} TB"


class _Progress:
    def __init__(self, total_files: int, total_bytes: int, cb: Callable[[dict], None] | None, every: float = 0.5):
        self.files = self.bytes = 0
        self.total_files, self.total_bytes = total_files, total_bytes
        self.cb, self.every = cb, every
        self.t0 = time.monotonic()
        self.last = 0.0
        self.lock = threading.Lock()

    def add(self, nbytes: int = 0, files: int = 0, force: bool = False) -> None:
        with self.lock:
            self.bytes += nbytes
            self.files += files
            now = time.monotonic()
            if self.cb and (force or now - self.last >= self.every):
                self.last = now
                el = max(now - self.t0, 1e-6)
                rate = self.bytes / el
                left = self.total_bytes - self.bytes
                self.cb({"files": self.files, "files_total": self.total_files, "bytes": self.bytes,
                         "bytes_total": self.total_bytes, "rate": rate,
                         "eta": left / rate if rate > 0 else None, "elapsed": el})


def _named(store: Store, prefix: str) -> tuple[list[ObjectInfo], str]:
    """The objects a URL names, and the prefix their paths are taken relative to. A URL names a folder: `data` is
    `data/`, never `data-old/...` beside it (staged as `-old/...` before), as rclone and `aws s3 sync` read a
    path; a name that is one object and no folder is that object alone, staged under its own name (it was left
    out before). The folder's own marker object (`data/`) is dest itself."""
    objs = list(store.list(prefix))
    if prefix and not prefix.endswith("/"):
        under = [o for o in objs if o.name.startswith(prefix + "/")]
        if under:
            prefix += "/"
            return [o for o in under if o.name != prefix], prefix
        return [o for o in objs if o.name == prefix], prefix[:prefix.rfind("/") + 1]
    return [o for o in objs if o.name != prefix], prefix


def dataset_objects(store: Store, prefix: str, consequence: str) -> tuple[list[ObjectInfo], str]:
    """The objects a dataset URL names (_named), or one line with the fix when it names none: the container or
    bucket is not there, or nothing is under the URL (a typo). ``consequence`` ends the line. `appliance check
    --online` asks the same before a lease is paid for."""
    try:
        listing, named_prefix = _named(store, prefix)
    except FileNotFoundError:
        raise ApplianceError(f"{store.url(prefix)}: there is no {store.holder} {store.where!r}; {consequence}",
                             "check the dataset URL; `appliance data upload DIR URL` makes it") from None
    if not listing:
        # a URL with a typo lists nothing: said, rather than staged as an empty dataset, and the node's earlier
        # copy (its manifest) is left as it is rather than removed as "no longer in the store"
        raise ApplianceError(f"{store.url(prefix)}: no object under it; {consequence}",
                             f"check the dataset URL (`appliance data ls {store.url()}` lists what is there)")
    return listing, named_prefix


def stage(store: Store, prefix: str, dest: str | Path, *, mode: str = "full", rank: int = 0, nodes: int = 1,
          concurrency: int = 16, retries: int = 4, progress: Callable[[dict], None] | None = None,
          keep_names: bool = False, keep_extra: bool = False, processes: int | None = None) -> StageResult:
    """Stage what ``prefix`` names into ``dest`` (the module's docstring says how). ``concurrency``: GETs at once
    on this node; ``processes``: how many processes share them (None: fetch.processes decides, by the cores)."""
    t0 = time.monotonic()
    dest = Path(dest)
    dest.mkdir(parents=True, exist_ok=True)
    lock = _only_stager(dest)
    try:
        return _stage(store, prefix, dest, t0, mode=mode, rank=rank, nodes=nodes, concurrency=concurrency,
                      retries=retries, progress=progress, keep_names=keep_names, keep_extra=keep_extra,
                      processes=processes, keep_fds=() if lock is None else (lock,))
    finally:
        if lock is not None:
            os.close(lock)  # and with it the lock


def _only_stager(dest: Path) -> int | None:
    """Lock ``dest`` for this staging run (flock on the directory, gone with the process): a second stager on the
    same directory would clear this one's downloads (``.appliance-staging/``) and leave it failing with a wrong
    reason. None where the file system has no flock for a directory (some network ones): not locked."""
    fd = os.open(dest, os.O_RDONLY | os.O_DIRECTORY)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        return fd
    except BlockingIOError:
        os.close(fd)
        raise ApplianceError(f"another staging run is writing into {dest}; nothing was changed",
                             "wait for it to finish (re-running then fetches only what it has not), or stage into "
                             "another directory") from None
    except OSError:
        os.close(fd)
        return None


def _make_dirs(dest: Path, dirs) -> None:
    """``dirs`` (paths under ``dest``) and the directories above them, each parent before its children."""
    for d in sorted({q for p in dirs for q in (p, *p.parents) if q != PurePosixPath(".")}):
        try:
            (dest / d).mkdir(parents=True, exist_ok=True)
        except OSError as e:  # a file where the directory goes (exist_ok takes only a directory), a read-only disk
            raise ApplianceError(f"cannot make the directory {dest / d} to stage into: {e.strerror or e}",
                                 f"move what is at {e.filename or dest / d} out of the way, or stage into another "
                                 "directory") from None


def _stage(store: Store, prefix: str, dest: Path, t0: float, *, mode: str, rank: int, nodes: int,
           concurrency: int, retries: int, progress: Callable[[dict], None] | None, keep_names: bool,
           keep_extra: bool, processes: int | None, keep_fds: tuple[int, ...]) -> StageResult:
    listing, prefix = dataset_objects(store, prefix, "nothing was staged")
    markers = [o for o in listing if is_dir_marker(o, prefix)]
    mine = select([o for o in listing if not is_dir_marker(o, prefix)], mode=mode, rank=rank, nodes=nodes)
    paths, dirs, bad = plan_paths(mine + markers, prefix)
    if bad:
        shown = ", ".join(repr(b) for b in bad[:3]) + (f" and {len(bad) - 3} more" if len(bad) > 3 else "")
        raise ApplianceError(f"refusing {len(bad)} object name(s) that would escape {dest}, collide with another "
                             f"object's path or with the stager's own files: {shown}; nothing was written",
                             "rename those objects in the store (no '..', '.', '//', leading '/', or parts over "
                             "255 bytes; no two names for one path)")
    _make_dirs(dest, dirs)  # the store's directory markers
    manifest, removed = _forget_others(dest, prefix, paths, keep_extra)
    todo, skipped = [], 0
    for o in mine:
        rec = manifest.get(o.name)
        target = dest / paths[o.name]
        if rec and rec[:2] == [o.size, o.etag] and _unchanged(target, rec):
            skipped += 1
        else:
            todo.append(o)
    need = sum(o.size for o in todo)
    free = free_bytes(dest)
    if need > free - DISK_MARGIN:
        raise ApplianceError(f"not enough disk on {dest}: the dataset needs {_fmt_bytes(need)} more, "
                             f"{_fmt_bytes(free)} free (keeping {_fmt_bytes(DISK_MARGIN)} spare)",
                             "stage a shard per node (dataset.mode: shard), pack small files, or use the node's "
                             "NVMe disk")
    res = StageResult(files_total=len(mine), files_skipped=skipped, bytes_total=sum(o.size for o in mine),
                      dest=str(dest))
    if keep_names:
        res.names = [o.name for o in mine]
    staging = dest / STAGING
    shutil.rmtree(staging, ignore_errors=True)  # leftovers of a killed run
    staging.mkdir()
    prog = _Progress(len(todo), need, progress)
    job = fetch.Job(store, dest, paths, staging, dest / JOURNAL, concurrency=concurrency, retries=retries,
                    one_get=fetch.one_get_for(todo))
    _make_dirs(dest, {paths[o.name].parent for o in todo})  # each directory the files go into, made once here
    procs = fetch.processes(len(todo)) if processes is None else processes

    def placed(name: str, rec: list) -> None:
        manifest[name] = rec
        prog.add(files=1)

    try:
        got = fetch.fetch(job, todo, lambda n: prog.add(n), placed, procs=procs, keep_fds=keep_fds)
    finally:
        _save_manifest(dest, manifest, prefix)  # what was placed, even when the stage failed
        shutil.rmtree(staging, ignore_errors=True)
    res.files_fetched, res.bytes_fetched = len(got.recs), got.bytes
    res.retries, res.corrupt_refetched, res.size_only = got.retries, got.corrupt_refetched, sorted(got.size_only)
    res.files_removed = removed
    prog.add(force=True)
    res.seconds = time.monotonic() - t0
    return res
