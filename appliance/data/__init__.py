"""Data, the launcher's side: the cluster-wide stage that runs the per-node stager (appliance.node.stage_main) on
every node in parallel over SSH, and the `appliance data` verbs (upload, pack, ls, rm). Object-store access is
appliance.store; credentials come from the caller (flows asks the site)."""

from __future__ import annotations

import hashlib
import json
import shlex
import threading
import time
from collections.abc import Callable
from contextlib import contextmanager
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from ..cluster import Cluster
from ..errors import ApplianceError, Unavailable
from ..node.stage import _fmt_bytes
from ..protocol import Line, parse
from ..remote import Session
from ..store.objects import StoreCreds, large_object_etags, open_store, unreachable
from ..store.parts import s3transfer_part
from .. import report

log = report.get(__name__)


def _bar(p: dict) -> str:
    tot = p.get("bytes_total") or 0
    pct = 100.0 * p["bytes"] / tot if tot else 100.0
    eta = f"{p['eta']:.0f}s" if p.get("eta") is not None else "-"
    return (f"{p['files']}/{p['files_total']} files {_fmt_bytes(p['bytes'])}/{_fmt_bytes(tot)} "
            f"({pct:.0f}%) {_fmt_bytes(p['rate'])}/s ETA {eta}")


PER_NODE_BARS = 4  # up to this many nodes, one progress bar each; beyond, one line for the whole cluster


def progress_line(progress: dict[str, dict], nodes: int) -> str:
    """The stage's progress line: a bar per node on a few nodes; on more (a line of 16 or 64 bars is unreadable)
    the cluster's totals and its slowest node, which is what the wait depends on."""
    if nodes <= PER_NODE_BARS:
        return "[stage] " + " | ".join(f"{n}: {_bar(p)}" for n, p in sorted(progress.items()))
    agg = {k: sum(p.get(k) or 0 for p in progress.values()) for k in ("files", "files_total", "bytes", "bytes_total",
                                                                        "rate")}
    agg["eta"] = max((p["eta"] for p in progress.values() if p.get("eta") is not None), default=None)

    def done(p: dict) -> float:
        return p["bytes"] / p["bytes_total"] if p.get("bytes_total") else 1.0

    slow_name, slow = min(progress.items(), key=lambda kv: (done(kv[1]), kv[0]))
    return f"[stage] {len(progress)}/{nodes} nodes: {_bar(agg)}; slowest {slow_name} {100 * done(slow):.0f}%"


def stage_cluster(cluster: Cluster, url: str, dest: str, *, mode: str = "full", creds=None, concurrency: int = 16,
                  keep_names: bool = False, keep_extra: bool = False,
                  out: Callable[[str], None] | None = None) -> dict[str, dict]:
    """Run the stager on every node in parallel; returns each node's result. Raises on any node's failure."""
    say = out or log.info
    scoped = creds.scoped(url) if creds is not None else None
    progress: dict[str, dict] = {}
    results: dict[str, dict] = {}
    errors: dict[str, str] = {}
    unanswered: set[str] = set()  # nodes whose error was the store not answering (the node's word)
    lock = threading.Lock()

    def show():
        with lock:
            if progress:
                say(progress_line(progress, len(cluster.nodes)))

    def run(node_index: int, remote) -> None:
        node = remote.node
        job = {"url": url, "dest": f"{node.workdir}/{dest}", "mode": mode, "rank": node_index,
               "nodes": len(cluster.nodes), "concurrency": concurrency, "keep_names": keep_names, "keep_extra": keep_extra,
               "creds": scoped.__dict__ if scoped else None}

        def on_line(stream, line):
            got = parse(line, (Line.PROGRESS, Line.STAGED, Line.ERROR, Line.NOTE))
            if got is None:
                return
            kind, body = got
            if kind == Line.PROGRESS:
                with lock:
                    progress[node.name] = body
            elif kind == Line.STAGED:
                results[node.name] = body
            elif kind == Line.ERROR:
                errors[node.name] = body["message"] + (f" (fix: {body['fix']})" if body.get("fix") else "")
                if body.get("unavailable"):
                    unanswered.add(node.name)
            else:
                say(f"[stage] {node.name}: {body}")

        cmd = f"{shlex.quote(cluster.python)} -m appliance.node.stage_main"
        r = remote.run(cmd, stdin=json.dumps(job).encode(), on_line=on_line)
        if r.rc != 0 and node.name not in errors:
            errors[node.name] = f"stager exited {r.rc}: {r.err.strip()[-300:]}"

    t0 = time.monotonic()
    with _every(1.0, show), Session(cluster) as s:
        remotes = [s[n.name] for n in cluster.nodes]
        with ThreadPoolExecutor(max_workers=len(remotes)) as ex:
            for f in [ex.submit(run, i, r) for i, r in enumerate(remotes)]:
                f.result()
    if errors:  # Unavailable when every node's store did not answer: the same staging later may well work
        name, msg = sorted(errors.items())[0]
        raise (Unavailable if unanswered >= set(errors) else ApplianceError)(f"staging failed on {name}: {msg}"
                             + (f" (and on {len(errors) - 1} other node(s))" if len(errors) > 1 else ""))
    wall = time.monotonic() - t0
    for name, r in sorted(results.items()):
        say(f"[stage] {name}: {r['files_fetched']} fetched, {r['files_skipped']} already here, "
            f"{_fmt_bytes(r['bytes_fetched'])} in {r['seconds']:.1f}s ({r['mb_per_s']} MB/s), "
            f"{r['retries']} retries, {r['corrupt_refetched']} corrupt re-fetched"
            + (f", {r['files_removed']} no longer in the store removed" if r.get("files_removed") else "")
            + f" -> {r['dest']}")
        if r.get("size_only"):
            shown = ", ".join(repr(n) for n in r["size_only"][:3]) + (" ..." if len(r["size_only"]) > 3 else "")
            say(f"[stage] warning: {name}: {len(r['size_only'])} object(s) uploaded in parts checked by size only: "
                f"{shown} (the store shows neither an SLO's segments, which Ceph RGW keeps out of sight unless "
                "they are in CONTAINER_segments/NAME/, nor the sizes of an S3 upload's parts, and no upload "
                "tool's rule gives them); upload them with `appliance data upload` to have them verified")
    say(f"[stage] done in {wall:.1f}s on {len(results)} node(s)")
    return results


def unstaged(cluster: Cluster, dest: str) -> list[str]:
    """The nodes whose ``dest`` (under their work directory) is missing or empty: a job there would find no data."""
    def empty(r) -> bool:
        path = shlex.quote(f"{r.node.workdir}/{dest}")
        return not r.run(f"ls -A {path} 2>/dev/null | head -1", timeout=30).out.strip()

    with Session(cluster) as s:
        return sorted(name for name, e in s.each(empty).items() if e)


@contextmanager
def _every(seconds: float, fn: Callable[[], None]):
    """Call ``fn`` every ``seconds`` on a thread while the block runs (progress lines)."""
    stop = threading.Event()

    def loop():
        while not stop.wait(seconds):
            fn()

    t = threading.Thread(target=loop, daemon=True)
    t.start()
    try:
        yield
    finally:
        stop.set()
        t.join(timeout=2)


def _already_there(store, listed: dict, path: Path, name: str, segment_size: int) -> bool:
    """The store holds ``name`` with this file's size and content: its ETag is the file's MD5, or the SLO or
    multipart ETag of the file as `data upload` sends it: Swift segments of ``segment_size``; S3 parts of
    ``segment_size`` as boto3 adjusts it (at least 5 MiB, doubled past 10,000 parts: store/parts.py), for a
    file over ``segment_size`` (so possibly one part: "MD5-1")."""
    o = listed.get(name)
    size = path.stat().st_size
    if o is None or o.size != size:
        return False
    if store.scheme == "s3" and size > segment_size:
        e = large_object_etags(path, s3transfer_part(segment_size, size))
        want = e.get("s3") or hashlib.md5(bytes.fromhex(e["md5"])).hexdigest() + "-1"
        return o.etag == want
    return o.etag in {v for k, v in large_object_etags(path, segment_size).items() if k in ("md5", "swift", "s3")}


def upload(src: str, url: str, *, creds: StoreCreds | None, segment_size: int = 5 * 1024**3,
           concurrency: int = 16) -> int:
    """`appliance data upload DIR URL`: every file under DIR to URL/<relative path>, in parallel. A file the store
    already holds with the same size and MD5 (a re-run after an interruption) is not sent again. Returns how many
    files of DIR are at URL."""
    root = Path(src)
    files = [p for p in sorted(root.rglob("*")) if p.is_file()] if root.is_dir() else [root]
    if not files:
        raise ApplianceError(f"{src}: nothing to upload", "give a file or a non-empty directory")
    with _open(url, creds, create=True) as (store, prefix):
        base = root if root.is_dir() else root.parent
        names = [(p, f"{prefix.rstrip('/') + '/' if prefix else ''}{p.relative_to(base).as_posix()}")
                 for p in files]
        try:
            listed = {o.name: o for o in store.list(prefix)}
        except FileNotFoundError:
            listed = {}
        with ThreadPoolExecutor(max_workers=concurrency) as ex:
            fresh = list(ex.map(lambda pn: not _already_there(store, listed, pn[0], pn[1], segment_size), names))
        todo = [pn for pn, f in zip(names, fresh) if f]
        total = sum(p.stat().st_size for p, _ in todo)
        done = {"files": 0, "bytes": 0}
        lock = threading.Lock()
        t0 = time.monotonic()

        def put(pn) -> None:
            store.put(pn[1], pn[0], segment_size=segment_size)
            with lock:
                done["files"] += 1
                done["bytes"] += pn[0].stat().st_size

        def show() -> None:
            with lock:
                el = max(time.monotonic() - t0, 1e-6)
                rate = done["bytes"] / el
                log.info("[upload] " + _bar({"files": done["files"], "files_total": len(todo), "bytes": done["bytes"],
                                             "bytes_total": total, "rate": rate,
                                             "eta": (total - done["bytes"]) / rate if rate > 0 else None}))

        with _every(2.0, show), ThreadPoolExecutor(max_workers=concurrency) as ex:
            list(ex.map(put, todo))
    kept = len(names) - len(todo)
    log.info(f"uploaded {len(todo)} file(s) ({_fmt_bytes(total)}) to {url}"
             + (f"; {kept} already there with the same size and MD5" if kept else ""))
    return len(names)


@contextmanager
def _open(url: str, creds: StoreCreds | None, *, create: bool = False):
    """(store, prefix) for a `data` verb: a store that never answers is one line with the fix (not requests' or
    botocore's chain of wrappers)."""
    store, prefix = open_store(url, creds)
    try:
        if create and hasattr(store, "ensure_container"):  # Swift's container, S3's bucket
            store.ensure_container()
        yield store, prefix
    except Exception as e:
        said = unreachable(store, e)
        if said is None:
            raise
        raise said from None


def pack_dir(src: str, url: str, *, creds: StoreCreds | None, shard_size: int = 64 * 1024**2,
             fmt: str = "tar") -> dict:
    """`appliance data pack DIR URL`: shards + index.json under URL."""
    from .pack import pack

    with _open(url, creds, create=True) as (store, prefix):
        return pack(src, store, prefix, shard_size=shard_size, fmt=fmt)


def pack_from_store(src: str, url: str, *, src_creds: StoreCreds | None, creds: StoreCreds | None,
                    shard_size: int = 64 * 1024**2, fmt: str = "tar") -> dict:
    """`appliance data pack SRC_URL URL`: the objects under SRC_URL packed into tar shards + index.json under URL,
    through memory (data/pack_store.py)."""
    from .pack_store import pack_store

    if fmt != "tar":
        raise ApplianceError("packing from an object store writes tar shards only (the format stream mode reads)",
                             "leave --format out, or pack a local directory for TFRecord shards")
    with _open(src, src_creds) as (src_store, src_prefix), _open(url, creds, create=True) as (store, prefix):
        return pack_store(src_store, src_prefix, store, prefix, shard_size=shard_size)


def dataset_summary(url: str, *, creds: StoreCreds | None) -> dict:
    """What `appliance stage` fetches from URL (to every node in full mode): its objects and bytes, read by the
    stager's own rules (a folder or one object; folder markers are directories), or the stager's one line when
    URL names nothing. `appliance check --online` asks it before a lease is paid for."""
    from ..node.stage import dataset_objects, is_dir_marker

    with _open(url, creds) as (store, prefix):
        objs, named = dataset_objects(store, prefix, "a lease would stage nothing")
    files = [o for o in objs if not is_dir_marker(o, named)]
    total = sum(o.size for o in files)
    return {"url": url, "objects": len(files), "bytes": total, "size": _fmt_bytes(total)}


def listing(url: str, *, creds: StoreCreds | None) -> list[dict]:
    with _open(url, creds) as (store, prefix):
        try:
            return [o.__dict__ for o in store.list(prefix)]
        except FileNotFoundError:
            raise ApplianceError(f"{url}: there is no {store.holder} {store.where!r} at this site",
                                 "check the name; `appliance data upload DIR URL` makes it") from None


def remove(url: str, *, creds: StoreCreds | None) -> int:
    """Delete every object under URL; returns how many (0 when the container does not exist)."""
    with _open(url, creds) as (store, prefix):
        try:
            names = [o.name for o in store.list(prefix)]
        except FileNotFoundError:
            return 0
        with ThreadPoolExecutor(max_workers=16) as ex:
            list(ex.map(store.delete, names))
    return len(names)
