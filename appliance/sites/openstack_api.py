"""The OpenStack APIs' request bodies, answers and refusals as Chameleon's Blazar and Nova give them: lease dates,
host and floating-IP reservations, Blazar's errors in one line with the fix, host keys a node publishes, and the
records (LeaseInfo, ListedServer) OpenStackCloud returns."""

from __future__ import annotations

import datetime as dt
import email.utils
import json
import re
from dataclasses import dataclass, field

from ..errors import ApplianceError, NoHosts, NoSUs, Unavailable, socket_reason

API_DATE = "%Y-%m-%d %H:%M"
MAX_LEASE = dt.timedelta(days=7)
EXTENSION_WINDOW = dt.timedelta(hours=48)


# ---------------------------------------------------------------------------------------------
# dates and request bodies


def fmt_date(t: dt.datetime) -> str:
    return t.strftime(API_DATE)


def parse_lease_date(value: str) -> dt.datetime:
    """Blazar answers with ISO dates (with microseconds); accept both forms. Naive UTC."""
    for f in ("%Y-%m-%dT%H:%M:%S.%f", "%Y-%m-%dT%H:%M:%S", "%Y-%m-%d %H:%M:%S", API_DATE):
        try:
            return dt.datetime.strptime(value, f)
        except ValueError:
            continue
    raise ValueError(f"unrecognised date {value!r}")


def resource_properties(node_type: str) -> str:
    return json.dumps(["=", "$node_type", node_type])


def node_type_in(resource_properties) -> str | None:
    """The node type a host reservation's resource_properties asks for (``["=", "$node_type", X]``, also inside an
    ``and``: Blazar's grammar, ChameleonCloud/blazar blazar/utils/plugins.py ``convert_requirements``), or None."""
    try:
        expr = json.loads(resource_properties) if isinstance(resource_properties, str) else resource_properties
    except ValueError:
        return None
    if not isinstance(expr, list) or not expr:
        return None
    if len(expr) == 3 and expr[0] in ("=", "==") and expr[1] == "$node_type" and isinstance(expr[2], str):
        return expr[2]
    if expr[0] == "and":
        return next((nt for x in expr[1:] if (nt := node_type_in(x)) is not None), None)
    return None


def host_reservation(node_type: str, count: int) -> dict:
    return {"resource_type": "physical:host", "min": count, "max": count, "hypervisor_properties": "",
            "resource_properties": resource_properties(node_type), "before_end": "default"}


def fip_reservation(public_network_id: str, amount: int = 1) -> dict:
    return {"resource_type": "virtual:floatingip", "network_id": public_network_id, "amount": amount}


# ---------------------------------------------------------------------------------------------
# errors

# A credential Keystone refuses (401) has often expired: a Chameleon token lasts a day (kolla's token_expiration,
# 86400 s, chi-in-a-box's default), and so does the application credential `cc-login` writes by default
# (ChameleonCloud/ccauth); `ccauth clouds-yaml` writes entries that log in again through the browser.
EXPIRED = "expired? a Chameleon token or a cc-login credential lasts 24 h"
RENEW = ("renew it: `cc-login --output-clouds-yaml ~/.config/openstack/clouds.yaml` or `ccauth clouds-yaml`, or "
         "create a new application credential (the site's dashboard: Identity > Application Credentials); else "
         "check its id and secret (or password)")


def blazar_error(e: Exception) -> tuple[int | None, str]:
    """(HTTP status, message) of a BlazarClientException: the text is args[0], the status kwargs['code']."""
    code = (getattr(e, "kwargs", None) or {}).get("code")
    msg = str(e.args[0]) if e.args else str(e)
    return code, re.sub(r"^ERROR: ", "", msg).strip()


def unanswered(e: Exception) -> bool:
    """A request whose outcome is unknown: no answer (keystoneauth's ConnectTimeout/ConnectFailure after the
    request may have reached the service count too: a reset mid-request), or a gateway's 502/503/504 in front of
    a service that may have acted."""
    code = blazar_error(e)[0] or getattr(e, "status_code", None)  # Blazar's client, or openstacksdk's HttpException
    if code in (502, 503, 504):
        return True
    names = {c.__name__ for c in type(e).__mro__}
    return bool(names & {"ConnectionError", "ConnectFailure", "ConnectTimeout", "RetriableConnectionFailure",
                         "GatewayTimeout", "BadGateway", "ServiceUnavailable", "TimeoutError", "Timeout"})


def bare_500(e: Exception) -> bool:
    """Blazar's answer to any error not its own: 500 "Internal Server Error" (ChameleonCloud/blazar
    blazar/api/v1/utils.py `Rest.route` -> `internal_error`), whatever happened: a restricted credential's trust
    refused (nothing made), or the create_lease RPC to its manager timed out (oslo.messaging MessagingTimeout), after
    which the manager may still make the lease."""
    code, msg = blazar_error(e)
    return code == 500 and msg.strip().rstrip(".").lower() in ("", "internal server error")


def why_unanswered(e: Exception) -> str:
    """A failure without an answer in a few words: the HTTP status, or the socket's reason."""
    code = blazar_error(e)[0] or getattr(e, "status_code", None)
    return f"HTTP {code}" if code else f"{type(e).__name__}: {socket_reason(e)}"


def unavailable(service: str, e: Exception) -> Unavailable:
    """A read or a delete the service did not answer though keystoneauth asked again (openstack_auth.RETRIES)."""
    return Unavailable(f"{service} is not answering ({why_unanswered(e)}, asked again with back-off)",
                       "the site's control plane is down or overloaded: run the step again in a few minutes "
                       "(nothing is taken for gone while it does not answer)")


def _not_found(e: Exception) -> bool:
    code, msg = blazar_error(e)
    return code == 404 or "not found" in msg.lower()


def explain_blazar(e: Exception, *, node_type: str = "", count: int = 0, end: str = "") -> ApplianceError:
    code, msg = blazar_error(e)
    low = msg.lower()
    if unanswered(e):
        return unavailable("Blazar", e)
    if "not enough hosts" in low or "notenoughhosts" in low:
        what = f"{count} x {node_type}" if node_type else "the reserved hosts"
        return NoHosts(f"not enough hosts available for {what} in that window (Blazar: {msg.strip()})",
                       "ask for fewer nodes or a later start, or see the site's host calendar "
                       "(Reservations > Host Calendar); an extension fails this way when someone "
                       "booked your hosts after your end")
    if "would spend" in low and "sus" in low:
        # Chameleon's portal through Blazar's ExternalServiceFilter (400 ExternalServiceFilterException):
        # "Reservation for project X would spend N SUs, only M left" (ChameleonCloud/portal
        # balance_service/enforcement/usage_enforcement.py `check_usage_against_allocation`)
        return NoSUs(f"not enough SUs for this lease (Blazar: {msg.strip()})",
                     "ask your project's PI for SUs (an allocation renewal or a supplement request on Chameleon's "
                     "portal), or ask for fewer nodes or a shorter lease")
    if "within" in low and ("extend" in low or "window" in low) or "updatewindow" in low:
        return ApplianceError(f"Chameleon allows an extension only within 48 h of the lease end (Blazar: {msg.strip()})",
                              f"extend after {end} (UTC)" if end else "extend later, within 48 h of the end")
    if "duration" in low and ("exceed" in low or "max" in low):
        return ApplianceError(f"the lease would be longer than Chameleon's 7-day maximum (Blazar: {msg.strip()})",
                              "ask for at most 7d; near the end, extend (within 48 h of it) or resume on a new lease")
    if "quota" in low or code == 403 or "allocation" in low or "budget" in low:
        return ApplianceError(f"refused by quota or allocation (Blazar: {msg.strip()})",
                              "check your project's allocation / SU budget with your PI")
    if code == 500 and node_type:
        # Blazar makes a Keystone trust for each new lease; Keystone refuses one to a restricted application
        # credential and Blazar answers that with a bare 500 (blazar/api/v1/utils.py internal_error)
        return ApplianceError("Blazar could not create the lease (HTTP 500, no reason given); with an application "
                              "credential this is how a restricted one fails: Blazar needs to make a Keystone trust",
                              "create the application credential with 'unrestricted' checked (Identity > "
                              "Application Credentials, or `openstack application credential create --unrestricted "
                              "NAME`) and use it")
    if code == 401:
        return ApplianceError(f"Blazar rejected the token (401 Unauthorized: {EXPIRED})", RENEW)
    return ApplianceError(f"Blazar: {msg.strip()}")


# ---------------------------------------------------------------------------------------------
# the cloud


HOST_KEY_TYPES = ("ssh-ed25519", "ecdsa-sha2-nistp256", "ecdsa-sha2-nistp384", "ecdsa-sha2-nistp521", "ssh-rsa")


def parse_console_host_keys(text: str) -> list[str]:
    """The host keys cloud-init printed between its BEGIN/END SSH HOST KEY KEYS markers (cloud-init's
    write-ssh-key-fingerprints), from the *last* complete block: a console log holds one block per boot, and a
    re-provisioned node prints new keys. Serial consoles end lines with CRLF. Only well-formed public-key lines
    (`TYPE BASE64 [comment]`) are kept."""
    text = text.replace("\r\n", "\n").replace("\r", "\n")
    blocks = re.findall(r"-----BEGIN SSH HOST KEY KEYS-----\n(.*?)-----END SSH HOST KEY KEYS-----", text, re.S)
    if not blocks:
        return []
    return _key_lines(blocks[-1].splitlines())


RESERVATION_KEY = "appliance_reservation"  # a server's metadata: the reservation it was asked for on
HOSTKEYS_HEADER = "appliance-hostkeys/1"  # the first line appliance/provision/hostkeys.sh posts


def _key_lines(lines) -> list[str]:
    keys = []
    for line in lines:
        parts = line.split()
        if len(parts) >= 2 and parts[0] in HOST_KEY_TYPES and re.fullmatch(r"[A-Za-z0-9+/]+={0,2}", parts[1]):
            keys.append(" ".join(parts[:2]))
    return keys


def parse_password_host_keys(text: str) -> list[str]:
    """The host keys a node published through Nova's server password (appliance/provision/hostkeys.sh): the header
    line, then `TYPE BASE64` lines. Anything else in the password (an image that posts an encrypted admin password,
    as cloudbase-init does) is not ours: no keys."""
    lines = (text or "").replace("\r\n", "\n").split("\n")
    if lines[0].strip() != HOSTKEYS_HEADER:
        return []
    return _key_lines(lines[1:])


@dataclass(frozen=True)
class ListedServer:
    """A server as Nova's listing shows it (API 2.1 fields: nova/api/openstack/compute/views/servers.py): what `up`
    reads while it waits, and the address it takes."""
    id: str
    name: str
    status: str
    addresses: dict
    fault: dict | None = None
    task_state: str | None = None
    metadata: dict = field(default_factory=dict)

    @classmethod
    def from_nova(cls, d: dict) -> ListedServer:
        return cls(id=d["id"], name=d.get("name") or "", status=d.get("status") or "",
                   addresses=d.get("addresses") or {}, fault=d.get("fault"),
                   task_state=d.get("OS-EXT-STS:task_state"), metadata=d.get("metadata") or {})


@dataclass
class LeaseInfo:
    id: str
    name: str
    status: str
    start: dt.datetime
    end: dt.datetime
    reservation_id: str | None
    fip_reservation_id: str | None
    degraded: bool  # sticky on Blazar: set on every reallocation, successful ones too, and never cleared
    missing_resources: bool = False  # the host reservation lacks hosts Blazar could not replace
    node_type: str | None = None  # the node type its host reservation asks for (None: not said by node type)
    hosts: int = 0  # the hosts it reserves (the reservation's max: the most Blazar allocates)

    @classmethod
    def from_api(cls, lease: dict) -> LeaseInfo:
        host = next((r for r in lease.get("reservations", []) if r.get("resource_type") == "physical:host"), None)
        fip = next((r for r in lease.get("reservations", []) if r.get("resource_type") == "virtual:floatingip"), None)
        return cls(id=lease["id"], name=lease["name"], status=lease["status"],
                   start=parse_lease_date(lease["start_date"]), end=parse_lease_date(lease["end_date"]),
                   reservation_id=host["id"] if host else None, fip_reservation_id=fip["id"] if fip else None,
                   degraded=bool(lease.get("degraded")),
                   missing_resources=bool(host and host.get("missing_resources")),
                   node_type=node_type_in(host.get("resource_properties")) if host else None,
                   hosts=_count(host.get("max") if host else 0))

    # Blazar's lease statuses (blazar/status.py LeaseStatus): TERMINATED at its end, DELETED when deleted; a lease
    # in ERROR keeps its hosts (and its charge) until it is deleted
    ENDED = ("TERMINATED", "DELETED")

    @property
    def ended(self) -> bool:
        """Blazar has ended or deleted it: its servers are gone or going."""
        return self.status in self.ENDED

    @property
    def unusable(self) -> bool:
        """Nothing more can run on it: ended, or in ERROR."""
        return self.ended or self.status == "ERROR"

    def over(self, now: dt.datetime) -> bool:
        """Ended, or past its end by the cloud's clock ``now`` (Blazar ends it at its next poll)."""
        return self.ended or self.end <= now

    def as_dict(self) -> dict:
        return {"id": self.id, "name": self.name, "status": self.status, "start": self.start.isoformat() + "Z",
                "end": self.end.isoformat() + "Z", "reservation_id": self.reservation_id,
                "fip_reservation_id": self.fip_reservation_id, "degraded": self.degraded,
                "missing_resources": self.missing_resources}


def _count(value) -> int:
    try:
        return max(0, int(value))
    except (TypeError, ValueError):
        return 0


def _date_of(resp) -> dt.datetime:
    """An HTTP answer's Date header as naive UTC (our clock when it has none)."""
    date = resp.headers.get("Date")
    if date:
        return email.utils.parsedate_to_datetime(date).astimezone(dt.timezone.utc).replace(tzinfo=None)
    return dt.datetime.utcnow()
