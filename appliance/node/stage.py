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
   (MD5), our uploads' objects by their CRC-32 (CRC_META). Each GET's bytes are hashed (hashlib, zlib-ng) as they
   are written, in the GET's thread; a group split into parallel ranges is hashed from the page cache once they
   are in. A file appears under its name only once verified (downloaded into ``.appliance-staging/`` in the
   destination, then renamed);
5. retry with backoff; record each verified file in the manifest, so a killed run resumes.
One staging run at a time per directory (a lock on it): a second is refused before it changes anything.
"""

from __future__ import annotations

import fcntl
import hashlib
import itertools
import json
import os
import queue
import random
import shutil
import stat
import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor, wait
from dataclasses import dataclass, field
from pathlib import Path, PurePosixPath

from ..errors import ApplianceError
from ..store.objects import Crc32, ObjectInfo, Store, crc32_combine, crc_from, md5_range, segmented, slo_etag
from ..store.parts import guesses, layout, multipart_etag, part_count

MANIFEST = ".appliance-manifest.json"
JOURNAL = ".appliance-manifest.journal"  # one line per verified file, so a killed run loses nothing
STAGING = ".appliance-staging"  # downloads in progress, on the same file system; no object can be staged there
PREFIX = ".appliance-manifest.prefix"  # the prefix the manifest's names were staged from (their paths follow it)
RESERVED = {MANIFEST, JOURNAL, STAGING, PREFIX, f".{MANIFEST}.tmp", f".{PREFIX}.tmp"}
LARGE = 64 * 1024**2  # objects above this are fetched as parallel ranged GETs
RANGE = 16 * 1024**2
MAX_RANGE = 2 * RANGE  # a part or segment up to this size is one GET
# ... and so is one up to this share of the large objects' bytes to fetch: with 8 or more of them, the parallel GETs
# come from the objects, and each object's MD5 is taken as its bytes come, with no read back of the page cache
WHOLE_SHARE = 8
DISK_MARGIN = 256 * 1024**2  # leave this much free


class Corrupt(Exception):
    pass


class Recheck(Exception):
    """No rule gave a multipart object's part sizes: fetch it again, to tell a damaged transfer (the two differ)
    from bytes the store holds but cannot be checked against its ETag (the two agree)."""


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


class _Left:
    """The objects a stage has left to place, and the first error: what the stage waits for."""

    def __init__(self, n: int):
        self.n = n
        self.error: BaseException | None = None
        self.lock = threading.Lock()
        self.over = threading.Event()
        if not n:
            self.over.set()

    def one_done(self) -> None:
        with self.lock:
            self.n -= 1
            if not self.n:
                self.over.set()

    def fail(self, e: BaseException) -> None:
        with self.lock:
            self.error = self.error or e
        self.over.set()

    def run(self, fn: Callable, *args) -> None:
        """``fn(*args)`` in a pool's thread: what it raises ends the stage."""
        try:
            fn(*args)
        except BaseException as e:
            self.fail(e)

    def wait(self) -> None:
        self.over.wait()
        if self.error is not None:
            raise self.error


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
          keep_names: bool = False, keep_extra: bool = False) -> StageResult:
    t0 = time.monotonic()
    dest = Path(dest)
    dest.mkdir(parents=True, exist_ok=True)
    lock = _only_stager(dest)
    try:
        return _stage(store, prefix, dest, t0, mode=mode, rank=rank, nodes=nodes, concurrency=concurrency,
                      retries=retries, progress=progress, keep_names=keep_names, keep_extra=keep_extra)
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
           keep_extra: bool) -> StageResult:
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
    one_get = max(MAX_RANGE, sum(o.size for o in todo if o.size >= LARGE) // WHOLE_SHARE)
    mlock = threading.Lock()
    journal = os.open(dest / JOURNAL, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
    left = _Left(len(todo))
    big_pool = ThreadPoolExecutor(max_workers=concurrency)  # ranged parts of large objects
    seen: dict[str, bytes] = {}  # multipart objects no part-size rule verified: their parts' MD5s, per fetch
    _make_dirs(dest, {paths[o.name].parent for o in todo})  # each directory the files go into, made once here

    def place(o: ObjectInfo, part: Path, verified: bool, rechecked: bool) -> None:
        """A fetched and checked object under its name, recorded (the journal line a killed run resumes from)."""
        target = dest / paths[o.name]
        os.replace(part, target)
        rec = [o.size, o.etag, os.stat(target).st_mtime_ns]
        with mlock:
            if not verified:
                res.size_only.append(o.name)
            elif rechecked:  # the first fetch did not verify and the second did: the first was damaged
                res.corrupt_refetched += 1
            res.files_fetched += 1
            res.bytes_fetched += o.size
            manifest[o.name] = rec
            os.write(journal, (json.dumps([o.name, *rec]) + "\n").encode())
        prog.add(files=1)
        left.one_done()

    def failed(o: ObjectInfo, part: Path, attempt: int, err: str, corrupt: bool) -> None:
        """A try that failed: counted, its download removed; the last one's error raised."""
        with mlock:
            res.retries += 1
            res.corrupt_refetched += corrupt
        part.unlink(missing_ok=True)
        if attempt == retries:
            raise ApplianceError(f"could not fetch {o.name!r} after {retries + 1} tries ({err})",
                                 "check the object store; re-running stage resumes where it stopped")

    def fetch(o: ObjectInfo) -> None:
        # in the staging directory, under a name no object can have: `x` never writes over object `x.part`; and
        # this process's own: another stager on the same directory may unlink it, never truncate it under this one
        part = staging / f"{hashlib.sha256(o.name.encode()).hexdigest()}.{os.getpid()}.part"
        attempt, rechecked, pause = 0, False, False
        while True:
            if pause:
                time.sleep(min(8.0, 0.2 * 2 ** (attempt - 1)) * (0.5 + random.random()))  # backoff before a retry
            try:
                place(o, part, _fetch_one(store, o, part, big_pool, prog, seen, one_get), rechecked)
                return
            except Recheck:
                part.unlink(missing_ok=True)
                rechecked = True  # not a failure: the second fetch decides, at once
                pause = False
                continue
            except Corrupt:
                failed(o, part, attempt, "checksum mismatch", True)
            except FileNotFoundError as e:
                if e.filename is not None:  # a local path (the store says a missing object with none)
                    raise ApplianceError(f"{e.filename} was removed while {o.name!r} was staged into it",
                                         f"let nothing else write into {dest} while stage runs, then re-run "
                                         "stage") from None
                raise ApplianceError(f"object {o.name!r} vanished from the store while staging", "re-run stage") from None
            except ApplianceError:
                raise
            except Exception as e:  # network errors, 5xx: retry with backoff
                failed(o, part, attempt, f"{type(e).__name__}: {e}", False)
            attempt += 1
            pause = True

    # the fetching threads take objects from one queue, the largest first
    work: queue.SimpleQueue = queue.SimpleQueue()
    stopping = threading.Event()

    def worker() -> None:
        while (o := work.get()) is not None and not stopping.is_set():
            left.run(fetch, o)

    for o in sorted(todo, key=lambda o: -o.size):
        work.put(o)
    threads = [threading.Thread(target=worker, name=f"stage-{i}", daemon=True)
               for i in range(min(concurrency, len(todo)))]
    try:
        for t in threads:
            t.start()
        left.wait()
    finally:
        stopping.set()  # after a failure, what is queued is not fetched
        for _ in threads:
            work.put(None)
        for t in threads:
            if t.is_alive():
                t.join()
        big_pool.shutdown(wait=True)
        with mlock:
            os.close(journal)
            _save_manifest(dest, manifest, prefix)
        shutil.rmtree(staging, ignore_errors=True)
    res.files_removed = removed
    prog.add(force=True)
    res.seconds = time.monotonic() - t0
    return res


def _fetch_one(store: Store, o: ObjectInfo, part: Path, pool: ThreadPoolExecutor, prog: _Progress,
               seen: dict[str, bytes] | None, one_get: int) -> bool:
    """Fetch ``o`` into ``part`` and verify it; raise Corrupt when it does not verify. Returns False when its
    content could be checked only by size: an SLO whose segments the store does not show (Ceph RGW gives no
    manifest, and its segments are not where uploads put them), or an S3 multipart object whose part sizes neither
    the store nor any known upload tool's rule gives. ``one_get``: a part, segment or object up to this many bytes
    is one GET (_fetch_ranges)."""
    etag = o.etag.strip('"')
    n_parts = part_count(etag)
    if o.size >= LARGE or n_parts is not None:
        want = store.crc32(o.name, etag)  # a HEAD: our uploads' CRC-32 for these bytes, if it holds (CRC_META)
        if want is not None:
            if _fetch_crc(store, o, part, pool, prog, one_get) != want:
                raise Corrupt(o.name)
            return True
    if n_parts is not None:
        return _fetch_multipart(store, o, part, pool, prog, etag, n_parts, seen, one_get)
    if o.size >= LARGE:
        segments = store.slo_segments(o.name) if store.scheme == "swift" else None
        if segments:  # one ranged GET per segment, each checked against the segment's MD5
            hashes = _fetch_ranges(store, o, part, pool, prog, [s["bytes"] for s in segments], one_get=one_get)
            if [h.hexdigest() for h in hashes] != [s["hash"] for s in segments] or slo_etag(segments) != etag:
                raise Corrupt(o.name)
            return True
        hashes = _fetch_ranges(store, o, part, pool, prog, [o.size], hashed=segments is None, one_get=one_get)
        if segments is None and hashes[0].hexdigest() != etag:
            raise Corrupt(o.name)
        return segments is None
    check = _Check(etag)

    def sink(view: memoryview) -> None:
        check.update(view)
        prog.add(len(view))

    fd = os.open(part, os.O_RDWR | os.O_CREAT | os.O_TRUNC, 0o644)
    try:
        n, headers = store.fetch(o.name, fd, 0, sink, on_headers=check.headers)
    finally:
        os.close(fd)
    if n != o.size:
        raise Corrupt(o.name)
    if check.crc is not None:
        if check.crc.value != check.want:
            raise Corrupt(o.name)
        return True
    h = check.md5 or hashlib.md5()
    if segmented(headers):
        segments = store.slo_segments(o.name) or []
        if not segments:
            return False
        if sum(seg["bytes"] for seg in segments) != o.size or slo_etag(segments) != etag:
            raise Corrupt(o.name)
        got = _md5_layout(part, [seg["bytes"] for seg in segments])
        if [d.hex() for d in got] != [seg["hash"] for seg in segments]:
            raise Corrupt(o.name)
    elif h.hexdigest() != etag:
        raise Corrupt(o.name)
    return True


def _fetch_multipart(store: Store, o: ObjectInfo, part: Path, pool: ThreadPoolExecutor, prog: _Progress, etag: str,
                     n: int, seen: dict[str, bytes] | None, one_get: int) -> bool:
    """An S3 multipart object (ETag ``<md5>-N``): fetched part by part, each part hashed as it is written, the
    parts' MD5s checked against the ETag (store/parts.py). The part sizes: the store's (``partNumber``), else the
    first of the upload tools' rules; when that does not give the ETag, the file is hashed again (page cache) for
    the other rules. None gives it: with the store's own part sizes the bytes are wrong (Corrupt, fetched again);
    without them, it is fetched a second time (Recheck): parts that hash differently mean a damaged transfer
    (Corrupt), the same hashes twice mean the store's bytes in a layout no rule knows, checked by size only (False;
    the summary names it)."""
    told = store.part_sizes(o.name, n)
    layouts = ([told] if told else []) + [layout(o.size, p) for p in guesses(o.size, n)]
    layouts = [x for i, x in enumerate(layouts) if sum(x) == o.size and x not in layouts[:i]]
    if not layouts:  # no rule gives N parts of this size: nothing to check the bytes against
        _fetch_ranges(store, o, part, pool, prog, [o.size], hashed=False)
        return False
    hashes = _fetch_ranges(store, o, part, pool, prog, layouts[0], one_get=one_get)
    if multipart_etag(h.digest() for h in hashes) == etag:
        return True
    if told is not None:  # the store answers partNumber: ask it for every part, should they differ in size
        every = store.part_sizes(o.name, n, every=True)
        if every and every not in layouts:
            layouts.append(every)
    for sizes in layouts[1:]:
        if multipart_etag(_md5_layout(part, sizes)) == etag:
            return True
    if told is not None:
        raise Corrupt(o.name)
    if seen is None:
        return False
    mine = b"".join(h.digest() for h in hashes)
    before, seen[o.name] = seen.get(o.name), mine
    if before == mine:
        return False
    raise Recheck(o.name) if before is None else Corrupt(o.name)


def _md5_layout(part: Path, sizes: list[int]) -> list[bytes]:
    """The MD5 of each of the consecutive ``sizes`` of the file ``part`` (read back: the page cache). Corrupt if the
    file is shorter."""
    fd = os.open(part, os.O_RDONLY)
    try:
        return [md5_range(fd, a, k).digest() for a, k in zip(itertools.accumulate(sizes[:-1], initial=0), sizes)]
    except OSError:
        raise Corrupt(part.name) from None
    finally:
        os.close(fd)


class _Check:
    """How one GET's bytes are checked: by the CRC-32 in the answer's CRC_META when it holds for this ETag (what our
    uploads write; 5x an MD5's speed), else by their MD5. Decided by the headers, before the first byte."""

    def __init__(self, etag: str):
        self.etag = etag
        self.want: int | None = None
        self.crc: Crc32 | None = None
        self.md5 = None

    def headers(self, h: dict) -> None:
        if self.crc is None and self.md5 is None:
            self.want = crc_from(h, self.etag)
            self.crc = Crc32() if self.want is not None else None

    def update(self, view: memoryview) -> None:
        if self.crc is not None:
            self.crc.update(view)
            return
        if self.md5 is None:
            self.md5 = hashlib.md5()
        self.md5.update(view)


def _get_pieces(store: Store, o: ObjectInfo, fd: int, pool: ThreadPoolExecutor, prog: _Progress,
                pieces: list[tuple[int, int, Callable[[memoryview], None] | None]]) -> None:
    """GET each (offset, size, update) piece of ``o`` into ``fd`` in parallel: ``update`` sees its bytes as they
    are written. Returns once no piece writes to ``fd`` any more."""
    def one(off, size, update):
        def sink(view: memoryview) -> None:
            if update is not None:
                update(view)
            prog.add(len(view))

        n, _ = store.fetch(o.name, fd, off, sink, start=off, end=off + size - 1)
        if n != size:
            raise Corrupt(o.name)

    futs = [pool.submit(one, *piece) for piece in pieces]
    try:
        for f in futs:
            f.result()
    finally:
        for f in futs:  # the fd stays open until no range writes to it any more
            f.cancel()
        wait(futs)


def _fetch_ranges(store, o, part, pool, prog, groups: list[int], *, hashed: bool = True,
                  one_get: int = MAX_RANGE) -> list:
    """Fetch ``o`` into ``part`` as parallel ranged GETs and return the MD5 (hashlib) of each group: consecutive
    byte counts that add up to the object (SLO segments, multipart parts, or the whole object); Nones when not
    ``hashed``. A group larger than ``one_get`` bytes (MAX_RANGE or more) is RANGE-sized GETs, hashed from the page
    cache once they are in (an MD5 cannot be split), the groups in parallel; consecutive smaller ones share a GET of
    up to ``one_get`` bytes and are hashed as its bytes pass (_gets, _split)."""
    each, gets = _gets(groups, one_get)
    hashes = [hashlib.md5() for _ in groups] if hashed else [None] * len(groups)
    fd = os.open(part, os.O_RDWR | os.O_CREAT | os.O_TRUNC, 0o644)
    try:
        os.ftruncate(fd, o.size)
        _get_pieces(store, o, fd, pool, prog, [(a, k, _split(hashes, each, spans) if hashed else None)
                                               for a, k, spans in gets])
        later = [g for g, pieces in enumerate(each) if hashed and len(pieces) > 1]
        offsets = [pieces[0][0] for pieces in each]
        list(pool.map(lambda g: md5_range(fd, offsets[g], groups[g], hashes[g]), later))
    finally:
        os.close(fd)
    return hashes


def _gets(groups: list[int], one_get: int) -> tuple[list[list[tuple[int, int]]], list[tuple[int, int, list]]]:
    """(each group's (offset, size) pieces, the GETs: (offset, size, [(group, piece, bytes), ...] in the order the
    GET's bytes come)). A group above ``one_get`` is RANGE-sized pieces, a GET each; consecutive groups up to
    ``one_get`` are one piece each, as many in one GET as fit in ``one_get`` bytes: 8 objects of 256 MiB uploaded in
    8 MiB parts were 256 GETs of a part each, and are 8 (one each when ``one_get`` is the object's size)."""
    each, gets, off, open_get = [], [], 0, False  # open_get: the last GET takes more small groups
    for g, size in enumerate(groups):
        if size > one_get:
            pieces = [(a, min(RANGE, off + size - a)) for a in range(off, off + size, RANGE)]
            gets += [(a, k, [(g, j, k)]) for j, (a, k) in enumerate(pieces)]
            open_get = False
        else:
            pieces = [(off, size)]
            if size:
                if open_get and gets[-1][1] + size <= one_get:
                    a, k, spans = gets[-1]
                    gets[-1] = (a, k + size, spans + [(g, 0, size)])
                else:
                    gets.append((off, size, [(g, 0, size)]))
                    open_get = True
        each.append(pieces)
        off += size
    return each, gets


def _split(hashes: list, each: list[list[tuple[int, int]]],
           spans: list[tuple[int, int, int]]) -> Callable[[memoryview], None]:
    """What one GET calls with each piece it wrote: the bytes told, in order, to the MD5s of the groups the GET
    covers whole (``spans``: (group, piece, bytes)); a group in several pieces is hashed once they are all in
    (_fetch_ranges). Bytes past the last span are the GET's error, said by its length check."""
    at = [0, spans[0][2]]  # the span now, its bytes not yet told

    def sink(view: memoryview) -> None:
        o, k = 0, len(view)
        while k and at[0] < len(spans):
            g = spans[at[0]][0]
            n = min(k, at[1])
            if n and len(each[g]) == 1:
                hashes[g].update(view[o:o + n])
            o, k, at[1] = o + n, k - n, at[1] - n
            if not at[1]:
                at[0] += 1
                if at[0] < len(spans):
                    at[1] = spans[at[0]][2]
    return sink


def _fetch_crc(store: Store, o: ObjectInfo, part: Path, pool: ThreadPoolExecutor, prog: _Progress,
               one_get: int = MAX_RANGE) -> int:
    """Fetch ``o`` into ``part`` (one GET up to ``one_get`` bytes, else RANGE-sized GETs in parallel) and return
    its CRC-32: each range's taken as it arrives, then combined (crc32_combine), so no range waits for the ones
    before it and no byte is read back."""
    pieces = _gets([o.size], one_get)[0][0]  # one GET, or RANGE-sized ones
    crcs = [Crc32() for _ in pieces]
    fd = os.open(part, os.O_RDWR | os.O_CREAT | os.O_TRUNC, 0o644)
    try:
        os.ftruncate(fd, o.size)
        _get_pieces(store, o, fd, pool, prog, [(a, k, c.update) for (a, k), c in zip(pieces, crcs) if k > 0])
    finally:
        os.close(fd)
    crc = 0
    for c in crcs:
        crc = crc32_combine(crc, c.value, c.size)
    return crc
