"""The checkpoint steps of `appliance resume RUN` (the workflow itself is flows.resume) and `appliance ls`.

resume: the run's spec (from its run record, or the copy saved next to its checkpoints, or ``--spec``) ->
the newest committed checkpoint that verifies against its manifest (older ones if not, saying so) -> a
cluster (the run's own if its lease still runs, else a new lease + `up`; or one named with ``--cluster``) ->
the dataset staged (only what is missing) -> the checkpoint staged to every node (checked against the store's
ETags, which were checked against the manifest) -> the job, restoring it.
"""

from __future__ import annotations

import dataclasses
import os
from pathlib import Path

from ..errors import ApplianceError
from ..sites import load_spec
from ..spec import NAME_RE, Spec
from ..store.checkpoints import CheckpointStore
from . import runs
from .. import report

log = report.get(__name__)


def find_spec(run: str, spec_path: str | None = None, url: str | None = None, creds=None) -> Spec:
    """The run's spec: ``spec_path``, else the one its run record names, else the copy saved beside its checkpoints
    at ``url`` (read with ``creds``: the store of the site the user points at)."""
    if spec_path:
        spec = load_spec(spec_path)
        if spec.name != run:
            raise ApplianceError(f"{spec_path} is the spec of run {spec.name!r}, not {run!r}",
                                 f"use `appliance resume {spec.name} --spec {spec_path}`")
        return spec
    rec = runs.load(run)
    if rec and rec.get("spec_path") and Path(rec["spec_path"]).exists():
        return load_spec(rec["spec_path"])
    if url:  # the copy saved beside the checkpoints: resume from another machine
        if not NAME_RE.fullmatch(run):
            raise ApplianceError(f"{run!r} is not a run name (a spec's name: a lowercase letter, then up to 38 "
                                 "lowercase letters, digits or '-')", "give the `name:` of the run's spec")
        cs = CheckpointStore(url, run, creds)
        buf = bytearray()
        try:
            cs.store.get(cs.prefix + "spec.yaml", buf.extend)
        except FileNotFoundError:
            raise ApplianceError(f"no run {run!r} at {url}: {cs.store.url(cs.prefix + 'spec.yaml')} is not there",
                                 f"check the run's name and its checkpoint.url (`appliance data ls {url}` lists "
                                 "what is there)") from None
        # kept with the run's record (~/.appliance/runs/RUN/), which names it from the job on, so a later
        # `appliance resume RUN` finds it; one file per run, replaced whole by the next fetch (a temporary
        # directory per resume was never removed)
        where = runs.record_dir(run)
        where.mkdir(parents=True, exist_ok=True)
        path = where / "spec.yaml"
        tmp = where / "spec.yaml.tmp"
        tmp.write_bytes(bytes(buf))
        def give_up() -> None:  # the copy, and the run's directory if this made it and it holds nothing else
            tmp.unlink(missing_ok=True)
            try:
                where.rmdir()
            except OSError:
                pass

        try:
            spec = load_spec(str(tmp))
        except BaseException:
            give_up()
            raise
        if spec.name != run:
            give_up()
            raise ApplianceError(f"{cs.store.url(cs.prefix + 'spec.yaml')} is the spec of run {spec.name!r}, not "
                                 f"{run!r}", f"use `appliance resume {spec.name} --url {url}`")
        os.replace(tmp, path)
        return dataclasses.replace(spec, path=str(path))
    raise ApplianceError(f"no record of run {run!r} on this machine", f"give its spec: `appliance resume {run} "
                         "--spec SPEC.yaml` (see `appliance ls`)")


def choose_checkpoint(spec: Spec, cs: CheckpointStore | None):
    """The newest committed checkpoint of the run's store ``cs`` (None: the spec has no checkpoint.url) that
    verifies."""
    url = spec.checkpoint.url
    if cs is None:
        raise ApplianceError(f"run {spec.name!r} has no checkpoint.url in its spec, so there is nothing to resume",
                             "add checkpoint: {url: swift://checkpoints/} and start it with `appliance train`")
    with report.prefixed("[resume] "):
        try:
            good, problems = cs.newest_good()
        except FileNotFoundError:  # the container or bucket itself is not there (a 404, not a failure)
            raise ApplianceError(f"run {spec.name!r} has no checkpoint: {cs.store.url()} has no "
                                 f"{cs.store.holder} {cs.store.where!r}",
                                 "check checkpoint.url; the local cloud's store starts empty after `appliance cloud "
                                 "stop`") from None
    if good is None:
        if problems:
            raise ApplianceError(f"run {spec.name!r}: no committed checkpoint in {url} passed verification "
                                 f"({'; '.join(problems)})", f"start it again with `appliance train {spec.path}`")
        raise ApplianceError(f"run {spec.name!r} has no committed checkpoint in {url}",
                             f"start it with `appliance train {spec.path}`")
    if problems:
        log.info(f"[resume] the newest checkpoint is unusable ({problems[0]}); using {good.name} "
                 f"(step {good.step}) instead")
    return good


def list_runs() -> list[dict]:
    return runs.list_runs()
