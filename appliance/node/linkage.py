"""Which NCCL Horovod's TensorFlow library will load, read from the file alone (no GPU, no import of TensorFlow).

    python -m appliance.node.linkage [--horovod DIR] [--expect gpu|cpu|any] [--json]

Checks of ``horovod/tensorflow/mpi_lib*.so``:
- ``NEEDED libnccl.so.2`` (``readelf -d``): NCCL is a shared library, the one TensorFlow also loads;
- no NCCL compiled in: the version string NCCL puts in its library (``NCCL version 2.21.5+cuda12.4``, NVIDIA/nccl
  ``src/init.cc`` VERSION_STRING) is not in the file. Horovod's FindNCCL (``cmake/Modules/FindNCCL.cmake``) links
  ``libnccl_static.a`` when it finds one unless ``HOROVOD_NCCL_LINK=SHARED``: two NCCLs in one process then;
- RUNPATH (or RPATH) reaches the venv's ``nvidia/nccl/lib``, where the nvidia-nccl-cu12 wheel TensorFlow brings
  keeps ``libnccl.so.2`` (``$ORIGIN`` is the library's own directory);
- the CUDA device code inside covers Chameleon's GPUs, sm_60 (P100) to sm_90 (H100) (``cuobjdump --list-elf`` and
  ``--list-ptx``; skipped with a line where the CUDA toolkit has no cuobjdump).
A build without NCCL (the CPU variant) says ``no NCCL (CPU build)`` and skips the rest. Exit 1 if a check fails.
"""

from __future__ import annotations

import importlib.util
import json
import mmap
import os
import re
import shutil
import subprocess
import sys
from dataclasses import asdict, dataclass, field
from pathlib import Path

from .doctor import Check

NCCL_SONAME = "libnccl.so.2"
# Chameleon's GPUs: P100 sm_60, V100 sm_70, RTX 6000 sm_75, A100 sm_80, H100 sm_90
CHAMELEON_SM = {60: "P100", 70: "V100", 75: "RTX 6000", 80: "A100", 90: "H100"}


def rebuild(wheel_lib: Path) -> str:
    """The fix for a Horovod linked to another NCCL than the venv's wheel (docs/image.md)."""
    return (f"rebuild Horovod with HOROVOD_NCCL_LINK=SHARED HOROVOD_NCCL_HOME={wheel_lib.parent} (a libnccl.so -> "
            f"{NCCL_SONAME} link there) and LDFLAGS=-Wl,-rpath,'$ORIGIN/../../nvidia/nccl/lib'")


_DYN = re.compile(r"\((NEEDED|RUNPATH|RPATH|SONAME)\)\s+[^\[]*\[(.*)\]")
_STATIC_VERSION = re.compile(rb"NCCL version (\d+\.\d+\.\d+[\w.+-]*)")
_SM = re.compile(r"\bsm_(\d+)a?\b")


@dataclass
class Dynamic:
    """The dynamic section entries this check reads."""

    needed: list[str] = field(default_factory=list)
    runpath: list[str] = field(default_factory=list)
    rpath: list[str] = field(default_factory=list)
    soname: str | None = None


def parse_readelf(text: str) -> Dynamic:
    """``readelf -d -W FILE``'s output -> its NEEDED, RUNPATH, RPATH and SONAME entries."""
    d = Dynamic()
    for tag, value in _DYN.findall(text):
        if tag == "NEEDED":
            d.needed.append(value)
        elif tag == "SONAME":
            d.soname = value
        else:
            getattr(d, tag.lower()).extend(p for p in value.split(":") if p)
    return d


def read_dynamic(so: Path, readelf: str | None = None) -> Dynamic | str:
    """The library's dynamic section, or a one-line reason it could not be read."""
    readelf = readelf or shutil.which("readelf")
    if not readelf:
        return "readelf is not installed (Debian/Ubuntu package binutils)"
    p = subprocess.run([readelf, "-d", "-W", str(so)], capture_output=True, text=True, timeout=60)
    if p.returncode != 0:
        return f"readelf -d {so.name}: {(p.stderr.strip().splitlines() or ['failed'])[-1]}"
    return parse_readelf(p.stdout)


def static_nccl(so: Path) -> str | None:
    """The NCCL version compiled into the file (NCCL's own version string), or None."""
    with open(so, "rb") as fh:
        if os.fstat(fh.fileno()).st_size == 0:
            return None
        with mmap.mmap(fh.fileno(), 0, access=mmap.ACCESS_READ) as mm:
            m = _STATIC_VERSION.search(mm)
            return m.group(1).decode(errors="replace") if m else None


def resolve(entries: list[str], origin: Path) -> list[Path]:
    """RUNPATH/RPATH entries as directories (``$ORIGIN`` and ``${ORIGIN}`` are the library's directory)."""
    return [Path(os.path.normpath(e.replace("${ORIGIN}", str(origin)).replace("$ORIGIN", str(origin))))
            for e in entries]


def parse_archs(elf_list: str, ptx_list: str = "") -> tuple[set[int], set[int]]:
    """The sm_NN of ``cuobjdump --list-elf`` (cubins) and ``--list-ptx`` (PTX) outputs."""
    return {int(n) for n in _SM.findall(elf_list)}, {int(n) for n in _SM.findall(ptx_list)}


def coverage(cubins: set[int], ptx: set[int], wanted=tuple(CHAMELEON_SM)) -> dict[int, str | None]:
    """How each wanted sm runs the device code: its own cubin, a cubin of the same major version and a lower minor
    (binary compatible), PTX of a lower or equal version (compiled by the driver at first use), or None."""
    out: dict[int, str | None] = {}
    for sm in wanted:
        same = sorted(c for c in cubins if c // 10 == sm // 10 and c <= sm)
        jit = sorted(p for p in ptx if p <= sm)
        out[sm] = (f"cubin sm_{sm}" if sm in cubins else f"cubin sm_{same[-1]}" if same else
                   f"PTX sm_{jit[-1]} (JIT)" if jit else None)
    return out


def find_mpi_lib(horovod_dir: Path) -> Path | None:
    found = sorted((horovod_dir / "tensorflow").glob("mpi_lib*.so"))
    return found[0] if found else None


def horovod_dir() -> Path | None:
    """This Python's horovod package directory, found without importing it (its import loads TensorFlow)."""
    spec = importlib.util.find_spec("horovod")
    return Path(spec.origin).parent if spec and spec.origin else None


def cuobjdump_path() -> str | None:
    for d in (os.environ.get("CUDA_HOME"), "/usr/local/cuda"):
        if d and os.access(f"{d}/bin/cuobjdump", os.X_OK):
            return f"{d}/bin/cuobjdump"
    return shutil.which("cuobjdump")


def nccl_checks(so: Path, dyn: Dynamic) -> list[Check]:
    """NEEDED, nothing compiled in, RUNPATH to the venv's wheel: one line."""
    static = static_nccl(so)
    wheel = Path(os.path.normpath(so.parent / ".." / ".." / "nvidia" / "nccl" / "lib"))
    fix = rebuild(wheel)
    if static:
        return [Check("nccl linkage", "fail", f"{so.name} has NCCL {static} compiled in (libnccl_static.a): a "
                      "second NCCL beside TensorFlow's", fix)]
    if NCCL_SONAME not in dyn.needed:
        return [Check("nccl linkage", "fail", f"{so.name} does not need {NCCL_SONAME} "
                      f"(NEEDED: {', '.join(dyn.needed) or 'none'})", fix)]
    kind, entries = ("RUNPATH", dyn.runpath) if dyn.runpath else ("RPATH", dyn.rpath)
    dirs = resolve(entries, so.parent)
    if wheel not in dirs:
        return [Check("nccl linkage", "fail", f"NEEDED {NCCL_SONAME}, but {kind or 'RUNPATH'} "
                      f"[{':'.join(entries)}] does not reach {wheel}", fix)]
    have = "" if (wheel / NCCL_SONAME).exists() else f" (no {NCCL_SONAME} there: install nvidia-nccl-cu12)"
    return [Check("nccl linkage", "ok" if not have else "fail",
                  f"NEEDED {NCCL_SONAME}, none compiled in, {kind} reaches {wheel}{have}",
                  None if not have else "install the GPU variant: images/install-stack.sh --variant gpu")]


def arch_check(so: Path, tool: str | None = None) -> Check:
    """The CUDA device code in the library covers sm_60..sm_90."""
    tool = tool or cuobjdump_path()
    if not tool:
        return Check("cuda archs", "skip", "no cuobjdump (the CUDA toolkit's) here: the sm list is not checked")
    lists = [subprocess.run([tool, flag, str(so)], capture_output=True, text=True, timeout=120)
             for flag in ("--list-elf", "--list-ptx")]
    cubins, ptx = parse_archs(lists[0].stdout, lists[1].stdout)
    if not cubins and not ptx:
        return Check("cuda archs", "skip", f"no CUDA device code in {so.name} (NCCL brings its own kernels)")
    cov = coverage(cubins, ptx)
    missing = [f"sm_{sm} ({CHAMELEON_SM[sm]})" for sm, how in cov.items() if how is None]
    have = ", ".join(f"sm_{n}" for n in sorted(cubins)) + (f"; PTX {', '.join(f'sm_{n}' for n in sorted(ptx))}"
                                                           if ptx else "")
    if missing:
        return Check("cuda archs", "fail", f"no device code for {', '.join(missing)} (has {have})",
                     "build with a CUDA 12 toolkit that lists these archs (`nvcc --list-gpu-arch`), or set "
                     "HOROVOD_BUILD_CUDA_CC_LIST=60,70,75,80,90")
    return Check("cuda archs", "ok", f"sm_60..sm_90 covered ({have})")


def check(hvd_dir: Path | None, expect: str = "any") -> list[Check]:
    """The linkage checks of the Horovod at ``hvd_dir``. ``expect``: "gpu" makes a build without NCCL a failure,
    "cpu" makes one with NCCL a failure, "any" takes what it finds."""
    so = find_mpi_lib(hvd_dir) if hvd_dir else None
    if so is None:
        return [Check("nccl linkage", "fail", f"no horovod/tensorflow/mpi_lib*.so under {hvd_dir}",
                      "install the stack: images/install-stack.sh (docs/image.md)")]
    dyn = read_dynamic(so)
    if isinstance(dyn, str):
        return [Check("nccl linkage", "skip", dyn)]
    if NCCL_SONAME not in dyn.needed and not static_nccl(so):
        if expect == "gpu":
            return [Check("nccl linkage", "fail", f"no NCCL in {so.name}: Horovod was built without it",
                          "rebuild: images/install-stack.sh --variant gpu")]
        return [Check("nccl linkage", "skip", "no NCCL (CPU build)")]
    if expect == "cpu":
        return [Check("nccl linkage", "fail", f"{so.name} has NCCL, the CPU variant should not",
                      "rebuild: images/install-stack.sh --variant cpu")]
    return nccl_checks(so, dyn) + [arch_check(so)]


def main(argv: list[str] | None = None) -> int:
    import argparse

    ap = argparse.ArgumentParser(prog="python -m appliance.node.linkage", description=__doc__.splitlines()[0])
    ap.add_argument("--horovod", help="the horovod package directory (default: this Python's)")
    ap.add_argument("--expect", choices=["gpu", "cpu", "any"], default="any",
                    help="gpu: a build without NCCL fails; cpu: one with NCCL fails")
    ap.add_argument("--json", action="store_true", help="print the checks as JSON")
    a = ap.parse_args(argv)
    checks = check(Path(a.horovod) if a.horovod else horovod_dir(), a.expect)
    if a.json:
        print(json.dumps([asdict(c) for c in checks], indent=1))
    else:
        mark = {"ok": "ok  ", "fail": "FAIL", "skip": "skip"}
        for c in checks:
            print(f"{mark[c.status]} {c.name:<13} {c.detail}" + (f"  (fix: {c.fix})" if c.fix else ""))
    return 1 if any(c.status == "fail" for c in checks) else 0


if __name__ == "__main__":
    sys.exit(main())
