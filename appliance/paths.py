"""Where the appliance keeps its state on the machine it runs on."""

from __future__ import annotations

import os
from pathlib import Path


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
