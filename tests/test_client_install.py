"""The client install: `pip install .` into a fresh venv gives the CLI that drives a cloud (a laptop, a lab server,
Chameleon's JupyterHub) without TensorFlow, Horovod, Ceph or root; the nodes run the training stack.

The quickstart's path (docs/quickstart.md) is walked with that CLI against the local cloud, which a full install
started: data upload, check --online, run --plan, up, stage, train, status, runs, logs, down. What `up` and `down`
do on the cloud is checked as before (the lease's floating IP, the `cc` user, idempotent `up`, nothing left)."""

import json
import os
import re
import subprocess
import sys
import textwrap

import pytest

from appliance import localcloud, testbed
from appliance.cluster import find_cluster
from appliance.sites.openstack import OpenStackCloud, connect
from conftest import ROOT, needs_netns

pytestmark = [pytest.mark.slow, needs_netns]


@pytest.fixture(scope="module")
def client(tmp_path_factory):
    """A venv with only the client install (`pip install .`, no extras): the repository as a user installs it."""
    venv = tmp_path_factory.mktemp("client") / "venv"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True)
    r = subprocess.run([sys.executable, "-m", "pip", "--python", str(venv / "bin" / "python"), "install", "-q",
                        "--disable-pip-version-check", "--no-compile", str(ROOT)],
                       capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr[-2000:]
    return venv


def cli(client, *args, cwd, check=True, timeout=600):
    env = {k: v for k, v in os.environ.items() if not k.startswith(("OS_", "PYTHON"))}
    env["PATH"] = f"{client / 'bin'}:{env['PATH']}"
    r = subprocess.run([str(client / "bin" / "appliance"), *args], cwd=cwd, env=env, capture_output=True,
                       text=True, timeout=timeout)
    if check:
        assert r.returncode == 0, f"appliance {' '.join(args)}: rc {r.returncode}\n{r.stdout[-1500:]}\n{r.stderr[-1500:]}"
    return r


def test_the_client_install_has_no_training_stack_and_checks_a_chameleon_spec(client, tmp_path):
    py = str(client / "bin" / "python")
    for mod in ("tensorflow", "horovod", "swift"):  # the stack, and the local cloud's extra
        r = subprocess.run([py, "-c", f"import {mod}"], capture_output=True, text=True, cwd=tmp_path)
        assert r.returncode != 0 and "ModuleNotFoundError" in r.stderr, (mod, r.stderr[-300:])
    r = subprocess.run([py, "-c", "import appliance, sys; print(appliance.__file__)"], capture_output=True,
                       text=True, cwd=tmp_path, check=True)
    assert r.stdout.startswith(str(client)), r.stdout  # the installed copy, not the checkout
    assert "appliance run" in cli(client, "--help", cwd=tmp_path).stdout
    out = cli(client, "check", str(ROOT / "examples" / "chameleon.yaml"), cwd=tmp_path).stdout
    assert "on chameleon, 2 x gpu_rtx_6000" in out, out
    # what nodes are installed from (`up --install`) came with it
    assert (client / "share" / "appliance" / "requirements.lock").read_bytes() == (ROOT / "requirements.lock").read_bytes()
    assert (client / "share" / "appliance" / "images" / "install-stack.sh").is_file()


def os_cloud() -> OpenStackCloud:
    return OpenStackCloud(connect(cloud=localcloud.CLOUD_NAME, config_file=str(localcloud.clouds_yaml())))


def requests(method, pattern):
    return [r for r in localcloud.admin("GET", "/requests")["requests"]
            if r["method"] == method and re.fullmatch(pattern, r["path"])]


def test_the_quickstart_from_a_client_install_lease_up_stage_train_down(client, cloud, tmp_path):
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
    up = cli(client, "data", "upload", str(data), "swift://cycle-data/v1/", "--cloud", "local", cwd=tmp_path)
    assert "at the local cloud CHI@local" in up.stdout + up.stderr
    ls = json.loads(cli(client, "data", "ls", "swift://cycle-data/v1/", "--cloud", "local", "--json",
                        cwd=tmp_path).stdout)
    assert [o["name"] for o in ls] == ["v1/a.txt"]
    assert "ok" in cli(client, "check", str(spec), "--online", cwd=tmp_path).stdout
    assert "lease" in cli(client, "run", str(spec), "--plan", "--for", "3h", cwd=tmp_path).stdout
    cli(client, "up", str(spec), cwd=tmp_path)
    cl = find_cluster("cycle")
    assert len(cl.nodes) == 2 and cl.lease_id and cl.reservation_id and cl.floating_ip
    assert cl.python == sys.executable  # the nodes' stack is the image's (the full install's), not the client's
    assert cl.nodes[1].via_head  # workers are reached through the head, as on Chameleon
    fip = os_cloud().conn.network.get_ip(cl.site.fip_id)
    assert f"reservation:{cl.site.fip_reservation_id}" in fip.tags  # the lease's reserved FIP was used
    st = json.loads(cli(client, "status", "cycle", "--json", cwd=tmp_path).stdout)
    assert st["lease_status"] == "ACTIVE" and [n["state"] for n in st["nodes"]] == ["ACTIVE", "ACTIVE"]
    assert st["seconds_left"] > 3600
    cli(client, "stage", str(spec), cwd=tmp_path)
    res = json.loads(cli(client, "train", str(spec), "--json", cwd=tmp_path).stdout)
    assert res["exit_code"] == 0, res
    assert res["hostnames_reported"] == ["cycle-0", "cycle-1"] and res["same_weights_on_all_ranks"], res
    assert res["checkpoints_committed"] >= 1, res
    assert "cycle" in cli(client, "ls", cwd=tmp_path).stdout
    assert "exit" in cli(client, "logs", "cycle", "-n", "5", cwd=tmp_path).stdout
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
    cli(client, "down", "cycle", "--yes", cwd=tmp_path)
    assert find_cluster("cycle") is None
    c = os_cloud()
    assert c.get_lease(cl.lease_id) is None
    for sid in [n.server_id for n in cl.nodes]:  # as openstacksdk's wait_for_delete: gone once its node is torn down
        srv = c.get_server(sid)
        if srv is not None:
            c.conn.compute.wait_for_delete(srv, interval=0.1, wait=120)
    assert not [n for n in (testbed.load(localcloud.testbed_name()).nodes) if n.name.startswith("cycle-")]
    assert "cycle" not in cli(client, "lease", "list", "--cloud", "local", cwd=tmp_path).stdout
    cli(client, "down", "cycle", "--yes", cwd=tmp_path)  # idempotent
