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
from collections import OrderedDict
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from ..errors import ApplianceError
from ..store.objects import Store, md5_file as _md5
from .. import report

log = report.get(__name__)


def sample_key(rel: str) -> tuple[str, str]:
    """('dir/name', 'ext.more') for 'dir/name.ext.more' (WebDataset's rule: the first dot of the basename)."""
    d, _, base = rel.rpartition("/")
    stem, dot, ext = base.partition(".")
    if not dot or not stem:
        raise ApplianceError(f"{rel}: a packed file needs a name and an extension (key.ext)",
                             "rename it, e.g. 0001.jpg; files of one sample share the key")
    return (f"{d}/{stem}" if d else stem), ext


def samples(src: Path) -> OrderedDict[str, dict[str, Path]]:
    out: dict[str, dict[str, Path]] = {}
    for p in sorted(src.rglob("*")):
        if p.is_file():
            key, ext = sample_key(p.relative_to(src).as_posix())
            if ext in out.setdefault(key, {}):
                raise ApplianceError(f"two files for {key}.{ext}", "give each sample's files distinct extensions")
            out[key][ext] = p
    return OrderedDict(sorted(out.items()))


def _tf_example(key: str, parts: dict[str, bytes]) -> bytes:
    import tensorflow as tf

    feats = {"__key__": tf.train.Feature(bytes_list=tf.train.BytesList(value=[key.encode()]))}
    for ext, data in parts.items():
        feats[ext] = tf.train.Feature(bytes_list=tf.train.BytesList(value=[data]))
    return tf.train.Example(features=tf.train.Features(feature=feats)).SerializeToString()


class _ShardWriter:
    def __init__(self, path: Path, fmt: str):
        self.path, self.fmt = path, fmt
        self.n = 0
        self.first = self.last = None
        if fmt == "tar":
            self.tar = tarfile.open(path, "w", format=tarfile.PAX_FORMAT)
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
    shards: list[dict] = []
    n_files = n_bytes = 0
    try:  # a re-run (after an interruption, or of unchanged files) sends only the shards the store lacks
        listed = {o.name: o for o in store.list(prefix)}
    except FileNotFoundError:
        listed = {}
    kept = []
    with tempfile.TemporaryDirectory(prefix="appliance-pack-") as tmp, \
            ThreadPoolExecutor(max_workers=concurrency) as ex:
        uploads = []

        def finish(w: _ShardWriter) -> None:
            w.close()
            rec = {"name": w.path.name, "size": w.path.stat().st_size, "md5": _md5(w.path), "samples": w.n,
                   "first_key": w.first, "last_key": w.last}
            shards.append(rec)

            def up(path=w.path, rec=rec):
                there = listed.get(prefix + path.name)
                if there is not None and (there.size, there.etag.strip('"')) == (rec["size"], rec["md5"]):
                    kept.append(path.name)  # the same bytes (shards are deterministic: tar mtimes are 0)
                else:
                    store.put(prefix + path.name, path)
                path.unlink()

            uploads.append(ex.submit(up))

        w = None
        for key, files in items.items():
            if w is None:
                w = _ShardWriter(Path(tmp) / f"shard-{len(shards):06d}.{ext}", fmt)
            parts = {e: p.read_bytes() for e, p in files.items()}
            n_files += len(parts)
            n_bytes += sum(len(d) for d in parts.values())
            w.add(key, parts)
            if w.size() >= shard_size:
                finish(w)
                w = None
        if w is not None:
            finish(w)
        for f in uploads:
            f.result()
    index = {"format": fmt, "layout": "webdataset" if fmt == "tar" else "tf.train.Example",
             "samples": len(items), "files": n_files, "bytes": n_bytes, "shard_size": shard_size,
             "shards": shards}
    with tempfile.NamedTemporaryFile("w", suffix=".json", delete=False) as fh:
        json.dump(index, fh, indent=1)
        tmpname = fh.name
    try:
        store.put(prefix + "index.json", Path(tmpname))  # last: the commit point
    finally:
        os.unlink(tmpname)
    log.info(f"packed {n_files} files ({len(items)} samples, {n_bytes / 1e6:.1f} MB) into {len(shards)} {fmt} shard(s)"
             + (f"; {len(kept)} of them already in the store with the same MD5, not sent again" if kept else ""))
    return index
