"""Heat v1 (/orchestration): stacks of the resource types our template uses. The engine (validation, intrinsic
functions, dependency order) is heat.py; this is its API."""

from __future__ import annotations

import functools

from .api import Request, Route
from .heat import HeatError

PREFIX = "orchestration"
V1 = "/v1/([0-9a-f]+)"


def error_body(e) -> dict:
    """openstack/heat heat/api/middleware/fault.py FaultWrapper: code, title, explanation, and error {message, type,
    traceback}, as for the validation errors below."""
    return {"code": e.code, "title": e.name or "Error", "explanation": e.message,
            "error": {"message": e.message, "type": e.name or "Error", "traceback": None}}


def _heat_errors(fn):
    @functools.wraps(fn)
    def wrapper(req, *a):
        try:
            return fn(req, *a)
        except HeatError as e:
            return e.code, {"code": e.code, "title": e.title, "explanation": e.message,
                            "error": {"message": e.message, "type": "StackValidationFailed", "traceback": None}}
    return wrapper


def _base(req: Request, project: str) -> str:
    return f"{req.base}/orchestration/v1/{project}"


@_heat_errors
def create(req: Request, project: str):
    hbase = _base(req, project)
    st = req.cloud.heat.create(req.body or {}, hbase)
    return 201, {"stack": {"id": st.id, "links": [{"href": f"{hbase}/stacks/{st.name}/{st.id}", "rel": "self"}]}}


@_heat_errors
def listing(req: Request, project: str):
    hbase = _base(req, project)
    return 200, {"stacks": [{k: v for k, v in s.view(hbase).items() if k not in ("outputs", "parameters")}
                            for s in req.cloud.heat.stacks.values() if s.status != "DELETE_COMPLETE"]}


@_heat_errors
def stack(req: Request, project: str, name: str, sid: str | None, outputs: str | None):
    heat = req.cloud.heat
    st = heat.find(sid or name)
    if req.method == "DELETE":
        heat.delete(st)
        return 204, None
    if outputs:
        return 200, {"outputs": [{"output_key": o["output_key"], "description": o["description"]} for o in st.outputs]}
    return 200, {"stack": st.view(_base(req, project))}


def _stack_link(req: Request, project: str, st) -> str:
    return f"{_base(req, project)}/stacks/{st.name}/{st.id}"


def _event_view(req: Request, project: str, st, ev: dict) -> dict:
    """heat/api/openstack/v1/events.py format_event with the index's summary keys: the id and its links (the event,
    its resource, its stack: heatclient's `stack create --wait` tells the stack's own events by the stack link's
    last part being their physical_resource_id), the time, the resource's logical and physical ids, and
    RES_ACTION joined to RES_STATUS ("CREATE_COMPLETE")."""
    stack = _stack_link(req, project, st)
    res = f"{stack}/resources/{ev['resource_name']}"
    return {"id": ev["id"], "event_time": ev["event_time"], "resource_name": ev["resource_name"],
            "logical_resource_id": ev["resource_name"], "physical_resource_id": ev["physical_resource_id"],
            "resource_status": ev["resource_status"], "resource_status_reason": ev["resource_status_reason"],
            "links": [{"href": f"{res}/events/{ev['id']}", "rel": "self"}, {"href": res, "rel": "resource"},
                      {"href": stack, "rel": "stack"}]}


@_heat_errors
def events(req: Request, project: str, name: str, sid: str | None, resource: str | None = None):
    """GET .../stacks/NAME[/ID][/resources/RES]/events (heat/api/openstack/v1/events.py EventController.index):
    oldest first unless ``sort_dir=desc``, after ``marker`` (an event id), at most ``limit``; a resource that has
    no events is 404. Heat answers the name-only path with a 302 to NAME/ID (util.identified_stack's lookup); this
    answers it directly, which the clients (keystoneauth follows the 302) cannot tell apart."""
    st = req.cloud.heat.find(sid or name)
    with st.lock:
        evs = [e for e in st.events if resource is None or e["resource_name"] == resource]
    if resource is not None and not evs:
        raise HeatError(404, f"No events found for resource {resource}", "Not Found")
    if req.query.get("sort_dir") == "desc":
        evs = evs[::-1]
    marker = req.query.get("marker")
    if marker:
        at = next((i for i, e in enumerate(evs) if e["id"] == marker), None)
        if at is None:
            raise HeatError(404, f"The Event ({marker}) could not be found.", "Not Found")
        evs = evs[at + 1:]
    if req.query.get("limit"):
        evs = evs[:int(req.query["limit"])]
    return 200, {"events": [_event_view(req, project, st, e) for e in evs]}


def _resource_view(req: Request, project: str, st, name: str) -> dict:
    """heat/api/openstack/v1/resources.py format_resource: logical and physical ids, type, action_status, reason,
    times, links (itself, its stack); INIT_COMPLETE before it is created."""
    stack = _stack_link(req, project, st)
    with st.lock:
        state = dict(st.states[name])
    return {"resource_name": name, "logical_resource_id": name, "physical_resource_id": state["physical"],
            "resource_type": st.template["resources"][name].get("type"), "resource_status": state["status"],
            "resource_status_reason": state["reason"], "creation_time": st.created,
            "updated_time": state["time"] or st.created, "required_by": [],
            "links": [{"href": f"{stack}/resources/{name}", "rel": "self"}, {"href": stack, "rel": "stack"}]}


@_heat_errors
def resources(req: Request, project: str, name: str, sid: str | None, resource: str | None = None):
    """GET .../stacks/NAME[/ID]/resources[/RES] (ResourceController.index and show): the template's resources
    (nested_depth 0), or one of them; an unknown one is 404."""
    st = req.cloud.heat.find(sid or name)
    if resource is None:
        return 200, {"resources": [_resource_view(req, project, st, n) for n in st.states]}
    if resource not in st.states:
        raise HeatError(404, f"The Resource ({resource}) could not be found.", "Not Found")
    return 200, {"resource": _resource_view(req, project, st, resource)}


def versions(req: Request):
    return 300, {"versions": [{"id": "v1.0", "status": "CURRENT",
                               "links": [{"href": f"{req.base}/orchestration/v1/", "rel": "self"}]}]}


ROUTES = [  # every Heat call, the version document too, needs a token (routes: heat/api/openstack/v1/__init__.py)
    Route("POST", f"{V1}/stacks", create),
    Route("GET", f"{V1}/stacks", listing),
    Route("GET", f"{V1}/stacks/([^/]+)(?:/([^/]+))?/events", events),
    Route("GET", f"{V1}/stacks/([^/]+)/([^/]+)/resources/([^/]+)/events", events),
    Route("GET", f"{V1}/stacks/([^/]+)(?:/([^/]+))?/resources", resources),
    Route("GET", f"{V1}/stacks/([^/]+)/([^/]+)/resources/([^/]+)", resources),
    Route(None, f"{V1}/stacks/([^/]+)(?:/([^/]+))?(/outputs)?", stack),
    Route(None, r"(?!/v1/[0-9a-f]+(?:/.*)?$).*", versions),  # anything not under /v1/PROJECT
]
