"""The import-layers contract (.importlinter): it holds for the code, and it catches a new upward import."""

import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
LINT = Path(sys.executable).with_name("lint-imports")


def lint(cwd: Path, pythonpath: Path) -> subprocess.CompletedProcess:
    return subprocess.run([str(LINT), "--no-cache"], cwd=cwd, capture_output=True, text=True, timeout=120,
                          env={"PATH": "/usr/bin:/bin", "PYTHONPATH": str(pythonpath)})


def test_the_layers_contract_holds():
    r = lint(ROOT, ROOT)
    assert r.returncode == 0, r.stdout + r.stderr
    assert "0 broken" in r.stdout


def copy_tree(tmp_path: Path) -> Path:
    shutil.copytree(ROOT / "appliance", tmp_path / "appliance", ignore=shutil.ignore_patterns("__pycache__"))
    shutil.copy2(ROOT / ".importlinter", tmp_path / ".importlinter")
    return tmp_path


@pytest.mark.parametrize("path, line, contract", [
    # the bottom layer reaching up to the workflows
    ("store/objects.py", "from .. import flows", "Data flows one way"),
    # a step importing the simulator instead of asking the local site
    ("provision/lifecycle.py", "from .. import localcloud", "Only the local site imports the simulator"),
    # node-side code reaching the launcher's records
    ("node/stage.py", "from ..cluster import Cluster", "Node-side code imports only"),
])
def test_a_forbidden_import_breaks_it(tmp_path, path, line, contract):
    d = copy_tree(tmp_path)
    p = d / "appliance" / path
    p.write_text(p.read_text() + f"\n\ndef _injected():\n    {line}  # noqa\n")
    r = lint(d, d)
    assert r.returncode != 0 and contract in r.stdout and "BROKEN" in r.stdout, r.stdout
