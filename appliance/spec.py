"""The run spec: one YAML file describes a run.

It is parsed into typed, frozen records. Every problem is reported as one line that names the
field and the fix (``SpecError``, exit code 2): unknown keys, wrong types, missing fields.

Example (examples/digits.yaml)::

    name: digits
    cloud: local
    nodes: {count: 2, node_type: compute_local, slots: 1}
    image: appliance-cpu
    train:
      code: digits
      command: python train.py --epochs 40
    checkpoint: {url: "file:///tmp/ckpt", every_steps: 50, keep: 3}
"""

from __future__ import annotations

import dataclasses
import datetime as dt
import hashlib
import math
import re
import types
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

import yaml

from .errors import SpecError
from .protocol import denied_names

NAME_RE = re.compile(r"[a-z][a-z0-9-]{0,38}")  # used with fullmatch: `$` would accept a trailing newline
DURATION_RE = re.compile(r"(\d{1,9})([smhd])")
MAX_DURATION_S = 366 * 86400  # no lease or margin is longer than a year (Chameleon's cap is 7 days)
MAX_NODES, MAX_SLOTS = 1024, 64
BOOK_AHEAD_MIN_S = 300  # lease.book_ahead's least
URL_RE = re.compile(r"(swift|s3)://[A-Za-z0-9][A-Za-z0-9._-]{0,254}(/[^\x00-\x1f]*)?|file:///[^\x00-\x1f]*")
ENV_NAME_RE = re.compile(r"[A-Za-z_][A-Za-z0-9_]{0,254}")  # a POSIX shell's variable name (fullmatch)
DEST_PART_RE = re.compile(r"[A-Za-z0-9_][A-Za-z0-9_.-]{0,254}")  # no hidden directories, no `.` or `..`


@dataclass(frozen=True)
class Alternative:
    """A node type to fall back on at a lease end (`appliance run`), at the run's own site or at another (``site``:
    CHI@TACC for a run at CHI@UC). In a spec: ``gpu_v100`` or ``{node_type: gpu_v100, site: CHI@TACC}``."""

    node_type: str
    site: str | None = None  # None: the spec's own


@dataclass(frozen=True)
class Nodes:
    """How many machines and what kind."""

    count: int = 2
    node_type: str = "compute_local"
    slots: int = 1  # Horovod ranks per node (GPUs per node on Chameleon)
    alternatives: tuple[Alternative, ...] = ()  # `appliance run`: what to fall back on at a lease end, in order


@dataclass(frozen=True)
class Lease:
    duration: str = "4h"  # Ns, Nm, Nh or Nd; at most 7d on Chameleon
    lease_id: str | None = None  # reuse an existing lease instead of creating one
    extend: bool = False  # let the watchdog extend the lease near its end
    floating_ip: bool = True
    stop_margin: str = "5m"  # the least time before the lease end at which the watchdog acts
    overlap: str = "0s"  # `appliance run`: the next lease starts this long before the current one ends (warm handover)
    wait: str = "1d"  # `appliance run`: the longest wait for free hosts at a lease end before the run parks
    keep_when_done: bool = False  # `appliance run`: keep the cluster and its lease once the run has finished
    exemption: str | None = None  # `appliance run`: the Chameleon help-desk ticket that allows its consecutive leases
    # `appliance run` with overlap: the next lease is booked this long before it starts, not at the job's start (the
    # later, the fewer SUs charged and hosts held at once; the earlier, the less risk its hosts are taken first)
    book_ahead: str = "1h"
    # `appliance run --plan`: the node types Chameleon's hogging check covers (its notifier's high_end_node_types);
    # empty: every node type, as in its published config
    hogging_node_types: tuple[str, ...] = ()


@dataclass(frozen=True)
class Limits:
    """`appliance run`: where a managed run stops, with its checkpoint, before it finishes (flows/budget.py)."""

    node_hours: float | None = None  # nodes x hours of every lease the run holds (overlaps too); none past it
    deadline: str | None = None  # "YYYY-MM-DD HH:MM" UTC: no lease of the run ends after it


@dataclass(frozen=True)
class StreamSource:
    """One packed dataset of a weighted mix (``dataset.streams``), weighted as MosaicML Streaming's ``Stream``: at
    most one of proportion, repeat, choose, the same one for every stream; none: its own size (each dataset once a
    mix epoch). appliance/node/stream_mix.py reads the mix."""

    source: str  # what `appliance data pack` wrote
    name: str | None = None  # in lines and the checkpoint's record (default: the URL's last part)
    proportion: float | None = None  # its share of the mix (normalised; the epoch: all datasets' samples once)
    repeat: float | None = None  # its samples a mix epoch, as a multiple of its size (0.5: half, 3: three times)
    choose: int | None = None  # its samples a mix epoch


@dataclass(frozen=True)
class Validation:
    """A validation stream (``dataset.validation``, stream mode): the same samples every pass, read beside the
    training stream (``open_validation``), never moving it."""

    source: str  # a packed dataset
    cache: str | None = None  # of dataset.cache, a node's (default: the dataset's size, up to a quarter)


@dataclass(frozen=True)
class Dataset:
    source: str | None = None  # swift://container/prefix, s3://bucket/prefix or file:///path (or streams)
    dest: str = "data"  # directory under the node's local disk
    mode: Literal["full", "shard", "stream"] = "full"
    cache: str | None = None  # stream: each node's shard cache, e.g. 150GB (default: half the free disk at the start)
    # stream: shards whose samples are mixed at once, per canonical share (the cache holds that many per share a rank
    # reads); 0: no sample shuffle (the shards' order only); None: the stream's default (16)
    shuffle: int | None = None
    streams: tuple[StreamSource, ...] = ()  # stream: a weighted mix of packed datasets, instead of source
    validation: Validation | None = None  # stream: a validation stream

    def urls(self) -> list[tuple[str, str]]:
        """(field, URL) of every dataset it reads: source or each of streams, then validation's."""
        main = [("dataset.source", self.source)] if self.source else [
            (f"dataset.streams[{i}]", s.source) for i, s in enumerate(self.streams)]
        return main + ([("dataset.validation.source", self.validation.source)] if self.validation else [])


@dataclass(frozen=True)
class Train:
    command: str  # run by every rank, in the code directory
    code: str = "."  # directory copied to every node (relative to the spec file)
    env: dict[str, str] = field(default_factory=dict)  # extra variables for the ranks
    start_timeout: int = 60  # seconds horovodrun waits for all ranks to start
    requirements: str | None = None  # a pip requirements file in `code`, installed on every node before the job
    keras: str = "auto"  # which Keras the ranks run: 2 (tf_keras), 3, or auto (3 when the code uses Keras-3-only API)


@dataclass(frozen=True)
class Checkpoint:
    url: str | None = None  # where committed checkpoints go
    every_steps: int | None = None
    every_minutes: float | None = None
    keep: int = 3
    resize: Literal["lr", "batch"] = "lr"  # on resume with another world size: scale lr, or keep the global batch
    auto: bool = True  # add the appliance's callback to a plain Model.fit that has none (level 2, docs/checkpoints.md)


@dataclass(frozen=True)
class Spec:
    name: str
    train: Train
    cloud: Literal["local", "chameleon"] = "local"
    site: str | None = None
    nodes: Nodes = field(default_factory=Nodes)
    image: str = "appliance-cpu"
    network: str = "sharednet1"
    key_name: str | None = None  # Nova key pair the nodes get (chameleon)
    key_file: str | None = None  # its private key on this machine (default ~/.ssh/id_ed25519 or id_rsa)
    lease: Lease = field(default_factory=Lease)
    dataset: Dataset | None = None
    checkpoint: Checkpoint = field(default_factory=Checkpoint)
    notify: str | None = None  # `appliance run`: a command, or an https:// URL, told of each handover and the end
    limits: Limits = field(default_factory=Limits)
    # Set by load_spec, not by the user:
    path: str = field(default="", metadata={"internal": True})
    digest: str = field(default="", metadata={"internal": True})

    @property
    def code_dir(self) -> Path:
        return (Path(self.path).parent / self.train.code).resolve()

    @property
    def world_size(self) -> int:
        return self.nodes.count * self.nodes.slots


# ---------------------------------------------------------------------------------------------
# Parsing


def _type_name(tp: Any) -> str:
    origin = typing.get_origin(tp)
    if tp is int:
        return "an integer"
    if tp is float:
        return "a number"
    if tp is str:
        return "a string"
    if tp is bool:
        return "true or false"
    if origin is Literal:
        return "one of " + ", ".join(repr(a) for a in typing.get_args(tp))
    if origin is dict:
        return "a mapping of names to strings"
    if origin is tuple and typing.get_args(tp)[0] is Alternative:
        return "a list of node types or {node_type, site} mappings"
    if origin is tuple and dataclasses.is_dataclass(typing.get_args(tp)[0]):
        return "a list of mappings"
    if origin is tuple:
        return "a list of strings"
    if dataclasses.is_dataclass(tp):
        return "a mapping"
    return str(tp)


def _convert(tp: Any, value: Any, where: str) -> Any:
    origin = typing.get_origin(tp)
    if origin in (typing.Union, types.UnionType):
        args = [a for a in typing.get_args(tp) if a is not type(None)]
        if value is None:
            return None
        return _convert(args[0], value, where)
    if dataclasses.is_dataclass(tp):
        return _build(tp, value, where)
    if origin is Literal:
        if value not in typing.get_args(tp):
            raise SpecError(f"{where}: expected {_type_name(tp)}, got {value!r}",
                            f"set {where} to {_type_name(tp)}")
        return value
    if origin is dict:
        if not isinstance(value, dict):
            raise SpecError(f"{where}: expected {_type_name(tp)}, got {type(value).__name__}",
                            f"write {where} as 'NAME: value' lines")
        out = {}
        for k, v in value.items():
            if not isinstance(k, str) or isinstance(v, (dict, list)) or v is None:
                raise SpecError(f"{where}.{k}: expected a string value, got {v!r}",
                                f"quote the value of {where}.{k}")
            out[k] = str(v)
        return out
    if origin is tuple and typing.get_args(tp)[0] is Alternative:
        if not isinstance(value, list):
            raise SpecError(f"{where}: expected {_type_name(tp)}, got {value!r}",
                            f"write {where} as [gpu_v100, {{node_type: gpu_p100, site: CHI@TACC}}]")
        return tuple(Alternative(str(v)) if isinstance(v, (str, int, float)) and not isinstance(v, bool) else
                     _convert(Alternative, v, f"{where}[{i}]") for i, v in enumerate(value))
    if origin is tuple and dataclasses.is_dataclass(typing.get_args(tp)[0]):
        if not isinstance(value, list):
            raise SpecError(f"{where}: expected {_type_name(tp)}, got {value!r}",
                            f"write {where} as a list: - {{source: swift://...}}")
        return tuple(_convert(typing.get_args(tp)[0], v, f"{where}[{i}]") for i, v in enumerate(value))
    if origin is tuple:
        if not isinstance(value, list) or any(isinstance(v, (dict, list)) or v is None for v in value):
            raise SpecError(f"{where}: expected {_type_name(tp)}, got {value!r}", f"write {where} as [a, b]")
        return tuple(str(v) for v in value)
    if tp is bool:
        if not isinstance(value, bool):
            raise SpecError(f"{where}: expected true or false, got {value!r}", f"set {where}: true or false")
        return value
    if tp is int:
        if isinstance(value, bool) or not isinstance(value, int):
            raise SpecError(f"{where}: expected an integer, got {value!r}", f"set {where} to a whole number")
        return value
    if tp is float:
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise SpecError(f"{where}: expected a number, got {value!r}", f"set {where} to a number")
        return float(value)
    if tp is str:
        if isinstance(value, (dict, list)) or value is None:
            raise SpecError(f"{where}: expected a string, got {type(value).__name__}", f"set {where} to a string")
        return str(value)
    raise SpecError(f"{where}: unsupported type {tp}")  # pragma: no cover - programming error


def _build(cls: Any, data: Any, where: str) -> Any:
    if not isinstance(data, dict):
        raise SpecError(f"{where or 'spec'}: expected a mapping, got {type(data).__name__}",
                        f"write {where or 'the spec'} as 'key: value' lines")
    hints = typing.get_type_hints(cls)
    fields = {f.name: f for f in dataclasses.fields(cls) if not f.metadata.get("internal")}
    for key in data:
        if key not in fields:
            known = ", ".join(sorted(fields))
            raise SpecError(f"{where + '.' if where else ''}{key}: unknown key",
                            f"remove it or use one of: {known}")
    kwargs = {}
    for name, f in fields.items():
        sub = f"{where}.{name}" if where else name
        if name in data:
            kwargs[name] = _convert(hints[name], data[name], sub)
        elif f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING:
            raise SpecError(f"{sub}: missing required field", f"add '{name}:' to {where or 'the spec'}")
    return cls(**kwargs)


def _check_duration(value: str, where: str) -> int:
    m = DURATION_RE.fullmatch(value)
    if not m:
        raise SpecError(f"{where}: {value!r} is not a duration", "write it as e.g. 90m, 4h or 2d (units s, m, h, d)")
    n, unit = int(m.group(1)), m.group(2)
    secs = n * {"s": 1, "m": 60, "h": 3600, "d": 86400}[unit]
    if secs > MAX_DURATION_S:
        raise SpecError(f"{where}: {value} is longer than a year", "give a duration such as 4h or 2d")
    return secs


def duration_seconds(value: str) -> int:
    return _check_duration(value, "duration")


def deadline_of(spec: Spec) -> dt.datetime | None:
    """limits.deadline as a naive UTC datetime (Blazar's dates), or None."""
    text = spec.limits.deadline
    if not text:
        return None
    try:
        when = dt.datetime.fromisoformat(text.strip().removesuffix("Z").removesuffix(" UTC"))
    except ValueError:
        raise SpecError(f"limits.deadline: {text!r} is not a date", "write it as 'YYYY-MM-DD HH:MM' (UTC)") from None
    if when.tzinfo is not None:
        when = when.astimezone(dt.timezone.utc).replace(tzinfo=None)
    return when


def _no_control_chars(obj, where: str = "") -> None:
    """Names, paths and URLs hold no control characters (a NUL or a newline in a path is never meant)."""
    for f in dataclasses.fields(obj):
        v = getattr(obj, f.name)
        at = f"{where}{f.name}"
        if dataclasses.is_dataclass(v):
            _no_control_chars(v, at + ".")
        elif isinstance(v, str) and at not in ("train.command",) and re.search(r"[\x00-\x1f\x7f]", v):
            raise SpecError(f"{at}: {v!r} contains a control character", f"remove it from {at}")


def _check_container(field_name: str, url: str | None) -> None:
    """A container or bucket the store would refuse to make, refused before a lease is paid for (a checkpoint.url
    bucket that cannot be made fails every commit of the job)."""
    if not url or not URL_RE.fullmatch(url) or url.startswith("file:"):
        return
    from .store.objects import container_name_problem, parse_url

    scheme, name, _ = parse_url(url)
    why = container_name_problem(scheme, name)
    if why:
        raise SpecError(f"{field_name}: {why}", f"choose another name, e.g. {scheme}://my-data-1/")


KERAS_CHOICES = ("auto", "2", "3")
LEGACY_TRUE = ("1", "true", "True")  # TensorFlow's reading of TF_USE_LEGACY_KERAS


def keras_choice(spec: Spec) -> tuple[str, str]:
    """Which Keras the job's ranks run, "2" (tf_keras) or "3", and why, in a few words: train.keras (it wins over
    train.env's TF_USE_LEGACY_KERAS); with auto, train.env's TF_USE_LEGACY_KERAS, else the code's own use of
    Keras-3-only API (an AST scan of its Python files: appliance/node/keras3.py)."""
    from .node.keras3 import keras3_uses

    chosen, env = spec.train.keras, spec.train.env.get("TF_USE_LEGACY_KERAS")
    if chosen in ("2", "3"):
        over = ""
        if env is not None and (env in LEGACY_TRUE) != (chosen == "2"):
            over = f", over train.env TF_USE_LEGACY_KERAS={env}"
        return chosen, f"train.keras: {chosen}{over}"
    if env is not None:
        return ("2" if env in LEGACY_TRUE else "3"), f"train.keras: auto, train.env TF_USE_LEGACY_KERAS={env}"
    uses = keras3_uses(spec.code_dir) if spec.code_dir.is_dir() else []
    if uses:
        more = f" (and {len(uses) - 1} more)" if len(uses) > 1 else ""
        return "3", f"train.keras: auto, {uses[0]} is Keras 3 API{more}"
    return "2", "train.keras: auto, no Keras-3-only API in the code"


def keras_line(spec: Spec) -> str:
    """The one line that says which Keras the job runs."""
    chosen, why = keras_choice(spec)
    return f"Keras {chosen}" + (" (tf_keras)" if chosen == "2" else "") + f": {why}"


def _semantic_checks(spec: Spec) -> None:
    _no_control_chars(spec)
    if not NAME_RE.fullmatch(spec.name):
        raise SpecError(f"name: {spec.name!r} is not a valid run name",
                        "use 1-39 lowercase letters, digits and '-', starting with a letter")
    if not 1 <= spec.nodes.count <= MAX_NODES:
        raise SpecError(f"nodes.count: must be at least 1 and at most {MAX_NODES}, got {spec.nodes.count}",
                        "set nodes.count: 1 or more")
    if not 1 <= spec.nodes.slots <= MAX_SLOTS:
        raise SpecError(f"nodes.slots: must be at least 1 and at most {MAX_SLOTS}, got {spec.nodes.slots}",
                        "set nodes.slots to the GPUs per node (1 on CPU nodes)")
    _check_duration(spec.lease.duration, "lease.duration")
    _check_duration(spec.lease.stop_margin, "lease.stop_margin")
    _check_duration(spec.lease.wait, "lease.wait")
    overlap = _check_duration(spec.lease.overlap, "lease.overlap")
    if overlap and overlap <= _check_duration(spec.lease.stop_margin, "lease.stop_margin"):
        raise SpecError(f"lease.overlap: {spec.lease.overlap} is not longer than lease.stop_margin "
                        f"({spec.lease.stop_margin}): the job stops that long before the end, so the next cluster would "
                        "not be ready by then", "give e.g. overlap: 30m (a bare-metal boot takes 10-20 minutes), or 0s")
    if overlap >= _check_duration(spec.lease.duration, "lease.duration"):
        raise SpecError(f"lease.overlap: {spec.lease.overlap} is not shorter than lease.duration", "give e.g. 30m")
    if _check_duration(spec.lease.book_ahead, "lease.book_ahead") < BOOK_AHEAD_MIN_S:
        raise SpecError(f"lease.book_ahead: {spec.lease.book_ahead} is shorter than 5m: Blazar takes whole minutes, "
                        "and the controller needs the time to try nodes.alternatives", "give e.g. book_ahead: 1h")
    nh = spec.limits.node_hours
    if nh is not None and not (math.isfinite(nh) and nh > 0):
        raise SpecError(f"limits.node_hours: must be a positive number, got {nh}", "give e.g. node_hours: 500, or "
                        "remove it")
    deadline_of(spec)
    if not spec.train.command.strip():
        raise SpecError("train.command: is empty", "give the command every rank runs, e.g. python train.py")
    req = spec.train.requirements
    if req is not None and (req.startswith("/") or not all(DEST_PART_RE.fullmatch(x) for x in req.split("/"))):
        raise SpecError(f"train.requirements: {req!r} must be a file in train.code, named relative to it",
                        "e.g. requirements: requirements.txt")
    if spec.train.keras not in KERAS_CHOICES:
        raise SpecError(f"train.keras: expected auto, 2 or 3, got {spec.train.keras!r}",
                        "set train.keras: auto (Keras 3 when the code uses Keras-3-only API), 2 (tf_keras) or 3")
    if spec.train.start_timeout < 1:
        raise SpecError("train.start_timeout: must be at least 1 second", "set e.g. train.start_timeout: 60")
    for k in spec.train.env:
        if not ENV_NAME_RE.fullmatch(str(k)):
            raise SpecError(f"train.env: {str(k)[:60]!r} is not an environment variable name",
                            "use letters, digits and '_', not starting with a digit (e.g. TF_CPP_MIN_LOG_LEVEL)")
    _check_sources(spec.dataset)
    for at, url in (spec.dataset.urls() if spec.dataset else []) + [("checkpoint.url", spec.checkpoint.url)]:
        if url and url.startswith(("swift:", "s3:")) and ("?" in url or "#" in url):
            raise SpecError(f"{at}: {url!r} has a '?' or '#', which a URL reads as a query or fragment and drops",
                            "remove it: object names under a prefix are written plainly, e.g. swift://ckpts/run1/")
    bad = denied_names(spec.train.env)
    if bad:
        raise SpecError(f"train.env: {', '.join(sorted(bad))} looks like a credential and would be forwarded to every rank",
                        "remove it; credentials are pushed to nodes separately, never through the job environment")
    for at, url in spec.dataset.urls() if spec.dataset else []:
        if not URL_RE.fullmatch(url):
            raise SpecError(f"{at}: {url!r} is not a swift://, s3:// or file:// URL",
                            "write e.g. swift://my-container/imagenet/")
        _check_container(at, url)
    if spec.dataset is not None:
        parts = spec.dataset.dest.split("/")
        if spec.dataset.dest.startswith("/") or not all(DEST_PART_RE.fullmatch(x) for x in parts):
            raise SpecError(f"dataset.dest: {spec.dataset.dest!r} must be a relative path inside the node's local disk "
                            "(no '.', '..', hidden or empty parts)", "use a plain name such as data")
    _check_stream(spec.dataset)
    if spec.checkpoint.url is not None and not URL_RE.fullmatch(spec.checkpoint.url):
        raise SpecError(f"checkpoint.url: {spec.checkpoint.url!r} is not a swift://, s3:// or file:// URL",
                        "write e.g. swift://checkpoints/")
    _check_container("checkpoint.url", spec.checkpoint.url)
    if spec.notify is not None and not spec.notify.strip():
        raise SpecError("notify: is empty", "give a command (it gets each event as JSON on stdin) or an https:// URL")
    if spec.notify and spec.notify.startswith("http://"):
        raise SpecError("notify: an http:// URL would send the run's events (and any token in the URL) in the clear",
                        "use https://")
    ck = spec.checkpoint
    if ck.keep < 1:
        raise SpecError("checkpoint.keep: must be at least 1", "set checkpoint.keep: 3")
    if ck.every_steps is not None and ck.every_steps < 1:
        raise SpecError("checkpoint.every_steps: must be at least 1", "set it to a positive step count or remove it")
    if ck.every_minutes is not None and not (math.isfinite(ck.every_minutes) and ck.every_minutes > 0):
        raise SpecError("checkpoint.every_minutes: must be positive", "set it to e.g. 10 or remove it")


SIZE_RE = re.compile(r"\s*(\d+(?:\.\d+)?)\s*(B|KB|MB|GB|TB|KiB|MiB|GiB|TiB)\s*")
_UNITS = {"B": 1, "KB": 10**3, "MB": 10**6, "GB": 10**9, "TB": 10**12, "KiB": 2**10, "MiB": 2**20, "GiB": 2**30,
          "TiB": 2**40}


def parse_size(text: str) -> int:
    """Bytes of a size such as 150GB or 512MiB; ValueError otherwise."""
    m = SIZE_RE.fullmatch(str(text))
    if not m:
        raise ValueError(text)
    return int(float(m.group(1)) * _UNITS[m.group(2)])


def _check_sources(ds: Dataset | None) -> None:
    """One packed dataset (source) or a mix (streams), never both; a mix and a validation stream in stream mode."""
    if ds is None:
        return
    if ds.source and ds.streams:
        raise SpecError("dataset.streams: given with dataset.source", "give source (one dataset) or streams (a "
                        "weighted mix of packed datasets), not both")
    if not ds.source and not ds.streams:
        raise SpecError("dataset.source: missing required field", "add 'source:' to dataset (or streams: a list of "
                        "{source, proportion} for a mix, in mode stream)")
    for what, given in (("streams", ds.streams), ("validation", ds.validation)):
        if given and ds.mode != "stream":
            raise SpecError(f"dataset.{what}: only stream mode reads it (mode is {ds.mode})",
                            f"set dataset.mode: stream, or remove dataset.{what}")


STREAM_NAME_RE = re.compile(r"[A-Za-z0-9_][A-Za-z0-9_.-]{0,63}")


def stream_names(ds: Dataset) -> list[str]:
    """Each of dataset.streams' names: its own, or its URL's last part (with its place when two would be alike)."""
    names = [s.name or re.sub(r"[^A-Za-z0-9_.-]", "-", s.source.rstrip("/").rpartition("/")[2])[:64]
             for s in ds.streams]
    names = [n if STREAM_NAME_RE.fullmatch(n) else f"stream{i}" for i, n in enumerate(names)]
    return [n if names.count(n) == 1 or s.name else f"{n}-{i}" for i, (n, s) in enumerate(zip(names, ds.streams))]


def _check_mix(ds: Dataset) -> None:
    """dataset.streams: names that say which is which, and weights as MosaicML Streaming takes them."""
    kinds = [[k for k in ("proportion", "repeat", "choose") if getattr(s, k) is not None] for s in ds.streams]
    for i, (s, ks) in enumerate(zip(ds.streams, kinds)):
        at = f"dataset.streams[{i}]"
        if s.name is not None and not STREAM_NAME_RE.fullmatch(s.name):
            raise SpecError(f"{at}.name: {s.name!r} is not a name", "use letters, digits, '_', '.' and '-' (e.g. web)")
        if len(ks) > 1:
            raise SpecError(f"{at}: both {ks[0]} and {ks[1]} given", "give one of proportion, repeat or choose")
        if ks != kinds[0]:
            raise SpecError(f"{at}: {ks[0] if ks else 'no weight'}, but dataset.streams[0] has "
                            f"{kinds[0][0] if kinds[0] else 'none'}", "weight every stream the same way: all "
                            "proportion, all repeat, all choose, or none (each dataset's own size)")
        v = getattr(s, ks[0]) if ks else None
        if v is not None and not (math.isfinite(v) and v > 0):
            raise SpecError(f"{at}.{ks[0]}: must be a positive number, got {v}", f"give e.g. {ks[0]}: "
                            + ("1000" if ks[0] == "choose" else "0.5"))
    names = stream_names(ds)
    dup = next((n for n in names if names.count(n) > 1), None)
    if dup is not None:
        raise SpecError(f"dataset.streams: two are named {dup!r}", "give each stream a name of its own")


def _check_stream(ds: Dataset | None) -> None:
    if ds is not None and ds.streams:
        _check_mix(ds)
    if ds is not None and ds.shuffle is not None:
        if ds.mode != "stream":
            raise SpecError(f"dataset.shuffle: only stream mode shuffles its samples (mode is {ds.mode})",
                            "set dataset.mode: stream, or remove dataset.shuffle")
        if isinstance(ds.shuffle, bool) or not isinstance(ds.shuffle, int) or ds.shuffle < 0:
            raise SpecError(f"dataset.shuffle: {ds.shuffle!r} is not a number of shards",
                            "write e.g. shuffle: 16 (shards mixed at once), or 0 for no sample shuffle")
    sizes = {}
    for at, text in (("dataset.cache", ds.cache if ds else None),
                     ("dataset.validation.cache", ds.validation.cache if ds and ds.validation else None)):
        if text is None:
            continue
        if ds.mode != "stream":
            raise SpecError(f"{at}: only stream mode has a cache (mode is {ds.mode})",
                            f"set dataset.mode: stream, or remove {at}")
        try:
            sizes[at] = parse_size(text)
        except ValueError:
            raise SpecError(f"{at}: {text!r} is not a size", "write e.g. cache: 150GB (B, KB, MB, GB, TB, "
                            "or KiB .. TiB)") from None
        if sizes[at] < 1:
            raise SpecError(f"{at}: {text} holds nothing", "give the cache room for a few shards, e.g. cache: 10GB")
    if len(sizes) == 2 and sizes["dataset.validation.cache"] >= sizes["dataset.cache"]:
        raise SpecError("dataset.validation.cache: is not less than dataset.cache, the node's whole cache (the "
                        "training stream has the rest)", "give the validation stream a part of dataset.cache")


def parse_spec(data: Any, path: str = "<spec>", raw: bytes = b"") -> Spec:
    spec = _build(Spec, data, "")
    _semantic_checks(spec)
    return dataclasses.replace(spec, path=str(path), digest=hashlib.sha256(raw).hexdigest()[:16])


def load_spec(path: str | Path) -> Spec:
    """Read and validate a spec file. Raises SpecError with one actionable line."""
    p = Path(path)
    try:
        raw = p.read_bytes()
    except FileNotFoundError:
        raise SpecError(f"{p}: no such spec file", "pass the path of a YAML spec, e.g. examples/digits.yaml") from None
    except OSError as e:
        raise SpecError(f"{p}: cannot read spec ({e.strerror})", "check the path and its permissions") from None
    try:
        data = yaml.safe_load(raw)
    except yaml.YAMLError as e:
        mark = getattr(e, "problem_mark", None)
        where = f" line {mark.line + 1}" if mark else ""
        raise SpecError(f"{p}:{where} is not valid YAML ({getattr(e, 'problem', e)})",
                        "fix the YAML syntax (indentation, quotes)") from None
    if data is None:
        raise SpecError(f"{p}: spec is empty", "see examples/digits.yaml for a complete spec")
    try:
        return parse_spec(data, str(p.resolve()), raw)
    except SpecError as e:
        e.message = f"{p}: {e.message}"
        e.args = (e.message,)
        raise
