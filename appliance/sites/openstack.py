"""Chameleon (OpenStack + Blazar) through the real clients: keystoneauth/openstacksdk, python-blazarclient.

No hand-written HTTP to OpenStack. The facts this follows (docs/chameleon.md, and the upstream sources cited beside each):
- lease dates are UTC, "YYYY-MM-DD HH:MM"; resource_properties is a JSON *string* of string triples, with `=`
  (accepted by both Chameleon's docs and Blazar's code); hypervisor_properties is required (may be "");
- the *reservation* id (not the lease id) goes to Nova as the `reservation` scheduler hint;
- an extension is a PUT of an absolute end_date, allowed only within 48 h of the current end, at most
  7 days past it; a lease lasts at most 7 days;
- waiting fails fast on ERROR or a host reservation with `missing_resources`; `degraded` alone (sticky after any
  reallocation) is a note.
The request bodies, answers and refusals are in openstack_api.py; the credentials (clouds.yaml, OS_*) in
openstack_auth.py.
"""

from __future__ import annotations

import base64
import datetime as dt
import json
import re
import time

from .. import report
from ..errors import ApplianceError, Unanswered
from .lease import Lease
from .openstack_api import (  # noqa: F401 - the API's records and rules, named here as before
    API_DATE, EXTENSION_WINDOW, HOSTKEYS_HEADER, MAX_LEASE, RESERVATION_KEY, LeaseInfo, ListedServer, _date_of,
    _not_found, bare_500, blazar_error, explain_blazar, fip_reservation, fmt_date, host_reservation,
    parse_console_host_keys, parse_lease_date, parse_password_host_keys, resource_properties, unanswered,
    unavailable, why_unanswered)
from .openstack_auth import (  # noqa: F401 - named here as before
    RUN_CLOUD, RUN_CLOUD_ENV, connect, entry_for_region, read_retry_session)

log = report.get(__name__)

# a lease found by name after a lost answer was made after the ask: by its created_at (Blazar's manager's clock)
# against the API's Date header less the time since the ask, less this for the two clocks' skew
LEASE_CLOCK_SLACK = dt.timedelta(seconds=60)


def blazar_client(conn):
    from blazarclient import client

    return client.Client(session=conn.session, region_name=conn.config.get_region_name(), interface="public")



class OpenStackCloud:
    """Leases, servers and floating IPs on one OpenStack site (Chameleon, or the local cloud)."""

    def __init__(self, conn):
        self.conn = conn
        self.blazar = blazar_client(conn)
        # a managed run's own credential (openstack_auth.connect: RUN_CLOUD) is unrestricted: a bare 500 from Blazar
        # is then no refused trust, and a lease may have been made
        self.unrestricted = getattr(conn.config, "name", None) == RUN_CLOUD

    # -- time -------------------------------------------------------------------------------------

    def now(self) -> dt.datetime:
        """The cloud's current UTC time (its HTTP Date header), so lease dates do not depend on our clock."""
        resp, _ = self.blazar.lease.request_manager.get("/leases")
        return _date_of(resp)

    def lease_at(self, lease_id: str) -> tuple[LeaseInfo | None, dt.datetime]:
        """A lease (None when gone) and the cloud's time, from one GET /leases/ID (its body and its Date header):
        what the lease watchdog reads each poll. `now()` lists every lease of the project for the Date alone."""
        info, resp = self._read_lease(lease_id)
        return info, _date_of(resp) if resp is not None else self.now()

    # -- identity ---------------------------------------------------------------------------------

    def region_name(self) -> str | None:
        return self.conn.config.region_name

    def identity_url(self) -> str:
        """Keystone's public endpoint (…/v3), from the catalog."""
        return self.conn.session.get_endpoint(service_type="identity", interface="public")

    def _app_creds_url(self) -> str:
        return f"{self.identity_url()}/users/{self.conn.current_user_id}/application_credentials"

    def create_app_cred(self, name: str, *, expires_at: dt.datetime | None, description: str = "",
                        unrestricted: bool = False) -> dict:
        """An application credential of the current user on the current project, with all the user's roles there,
        expiring at ``expires_at`` (UTC): restricted (it cannot make credentials or trusts), unless
        ``unrestricted`` (a managed run's controller: Blazar makes a trust for each lease). POST
        /v3/users/{user_id}/application_credentials (keystone api-ref). Returns {id, secret, ...}; the secret is
        shown only here."""
        body = {"name": name, "description": description, "unrestricted": unrestricted,
                "expires_at": expires_at.strftime("%Y-%m-%dT%H:%M:%S") if expires_at else None}
        r = self.conn.session.post(self._app_creds_url(), json={"application_credential": body}, raise_exc=False)
        if r.status_code != 201:
            raise ApplianceError(f"Keystone refused an application credential ({r.status_code}: {_keystone_message(r)})",
                                 "see docs/chameleon.md (credentials for the nodes)")
        return r.json()["application_credential"]

    def list_app_creds(self) -> list[dict]:
        """The current user's application credentials ({id, name, expires_at, ...}; never a secret)."""
        r = self.conn.session.get(self._app_creds_url(), raise_exc=False)
        if r.status_code != 200:
            raise ApplianceError(f"Keystone refused to list application credentials ({r.status_code}: "
                                 f"{_keystone_message(r)})", "see docs/chameleon.md (credentials)")
        return r.json().get("application_credentials") or []

    def delete_app_cred(self, cred_id: str) -> bool:
        """True when it was deleted, False when it was already gone."""
        r = self.conn.session.delete(f"{self._app_creds_url()}/{cred_id}", raise_exc=False)
        if r.status_code == 404:
            return False
        if r.status_code >= 300:
            raise ApplianceError(f"Keystone refused to delete application credential {cred_id} ({r.status_code})",
                                 "delete it in the dashboard: Identity -> Application Credentials")
        return True

    def create_job_ec2(self, app_cred: dict) -> tuple[str, str]:
        """S3 keys that live no longer than ``app_cred`` (a job's application credential, {id, secret}): an EC2
        credential made with that credential's token through POST /v3/credentials, which records it in the
        credential's blob (keystone/api/credentials.py CredentialResource._assign_unique_id, ``app_cred_id``);
        Keystone then refuses the keys once the application credential is deleted or expired, and the tokens they
        are exchanged for carry its roles only (keystone/api/_shared/EC2_S3_Resource.py handle_authenticate).
        Returns (access, secret)."""
        import secrets as _secrets

        from keystoneauth1.identity import v3

        auth = v3.ApplicationCredential(auth_url=self.identity_url(), application_credential_id=app_cred["id"],
                                        application_credential_secret=app_cred["secret"])
        sess = read_retry_session()(auth=auth, verify=self.conn.session.verify)
        access, secret = _secrets.token_hex(16), _secrets.token_hex(16)
        body = {"type": "ec2", "user_id": self.conn.current_user_id, "project_id": self.conn.current_project_id,
                "blob": json.dumps({"access": access, "secret": secret})}
        r = sess.post(f"{self.identity_url()}/credentials", json={"credential": body}, raise_exc=False)
        if r.status_code != 201:
            raise ApplianceError(f"Keystone refused an EC2 credential for the job ({r.status_code}: "
                                 f"{_keystone_message(r)})", "see docs/chameleon.md (credentials for the nodes)")
        return access, secret

    def delete_ec2(self, access: str) -> bool:
        """DELETE /v3/users/{user_id}/credentials/OS-EC2/{access}; False when it was already gone."""
        url = f"{self.identity_url()}/users/{self.conn.current_user_id}/credentials/OS-EC2/{access}"
        r = self.conn.session.delete(url, raise_exc=False)
        if r.status_code in (401, 404):  # UserOSEC2CredentialsResourceGetDelete: an unknown key is 401
            return False
        if r.status_code >= 300:
            raise ApplianceError(f"Keystone refused to delete EC2 credential {access[:8]}... ({r.status_code})",
                                 "delete it with `openstack ec2 credentials delete`")
        return True

    def ec2_credential(self) -> tuple[str, str]:
        """S3 keys of the current user on the current project: an EC2 credential Keystone has (the first), or a new
        one, as `openstack ec2 credentials list/create` would. GET/POST /v3/users/{user_id}/credentials/OS-EC2
        (keystone/api/users.py; keystoneclient's ec2.create names the project ``tenant_id``). Returns (access,
        secret)."""
        url = f"{self.identity_url()}/users/{self.conn.current_user_id}/credentials/OS-EC2"
        project = self.conn.current_project_id
        r = self.conn.session.get(url, raise_exc=False)
        if r.status_code >= 500:  # asked again already: not "none", which would make another
            raise ApplianceError(f"Keystone is not answering ({r.status_code}: {_keystone_message(r)}, asked again "
                                 "with back-off)", "run the step again in a few minutes")
        mine = [c for c in (r.json().get("credentials") or []) if c.get("tenant_id") == project] \
            if r.status_code == 200 else []
        if not mine:
            r = self.conn.session.post(url, json={"tenant_id": project}, raise_exc=False)
            if r.status_code != 201:
                raise ApplianceError(f"Keystone refused an EC2 credential ({r.status_code}: {_keystone_message(r)})",
                                     "make one with `openstack ec2 credentials create` and set "
                                     "AWS_ACCESS_KEY_ID/AWS_SECRET_ACCESS_KEY")
            mine = [r.json()["credential"]]
        return mine[0]["access"], mine[0]["secret"]

    # -- leases -----------------------------------------------------------------------------------

    def public_network_id(self) -> str:
        net = self.conn.network.find_network("public")
        if net is None:
            raise ApplianceError("no external network named 'public' on this site", "check the site / region")
        return net.id

    def create_lease(self, name: str, node_type: str, count: int, duration: dt.timedelta, *,
                     start: dt.datetime | None = None, floating_ip: bool = False) -> LeaseInfo:
        if duration > MAX_LEASE:
            raise ApplianceError(f"a {duration} lease is longer than Chameleon's 7-day maximum",
                                 "ask for at most 7d; extend later, within 48 h of the end")
        begin = start or self.now()
        end = begin + duration
        reservations = [host_reservation(node_type, count)]
        if floating_ip:
            reservations.append(fip_reservation(self.public_network_id()))
        lease = self._ask_lease(name, lambda: self.blazar.lease.create(
            name, "now" if start is None else fmt_date(begin), fmt_date(end), reservations, []),
            node_type=node_type, count=count)
        return LeaseInfo.from_api(lease)

    def _lost(self, e: Exception) -> bool:
        """A lease POST whose outcome is unknown: no answer, a gateway's 502-504, or, for a managed run's own
        (unrestricted) credential, Blazar's bare 500: an RPC to its manager that timed out, which may still make it."""
        return unanswered(e) or (self.unrestricted and bare_500(e))

    def _ask_lease(self, name: str, ask, *, node_type: str, count: int) -> dict:
        """Blazar's lease from ``ask()`` (the POST), never sent again blindly: an answer lost is looked for by the
        lease's name among the leases made since (Blazar allows two of one name); only when none is found is it
        asked once more. Two lost: Unanswered, the name kept for `up`, `down` and the run's ledger to find it."""
        lost = None
        for _ in range(2):
            t0 = time.monotonic()
            try:
                return ask()
            except Exception as e:  # BlazarClientException, or keystoneauth's when no answer came
                if not self._lost(e):
                    raise explain_blazar(e, node_type=node_type, count=count) from None
                lost = e
            found = self._lease_named(name, time.monotonic() - t0, lost)
            if found is not None:
                log.info(f"lease {name}: Blazar made it, though its answer was lost ({why_unanswered(lost)})")
                return found
            log.info(f"lease {name}: Blazar's answer was lost ({why_unanswered(lost)}) and no lease of that name "
                     "was made: asking again")
        raise Unanswered(f"Blazar did not answer whether it made lease {name}, twice ({why_unanswered(lost)}; "
                         f"{blazar_error(lost)[1][:160]}), and no lease of that name is listed yet",
                         "run the step again: it looks for the lease by its name before it asks for another")

    def _lease_named(self, name: str, asked_s: float, lost: Exception) -> dict | None:
        """The lease named ``name`` that Blazar made since it was asked ``asked_s`` seconds ago (its created_at by the
        cloud's clock, less LEASE_CLOCK_SLACK), or None. A listing that fails is not "none": Unanswered."""
        try:
            resp, body = self.blazar.lease.request_manager.get("/leases")
        except Exception as e:
            raise Unanswered(f"Blazar did not answer whether it made lease {name} ({why_unanswered(lost)}), nor the "
                             f"listing that looks for it ({why_unanswered(e)})",
                             "run the step again: it looks for the lease by its name before it asks for another") \
                from None
        since = _date_of(resp) - dt.timedelta(seconds=asked_s) - LEASE_CLOCK_SLACK
        made = [x for x in (body or {}).get("leases") or [] if x.get("name") == name
                and (not x.get("created_at") or parse_lease_date(x["created_at"]) >= since)]
        return max(made, key=lambda x: x.get("created_at") or "") if made else None

    def get_lease(self, lease_id: str) -> LeaseInfo | None:
        return self._read_lease(lease_id)[0]

    def _read_lease(self, lease_id: str):
        """(lease, HTTP answer), or (None, None) when Blazar has no such lease: GET /leases/ID, as blazarclient's
        lease.get sends it, keeping the answer for its Date."""
        try:
            resp, body = self.blazar.lease.request_manager.get(f"/leases/{lease_id}")
        except Exception as e:
            if _not_found(e):
                return None, None
            raise explain_blazar(e) from None
        return LeaseInfo.from_api(body["lease"]), resp

    def next_slot(self, node_type: str, count: int, duration: dt.timedelta,
                  after: dt.datetime | None = None) -> dt.datetime | None:
        """The earliest start (cloud time) of ``count`` hosts of ``node_type`` free for ``duration`` (sites/slots.py),
        from Blazar's hosts and their allocations; None when the site has too few such hosts."""
        from .slots import earliest_slot

        try:
            hosts = self.blazar.host.list()
            _, body = self.blazar.host.request_manager.get("/os-hosts/allocations")
        except Exception as e:
            raise explain_blazar(e) from None
        return earliest_slot(hosts, (body or {}).get("allocations") or [], node_type, count, duration,
                             after or self.now())

    def node_type_hosts(self, node_type: str) -> tuple[int, float]:
        """How many reservable hosts of ``node_type`` the site has (Blazar's GET /v1/os-hosts) and their SU factor
        (the largest ``su_factor`` extra capability among them; 1.0 where none has one: Chameleon's portal
        balance_service/enforcement/usage_enforcement.py DEFAULT_SU_FACTOR)."""
        try:
            hosts = [h for h in self.blazar.host.list() if h.get("node_type") == node_type]
        except Exception as e:
            raise explain_blazar(e) from None
        factors = [float(h["su_factor"]) for h in hosts if h.get("su_factor") not in (None, "")]
        return len(hosts), max(factors, default=1.0)

    def list_leases(self) -> list[LeaseInfo]:
        try:
            return [LeaseInfo.from_api(x) for x in self.blazar.lease.list()]
        except Exception as e:
            raise explain_blazar(e) from None

    def wait_lease(self, lease_id: str, *, timeout: float = 600.0, poll: float = 2.0) -> LeaseInfo:
        """Until ACTIVE. Fails fast on ERROR or on hosts Blazar could not replace; real timeout.

        `degraded` alone is not a failure: Blazar's monitor sets it on the lease whenever it updates a reservation's
        flags (blazar/monitor/base.py `_update_flags`), which its host plugin does after a *successful*
        reallocation too (`resources_changed`; blazar/plugins/oshosts/host_plugin.py `heal_reservations`), and
        nothing clears it. Only `missing_resources` on the host reservation means the lease lacks a host."""
        deadline = time.monotonic() + timeout
        said = {"status": None, "degraded": False}

        def seen(info: LeaseInfo | None) -> None:
            if info is None or info.status == "ERROR":
                return  # said below
            if info.status != said["status"]:
                log.info(f"lease {info.name}: {info.status}")
                said["status"] = info.status
            if info.missing_resources:
                raise ApplianceError(f"lease {info.name} is missing a reserved host: one failed and Blazar found no "
                                     "replacement",
                                     f"`openstack reservation host reallocate --lease-id {lease_id} <host>`, or a new lease")
            if info.degraded and not said["degraded"]:
                log.info(f"note: lease {info.name} is marked degraded: Blazar replaced a failed host; every host is "
                         "there")
                said["degraded"] = True

        info = Lease(self, lease_id).until_active(lambda: time.monotonic() > deadline, lambda: time.sleep(poll), seen)
        if info is None:
            raise ApplianceError(f"lease {lease_id} disappeared while waiting for it", "create a new one")
        if info.status == "ERROR":
            raise ApplianceError(f"lease {info.name} ({lease_id}) is in ERROR",
                                 "delete it (`appliance lease delete`) and create another")
        if info.status == "ACTIVE":
            return info
        if info.ended:
            raise ApplianceError(f"lease {info.name} has ended ({info.status})", "create a new lease")
        raise ApplianceError(f"lease {info.name} not ACTIVE after {timeout:.0f}s (status {info.status}, "
                             f"starts {info.start:%Y-%m-%d %H:%M} UTC)", "wait, or pass --timeout")

    def extend_lease(self, lease_id: str, *, by: dt.timedelta | None = None, to: dt.datetime | None = None) -> LeaseInfo:
        """PUT an absolute end date, after checking Chameleon's 48 h window and 7-day cap ourselves."""
        info = self.get_lease(lease_id)
        if info is None:
            raise ApplianceError(f"no lease {lease_id}", "see `appliance lease list`")
        new_end = to or (info.end + (by or dt.timedelta(0)))
        now = self.now()
        if new_end <= info.end:
            raise ApplianceError(f"the new end {fmt_date(new_end)} is not after the current end {fmt_date(info.end)}",
                                 "give a positive duration, e.g. --by 1d")
        if info.status == "ACTIVE" and info.end - now > EXTENSION_WINDOW:
            opens = info.end - EXTENSION_WINDOW
            raise ApplianceError(f"lease {info.name} ends {fmt_date(info.end)} UTC; Chameleon allows extending only "
                                 f"within 48 h of the end", f"extend after {fmt_date(opens)} UTC")
        if new_end - info.end > MAX_LEASE:
            raise ApplianceError("an extension may add at most 7 days past the current end",
                                 f"extend to {fmt_date(info.end + MAX_LEASE)} UTC or earlier")
        try:
            lease = self.blazar.lease.update(lease_id, end_date=fmt_date(new_end))
        except Exception as e:
            raise explain_blazar(e, end=fmt_date(info.end - EXTENSION_WINDOW)) from None
        return LeaseInfo.from_api(lease)

    def delete_lease(self, lease_id: str) -> bool:
        try:
            self.blazar.lease.delete(lease_id)
            return True
        except Exception as e:
            if _not_found(e):
                return False
            raise explain_blazar(e) from None

    # -- servers ----------------------------------------------------------------------------------

    def ensure_keypair(self, name: str, public_key: str | None) -> None:
        kp = self.conn.compute.find_keypair(name)
        if kp is not None:
            if public_key and kp.public_key.split()[:2] != public_key.split()[:2]:
                raise ApplianceError(f"key pair {name!r} exists with a different public key",
                                     "use another key_name, or delete the old key pair")
            return
        if not public_key:
            raise ApplianceError(f"no key pair named {name!r} on this site", "create it in the dashboard, or set key_name")
        self.conn.compute.create_keypair(name=name, public_key=public_key)

    def create_server(self, name: str, *, reservation_id: str, image: str, key_name: str, network: str,
                      user_data: str | None = None, flavor: str = "baremetal") -> str:
        img = self.conn.image.find_image(image)
        if img is None:
            raise ApplianceError(f"no image named {image!r} on this site", "see `openstack image list`; set image in the spec")
        flv = self.conn.compute.find_flavor(flavor)
        if flv is None:
            raise ApplianceError(f"no flavor {flavor!r}", "bare-metal sites use 'baremetal'")
        net = self.conn.network.find_network(network)
        if net is None:
            raise ApplianceError(f"no network named {network!r}", "Chameleon's shared network is sharednet1")
        # the reservation in the server's metadata too (Nova shows it in every listing, where the scheduler hint is
        # not shown): a server an `up` asked for and never recorded is found by it (lifecycle.up, no orphans)
        kwargs = dict(name=name, flavor_id=flv.id, image_id=img.id, key_name=key_name,
                      networks=[{"uuid": net.id}], scheduler_hints={"reservation": reservation_id},
                      metadata={RESERVATION_KEY: reservation_id})
        if user_data:
            kwargs["user_data"] = base64.b64encode(user_data.encode()).decode()
        for _ in range(2):  # an answer lost: looked for by name and reservation, then asked once more (as a lease)
            try:
                return self.conn.compute.create_server(**kwargs).id
            except Exception as e:  # openstacksdk's HttpException, or keystoneauth's when no answer came
                if not unanswered(e):
                    raise _cloud_error("Nova", e, f"server {name} was refused") from None
                lost = e
            found = self._server_named(name, reservation_id, lost)
            if found is not None:
                log.info(f"  {name}: Nova made it, though its answer was lost ({why_unanswered(lost)})")
                return found
        raise Unanswered(f"Nova did not answer whether it made server {name}, twice ({why_unanswered(lost)})",
                         "run `appliance up` again: it uses the servers it finds by name on the reservation")

    def _server_named(self, name: str, reservation_id: str, lost: Exception) -> str | None:
        """The id of a server named ``name`` asked for on ``reservation_id`` (its metadata) and not being deleted,
        or None; a listing that fails is not "none": Unanswered."""
        try:
            listed = self.find_servers(f"^{re.escape(name)}$")
        except Exception as e:
            raise Unanswered(f"Nova did not answer whether it made server {name} ({why_unanswered(lost)}), nor the "
                             f"listing that looks for it ({why_unanswered(e)})",
                             "run `appliance up` again: it uses the servers it finds by name on the reservation") \
                from None
        return next((srv.id for srv in listed if srv.name == name and srv.task_state != "deleting"
                     and srv.metadata.get(RESERVATION_KEY) == reservation_id), None)

    def get_server(self, server_id: str):
        return self.conn.compute.find_server(server_id)

    def find_servers(self, name_regex: str | None = None) -> list[ListedServer]:
        """Every server of the project whose name matches ``name_regex`` (all of them without), from one listing
        (GET /servers/detail?name=..., every page). Nova matches ``name`` as a regular expression for any user
        (nova/api/openstack/compute/servers.py ``_get_server_search_options`` keeps it for non-admins;
        nova/db/main/api.py ``_regex_instance_filter``: the database's REGEXP), so ``name_regex`` is plain POSIX
        (``^run-[0-9]+$``): MySQL's and MariaDB's REGEXP alike."""
        import openstack.exceptions

        found, url, params = [], "/servers/detail", ({"name": name_regex} if name_regex else None)
        while url:  # Nova pages at its [api] max_limit (1000): servers_links names the next page
            resp = self.conn.compute.get(url, params=params)
            openstack.exceptions.raise_from_response(resp)
            body = resp.json()
            found += [ListedServer.from_nova(d) for d in body.get("servers") or []]
            url = next((link.get("href") for link in body.get("servers_links") or [] if link.get("rel") == "next"),
                       None)
            params = None  # the next link carries the query
        return found

    def get_servers(self, server_ids: list[str], name_regex: str | None = None) -> dict[str, object]:
        """{id: server (ListedServer), or None when it is gone} for many servers from one listing (find_servers),
        where a GET per server costs N requests a round: 64 at 0.2-0.3 s each on a real Nova, and ~36 ms of the
        launcher's CPU each for openstacksdk's parsing (make bench-scale-light). The listing's JSON is read as it
        is: openstacksdk's Server resource for each listed server cost ~21 ms of CPU more (a cProfile of `up` at 64
        nodes: 6.95 s over 5 rounds). Without ``name_regex``, the project's every server is listed (a cluster
        adopted from a Heat stack has other names)."""
        found = {srv.id: srv for srv in self.find_servers(name_regex)}
        return {sid: found.get(sid) for sid in server_ids}

    def delete_server(self, server_id: str) -> bool:
        """Whether there was such a server: one DELETE (a 404 is False), not a GET to find it first, which cost a
        round trip and ~36 ms of openstacksdk's parsing per server (make bench-scale-light)."""
        import openstack.exceptions

        try:
            self.conn.compute.delete_server(server_id, ignore_missing=False)
        except openstack.exceptions.NotFoundException:
            return False
        except Exception as e:  # keystoneauth asked again already (openstack_auth.retry_policy)
            raise _cloud_error("Nova", e, f"Nova refused to delete server {server_id}") from None
        return True

    def server_ip(self, srv) -> str:
        for addrs in (srv.addresses or {}).values():
            for a in addrs:
                if a.get("OS-EXT-IPS:type", "fixed") == "fixed" and a.get("version", 4) == 4:
                    return a["addr"]
        raise ApplianceError(f"server {srv.name} has no fixed IPv4 address")

    def server_host_keys(self, server_id: str) -> list[str]:
        """A server's SSH host public keys from a channel only the server could have written, so that pinning them
        is not trust on first use: first what our boot script (provision/hostkeys.sh) posted to the metadata
        `password` (GET os-server-password); else what cloud-init printed to the console log. Bare metal has
        only the first: Nova's Ironic driver has no console log (the API answers 501). [] until one has keys."""
        try:
            keys = parse_password_host_keys(self.conn.compute.get_server_password(server_id) or "")
        except Exception:  # noqa: BLE001 - not yet there (or not allowed): try the console, then wait
            keys = []
        if keys:
            return keys
        try:
            out = self.conn.compute.get_server_console_output(server_id).get("output", "")
        except Exception:  # noqa: BLE001 - 501 on bare metal (no console log)
            return []
        return parse_console_host_keys(out or "")

    # -- floating IPs -----------------------------------------------------------------------------

    def upload_image(self, path: str, name: str, *, disk_format: str = "qcow2", properties: dict | None = None,
                     timeout: float = 3600) -> dict:
        """Upload a disk image to Glance (private), or return the image of that name with the same checksum.
        Glance checks the data's MD5 on arrival; a second upload of the same file is a no-op."""
        import openstack.exceptions

        try:
            img = self.conn.image.create_image(name, filename=path, disk_format=disk_format, container_format="bare",
                                               visibility="private", wait=True, timeout=timeout,
                                               validate_checksum=True, allow_duplicates=False,
                                               meta=dict(properties or {}))
        except openstack.exceptions.SDKException as e:
            raise ApplianceError(f"image upload of {path} as {name!r} failed: {e}",
                                 "check the file is a valid image and your image quota") from None
        return {"id": img.id, "name": img.name, "status": img.status, "size": img.size, "checksum": img.checksum,
                "disk_format": img.disk_format}

    def reserved_floating_ip(self, fip_reservation_id: str):
        for ip in self.conn.network.ips(tags=f"reservation:{fip_reservation_id}"):
            return ip
        return None

    def attach_floating_ip(self, server_id: str, *, fip_reservation_id: str | None = None):
        """Prefer the lease's reserved FIP (by tag); else allocate one from 'public'. Returns the FIP."""
        fip = self.reserved_floating_ip(fip_reservation_id) if fip_reservation_id else None
        if fip is None:
            fip = self.conn.network.create_ip(floating_network_id=self.public_network_id())
        ports = list(self.conn.network.ports(device_id=server_id))
        if not ports:
            raise ApplianceError(f"server {server_id} has no port to attach a floating IP to")
        last = None
        for port in ports:  # try each port, as on multi-NIC bare metal
            try:
                return self.conn.network.update_ip(fip, port_id=port.id)
            except Exception as e:
                last = e
        raise ApplianceError(f"could not attach floating IP {fip.floating_ip_address}: {last}")

    def server_floating_ip(self, server_id: str):
        """The floating IP on one of the server's ports already (an attach whose answer was lost), or None."""
        try:
            for port in self.conn.network.ports(device_id=server_id):
                for ip in self.conn.network.ips(port_id=port.id):
                    return ip
        except Exception as e:  # keystoneauth asked again already (openstack_auth.retry_policy)
            raise _cloud_error("Neutron", e, f"Neutron refused to list the ports of server {server_id}") from None
        return None

    def release_floating_ip(self, fip_id: str) -> None:
        import openstack.exceptions

        try:
            ip = self.conn.network.get_ip(fip_id)
            if ip is None:
                return
            if "blazar" in (ip.tags or []):
                self.conn.network.update_ip(ip, port_id=None)  # a reserved FIP goes back with its lease
            else:
                self.conn.network.delete_ip(ip)
        except openstack.exceptions.NotFoundException:  # released already (a reserved FIP goes at the lease end)
            return
        except Exception as e:  # keystoneauth asked again already where it may (openstack_auth.retry_policy)
            raise _cloud_error("Neutron", e, f"Neutron refused to release floating IP {fip_id}") from None


def _cloud_error(service: str, e: Exception, refused: str) -> ApplianceError:
    """An openstacksdk or keystoneauth error in one line: not answering (5xx, no answer), or ``refused`` and why."""
    if unanswered(e) or (getattr(e, "status_code", None) or 0) >= 500:
        return unavailable(service, e)
    return ApplianceError(f"{refused}: {(str(e).splitlines() or [type(e).__name__])[0][:200]}")


def _keystone_message(r) -> str:
    """The message of Keystone's error body ({"error": {"message"}}), or the start of whatever came instead."""
    try:
        return r.json()["error"]["message"]
    except Exception:  # noqa: BLE001 - not Keystone's error shape
        return r.text[:200]
