"""The site interface: everything that differs between Chameleon and the local cloud lives behind ``Site``.

A site knows how to connect (``cloud``: the OpenStack client for leases, servers, floating IPs, images), who the
nodes' login user is and where their work directory and Python are, how long to wait for bare metal or
namespaces, how often to poll, how fast the cloud's clock runs, how to get object-store credentials, how to
prepare a node (the NVMe drive on Chameleon), how to install the stack, which spec rules apply (Chameleon's 7-day
cap), and which cluster a run uses when none was brought up (the local testbed). The steps above (provision,
data, train, checkpoint, flows) ask the site; none of them branches on which site it is.

Modelled on SkyPilot's `sky/provision` (one implementation per cloud behind the same verbs) and Ray's
`NodeProvider` (one interface, a local implementation, and an in-process fake for tests: tests/fakes.py).
"""

from __future__ import annotations

import datetime as dt
import os
import secrets
from abc import ABC, abstractmethod
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from ..cluster import Cluster
from ..errors import SpecError
from ..spec import Spec
from ..store.objects import StoreCreds, parse_url

# how long after the lease end a job's application credential lives: the job deletes it when it ends, and a lease
# extension (Blazar moves the end, up to Chameleon's 7-day length at a time) must not outrun it
APP_CRED_AFTER_LEASE = dt.timedelta(days=7)


@dataclass
class LoginKey:
    name: str  # the Nova key pair
    file: str  # its private key on this machine


class Site(ABC):
    kind: str = ""  # the spec's `cloud:` value
    user: str = "root"  # the nodes' login user
    workdir: str = "/tmp"  # node-local disk, before prepare_nodes() picks a better one
    python: str = ""  # the stack's Python on the nodes
    boot_timeout: float = 120.0  # servers ACTIVE within
    # a server finding no valid host is asked for again for this long: its reserved host may still be cleaned
    # after the server that had it (Ironic's cleaning; its length on Chameleon is not public: assumed < 30 min)
    clean_timeout: float = 1800.0
    ssh_timeout: float = 60.0  # the nodes' published host keys, then SSH, within
    poll: float = 0.2  # seconds between API polls while waiting (servers, host keys, SSH)
    lease_poll: float = 0.5  # the lease watchdog's poll
    boot_note: str = ""  # said while waiting for servers
    rank_env: dict[str, str] = {}  # what the ranks of a job on its machines get unless train.env says (sites.rank_env)

    def __init__(self, region: str | None = None):
        self.region = region
        self._cloud = None

    def describe(self) -> str:
        """The cloud and site a verb acts on, in words (data and lease verbs say it)."""
        return f"{self.kind} site {self.region or '(default region)'}"

    # -- connection -------------------------------------------------------------------------------
    @property
    def cloud(self):
        """The site's OpenStack client (appliance.sites.openstack.OpenStackCloud), connected on first use."""
        if self._cloud is None:
            self._cloud = self.connect()
        return self._cloud

    @abstractmethod
    def connect(self):
        ...

    @abstractmethod
    def login_key(self, key_name: str | None, key_file: str | None) -> LoginKey:
        """The key pair servers are booted with and its private key here (checked or made)."""

    def time_scale(self) -> float:
        """Cloud seconds per real second (1 on a real site)."""
        return 1.0

    def cloud_up(self) -> bool:
        """Whether asking the site's cloud starts nothing: a real site's is always there (the local cloud's only
        while it runs: what only looks, `check --online`, does not start it)."""
        return True

    # -- object store ----------------------------------------------------------------------------
    def store_creds(self, url: str | None = None) -> StoreCreds | None:
        """Object-store credentials for ``url`` (any URL of the site when None; None for a file:// URL, a directory
        that needs none: the one place this rule is written). Swift v1 variables (ST_AUTH,
        ST_USER, ST_KEY) win when set; otherwise the site's own (`_site_store_creds`). S3 keys come from
        AWS_ACCESS_KEY_ID / AWS_SECRET_ACCESS_KEY with APPLIANCE_S3_ENDPOINT. For an s3:// URL without them, on a
        site whose store takes Keystone (Chameleon's RGW): the user's EC2 credential (the first Keystone lists, or a
        new one) and the object-store endpoint without its ``/swift...`` path, as Chameleon's own
        setup-cc-mount-object-store does (CC-Images elements/cc-rclone: ``openstack ec2 credential list`` or
        ``create``, ``${OS_STORAGE_URL%/swift*}``). No EC2 credential is made for any other URL."""
        if url and parse_url(url)[0] == "file":
            return None
        env = os.environ
        if env.get("ST_AUTH") and env.get("ST_USER") and env.get("ST_KEY"):
            creds = StoreCreds(auth_url=env["ST_AUTH"], user=env["ST_USER"], key=env["ST_KEY"])
        else:
            creds = self._site_store_creds()
        if _s3_keys_in_env():
            creds.s3_access_key = env["AWS_ACCESS_KEY_ID"]
            creds.s3_secret_key = env["AWS_SECRET_ACCESS_KEY"]
            creds.s3_endpoint = env.get("APPLIANCE_S3_ENDPOINT") or creds.s3_endpoint
            creds.s3_region = env.get("AWS_DEFAULT_REGION", creds.s3_region)
        elif url and parse_url(url)[0] == "s3" and not creds.s3_access_key and creds.token and creds.storage_url:
            creds.s3_access_key, creds.s3_secret_key = self.cloud.ec2_credential()
            creds.s3_endpoint = env.get("APPLIANCE_S3_ENDPOINT") or creds.s3_endpoint or \
                s3_endpoint_of(creds.storage_url)
        return creds

    def fresh_store_creds(self, url: str | None = None) -> StoreCreds | None:
        """``store_creds(url)`` with a new Keystone token, not the one the session holds and the store has just
        refused (revoked, or this machine's clock off Keystone's): what a process that outlives a token asks for
        (SwiftStore's ``renew``). keystoneauth keeps a token until 120 s before the end it was told."""
        session = getattr(getattr(self._cloud, "conn", None), "session", None)  # none made yet: none held
        if session is not None:
            session.invalidate()  # keystoneauth1 session.py Session.invalidate: the plugin authenticates anew
        return self.store_creds(url)

    @abstractmethod
    def _site_store_creds(self) -> StoreCreds:
        ...

    def _keystone_store_creds(self) -> StoreCreds:
        """Keystone (OS_CLOUD / OS_*): the object-store endpoint from the catalog and a token (a day on Chameleon:
        enough for this machine's own calls, not for a job's nodes: see job_store_creds)."""
        conn = self.cloud.conn
        return StoreCreds(storage_url=conn.object_store.get_endpoint(), token=conn.session.get_token())

    def job_store_creds(self, url: str, *, name: str, lease_end: dt.datetime | None,
                        say: Callable[[str], None] = print) -> tuple[StoreCreds | None, Callable[[], None] | None]:
        """What a job's nodes use for ``url``, and how to withdraw it when the job ends (None: nothing to withdraw;
        (None, None) for a file:// URL).

        With Keystone credentials, an application credential of the job's own, made here, restricted (it cannot make
        application credentials or trusts), expiring APP_CRED_AFTER_LEASE after the lease end:
        - swift://: the nodes get it; swiftclient gets a token with it and a new one whenever the store refuses the
          old (401), so a week-long job keeps committing checkpoints past the one-day token lifetime (issue 12
          item 2). It carries no access rules: Keystone refuses to validate tokens of credentials with access rules
          for any service that does not announce it enforces them (keystone/token/provider.py
          _validate_token_access_rules), and Ceph RGW 16 does not;
        - s3://: the nodes get an EC2 credential made with it (``Cloud.create_job_ec2``), which Keystone binds to it:
          once the job ends both are deleted, and the EC2 credential stops working when the application credential
          is gone or expired (keystone/api/_shared/EC2_S3_Resource.py). The user's own EC2 credential, which never
          expires and can be exchanged for project tokens, stays on this machine (issue 49).
        Swift v1 auth (ST_*) and S3 keys the user set (AWS_*) are the store's own credentials already and go as
        they are, scoped to the URL's scheme. When Keystone will not make one (a restricted credential in OS_CLOUD,
        a policy), the nodes get what this machine has and the job says what that means."""
        scheme = parse_url(url)[0]
        if scheme == "file":
            return None, None
        if scheme == "s3" and not _s3_keys_in_env():
            site = self._site_store_creds()
            if site.token and site.storage_url:
                return self._job_ec2(site, name=name, lease_end=lease_end, say=say)
        creds = self.store_creds(url).scoped(url)
        if scheme != "swift" or not creds.token:
            return creds, None
        made = self._job_app_cred(name, lease_end, say, "rank 0 gets a Keystone token, which the store refuses "
                                  "after a day (then no checkpoint commits): for longer runs use an unrestricted "
                                  "application credential in OS_CLOUD, ST_AUTH/ST_USER/ST_KEY, or an s3:// URL")
        if made is None:
            return creds, None
        cloud, ac = made
        node = StoreCreds(keystone_url=cloud.identity_url(), app_cred_id=ac["id"], app_cred_secret=ac["secret"],
                          region=cloud.region_name())
        return node, lambda: cloud.delete_app_cred(ac["id"])

    def _job_app_cred(self, name: str, lease_end: dt.datetime | None, say: Callable[[str], None], instead: str):
        """(cloud, application credential) of a job's own, or None (said, with ``instead``) when Keystone will not."""
        start = lease_end or dt.datetime.now(dt.timezone.utc).replace(tzinfo=None)
        try:
            cloud = self.cloud
            return cloud, cloud.create_app_cred(f"{name}-{secrets.token_hex(3)}", expires_at=start + APP_CRED_AFTER_LEASE,
                                                description="appliance: a job's object-store credential, deleted "
                                                            "when the job ends")
        except Exception as e:  # noqa: BLE001 - the job can still run
            say(f"[appliance] warning: no application credential for the nodes ({e}); {instead}")
            return None

    def _job_ec2(self, site: StoreCreds, *, name: str, lease_end: dt.datetime | None,
                 say: Callable[[str], None]) -> tuple[StoreCreds, Callable[[], None] | None]:
        """An s3:// job's nodes: an EC2 credential bound to an application credential of the job's own."""
        endpoint = os.environ.get("APPLIANCE_S3_ENDPOINT") or site.s3_endpoint or s3_endpoint_of(site.storage_url)
        made = self._job_app_cred(name, lease_end, say, "the nodes get your own EC2 credential, which never "
                                  "expires: delete it when the job ends (`openstack ec2 credentials list`)")
        if made is not None:
            cloud, ac = made
            try:
                access, secret = cloud.create_job_ec2(ac)
            except Exception as e:  # noqa: BLE001
                cloud.delete_app_cred(ac["id"])
                say(f"[appliance] warning: no EC2 credential of the job's own ({e}); the nodes get your own, which "
                    "never expires")
            else:
                def withdraw() -> None:
                    try:
                        cloud.delete_ec2(access)
                    finally:
                        cloud.delete_app_cred(ac["id"])
                return StoreCreds(s3_endpoint=endpoint, s3_access_key=access, s3_secret_key=secret), withdraw
        access, secret = self.cloud.ec2_credential()
        return StoreCreds(s3_endpoint=endpoint, s3_access_key=access, s3_secret_key=secret), None

    # -- spec rules, nodes, install --------------------------------------------------------------
    @classmethod
    def check_spec(cls, spec: Spec) -> None:
        """The site's own rules beyond the spec's (raise SpecError)."""

    def catalog(self, node_type: str, site: str | None = None) -> dict | None:
        """What the appliance ships about ``node_type`` at ``site``, for a plan made without asking the site (its
        hosts, GPUs per node, su_factor, and where each figure comes from); None: nothing shipped, ask the site."""
        return None

    def check_here(self, spec: Spec) -> None:
        """What the spec names on this machine, checked before a lease is paid for (`appliance check`, `up`, `run`;
        not where a spec is only read: a controller's copy in the store, `--plan`): its key_file is a file here."""
        if spec.key_file and not Path(spec.key_file).expanduser().is_file():
            pair = f"key pair {spec.key_name!r}" if spec.key_name else "the key pair key_name names"
            raise SpecError(f"key_file: {spec.key_file} is not a file on this machine (the private key of {pair}, "
                            "which `appliance` logs in to the nodes with)", NEW_KEY)

    def prepare_nodes(self, cluster: Cluster, session) -> None:
        """Bring each node's work directory to the site's fast local disk (updates ``node.workdir``)."""

    @abstractmethod
    def install_options(self) -> dict:
        """Options for provision.install.install_stack on this site's nodes (venv, system deps, sudo, pip)."""

    def default_cluster(self, spec: Spec) -> Cluster | None:
        """The cluster a run uses when it has none of its own and none was named (None: bring one up)."""
        return None


NEW_KEY = ("set key_file to the private key of key_name's pair; or make a pair, `ssh-keygen -t ed25519 -f "
           "~/.ssh/id_ed25519`, import ~/.ssh/id_ed25519.pub at the site as key_name (Compute > Key Pairs), and set "
           "key_file: ~/.ssh/id_ed25519")


def _s3_keys_in_env() -> bool:
    return bool(os.environ.get("AWS_ACCESS_KEY_ID") and os.environ.get("AWS_SECRET_ACCESS_KEY"))


def s3_endpoint_of(storage_url: str) -> str:
    """The S3 endpoint of a Ceph RGW from its Swift URL: everything before the last ``/swift`` (the shell's
    ``${OS_STORAGE_URL%/swift*}`` in CC-Images elements/cc-rclone/bin/setup-cc-mount-object-store; RGW serves S3
    at its root). ``https://chi.uc.chameleoncloud.org:7480/swift/v1/AUTH_p`` -> ``https://chi.uc.chameleoncloud.org:7480``."""
    i = storage_url.rfind("/swift")
    return storage_url[:i] if i >= 0 else storage_url.rstrip("/")
