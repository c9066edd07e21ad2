"""A managed run's controller gets a credential of its own (flows/credential.py), on the fake site: unrestricted,
expiring, handed over in a private clouds.yaml (never in the environment), deleted at the run's end, and those of
earlier controllers of the run deleted by the one that takes the run over."""

import datetime as dt
import os
from pathlib import Path
import stat

import yaml

from appliance import flows
from appliance.flows import credential
from appliance.sites.openstack import RUN_CLOUD, RUN_CLOUD_ENV
from fakes import FakeSite, fault
from test_fake_site import spec_of


def _ctx(tmp_path, name="cr", limits=""):
    return flows.RunContext(spec_of(tmp_path, name, lease=f"lease: {{duration: 2h}}\n{limits}"), FakeSite())


def test_the_controller_gets_an_unrestricted_expiring_credential_in_a_private_file_not_in_its_environment(
        tmp_path, monkeypatch):
    ctx = _ctx(tmp_path, limits="limits: {deadline: '2026-12-24 12:00'}\n")
    made = credential.make(ctx, tmp_path)
    (cred,) = ctx.site.cloud.app_creds.values()
    assert cred["unrestricted"] and cred["expires_at"] == dt.datetime(2026, 12, 25, 12, 0)  # a day past the deadline
    assert cred["name"] == "appliance-run-cr-20261123120000"
    path = tmp_path / f"controller-cloud-20261123120000-{os.getpid()}.yaml"  # this controller's own file
    assert made == {RUN_CLOUD_ENV: str(path), credential.CRED_ENV: cred["id"],
                    credential.EXPIRES_ENV: "2026-12-25 12:00"}
    assert stat.S_IMODE(path.stat().st_mode) == 0o600
    entry = yaml.safe_load(path.read_text())["clouds"][RUN_CLOUD]
    assert entry["auth_type"] == "v3applicationcredential" and entry["auth"]["application_credential_secret"] == "s3cret"
    monkeypatch.setenv("OS_PASSWORD", "hunter2")
    monkeypatch.setenv("OS_AUTH_URL", "https://kvm.tacc.chameleoncloud.org:5000/v3")
    env = credential.controller_env(made)
    assert not [k for k in env if k.startswith("OS_")] and env[credential.CRED_ENV] == cred["id"]
    assert "s3cret" not in "".join(env.values())  # the secret is in the file only
    monkeypatch.setattr(os, "environ", {**os.environ, **made})  # the controller, at the run's end
    credential.drop(ctx)
    assert not ctx.site.cloud.app_creds and not path.exists()


def test_without_a_deadline_it_expires_after_run_credential_days(tmp_path):
    ctx = _ctx(tmp_path)
    credential.make(ctx, tmp_path)
    (cred,) = ctx.site.cloud.app_creds.values()
    assert cred["expires_at"] == ctx.site.cloud.clock + dt.timedelta(days=credential.RUN_CREDENTIAL_DAYS)


def test_when_keystone_refuses_it_the_controller_keeps_your_credential_and_says_so(tmp_path, monkeypatch, said):
    ctx = _ctx(tmp_path)
    ctx.site.cloud.faults["create_app_cred"] = fault("Keystone refused an application credential (403: Using "
                                                     "method 'application_credential' is not allowed)")
    monkeypatch.setenv("OS_CLOUD", "chameleon")
    assert credential.make(ctx, tmp_path) == {} and credential.controller_env({})["OS_CLOUD"] == "chameleon"
    assert any("runs with your own credential" in m for m in said)


def test_a_controller_that_takes_the_run_over_deletes_the_credentials_of_those_before_it(tmp_path, monkeypatch):
    ctx = _ctx(tmp_path, "cr")
    c = ctx.site.cloud
    old = c.create_app_cred("appliance-run-cr-20261120080000", expires_at=None, unrestricted=True)
    own = c.create_app_cred("appliance-run-cr-20261123120000", expires_at=None, unrestricted=True)
    other_run = c.create_app_cred("appliance-run-cr-2-20261120080000", expires_at=None, unrestricted=True)
    job = c.create_app_cred("appliance-cr-job-1", expires_at=None)
    monkeypatch.setenv(credential.CRED_ENV, own["id"])
    credential.forget_others(ctx)
    assert set(c.app_creds) == {own["id"], other_run["id"], job["id"]} and old["id"] not in c.app_creds


def _two_sites(tmp_path):
    import dataclasses

    from appliance.spec import Alternative

    spec = spec_of(tmp_path, "cs", lease="lease: {duration: 2h}\n")
    spec = dataclasses.replace(spec, nodes=dataclasses.replace(
        spec.nodes, alternatives=(Alternative("gpu_local"), Alternative("gpu_local", "CHI@local2"))))
    ctx = flows.RunContext(spec, FakeSite())
    ctx._others["CHI@local2"] = FakeSite()  # the other site: a Keystone of its own
    return ctx, ctx.site.cloud, ctx.at("CHI@local2").cloud


def test_with_an_alternative_at_another_site_the_controller_gets_a_credential_there_too(tmp_path, monkeypatch):
    """Each site's Keystone is its own (a credential of CHI@UC is refused at CHI@TACC): one credential at each site
    the run may lease at, one clouds.yaml entry each (connect picks it by region), both deleted at the end."""
    ctx, home, there = _two_sites(tmp_path)
    made = credential.make(ctx, tmp_path)
    (mine,), (theirs,) = home.app_creds.values(), there.app_creds.values()
    assert mine["unrestricted"] and theirs["unrestricted"] and made[credential.CRED_ENV] == mine["id"]
    assert made[credential.ELSEWHERE_ENV] == f"CHI@local2={theirs['id']}"
    entries = yaml.safe_load(Path(made[RUN_CLOUD_ENV]).read_text())["clouds"]
    assert [e["auth"]["application_credential_id"] for e in entries.values()] == [mine["id"], theirs["id"]]
    assert list(entries)[0] == RUN_CLOUD
    monkeypatch.setattr(os, "environ", {**os.environ, **made})
    credential.forget_others(ctx)  # its own, at both sites, stay
    assert len(home.app_creds) == len(there.app_creds) == 1
    credential.drop(ctx)
    assert not home.app_creds and not there.app_creds


def test_when_the_other_site_refuses_no_credential_is_kept(tmp_path, said):
    ctx, home, there = _two_sites(tmp_path)
    there.faults["create_app_cred"] = fault("Keystone refused an application credential (403)")
    assert credential.make(ctx, tmp_path) == {} and not home.app_creds
    assert any("runs with your own credential" in m for m in said)


def test_each_site_is_reached_with_the_clouds_yaml_entry_of_its_region():
    import pytest

    from appliance.errors import ApplianceError
    from appliance.sites.openstack import entry_for_region

    clouds = {"CHI@UC": {"region_name": "CHI@UC"}, "tacc": {"region_name": "CHI@TACC"},
              "any": {}, "many": {"regions": ["RegionOne", {"name": "RegionTwo"}]}}
    assert entry_for_region(clouds, "CHI@UC", "CHI@TACC") == "tacc"
    assert entry_for_region(clouds, "CHI@UC", "CHI@UC") == "CHI@UC"
    assert entry_for_region(clouds, "any", "CHI@TACC") == "any"  # an entry with no region: the region is asked of it
    assert entry_for_region(clouds, "CHI@UC", "RegionTwo") == "many"
    with pytest.raises(ApplianceError, match="no entry is for site CHI@NCAR in clouds.yaml .OS_CLOUD=CHI@UC is CHI@UC"):
        entry_for_region(clouds, "CHI@UC", "CHI@NCAR")
    with pytest.raises(ApplianceError, match="2 entries .CHI@UC, again. are for site CHI@UC"):
        entry_for_region({**clouds, "again": {"region_name": "CHI@UC"}}, "tacc", "CHI@UC")
    pw = {"tacc": {"region_name": "CHI@TACC", "auth_type": "v3applicationcredential"},  # a credential, a password
          "tacc-pw": {"region_name": "CHI@TACC", "auth_type": "password"},
          "uc": {"region_name": "CHI@UC", "auth_type": "password"}}
    assert entry_for_region(pw, "uc", "CHI@TACC") == "tacc-pw"  # the same kind as OS_CLOUD's


def test_an_other_site_without_a_credential_of_yours_stops_the_run_before_it_starts(tmp_path):
    import pytest

    from appliance.errors import ApplianceError

    ctx, home, there = _two_sites(tmp_path)

    class Unreached:
        @property
        def cloud(self):
            raise ApplianceError("no entry is for site CHI@local2 in clouds.yaml", "add one")
    ctx._others["CHI@local2"] = Unreached()
    with pytest.raises(ApplianceError, match="no entry is for site CHI@local2"):
        credential.make(ctx, tmp_path)
    assert not home.app_creds  # nothing was made
