"""The launcher's side of ``dataset.mode: stream``, for one job: a `train` hook (flows.run_job adds it).

Nothing is staged: the ranks read the packed dataset (`appliance data pack`: tar shards and index.json) from the
store while they train (appliance/node/stream.py). Before the job, every node gets a 0600 file with the job's own
credential for the dataset's URL (Site.job_store_creds: on a Keystone site an application credential of the job's,
deleted when the job ends) and the ranks get the URL, that file's path and the cache's place and size in their
environment (never the secret). When the lease is extended, a credential that outlives the new end replaces the
file on every node (``renew``). When the job ends the files go from every node, and the credential is deleted."""

from __future__ import annotations

import json
import shlex
from collections.abc import Callable

from ..errors import ApplianceError
from ..node.stage import _fmt_bytes
from ..protocol import Env, Line, parse
from ..sites import Site
from ..spec import parse_size
from ..train.launch import JobContext, JobHooks


class JobStream(JobHooks):
    def __init__(self, site: Site):
        self.site = site
        self.epochs: list[dict] = []  # rank 0's APPLIANCE_STREAM reports, one an epoch
        self.store_bytes = 0  # every rank's bytes fetched from the store (the epochs the ranks reported)
        self.ctx: JobContext | None = None
        self.path: str | None = None  # the credentials file, the same path on every node
        self._withdraw: list[Callable[[], None]] = []

    def prepare(self, ctx: JobContext) -> dict[str, str]:
        ds = ctx.spec.dataset
        if ds is None or ds.mode != "stream":
            return {}
        self.ctx = ctx
        # before the first step: a shard index.json names that the store lacks, or of another size, is one line now
        # (the ranks would fail when they reach it, maybe an epoch later)
        index = stream_check(ds.source, self.site.store_creds(ds.source))
        data_dir = f"{ctx.cluster.head.workdir}/{ds.dest}"
        env = {Env.STREAM_URL: ds.source, Env.STREAM_CACHE: f"{data_dir}/.stream-cache"}
        if ds.cache:
            env[Env.STREAM_CACHE_BYTES] = str(parse_size(ds.cache))
        if ds.shuffle is not None:
            env[Env.STREAM_SHUFFLE] = str(ds.shuffle)
        creds = self._creds(ctx.cluster.lease_end_at)
        if creds is not None:
            self.path = f"{ctx.run_dir}/.stream-creds.json"
            self._write(creds)
            env[Env.STREAM_CREDS] = self.path
        ctx.say(f"[appliance] stream: the ranks read {ds.source} ({len(index['shards']):,} shard(s), each in the "
                f"store as index.json says) while they train, through a cache of {ds.cache or 'half the free disk'} "
                f"per node in {data_dir}/.stream-cache")
        return env

    def _creds(self, lease_end):
        ctx = self.ctx
        creds, withdraw = self.site.job_store_creds(ctx.spec.dataset.source, lease_end=lease_end, say=ctx.say,
                                                    name=f"appliance-{ctx.spec.name}-{ctx.job_id}-data")
        if withdraw is not None:
            self._withdraw.append(withdraw)
        return creds

    def _write(self, creds) -> None:
        """The file on every node, written beside it and renamed over it (0600 from its first byte)."""
        body = json.dumps({k: v for k, v in creds.__dict__.items() if v not in (None, {})}).encode()
        path, tmp = shlex.quote(self.path), shlex.quote(f"{self.path}.new")
        rd = shlex.quote(self.ctx.run_dir)
        self.ctx.nodes.each(lambda r: r.run(f"mkdir -p {rd} && umask 077 && cat > {tmp} && mv -f {tmp} {path}",
                                            stdin=body, check=True))

    def renew(self, lease_end) -> None:
        """The lease was extended: a credential that outlives the new end, on every node (the ranks read the file
        again before their next fetch); the old one is deleted when the job ends."""
        if self.path is None or not self._withdraw:
            return  # Swift v1 keys or the user's S3 keys: they do not expire
        self._write(self._creds(lease_end))

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
        if self.path:
            path = shlex.quote(self.path)
            try:
                ctx.nodes.each(lambda r: r.run(f"rm -f {path}", timeout=15))
            except ApplianceError:
                ctx.say(f"[appliance] warning: could not remove {self.path} from every node")
        for withdraw in self._withdraw:
            try:
                withdraw()
            except Exception as e:  # noqa: BLE001 - it expires by itself a week after the lease end
                ctx.say(f"[appliance] warning: could not delete the job's dataset credential ({e}); it expires "
                        "7 days after the lease end")
        self._withdraw = []


def stream_index(url: str, creds) -> dict:
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
            raise ApplianceError(f"dataset.source {url}: no index.json there, so it is not a packed dataset; stream "
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
        raise ApplianceError(f"dataset.source {url}: its index.json is not one of tar shards as `appliance data pack` "
                             "writes it", f"pack it again: `appliance data pack DIR {url} --format tar`")
    return index


SHOWN = 3  # shards named in the line that says what is missing or wrong; the rest are counted


def stream_check(url: str, creds) -> dict:
    """``stream_index``, and every shard it names compared with the store's listing under ``url`` (names and
    sizes; the MD5 is checked as each shard is fetched): one line naming what is missing or of another size, before
    a lease is spent on a job that would fail when it reaches the shard (``check --online``, the job's start)."""
    from . import _open

    index = stream_index(url, creds)
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
        raise ApplianceError(f"dataset.source {url}: of the {len(index['shards']):,} shard(s) index.json names, "
                             + " and ".join(said) + "; a job would fail when it reaches them",
                             f"pack the dataset again (`appliance data pack SRC {url}`), or upload the shards "
                             "index.json names")
    return index
