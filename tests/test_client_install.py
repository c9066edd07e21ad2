"""The client install: `pip install .` into a fresh venv gives the CLI that drives a cloud (a laptop, a lab server,
Chameleon's JupyterHub) without TensorFlow, Horovod, Ceph or root; the nodes run the training stack.

The quickstart (docs/quickstart.md, examples/quickstart.ipynb) is run as a notebook, with that CLI, against the
local cloud that a full install started: check --online, data upload, up, stage, train, ls, logs, down, lease list.
What `up` and `down` do on the cloud is checked in between (the lease's floating IP, the `cc` user, idempotent
`up`, nothing left)."""

import json
import os
import subprocess
import sys
import textwrap

import pytest

from appliance import localcloud, testbed
from appliance.cluster import find_cluster
from conftest import ROOT, needs_netns
from test_provision import os_cloud, requests  # the local cloud's clients, as the provisioning tests use them

pytestmark = [pytest.mark.slow, needs_netns]


def other_pythons() -> list[str]:
    """The newest Python above the nodes' 3.11 that this machine has (on PATH, or pyenv's): what laptops run (3.12
    is also the CC-Ubuntu24.04 nodes' own, where test_image installs the whole package on it)."""
    import glob
    import shutil

    found = {}
    for minor in ("3.12", "3.13"):
        for path in [shutil.which(f"python{minor}"),
                     *sorted(glob.glob(os.path.expanduser(f"~/.pyenv/versions/{minor}.*/bin/python{minor}")))]:
            if path and subprocess.run([path, "-c", "import venv"], capture_output=True).returncode == 0:
                found[minor] = path  # (pyenv's shim on PATH exits 127 for a version it does not select)
                break
    return [pytest.param(p, id=m) for m, p in list(found.items())[-1:]] or [pytest.param(None, id="none")]


@pytest.fixture(scope="module")
def wheel(tmp_path_factory):
    """The repository as pip builds it for a user (`pip install .` builds this wheel), built once."""
    out = tmp_path_factory.mktemp("wheel")
    r = subprocess.run([sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "--disable-pip-version-check",
                        "-w", str(out), str(ROOT)], capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr[-2000:]
    return next(out.glob("appliance-*.whl"))


def install_client(wheel, venv, python=sys.executable):
    """A venv of ``python`` with only the client install (no extras)."""
    subprocess.run([python, "-m", "venv", "--without-pip", str(venv)], check=True)
    r = subprocess.run([sys.executable, "-m", "pip", "--python", str(venv / "bin" / "python"), "install", "-q",
                        "--disable-pip-version-check", "--no-compile", str(wheel)],
                       capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr[-2000:]
    return venv


@pytest.fixture(scope="module")
def client(wheel, tmp_path_factory):
    """A venv with only the client install (`pip install .`, no extras): the repository as a user installs it."""
    return install_client(wheel, tmp_path_factory.mktemp("client") / "venv")


def cli(client, *args, cwd, check=True, timeout=600, home=None):
    """``home``: the user's home for the command (a laptop's, with the key pair a Chameleon spec names)."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("OS_", "PYTHON"))}
    env["PATH"] = f"{client / 'bin'}:{env['PATH']}"
    if home is not None:
        env["HOME"] = str(home)
    r = subprocess.run([str(client / "bin" / "appliance"), *args], cwd=cwd, env=env, capture_output=True,
                       text=True, timeout=timeout)
    if check:
        assert r.returncode == 0, f"appliance {' '.join(args)}: rc {r.returncode}\n{r.stdout[-1500:]}\n{r.stderr[-1500:]}"
    return r


def laptop(tmp_path):
    """A home with the key pair examples/chameleon.yaml names (key_file: ~/.ssh/id_ed25519): `appliance check`
    refuses a spec whose key file is not there."""
    home = tmp_path / "home"
    (home / ".ssh").mkdir(parents=True, exist_ok=True)
    (home / ".ssh" / "id_ed25519").write_text("a private key\n")
    return home


def test_the_client_install_has_no_training_stack_and_checks_a_chameleon_spec(client, tmp_path):
    py = str(client / "bin" / "python")
    for mod in ("tensorflow", "horovod", "swift"):  # the stack, and the local cloud's extra
        r = subprocess.run([py, "-c", f"import {mod}"], capture_output=True, text=True, cwd=tmp_path)
        assert r.returncode != 0 and "ModuleNotFoundError" in r.stderr, (mod, r.stderr[-300:])
    r = subprocess.run([py, "-c", "import appliance, sys; print(appliance.__file__)"], capture_output=True,
                       text=True, cwd=tmp_path, check=True)
    assert r.stdout.startswith(str(client)), r.stdout  # the installed copy, not the checkout
    assert "appliance run" in cli(client, "--help", cwd=tmp_path).stdout
    r = cli(client, "check", str(ROOT / "examples" / "chameleon.yaml"), cwd=tmp_path, home=tmp_path, check=False)
    assert r.returncode == 2 and "key_file: ~/.ssh/id_ed25519 is not a file on this machine" in r.stderr, r.stderr
    out = cli(client, "check", str(ROOT / "examples" / "chameleon.yaml"), cwd=tmp_path, home=laptop(tmp_path)).stdout
    assert "on chameleon, 2 x gpu_rtx_6000" in out, out
    # what nodes are installed from (`up --install`) came with it
    assert (client / "share" / "appliance" / "requirements.lock").read_bytes() == (ROOT / "requirements.lock").read_bytes()
    assert (client / "share" / "appliance" / "images" / "install-stack.sh").is_file()


@pytest.mark.parametrize("python", other_pythons())
def test_the_client_installs_and_drives_the_local_cloud_on_newer_pythons(python, wheel, cloud, tmp_path):
    """Laptops run Python 3.12 and 3.13; only the nodes need 3.11. The same wheel, installed on each, checks a
    Chameleon spec and lists the local cloud's leases (openstacksdk, keystoneauth, Blazar's API)."""
    if python is None:
        pytest.skip("no Python 3.12 or 3.13 on this machine (PATH or ~/.pyenv)")
    venv = install_client(wheel, tmp_path / "venv", python)
    ver = subprocess.run([str(venv / "bin" / "python"), "-c", "import sys; print(sys.version_info[:2])"],
                         capture_output=True, text=True, check=True).stdout
    assert ver.strip() in ("(3, 12)", "(3, 13)"), ver
    out = cli(venv, "check", str(ROOT / "examples" / "chameleon.yaml"), cwd=tmp_path, home=laptop(tmp_path)).stdout
    assert "on chameleon, 2 x gpu_rtx_6000" in out, out
    localcloud.start()
    assert json.loads(cli(venv, "lease", "list", "--cloud", "local", "--json", cwd=tmp_path).stdout) is not None


def _run_cells(nc, cells, start, until=None):
    """Execute the notebook's cells from ``start`` up to the first whose source contains ``until``; their output."""
    out = []
    for i in range(start, len(cells)):
        if until and until in cells[i].source:
            return i, "".join(out)
        nc.execute_cell(cells[i], i)  # a %%bash cell raises on a non-zero exit: the test fails there
        out += [o.get("text", "") for o in cells[i].get("outputs", []) if o.get("output_type") == "stream"]
    return len(cells), "".join(out)


def test_the_quickstart_notebook_with_the_client_install_lease_up_stage_train_down(client, cloud, tmp_path):
    """examples/quickstart.ipynb, as a JupyterHub user runs it, its `appliance` the client install's; the
    parameters a `cloud: local` spec of the same shape as examples/chameleon.yaml."""
    import nbformat
    from nbclient import NotebookClient

    data = tmp_path / "data"
    data.mkdir()
    (data / "a.txt").write_text("a" * 1000)
    spec = tmp_path / "cycle.yaml"
    spec.write_text(textwrap.dedent(f"""\
        name: cycle
        cloud: local
        nodes: {{count: 2, node_type: compute_local, slots: 1}}
        image: appliance-cpu
        lease: {{duration: 2h}}
        train:
          code: {ROOT / 'examples' / 'digits'}
          command: python train.py --epochs 3
        dataset: {{source: "swift://cycle-data/v1/", dest: data/cycle}}
        checkpoint: {{url: "swift://cycle-checkpoints/", every_steps: 50}}
        """))
    nb = nbformat.read(ROOT / "examples" / "quickstart.ipynb", as_version=4)
    nb.cells = [c for c in nb.cells if "install" not in c.metadata.get("tags", [])]  # the client is installed
    params = [c for c in nb.cells if "parameters" in c.metadata.get("tags", [])]
    assert len(params) == 1
    params[0].source = f"%env SPEC={spec}\n%env RUN=cycle\n%env DATA_DIR={data}\n%env DATA_URL=swift://cycle-data/v1/"
    env = {k: v for k, v in os.environ.items() if not k.startswith(("OS_", "PYTHON"))}
    env["PATH"] = f"{client / 'bin'}:{env['PATH']}"
    nc = NotebookClient(nb, timeout=900, kernel_name="python3", resources={"metadata": {"path": str(tmp_path)}})
    with nc.setup_kernel(env=env):
        at, shown = _run_cells(nc, nb.cells, 0, until="appliance down")
        assert "at the local cloud CHI@local" in shown, shown[-2000:]  # the site the data went to, said
        assert "1 object(s), 1000 bytes" in shown and "ok: run 'cycle'" in shown, shown[-2000:]
        assert "[0|cycle-0]" in shown and "cycle" in shown, shown[-2000:]  # the job's output, then `ls`
        cl = find_cluster("cycle")
        assert len(cl.nodes) == 2 and cl.lease_id and cl.reservation_id and cl.floating_ip
        assert cl.python == sys.executable  # the nodes' stack is the image's (the full install's), not the client's
        assert cl.nodes[1].via_head  # workers are reached through the head, as on Chameleon
        fip = os_cloud().conn.network.get_ip(cl.site.fip_id)
        assert f"reservation:{cl.site.fip_reservation_id}" in fip.tags  # the lease's reserved FIP was used
        st = json.loads(cli(client, "status", "cycle", "--json", cwd=tmp_path).stdout)
        assert st["lease_status"] == "ACTIVE" and [n["state"] for n in st["nodes"]] == ["ACTIVE", "ACTIVE"]
        assert st["seconds_left"] > 3600
        runs = json.loads(cli(client, "ls", "cycle", "--json", cwd=tmp_path).stdout)
        assert runs["status"] == "complete" and runs["last_checkpoint"], runs
        # the nodes are CC images: the launcher logs in as cc, which has passwordless sudo and was given the work
        # directory; the job's files are cc's; root's key answers "log in as cc" (cloud-init's disable_root)
        from appliance.remote import Session
        with Session(cl) as s:
            wd = cl.nodes[1].workdir
            r = s[cl.nodes[1].name].run(f"id -un; sudo -n id -u; stat -c %U {wd}; find {wd} ! -user cc | head -3",
                                        check=True)
        assert r.out.split() == ["cc", "0", "cc"], r.out
        r = testbed.node_exec(localcloud.testbed_name(), cl.nodes[0].name, "cat /root/.ssh/authorized_keys")
        assert r.stdout.startswith('no-port-forwarding,no-agent-forwarding,no-X11-forwarding,command="echo '
                                   '\'Please login as the user \\"cc\\" rather than the user \\"root\\".\'')
        # idempotent: a second `up` creates nothing new
        before = len(requests("POST", r"/compute/v2.1/servers"))
        cli(client, "up", str(spec), cwd=tmp_path)
        assert len(requests("POST", r"/compute/v2.1/servers")) == before
        assert len(requests("POST", r"/reservation/v1/leases")) >= 1
        _, shown = _run_cells(nc, nb.cells, at)
    assert "leases at the local cloud CHI@local" in shown and "cycle" not in shown.split("leases at")[1], shown
    assert find_cluster("cycle") is None
    c = os_cloud()
    assert c.get_lease(cl.lease_id) is None
    for sid in [n.server_id for n in cl.nodes]:  # as openstacksdk's wait_for_delete: gone once its node is torn down
        srv = c.get_server(sid)
        if srv is not None:
            c.conn.compute.wait_for_delete(srv, interval=0.1, wait=120)
    assert not [n for n in (testbed.load(localcloud.testbed_name()).nodes) if n.name.startswith("cycle-")]
    cli(client, "down", "cycle", "--yes", cwd=tmp_path)  # idempotent
