"""The job's object-store credentials on a node: the 0600 file the launcher wrote (``APPLIANCE_CHECKPOINT_CREDS``),
read again whenever the launcher replaced it. At a lease extension the launcher makes a credential that outlives
the new end and renames it over the file (checkpoint/job.py ``renew_creds``); rank 0 and the file syncer pick it up
before their next commit (a run extended past the first credential's expiry got 401 on its commits: issue 52)."""

from __future__ import annotations

import json
import os
from pathlib import Path

from ..protocol import Env
from ..store.objects import StoreCreds


class CredsFile:
    def __init__(self, path: str | None = None):
        self.path = path if path is not None else os.environ.get(Env.CKPT_CREDS)
        self.seen: tuple[int, int] | None = None

    def _stamp(self) -> tuple[int, int] | None:
        try:
            st = os.stat(self.path) if self.path else None
        except OSError:
            return None
        return (st.st_ino, st.st_mtime_ns) if st else None

    def changed(self) -> bool:
        """Whether the file is not the one last loaded (never loaded counts as changed)."""
        return self.seen is None or self._stamp() != self.seen

    def load(self) -> StoreCreds | None:
        """The credentials in the file now (None without one: a file:// store, or Swift v1 from the environment)."""
        self.seen = self._stamp() or (0, 0)
        if not self.path or not os.path.exists(self.path):
            return None
        return StoreCreds(**json.loads(Path(self.path).read_text()))
