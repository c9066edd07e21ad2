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
