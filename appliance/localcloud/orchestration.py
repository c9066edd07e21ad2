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


def versions(req: Request):
    return 300, {"versions": [{"id": "v1.0", "status": "CURRENT",
                               "links": [{"href": f"{req.base}/orchestration/v1/", "rel": "self"}]}]}


ROUTES = [  # every Heat call, the version document too, needs a token
    Route("POST", f"{V1}/stacks", create),
    Route("GET", f"{V1}/stacks", listing),
    Route(None, f"{V1}/stacks/([^/]+)(?:/([^/]+))?(/outputs)?", stack),
    Route(None, r"(?!/v1/[0-9a-f]+(?:/.*)?$).*", versions),  # anything not under /v1/PROJECT
]
