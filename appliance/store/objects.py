"""Object stores by URL: swift://container/prefix, s3://bucket/prefix, file:///path.

One small interface, ``Store``: ``list`` (paged with markers through any number of objects),
``get`` (streamed, optionally a byte range), ``put`` (SLO-segmented above a size), ``delete``.
Swift goes through python-swiftclient (one connection per thread), S3 through boto3.

The interface and its records are in base.py, the checksums in hashes.py, the stores in swift.py, s3.py and
here (file://); this module names them all, and opens one by URL (``open_store``).

Credentials (``StoreCreds``) come from the same place as provisioning: a Keystone session
(storage URL + token, both scoped and expiring), or Swift v1 auth (the local cloud's Ceph RGW or Swift; tokens
renewed on a 401), and EC2-style keys for S3. They are never logged and never put on a command line.
"""

from __future__ import annotations

import os
import tempfile
from collections.abc import Callable, Iterator
from pathlib import Path

from .. import report
from ..errors import ApplianceError, socket_reason, untrusted_certificate
from .base import (  # noqa: F401 - the stores' names, here as before the split
    LIST_DEADLINE, MAX_OBJECT, SEGMENTS_IN_FLIGHT, SWIFT_PAGE, ObjectInfo, Store, StoreCreds, StoreRefused, _check_name,
    _no_answer, _status, _transient, container_name_problem, parse_url, quota_exceeded, transient_retry)
from .hashes import (  # noqa: F401
    CRC_META, EMPTY_MD5, HASH_THREADS, Crc32, _crc32, crc32_combine, crc_from, crc_meta, large_object_etags,
    md5_file, md5_range, parts_match, segmented, slo_etag)
from .s3 import S3Store
from .swift import SwiftStore

log = report.get(__name__)


class FileStore(Store):
    scheme = "file"

    def __init__(self, root: str):
        self.root = Path(root)
        self.where = str(self.root)

    def list(self, prefix: str = "") -> Iterator[ObjectInfo]:
        base = self.root
        for dirpath, _dirs, files in sorted(os.walk(base)):
            for f in sorted(files):
                p = Path(dirpath) / f
                name = str(p.relative_to(base))
                if not name.startswith(prefix):
                    continue
                try:
                    info = ObjectInfo(name, p.stat().st_size, md5_file(p))
                except FileNotFoundError:  # gone since the walk (a writer's .part renamed onto its name): not there
                    continue
                yield info

    def get(self, name, write, *, start=None, end=None) -> dict:
        with open(self.root / name, "rb") as fh:
            if start:
                fh.seek(start)
            left = None if end is None else end - (start or 0) + 1
            while left is None or left > 0:
                chunk = fh.read(1 << 20 if left is None else min(1 << 20, left))
                if not chunk:
                    break
                write(chunk)
                if left is not None:
                    left -= len(chunk)
        return {}

    def put(self, name, path, *, segment_size=MAX_OBJECT, md5s=None) -> str:
        dst = self.root / name
        dst.parent.mkdir(parents=True, exist_ok=True)
        tmp = dst.with_name(dst.name + ".part")
        with open(path, "rb") as src, open(tmp, "wb") as out:
            while chunk := src.read(1 << 20):
                out.write(chunk)
        tmp.replace(dst)
        return md5_file(dst)

    def create(self, name, data) -> bool:
        """The bytes in a file of their own, then link(2) to the name: it fails with EEXIST where the name is taken,
        so of two writers exactly one wins, and a reader never sees half of it."""
        dst = self.root / name
        dst.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(prefix=".create-", dir=dst.parent)
        try:
            with open(fd, "wb") as fh:
                fh.write(data)
            os.link(tmp, dst)
        except FileExistsError:
            return False
        finally:
            os.unlink(tmp)
        return True

    def delete(self, name) -> None:
        p = self.root / name
        p.unlink(missing_ok=True)
        for d in p.parents:  # no empty pseudo-directories left behind, as in an object store
            if d == self.root or self.root not in d.parents:
                break
            try:
                d.rmdir()
            except OSError:
                break


def unreachable(store: Store, e: BaseException) -> ApplianceError | None:
    """A store that never answered (refused, unresolvable, reset, timed out), or whose certificate this machine
    does not trust, in one line with the fix; None for any other failure (an HTTP answer, our own refusal)."""
    where = f" at {store.endpoint}" if store.endpoint else ""
    why = untrusted_certificate(e)
    if why:  # an https store (Chameleon's are) whose certificate no CA bundle here vouches for
        return ApplianceError(f"the object store{where} sent a certificate this machine does not trust ({why})",
                              "point REQUESTS_CA_BUNDLE (or SSL_CERT_FILE) at the CA bundle that signed it, or "
                              "update the system's CA certificates (the ca-certificates package)")
    if not _no_answer(e):
        return None
    fix = {"s3": "check APPLIANCE_S3_ENDPOINT (or the object-store endpoint in OS_CLOUD's catalog) and the network",
           "swift": "check ST_AUTH (or the object-store endpoint in OS_CLOUD's catalog) and the network"}
    return ApplianceError(f"cannot reach the object store{where} ({socket_reason(e)})",
                          fix.get(store.scheme, "check the network"))


def open_store(url: str, creds: StoreCreds | None,
               renew: Callable[[], StoreCreds] | None = None) -> tuple[Store, str]:
    """(store, prefix) for a URL. ``renew``: new credentials when a Swift store refuses a bare token (SwiftStore)."""
    scheme, where, prefix = parse_url(url)
    if scheme == "file":
        return FileStore(where), prefix
    if creds is None:
        raise ApplianceError(f"no credentials for {url}", "see docs/staging.md (OS_CLOUD, or the local cloud)")
    if scheme == "swift":
        return SwiftStore(where, creds, renew), prefix
    return S3Store(where, creds), prefix


def swift_fallback(url: str, creds: StoreCreds) -> tuple[Store, str] | None:
    """s3://bucket/prefix -> swift://bucket/prefix (same data on Chameleon's Ceph), if Swift creds exist."""
    scheme, where, prefix = parse_url(url)
    if scheme != "s3" or not (creds.storage_url or creds.auth_url or creds.app_cred):
        return None
    return SwiftStore(where, creds), prefix
