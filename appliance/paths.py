"""Where the appliance keeps its state on the machine it runs on, and the one lock of versions it ships with."""

from __future__ import annotations

import os
import re
from pathlib import Path

LOCK = Path(__file__).resolve().parents[1] / "requirements.lock"


def lock_pin(name: str) -> str:
    """The version requirements.lock pins for a package (`name==VERSION`), or "" if it pins none."""
    m = re.search(rf"^{re.escape(name)}==(\S+)", LOCK.read_text(), re.M)
    return m.group(1) if m else ""


def home() -> Path:
    """State root: $APPLIANCE_HOME, else ~/.appliance."""
    p = Path(os.environ.get("APPLIANCE_HOME") or Path.home() / ".appliance")
    p.mkdir(parents=True, exist_ok=True)
    return p


def testbeds_dir() -> Path:
    d = home() / "testbeds"
    d.mkdir(parents=True, exist_ok=True)
    return d


def clusters_dir() -> Path:
    d = home() / "clusters"
    d.mkdir(parents=True, exist_ok=True)
    return d


def write_private(path: Path, data: bytes) -> None:
    """Write ``data`` to ``path`` readable by its owner alone from the first byte (a file created 0600 beside it,
    then renamed over it): never a moment at the umask's mode, as a copy-then-chmod leaves (issue 49)."""
    path = Path(path)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    tmp.unlink(missing_ok=True)
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    try:
        with os.fdopen(fd, "wb") as fh:
            fh.write(data)
        tmp.replace(path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
