"""A managed run's own credential (issue 52 item 4): `appliance run SPEC` makes its controller a Keystone application
credential of its own, so the detached controller holds neither your password nor your own credential, and that
credential goes when the run ends.

What it is, and why no less:
- *unrestricted*. The controller books leases, and Blazar makes a Keystone trust for each (ChameleonCloud/blazar
  blazar/utils/trusts.py); Keystone refuses a trust to a restricted application credential's token
  (openstack/keystone keystone/api/trusts.py ``_check_unrestricted``). It also makes each job's own restricted
  credential, which only an unrestricted one may (keystone/api/users.py ``UserAppCredListCreateResource.post``,
  ``_check_unrestricted_application_credential``);
- your roles on the run's project and no more (keystone/api/users.py ``_get_roles``: the creating token's roles);
- it expires a day after ``limits.deadline``, else ``RUN_CREDENTIAL_DAYS`` after the start (Keystone refuses it
  after ``expires_at``: keystone/application_credential/backends/sql.py ``_check_expired``); a run longer than that is
  continued by `appliance run SPEC` again, which makes a new one;
- the controller deletes it as the run ends (an unrestricted credential may: keystone/api/users.py
  ``UserAppCredGetDeleteResource.delete``), and one that takes the run over deletes those of the controllers before
  it (they are gone: it holds the run's lock).

It reaches the controller as a clouds.yaml of its own (mode 0600, in ~/.appliance/runs/RUN/, one file per
controller), named by
APPLIANCE_RUN_CLOUD in the controller's environment, from which your OS_* variables are removed; its secret is in
no argument, log or environment. When Keystone will not make it (your own credential is a restricted one), the
controller runs with yours, and says so.

A run with an alternative at another site (nodes.alternatives: CHI@TACC for a run at CHI@UC) gets one such
credential at each site, each from that site's own Keystone (a credential is a site's own: each site is a region with its own
Keystone, python-chi chi/context.py use_site), one clouds.yaml entry each; when one site refuses, none is kept and the controller runs with yours.
"""

from __future__ import annotations

import datetime as dt
import os
import re
from pathlib import Path

from .. import report
from ..errors import ApplianceError
from ..sites.openstack import RUN_CLOUD, RUN_CLOUD_ENV
from ..spec import deadline_of

log = report.get(__name__)

RUN_CREDENTIAL_DAYS = 60
CRED_ENV = "APPLIANCE_RUN_CREDENTIAL"  # its id (never its secret), in the controller's environment
ELSEWHERE_ENV = "APPLIANCE_RUN_CREDENTIALS_ELSEWHERE"  # "SITE=id,...": those at the run's other sites
EXPIRES_ENV = "APPLIANCE_RUN_CREDENTIAL_EXPIRES"  # and when it expires (UTC)
PREFIX = "appliance-run-"


def _name_re(run: str) -> re.Pattern:
    return re.compile(rf"{re.escape(PREFIX + run)}-\d{{14}}")


def _other_sites(spec) -> list[str]:
    """The sites other than the run's own that its alternatives name, in order."""
    return list(dict.fromkeys(a.site for a in spec.nodes.alternatives if a.site not in (None, spec.site)))


def make(ctx, where: Path) -> dict[str, str]:
    """A credential of the run's controller's own at each site the run may lease at, and its clouds.yaml in
    ``where``; returns what the controller's environment adds (controller_env), or {} when Keystone refused one
    (the controller then runs with yours)."""
    spec = ctx.spec
    now = ctx.site.cloud.now()
    deadline = deadline_of(spec)
    expires = deadline + dt.timedelta(days=1) if deadline else now + dt.timedelta(days=RUN_CREDENTIAL_DAYS)
    made: list[tuple[str | None, object, dict]] = []  # (site, its client, the credential)
    # each site reached first: one without a credential of yours (no clouds.yaml entry for it) stops the run here
    clients = [(site, ctx.at(site).cloud) for site in [None, *_other_sites(spec)]]
    try:
        for site, c in clients:
            made.append((site, c, c.create_app_cred(
                f"{PREFIX}{spec.name}-{now:%Y%m%d%H%M%S}", expires_at=expires, unrestricted=True,
                description=f"appliance run {spec.name}: its controller books leases and servers; deleted when the "
                            "run ends")))
    except ApplianceError as e:
        for _, c, cred in made:  # those the other sites made go: none is kept
            try:
                c.delete_app_cred(cred["id"])
            except Exception as gone:  # noqa: BLE001 - it expires by itself
                log.info(f"[run] warning: credential {cred['id'][:8]} was not deleted ({gone}); it expires by itself")
        log.info(f"[run] warning: the controller runs with your own credential: Keystone refused it one of its own "
                 f"({e.message}); docs/managed.md (credentials) says what to give it")
        return {}
    entries = {RUN_CLOUD if site is None else f"{RUN_CLOUD}-{n}": _entry(c, cred)
               for n, (site, c, cred) in enumerate(made)}
    import yaml

    path = where / f"controller-cloud-{now:%Y%m%d%H%M%S}-{os.getpid()}.yaml"  # this controller's own: another
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    with os.fdopen(fd, "w") as f:
        f.write(yaml.safe_dump({"clouds": entries}, sort_keys=False))
    others = ",".join(f"{site}={cred['id']}" for site, _, cred in made[1:])
    return {RUN_CLOUD_ENV: str(path), CRED_ENV: made[0][2]["id"], EXPIRES_ENV: f"{expires:%Y-%m-%d %H:%M}",
            **({ELSEWHERE_ENV: others} if others else {})}


def _entry(c, cred: dict) -> dict:
    """The clouds.yaml entry of a credential made at the site ``c`` is a client of."""
    entry = {"auth_type": "v3applicationcredential", "region_name": c.region_name(), "interface": "public",
             "identity_api_version": 3,
             "auth": {"auth_url": c.identity_url(), "application_credential_id": cred["id"],
                      "application_credential_secret": cred["secret"]}}
    mine = getattr(getattr(c, "conn", None), "config", None)
    for k in ("verify", "cacert"):  # how your clouds.yaml reaches Keystone (a private CA), the same for it
        if mine is not None and mine.config.get(k) is not None:
            entry[k] = mine.config[k]
    return entry


def _own(env) -> dict[str | None, str]:
    """The controller's own credentials by site (None: the run's own site), from its environment."""
    own = {None: env[CRED_ENV]} if env.get(CRED_ENV) else {}
    for item in filter(None, (env.get(ELSEWHERE_ENV) or "").split(",")):
        site, _, cid = item.rpartition("=")
        own[site] = cid
    return own


def controller_env(extra: dict[str, str]) -> dict[str, str]:
    """The detached controller's environment: with its own credential, none of your OS_* variables."""
    if not extra:
        return dict(os.environ)
    return {k: v for k, v in os.environ.items() if not k.startswith("OS_")} | extra


def forget_others(ctx) -> None:
    """A controller with a credential of its own: the run's credentials made for controllers before it (gone: it
    holds the run's lock) are deleted, at each site. A failure is said; they expire anyway."""
    own = _own(os.environ)
    if not own:
        return
    pattern = _name_re(ctx.spec.name)
    try:
        for site in [None, *_other_sites(ctx.spec)]:
            c = ctx.at(site).cloud
            for x in c.list_app_creds():
                if x.get("id") not in own.values() and pattern.fullmatch(x.get("name") or ""):
                    c.delete_app_cred(x["id"])
                    log.info(f"[run] deleted the credential of an earlier controller of run {ctx.spec.name} "
                             f"({x['id'][:8]}{f' at {site}' if site else ''})")
    except Exception as e:  # noqa: BLE001 - they expire by themselves
        log.info(f"[run] warning: could not look for earlier controllers' credentials ({type(e).__name__}: {e})")


def drop(ctx, made: dict[str, str] | None = None) -> None:
    """This controller's own credentials go (the last call it makes: its tokens stop with them), and their file.
    ``made``: those `appliance run` made for a controller that did not start (deleted with your credential)."""
    env = made if made is not None else os.environ
    own, path = _own(env), env.get(RUN_CLOUD_ENV)
    for site, cid in sorted(own.items(), key=lambda x: x[0] is None):  # the run's own site's last
        try:
            ctx.at(site).cloud.delete_app_cred(cid)
        except Exception as e:  # noqa: BLE001 - it expires by itself
            log.info(f"[run] warning: the controller's credential {cid[:8]}{f' at {site}' if site else ''} was not "
                     f"deleted ({type(e).__name__}: {e}); it expires by itself, or delete it in the dashboard: "
                     "Identity -> Application Credentials")
    if own and path:
        Path(path).unlink(missing_ok=True)
