"""The local cloud's clock: its own time (the HTTP ``Date`` header, lease dates), faster than real time for tests
and demos, shared by the local cloud's sites."""

from __future__ import annotations

import json
import os
import threading
import time
from pathlib import Path


class Clock:
    """The cloud's clock, ``scale`` times faster than real time, moved ahead at once by ``advance``. ``shared``: a
    file that holds it for every site of one local cloud (the sites' clocks agree, as Chameleon's sites keep UTC):
    a site that advances it moves all of them."""

    def __init__(self, scale: float = 1.0, shared: Path | None = None):
        self.scale = scale
        self.real0 = time.time()
        self.virt0 = self.real0
        self.offset = 0.0
        self.lock = threading.Lock()
        self.shared, self._seen = shared, None
        if shared is not None:
            if shared.exists():
                self._sync()
            else:
                self._save()

    def _sync(self) -> None:
        """The shared clock, when another site moved it (called with ``lock`` held)."""
        try:
            seen = self.shared.stat().st_mtime_ns
            if seen != self._seen:
                d = json.loads(self.shared.read_text())
                self.scale, self.real0, self.virt0, self.offset = d["scale"], d["real0"], d["virt0"], d["offset"]
                self._seen = seen
        except (OSError, ValueError, KeyError):
            pass  # being replaced this moment: the last one read holds

    def _save(self) -> None:
        if self.shared is None:
            return
        tmp = self.shared.with_name(f".{self.shared.name}.{os.getpid()}")
        tmp.write_text(json.dumps({"scale": self.scale, "real0": self.real0, "virt0": self.virt0,
                                   "offset": self.offset}))
        os.replace(tmp, self.shared)
        self._seen = self.shared.stat().st_mtime_ns

    def now(self) -> float:
        with self.lock:
            if self.shared is not None:
                self._sync()
            return self.virt0 + (time.time() - self.real0) * self.scale + self.offset

    def advance(self, seconds: float) -> None:
        with self.lock:
            if self.shared is not None:
                self._sync()
            self.offset += seconds
            self._save()

    def reset(self) -> None:
        """Back on this machine's clock (a demo that jumped ahead puts it back when its leases are gone)."""
        with self.lock:
            self.real0 = self.virt0 = time.time()
            self.offset = 0.0
            self._save()
