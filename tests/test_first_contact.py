"""A new user's first contact from a laptop (issue 76 point 4): what `appliance` says before anything works. Each
refusal is one line with its fix and a non-zero exit; nothing here reaches a cloud (a clouds.yaml in tmp_path,
openstacksdk's Connection faked where a 401 is needed)."""

from __future__ import annotations

import json
import os
import sys

import pytest
import yaml
from click.testing import CliRunner

from appliance.cli import main
from appliance.errors import ApplianceError
from appliance.sites.openstack_auth import connect

CHI_UC = "https://chi.uc.chameleoncloud.org:5000/v3"


@pytest.fixture
def clouds_yaml(tmp_path, monkeypatch):
    """A clouds.yaml with the given entries, the only one openstacksdk finds; no OS_* variable but OS_CLOUD."""
    def write(entries: dict, os_cloud: str) -> str:
        for k in [k for k in os.environ if k.startswith("OS_")]:
            monkeypatch.delenv(k)
        path = tmp_path / "clouds.yaml"
        path.write_text(yaml.safe_dump({"clouds": entries}, sort_keys=False))
        monkeypatch.setenv("OS_CLIENT_CONFIG_FILE", str(path))
        monkeypatch.setenv("OS_CLOUD", os_cloud)
        return str(path)
    return write


def _cli(*args) -> tuple[int, str, str]:
    r = CliRunner().invoke(main, list(args))
    return r.exit_code, r.stdout, r.stderr


# -- 1. a ccauth entry without ccauth -----------------------------------------------------------------------------


def test_a_ccauth_entry_without_ccauth_says_to_install_it_into_this_python(clouds_yaml):
    """`ccauth clouds-yaml` writes auth_type v3chameleonoidc, a plugin of the ccauth package: without it keystoneauth
    raised NoMatchingPlugin, which the CLI printed as an unexpected error ("report it")."""
    clouds_yaml({"CHI@UC": {"auth_type": "v3chameleonoidc", "auth": {"auth_url": CHI_UC}, "region_name": "CHI@UC"}},
                "CHI@UC")
    with pytest.raises(ApplianceError) as e:
        connect()
    assert "v3chameleonoidc" in e.value.message and "ccauth" in e.value.message
    assert e.value.fix.startswith(f"`{sys.executable} -m pip install ccauth`")
    code, out, err = _cli("lease", "list", "--cloud", "chameleon")
    assert code == 1 and out == "" and len(err.strip().splitlines()) == 1, err
    assert err.startswith("error: clouds.yaml entry 'CHI@UC' has auth_type v3chameleonoidc") and "report it" not in err


# -- 4. OS_CLOUD names no entry -----------------------------------------------------------------------------------


def test_an_os_cloud_that_names_no_entry_says_where_clouds_yaml_was_looked_for_and_its_entries(clouds_yaml):
    from openstack.config import loader

    path = clouds_yaml({"CHI@UC": {"auth_type": "v3applicationcredential", "auth": {"auth_url": CHI_UC},
                                   "region_name": "CHI@UC"},
                        "CHI@TACC": {"auth_type": "v3applicationcredential", "region_name": "CHI@TACC"}}, "chi-uc")
    with pytest.raises(ApplianceError) as e:
        connect()
    msg = e.value.message
    assert msg.startswith(f"OS_CLOUD=chi-uc: no such entry in {path} (its entries: CHI@UC, CHI@TACC;"), msg
    assert f"OS_CLIENT_CONFIG_FILE={path}" in msg and "~/.config/openstack/clouds.yaml" in msg
    assert "/etc/openstack/clouds.yaml" in msg and "./clouds.yaml" in msg
    assert f"{loader.UNIX_SITE_CONFIG_HOME}/clouds.yaml" in msg
    assert "OS_CLOUD to one of its entries" in e.value.fix


def test_no_clouds_yaml_anywhere_says_where_it_was_looked_for(clouds_yaml, tmp_path, monkeypatch):
    from openstack.config import loader

    clouds_yaml({}, "CHI@UC")
    monkeypatch.setenv("OS_CLIENT_CONFIG_FILE", str(tmp_path / "nowhere.yaml"))
    monkeypatch.setattr(loader, "CONFIG_FILES", [str(tmp_path / "none" / "clouds.yaml")])
    with pytest.raises(ApplianceError) as e:
        connect()
    assert e.value.message.startswith("OS_CLOUD=CHI@UC: no clouds.yaml found (looked for: OS_CLIENT_CONFIG_FILE="
                                      f"{tmp_path}/nowhere.yaml, {tmp_path}/none/clouds.yaml"), e.value.message
    assert "~/.config/openstack/clouds.yaml" in e.value.fix


# -- 5. a 401 may be an expired credential ------------------------------------------------------------------------


def test_a_401_asks_whether_the_credential_expired_and_says_how_to_renew_it(clouds_yaml, monkeypatch):
    import keystoneauth1.exceptions as ksa
    import openstack.connection

    class Refused:
        def __init__(self, config):
            pass

        def authorize(self):
            raise ksa.Unauthorized("The request you have made requires authentication. (HTTP 401)")

    monkeypatch.setattr(openstack.connection, "Connection", Refused)
    clouds_yaml({"CHI@UC": {"auth_type": "v3applicationcredential", "region_name": "CHI@UC",
                            "auth": {"auth_url": CHI_UC, "application_credential_id": "a",
                                     "application_credential_secret": "b"}}}, "CHI@UC")
    with pytest.raises(ApplianceError) as e:
        connect()
    assert "(401 Unauthorized: expired?" in e.value.message
    assert "cc-login" in e.value.fix and "ccauth" in e.value.fix and "new application credential" in e.value.fix


def test_blazars_401_asks_whether_the_token_expired():
    from appliance.sites.openstack_api import explain_blazar

    class BlazarClientException(Exception):  # python-blazarclient's: the message, and the status in kwargs
        def __init__(self, msg, code):
            super().__init__(msg)
            self.kwargs = {"code": code}

    got = explain_blazar(BlazarClientException("ERROR: The request you have made requires authentication.", 401))
    assert "(401 Unauthorized: expired?" in got.message and "cc-login" in got.fix


# -- 2. `appliance run SPEC --plan` before any credential ---------------------------------------------------------


@pytest.fixture
def no_credentials(tmp_path, monkeypatch):
    """No OS_* variable, no clouds.yaml, no key: a laptop before step 1 of docs/quickstart.md."""
    for k in [k for k in os.environ if k.startswith("OS_")] + ["APPLIANCE_RUN_CLOUD"]:
        monkeypatch.delenv(k, raising=False)
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    monkeypatch.chdir(tmp_path)


def test_run_plan_of_the_chameleon_example_needs_no_credential(no_credentials):
    """`appliance run examples/chameleon.yaml --plan --for 30d` asked Keystone first, so a newcomer could not see
    what a run costs before making a credential."""
    from pathlib import Path

    from appliance.sites.chameleon_types import TABLE_DATE

    spec = str(Path(__file__).resolve().parents[1] / "examples" / "chameleon.yaml")
    code, out, err = _cli("run", spec, "--plan", "--for", "30d")
    assert code == 0, (out, err)
    lines = out.splitlines()
    assert lines[0] == "plan of run digits-chi: 2 x gpu_rtx_6000 at CHI@UC for 720.0 h (--for 30d); successor leases"
    assert lines[1] == ("  the site was not asked (no OpenStack credentials: neither OS_CLOUD nor OS_AUTH_URL is set): "
                        f"its figures are from the appliance's table of Chameleon node types as of {TABLE_DATE} "
                        "(appliance/sites/chameleon_types.py)")
    assert lines[2].startswith("  table: 37 gpu_rtx_6000 hosts (the nodes the reference-repository lists at CHI@UC), "
                               "1 x Quadro RTX 6000 per node; su_factor 1 (assumed: not public;"), lines[2]
    assert "  total: 30 lease(s), 1440 node-hours, 1440 SUs (su_factor 1 of gpu_rtx_6000, 37 hosts at the site)" in out
    assert "  the project's other leases not read (the site was not asked): none assumed" in out
    code, out, err = _cli("run", spec, "--plan", "--for", "30d", "--json")
    p = json.loads(out)
    assert code == 0 and p["source"] == "table" and p["assumed"]["date"] == TABLE_DATE and len(p["leases"]) == 30
    assert p["assumed"]["gpus"] == 1 and p["su_factor"] == 1.0 and p["hosts_of_node_type"] == 37


def test_run_plan_with_a_credential_that_works_asks_the_site(no_credentials, monkeypatch):
    import datetime as dt
    from pathlib import Path

    from appliance.sites.chameleon import ChameleonSite

    class Blazar:  # the site's answers: its clock, its hosts of the node type and their su_factor
        def now(self):
            return dt.datetime(2026, 12, 1, 12, 0)

        def node_type_hosts(self, node_type):
            return (5, 2.5) if node_type == "gpu_rtx_6000" else (0, 1.0)

        def region_name(self):
            return "CHI@UC"

        def list_leases(self):  # the project's leases (GET /leases): none of the node type
            return []

    monkeypatch.setattr(ChameleonSite, "connect", lambda self: Blazar())
    spec = str(Path(__file__).resolve().parents[1] / "examples" / "chameleon.yaml")
    code, out, err = _cli("run", spec, "--plan", "--for", "2d", "--json")
    p = json.loads(out)
    assert code == 0 and p["source"] == "site" and "assumed" not in p, (out, err)
    assert (p["hosts_of_node_type"], p["su_factor"], p["leases"][0]["start"]) == (5, 2.5, "2026-12-01 12:00")
    assert p["sus"] == 2.5 * p["node_hours"]


def test_run_plan_when_blazar_answers_an_error_is_one_line_never_a_traceback(no_credentials, monkeypatch):
    """The plan's first question is Blazar's clock (GET /leases); its error came through as python-blazarclient's
    exception, past the table and past the one-line errors: the plan says why the site was not asked instead."""
    from pathlib import Path

    from appliance.sites.chameleon import ChameleonSite

    class BlazarClientException(Exception):
        def __init__(self, msg, code):
            super().__init__(msg)
            self.kwargs = {"code": code}

    class Blazar:
        def now(self):
            raise BlazarClientException("ERROR: The request you have made requires authentication.", 401)

    monkeypatch.setattr(ChameleonSite, "connect", lambda self: Blazar())
    spec = str(Path(__file__).resolve().parents[1] / "examples" / "chameleon.yaml")
    code, out, err = _cli("run", spec, "--plan", "--for", "2d", "--json")
    p = json.loads(out)
    assert code == 0 and p["source"] == "table" and "401 Unauthorized: expired?" in p["assumed"]["why"], (out, err)


def test_the_node_type_table_says_what_it_does_not_know():
    from appliance.sites.chameleon_types import facts

    base = facts("compute_skylake", "CHI@UC")  # not in the table: a base node type
    assert base["hosts"] is None and base["su_factor"] == 1.0 and "portal's default" in base["su_factor_from"]
    assert "not in the table" in base["hosts_from"]
    assert facts("gpu_rtx_6000", "CHI@TACC")["hosts"] == 0  # the reference-repository lists none there
    assert facts("gpu_h100", None)["site"] == "CHI@TACC" and facts("gpu_h100", None)["hosts"] == 2
    both = facts("compute_gigaio", None)
    assert both["hosts"] is None and both["site"] == "CHI@UC or CHI@TACC"


# -- 3. `appliance check` and the spec's key_file -----------------------------------------------------------------


def _chameleon_spec(tmp_path, **fields) -> str:
    """examples/chameleon.yaml with ``fields`` changed (its train.code made absolute), in tmp_path."""
    from pathlib import Path

    root = Path(__file__).resolve().parents[1]
    doc = yaml.safe_load((root / "examples" / "chameleon.yaml").read_text())
    doc["train"]["code"] = str(root / "examples" / doc["train"]["code"])
    doc.update(fields)
    path = tmp_path / "chameleon.yaml"
    path.write_text(yaml.safe_dump(doc))
    return str(path)


def test_check_names_a_key_file_that_is_not_there_and_exits_2(tmp_path):
    spec = _chameleon_spec(tmp_path, key_file=str(tmp_path / "no-such-key"))
    code, out, err = _cli("check", spec)
    assert code == 2 and out == "" and len(err.strip().splitlines()) == 1, (out, err)
    assert err.startswith(f"error: key_file: {tmp_path}/no-such-key is not a file on this machine (the private key of "
                          "key pair 'my-key'"), err
    assert "ssh-keygen -t ed25519" in err and "Compute > Key Pairs" in err
    key = tmp_path / "id_ed25519"
    key.write_text("a private key\n")
    code, out, err = _cli("check", _chameleon_spec(tmp_path, key_file=str(key)))
    assert code == 0 and out.startswith(f"{tmp_path}/chameleon.yaml: ok: run 'digits-chi' on chameleon"), (out, err)


def test_check_on_chameleon_without_key_file_needs_a_default_key_here(tmp_path, monkeypatch):
    monkeypatch.setenv("HOME", str(tmp_path / "home"))  # no ~/.ssh/id_ed25519, no ~/.ssh/id_rsa
    code, out, err = _cli("check", _chameleon_spec(tmp_path, key_file=None))
    assert code == 2 and err.startswith("error: key_file: not set, and neither ~/.ssh/id_ed25519 nor ~/.ssh/id_rsa is "
                                        "on this machine"), err


# -- 6. --json on every verb --------------------------------------------------------------------------------------


def test_lease_delete_and_cloud_stop_print_their_result_as_json(monkeypatch):
    from appliance import flows

    monkeypatch.setattr(flows, "lease", lambda verb, lease_id, **kw: verb == "delete" and lease_id == "L1")
    monkeypatch.setattr(flows, "cloud_stop", lambda: False)
    code, out, err = _cli("lease", "delete", "L1", "--cloud", "local", "--yes", "--json")
    assert code == 0 and json.loads(out) == {"id": "L1", "deleted": True}, (out, err)
    code, out, err = _cli("lease", "delete", "L2", "--cloud", "local", "--yes", "--json")
    assert code == 0 and json.loads(out) == {"id": "L2", "deleted": False}, (out, err)
    code, out, err = _cli("cloud", "stop", "--json")
    assert code == 0 and json.loads(out) == {"stopped": False}, (out, err)
