"""Fetch a stage's objects into its directory, each verified before it takes its name: the stager's data path.

``fetch(job, todo)`` fetches ``todo`` (objects the stage decided to fetch) with ``job.concurrency`` threads, in
``processes(...)`` processes of the node: each process takes every k-th object (the largest first) and runs its share
of the threads, so the node's cores work on it side by side. A thread GETs an object (or, for a large one, ranges
of it in parallel) straight into a file under ``.appliance-staging/``; hashlib and zlib-ng check the bytes as they
pass (an MD5 cannot be split: a group fetched as several ranges is hashed from the page cache once they are in),
and a verified file is renamed to its name and its line appended to the journal, which a killed stage resumes from.
A process stops with its parent (a pipe only the parent holds open).

What is checked: a large object's CRC-32 when our upload wrote one (CRC_META), an SLO segment by segment against its
manifest, an S3 multipart object part by part against its ETag (store/parts.py), anything else against its ETag.
"""

from __future__ import annotations

import dataclasses
import hashlib
import itertools
import json
import multiprocessing
import multiprocessing.connection
import os
import queue
import random
import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor, wait
from dataclasses import dataclass, field
from pathlib import Path, PurePosixPath

from ..errors import ApplianceError, Unavailable
from ..store.objects import Crc32, ObjectInfo, Store, crc32_combine, crc_from, md5_range, segmented, slo_etag
from ..store.parts import guesses, layout, multipart_etag, part_count

LARGE = 64 * 1024**2  # objects above this are fetched as parallel ranged GETs
RANGE = 16 * 1024**2
MAX_RANGE = 2 * RANGE  # a part or segment up to this size is one GET
# ... and so is one up to this share of the large objects' bytes to fetch: with 8 or more of them, the parallel GETs
# come from the objects, and each object's MD5 is taken as its bytes come, with no read back of the page cache
WHOLE_SHARE = 8
MOST_PROCESSES = 16  # processes per node at most: a 48-core node's NIC (25 GbE) is full well before
PER_PROCESS = 64  # objects per process at least: fewer are not worth a process's start (a fork, ~10 ms)


class Corrupt(Exception):
    pass


class Recheck(Exception):
    """No rule gave a multipart object's part sizes: fetch it again, to tell a damaged transfer (the two differ)
    from bytes the store holds but cannot be checked against its ETag (the two agree)."""


@dataclass
class Job:
    """What every fetching thread of a stage shares."""
    store: Store
    dest: Path
    paths: dict[str, PurePosixPath]  # object name -> its path under dest
    staging: Path  # dest's .appliance-staging
    journal: Path  # one line per verified file
    concurrency: int = 16
    retries: int = 4
    one_get: int = MAX_RANGE  # a part, segment or object up to this many bytes is one GET


@dataclass
class Fetched:
    """What a fetch did: the verified files' manifest records, and the counts a StageResult reports."""
    recs: dict[str, list] = field(default_factory=dict)
    bytes: int = 0
    retries: int = 0
    corrupt_refetched: int = 0
    size_only: list[str] = field(default_factory=list)


def processes(n_objects: int, cores: int | None = None) -> int:
    """How many processes fetch ``n_objects``: one per core this process may run on, at most MOST_PROCESSES, and
    no more than one per PER_PROCESS objects. APPLIANCE_STAGE_PROCESSES sets it (the benchmark's A/B)."""
    told = os.environ.get("APPLIANCE_STAGE_PROCESSES")
    if told:
        return max(1, int(told))
    cores = cores or len(os.sched_getaffinity(0))
    return max(1, min(cores, MOST_PROCESSES, n_objects // PER_PROCESS))


def one_get_for(todo: list[ObjectInfo]) -> int:
    return max(MAX_RANGE, sum(o.size for o in todo if o.size >= LARGE) // WHOLE_SHARE)


def fetch(job: Job, todo: list[ObjectInfo], on_bytes: Callable[[int], None], on_placed: Callable[[str, list], None],
          *, procs: int = 1, keep_fds: tuple[int, ...] = ()) -> Fetched:
    """Fetch ``todo`` (the largest first) into ``job.dest``: in this process with ``procs`` 1, else in ``procs``
    forked ones (``keep_fds``: this process's descriptors a child must not keep, the stage's lock). ``on_bytes``
    hears of bytes as they come, ``on_placed(name, record)`` of each verified file. Raises the first failure (an
    ApplianceError with the fix) once every thread has stopped; what was placed before it stays placed."""
    todo = sorted(todo, key=lambda o: -o.size)
    if procs <= 1 or len(todo) < 2:
        return _Threads(job, on_bytes, on_placed).run(todo)
    return _in_processes(job, todo, on_bytes, on_placed, min(procs, len(todo)), keep_fds)


class _Left:
    """The objects a fetch has left to place, and the first error: what it waits for."""

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

    def wait(self) -> None:
        self.over.wait()
        if self.error is not None:
            raise self.error


class _Threads:
    """``job.concurrency`` threads taking objects from one queue, each fetching, checking and placing its object."""

    def __init__(self, job: Job, on_bytes: Callable[[int], None], on_placed: Callable[[str, list], None]):
        self.job, self.on_bytes, self.on_placed = job, on_bytes, on_placed
        self.got = Fetched()
        self.lock = threading.Lock()
        self.seen: dict[str, bytes] = {}  # multipart objects no part-size rule verified: their parts' MD5s

    def run(self, todo: list[ObjectInfo]) -> Fetched:
        left, work, stopping = _Left(len(todo)), queue.SimpleQueue(), threading.Event()
        journal = os.open(self.job.journal, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
        pool = ThreadPoolExecutor(max_workers=self.job.concurrency)  # ranged parts of large objects

        def worker() -> None:
            while (o := work.get()) is not None and not stopping.is_set():
                try:
                    self.one(o, pool, journal)
                except BaseException as e:
                    left.fail(e)
                else:
                    left.one_done()

        for o in todo:
            work.put(o)
        threads = [threading.Thread(target=worker, name=f"stage-{i}", daemon=True)
                   for i in range(min(self.job.concurrency, len(todo)))]
        try:
            for t in threads:
                t.start()
            left.wait()
        finally:
            stopping.set()  # after a failure, what is queued is not fetched
            for _ in threads:
                work.put(None)
            for t in threads:
                t.join()
            pool.shutdown(wait=True)
            os.close(journal)
        return self.got

    def place(self, o: ObjectInfo, part: Path, verified: bool, rechecked: bool, journal: int) -> None:
        """A fetched and checked object under its name, recorded (the journal line a killed stage resumes from)."""
        target = self.job.dest / self.job.paths[o.name]
        os.replace(part, target)
        rec = [o.size, o.etag, os.stat(target).st_mtime_ns]
        with self.lock:
            if not verified:
                self.got.size_only.append(o.name)
            elif rechecked:  # the first fetch did not verify and the second did: the first was damaged
                self.got.corrupt_refetched += 1
            self.got.recs[o.name] = rec
            self.got.bytes += o.size
            os.write(journal, (json.dumps([o.name, *rec]) + "\n").encode())
            self.on_placed(o.name, rec)

    def failed(self, o: ObjectInfo, part: Path, attempt: int, err: str, corrupt: bool) -> None:
        """A try that failed: counted, its download removed; the last one's error raised."""
        with self.lock:
            self.got.retries += 1
            self.got.corrupt_refetched += corrupt
        part.unlink(missing_ok=True)
        if attempt == self.job.retries:  # the store not answering (not bytes that came damaged): Unavailable
            raise (ApplianceError if corrupt else Unavailable)(
                f"could not fetch {o.name!r} after {self.job.retries + 1} tries ({err})",
                "check the object store; re-running stage resumes where it stopped")

    def one(self, o: ObjectInfo, pool: ThreadPoolExecutor, journal: int) -> None:
        """Fetch, check and place ``o``: a damaged or failed try again after a backoff, up to ``job.retries``."""
        # in the staging directory, under a name no object can have: `x` never writes over object `x.part`; and
        # this process's own: another stager on the same directory may unlink it, never truncate it under this one
        part = self.job.staging / f"{hashlib.sha256(o.name.encode()).hexdigest()}.{os.getpid()}.part"
        attempt, rechecked, pause = 0, False, False
        while True:
            if pause:
                time.sleep(min(8.0, 0.2 * 2 ** (attempt - 1)) * (0.5 + random.random()))  # backoff before a retry
            try:
                verified = _fetch_one(self.job.store, o, part, pool, self.on_bytes, self.seen, self.job.one_get)
                self.place(o, part, verified, rechecked, journal)
                return
            except Recheck:
                part.unlink(missing_ok=True)
                rechecked, pause = True, False  # not a failure: the second fetch decides, at once
                continue
            except Corrupt:
                self.failed(o, part, attempt, "checksum mismatch", True)
            except FileNotFoundError as e:
                if e.filename is not None:  # a local path (the store says a missing object with none)
                    raise ApplianceError(f"{e.filename} was removed while {o.name!r} was staged into it",
                                         f"let nothing else write into {self.job.dest} while stage runs, then "
                                         "re-run stage") from None
                raise ApplianceError(f"object {o.name!r} vanished from the store while staging",
                                     "re-run stage") from None
            except ApplianceError:
                raise
            except Exception as e:  # network errors, 5xx: retry with backoff
                self.failed(o, part, attempt, f"{type(e).__name__}: {e}", False)
            attempt, pause = attempt + 1, True


def _in_processes(job: Job, todo: list[ObjectInfo], on_bytes, on_placed, procs: int,
                  keep_fds: tuple[int, ...]) -> Fetched:
    """``todo`` over ``procs`` forked processes (every procs-th object each, so each gets large and small ones), the
    threads shared out among them. Each child says what it placed and how many bytes came over a pipe; the first
    failure stops the others (SIGTERM), and is raised once all have stopped."""
    ctx = multiprocessing.get_context("fork")
    alive_r, alive_w = os.pipe()  # a child's read end sees EOF when this process is gone, however it went
    threads = max(1, job.concurrency // procs)
    kids, conns = [], []
    try:
        for i in range(procs):
            mine, theirs = ctx.Pipe(duplex=False)
            p = ctx.Process(target=_child, args=(job, todo[i::procs], threads, theirs, alive_r, alive_w, keep_fds),
                            daemon=True)
            p.start()
            theirs.close()
            kids.append(p)
            conns.append(mine)
        return _gather(kids, conns, on_bytes, on_placed)
    finally:
        for p in kids:
            if p.is_alive():
                p.terminate()
            p.join()
        for c in conns:
            c.close()
        os.close(alive_r)
        os.close(alive_w)


def _gather(kids, conns, on_bytes, on_placed) -> Fetched:
    got, error, open_conns = Fetched(), None, list(conns)
    while open_conns:
        for c in multiprocessing.connection.wait(open_conns):
            try:
                kind, *msg = c.recv()
            except EOFError:
                open_conns.remove(c)
                kid = kids[conns.index(c)]
                kid.join()
                if kid.exitcode and error is None:
                    error = ApplianceError(f"a staging process stopped with exit code {kid.exitcode}",
                                           "re-run stage: it resumes where it stopped")
                continue
            if kind == "news":
                if msg[0]:
                    on_bytes(msg[0])
                for name, rec in msg[1]:
                    got.recs[name] = rec
                    on_placed(name, rec)
            elif kind == "done":
                f = msg[0]
                got.bytes += f.bytes
                got.retries += f.retries
                got.corrupt_refetched += f.corrupt_refetched
                got.size_only += f.size_only
            elif kind == "error" and error is None:
                error = ApplianceError(*msg)
                for p in kids:  # the first failure ends the stage: the other processes stop fetching
                    if p.is_alive():
                        p.terminate()
    if error is not None:
        raise error
    return got


def _child(job: Job, todo: list[ObjectInfo], threads: int, conn, alive_r: int, alive_w: int,
           keep_fds: tuple[int, ...]) -> None:
    os.close(alive_w)
    for fd in keep_fds:
        os.close(fd)  # the stage's lock stays with the parent alone: it goes when the parent goes
    job.store.forked()  # the parent's connections are the parent's (httpget's pools: os.register_at_fork)
    threading.Thread(target=lambda: (os.read(alive_r, 1), os._exit(1)), daemon=True).start()
    lock, news, last = threading.Lock(), {"bytes": 0, "placed": []}, [time.monotonic()]

    def flush(force: bool = False) -> None:
        """What came and what was placed, to the parent in one message at most every 0.1 s (a message per object
        cost the two processes more CPU than the object's own GET). Called with ``lock`` held."""
        now = time.monotonic()
        if force or now - last[0] >= 0.1:
            if news["bytes"] or news["placed"]:
                conn.send(("news", news["bytes"], news["placed"]))
            news["bytes"], news["placed"], last[0] = 0, [], now

    def on_bytes(n: int) -> None:
        with lock:
            news["bytes"] += n
            flush()

    def on_placed(name: str, rec: list) -> None:
        with lock:
            news["placed"].append((name, rec))
            flush()

    job = dataclasses.replace(job, concurrency=threads)
    try:
        got = _Threads(job, on_bytes, on_placed).run(todo)
        msg = ("done", Fetched(bytes=got.bytes, retries=got.retries, corrupt_refetched=got.corrupt_refetched,
                               size_only=got.size_only))
    except ApplianceError as e:
        msg = ("error", e.message, e.fix)
    except BaseException as e:  # noqa: BLE001 - said to the parent, in one line
        msg = ("error", f"{type(e).__name__}: {e}", "re-run stage: it resumes where it stopped")
    with lock:
        flush(force=True)  # what was placed before a failure too: it stays placed and recorded
        conn.send(msg)


def _fetch_one(store: Store, o: ObjectInfo, part: Path, pool: ThreadPoolExecutor, on_bytes: Callable[[int], None],
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
            if _fetch_crc(store, o, part, pool, on_bytes, one_get) != want:
                raise Corrupt(o.name)
            return True
    if n_parts is not None:
        return _fetch_multipart(store, o, part, pool, on_bytes, etag, n_parts, seen, one_get)
    if o.size >= LARGE:
        segments = store.slo_segments(o.name) if store.scheme == "swift" else None
        if segments:  # one ranged GET per segment, each checked against the segment's MD5
            hashes = _fetch_ranges(store, o, part, pool, on_bytes, [s["bytes"] for s in segments], one_get=one_get)
            if [h.hexdigest() for h in hashes] != [s["hash"] for s in segments] or slo_etag(segments) != etag:
                raise Corrupt(o.name)
            return True
        hashes = _fetch_ranges(store, o, part, pool, on_bytes, [o.size], hashed=segments is None, one_get=one_get)
        if segments is None and hashes[0].hexdigest() != etag:
            raise Corrupt(o.name)
        return segments is None
    check = _Check(etag)

    def sink(view: memoryview) -> None:
        check.update(view)
        on_bytes(len(view))

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


def _fetch_multipart(store: Store, o: ObjectInfo, part: Path, pool: ThreadPoolExecutor, on_bytes: Callable[[int], None], etag: str,
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
        _fetch_ranges(store, o, part, pool, on_bytes, [o.size], hashed=False)
        return False
    hashes = _fetch_ranges(store, o, part, pool, on_bytes, layouts[0], one_get=one_get)
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


def _get_pieces(store: Store, o: ObjectInfo, fd: int, pool: ThreadPoolExecutor, on_bytes: Callable[[int], None],
                pieces: list[tuple[int, int, Callable[[memoryview], None] | None]]) -> None:
    """GET each (offset, size, update) piece of ``o`` into ``fd`` in parallel: ``update`` sees its bytes as they
    are written. Returns once no piece writes to ``fd`` any more."""
    def one(off, size, update):
        def sink(view: memoryview) -> None:
            if update is not None:
                update(view)
            on_bytes(len(view))

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


def _fetch_ranges(store, o, part, pool, on_bytes, groups: list[int], *, hashed: bool = True,
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
        _get_pieces(store, o, fd, pool, on_bytes, [(a, k, _split(hashes, each, spans) if hashed else None)
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


def _fetch_crc(store: Store, o: ObjectInfo, part: Path, pool: ThreadPoolExecutor, on_bytes: Callable[[int], None],
               one_get: int = MAX_RANGE) -> int:
    """Fetch ``o`` into ``part`` (one GET up to ``one_get`` bytes, else RANGE-sized GETs in parallel) and return
    its CRC-32: each range's taken as it arrives, then combined (crc32_combine), so no range waits for the ones
    before it and no byte is read back."""
    pieces = _gets([o.size], one_get)[0][0]  # one GET, or RANGE-sized ones
    crcs = [Crc32() for _ in pieces]
    fd = os.open(part, os.O_RDWR | os.O_CREAT | os.O_TRUNC, 0o644)
    try:
        os.ftruncate(fd, o.size)
        _get_pieces(store, o, fd, pool, on_bytes, [(a, k, c.update) for (a, k), c in zip(pieces, crcs) if k > 0])
    finally:
        os.close(fd)
    crc = 0
    for c in crcs:
        crc = crc32_combine(crc, c.value, c.size)
    return crc
