"""Stream mode's GET of a shard on a node (``store_fetch``), and what a rank says when it waits on the store.

- **Retried**: a 5xx, a reset or a timeout is asked again with backoff for up to STORE_DEADLINE; a missing object
  is FileNotFoundError (the cache names the shard), a refusal is not asked again.
- **A deadline per GET** (``get_deadline``): GET_FLOOR_S plus the shard's size at GET_MIN_RATE. A GET whose answer
  has not all come by then (held back, or trickled a byte at a time, which the socket's own timeout never sees) is
  cut (store/httpget.py ``get_into``'s ``deadline``) and asked again like a reset.
- **Said by the rank it happens on** (``StoreWaits``), not only rank 0: a GET asked again, and a GET still going
  after SLOW_S (said within SLOW_S + CHECK_S), as ``[appliance] stream rank R: ...``; at most one line a
  SAY_EVERY_S per rank, the newest line held back said when the minute is over, with how many were held.
"""

from __future__ import annotations

import hashlib
import os
import threading
import time
from collections.abc import Callable
from contextlib import contextmanager
from pathlib import Path

STORE_DEADLINE = 600.0  # seconds one shard's fetch is retried through transient store errors before the job stops
GET_FLOOR_S = 60.0  # a GET's deadline: this, plus its bytes at GET_MIN_RATE
GET_MIN_RATE = 256 * 1024  # bytes/s: a 64 MB shard's GET is cut after 316 s (a Chameleon node reads ~40 MB/s a GET)
SLOW_S = 30.0  # a GET still going after this is said by its rank
CHECK_S = 10.0  # how often a rank looks at its GETs in flight
SAY_EVERY_S = 60.0  # a rank says at most one line about the store this often


def get_deadline(size: int | None) -> float:
    """Seconds a GET of ``size`` bytes (None: unknown, e.g. index.json) may take before it is cut and asked again."""
    return GET_FLOOR_S + (size or 0) / GET_MIN_RATE


def _fmt(n: float) -> str:
    for unit in ("B", "KB", "MB", "GB"):
        if n < 1000 or unit == "GB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1000
    return ""


class StoreWaits:
    """A rank's GETs in flight (``get``), looked at every CHECK_S on a thread of its own (``check``), and its lines
    about the store (``say``), each prefixed with the rank, at most one a SAY_EVERY_S."""

    def __init__(self, rank: int, say: Callable[[str], None], clock: Callable[[], float] = time.monotonic):
        self.rank, self._say, self.clock = rank, say, clock
        self._lock = threading.Lock()
        self._gets: dict[int, list] = {}  # id -> [name, size, started, bytes so far, said]
        self._last: float | None = None  # when a line was last said
        self._pending: str | None = None  # the newest line held back
        self._held = 0
        self._thread: threading.Thread | None = None

    def say(self, msg: str) -> None:
        with self._lock:
            now = self.clock()
            if self._last is not None and now - self._last < SAY_EVERY_S:
                self._pending, self._held = msg, self._held + 1
                return
            self._last = now
        self._say(f"[appliance] stream rank {self.rank}: {msg}")

    def _flush(self, now: float) -> None:
        with self._lock:
            if self._pending is None or (self._last is not None and now - self._last < SAY_EVERY_S):
                return
            msg, held, self._pending, self._held, self._last = self._pending, self._held, None, 0, now
        more = f" ({held - 1} other line(s) about the store held back in the last minute)" if held > 1 else ""
        self._say(f"[appliance] stream rank {self.rank}: {msg}{more}")

    @contextmanager
    def get(self, name: str, size: int | None):
        """Around one GET: yields the callback that counts its bytes as they come."""
        rec = [name, size, self.clock(), 0, False]
        with self._lock:
            self._gets[id(rec)] = rec
            if self._thread is None:
                self._thread = threading.Thread(target=self._watch, name="appliance-stream-waits", daemon=True)
                self._thread.start()

        def got(n: int) -> None:
            rec[3] += n

        try:
            yield got
        finally:
            with self._lock:
                self._gets.pop(id(rec), None)

    def check(self, now: float | None = None) -> None:
        """Say each GET that has been going for SLOW_S or more (once a GET), and a line held back."""
        now = self.clock() if now is None else now
        with self._lock:
            slow = [r for r in self._gets.values() if not r[4] and now - r[2] >= SLOW_S]
            for r in slow:
                r[4] = True
        for name, size, t0, got, _ in slow:
            self.say(f"waiting on the store: {name}: {_fmt(got)} of {_fmt(size) if size else '?'} in {now - t0:.0f} "
                     f"s; the GET is cut and asked again {get_deadline(size):.0f} s after it began")
        self._flush(now)

    def _watch(self) -> None:
        while True:
            time.sleep(CHECK_S)
            self.check()


def store_fetch(url: str, creds_path: str | None, say: Callable[[str], None], *, rank: int = 0,
                sizes: dict[str, int] | None = None) -> Callable[[str, Path], str]:
    """The store's GET of a shard under ``url`` (``sizes``: each shard's size from index.json, filled once it is
    read: the GET's deadline), retried through transient errors for up to STORE_DEADLINE; a missing object is
    FileNotFoundError. The credentials file is read again when the launcher replaced it. ``say`` hears this rank's
    lines about the store (``StoreWaits``); the fetch's ``waits`` is it."""
    from ..store.base import transient_retry
    from ..store.objects import open_store
    from .creds import CredsFile

    creds_file = CredsFile(creds_path or "")
    held: list = []
    waits = StoreWaits(rank, say)

    def store():
        if not held or creds_file.changed():
            held[:] = [open_store(url, creds_file.load())]
        return held[0]

    def fetch(name: str, dest: Path) -> str:
        size = (sizes or {}).get(name)

        def once() -> str:
            st, prefix = store()
            h = hashlib.md5(usedforsecurity=False)
            fd = os.open(dest, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
            try:  # straight into the file (Swift and S3: httpget.get_into), hashed as it arrives
                with waits.get(name, size) as got:
                    st.fetch((prefix.rstrip("/") + "/" if prefix else "") + name, fd, 0,
                             lambda view: (h.update(view), got(len(view))), deadline=get_deadline(size))
            finally:
                os.close(fd)
            return h.hexdigest()
        return transient_retry(once, deadline=STORE_DEADLINE, note=lambda m: waits.say(f"{name}: {m}"))

    fetch.waits = waits  # type: ignore[attr-defined]
    return fetch
