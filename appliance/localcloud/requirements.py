"""Blazar's resource_properties grammar (ChameleonCloud/blazar blazar/utils/plugins.py ``convert_requirements``):
a JSON-encoded string of ``[op, "$capability", value]`` triples, joined with ``["and", ...]``."""

from __future__ import annotations

import json

from .state import ApiError

OPS = {"=", "==", "!=", ">=", "<=", ">", "<"}


def parse_requirements(text: str):
    """Parse a resource_properties string; returns a predicate on a host's capabilities."""
    if text == "":
        return lambda caps: True
    if not isinstance(text, str):
        raise ApiError(400, "resource_properties must be a JSON-encoded string", "MalformedRequirements")
    try:
        req = json.loads(text)
    except ValueError:
        raise ApiError(400, f"Malformed requirements {text}", "MalformedRequirements") from None
    return _compile(req, text)


def _compile(req, text):
    if not isinstance(req, list) or not req:
        raise ApiError(400, f"Malformed requirements {text}", "MalformedRequirements")
    if req[0] == "and":
        parts = [_compile(r, text) for r in req[1:]]
        return lambda caps: all(p(caps) for p in parts)
    if len(req) != 3 or req[0] not in OPS or not all(isinstance(x, str) for x in req):
        raise ApiError(400, f"Malformed requirements {text}", "MalformedRequirements")
    op, key, value = req
    if not key.startswith("$"):
        raise ApiError(400, f"Malformed requirements {text}", "MalformedRequirements")
    key = key[1:]

    def pred(caps):
        have = caps.get(key)
        if have is None:
            return False
        a, b = have, value
        try:
            a, b = float(have), float(value)
        except ValueError:
            pass
        return {"=": a == b, "==": a == b, "!=": a != b, ">=": a >= b, "<=": a <= b, ">": a > b, "<": a < b}[op]

    return pred
