"""The launcher's side of ``dataset.mode: stream``, for one job: a `train` hook (flows.run_job adds it).

Nothing is staged: the ranks read the packed dataset (`appliance data pack`: tar shards and index.json) from the
store while they train (appliance/node/stream.py): one dataset (dataset.source) or a weighted mix (dataset.streams,
each dataset's samples a mix epoch from its weight: ``mix_weights``), and a validation stream (dataset.validation).
Before the job, every dataset is checked against the store's listing (``stream_check``) and every node gets a 0600
file with the job's own credential for each store the datasets are in (Site.job_store_creds: on a Keystone site an
application credential of the job's, deleted when the job ends); the ranks get the URLs, those files' paths and the
cache's place and size in their environment (never the secret). When the lease is extended, a credential that
outlives the new end replaces each file on every node (``renew``). When the job ends the files go from every node,
and the credentials are deleted."""

from __future__ import annotations

import json
import shlex
from collections.abc import Callable

from ..errors import ApplianceError
from ..node.stage import _fmt_bytes
from ..node.stream_mix import KINDS, epoch_counts
from ..protocol import Env, Line, parse
from ..sites import Site
from ..spec import parse_size, stream_names
from ..store.objects import parse_url
from ..train.launch import JobContext, JobHooks


class JobStream(JobHooks):
    def __init__(self, site: Site):
        self.site = site
        self.epochs: list[dict] = []  # rank 0's APPLIANCE_STREAM reports, one an epoch
        self.store_bytes = 0  # every rank's bytes fetched from the store (the epochs the ranks reported)
        self.ctx: JobContext | None = None
        self.files: dict[str, tuple[str, str]] = {}  # store scheme -> (its credentials file, a URL of it)
        self._withdraw: list[Callable[[], None]] = []

    def prepare(self, ctx: JobContext) -> dict[str, str]:
        ds = ctx.spec.dataset
        if ds is None or ds.mode != "stream":
            return {}
        self.ctx = ctx
        # before the first step: a shard index.json names that the store lacks, or of another size, is one line now
        # (the ranks would fail when they reach it, maybe an epoch later)
        indexes = [stream_check(url, self.site.store_creds(url), at) for at, url in ds.urls()]
        data_dir = f"{ctx.cluster.head.workdir}/{ds.dest}"
        env = {Env.STREAM_CACHE: f"{data_dir}/.stream-cache"}
        if ds.cache:
            env[Env.STREAM_CACHE_BYTES] = str(parse_size(ds.cache))
        if ds.shuffle is not None:
            env[Env.STREAM_SHUFFLE] = str(ds.shuffle)
        for _, url in ds.urls():  # a file per store the datasets are in (one credential reads all of its containers)
            scheme = parse_url(url)[0]
            if scheme not in self.files:
                creds = self._creds(url, ctx.cluster.lease_end_at)
                if creds is not None:
                    self.files[scheme] = (f"{ctx.run_dir}/.stream-creds{'-' + scheme if self.files else ''}.json", url)
                    self._write(self.files[scheme][0], creds)
        creds_of = lambda url: self.files.get(parse_url(url)[0], (None,))[0]  # noqa: E731
        if ds.source:
            env[Env.STREAM_URL] = ds.source
            if creds_of(ds.source):
                env[Env.STREAM_CREDS] = creds_of(ds.source)
            what = f"{ds.source} ({len(indexes[0]['shards']):,} shard(s), each in the store as index.json says)"
        else:
            weights = mix_weights(ds, indexes)
            env[Env.STREAMS] = json.dumps([{"name": n, "url": s.source, "creds": creds_of(s.source), "weight": w}
                                           for n, s, w in zip(stream_names(ds), ds.streams, weights)])
            what = "a mix of " + ", ".join(f"{n} ({s.source}, {w:,} sample(s) a mix epoch)"
                                           for n, s, w in zip(stream_names(ds), ds.streams, weights))
        if ds.validation:
            url = ds.validation.source
            env[Env.STREAM_VALIDATION] = json.dumps({
                "url": url, "creds": creds_of(url), "bytes": sum(s["size"] for s in indexes[-1]["shards"]),
                "cache": parse_size(ds.validation.cache) if ds.validation.cache else 0})
            what += f", and validate on {url}"
        ctx.say(f"[appliance] stream: the ranks read {what} while they train, through a cache of "
                f"{ds.cache or 'half the free disk'} per node in {data_dir}/.stream-cache")
        return env

    def _creds(self, url: str, lease_end):
        ctx = self.ctx
        creds, withdraw = self.site.job_store_creds(url, lease_end=lease_end, say=ctx.say,
                                                    name=f"appliance-{ctx.spec.name}-{ctx.job_id}-data")
        if withdraw is not None:
            self._withdraw.append(withdraw)
        return creds

    def _write(self, path: str, creds) -> None:
        """The file on every node, written beside it and renamed over it (0600 from its first byte)."""
        body = json.dumps({k: v for k, v in creds.__dict__.items() if v not in (None, {})}).encode()
        path, tmp = shlex.quote(path), shlex.quote(f"{path}.new")
        rd = shlex.quote(self.ctx.run_dir)
        self.ctx.nodes.each(lambda r: r.run(f"mkdir -p {rd} && umask 077 && cat > {tmp} && mv -f {tmp} {path}",
                                            stdin=body, check=True))

    def renew(self, lease_end) -> None:
        """The lease was extended: a credential that outlives the new end, on every node (the ranks read the file
        again before their next fetch); the old one is deleted when the job ends."""
        if not self.files or not self._withdraw:
            return  # Swift v1 keys or the user's S3 keys: they do not expire
        for path, url in self.files.values():
            self._write(path, self._creds(url, lease_end))

    def rank_line(self, rank: int, text: str) -> bool:
        got = parse(text, (Line.STREAM,))
        if got is None or not isinstance(got[1], dict):
            return False
        e = got[1]
        self.store_bytes += int(e.get("store_bytes") or 0)
        if int(e.get("rank", rank)) != 0:  # every rank's bytes count; rank 0's epochs are said (the line's rank:
            return True  # horovodrun may glue one rank's line to another's open progress bar)
        self.epochs.append(e)
        self.ctx.say(f"[appliance] stream epoch {e.get('epoch')}: rank 0 read {e.get('read')} shard(s), "
                     f"{e.get('ready')} ready when asked, {e.get('stalls')} waited for ({e.get('waited_s', 0):.1f}s), "
                     f"{e.get('refetched')} fetched again; cache peak {_fmt_bytes(e.get('peak', 0))} of "
                     f"{_fmt_bytes(e.get('capacity', 0))}; {_fmt_bytes(e.get('store_bytes', 0))} from the store, "
                     f"{e.get('kept', 0)} shard(s) kept from before")
        return True

    def finish(self, result) -> None:
        """Rank 0's waits for the store over the job's epochs and every rank's bytes read from it, on the result
        (the run's record keeps them)."""
        if self.epochs:
            result.stream = {"epochs": len(self.epochs), "shards": sum(e.get("read", 0) for e in self.epochs),
                             "stalls": sum(e.get("stalls", 0) for e in self.epochs),
                             "waited_s": round(sum(e.get("waited_s", 0.0) for e in self.epochs), 1),
                             "wall_s": round(sum(e.get("wall_s", 0.0) for e in self.epochs), 1),
                             "store_bytes": self.store_bytes,
                             "rank0_store_bytes": [e.get("store_bytes", 0) for e in self.epochs],
                             "dataset_bytes": self.epochs[-1].get("dataset_bytes", 0)}

    def close(self) -> None:
        ctx = self.ctx
        if ctx is None or ctx.abandoned:  # the job may still run: it keeps reading
            return
        if self.files:
            paths = " ".join(shlex.quote(path) for path, _ in self.files.values())
            try:
                ctx.nodes.each(lambda r: r.run(f"rm -f {paths}", timeout=15))
            except ApplianceError:
                ctx.say(f"[appliance] warning: could not remove {paths} from every node")
        for withdraw in self._withdraw:
            try:
                withdraw()
            except Exception as e:  # noqa: BLE001 - it expires by itself a week after the lease end
                ctx.say(f"[appliance] warning: could not delete the job's dataset credential ({e}); it expires "
                        "7 days after the lease end")
        self._withdraw = []


def mix_weights(ds, indexes: list[dict]) -> list[int]:
    """Each of dataset.streams' samples in a mix epoch, from its weight and its index's samples (stream_mix)."""
    kind = next((k for k in KINDS if getattr(ds.streams[0], k) is not None), None)
    return epoch_counts(kind, [getattr(s, kind) for s in ds.streams] if kind else [],
                        [sum(x["samples"] for x in ix["shards"]) for ix in indexes[:len(ds.streams)]])


def stream_index(url: str, creds, at: str = "dataset.source") -> dict:
    """The packed dataset's index.json under ``url``, checked as the ranks will read it (tar shards, each with a
    name, size, MD5 and sample count): one line before a lease is spent on a dataset the job cannot stream."""
    from . import _open
    from ..store.base import transient_retry

    buf: list[bytes] = []
    with _open(url, creds) as (store, prefix):
        name = (prefix.rstrip("/") + "/" if prefix else "") + "index.json"
        try:
            transient_retry(lambda: (buf.clear(), store.get(name, buf.append)))
        except FileNotFoundError:
            raise ApplianceError(f"{at} {url}: no index.json there, so it is not a packed dataset; stream "
                                 "mode reads only those", f"pack it: `appliance data pack DIR {url}`, or use mode: "
                                 "full or shard") from None
    try:
        index = json.loads(b"".join(buf))
        shards = index["shards"]
        ok = index.get("format") == "tar" and shards and all(
            {"name", "size", "md5", "samples"} <= set(s) for s in shards)
    except (ValueError, KeyError, TypeError):
        ok = False
    if not ok:
        raise ApplianceError(f"{at} {url}: its index.json is not one of tar shards as `appliance data pack` "
                             "writes it", f"pack it again: `appliance data pack DIR {url} --format tar`")
    return index


SHOWN = 3  # shards named in the line that says what is missing or wrong; the rest are counted


def stream_check(url: str, creds, at: str = "dataset.source") -> dict:
    """``stream_index``, and every shard it names compared with the store's listing under ``url`` (names and
    sizes; the MD5 is checked as each shard is fetched): one line naming what is missing or of another size, before
    a lease is spent on a job that would fail when it reaches the shard (``check --online``, the job's start)."""
    from . import _open

    index = stream_index(url, creds, at)
    with _open(url, creds) as (store, prefix):
        base = prefix.rstrip("/") + "/" if prefix else ""
        listed = {o.name[len(base):]: o.size for o in store.list(base) if o.name.startswith(base)}
    missing = [s["name"] for s in index["shards"] if s["name"] not in listed]
    wrong = [f"{s['name']}: {listed[s['name']]:,} bytes there, {s['size']:,} in index.json"
             for s in index["shards"] if s["name"] in listed and listed[s["name"]] != s["size"]]
    said = []
    for what, names in (("not in the store", missing), ("of another size", wrong)):
        if names:
            shown = "; ".join(names[:SHOWN]) + (f"; and {len(names) - SHOWN} more" if len(names) > SHOWN else "")
            said.append(f"{len(names):,} {what} ({shown})")
    if said:
        raise ApplianceError(f"{at} {url}: of the {len(index['shards']):,} shard(s) index.json names, "
                             + " and ".join(said) + "; a job would fail when it reaches them",
                             f"pack the dataset again (`appliance data pack SRC {url}`), or upload the shards "
                             "index.json names")
    return index
