"""The import-layers contract (.importlinter): it holds for the code, and it catches a new upward import."""

import shutil
import subprocess
import sys
from pathlib import Path

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


def test_an_upward_import_breaks_it(tmp_path):
    d = copy_tree(tmp_path)
    p = d / "appliance" / "store" / "objects.py"  # the bottom layer reaching up to the workflows
    p.write_text(p.read_text() + "\n\ndef _up():\n    from .. import flows  # noqa\n")
    r = lint(d, d)
    assert r.returncode != 0 and "Data flows one way" in r.stdout and "BROKEN" in r.stdout, r.stdout


def test_the_simulator_outside_the_local_site_breaks_it(tmp_path):
    d = copy_tree(tmp_path)
    p = d / "appliance" / "provision" / "lifecycle.py"
    p.write_text(p.read_text() + "\n\ndef _sim():\n    from .. import localcloud  # noqa\n")
    r = lint(d, d)
    assert r.returncode != 0 and "Only the local site imports the simulator" in r.stdout, r.stdout


def test_node_code_reaching_the_launcher_breaks_it(tmp_path):
    d = copy_tree(tmp_path)
    p = d / "appliance" / "node" / "stage.py"
    p.write_text(p.read_text() + "\n\ndef _launcher():\n    from ..cluster import Cluster  # noqa\n")
    r = lint(d, d)
    assert r.returncode != 0 and "Node-side code imports only" in r.stdout, r.stdout
