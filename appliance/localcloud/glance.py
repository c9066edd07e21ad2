"""Glance v2 (/image): the image list, create, data upload (stored, with Glance's checksums), delete, and the image
schemas glanceclient builds its models from."""

from __future__ import annotations

import hashlib

from .api import Request, Route, nova_style_error, versions
from .cloud import ApiError, _fmt, _uuid
from .state import Image

PREFIX = "image"
# glance/common/config.py image_format_opts: the defaults of [image_format] disk_formats and container_formats
DISK_FORMATS = (None, "ami", "ari", "aki", "vhd", "vhdx", "vmdk", "raw", "qcow2", "vdi", "iso", "ploop")
CONTAINER_FORMATS = (None, "ami", "ari", "aki", "bare", "ovf", "ova", "docker", "compressed")


def image_schema() -> dict:
    """GET /v2/schemas/image, as glance/api/v2/schemas.py Controller.image serves it: images.get_schema()'s
    base properties (glance/api/v2/images.py get_base_properties, descriptions left out) in a PermissiveSchema
    (glance/schema.py: other properties are strings). glanceclient reads it before it lists or shows an image
    (glanceclient/v2/images.py unvalidated_model), so python-chi's chi.image.get_image needs it."""
    s, ns, ro = {"type": "string"}, {"type": ["null", "string"]}, {"readOnly": True}
    props = {
        "id": {**s, "pattern": "^([0-9a-fA-F]){8}-([0-9a-fA-F]){4}-([0-9a-fA-F]){4}-([0-9a-fA-F]){4}-([0-9a-fA-F]){12}$"},
        "name": {**ns, "maxLength": 255},
        "status": {**s, **ro, "enum": ["queued", "saving", "active", "killed", "deleted", "uploading", "importing",
                                       "pending_delete", "deactivated"]},
        "visibility": {**s, "enum": ["community", "public", "private", "shared"]},
        "protected": {"type": "boolean"}, "os_hidden": {"type": "boolean"},
        "checksum": {**ns, **ro, "maxLength": 32}, "os_hash_algo": {**ns, **ro, "maxLength": 64},
        "os_hash_value": {**ns, **ro, "maxLength": 128}, "owner": {**ns, "maxLength": 255},
        "size": {"type": ["null", "integer"], **ro}, "virtual_size": {"type": ["null", "integer"], **ro},
        "container_format": {**ns, "enum": list(CONTAINER_FORMATS)}, "disk_format": {**ns, "enum": list(DISK_FORMATS)},
        "created_at": {**s, **ro}, "updated_at": {**s, **ro},
        "tags": {"type": "array", "items": {**s, "maxLength": 255}},
        "direct_url": {**s, **ro}, "min_ram": {"type": "integer"}, "min_disk": {"type": "integer"},
        "self": {**s, **ro}, "file": {**s, **ro}, "stores": {**s, **ro}, "schema": {**s, **ro},
        "locations": {"type": "array", "items": {"type": "object", "required": ["url", "metadata"], "properties": {
            "url": {**s, "maxLength": 255}, "metadata": {"type": "object"}}}},
    }
    return {"name": "image", "properties": props, "additionalProperties": {"type": "string"},
            "links": [{"rel": "self", "href": "{self}"}, {"rel": "enclosure", "href": "{file}"},
                      {"rel": "describedby", "href": "{schema}"}]}


def images_schema() -> dict:
    """GET /v2/schemas/images: glance/schema.py CollectionSchema('images', the image schema).raw()."""
    return {"name": "images", "properties": {"images": {"type": "array", "items": image_schema()},
                                             "first": {"type": "string"}, "next": {"type": "string"},
                                             "schema": {"type": "string"}},
            "links": [{"rel": "first", "href": "{first}"}, {"rel": "next", "href": "{next}"},
                      {"rel": "describedby", "href": "{schema}"}]}


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
    img = Image(b.get("id") or _uuid(), b["name"], c.project_id, now, disk_format=b.get("disk_format"),
                container_format=b.get("container_format"), visibility=b.get("visibility", "shared"),
                tags=b.get("tags", []), updated_at=now, properties={k: v for k, v in b.items() if k not in Image.CORE})
    c.images.append(img)
    return 201, img.view()


def listing(req: Request):
    imgs = req.cloud.images
    if "name" in req.query:
        imgs = [i for i in imgs if i.name == req.query["name"]]
    return 200, {"images": [i.view() for i in imgs], "first": "/v2/images", "schema": "/v2/schemas/images"}


def image(req: Request, iid: str, file: str | None):
    c = req.cloud
    img = next((i for i in c.images if i.id == iid), None)
    if img is None:
        raise ApiError(404, f"No image found with ID {iid}", "NotFound")
    if file and req.method == "PUT":
        return upload(req, img)
    if req.method == "DELETE" and not file:
        c.images.remove(img)
        (c.dir / "images" / img.id).unlink(missing_ok=True)
        return 204, None
    if req.method == "GET" and not file:
        return 200, img.view()
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


def upload(req: Request, img: Image):
    """PUT /v2/images/ID/file: store the data, then the image is active with Glance's checksums."""
    if img.status != "queued":
        raise ApiError(409, f"Image status transition from {img.status} to saving is not allowed", "Conflict")
    d = req.cloud.dir / "images"
    d.mkdir(parents=True, exist_ok=True)
    md5, sha512, size = hashlib.md5(), hashlib.sha512(), 0
    tmp = d / f".{img.id}.part"
    with open(tmp, "wb") as fh:
        for chunk in _chunks(req.handler):
            fh.write(chunk)
            md5.update(chunk)
            sha512.update(chunk)
            size += len(chunk)
    tmp.replace(d / img.id)
    img.status, img.size, img.checksum = "active", size, md5.hexdigest()
    img.os_hash_algo, img.os_hash_value = "sha512", sha512.hexdigest()
    img.updated_at = _fmt(req.cloud.clock.now(), "%Y-%m-%dT%H:%M:%SZ")
    return 204, None


ROUTES = [
    Route(None, "/", lambda req: (300, versions("v2.15", f"{req.base}/image/v2/")), auth=False),
    Route("POST", "/v2/images", create),
    Route(None, "/v2/images", listing),
    Route(None, "/v2/images/([^/]+)(/file)?", image),
    Route("GET", "/v2/schemas/image", lambda req: (200, image_schema())),  # glance/api/v2/router.py
    Route("GET", "/v2/schemas/images", lambda req: (200, images_schema())),
]
