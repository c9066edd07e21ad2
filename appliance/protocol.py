"""The launcher<->node contract: what the launcher tells the nodes, what the nodes tell it back.

One module both sides import (the node-side package `appliance.node` imports only this and `appliance.store`):

- **Variables** the launcher sets in the ranks' environment (``Env``) and the node-side code reads.
- **Lines** node-side code prints on stdout for the launcher to parse: ``KIND {json}`` (``Line``), written with
  :func:`emit` and read back with :func:`parse`. Training ranks' lines reach the launcher through horovodrun's
  ``[rank]<stdout>:`` prefix; the stager's and the doctor's come straight over SSH.
- **Exit codes**: :data:`EXIT_STOPPED`.
- **The environment horovodrun forwards** to every rank: built from an allow-list, credentials refused
  (:func:`rank_environment`). horovodrun copies the launcher's *entire* environment onto the ssh command line of
  every rank, so the launcher runs with an environment built from an allow-list, and anything that looks like a
  credential is refused even when a user asks for it.
"""

from __future__ import annotations

import fnmatch
import json
from collections.abc import Callable, Mapping

EXIT_STOPPED = 75  # "stopped before the lease end, checkpoint committed: resumable" (EX_TEMPFAIL)
NODE_WATCH_MARGIN = 600.0  # `appliance watchdog --node` stops jobs this many seconds before the vendordata end;
# the launcher extends a lease (lease.extend) before that, so that no node-side stop comes first
VENDORDATA_MARGIN = 300.0  # rank 0's own look at the vendordata end (at least; more when saves are slow)
RUN_MARKER = ".appliance-run"  # in every run directory the launcher made: the node watchdog acts on no other


class Env:
    """Names of the variables the launcher sets for the ranks."""

    JOB_ID = "APPLIANCE_JOB_ID"  # every process of one job carries it (the reaper kills by it)
    RUN = "APPLIANCE_RUN"
    RUN_DIR = "APPLIANCE_RUN_DIR"  # <workdir>/appliance/runs/RUN on the head node; the node watchdog finds jobs by it
    WORKDIR = "APPLIANCE_WORKDIR"
    DATA_DIR = "APPLIANCE_DATA_DIR"
    RESTORE = "APPLIANCE_RESTORE"  # the staged checkpoint directory to resume from
    STOP_FILE = "APPLIANCE_STOP_FILE"
    SPEC_HASH = "APPLIANCE_SPEC_HASH"
    CODE_HASH = "APPLIANCE_CODE_HASH"
    CKPT_URL = "APPLIANCE_CKPT_URL"
    CKPT_KEEP = "APPLIANCE_CKPT_KEEP"
    CKPT_RESIZE = "APPLIANCE_CKPT_RESIZE"
    CKPT_EVERY_STEPS = "APPLIANCE_CKPT_EVERY_STEPS"
    CKPT_EVERY_MINUTES = "APPLIANCE_CKPT_EVERY_MINUTES"
    CHECKPOINT_DIR = "APPLIANCE_CHECKPOINT_DIR"  # the job's working directory; rank 0's is synced (level 3)
    CODE_FILES = "APPLIANCE_CODE_FILES"  # a JSON list of the code's files in it (not synced)
    FILES_RESTORE = "APPLIANCE_FILES_RESTORE"  # "1" on a resume: rank 0 restores the synced files first
    FILES_EVERY_SECONDS = "APPLIANCE_FILES_EVERY_SECONDS"  # how often rank 0 syncs them (default 60)
    FILES_SYNC = "APPLIANCE_FILES_SYNC"  # "0": no sync
    CKPT_AUTO = "APPLIANCE_CKPT_AUTO"  # "0": no callback added to a plain Model.fit (checkpoint.auto: false)
    KERAS = "APPLIANCE_KERAS"  # "2" (tf_keras, TF_USE_LEGACY_KERAS=1) or "3" (Keras 3): train.keras, decided per job
    KERAS_RNG = "APPLIANCE_KERAS_RNG"  # "legacy": Keras' default RNG for random layers (not checkpointable)
    HOROVOD_AUTOGRAPH = "APPLIANCE_HOROVOD_AUTOGRAPH"  # "convert": autograph converts Horovod's code (TF's default)
    CKPT_CREDS = "APPLIANCE_CKPT_CREDS"  # a 0600 file on the head node, read by rank 0 only
    # dataset.mode stream: the packed dataset's URL; a 0600 file on every node with the job's read credential for it
    # (removed when the job ends); the shard cache's directory on each node's local disk and its size (per node)
    STREAM_URL = "APPLIANCE_STREAM_URL"
    STREAM_CREDS = "APPLIANCE_STREAM_CREDS"
    STREAM_CACHE = "APPLIANCE_STREAM_CACHE"
    STREAM_CACHE_BYTES = "APPLIANCE_STREAM_CACHE_BYTES"
    STREAM_SHUFFLE = "APPLIANCE_STREAM_SHUFFLE"  # shards whose samples a stream mixes at once (dataset.shuffle)
    # dataset.streams: a JSON list of the mix's datasets, each {name, url, creds (its scheme's file), weight (its
    # samples a mix epoch)}; dataset.validation: JSON {url, creds, bytes (the dataset's), cache (bytes a node, or 0)}
    STREAMS = "APPLIANCE_STREAMS"
    STREAM_VALIDATION = "APPLIANCE_STREAM_VALIDATION"
    STOP_CHECK_SECONDS = "APPLIANCE_STOP_CHECK_SECONDS"
    ETC = "APPLIANCE_ETC"  # where contextualize wrote cluster.json (default /etc/appliance)
    # where rank 0 reads Chameleon's live vendordata (default: Nova's metadata address); empty: nowhere, only the
    # cache (the ranks run on the launcher's own machine, whose lease the launcher watches itself)
    VENDORDATA_URL = "APPLIANCE_VENDORDATA_URL"


class Line:
    """Kinds of the ``KIND {json}`` lines node-side code prints for the launcher."""

    RESULT = "APPLIANCE_RESULT"  # a rank's result (bench, examples)
    CKPT = "APPLIANCE_CKPT"  # rank 0: a checkpoint committed
    STOPPED = "APPLIANCE_STOPPED"  # rank 0: stopped before the lease end (committed or not)
    RESUMED = "APPLIANCE_RESUMED"  # rank 0: where the job resumed from (and the seconds the restore took)
    FIRST_STEP = "APPLIANCE_FIRST_STEP"  # rank 0: the job's first step is done (the end of a resume's downtime)
    FILES = "APPLIANCE_FILES"  # rank 0: its working directory's files committed (level 3)
    RANK_EXIT = "APPLIANCE_RANK_EXIT"  # a rank's own exit status (a plain integer, not JSON)
    PROGRESS = "APPLIANCE_PROGRESS"  # the stager's progress
    STAGED = "APPLIANCE_STAGED"  # the stager's result
    ERROR = "APPLIANCE_ERROR"  # a node-side failure: {"message", "fix"}
    NOTE = "APPLIANCE_NOTE"  # free text for the user (not JSON)
    DOCTOR = "APPLIANCE_DOCTOR"  # the doctor's checks
    DOCTOR_INFO = "APPLIANCE_DOCTOR_INFO"  # `doctor --gpu`: the node's versions, GPUs and nvidia-smi, for the report
    STREAM = "APPLIANCE_STREAM"  # rank 0: an epoch of its stream read (shards, waits for the store, the epoch's time)


_TEXT = {Line.NOTE, Line.RANK_EXIT}  # kinds whose body is plain text


KERAS_NAMES = {"2": "Keras 2 (tf_keras)", "3": "Keras 3"}


def keras_switch(saved: str | None, now: str) -> str | None:
    """Why a checkpoint written by one Keras cannot resume on the other (``saved``: its meta's ``keras``, absent on
    checkpoints of tf_keras jobs only; ``now``: "2" or "3"), or None. The two save a model's state in different
    formats (appliance/node/rngstate.py) and their random layers draw differently."""
    saved = saved or "2"
    if saved == now:
        return None
    return (f"the checkpoint was written by a {KERAS_NAMES.get(saved, saved)} job and this job runs "
            f"{KERAS_NAMES.get(now, now)}: a resume across a switch of Keras is refused (the weights' format and the "
            f"random streams differ); set train.keras: {saved} in the spec to resume it, or start a new run")


def job_files(rd: str, job_id: str) -> tuple[str, str, str]:
    """The detached job's files on the head node (in its run directory ``rd``): its output (stdout and stderr, in
    order), its exit status (written when it ends), the PID of the process that lives as long as the job."""
    return f"{rd}/{job_id}.out", f"{rd}/{job_id}.rc", f"{rd}/{job_id}.pid"


def format_line(kind: str, body) -> str:
    return f"{kind} {body}" if kind in _TEXT else f"{kind} {json.dumps(body, sort_keys=True)}"


def emit(kind: str, body, write: Callable[[str], None] | None = None) -> None:
    """Print one protocol line (flushed: the launcher reads it while the process runs)."""
    line = format_line(kind, body)
    if write is not None:
        write(line)
    else:
        print(line, flush=True)


def parse(line: str, kinds: tuple[str, ...] | None = None) -> tuple[str, object] | None:
    """(kind, body) of a protocol line, or None for any other line (or a JSON body that does not parse)."""
    kind, sep, rest = line.partition(" ")
    if not sep or not kind.startswith("APPLIANCE_") or (kinds is not None and kind not in kinds):
        return None
    if kind in _TEXT:
        return kind, rest
    try:
        return kind, json.loads(rest)
    except json.JSONDecodeError:
        return None


# ---------------------------------------------------------------------------------------------
# The environment horovodrun forwards to every rank

# Names (fnmatch patterns, matched case-insensitively) that must never reach a rank.
DENY_PATTERNS = (
    "OS_*",
    "AWS_*",
    "*_SECRET*",
    "*SECRET*",
    "*TOKEN*",
    "*PASSWORD*",
    "*PASSWD*",
    "*CREDENTIAL*",
    "*_KEY",
    "*PRIVATE_KEY*",
    "ST_AUTH",
    "ST_USER",
    "SWIFT_*",
    "SSH_AUTH_SOCK",
)

# Variables kept from the launcher's own environment, if set.
ALLOW_FROM_LAUNCHER = ("LANG", "LC_ALL", "TZ", "TERM")

# Always set for ranks.
BASE_RANK_ENV = {
    "TF_USE_LEGACY_KERAS": "1",  # tf_keras, unless the job runs Keras 3 (train.keras; the launcher sets it per job)
    "TF_CPP_MIN_LOG_LEVEL": "2",
    "PYTHONUNBUFFERED": "1",
    "PYTHONDONTWRITEBYTECODE": "1",
}


def is_denied(name: str) -> bool:
    up = name.upper()
    return any(fnmatch.fnmatchcase(up, pat) for pat in DENY_PATTERNS)


def denied_names(env: Mapping[str, str]) -> set[str]:
    return {k for k in env if is_denied(k)}


def rank_environment(*, path: str, home: str, nic: str | None, extra: Mapping[str, str] | None = None,
                     launcher_env: Mapping[str, str] | None = None) -> dict[str, str]:
    """The complete environment for horovodrun (and so for every rank).

    Raises ValueError if ``extra`` names a denied variable: a spec that asks to forward a
    credential is an error, not something to drop silently.
    """
    env: dict[str, str] = {"PATH": path, "HOME": home, "LANG": "C.UTF-8"}
    for k in ALLOW_FROM_LAUNCHER:
        if launcher_env and k in launcher_env and not is_denied(k):
            env[k] = launcher_env[k]
    env.update(BASE_RANK_ENV)
    if nic:
        env["GLOO_SOCKET_IFNAME"] = nic
        env["NCCL_SOCKET_IFNAME"] = nic
        env["HOROVOD_GLOO_IFACE"] = nic
    if extra:
        bad = denied_names(extra)
        if bad:
            raise ValueError(f"refusing to forward credential-like variables to ranks: {', '.join(sorted(bad))}")
        env.update(extra)
    assert not denied_names(env), denied_names(env)
    return env
