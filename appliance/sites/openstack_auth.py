"""Keystone credentials: an openstacksdk Connection from clouds.yaml (OS_CLOUD) or the OS_* variables (openrc), and
the clouds.yaml entry of each Chameleon site; every way it can fail said in one line with the fix. Its one session
re-sends what is safe to send again (read_retry_session)."""

from __future__ import annotations

import functools
import os
import sys

from ..errors import ApplianceError, socket_reason
from .openstack_api import EXPIRED, RENEW

# What keystoneauth sends again by itself (keystoneauth1/session.py `Session._send_request`: ``connect_retries`` for
# a connection refused or reset and for a timeout, ``status_code_retries`` for ``retriable_status_codes``, each with
# its exponential back-off from 0.5 s, or ``*_retry_delay`` apart): only what may be sent twice. A read, or a DELETE
# of a known id (a second one is a 404: "already gone"); and Keystone's token POST (a second token harms nothing).
# Never another POST, PUT or PATCH: keystoneauth would re-send any method, a read timeout included, and a lease or
# a server asked for twice is two (Blazar and Nova allow two of one name); those are found by name instead
# (OpenStackCloud.create_lease, create_server). Blazar answers any error that is not its own with a bare 500
# (ChameleonCloud/blazar blazar/api/v1/utils.py `Rest.route`): a read answered 500 is read again too.
SAFE_METHODS = frozenset({"GET", "HEAD", "DELETE"})
# 0.5 + 1 + 2 + 4 + 8 s of back-off: a gateway's restart or a service's short outage passes (longer outages: a managed
# run waits for the cloud, flows/recovery.py); APPLIANCE_CLOUD_RETRIES sets another count (0: none, as a script that
# would rather fail at once asks)
RETRIES = int(os.environ.get("APPLIANCE_CLOUD_RETRIES", "5"))
RETRIABLE = [429, 500, 502, 503, 504]
RETRY_DELAY: float | None = None  # None: keystoneauth's exponential back-off (the fast tests set a fixed one)
READ_TIMEOUT = (15.0, 120.0)  # (connect, read) seconds of a read with no api_timeout: a hung read is retried


def retry_policy(url: str, method: str, kwargs: dict, timeout: float | None) -> dict:
    """keystoneauth's retry settings for one request: retries for a safe one, none for any other."""
    if method.upper() in SAFE_METHODS or (kwargs.get("authenticated") is False and "/auth/tokens" in url):
        return {"connect_retries": RETRIES, "status_code_retries": RETRIES, "retriable_status_codes": RETRIABLE,
                "connect_retry_delay": RETRY_DELAY, "status_code_retry_delay": RETRY_DELAY,
                "timeout": kwargs.get("timeout") or timeout or READ_TIMEOUT}
    return {"connect_retries": 0, "status_code_retries": 0}


@functools.cache
def read_retry_session() -> type:
    """The keystoneauth Session class of every OpenStack call (openstacksdk's proxies, blazarclient's adapter,
    Keystone itself): each request with retry_policy's settings, over whatever openstacksdk's config or a proxy
    set. (keystoneauth is imported once a connection is made, not with the CLI.)"""
    from keystoneauth1 import session as ks_session

    class ReadRetrySession(ks_session.Session):
        def request(self, url, method, **kwargs):  # type: ignore[override]
            return super().request(url, method, **{**kwargs, **retry_policy(url, method, kwargs, self.timeout)})

    return ReadRetrySession



def _unreachable(where: str, region_cfg, text: str) -> ApplianceError:
    """Keystone not reached: its URL and the socket's reason ("Connection refused", "Name or service not known",
    "timed out"), not urllib3's chain of wrappers around it."""
    url = ((getattr(region_cfg, "config", None) or {}).get("auth") or {}).get("auth_url")
    return ApplianceError(f"cannot reach Keystone{f' at {url}' if url else ''} for {where} ({socket_reason(text)})",
                          "check auth_url / OS_AUTH_URL and the network")


def _no_plugin(where: str, name: str) -> ApplianceError:
    """clouds.yaml names an auth_type no installed package provides: keystoneauth's NoMatchingPlugin. `ccauth
    clouds-yaml` writes ``v3chameleonoidc``, a plugin of ChameleonCloud/ccauth, loaded only from the same Python."""
    py = sys.executable
    if name.startswith("v3chameleon"):
        return ApplianceError(f"{where} has auth_type {name}, a keystoneauth plugin of Chameleon's ccauth package, "
                              f"which is not installed in this Python ({py})",
                              f"`{py} -m pip install ccauth`; a uv tool install: `uv tool install --with ccauth .`")
    return ApplianceError(f"{where} has auth_type {name!r}, which no keystoneauth plugin installed in this Python "
                          f"({py}) provides", "check auth_type (v3applicationcredential, v3password, ...), or install "
                          f"the package that provides it: `{py} -m pip install PACKAGE`")


def clouds_yaml_places(config_file: str | None = None) -> list[str]:
    """Where openstacksdk looks for clouds.yaml, in its order (the first found is read): OS_CLIENT_CONFIG_FILE, then
    openstack/config/loader.py CONFIG_FILES (the working directory, the user's config directories, the system's),
    each also as clouds.yml and clouds.json, named here once as clouds.yaml; ``config_file``: the only one read."""
    from openstack.config import loader

    if config_file:
        return [config_file]
    home, cwd = os.path.expanduser("~"), os.getcwd()
    places = []
    for p in loader.CONFIG_FILES:
        if not p.endswith(f"{os.sep}clouds.yaml"):
            continue
        if os.path.dirname(p) == cwd:
            p = f".{os.sep}clouds.yaml"
        elif p.startswith(home + os.sep):
            p = "~" + p[len(home):]
        if p not in places:
            places.append(p)
    env = os.environ.get("OS_CLIENT_CONFIG_FILE")
    return [f"OS_CLIENT_CONFIG_FILE={env}"] * bool(env) + places


def _no_entry(cloud: str, cfg, config_file: str | None) -> ApplianceError:
    """OS_CLOUD names no entry of the clouds.yaml openstacksdk read (or it found none): which file it read and its
    entries, and where it looked."""
    places = ", ".join(clouds_yaml_places(config_file))
    if cfg.config_filename:
        names = [n for n in cfg.get_cloud_names() if n != cfg.envvar_key]
        return ApplianceError(f"OS_CLOUD={cloud}: no such entry in {cfg.config_filename} (its entries: "
                              f"{', '.join(names) or 'none'}; clouds.yaml is looked for in {places}, the first found "
                              "is read)", f"set OS_CLOUD to one of its entries, or add an entry {cloud} with your "
                              "credential: docs/chameleon.md, step 1")
    return ApplianceError(f"OS_CLOUD={cloud}: no clouds.yaml found (looked for: {places}; .yml and .json too)",
                          "put your credential's clouds.yaml in ~/.config/openstack/clouds.yaml, or point "
                          "OS_CLIENT_CONFIG_FILE at it: the site's dashboard gives one (Identity > Application "
                          "Credentials), and so does `cc-login --output-clouds-yaml ~/.config/openstack/clouds.yaml`")


RUN_CLOUD_ENV = "APPLIANCE_RUN_CLOUD"  # a clouds.yaml whose entry RUN_CLOUD holds a managed run's own credential
RUN_CLOUD = "appliance-run"


def connect(*, cloud: str | None = None, config_file: str | None = None, region: str | None = None):
    """An openstacksdk Connection from clouds.yaml (+ OS_CLOUD) or OS_* variables (openrc).

    Raises ApplianceError naming the variable or clouds.yaml entry to fix.
    """
    import keystoneauth1.exceptions as ksa
    import openstack
    import openstack.config
    import openstack.exceptions

    if os.environ.get(RUN_CLOUD_ENV):  # a managed run's controller: its own credential (flows/credential.py)
        cloud, config_file = RUN_CLOUD, os.environ[RUN_CLOUD_ENV]
    cloud = cloud or os.environ.get("OS_CLOUD")
    where = f"clouds.yaml entry {cloud!r}" if cloud else "the OS_* variables (openrc)"
    if not cloud and not os.environ.get("OS_AUTH_URL"):
        raise ApplianceError("no OpenStack credentials: neither OS_CLOUD nor OS_AUTH_URL is set",
                             "export OS_CLOUD=<your clouds.yaml entry>, or source your site's openrc "
                             "(see docs/chameleon.md)")
    region_cfg = None
    try:
        files = [config_file] if config_file else None
        cfg = openstack.config.OpenStackConfig(config_files=files) if files else openstack.config.OpenStackConfig()
        if cloud and cloud not in cfg.get_cloud_names():
            raise _no_entry(cloud, cfg, config_file)
        if region and (cloud or os.environ.get("OS_REGION_NAME") not in (None, region)):
            cloud = entry_for_region(cfg.cloud_config.get("clouds") or {}, cloud, region)
            where = f"clouds.yaml entry {cloud!r}"
        region_cfg = cfg.get_one(cloud=cloud, region_name=region) if cloud else \
            cfg.get_one(region_name=region, load_envvars=True)
        region_cfg.set_session_constructor(read_retry_session())
        conn = openstack.connection.Connection(config=region_cfg)
        conn.authorize()
    except openstack.exceptions.ConfigException as e:
        raise ApplianceError(f"OpenStack configuration: {e}",
                             f"check OS_CLOUD={cloud} names an entry in clouds.yaml" if cloud
                             else "check OS_AUTH_URL, OS_REGION_NAME and the other OS_* variables") from None
    except (ksa.Unauthorized, openstack.exceptions.SDKException) as e:
        text = str(e)
        if isinstance(e, ksa.Unauthorized) or "401" in text or "requires authentication" in text:
            raise ApplianceError(f"OpenStack rejected the credentials in {where} (401 Unauthorized: {EXPIRED})",
                                 f"{RENEW}; to lease, an application credential must be unrestricted "
                                 "(docs/chameleon.md)") from None
        if "Unable to establish connection" in text or "Connection" in text:
            raise _unreachable(where, region_cfg, text) from None
        raise ApplianceError(f"OpenStack authentication with {where} failed: {text}") from None
    except ksa.NoMatchingPlugin as e:
        raise _no_plugin(where, e.name) from None
    except ksa.MissingRequiredOptions as e:
        names = ", ".join(o.dest for o in e.options)
        raise ApplianceError(f"{where} lacks {names}", "add it to clouds.yaml or export the OS_* variable") from None
    except ksa.ConnectFailure as e:
        raise _unreachable(where, region_cfg, str(e)) from None
    except ksa.EndpointNotFound as e:
        raise ApplianceError(f"{where}: {e}", "check region_name / OS_REGION_NAME (e.g. CHI@UC, CHI@TACC)") from None
    return conn


def entry_for_region(clouds: dict, cloud: str | None, region: str) -> str:
    """The clouds.yaml entry for the site ``region``: ``cloud`` when it is that site's (or names no region), else
    the one entry whose region is ``region`` (of those, the one with ``cloud``'s auth_type). Each Chameleon site is its own region with its own Keystone, so a
    credential (an application credential above all) is a site's own (python-chi chi/context.py use_site; Horizon's
    "OpenStack clouds.yaml File" at each site gives its entry); a run at CHI@UC with an alternative at CHI@TACC
    reaches TACC with TACC's entry."""
    def regions(entry: dict) -> list[str]:
        listed = entry.get("regions") or ([entry["region_name"]] if entry.get("region_name") else [])
        return [r if isinstance(r, str) else r.get("name") for r in listed]

    own = regions(clouds.get(cloud) or {}) if cloud else []
    if cloud and (not own or region in own):
        return cloud
    found = [name for name, entry in clouds.items() if region in regions(entry or {})]
    if len(found) > 1 and cloud:  # several for the site (a credential and a password): the one of the same kind
        kind = (clouds.get(cloud) or {}).get("auth_type")
        found = [name for name in found if clouds[name].get("auth_type") == kind] or found
    if len(found) == 1:
        return found[0]
    why = f"{len(found)} entries ({', '.join(found)}) are" if found else "no entry is"
    raise ApplianceError(f"{why} for site {region} in clouds.yaml" + (f" (OS_CLOUD={cloud} is {', '.join(own)})"
                                                                      if cloud else ""),
                         f"each Chameleon site has its own Keystone: add one entry with region_name: {region} and a "
                         "credential of that site (docs/chameleon.md, Several sites)")
