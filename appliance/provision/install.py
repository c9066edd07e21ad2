"""The boot-time installer (`appliance up SPEC --install`): the appliance image's stack on stock nodes.

For users who stay on Chameleon's stock CC-Ubuntu images (22.04 or 24.04, with CUDA or not). Every node runs
``images/install-stack.sh`` (the same steps ``make install`` and the image build run), in parallel, into the
venv the cluster then trains with. Building Horovod takes minutes, so its wheel is cached in the object store
under ``CACHE_URL/TAG/``: the first cluster builds it once, on the head node, and uploads it; every later cluster
(and every other node) installs that wheel, no build. TAG is what a built wheel depends on (TensorFlow, variant,
Python; on gpu the CUDA toolkit and the NCCL wheel), and only the node knows its Python and CUDA: every node says
its TAG first (``install-stack.sh --print-tag``), and a cluster whose nodes differ is refused.

The launcher mediates the cache (download, push to nodes over SSH; pull from the head, upload), so nodes never
hold object-store credentials for it.
"""

from __future__ import annotations

import base64
import hashlib
import re
import shlex
import shutil
import tempfile
from pathlib import Path

from .. import paths, report
from ..cluster import Cluster
from ..errors import ApplianceError
from ..remote import Remote, Session

log = report.get(__name__)

PACKAGE = Path(__file__).resolve().parents[1]
LOCK = paths.LOCK
DEFAULT_CACHE = "swift://appliance-wheels/"


def bundle(dest: Path) -> Path:
    """What a node needs to install the stack: the package, the lock, the install script."""
    dest.mkdir(parents=True, exist_ok=True)
    shutil.copytree(PACKAGE, dest / "appliance", ignore=shutil.ignore_patterns("__pycache__"))
    for f in paths.SHIPPED:
        src = paths.shipped(f)
        if not src.is_file():
            raise ApplianceError(f"{src} is missing: this install of appliance cannot install nodes",
                                 "reinstall it (pip install appliance from its source), or use the appliance image")
        (dest / f).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(src, dest / f)
    return dest


def fetch_cached_wheel(store, key: str, dest: Path) -> str | None:
    """The newest cached Horovod wheel under ``key``, downloaded into ``dest`` if its recorded SHA-256 (the
    ``.sha256`` object written beside it when it was cached) matches its bytes; None otherwise (the head node then
    builds, and the entry is written again). Nodes install it as root, so no unchecked bytes are used."""
    names = sorted(o.name for o in store.list(key))
    for name in sorted((n for n in names if n.endswith(".whl")), reverse=True):
        if name + ".sha256" not in names:
            log.info(f"[install] horovod: {Path(name).name} in the wheel cache has no recorded SHA-256; not using it")
            continue
        want = bytearray()
        store.get(name + ".sha256", want.extend)
        local = dest / Path(name).name
        h = hashlib.sha256()
        with open(local, "wb") as fh:
            store.get(name, lambda b: (fh.write(b), h.update(b)))
        recorded = bytes(want).decode(errors="replace").split()
        if recorded and h.hexdigest() == recorded[0]:
            return local.name
        local.unlink(missing_ok=True)
        log.info(f"[install] horovod: {Path(name).name} in the wheel cache does not match its recorded SHA-256; "
                 "not using it")
    return None


def _script(r: Remote, d: str, *, variant: str, venv: str, python: str, sudo: bool, pip_env: dict[str, str],
            system_deps: bool, extra: str = "") -> str:
    env = " ".join(f"{k}={shlex.quote(v)}" for k, v in pip_env.items())
    return (f"{'sudo -n ' if sudo else ''}env {env} bash {d}/images/install-stack.sh --variant {variant} "
            f"--venv {shlex.quote(venv)} --lock {d}/requirements.lock --appliance {d} --wheels {d}-wheels "
            f"--python {shlex.quote(python)}" + (" --system-deps" if system_deps else "") + extra)


def node_tags(session: Session, inst, **opts) -> str:
    """The wheel-cache key every node computes for itself (its Python; on gpu its CUDA toolkit); one for all."""
    def ask(r: Remote) -> str:
        res = r.run(_script(r, inst(r), system_deps=False, extra=" --print-tag", **opts), timeout=120)
        m = re.search(r"^APPLIANCE_STACK_TAG (\S+)", res.out, re.M)
        if res.rc != 0 or not m:
            tail = (res.err.strip().splitlines() or [f"exit {res.rc}"])[-1]
            raise ApplianceError(f"{r.node.name} cannot install the stack: {tail}",
                                 "as install-stack.sh's line says; it installs on CC-Ubuntu24.04 and 22.04, CUDA or "
                                 "not (docs/image.md)")
        return m.group(1)

    tags = session.each(ask)
    if len(set(tags.values())) > 1:
        raise ApplianceError("the nodes would need different Horovod builds: " +
                             ", ".join(f"{n} {t}" for n, t in sorted(tags.items())),
                             "boot every node of a cluster from the same image")
    return next(iter(tags.values()))


def install_stack(cluster: Cluster, *, variant: str, venv: str, cache_url: str = DEFAULT_CACHE, creds=None,
                  system_deps: bool = True, pip_env: dict[str, str] | None = None, sudo: bool = False,
                  python: str = "auto") -> dict:
    """Install the stack on every node into ``venv``; returns {"python", "tag", "built", "cached"}.
    ``python``: the node's interpreter, or ``auto`` (install-stack.sh finds one the pins support)."""
    from ..store.objects import SwiftStore, open_store

    opts = dict(variant=variant, venv=venv, python=python, sudo=sudo, pip_env=pip_env or {})
    store, prefix = open_store(cache_url, creds)
    if isinstance(store, SwiftStore):
        store.ensure_container()
    work = Path(tempfile.mkdtemp(prefix="appliance-install-"))
    try:
        src = bundle(work / "bundle")
        with Session(cluster) as session:
            def inst(r: Remote) -> str:
                return f"{r.node.workdir}/appliance/installer"

            session.each(lambda r: r.put_dir(src, inst(r)))
            tag = node_tags(session, inst, **opts)
            key = f"{prefix.rstrip('/') + '/' if prefix else ''}{tag}/"
            wheels_here = work / "wheels"
            (wheels_here / tag).mkdir(parents=True)
            cached = fetch_cached_wheel(store, key, wheels_here / tag)
            if cached:
                log.info(f"[install] horovod: the wheel cache has {cached} ({tag}, SHA-256 checked); no build")
            else:
                log.info(f"[install] horovod: no wheel for {tag} in {cache_url}; the head node builds it once (~5 "
                         "min on a 2-core machine, less on a GPU node) and it is cached for every later cluster")
            session.each(lambda r: r.put_dir(wheels_here, f"{inst(r)}-wheels"))

            def run(r: Remote) -> str:
                res = r.run(_script(r, inst(r), system_deps=system_deps, **opts),
                            on_line=lambda _s, line: log.info(f"[install|{r.node.name}] {line}")
                            if line.startswith("install-stack") else None, timeout=3600)
                m = re.search(r"^APPLIANCE_STACK ok .* wheel=(\S+)$", res.out, re.M)
                if res.rc != 0 or not m:
                    tail = (res.err.strip().splitlines() or res.out.strip().splitlines() or [f"exit {res.rc}"])[-1]
                    raise ApplianceError(f"installing the stack on {r.node.name} failed: {tail}",
                                         "re-run `appliance up SPEC --install` (it is idempotent); "
                                         "`appliance doctor --cluster NAME` shows what is missing")
                return m.group(1)

            built = None
            if not cached:  # the head builds; its wheel goes to the cache and to the other nodes
                built = _build_on_head(session, run, store, key, wheels_here / tag, work)
                log.info(f"[install] horovod wheel {built} cached in {cache_url}{tag}/")
                rest = [n for n in cluster.nodes if n is not cluster.head]
                for n in rest:
                    session[n.name].put_dir(wheels_here, f"{inst(session[n.name])}-wheels")
                others = {n.name: session[n.name] for n in rest}
            else:
                others = dict(session.remotes)
            if others:
                from concurrent.futures import ThreadPoolExecutor

                with ThreadPoolExecutor(max_workers=min(16, len(others))) as ex:
                    list(ex.map(run, others.values()))
            python_path = session.head.run(f"readlink -f {shlex.quote(venv)}/bin/python || true").out.strip()
    finally:
        shutil.rmtree(work, ignore_errors=True)
    return {"python": f"{venv}/bin/python", "tag": tag, "built": built, "cached": bool(cached),
            "interpreter": python_path}


def _build_on_head(session: Session, run, store, key: str, here: Path, work: Path) -> str:
    """The head installs (building Horovod); its wheel comes back here, goes to the cache (the wheel, then its
    SHA-256: a cache entry is both) and is returned by name."""
    wheel = run(session.head)
    r = session.head.run(f"base64 -w0 {shlex.quote(wheel)}", timeout=600)
    if r.rc != 0:
        raise ApplianceError(f"cannot read the built wheel {wheel} on {session.head.node.name}")
    local = here / Path(wheel).name
    local.write_bytes(base64.b64decode(r.out.strip()))
    store.put(f"{key}{local.name}", local)
    digest = work / "digest"
    digest.write_text(hashlib.sha256(local.read_bytes()).hexdigest() + "\n")
    store.put(f"{key}{local.name}.sha256", digest)
    return local.name
