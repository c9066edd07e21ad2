"""The Heat template: static checks against Heat's resource schemas, then a real stack on the local cloud
(python-heatclient -> the local cloud's Heat API -> testbed nodes running the template's user_data), adopted
by the CLI and trained on."""

import json
import re
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from appliance import localcloud, testbed
from appliance import sites
from appliance.provision import heat
from appliance.spec import load_spec
from appliance.flows import run_job as train
from conftest import NETNS_OK, ROOT

# Property and attribute names from Heat's resource plugins (openstack/heat, heat/engine/resources/openstack:
# nova/server.py, nova/keypair.py, heat/resource_group.py, neutron/floatingip.py), the subset a template may use.
SCHEMAS = {
    "OS::Nova::Server": ({"name", "image", "flavor", "key_name", "networks", "scheduler_hints", "user_data",
                          "user_data_format", "metadata", "security_groups", "availability_zone", "config_drive",
                          "block_device_mapping_v2", "software_config_transport", "admin_pass", "tags"},
                         {"first_address", "name", "addresses", "networks", "accessIPv4", "instance_name",
                          "console_urls", "show"}),
    "OS::Nova::KeyPair": ({"name", "save_private_key", "public_key", "type", "user"},
                          {"private_key", "public_key", "show"}),
    "OS::Heat::ResourceGroup": ({"count", "resource_def", "index_var", "removal_policies",
                                 "removal_policies_mode"}, {"refs", "refs_map", "attributes", "removed_rsrc_list"}),
    "OS::Neutron::FloatingIP": ({"floating_network", "floating_subnet", "port_id", "fixed_ip_address",
                                 "floating_ip_address", "value_specs", "dns_name", "dns_domain"},
                                {"floating_ip_address", "fixed_ip_address", "port_id", "router_id", "show"}),
    "OS::Neutron::FloatingIPAssociation": ({"floatingip_id", "port_id", "fixed_ip_address"}, {"show"}),
}
PSEUDO = {"OS::stack_name", "OS::stack_id", "OS::project_id"}


def tpl() -> dict:
    return yaml.safe_load(heat.TEMPLATE.read_text())


def walk(value, fn):
    if isinstance(value, dict):
        for k, v in value.items():
            fn(k, v)
            walk(v, fn)
    elif isinstance(value, list):
        for v in value:
            walk(v, fn)


def test_committed_template_is_generated_from_the_shared_scripts():
    heat.check_committed()  # heat_boot.sh + hostkeys.sh, the user_data `appliance up` gives every server
    ud = tpl()["resources"]["head"]["properties"]["user_data"]["str_replace"]["template"]
    assert (ROOT / "appliance" / "provision" / "hostkeys.sh").read_text().strip() in ud


def test_no_secret_and_no_generated_key_pair_in_the_template():
    """Issue 14 item 10 and issue 12 item 4: the template used to generate an OS::Nova::KeyPair (refused by Heat
    without public_key on Chameleon's Nova) and put its private key in every server's user_data."""
    text = heat.TEMPLATE.read_text()
    assert "OS::Nova::KeyPair" not in text and "private_key" not in text and "PRIVATE KEY" not in text
    assert "ssh-keyscan" not in text  # no trust on first use between the nodes


def test_template_uses_only_chameleon_types_and_real_property_names():
    t = tpl()
    assert t["heat_template_version"] == "2018-08-31"  # what Chameleon's own templates use (needs >= 2016-10-14 for yaql)
    resources = t["resources"]
    defs = dict(resources)
    defs["workers.resource_def"] = resources["workers"]["properties"]["resource_def"]
    for name, r in defs.items():
        assert r["type"] in SCHEMAS, (name, r["type"])
        assert set(r.get("properties", {})) <= SCHEMAS[r["type"]][0], (name, set(r["properties"]) - SCHEMAS[r["type"]][0])


def test_every_reference_resolves():
    t = tpl()
    params, resources = set(t["parameters"]), t["resources"]
    member = resources["workers"]["properties"]["resource_def"]["type"]
    problems = []

    def check(k, v):
        if k == "get_param":
            name = v[0] if isinstance(v, list) else v
            if name not in params | PSEUDO:
                problems.append(f"get_param {name}")
        elif k == "get_resource" and v not in resources:
            problems.append(f"get_resource {v}")
        elif k == "get_attr":
            res, attr = v[0], v[1]
            if res not in resources:
                problems.append(f"get_attr {res}")
                return
            rtype = resources[res]["type"]
            allowed = SCHEMAS[rtype][1] | (SCHEMAS[member][1] if rtype == "OS::Heat::ResourceGroup" else set())
            if attr not in allowed:
                problems.append(f"get_attr {res}.{attr}")

    walk(t["resources"], check)
    walk(t["outputs"], check)
    assert not problems
    for name, p in t["parameters"].items():
        assert p.get("label") and p.get("description"), name
    assert {"custom_constraint": "blazar.reservation"} in t["parameters"]["reservation_id"]["constraints"]
    assert {"head_ip", "worker_ips", "ssh_command"} <= set(t["outputs"])


def test_boot_script_is_valid_sh_with_heats_values_in():
    script = heat.boot_script()
    for k, v in {"%%ROLE%%": "head", "%%STACK%%": "s"}.items():
        script = script.replace(k, v)
    assert "%%" not in script
    r = subprocess.run(["sh", "-n"], input=script, text=True, capture_output=True)
    assert r.returncode == 0, r.stderr


# ---------------------------------------------------------------------------------------------------------
# a real stack on the local cloud


@pytest.mark.slow
@pytest.mark.skipif(not NETNS_OK, reason="needs network namespaces")
def test_stack_from_the_template_adopt_and_train(cloud, tmp_path):
    """Issue 51, as a user walks it with the `openstack` CLI and `appliance`: a key pair of one's own (`openstack
    keypair create --public-key`), a lease (`openstack reservation lease create`), `openstack stack create --wait`,
    `stack event list`, `stack resource list`, `appliance adopt --key-file`, then training. The local site recorded
    its own login key whatever was given, and the nodes refused it after a 60-s wait with paramiko's tracebacks
    printed: now the user's key is used, and a key the nodes refuse is one line naming it, at once."""
    import datetime as dt

    from cryptography.hazmat.primitives import serialization
    from cryptography.hazmat.primitives.asymmetric import ed25519

    from test_provision import _openstack

    site = sites.open_site("local")
    c = site.cloud
    user_key = ed25519.Ed25519PrivateKey.generate()
    mine = tmp_path / "id_mine"
    mine.write_bytes(user_key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.OpenSSH,
                                            serialization.NoEncryption()))
    mine.chmod(0o600)
    (tmp_path / "id_mine.pub").write_bytes(user_key.public_key().public_bytes(serialization.Encoding.OpenSSH,
                                                                              serialization.PublicFormat.OpenSSH))
    _openstack("keypair", "create", "--public-key", str(tmp_path / "id_mine.pub"), "hs-user")
    key = site.login_key("hs-user", str(mine))
    end = (dt.datetime.now(dt.timezone.utc) + dt.timedelta(hours=2)).strftime("%Y-%m-%d %H:%M")
    out = _openstack(
        "reservation", "lease", "create", "--reservation",
        'min=2,max=2,resource_type=physical:host,resource_properties=["=", "$node_type", "compute_local"]',
        "--end-date", end, "-f", "json", "heat-lease")
    made = json.loads(out[out.index("{"):])  # blazarclient prints "Created a new lease:" before its JSON
    lease = c.wait_lease(made["id"])
    hc = heat.heat_client(site)
    try:
        # a bad parameter is refused the way Heat refuses it
        with pytest.raises(Exception, match="node_count"):
            hc.stacks.create(stack_name="hbad", template=tpl(), parameters={
                "reservation_id": lease.reservation_id, "node_count": 0, "key_name": key.name,
                "image": "appliance-cpu"})
        # Heat 2023.1 on Chameleon's Nova (microversion >= 2.92) refuses a KeyPair that Nova would have to generate
        old_style = tpl()
        old_style["resources"]["cluster_key"] = {"type": "OS::Nova::KeyPair",
                                                 "properties": {"name": "k", "save_private_key": True}}
        with pytest.raises(Exception, match="public_key property is required"):
            hc.stacks.create(stack_name="hkp", template=old_style, parameters={
                "reservation_id": lease.reservation_id, "node_count": 1, "key_name": key.name,
                "image": "appliance-cpu"})
        # as a user walks it (issue 51): the `openstack` CLI, `stack create --wait` (it polls the stack's events),
        # then the events and resources Horizon and the CLI read
        from test_provision import _openstack

        out = _openstack("stack", "create", "-t", str(heat.TEMPLATE), "--parameter",
                         f"reservation_id={lease.reservation_id}", "--parameter", "node_count=2", "--parameter",
                         f"key_name={key.name}", "--parameter", "image=appliance-cpu", "--wait", "-f", "json", "hs")
        assert "[hs]: CREATE_IN_PROGRESS  Stack CREATE started" in out  # --wait printed the stack's events
        assert json.loads(out[out.index("\n{") + 1:])["stack_status"] == "CREATE_COMPLETE", out[-1000:]
        st = hc.stacks.get("hs")
        events = json.loads(_openstack("stack", "event", "list", "hs", "-f", "json"))
        assert ("hs", "CREATE_COMPLETE") in [(e["resource_name"], e["resource_status"]) for e in events], events
        res = {r["resource_name"]: r for r in json.loads(_openstack("stack", "resource", "list", "hs", "-f", "json"))}
        assert res["head"]["resource_type"] == "OS::Nova::Server" and \
            all(r["resource_status"] == "CREATE_COMPLETE" for r in res.values()), res
        out = {o["output_key"]: o["output_value"] for o in st.outputs}
        assert out["worker_names"] == ["hs-worker-0"] and len(out["worker_ips"]) == 1
        assert out["ssh_command"] == f"ssh cc@{out['head_ip']}"
        # the boot scripts ran on every node
        tb = testbed.load(localcloud.testbed_name())
        disks = {n.name: Path(n.disk) for n in tb.nodes}
        head_id = next(s.id for s in c.conn.compute.servers() if s.name == "hs-head")
        head_node = next(n for n in tb.nodes if n.name == "hs-head")
        assert (Path(head_node.dir) / "user_data.log").read_text().splitlines()[-1] == "exit 0"
        # bare metal: no console log (Nova-Ironic answers 501); each node published its host key instead
        with pytest.raises(Exception, match="501|not supported"):
            c.conn.compute.get_server_console_output(head_id)
        assert c.server_host_keys(head_id) == [" ".join(head_node.host_key_pub.read_text().split()[:2])]

        # `appliance adopt` with the local cloud's own key, not the stack's: refused at once, one line naming it
        cli = Path(sys.executable).parent / "appliance"
        r = subprocess.run([str(cli), "adopt", "hs", "--cloud", "local"], capture_output=True, text=True,
                           timeout=300)
        assert r.returncode != 0 and re.search(r"hs-head .* refused the key .*id_ed25519 for user cc", r.stderr), \
            r.stderr[-2000:]
        assert "never came up" not in r.stderr and "Traceback" not in r.stderr + r.stdout and \
            len([ln for ln in r.stderr.splitlines() if "refused" in ln]) == 1, r.stderr[-2000:]
        # with the user's key (as `appliance adopt hs --key-name hs-user --key-file KEY`), then train on it
        r = subprocess.run([str(cli), "adopt", "hs", "--cloud", "local", "--key-name", "hs-user", "--key-file",
                            str(mine), "--json"], capture_output=True, text=True, timeout=600)
        assert r.returncode == 0, r.stderr[-2000:]
        from appliance.cluster import load_cluster

        cl = load_cluster("hs")
        assert cl.key_file == str(mine)
        for name in ("hs-head", "hs-worker-0"):  # adopt set the cluster up on every node
            cj = disks[name] / "appliance" / "etc" / "cluster.json"
            assert cj.exists(), name
            assert [n["name"] for n in yaml.safe_load(cj.read_text())["nodes"]] == ["hs-head", "hs-worker-0"]
            assert (disks[name] / "appliance" / "etc" / "hostfile").read_text().split() == \
                ["hs-head", "slots=1", "hs-worker-0", "slots=1"]
        assert [n.name for n in cl.nodes] == ["hs-head", "hs-worker-0"] and cl.lease_id == lease.id
        spec = load_spec(ROOT / "examples" / "digits.yaml")
        import dataclasses
        spec = dataclasses.replace(spec, name="heatdigits", dataset=None, checkpoint=dataclasses.replace(
            spec.checkpoint, url=None), train=dataclasses.replace(spec.train, command="python train.py --epochs 2"))
        res = train(spec, cl, out=lambda line: None)
        assert res.exit_code == 0, res.failure
        assert sorted(res.hostnames) == ["hs-head", "hs-worker-0"]

        # or, on the head node itself, as its login user cc: `appliance train` finds the cluster from the files
        # contextualize wrote (and cc's ~/.ssh)
        (disks["hs-head"] / "onhead.yaml").write_text(
            f"name: onhead\ncloud: local\nnodes: {{count: 2}}\ntrain:\n"
            f"  code: {ROOT / 'examples' / 'digits'}\n  command: python train.py --epochs 1\n")
        cli = Path(sys.executable).parent / "appliance"
        r = testbed.node_exec(localcloud.testbed_name(), "hs-head",
                              "exec runuser -u cc -- env HOME=/home/cc APPLIANCE_HOME=/mnt/local/appliance/home "
                              f"APPLIANCE_ETC=/mnt/local/appliance/etc {cli} train /mnt/local/onhead.yaml --json",
                              timeout=300)
        assert r.returncode == 0, r.stderr[-2000:]
        summary = json.loads(r.stdout)
        assert summary["hostnames_reported"] == ["hs-head", "hs-worker-0"], summary
    finally:
        for s in hc.stacks.list():
            hc.stacks.delete(s.id)
        c.delete_lease(lease.id)
        _openstack("keypair", "delete", "hs-user")
    assert not [s for s in c.conn.compute.servers() if s.name.startswith("hs-")]
