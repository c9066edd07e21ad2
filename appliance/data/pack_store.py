"""Pack a dataset that is in an object store object by object into shards in a store (`appliance data pack
swift://src/ swift://dst/`, s3:// and file:// alike), with no local copy: the dataset that `mode: full/shard` stage
as it is, packed for `mode: stream` when it fits no disk.

The objects under the source are grouped into samples as ``pack`` groups a directory's files (the name up to the
first dot of its last part: ``cats/0001.jpg`` and ``cats/0001.cls`` are one sample ``cats/0001``), in key order.
``concurrency`` threads GET them in that order, at most a shard's bytes ahead of the writer, each object's bytes
checked against its listing (its size; its MD5 where its ETag is one: not a Swift SLO/DLO or an S3 multipart object,
which are checked by size and counted); a 5xx, a reset or a stalled GET is asked again (a GET's deadline grows with
its size, as a stream's). The shards are tar (WebDataset) only: stream mode reads tar, and a TFRecord writer needs a
file TensorFlow opens. Each shard is written in memory (Linux: ``memfd_create``; elsewhere a temporary file), at
most UPLOADS + 1 shards at once (``pack.Shards``), and dropped once it is up; index.json goes up last. In memory at
most: UPLOADS + 1 shards, and a shard's bytes of source objects (~400 MB at 64 MB shards).
What is left to a cluster: spreading the work over its nodes by key range (one machine packs it all).
"""

from __future__ import annotations

import hashlib
import os
import re
import tempfile
from collections import deque
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from ..errors import ApplianceError
from ..node.stage import is_dir_marker
from ..node.stream_fetch import get_deadline
from ..store.base import ObjectInfo, Store, transient_retry
from ..store.hashes import segmented
from .. import report
from .pack import Shards, _ShardWriter, grouped

log = report.get(__name__)
GET_TRIES = 3  # an object whose bytes do not match its listing is fetched this many times before the pack stops
UPLOADS = 4  # shards going up at once, and in memory besides the one being written (5 x 64 MB by default)
_MD5 = re.compile(r"[0-9a-f]{32}")


def _memfile():
    """(file object, a path that opens it) of a file in memory (Linux: memfd_create), else a temporary file."""
    if hasattr(os, "memfd_create"):
        fd = os.memfd_create("appliance-pack")
        return open(fd, "w+b", buffering=0), Path(f"/proc/self/fd/{fd}")
    fh = tempfile.NamedTemporaryFile(prefix="appliance-pack-", delete=False, buffering=0)
    return fh, Path(fh.name)


def _drop(fh, path: Path):
    def drop() -> None:
        fh.close()
        if not str(path).startswith("/proc/"):
            path.unlink(missing_ok=True)
    return drop


class _Mismatch(Exception):
    """An object's bytes are not what its listing says."""


class _Source:
    """The source's objects, GET in key order ahead of the writer; counts what was checked by size only."""

    def __init__(self, store: Store, concurrency: int, ahead: int):
        self.store, self.concurrency, self.ahead = store, concurrency, ahead
        self.size_only: list[str] = []

    def _once(self, o: ObjectInfo) -> bytes:
        fh, _ = _memfile()
        with fh:
            h, hdrs = hashlib.md5(usedforsecurity=False), {}
            _, got = self.store.fetch(o.name, fh.fileno(), 0, h.update, on_headers=hdrs.update,
                                      deadline=get_deadline(o.size))
            hdrs = hdrs or got or {}
            fh.seek(0)
            data = fh.read()
        etag = o.etag.strip('"')
        plain = _MD5.fullmatch(etag) and not segmented(hdrs)
        if len(data) != o.size or (plain and h.hexdigest() != etag):
            raise _Mismatch(o.name)
        if not plain:
            self.size_only.append(o.name)
        return data

    def get(self, o: ObjectInfo) -> bytes:
        for _ in range(GET_TRIES):
            try:
                return transient_retry(lambda: self._once(o), note=lambda m: log.info(f"[pack] {o.name}: {m}"))
            except _Mismatch:
                continue
            except FileNotFoundError:
                raise ApplianceError(f"{self.store.url(o.name)} was listed but is gone",
                                     "pack again once the source is no longer being changed") from None
        raise ApplianceError(f"{self.store.url(o.name)}: its bytes did not match its listing (size, MD5) in "
                             f"{GET_TRIES} GETs", "check the object (`appliance data ls`); nothing was committed")

    def samples(self, items: list[tuple[str, dict[str, ObjectInfo]]]) -> Iterator[tuple[str, dict[str, bytes]]]:
        """(key, {ext: bytes}) in key order, ``concurrency`` samples fetched at once and at most ``ahead`` bytes
        (and one sample) ahead of the one asked for."""
        def one(files: dict[str, ObjectInfo]) -> dict[str, bytes]:
            return {e: self.get(o) for e, o in files.items()}

        with ThreadPoolExecutor(max_workers=self.concurrency) as ex:
            pending: deque = deque()
            todo, queued = iter(items), 0
            try:
                while True:
                    while not pending or (queued < self.ahead and len(pending) < 4 * self.concurrency):
                        nxt = next(todo, None)
                        if nxt is None:
                            break
                        size = sum(o.size for o in nxt[1].values())
                        pending.append((nxt[0], size, ex.submit(one, nxt[1])))
                        queued += size
                    if not pending:
                        return
                    key, size, fut = pending.popleft()
                    queued -= size
                    yield key, fut.result()
            finally:
                for _, _, fut in pending:
                    fut.cancel()


def source_items(store: Store, prefix: str, dst: tuple[Store, str]) -> list[tuple[str, dict[str, ObjectInfo]]]:
    """The source's samples: the objects under ``prefix`` (folder markers aside), grouped by key. Refused: a source
    with nothing under it, and a destination inside the source (a re-run would pack its own shards)."""
    base = prefix.rstrip("/") + "/" if prefix else ""

    def full(st: Store, p: str) -> str:
        return f"{st.scheme}://{st.where.rstrip('/')}/{p.rstrip('/')}/".replace("//", "/")

    if full(*dst).startswith(full(store, base)):
        raise ApplianceError(f"the destination {dst[0].url(dst[1])} is inside the source {store.url(base)}",
                             "pack into another prefix or container, outside the source")
    try:
        objs = [o for o in store.list(base) if o.name.startswith(base) and not is_dir_marker(o, base)]
    except FileNotFoundError:
        objs = []
    if not objs:
        raise ApplianceError(f"{store.url(base)}: no object under it to pack", "check the source URL")
    return list(grouped((o.name[len(base):], o) for o in objs).items())


def pack_store(src: Store, src_prefix: str, store: Store, prefix: str, *, shard_size: int = 64 * 1024**2,
               concurrency: int = 8) -> dict:
    """Pack the objects under ``src_prefix`` in ``src`` into tar shards under ``prefix`` in ``store``; returns
    the index (as ``pack`` writes it)."""
    prefix = prefix.rstrip("/") + "/" if prefix else ""
    items = source_items(src, src_prefix, (store, prefix))
    source = _Source(src, concurrency, ahead=shard_size)
    n_files = n_bytes = 0
    with Shards(store, prefix, UPLOADS, held=UPLOADS) as out:
        w = fh = None
        for key, parts in source.samples(items):
            if w is None:
                fh, path = _memfile()
                w = _ShardWriter(path, "tar", name=f"shard-{len(out.shards):06d}.tar", fileobj=fh)
            n_files += len(parts)
            n_bytes += sum(len(d) for d in parts.values())
            w.add(key, parts)
            if w.size() >= shard_size:
                out.finish(w, _drop(fh, w.path))
                w = None
        if w is not None:
            out.finish(w, _drop(fh, w.path))
        index = out.commit("tar", len(items), n_files, n_bytes, shard_size)
    if source.size_only:
        log.info(f"[pack] {len(source.size_only)} source object(s) in parts (a Swift SLO or DLO, an S3 multipart "
                 "upload) were checked by their size only; every other one by its MD5")
    return index
