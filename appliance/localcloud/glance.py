"""Glance v2 (/image): the image list, create, data upload (stored, with Glance's checksums), delete."""

from __future__ import annotations

import hashlib

from .api import Request, Route, nova_style_error, versions
from .cloud import ApiError, _fmt, _uuid

PREFIX = "image"
DISK_FORMATS = (None, "qcow2", "raw", "vmdk", "vdi", "iso", "ami", "ari", "aki")


error_body = nova_style_error


def raw_body(method: str, path: str) -> bool:
    """A data upload streams its body: it is not JSON."""
    return method == "PUT" and path.endswith("/file")


def create(req: Request):  # queued until its data is uploaded
    c = req.cloud
    b = dict(req.body or {})
    if not b.get("name"):
        raise ApiError(400, "an image needs a name", "BadRequest")
    if b.get("disk_format") not in DISK_FORMATS:
        raise ApiError(400, f"Invalid disk format '{b.get('disk_format')}'", "BadRequest")
    now = _fmt(c.clock.now(), "%Y-%m-%dT%H:%M:%SZ")
    img = {**b, "id": b.get("id") or _uuid(), "status": "queued", "visibility": b.get("visibility", "shared"),
           "size": None, "checksum": None, "os_hash_algo": None, "os_hash_value": None, "tags": b.get("tags", []),
           "created_at": now, "updated_at": now, "min_disk": 0, "min_ram": 0, "owner": c.project_id,
           "protected": False, "file": None}
    img["file"] = f"/v2/images/{img['id']}/file"
    c.images.append(img)
    return 201, img


def listing(req: Request):
    imgs = req.cloud.images
    if "name" in req.query:
        imgs = [i for i in imgs if i["name"] == req.query["name"]]
    return 200, {"images": imgs, "first": "/v2/images", "schema": "/v2/schemas/images"}


def image(req: Request, iid: str, file: str | None):
    c = req.cloud
    img = next((i for i in c.images if i["id"] == iid), None)
    if img is None:
        raise ApiError(404, f"No image found with ID {iid}", "NotFound")
    if file and req.method == "PUT":
        return upload(req, img)
    if req.method == "DELETE" and not file:
        c.images.remove(img)
        (c.dir / "images" / img["id"]).unlink(missing_ok=True)
        return 204, None
    if req.method == "GET" and not file:
        return 200, img
    raise ApiError(404, f"not found: {req.path}", "NotFound")


def _chunks(h):
    if "chunked" in (h.headers.get("Transfer-Encoding") or "").lower():
        while True:
            size = int(h.rfile.readline().split(b";")[0].strip() or b"0", 16)
            if size == 0:
                h.rfile.readline()
                return
            yield h.rfile.read(size)
            h.rfile.readline()
    left = int(h.headers.get("Content-Length") or 0)
    while left > 0:
        chunk = h.rfile.read(min(left, 1 << 20))
        if not chunk:
            raise ApiError(400, "the image data ended early", "BadRequest")
        left -= len(chunk)
        yield chunk


def upload(req: Request, img: dict):
    """PUT /v2/images/ID/file: store the data, then the image is active with Glance's checksums."""
    if img["status"] != "queued":
        raise ApiError(409, f"Image status transition from {img['status']} to saving is not allowed", "Conflict")
    d = req.cloud.dir / "images"
    d.mkdir(parents=True, exist_ok=True)
    md5, sha512, size = hashlib.md5(), hashlib.sha512(), 0
    tmp = d / f".{img['id']}.part"
    with open(tmp, "wb") as fh:
        for chunk in _chunks(req.handler):
            fh.write(chunk)
            md5.update(chunk)
            sha512.update(chunk)
            size += len(chunk)
    tmp.replace(d / img["id"])
    img.update({"status": "active", "size": size, "checksum": md5.hexdigest(), "os_hash_algo": "sha512",
                "os_hash_value": sha512.hexdigest(),
                "updated_at": _fmt(req.cloud.clock.now(), "%Y-%m-%dT%H:%M:%SZ")})
    return 204, None


ROUTES = [
    Route(None, "/", lambda req: (300, versions("v2.15", f"{req.base}/image/v2/")), auth=False),
    Route("POST", "/v2/images", create),
    Route(None, "/v2/images", listing),
    Route(None, "/v2/images/([^/]+)(/file)?", image),
]
