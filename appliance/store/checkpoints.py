"""Checkpoints in the object store: upload, commit, verify, prune, find.

Layout under the spec's ``checkpoint.url`` (swift://, s3:// or file://)::

    <url>/<run>/ckpt-000000420/state.index             files of one checkpoint ...
    <url>/<run>/ckpt-000000420/state.data-00000-of-00001
    <url>/<run>/ckpt-000000420/meta.json
    <url>/<run>/ckpt-000000420/metrics/...
    <url>/<run>/ckpt-000000420/MANIFEST.json           ... and its commit point, written last
    <url>/<run>/ckpt-000000420.1/...                   a later save of the same step (never written over the first)
    <url>/<run>/spec.yaml                              the run's spec, for `appliance resume` elsewhere

The rules that make "committed" mean something:
- a committed checkpoint is never written over: an upload goes to a name no object of the store has yet
  (``ckpt-<step>``, or ``ckpt-<step>.<n>`` after a save of that step), which sorts after every earlier save;
- a checkpoint is committed once its MANIFEST.json exists; the manifest is written only after every
  file was uploaded and the store's listing showed each one with the expected size and MD5;
- resume uses only committed checkpoints, and checks each against its manifest again (size and ETag of
  every file, and the manifest's own digest) before using it, falling back to the next older one;
- pruning keeps the newest ``keep`` committed checkpoints and runs only after a new one is committed;
  it removes a checkpoint's manifest first, so a half-deleted checkpoint is never taken as committed.
"""

from __future__ import annotations

import hashlib
import json
import os
import random
import re
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path, PurePosixPath

from .objects import ObjectInfo, StoreCreds, StoreRefused, large_object_etags, md5_file, open_store, parts_match
from ..errors import ApplianceError
from .. import report

log = report.get(__name__)

MANIFEST = "MANIFEST.json"
CKPT_DIR = re.compile(r"^ckpt-(\d{9,})(?:\.(\d+))?$")  # ckpt-<step>, ckpt-<step>.<n> for the n-th re-save
# A checkpoint file above this goes up as parallel parts (SLO segments, S3 multipart parts); a 1-2 GB model state
# then uploads at the store's bandwidth rather than one Python stream's (make bench-stage, the upload rows)
CKPT_SEGMENT = 128 * 1024**2
MAX_SEGMENTS = 1000  # an SLO's cap: Swift slo.py DEFAULT_MAX_MANIFEST_SEGMENTS, RGW rgw_max_slo_entries (both 1000)
FORMAT = 1


def ckpt_name(step: int) -> str:
    return f"ckpt-{step:09d}"


def safe_rel(rel: str) -> bool:
    """A relative path that stays inside the directory it is written into (a manifest's names are the store's
    data: they are checked before a path is made of them)."""
    p = PurePosixPath(rel)
    return bool(rel) and not p.is_absolute() and ".." not in p.parts and "" not in rel.split("/") and \
        "\x00" not in rel


def ckpt_key(name: str) -> tuple[int, int] | None:
    """(step, n) of a checkpoint directory's name, the order of saves; None for any other name."""
    m = CKPT_DIR.match(name)
    return (int(m.group(1)), int(m.group(2) or 0)) if m else None


@dataclass
class Committed:
    """A committed checkpoint as the store lists it."""

    name: str  # ckpt-000000420 (ckpt-000000420.1: a later save of the same step)
    step: int
    manifest: dict | None = None  # read on demand
    n: int = 0  # the save's number within its step

    @property
    def key(self) -> tuple[int, int]:
        return (self.step, self.n)

    @property
    def epoch(self) -> int:
        return int((self.manifest or {}).get("meta", {}).get("epoch", 0))


class StoreUnavailable(ApplianceError):
    """The object store did not answer (or answered 5xx) after the retries allowed."""


class LockLost(ApplianceError):
    """Another job holds the run's lock now (store/runlock.py): this job commits and prunes nothing more."""


def manifest_digest(body: dict) -> str:
    rest = {k: v for k, v in body.items() if k != "digest"}
    return hashlib.sha256(json.dumps(rest, sort_keys=True).encode()).hexdigest()


def retrying(fn: Callable, *, what: str, until: float | None = None, attempts: int | None = None,
             stop: Callable[[], bool] = lambda: False):
    """Call fn() until it succeeds: exponential backoff with jitter (0.5 s .. 30 s), bounded by a wall-clock
    deadline (time.time() value) and/or a number of attempts. Errors other than I/O and HTTP are raised."""
    delay, n = 0.5, 0
    while True:
        n += 1
        try:
            return fn()
        except (FileNotFoundError, json.JSONDecodeError):
            raise
        except Exception as e:  # network errors, 5xx from swiftclient/botocore
            if isinstance(e, StoreRefused):  # credentials, permissions, a name: asking again does not help
                raise
            left = None if until is None else until - time.time()
            if (attempts is not None and n >= attempts) or (left is not None and left <= 0) or stop():
                raise StoreUnavailable(f"{what}: the object store failed {n} time(s), last: "
                                       f"{type(e).__name__}: {str(e).splitlines()[0][:160] if str(e) else ''}",
                                       "check the object store; the checkpoint is kept on the node's disk") from None
            wait = min(delay, 30.0) * (0.75 + random.random() / 2)
            if left is not None:
                wait = max(0.05, min(wait, left))
            log.info(f"{what}: {type(e).__name__}; retrying in {wait:.1f}s (attempt {n})")
            time.sleep(wait)  # backoff between retries of a failed request, not synchronisation
            delay *= 2


class CheckpointStore:
    """The checkpoints of one run in one object store."""

    def __init__(self, url: str, run: str, creds: StoreCreds | None,
                 renew: Callable[[], StoreCreds] | None = None):
        self.url = url.rstrip("/") + "/"
        self.run = run
        self.store, base = open_store(self.url, creds, renew)  # renew: for a process that outlives a token
        # every request here is retried by `retrying`, against the caller's deadline (a stop's), not the stager's
        self.store.list_deadline = 0.0
        self.prefix = f"{base}{run}/" if base else f"{run}/"
        self._manifests: dict[tuple[str, str], dict] = {}  # (name, the manifest object's ETag) -> its body
        # files above this go up in parts (Swift SLO segments, S3 multipart), in parallel; a test makes it small
        self.segment_size = int(os.environ.get("APPLIANCE_SEGMENT_BYTES") or CKPT_SEGMENT)
        # the job that holds the run's lock instead of ours, if one does (store/runlock.py ``fenced``), asked before
        # every commit and prune: a job that lost the lock writes no manifest and deletes nothing
        self.fence: Callable[[], str | None] | None = None

    def check_fence(self, what: str) -> None:
        """Raise LockLost when another job holds the run's lock (``fence``)."""
        other = self.fence() if self.fence is not None else None
        if other:
            raise LockLost(f"{what}: not done: job {other} holds the run's lock now",
                           "this job lost the run to another one (docs/checkpoints.md, the run lock); stop it")

    # -- listing -------------------------------------------------------------------------------------------
    def _objects(self, sub: str = "") -> list[ObjectInfo]:
        return list(self.store.list(self.prefix + sub))

    def committed(self, listing: list[ObjectInfo] | None = None) -> list[Committed]:
        """Committed checkpoints, newest first (from one listing, or the one given)."""
        found = []
        for o in self._objects() if listing is None else listing:
            rel = o.name[len(self.prefix):]
            parts = rel.split("/")
            if len(parts) == 2 and parts[1] == MANIFEST:
                k = ckpt_key(parts[0])
                if k:
                    found.append(Committed(parts[0], k[0], n=k[1]))
        return sorted(found, key=lambda c: c.key, reverse=True)

    def read_json(self, rel: str) -> dict:
        buf = bytearray()
        self.store.get(self.prefix + rel, buf.extend)
        return json.loads(bytes(buf))

    def read_manifest(self, c: Committed) -> dict:
        if c.manifest is None:
            c.manifest = self.read_json(f"{c.name}/{MANIFEST}")
        return c.manifest

    def verify(self, c: Committed, listing: list[ObjectInfo] | None = None) -> str | None:
        """None if the checkpoint matches its manifest in the store, else what is wrong (one line). With
        ``listing`` (the run's objects, just listed) no other listing is made, and the manifest is read again only
        when its ETag changed."""
        key = None
        if listing is not None:
            mo = next((o for o in listing if o.name == f"{self.prefix}{c.name}/{MANIFEST}"), None)
            key = (c.name, mo.etag if mo else "")
            if c.manifest is None and key in self._manifests:
                c.manifest = self._manifests[key]
        try:
            m = self.read_manifest(c)
        except json.JSONDecodeError:
            return f"{c.name}: its manifest is not valid JSON"
        except FileNotFoundError:
            return f"{c.name}: its manifest is gone"
        if m.get("digest") != manifest_digest(m):
            return f"{c.name}: its manifest does not match its own digest"
        if key is not None:
            self._manifests[key] = m
        base = f"{self.prefix}{c.name}/"
        objs = [o for o in listing if o.name.startswith(base)] if listing is not None else self._objects(c.name + "/")
        listed = {o.name[len(base):]: o for o in objs}
        for rel, f in sorted(m.get("files", {}).items()):
            o = listed.get(rel)
            if o is None:
                return f"{c.name}: {rel} is missing"
            if o.size != f["size"]:
                return f"{c.name}: {rel} has {o.size} bytes, the manifest says {f['size']}"
            if f.get("etag") and o.etag != f["etag"]:
                return f"{c.name}: {rel} has checksum {o.etag}, the manifest says {f['etag']} (corrupted)"
        return None

    def newest_good(self) -> tuple[Committed | None, list[str]]:
        """The newest committed checkpoint that verifies, and the problems met on the way."""
        problems = []
        for c in self.committed():
            why = self.verify(c)
            if why is None:
                return c, problems
            problems.append(why)
            log.info(f"checkpoint {why}; trying the previous one")
        return None, problems

    # -- writing -------------------------------------------------------------------------------------------
    def connect(self) -> None:
        """Authenticate and reach the store now (one read of the container), so that a later upload starts warm.
        Raises what the store says; a container that is not there yet is fine (the first upload makes it)."""
        try:
            self.store.reach()
        except FileNotFoundError:
            pass

    def ensure_container(self) -> None:
        if hasattr(self.store, "ensure_container"):
            self.store.ensure_container()

    def segment_for(self, size: int) -> int:
        """The part size a file of ``size`` bytes goes up in: ``segment_size``, or more for a file that would need
        more than MAX_SEGMENTS parts (Swift's and RGW's cap on an SLO's segments)."""
        return max(self.segment_size, -(-size // MAX_SEGMENTS))

    def _put(self, rel: str, path: Path, md5s: dict | None = None) -> None:
        """Upload one file; ``md5s`` (large_object_etags at segment_for's size): what the store's ETags must be."""
        seg = self.segment_for(path.stat().st_size)
        try:
            self.store.put(self.prefix + rel, path, segment_size=seg, md5s=md5s)
        except FileNotFoundError:  # the container is not there (yet): make it, then put again
            self.ensure_container()
            self.store.put(self.prefix + rel, path, segment_size=seg, md5s=md5s)

    def _segments_match(self, rel: str, parts: list[str]) -> bool:
        try:
            segs = self.store.slo_segments(self.prefix + rel)
        except Exception:  # noqa: BLE001 - not an SLO store, or no manifest to read: unverified
            return False
        return bool(segs) and [s["hash"].strip('"') for s in segs] == parts

    def put_text(self, rel: str, text: str, tmp_dir: Path) -> None:
        tmp = Path(tmp_dir) / f".upload-{os.getpid()}-{random.randrange(1 << 30)}"
        tmp.write_text(text)
        try:
            self._put(rel, tmp)
        finally:
            tmp.unlink(missing_ok=True)

    def free_name(self, step: int, *, until: float | None = None, stop: Callable[[], bool] = lambda: False) -> str:
        """The name the next save of ``step`` goes up as: ``ckpt-<step>`` where the store has no object of that
        step, else ``ckpt-<step>.<n>`` past every save of it there, committed or partial. A listing that fails is
        retried (and then raised), never read as "none there"."""
        base = ckpt_name(step)

        def listed() -> list[ObjectInfo]:
            try:
                return self._objects(base)
            except FileNotFoundError:  # no container yet (a 404, not a failure): nothing of this step
                return []
        taken = [k[1] for o in retrying(listed, what=f"list {base}", until=until, stop=stop)
                 if (k := ckpt_key(o.name[len(self.prefix):].split("/", 1)[0])) and k[0] == step]
        return base if not taken else f"{base}.{max(taken) + 1}"

    def upload(self, local: Path, meta: dict, *, until: float | None = None,
               stop: Callable[[], bool] = lambda: False, fault: Callable[[int], None] | None = None) -> dict:
        """Upload one local checkpoint directory under a name of its own (``free_name``: nothing committed is ever
        written over), verify it in the store, then commit it (manifest last). Returns the manifest, whose
        ``name`` is the store's. Raises StoreUnavailable when the store stays down past ``until``."""
        local = Path(local)
        name = self.free_name(int(meta["step"]), until=until, stop=stop)
        files = sorted(p for p in local.rglob("*") if p.is_file())
        record: dict[str, dict] = {}
        expect: dict[str, dict] = {}
        for i, p in enumerate(files):
            rel = p.relative_to(local).as_posix()
            size = p.stat().st_size
            seg = self.segment_for(size)
            # the file's MD5s first (its parts hashed in parallel), then the upload, which checks the store's ETag
            # of each part against them instead of hashing the bytes again (hashing each part as it went up instead
            # was no faster: 6.27 against 6.53 s for 1.6 GB, inside the spread; docs/staging.md). A file in
            # parts is recorded by its parts' MD5s, which the store's ETags are made of: the whole file's MD5 would
            # be one more pass over every byte, in order (`whole`), and only a directory store's ETag is that
            parts = size > seg and self.store.scheme in ("swift", "s3")
            expect[rel] = large_object_etags(p, seg, whole=not parts)
            retrying(lambda: self._put(f"{name}/{rel}", p, expect[rel]), what=f"upload {name}/{rel}",
                     until=until, stop=stop)
            record[rel] = ({"size": size, "part_size": seg, "parts": expect[rel]["parts"]} if parts
                           else {"size": size, "md5": expect[rel]["md5"]})
            if fault:
                fault(i)
        # verify what the store now holds before committing
        listed = {}
        for o in retrying(lambda: self._objects(name + "/"), what=f"list {name}", until=until, stop=stop):
            listed[o.name[len(self.prefix) + len(name) + 1:]] = o
        for rel, f in record.items():
            o = listed.get(rel)
            if o is None or o.size != f["size"]:
                raise StoreUnavailable(f"{name}/{rel} did not arrive intact in the store",
                                       "the checkpoint is kept on the node's disk")
            e = expect[rel]
            want = e[self.store.scheme] if "parts" in f else f["md5"]  # a directory store's ETag is the MD5
            if o.etag == want:
                pass
            elif "swift" in e and self._segments_match(f"{name}/{rel}", e["parts"]):
                pass  # a store whose listing does not carry the large object's ETag: its segments vouch for it
            else:
                raise StoreUnavailable(f"{name}/{rel}: the store holds ETag {o.etag}, we expected {want}",
                                       "the checkpoint is kept on the node's disk")
            f["etag"] = o.etag
        self.check_fence(f"commit {name}")
        body = {"format": FORMAT, "run": self.run, "name": name, "step": meta["step"], "meta": meta,
                "files": record, "committed_at": time.time()}
        body["digest"] = manifest_digest(body)
        text = json.dumps(body, indent=1, sort_keys=True)
        retrying(lambda: self.put_text(f"{name}/{MANIFEST}", text, local.parent), what=f"commit {name}",
                 until=until, stop=stop)
        return body

    def prune(self, keep: int) -> list[str]:
        """Keep the newest ``keep`` committed checkpoints that verify (at least 1); delete older ones, manifest
        first, and uncommitted leftovers older than the newest good one. A committed checkpoint that fails
        verification holds no slot and is never what makes a good one go: one newer than the newest good one is
        left in place (said so; resume skips it), one older than the kept ones goes with them. So the newest
        checkpoint that verifies is never deleted, whatever happened to the ones after it."""
        keep = max(1, keep)
        self.check_fence("prune")
        listing = self._objects()  # one listing: what is committed, and each candidate checked against it
        committed = self.committed(listing)  # newest first
        good: list[Committed] = []
        bad: list[Committed] = []
        for c in committed:
            if len(good) >= keep:
                break
            why = self.verify(c, listing)
            if why is None:
                good.append(c)
            else:
                bad.append(c)
                log.info(f"checkpoint {why}: it does not count towards checkpoint.keep and is not pruned")
        if not good:  # nothing verifies: delete nothing
            return []
        kept = {c.name for c in good + bad}
        doomed = {c.name for c in committed if c.name not in kept}  # all older than the oldest good one kept
        newest_good = good[0].key
        by_dir: dict[str, list[str]] = {}
        for o in listing:
            top = o.name[len(self.prefix):].split("/", 1)[0]
            k = ckpt_key(top)
            if k and top not in kept and (top in doomed or k < newest_good):
                by_dir.setdefault(top, []).append(o.name)
        for top, names in sorted(by_dir.items()):
            names.sort(key=lambda n: not n.endswith("/" + MANIFEST))  # un-commit first
            for n in names:
                self.store.delete(n)
            log.info(f"pruned {top}")
        return sorted(by_dir)

    def download(self, c: Committed, dest: Path) -> Path:
        """Fetch a committed checkpoint into dest/<name> and check every file's MD5 (a file in parts: each part's)
        against the manifest."""
        m = self.read_manifest(c)
        out = Path(dest) / c.name
        bad = [rel for rel in m["files"] if not safe_rel(rel) or rel == MANIFEST]
        if bad or not ckpt_key(c.name):
            raise ApplianceError(f"{c.name}: its manifest names a file outside the checkpoint ({(bad or [c.name])[0]!r})",
                                 "the manifest was not written by the appliance; remove that checkpoint from the store")
        for rel, f in m["files"].items():
            p = out / rel
            p.parent.mkdir(parents=True, exist_ok=True)
            with open(p, "wb") as fh:
                self.store.get(f"{self.prefix}{c.name}/{rel}", fh.write)
            if not (parts_match(p, f["part_size"], f["parts"]) if "parts" in f else md5_file(p) == f["md5"]):
                raise ApplianceError(f"{c.name}/{rel}: downloaded bytes do not match the manifest",
                                     "retry; if it persists the object is corrupted in the store")
        (out / MANIFEST).write_text(json.dumps(m, indent=1, sort_keys=True))
        return out


def open_run(url: str, run: str, creds: StoreCreds | None) -> CheckpointStore:
    return CheckpointStore(url, run, creds)
