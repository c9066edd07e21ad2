"""Blazar v1 (/reservation): leases of physical hosts and floating IPs; the host list. The lease rules themselves
(dates, pools, the 7-day cap, the 48 h extension window) are in cloud.py."""

from __future__ import annotations

from .api import Request, Route, versions
from .cloud import ApiError
from .state import HostReservation, fmt

PREFIX = "reservation"


def error_body(e: ApiError) -> dict:
    """ChameleonCloud/blazar blazar/api/v1/utils.py render_error_message: error_code, error_message, error_name."""
    return {"error_code": e.code, "error_message": e.message, "error_name": e.name or "BlazarException"}


def create_lease(req: Request):
    """Blazar makes a Keystone trust for every new lease (blazar/utils/trusts.py `use_trust_auth`, on the API's
    create); Keystone refuses trusts to a restricted application credential (keystone/api/trusts.py
    `_check_unrestricted_application_credential`), and Blazar's route turns that non-Blazar exception into a
    bare 500 (blazar/api/v1/utils.py `Rest.route` -> `internal_error(500, 'Internal Server Error', e)`)."""
    tok = req.caller()
    if tok.app_cred and not tok.unrestricted:
        raise ApiError(500, "Internal Server Error", "INTERNAL_SERVER_ERROR")
    return 201, {"lease": req.cloud.create_lease(req.body or {})}


def normalize(path: str) -> str:
    """blazar/api/v1/utils.py Rest.route registers every rule also as RULE + '.json'."""
    return path[:-len(".json")] if path.endswith(".json") else path


def list_leases(req: Request):
    c = req.cloud
    return 200, {"leases": [x.view() for x in c.leases.values() if x.status != "DELETED"]}


def delete_lease(req: Request, lid: str):
    req.cloud.delete_lease(lid)
    return 204, None


def hosts(req: Request):
    return 200, {"hosts": [h.view() for h in req.cloud.hosts]}


def allocations(req: Request):
    """GET /v1/os-hosts/allocations (ChameleonCloud/blazar blazar/api/v1/oshosts/v1_0.py ``allocations_list`` ->
    blazar/plugins/oshosts/host_plugin.py ``list_allocations``): every host with the host reservations that hold
    it from now on (``query_host_allocations``: from utcnow to date.max), each {id (the reservation), lease_id,
    start_date, end_date} plus ``extras`` (blazar/plugins/base.py ``add_extra_allocation_info``); project, lease
    name and status only with ``detail`` (not served here). Dates in Blazar's ISO form, which python-chi's
    chi/hardware.py ``_parse_blazar_dt`` reads ("%Y-%m-%dT%H:%M:%S.%f"). Upstream's policy
    (blazar/policies/oshosts.py ``get_allocations``) defaults to admin; Chameleon lets its users read it (python-chi's
    ``Node.next_free_timeslot`` and Horizon's host calendar do, as users): assumed, its policy file is not public."""
    c = req.cloud
    now = c.clock.now()
    out = []
    for h in c.hosts:
        held = [{"id": r.id, "lease_id": lease.id, "start_date": fmt(lease.start), "end_date": fmt(lease.end),
                 "extras": {}}
                for lease in c.leases.values() if lease.status not in ("TERMINATED", "DELETED")  # ERROR keeps its hosts
                and lease.end > now for r in lease.reservations if isinstance(r, HostReservation) and h.id in r.hosts]
        out.append({"resource_id": h.id, "reservations": held})
    return 200, {"allocations": out}


ROUTES = [
    Route(None, "/", lambda req: (300, versions("v1.0", f"{req.base}/reservation/v1/")), auth=False),
    Route("GET", "/v1/leases", list_leases),
    Route("POST", "/v1/leases", create_lease),
    Route("GET", "/v1/leases/([^/]+)", lambda req, lid: (200, {"lease": req.cloud.get_lease(lid).view()})),
    Route("PUT", "/v1/leases/([^/]+)", lambda req, lid: (200, {"lease": req.cloud.update_lease(lid, req.body or {})})),
    Route("DELETE", "/v1/leases/([^/]+)", delete_lease),
    Route("GET", "/v1/os-hosts", hosts),
    Route("GET", "/v1/os-hosts/allocations", allocations),
]
