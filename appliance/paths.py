"""Where the appliance keeps its state on the machine it runs on, and the one lock of versions it ships with."""

from __future__ import annotations

import os
import re
import site
import sys
from pathlib import Path

# What nodes are installed from (`up --install`, provision/install.py bundle): the lock, the install script and the
# package's own metadata. In a source checkout (make install: editable) they are beside the package; a client
# install (`pip install .`, `uv tool install .`) has them from pyproject.toml's [tool.setuptools.data-files], under
# the environment's share/appliance (or the user base's, with pip --user).
SHIPPED = ("requirements.lock", "pyproject.toml", "README.md", "images/install-stack.sh")
SOURCE = Path(__file__).resolve().parents[1]


def shipped(rel: str) -> Path:
    """Where one of SHIPPED is on this machine (the checkout's path when it is nowhere, for the error to name)."""
    for base in (SOURCE, Path(sys.prefix) / "share" / "appliance", Path(site.getuserbase()) / "share" / "appliance"):
        if (base / rel).is_file():
            return base / rel
    return SOURCE / rel


LOCK = shipped("requirements.lock")


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
