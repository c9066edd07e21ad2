"""Level 3 of docs/checkpoints.md: the files of a directory (the job's working directory on the head node), kept
in the object store incrementally and committed by a manifest written last.

Layout under ``URL/RUN/files/``:

- ``objects/<md5>-<size>``: a file's content, named by it: immutable, uploaded once, shared by every manifest that
  lists a file with that content;
- ``manifest-<seq>.json``: ``{"seq", "files": {relpath: {"md5", "size", "object"}}, "digest"}``. Written only after
  every object it names is in the store with the right size and ETag: **the manifest is the commit point**, as for
  checkpoints (store/checkpoints.py). A sync that dies half-way leaves objects no manifest names, which the next
  prune removes.

Pruning keeps the newest ``keep`` manifests that verify (the newest one that verifies is never deleted) and the
objects they name.
"""

from __future__ import annotations

import json
import os
import re
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

from ..errors import ApplianceError
from .checkpoints import CheckpointStore, StoreUnavailable, manifest_digest, retrying, safe_rel
from .objects import ObjectInfo, StoreCreds, large_object_etags, md5_file
from .. import report

log = report.get(__name__)

SUB = "files/"
OBJECTS = "files/objects/"
MANIFEST_NAME = re.compile(r"^files/manifest-(\d{9,})\.json$")
FORMAT = 1
READ_WAIT = 60.0  # seconds a manifest's read is retried before the store counts as down


class FileSet:
    """The synced files of one run in one object store."""

    def __init__(self, url: str, run: str, creds: StoreCreds | None):
        self._use(CheckpointStore(url, run, creds))  # its store, prefix, retries, part size and fence

    def _use(self, cs: CheckpointStore) -> None:
        self.cs, self.store, self.prefix = cs, cs.store, cs.prefix

    @classmethod
    def of(cls, cs: CheckpointStore) -> FileSet:
        """The synced files of the run ``cs`` holds, through its store."""
        fs = cls.__new__(cls)
        fs._use(cs)
        return fs

    def _listing(self) -> list[ObjectInfo]:
        return list(self.store.list(self.prefix + SUB))

    def manifests(self, listing: list[ObjectInfo] | None = None) -> list[int]:
        """Committed manifests' sequence numbers, newest first."""
        seqs = []
        for o in self._listing() if listing is None else listing:
            m = MANIFEST_NAME.match(o.name[len(self.prefix):])
            if m:
                seqs.append(int(m.group(1)))
        return sorted(seqs, reverse=True)

    def read(self, seq: int, *, until: float | None = None) -> dict:
        """Manifest ``seq``: FileNotFoundError when it is gone, JSONDecodeError when it is not JSON; a store that
        fails is asked again until ``until`` (default: a minute from now), then StoreUnavailable. A failed read is
        never taken for a missing manifest (issue 49: a restore that read one 503 as "no files" let the new job's
        prunes delete the old job's files)."""
        return retrying(lambda: self.cs.read_json(f"files/manifest-{seq:09d}.json"), what=f"read synced files {seq}",
                        until=time.time() + READ_WAIT if until is None else until)

    def verify(self, body: dict, listing: list[ObjectInfo]) -> str | None:
        """None if the manifest is intact and every object it names is in the store with its size and ETag."""
        if body.get("digest") != manifest_digest({k: v for k, v in body.items() if k != "digest"}):
            return f"manifest {body.get('seq')}: its digest does not match (corrupted)"
        have = {o.name[len(self.prefix):]: o for o in listing}
        for rel, f in body["files"].items():
            o = have.get(OBJECTS + f["object"])
            if o is None or o.size != f["size"] or (f.get("etag") and o.etag != f["etag"]):
                return f"manifest {body['seq']}: {rel} is missing or changed in the store"
        return None

    def newest_good(self, *, until: float | None = None) -> dict | None:
        """The newest manifest that verifies, None when there is none. A manifest that is gone or damaged is passed
        over for the one before it; a store that does not answer raises StoreUnavailable (``read``)."""
        listing = retrying(self._listing, what="list synced files", until=until or time.time() + READ_WAIT)
        for seq in self.manifests(listing):
            try:
                body = self.read(seq, until=until)
            except (FileNotFoundError, json.JSONDecodeError) as e:
                log.info(f"synced files: manifest {seq} unreadable ({type(e).__name__}); trying the one before it")
                continue
            why = self.verify(body, listing)
            if why is None:
                return body
            log.info(f"synced files: {why}; trying the one before it")
        return None

    def push(self, root: Path, files: dict[str, dict], seq: int, *, until: float | None = None) -> dict:
        """Upload what the store lacks of ``files`` (rel -> {"md5", "size"}, the content of ``root/rel``), check
        every object against a fresh listing, then commit manifest ``seq``. Returns the manifest."""
        have = {o.name[len(self.prefix) + len(OBJECTS):]: o for o in retrying(
            lambda: list(self.store.list(self.prefix + OBJECTS)), what="list synced files", until=until)}
        record: dict[str, dict] = {}
        for rel, f in sorted(files.items()):
            obj = f"{f['md5']}-{f['size']}"
            record[rel] = {"md5": f["md5"], "size": f["size"], "object": obj}
            if obj in have:
                continue
            p = root / rel
            seg = self.cs.segment_for(f["size"])
            etags = large_object_etags(p, seg) if f["size"] > seg else None
            if (etags or {}).get("md5", f["md5"]) != f["md5"]:
                raise StoreUnavailable(f"{rel} changed while it was being synced", "the next sync takes it")
            retrying(lambda: self.cs._put(f"{SUB}objects/{obj}", p, etags), what=f"upload {rel}", until=until)
            have[obj] = None  # uploaded: checked below
            if etags:
                record[rel]["etag_expect"] = etags.get(self.store.scheme, f["md5"])
        listed = {o.name[len(self.prefix) + len(OBJECTS):]: o for o in retrying(
            lambda: list(self.store.list(self.prefix + OBJECTS)), what="list synced files", until=until)}
        for rel, r in record.items():
            o = listed.get(r["object"])
            want = r.pop("etag_expect", r["md5"])
            if o is None or o.size != r["size"] or o.etag not in (want, r["md5"]):
                raise StoreUnavailable(f"synced file {rel} did not arrive intact in the store",
                                       "the next sync tries again")
            r["etag"] = o.etag
        self.cs.check_fence(f"commit synced files {seq}")
        body = {"format": FORMAT, "seq": seq, "files": record, "committed_at": time.time()}
        body["digest"] = manifest_digest(body)
        text = json.dumps(body, indent=1, sort_keys=True)
        retrying(lambda: self.cs.put_text(f"files/manifest-{seq:09d}.json", text, root),
                 what=f"commit synced files {seq}", until=until)
        return body

    def pull(self, body: dict, dest: Path, skip: Callable[[str], bool] = lambda rel: False) -> list[str]:
        """Restore a manifest's files into ``dest`` (each downloaded beside its place, checked against its MD5, then
        renamed into place). Returns the paths restored; paths ``skip`` names, or that would leave ``dest``, are
        not written."""
        done = []
        for rel, f in sorted(body["files"].items()):
            if not safe_rel(rel) or skip(rel):
                continue
            final = dest / rel
            final.parent.mkdir(parents=True, exist_ok=True)
            # a name of its own, not the file's with a prefix: a file name near NAME_MAX (255 bytes) synced but
            # could not be restored (ENAMETOOLONG)
            fd, tmp_name = tempfile.mkstemp(prefix=".appliance-restore-", dir=final.parent)
            tmp = Path(tmp_name)
            os.fchmod(fd, 0o644)  # as a plain open() under the usual umask, not mkstemp's 0600
            try:
                with open(fd, "wb") as fh:
                    self.store.get(f"{self.prefix}{OBJECTS}{f['object']}", fh.write)
                if md5_file(tmp) != f["md5"]:
                    raise ApplianceError(f"synced file {rel}: the downloaded bytes do not match its manifest",
                                         "retry; if it persists the object is corrupted in the store")
                os.replace(tmp, final)
            finally:
                tmp.unlink(missing_ok=True)
            done.append(rel)
        return done

    def prune(self, keep: int) -> int:
        """Keep the newest ``keep`` manifests that verify and every object they name; delete the rest (older
        manifests first, then unnamed objects). Nothing is deleted when no manifest verifies, nor when a manifest
        could not be read (StoreUnavailable is raised: what it names may be the newest files)."""
        self.cs.check_fence("prune synced files")
        listing = self._listing()
        good, kept = [], set()
        for seq in self.manifests(listing):
            if len(good) >= max(1, keep):
                break
            try:
                body = self.read(seq)
            except (FileNotFoundError, json.JSONDecodeError):  # gone or damaged: it names nothing to keep
                continue
            if self.verify(body, listing) is None:
                good.append(seq)
                kept |= {f["object"] for f in body["files"].values()}
        if not good:
            return 0
        gone = 0
        for seq in self.manifests(listing):
            if seq < good[-1] or (seq not in good and seq < good[0]):
                self.store.delete(f"{self.prefix}files/manifest-{seq:09d}.json")
                gone += 1
        for o in listing:
            rel = o.name[len(self.prefix):]
            if rel.startswith(OBJECTS) and rel[len(OBJECTS):] not in kept:
                self.store.delete(o.name)
                gone += 1
        if gone:
            log.info(f"synced files: pruned {gone} object(s) no kept manifest names")
        return gone
