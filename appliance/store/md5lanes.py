"""MD5s of many files' byte ranges at once, as the bytes are written: what the stager checks other tools' objects by.

An MD5 cannot be split within one stream, so one core hashes one stream at ~0.6 GB/s (OpenSSL's, hashlib's). A
dataset's objects are independent streams, though, and ``_md5lanes`` (a C extension, appliance/store/_md5lanes.c)
runs 8 of them through the lanes of one AVX2 register: ~3.2-3.4 GB/s of MD5 on one core here against hashlib's 0.65
(``bench/md5_lanes.py``), and 16 through two registers whose steps interleave: 3.4-3.9 GB/s. Where it did not build
or the CPU has no AVX2, hashlib does the same work, a stream per thread.

``Hasher`` owns the hashing threads (one with lanes: it takes up to 16 streams' next 256 KiB each and hashes them in
one call, the GIL released). ``Hasher.streams(fd, groups)`` gives, for each group of consecutive (offset, size)
pieces of the open file ``fd``, the MD5 of the bytes they cover, hashed as they come, contiguous from the start.
Where the stager writes past the page cache (a dataset more than half the memory: stage.writes_past_the_page_cache),
bytes that come where a stream's bytes so far end are handed to it in the buffer they were received in
(``holds``/``hold``: httpget.get_into then writes them with O_DIRECT and goes on with another buffer); the rest
(every byte otherwise, and bytes that come ahead: parallel ranges of one object) are written to the file first and
said with ``wrote``, in any order, and read from the page cache (a read-only mmap, no copy).
``digest()`` waits for the last bytes, or ``then(fn)`` calls back once they are hashed (the stager's objects of a few
MB, whose fetching threads go on meanwhile). ``md5_ranges`` is the same for bytes already in a file (an upload's
parts), in the calling thread.

``Bodies`` is the same for small objects, whose bodies are whole in memory after their GET: a copy of each is queued
and hashed with up to 15 others in one call, in a thread of its own, while the thread that fetched it goes on to its
next object (100 KB: 41 microseconds of CPU each in a call of 8, 155 with hashlib: bench/results/stage-small-lanes).
"""

from __future__ import annotations

import hashlib
import mmap
import os
import struct
import threading
import time
from collections import Counter, deque
from collections.abc import Callable

try:
    from . import _md5lanes
except ImportError:  # not built here (no compiler when the package was installed): hashlib, a stream per thread
    _md5lanes = None

LANES = _md5lanes.LANES if _md5lanes is not None else 1
CHUNK = 256 * 1024  # the least of a stream a call waits for (md5_ranges: its read buffer, one per lane)
PER_CALL = 32 * CHUNK  # the most of a stream one call of the hasher takes
_IV = struct.pack("<4I", 0x67452301, 0xEFCDAB89, 0x98BADCFE, 0x10325476)  # RFC 1321, 3.3


def lanes_in_use() -> int:
    """How many streams one hashing call takes: 16 with ``_md5lanes`` on an AVX2 CPU, else 1 (hashlib)."""
    return LANES


def _padding(total: int) -> bytes:
    """MD5's padding after ``total`` bytes (RFC 1321, 3.1-3.2): 0x80, zeros to 56 mod 64, the bit length."""
    return b"\x80" + b"\0" * ((55 - total) % 64) + struct.pack("<Q", (total * 8) & (2**64 - 1))


class _State:
    """One stream's MD5 as the lanes keep it (16 bytes: A, B, C, D) or a hashlib object, fed whole blocks, then
    the tail with its padding."""

    def __init__(self, lanes: bool):
        self.raw = bytearray(_IV) if lanes else None
        self.h = None if lanes else hashlib.md5()

    def digest(self) -> bytes:
        return bytes(self.raw) if self.raw is not None else self.h.digest()


def _read(fd: int, view: memoryview, pos: int) -> None:
    got = 0
    while got < len(view):
        k = os.preadv(fd, [view[got:]], pos + got)
        if not k:
            raise OSError(f"the file ends at byte {pos + got}, before {pos + len(view)}")
        got += k


def _hash(batch: list[tuple[_State, memoryview | list[memoryview], int | None]]) -> None:
    """Hash each (state, bytes or a list of them in order, the stream's length if these are its last bytes)
    together: the lanes take whole blocks (every piece but a last one is whole blocks), then the last bytes of
    streams that end here with MD5's padding."""
    if batch and batch[0][0].raw is None:
        for st, views, _ in batch:
            for view in views if isinstance(views, list) else [views]:
                st.h.update(view)
        return
    jobs, tails = [], []
    for st, views, total in batch:
        views = list(views) if isinstance(views, list) else [views]
        if total is not None and views:
            view = views[-1]
            whole = len(view) // 64 * 64
            tails.append((st.raw, bytes(view[whole:]) + _padding(total)))
            views[-1] = view[:whole]
        elif total is not None:
            tails.append((st.raw, _padding(total)))
        jobs.append((st.raw, views))
    _md5lanes.update(jobs)
    if tails:
        _md5lanes.update(tails)


class Stream:
    """The MD5 of consecutive ``pieces`` of a file, fed by ``Hasher`` as ``wrote`` says they arrive, read from
    ``view``: the file's map (``Hasher.streams``)."""

    def __init__(self, hasher: Hasher, view: memoryview | None, pieces: list[tuple[int, int]]):
        self.hasher = hasher
        self.start = pieces[0][0] if pieces else 0
        self.end = self.start + sum(k for _, k in pieces)
        self.map = view
        self.pieces = pieces
        self.written = [0] * len(pieces)
        self.k = 0  # the first piece not yet complete
        self.frontier = self.start  # bytes start..frontier are in the file
        self._advance()
        self.hashed = self.start
        self.state = _State(hasher.lanes > 1)
        self.busy = False  # a hashing thread reads it now
        self.held: deque = deque()  # (position, bytes, Lease): bytes at the frontier still in a receive buffer
        self.using: tuple = ()  # the Leases a hashing thread reads now
        self.finished = False
        self.error: Exception | None = None
        self.done = threading.Event()
        self.then_fn: Callable[[Stream], None] | None = None

    def ready(self) -> bool:
        return not self.finished and (self.frontier - self.hashed >= CHUNK or self.frontier == self.end)

    def _advance(self) -> None:
        while self.k < len(self.pieces) and self.written[self.k] >= self.pieces[self.k][1]:
            self.k += 1
        self.frontier = (self.pieces[self.k][0] + self.written[self.k]) if self.k < len(self.pieces) else self.end

    def holds(self, j: int, n: int) -> bool:
        """Under the hasher's ``cv``: whether the ``n`` bytes that come next in piece ``j`` may be hashed from the
        buffer they came in (``hold``) rather than from the file: the piece is where the stream's written bytes
        end, and they leave the blocks whole (64 bytes from the stream's start, or its end)."""
        return (not self.finished and j == self.k and (self.frontier - self.start) % 64 == 0
                and (n % 64 == 0 or self.frontier + n == self.end))

    def hold(self, j: int, view: memoryview, lease) -> None:
        """Under the hasher's ``cv``, once ``holds`` said so: the next bytes of piece ``j`` are ``view``, in a
        receive buffer the stream holds a share of (``httpget.Lease``) until they are hashed; the file need not
        have them (httpget writes them past the page cache, O_DIRECT)."""
        lease.share()
        self.held.append((self.frontier, view, lease))
        was = self.ready()
        self.written[j] += len(view)
        self._advance()
        if not was and not self.busy and self.ready():
            self.hasher.cv.notify()

    def pieces_of(self, n: int) -> tuple[list[memoryview], tuple]:
        """Under the hasher's ``cv``: the next ``n`` bytes to hash, in order, as views of the receive buffers that
        hold them and of the file's map between them, and the buffers' Leases (what a hashing thread reads)."""
        views, leases, pos, end = [], [], self.hashed, self.hashed + n
        for at, buf, lease in self.held:
            if pos >= end:
                break
            if at > pos:  # written through the page cache before this buffer's bytes
                k = min(at, end) - pos
                views.append(self.map[pos:pos + k])
                pos += k
                if pos >= end:
                    break
            k = min(at + len(buf), end) - pos
            views.append(buf[pos - at:pos - at + k])
            leases.append(lease)
            pos += k
        if pos < end:
            views.append(self.map[pos:end])
        return views, tuple(leases)

    def wrote(self, j: int, n: int) -> None:
        """``n`` more bytes of piece ``j`` are in the file, contiguous from the piece's start."""
        with self.hasher.cv:
            self.written[j] += n
            if j != self.k:
                return
            was = self.ready()
            self._advance()
            if not was and not self.busy and self.ready():  # it became ready: the hasher may count it in
                self.hasher.cv.notify()

    def digest(self) -> bytes:
        """The MD5, once every byte is hashed (the writer has said so for every piece): waits for the hasher."""
        if self.frontier != self.end:
            raise ValueError(f"bytes {self.frontier}..{self.end} were not written")
        self.done.wait()
        if self.error is not None:
            raise self.error
        return self.state.digest()

    def hexdigest(self) -> str:
        return self.digest().hex()

    def result(self) -> Stream:
        """The stream, once hashed (``digest``, ``hexdigest``: hashlib's interface, as the stager's other checks
        use it); a caller that cancels the streams it gave up on waits for this first."""
        self.digest()
        return self

    def cancel(self) -> None:
        """The writer gave up (a failed GET): stop hashing it."""
        with self.hasher.cv:
            if not self.finished:
                self.error = self.error or OSError("cancelled")
                self.hasher._finish(self)
        self.hasher._run_due()

    def then(self, fn: Callable[[Stream], None]) -> None:
        """Once every byte is written (the writer has said so): ``fn(stream)`` once it is hashed (``error`` None,
        ``hexdigest()``) or has failed (``error`` set), in the hashing thread, or at once here if it is already;
        the writer goes on meanwhile (the stager's objects of a few MB: their verdict comes later, as a small
        object's from ``Bodies``). ``fn`` must not raise (what it raises is kept in the hasher's ``errors``)."""
        if self.frontier != self.end:
            raise ValueError(f"bytes {self.frontier}..{self.end} were not written")
        with self.hasher.cv:
            self.then_fn = fn
            if self.finished:
                self.hasher.due.append(self)
        self.hasher._run_due()


class Hasher:
    """The threads that hash every stream of one staging run: one with lanes, else one per core (up to 8).

    A call of the lanes costs as much for two streams as for eight (and for nine as for 16), so fewer than LANES
    ready streams are hashed only once the first of them has waited ``flush`` seconds, or when no other stream could
    become ready (none is unfinished, or the rest are being hashed). Hashing whatever was ready made 8 x 256 MiB
    multipart objects from Ceph RGW over https 2,928 calls, 1,153 of them one stream alone (302 MB at hashlib's
    speed) and 231 of eight; the writers keep on meanwhile (they only say how far they came), so the wait delays a
    verdict, not a GET. ``batches``: calls by how many streams each took (the tests, the benchmark)."""

    def __init__(self, threads: int | None = None, flush: float = 0.02):
        self.lanes = lanes_in_use()
        self.flush = flush
        self.cv = threading.Condition()
        self.live: list[Stream] = []
        self.closed = False
        self.batches: Counter[int] = Counter()
        self.due: list[Stream] = []  # finished streams whose ``then`` is to be called, once ``cv`` is let go
        self.errors: list[BaseException] = []  # what a ``then`` raised
        n = threads or (1 if self.lanes > 1 else min(8, os.cpu_count() or 1))
        self.threads = [threading.Thread(target=self._work, name=f"md5-{i}", daemon=True) for i in range(n)]
        for t in self.threads:
            t.start()

    def streams(self, fd: int, groups: list[list[tuple[int, int]]], *, direct: bool = False) -> list[Stream]:
        """A stream per group of consecutive (offset, size) pieces of the open file ``fd``, all read from one map of
        the file (mmap, read-only: the hasher reads the page cache where the writes put it, with no copy; a pread
        of 1 GiB cost 0.08-0.6 s of system time here, the mapping 0.005 s). One map per file, not per stream: a
        multipart object has up to 10,000 parts, and a process up to vm.max_map_count maps (65,530 by default).
        The file must have its size already (ftruncate; ValueError if it is shorter than the pieces) and must not
        shrink while mapped: the stager's own downloads, named for its process. The map outlives ``fd``."""
        end = max((a + k for pieces in groups for a, k in pieces), default=0)
        m = mmap.mmap(fd, end, access=mmap.ACCESS_READ) if end else None
        if direct and m is not None and hasattr(m, "madvise"):
            # ``direct``: other bytes of the file are written past the page cache (O_DIRECT, httpget); no read-ahead
            # past the page a read needs, so none of theirs is read into it from the disk before they land there
            m.madvise(mmap.MADV_RANDOM)
        view = memoryview(m) if m is not None else None
        made = [Stream(self, view, pieces) for pieces in groups]
        with self.cv:
            if self.closed:
                raise RuntimeError("the hasher is closed")
            self.live.extend(made)
            if any(s.ready() for s in made):
                self.cv.notify()
        return made

    def stream(self, fd: int, pieces: list[tuple[int, int]]) -> Stream:
        """One group's stream (``streams``)."""
        return self.streams(fd, [pieces])[0]

    def close(self) -> None:
        with self.cv:
            self.closed = True
            for s in list(self.live):
                s.error = s.error or OSError("the hasher was closed")
                self._finish(s)
            self.cv.notify_all()
        self._run_due()
        for t in self.threads:
            t.join()
        self._run_due()

    def __enter__(self) -> Hasher:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def _finish(self, s: Stream) -> None:
        """Under ``cv``: the stream is done (hashed, failed or cancelled). A thread that still hashes it holds its
        own reference to the map, which goes when the last one does."""
        s.finished = True
        if s in self.live:
            self.live.remove(s)
        s.map = None
        for _, _, lease in s.held:
            if not any(lease is u for u in s.using):  # those the hashing thread gives back
                lease.release()
        s.held.clear()
        s.done.set()
        if s.then_fn is not None:
            self.due.append(s)

    def _run_due(self) -> None:
        """Call the ``then`` of each stream finished so far, outside ``cv``, each once."""
        while True:
            with self.cv:
                if not self.due:
                    return
                s = self.due.pop(0)
                fn, s.then_fn = s.then_fn, None
            if fn is not None:
                try:
                    fn(s)
                except BaseException as e:  # not expected: kept, so that the thread goes on with the others
                    self.errors.append(e)

    def _next(self) -> list[Stream]:
        """Under ``cv``: the streams to hash in the next call, once a batch is worth it (the class's docstring);
        [] once closed."""
        since = None  # when fewer than a full batch were first found ready
        while True:
            ready = [s for s in self.live if not s.busy and s.ready()]
            if self.closed or len(ready) >= self.lanes:
                return ready
            if not ready:
                since = None
                self.cv.wait()
                continue
            coming = any(not s.busy and not s.ready() for s in self.live)  # unfinished: more bytes to come
            now = time.monotonic()
            since = now if since is None else since
            if not coming or now - since >= self.flush:
                return ready
            self.cv.wait(since + self.flush - now)

    def _work(self) -> None:
        while True:
            with self.cv:
                ready = self._next()
                if not ready:
                    return
                self.batches[min(len(ready), self.lanes)] += 1
                batch = ready[:self.lanes]  # the oldest streams first: they finish first
                # as much of each as the least of those still coming has (the lanes run whole together), at least
                # CHUNK (each has that), at most PER_CALL: a call takes back the GIL once for all of it
                going = [s.frontier - s.hashed for s in batch if s.frontier != s.end]
                most = min(PER_CALL, max(CHUNK, min(going))) if going else PER_CALL
                take = []
                for s in batch:
                    s.busy = True
                    n = min(most, s.frontier - s.hashed)
                    if s.hashed + n != s.end:
                        n = n // 64 * 64
                    views, s.using = s.pieces_of(n)
                    take.append((s, s.hashed, n, s.hashed + n == s.end, views))
            error = None
            try:
                _hash([(s.state, views, s.end - s.start if last else None) for s, _, _, last, views in take])
            except Exception as e:  # not expected: every stream of the batch fails with it rather than hangs
                error = e
            with self.cv:
                for s, pos, n, last, views in take:
                    for view in views:
                        view.release()
                    s.busy = False
                    s.hashed = pos + n
                    leases, s.using = s.using, ()
                    if s.finished:  # _finish left these to this thread
                        for lease in leases:
                            lease.release()
                        continue
                    while s.held and s.held[0][0] + len(s.held[0][1]) <= s.hashed:
                        s.held.popleft()[2].release()
                    if error is not None:
                        s.error = error
                    if last or error is not None:
                        self._finish(s)
                take = None
                self.cv.notify_all()
            self._run_due()


def md5_ranges(fd: int, ranges: list[tuple[int, int]], crcs: list | None = None) -> list[bytes]:
    """The MD5 of each (offset, size) range of the open file ``fd`` (an upload's parts), in this thread: 16 ranges
    at a time through the lanes, else one after another with hashlib. ``crcs``: an object per range whose
    ``update`` sees the same bytes (the parts' CRC-32s). Raises OSError if the file is shorter."""
    lanes = lanes_in_use()
    states = [_State(lanes > 1) for _ in ranges]
    bufs = [memoryview(bytearray(CHUNK)) for _ in range(min(lanes, len(ranges)) or 1)]
    for first in range(0, len(ranges), lanes):
        group = list(range(first, min(first + lanes, len(ranges))))
        pos = {i: ranges[i][0] for i in group}
        while group:
            batch, left = [], []
            for i, buf in zip(group, bufs):
                off, size = ranges[i]
                n = min(CHUNK, off + size - pos[i])
                last = off + size - pos[i] <= CHUNK
                _read(fd, buf[:n], pos[i])
                if crcs is not None:
                    crcs[i].update(buf[:n])
                batch.append((states[i], buf[:n], size if last else None))
                pos[i] += n
                if not last:
                    left.append(i)
            _hash(batch)
            group = left
    return [s.digest() for s in states]


class Body:
    """A buffer to copy one small object's body into (``Bodies.job``): ``buf``, of the object's size."""

    def __init__(self, store: bytearray, size: int):
        self.store = store
        self.buf = memoryview(store)[:size]


class Bodies:
    """The MD5s of small objects' bodies, many in one call of the lanes, in a thread of its own (``md5-bodies``).

    ``job(size)`` gives a buffer to copy a body into; ``submit(job, done)`` queues it and returns at once (it waits
    only while ``queued`` bodies wait already), and the hashing thread calls ``done(digest)`` once it is hashed; a
    job given up goes back with ``drop(job)``. A batch is hashed once LANES bodies wait, or once the oldest has waited
    ``flush`` seconds (a run's last objects, a slow trickle: a wait for the verdict, not for the fetches, which go
    on), or at ``close``, which hashes what is queued and calls each ``done`` before it returns. ``done`` runs in the
    hashing thread and must not raise (what it raises is kept in ``errors``, with anything else unexpected). Only
    worth it with the lanes: where they are not, hashlib in the fetching thread costs the same with no copy."""

    def __init__(self, flush: float = 0.02, queued: int = 32):
        self.flush, self.queued = flush, queued
        self.lock = threading.Lock()
        self.ready = threading.Condition(self.lock)  # the hashing thread waits for a batch
        self.room = threading.Condition(self.lock)  # a submitter waits for the queue to shrink
        self.waiting: list[tuple[Body, Callable[[bytes], None], float]] = []
        self.free: dict[int, list[bytearray]] = {}  # buffers given back, by their size's power of 2
        self.closed = False
        self.batches: Counter[int] = Counter()  # calls by how many bodies each hashed (the tests, the benchmark)
        self.errors: list[BaseException] = []
        self.thread = threading.Thread(target=self._work, name="md5-bodies", daemon=True)
        self.thread.start()

    def job(self, size: int) -> Body:
        """A buffer for a body of ``size`` bytes: one given back before, of the same power-of-2 class (from 64 KiB),
        or a new one. As many are made of a class as bodies of it are in hand at once, at most: the fetching
        threads', the queued and the batch."""
        cls = max(16, (size - 1).bit_length())
        with self.lock:
            free = self.free.get(cls)
            store = free.pop() if free else None
        return Body(store if store is not None else bytearray(1 << cls), size)

    def drop(self, job: Body) -> None:
        job.buf.release()
        with self.lock:
            self.free.setdefault(len(job.store).bit_length() - 1, []).append(job.store)

    def submit(self, job: Body, done: Callable[[bytes], None]) -> None:
        with self.lock:
            while len(self.waiting) >= self.queued and not self.closed:
                self.room.wait()
            if self.closed:
                raise RuntimeError("the hashing of bodies is closed")
            self.waiting.append((job, done, time.monotonic()))
            if len(self.waiting) in (1, LANES):  # the first starts the flush clock, the LANES-th fills a batch
                self.ready.notify()

    def close(self) -> None:
        with self.lock:
            self.closed = True
            self.ready.notify()
            self.room.notify_all()
        self.thread.join()

    def __enter__(self) -> Bodies:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def _next(self) -> list[tuple[Body, Callable[[bytes], None], float]]:
        with self.lock:
            while True:
                if len(self.waiting) >= LANES or (self.waiting and self.closed):
                    break
                if not self.waiting:
                    if self.closed:
                        return []
                    self.ready.wait()
                    continue
                left = self.waiting[0][2] + self.flush - time.monotonic()
                if left <= 0:
                    break
                self.ready.wait(left)
            batch, self.waiting = self.waiting[:LANES], self.waiting[LANES:]
            self.room.notify_all()
            return batch

    def _work(self) -> None:
        while batch := self._next():
            digests = None
            if len(batch) > 1 and LANES > 1:  # the lanes take as long for 1 body as for 8: hashlib is faster alone
                states = [_State(True) for _ in batch]
                try:
                    _hash([(st, job.buf, len(job.buf)) for st, (job, _, _) in zip(states, batch)])
                    digests = [st.digest() for st in states]
                except Exception as e:  # not expected: hashlib gives the same digests
                    self.errors.append(e)
            if digests is None:
                digests = [hashlib.md5(job.buf).digest() for job, _, _ in batch]
            self.batches[len(batch)] += 1
            for (job, done, _), digest in zip(batch, digests):
                self.drop(job)
                try:
                    done(digest)
                except BaseException as e:  # not expected: kept, so that the thread goes on with the others
                    self.errors.append(e)
