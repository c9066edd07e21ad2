"""Pack a directory of many small files into shards: the fix for the worst access pattern there is.

A million ~100 KB objects cost a request each to list, fetch and verify; 64 MB shards cost one per
~600 files. ``pack(src, url)`` groups files into *samples* by key (the path without its extensions,
as in WebDataset: ``cats/0001.jpg`` and ``cats/0001.cls`` are one sample ``cats/0001``), keeps each
sample whole inside one shard, and writes shards of about ``shard_size`` bytes:

- ``tar``: WebDataset layout, members ``<key>.<ext>`` in key order (``shard-000000.tar``, ...);
- ``tfrecord``: one ``tf.train.Example`` per sample, feature ``__key__`` plus one bytes feature per
  extension (``shard-000000.tfrecord``, ...).

Then ``index.json`` (format, shards with size, MD5, sample count and first/last key) is uploaded
*last*, so a reader never sees an index that names a missing shard. Shards upload in parallel as
they are written. ``examples/packed/input_pipeline.py`` reads the staged shards with tf.data.
"""

from __future__ import annotations

import io
import json
import os
import tarfile
import tempfile
import threading
from collections import OrderedDict
from collections.abc import Callable, Iterable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import TypeVar

from ..errors import ApplianceError
from ..store.objects import Store, md5_file as _md5
from .. import report

log = report.get(__name__)
T = TypeVar("T")


def sample_key(rel: str) -> tuple[str, str]:
    """('dir/name', 'ext.more') for 'dir/name.ext.more' (WebDataset's rule: the first dot of the basename)."""
    d, _, base = rel.rpartition("/")
    stem, dot, ext = base.partition(".")
    if not dot or not stem:
        raise ApplianceError(f"{rel}: a packed file needs a name and an extension (key.ext)",
                             "rename it, e.g. 0001.jpg; files of one sample share the key")
    return (f"{d}/{stem}" if d else stem), ext


def samples(src: Path) -> OrderedDict[str, dict[str, Path]]:
    return grouped((p.relative_to(src).as_posix(), p) for p in sorted(src.rglob("*")) if p.is_file())


def grouped(files: Iterable[tuple[str, T]]) -> OrderedDict[str, dict[str, T]]:
    """{sample key: {extension: file}} of (relative name, file) pairs, in key order."""
    out: dict[str, dict[str, T]] = {}
    for rel, f in files:
        key, ext = sample_key(rel)
        if ext in out.setdefault(key, {}):
            raise ApplianceError(f"two files for {key}.{ext}", "give each sample's files distinct extensions")
        out[key][ext] = f
    return OrderedDict(sorted(out.items()))


def _tf_example(key: str, parts: dict[str, bytes]) -> bytes:
    import tensorflow as tf

    feats = {"__key__": tf.train.Feature(bytes_list=tf.train.BytesList(value=[key.encode()]))}
    for ext, data in parts.items():
        feats[ext] = tf.train.Feature(bytes_list=tf.train.BytesList(value=[data]))
    return tf.train.Example(features=tf.train.Features(feature=feats)).SerializeToString()


class _ShardWriter:
    """A shard being written to ``path`` (tar: into ``fileobj`` when given), named ``name`` in the store."""

    def __init__(self, path: Path, fmt: str, *, name: str | None = None, fileobj=None):
        self.path, self.fmt, self.name = path, fmt, name or path.name
        self.n = 0
        self.first = self.last = None
        if fmt == "tar":
            self.tar = tarfile.open(path if fileobj is None else None, "w", fileobj, format=tarfile.PAX_FORMAT)
        else:
            import tensorflow as tf

            self.rec = tf.io.TFRecordWriter(str(path))

    def add(self, key: str, parts: dict[str, bytes]) -> None:
        if self.fmt == "tar":
            for ext, data in sorted(parts.items()):
                ti = tarfile.TarInfo(f"{key}.{ext}")
                ti.size, ti.mtime, ti.mode = len(data), 0, 0o644
                ti.uname = ti.gname = ""
                self.tar.addfile(ti, io.BytesIO(data))
        else:
            self.rec.write(_tf_example(key, parts))
        self.n += 1
        self.first = self.first or key
        self.last = key

    def size(self) -> int:
        if self.fmt == "tar":
            return self.tar.fileobj.tell()
        self.rec.flush()
        return self.path.stat().st_size

    def close(self) -> None:
        if self.fmt == "tar":
            self.tar.close()
        else:
            self.rec.close()


class Shards:
    """The shards of one pack going up to ``prefix`` in ``store`` while the next is written: at most ``concurrency``
    uploads at once and ``held`` shards (default 2 x ``concurrency``) uploading or waiting to (each shard's bytes
    are dropped once sent), a shard the store holds with the same size and MD5 not sent again (a re-run: shards are
    deterministic, tar mtimes are 0), and ``commit`` writes index.json last."""

    def __init__(self, store: Store, prefix: str, concurrency: int, held: int | None = None):
        self.store, self.prefix = store, prefix
        try:
            self.listed = {o.name: o for o in store.list(prefix)}
        except FileNotFoundError:
            self.listed = {}
        self.kept: list[str] = []
        self.shards: list[dict] = []
        self._ex = ThreadPoolExecutor(max_workers=concurrency)
        self._slots = threading.BoundedSemaphore(held or 2 * concurrency)
        self._uploads: list = []

    def __enter__(self) -> Shards:
        return self

    def __exit__(self, *exc) -> None:
        self._ex.shutdown(wait=True, cancel_futures=exc[0] is not None)

    def finish(self, w: _ShardWriter, drop: Callable[[], None]) -> None:
        """``w`` closed, its record kept, and its upload queued; ``drop()`` once it is up (or failed)."""
        w.close()
        rec = {"name": w.name, "size": w.path.stat().st_size, "md5": _md5(w.path), "samples": w.n,
               "first_key": w.first, "last_key": w.last}
        self.shards.append(rec)
        self._slots.acquire()

        def up() -> None:
            try:
                there = self.listed.get(self.prefix + rec["name"])
                if there is not None and (there.size, there.etag.strip('"')) == (rec["size"], rec["md5"]):
                    self.kept.append(rec["name"])
                else:
                    self.store.put(self.prefix + rec["name"], w.path)
            finally:
                drop()
                self._slots.release()

        self._uploads.append(self._ex.submit(up))

    def commit(self, fmt: str, samples: int, files: int, n_bytes: int, shard_size: int) -> dict:
        """Every shard up, then index.json (the commit point: a reader never sees an index naming a missing
        shard); returns the index."""
        for f in self._uploads:
            f.result()
        index = {"format": fmt, "layout": "webdataset" if fmt == "tar" else "tf.train.Example", "samples": samples,
                 "files": files, "bytes": n_bytes, "shard_size": shard_size, "shards": self.shards}
        with tempfile.NamedTemporaryFile("w", suffix=".json", delete=False) as fh:
            json.dump(index, fh, indent=1)
            tmpname = fh.name
        try:
            self.store.put(self.prefix + "index.json", Path(tmpname))
        finally:
            os.unlink(tmpname)
        log.info(f"packed {files} files ({samples} samples, {n_bytes / 1e6:.1f} MB) into {len(self.shards)} {fmt} "
                 "shard(s)" + (f"; {len(self.kept)} of them already in the store with the same MD5, not sent again"
                               if self.kept else ""))
        return index


def pack(src: str | Path, store: Store, prefix: str, *, shard_size: int = 64 * 1024**2, fmt: str = "tar",
         concurrency: int = 8) -> dict:
    """Pack ``src`` into shards under ``prefix`` in ``store``; returns the index."""
    if fmt not in ("tar", "tfrecord"):
        raise ApplianceError(f"unknown shard format {fmt!r}", "use tar (WebDataset) or tfrecord")
    src = Path(src)
    if not src.is_dir():
        raise ApplianceError(f"{src}: not a directory", "give the directory of files to pack")
    items = samples(src)
    if not items:
        raise ApplianceError(f"{src}: no files to pack")
    prefix = prefix.rstrip("/") + "/" if prefix else ""
    ext = "tar" if fmt == "tar" else "tfrecord"
    n_files = n_bytes = 0
    with tempfile.TemporaryDirectory(prefix="appliance-pack-") as tmp, Shards(store, prefix, concurrency) as out:
        w = None
        for key, files in items.items():
            if w is None:
                w = _ShardWriter(Path(tmp) / f"shard-{len(out.shards):06d}.{ext}", fmt)
            parts = {e: p.read_bytes() for e, p in files.items()}
            n_files += len(parts)
            n_bytes += sum(len(d) for d in parts.values())
            w.add(key, parts)
            if w.size() >= shard_size:
                out.finish(w, w.path.unlink)
                w = None
        if w is not None:
            out.finish(w, w.path.unlink)
        return out.commit(fmt, len(items), n_files, n_bytes, shard_size)
