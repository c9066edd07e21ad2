"""Start, stop and inspect the local cloud (see server.py for what it simulates).

State lives in $APPLIANCE_HOME/localcloud: credentials.json and clouds.yaml (both 0600, the
secrets never on a command line), the server's pid, endpoint and log. ``cloud: local`` in a spec
uses the clouds.yaml entry ``appliance-local`` (an application credential, as on Chameleon).

The local cloud has two sites, as Chameleon has CHI@UC and CHI@TACC: ``CHI@local`` (the default) and
``CHI@local2``, each a server of its own (Keystone with its own users and credentials, Blazar and its hosts, Nova,
Glance, a metadata service), on a testbed of its own, in $APPLIANCE_HOME/localcloud-local2 with the clouds.yaml entry
``appliance-local2``. The second starts when first used. The two share one clock (localcloud-clock.json), as
Chameleon's sites keep UTC. Only the first runs an object store: a run keeps its checkpoints at its own site.
"""

from __future__ import annotations

import json
import os
import secrets
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request
import uuid
from pathlib import Path

import yaml

from .. import paths, report, testbed
from ..errors import ApplianceError

log = report.get(__name__)

CLOUD_NAME = "appliance-local"
# the Keystone user the local RGW validates tokens as (kolla-ansible ceph-guide: ``ceph_rgw_keystone_user``)
RGW_SERVICE_USER = "ceph_rgw"
# Chameleon's bare-metal sites are separate regions, each with its own Keystone, Blazar, Glance and store
# (python-chi chi/context.py use_site builds each site's own auth_url): here two
# servers, one per site. The first is the default, and the only one with an object store (assumed enough: a run
# keeps its checkpoints at its own site); their shared clock is a simplification (real sites keep UTC).
SITES = ("CHI@local", "CHI@local2")


def _site(site: str | None) -> str:
    if site is None:
        return SITES[0]
    if site not in SITES:
        raise ApplianceError(f"{site!r} is not a site of the local cloud", f"use one of {', '.join(SITES)}")
    return site


def _suffix(site: str | None) -> str:
    """"" for the first site, "2" for CHI@local2: its directory's, clouds.yaml entry's and testbed's names."""
    site = _site(site)
    return "" if site == SITES[0] else site.split("@local", 1)[1]


def cloud_name(site: str | None = None) -> str:
    """The site's clouds.yaml entry."""
    return CLOUD_NAME + _suffix(site)


def state_dir(site: str | None = None, make: bool = True) -> Path:
    d = paths.home() / ("localcloud" + (f"-local{_suffix(site)}" if _suffix(site) else ""))
    if make:
        d.mkdir(parents=True, exist_ok=True)
    return d


def _clock_file() -> Path:
    return paths.home() / "localcloud-clock.json"


def _write_private(p: Path, text: str) -> None:
    paths.write_private(p, text.encode())


def _credentials(d: Path) -> dict:
    p = d / "credentials.json"
    if not p.exists():
        creds = {"username": "researcher", "user_id": uuid.uuid4().hex, "password": secrets.token_urlsafe(16),
                 "project_name": "appliance-local", "project_id": uuid.uuid4().hex,
                 "app_cred_name": "appliance", "app_cred_id": uuid.uuid4().hex,
                 "app_cred_secret": secrets.token_urlsafe(24)}
        _write_private(p, json.dumps(creds, indent=2))
    creds = json.loads(p.read_text())
    if "services" not in creds:  # the cloud's own services' Keystone users (the RGW validates tokens as one)
        creds["services"] = {RGW_SERVICE_USER: secrets.token_urlsafe(24)}
        _write_private(p, json.dumps(creds, indent=2))
    return creds


def testbed_name(site: str | None = None) -> str:
    """The testbed a site's servers live on: `cloud` for ~/.appliance, else one per APPLIANCE_HOME, so a test
    run's cloud never touches a user's; a second site's ends in its number."""
    import zlib

    home = paths.home().resolve()
    if home == (Path.home() / ".appliance").resolve():
        return "cloud" + _suffix(site)
    return f"c{zlib.crc32(str(home).encode()) & 0xFFFFF:05x}" + _suffix(site)


def _pid(site: str | None = None) -> int | None:
    p = state_dir(site) / "pid"
    if not p.exists():
        return None
    pid = int(p.read_text())
    try:
        cmd = Path(f"/proc/{pid}/cmdline").read_bytes()
    except OSError:
        return None
    return pid if b"appliance.localcloud.server" in cmd else None


def endpoint(site: str | None = None) -> str | None:
    p = state_dir(site) / "endpoint"
    return p.read_text().strip() if p.exists() and _pid(site) else None


def clouds_yaml(site: str | None = None) -> Path:
    return state_dir(site) / "clouds.yaml"


def _write_clouds_yaml(d: Path, base: str, creds: dict, site: str | None = None) -> None:
    common = {"region_name": _site(site), "interface": "public", "identity_api_version": 3}
    name = cloud_name(site)
    doc = {"clouds": {
        name: {"auth_type": "v3applicationcredential",
               "auth": {"auth_url": f"{base}/identity/v3", "application_credential_id": creds["app_cred_id"],
                        "application_credential_secret": creds["app_cred_secret"]}, **common},
        f"{name}-password": {"auth_type": "password",
                             "auth": {"auth_url": f"{base}/identity/v3", "username": creds["username"],
                                      "password": creds["password"], "project_name": creds["project_name"],
                                      "user_domain_name": "Default", "project_domain_name": "Default"},
                             **common},
    }}
    _write_private(d / "clouds.yaml", yaml.safe_dump(doc, sort_keys=False))


def _public_base(base: str, site: str | None = None) -> str:
    """The API as clouds.yaml names it: on the cloud's bridge, where its servers reach it too (Chameleon's
    endpoints are public: a node and the user's machine use the same Keystone URL), else on 127.0.0.1."""
    tb = testbed.load(testbed_name(site))
    if tb is not None and tb.host_ip:
        public = f"http://{tb.host_ip}:{base.rsplit(':', 1)[1]}"
        if _health(public):
            return public
    return base


def _health(base: str) -> bool:
    if not base.startswith(("http://", "https://")):  # no address yet (a file being written): not up
        return False
    try:
        with urllib.request.urlopen(f"{base}/_admin/health", timeout=2) as r:
            return r.status == 200
    except (OSError, urllib.error.URLError):
        return False


def start(*, time_scale: float = 1.0, port: int = 0, boot_seconds: float = 0.0,
          timeout: float = 30.0, hosts: int | None = None, site: str | None = None,
          clean_seconds: float | None = None, su_budget: float | None = None) -> dict:
    """Start the local cloud (``site``: one of SITES, the first by default) if it is not running. Idempotent.
    ``hosts``: compute_local hosts in Blazar's pool (default 4; the scale benchmark asks for 16). The first site of
    a local cloud to start sets the clock the others follow (its ``time_scale``). ``clean_seconds``: how long a node
    is cleaned after its server's delete (default cloud.CLEAN_SECONDS); ``su_budget``: the project's SUs (default:
    not enforced); both are Chameleon's terms (cloud.py, portal.py), changed later through /_admin/terms."""
    site = _site(site)
    d = state_dir(site)
    if endpoint(site) and _health(endpoint(site)):
        return status(site)
    ok, why = testbed.namespaces_available()
    if not ok:
        raise ApplianceError(f"the local cloud needs network namespaces for its servers: {why}",
                             "run as root on Linux (make deploy / make test do)")
    if not any(_pid(s) for s in SITES):
        _clock_file().unlink(missing_ok=True)  # no site runs: the clock starts afresh, at this one's scale
    creds = _credentials(d)
    (d / "endpoint").unlink(missing_ok=True)
    with open(d / "server.log", "ab") as out:
        proc = subprocess.Popen([sys.executable, "-m", "appliance.localcloud.server", "--state", str(d),
                                 "--port", str(port), "--time-scale", str(time_scale),
                                 "--boot-seconds", str(boot_seconds), "--testbed", testbed_name(site),
                                 "--region", site, "--clock", str(_clock_file()),
                                 *(["--hosts", str(hosts)] if hosts else []),
                                 *(["--clean-seconds", str(clean_seconds)] if clean_seconds is not None else []),
                                 *(["--su-budget", str(su_budget)] if su_budget is not None else [])],
                                stdin=subprocess.DEVNULL, stdout=out, stderr=subprocess.STDOUT,
                                start_new_session=True, env={**os.environ, "PYTHONUNBUFFERED": "1"})
    (d / "pid").write_text(str(proc.pid))
    (d / "python").write_text(sys.executable)  # its image's stack (image_python)
    deadline = time.monotonic() + timeout
    while True:
        ep = d / "endpoint"
        if ep.exists() and _health(ep.read_text().strip()):
            break
        if proc.poll() is not None:
            tail = (d / "server.log").read_text()[-600:]
            raise ApplianceError(f"the local cloud exited at start: {tail.strip()}", f"see {d / 'server.log'}")
        if time.monotonic() > deadline:
            proc.kill()
            raise ApplianceError("the local cloud did not answer within 30 s", f"see {d / 'server.log'}")
        time.sleep(0.05)  # readiness poll of a local port
    base = _public_base((d / "endpoint").read_text().strip(), site)
    _write_clouds_yaml(d, base, creds, site)
    log.info(f"local cloud {site} up at {base} (time x{time_scale:g}); clouds.yaml entry {cloud_name(site)!r} in "
             f"{clouds_yaml(site)}")
    return status(site)


STORES = ("rgw", "swift")


def store_kind() -> str:
    """Which object store the local cloud runs: APPLIANCE_LOCAL_STORE (`rgw` or `swift`); by default a real Ceph RGW,
    Chameleon's own store (ChameleonCloud/docs `swift/index.rst`), when its packages are installed."""
    from . import rgw_server

    kind = os.environ.get("APPLIANCE_LOCAL_STORE", "").strip().lower()
    if kind and kind not in STORES:
        raise ApplianceError(f"APPLIANCE_LOCAL_STORE={kind!r} is not an object store of the local cloud",
                             f"use one of {', '.join(STORES)}")
    return kind or ("rgw" if rgw_server.installed() else "swift")


def _store_server(kind: str, d: Path, bind_ip: str = "127.0.0.1"):
    from .rgw_server import RGWServer
    from .swift_server import SwiftServer

    return (RGWServer if kind == "rgw" else SwiftServer)(d / kind, bind_ip=bind_ip)


def object_store() -> dict:
    """The local cloud's object store, started on first use: a real Ceph RGW (or a real Swift, see ``store_kind``),
    listening on the cloud's bridge address so its servers reach it. The RGW takes Keystone tokens as Chameleon's
    does (the catalog's object-store endpoint) and Swift v1 auth. Returns its v1 and S3 credentials."""
    d = state_dir()
    start()
    kind = store_kind()
    creds_file = d / "store.json"
    private = ("kind", "keystone")
    if creds_file.exists():
        creds = json.loads(creds_file.read_text())
        if creds.get("kind") == kind and _store_answers(creds):
            return {k: v for k, v in creds.items() if k not in private}
        _store_server(creds.get("kind", kind), d).stop()  # another kind, or one that died: start afresh
    srv = _store_server(kind, d, bind_ip=testbed.load(testbed_name()).host_ip)
    if kind == "rgw":  # how long its Swift tokens live (a day, as Chameleon's Keystone tokens); tests use seconds
        srv.token_seconds = int(os.environ.get("APPLIANCE_LOCAL_TOKEN_SECONDS", "86400"))
        cloud_creds = _credentials(d)
        srv.uid = cloud_creds["project_id"]
        srv.keystone = {"url": f"{endpoint()}/identity", "user": RGW_SERVICE_USER,
                        "password": cloud_creds["services"][RGW_SERVICE_USER], "project": "service",
                        "domain": "Default"}
        log.info("starting the local object store (Ceph RGW: mon, memstore OSD, radosgw) ...")
    srv.start()
    creds = srv.credentials()
    _write_private(creds_file, json.dumps({**creds, "kind": kind, "keystone": kind == "rgw"}))
    log.info(f"local object store ({'Ceph RGW' if kind == 'rgw' else 'OpenStack Swift'}) at {creds['s3_endpoint']}")
    return creds


def store_takes_keystone() -> bool:
    """The running store validates Keystone tokens (the RGW; the catalog then lists it as object-store)."""
    p = state_dir() / "store.json"
    return p.exists() and bool(json.loads(p.read_text()).get("keystone"))


def _store_answers(creds: dict) -> bool:
    """The store answers v1 auth with the saved credentials (RGW and Swift both serve /auth/v1.0)."""
    req = urllib.request.Request(creds["auth_url"], headers={"X-Auth-User": creds["user"], "X-Auth-Key": creds["key"]})
    try:
        with urllib.request.urlopen(req, timeout=3) as r:
            return r.status in (200, 204)
    except OSError:
        return False


def account_usage(auth_url: str, user: str, key: str) -> dict | None:
    """What a store's account holds, by Swift v1 auth, the account listing and each container's HEAD (RGW and Swift
    both serve them; Swift's account listing counts lag, its updater sums them later): {"containers", "objects",
    "bytes"}; None when it does not answer."""
    from urllib.parse import quote

    def ask(url: str, token: str | None, method: str = "GET"):
        req = urllib.request.Request(url, method=method, headers={"X-Auth-Token": token} if token else
                                     {"X-Auth-User": user, "X-Auth-Key": key})
        with urllib.request.urlopen(req, timeout=30) as r:
            return r.headers, r.read()

    try:
        hdrs, _ = ask(auth_url, None)
        url, token = hdrs["X-Storage-Url"], hdrs["X-Auth-Token"]
        names = [c["name"] for c in json.loads(ask(f"{url}?format=json", token)[1] or b"[]")]
        heads = [ask(f"{url}/{quote(n)}", token, "HEAD")[0] for n in names]
        return {"containers": len(names), "objects": sum(int(h.get("X-Container-Object-Count", 0)) for h in heads),
                "bytes": sum(int(h.get("X-Container-Bytes-Used", 0)) for h in heads)}
    except (OSError, ValueError, KeyError, TypeError):
        return None


def _say_what_the_store_loses(d: Path) -> None:
    """The local store keeps its objects in memory (the RGW's memstore OSD): stopping it loses them. Said, with how
    much, before they go (issue 49: a user of the default lost every dataset and checkpoint without a word)."""
    try:
        creds = json.loads((d / "store.json").read_text())
    except (OSError, ValueError):
        return
    used = account_usage(creds["auth_url"], creds["user"], creds["key"])
    if used and used["objects"]:
        log.info(f"the local object store is emptied as it stops: {used['objects']} object(s), "
                 f"{used['bytes'] / 1e6:.1f} MB in {used['containers']} container(s) are gone with it (it keeps them "
                 "in memory; Chameleon's store keeps them)")


def stop(timeout: float = 30.0) -> bool:
    """Stop the local cloud, every site of it: its servers (testbed nodes) are deleted, its object store stopped (and
    emptied: said with what it held). Idempotent."""
    ran = [_stop_site(site, timeout) for site in SITES]
    _clock_file().unlink(missing_ok=True)
    log.info("local cloud stopped" if any(ran) else "local cloud was not running")
    return any(ran)


def _stop_site(site: str, timeout: float) -> bool:
    if site != SITES[0] and not state_dir(site, make=False).exists():
        return False  # never started here
    pid = _pid(site)
    d = state_dir(site)
    _say_what_the_store_loses(d)
    for kind in STORES:
        if (d / kind).exists():
            _store_server(kind, d).stop()
    (d / "store.json").unlink(missing_ok=True)
    if pid:
        os.kill(pid, signal.SIGTERM)
        deadline = time.monotonic() + timeout
        while _pid(site) and time.monotonic() < deadline:
            time.sleep(0.05)  # bounded wait for its clean shutdown
        if _pid(site):
            os.kill(pid, signal.SIGKILL)
            deadline = time.monotonic() + 10
            while _pid(site) and time.monotonic() < deadline:
                time.sleep(0.05)  # the kernel ends it, and only then lets go of its locks
    if pid or site == SITES[0]:
        with report.muted():
            # whatever a crashed server left; a server slow to stop (a loaded machine) may still hold the testbed's
            # lock for a moment: stopping the cloud waits for it, where two CLI commands on one testbed do not
            testbed.down(testbed_name(site), wait=30.0)
    for name in ("pid", "endpoint"):
        (d / name).unlink(missing_ok=True)
    return bool(pid)


def image_python(site: str | None = None) -> str:
    """The stack's Python on the local cloud's nodes: the install that started the cloud. Its nodes share this
    machine's file system, so its appliance-cpu image has the full install's stack, also when a client install
    (`pip install .`, no TensorFlow) drives it."""
    p = state_dir(_site(site)) / "python"
    return p.read_text().strip() if p.is_file() else sys.executable


def status(site: str | None = None) -> dict:
    base = endpoint(site)
    info = {"running": bool(base and _health(base)), "endpoint": base, "pid": _pid(site),
            "clouds_yaml": str(clouds_yaml(site)), "cloud": cloud_name(site), "site": _site(site)}
    if info["running"]:
        info.update(admin("GET", "/clock", site=site))
        info.update(admin("GET", "/terms", site=site))
    return info


def admin(method: str, path: str, body: dict | None = None, *, site: str | None = None) -> dict:
    """Call the local cloud's test hooks (/_admin): advance the clock (every site's), inject faults, read
    requests (``site``'s)."""
    base = endpoint(site)
    if not base:
        raise ApplianceError("the local cloud is not running", "run `appliance cloud start`")
    data = json.dumps(body).encode() if body is not None else None
    req = urllib.request.Request(f"{base}/_admin{path}", data=data, method=method,
                                 headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=30) as r:
        raw = r.read()
    return json.loads(raw) if raw else {}
