"""appliance/node/linkage.py: which NCCL Horovod's TensorFlow library loads, read from the file. The GPU cases run on
fabricated `readelf -d` / `cuobjdump` output and .so-like files (this machine has no GPU build); the CPU build
installed here is read for real."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from appliance.node import linkage
from conftest import ROOT

GOOD_READELF = """
Dynamic section at offset 0x1d8e8 contains 30 entries:
  Tag        Type                         Name/Value
 0x0000000000000001 (NEEDED)             Shared library: [libnccl.so.2]
 0x0000000000000001 (NEEDED)             Shared library: [libtensorflow_framework.so.2]
 0x0000000000000001 (NEEDED)             Shared library: [libstdc++.so.6]
 0x000000000000000e (SONAME)             Library soname: [mpi_lib.cpython-311-x86_64-linux-gnu.so]
 0x000000000000001d (RUNPATH)            Library runpath: [$ORIGIN/../../nvidia/nccl/lib:/usr/local/cuda/lib64]
 0x000000000000000c (INIT)               0x33000
"""
ALL_ARCHS = "\n".join(f"ELF file    {i}: mpi_lib.{i}.sm_{sm}.cubin" for i, sm in enumerate((60, 70, 75, 80, 90), 1))
CUDA13_ARCHS = "\n".join(f"ELF file    {i}: mpi_lib.{i}.sm_{sm}.cubin" for i, sm in enumerate((75, 80, 90, 100), 1))


def site(tmp_path, so_bytes=b"\x7fELF" + b"\0" * 64 + b"NCCL version >= 2.7.0 needed for alltoall", wheel=True):
    """A venv's site-packages: horovod/tensorflow/mpi_lib*.so and, with ``wheel``, nvidia/nccl/lib/libnccl.so.2."""
    sp = tmp_path / "site-packages"
    (sp / "horovod" / "tensorflow").mkdir(parents=True)
    (sp / "horovod" / "tensorflow" / "mpi_lib.cpython-311-x86_64-linux-gnu.so").write_bytes(so_bytes)
    if wheel:
        (sp / "nvidia" / "nccl" / "lib").mkdir(parents=True)
        (sp / "nvidia" / "nccl" / "lib" / "libnccl.so.2").write_bytes(b"\x7fELF")
    return sp / "horovod"


def tool(tmp_path, name, outputs: dict[str, str]) -> Path:
    """A fake binutils/CUDA tool on PATH: prints outputs[first argument]."""
    bindir = tmp_path / "bin"
    bindir.mkdir(exist_ok=True)
    script = bindir / name
    cases = "".join(f"  {flag}) cat <<'EOF'\n{text}\nEOF\n  ;;\n" for flag, text in outputs.items())
    script.write_text(f"#!/bin/sh\ncase \"$1\" in\n{cases}esac\n")
    script.chmod(0o755)
    return script


@pytest.fixture
def gpu_tools(tmp_path, monkeypatch):
    def use(readelf=GOOD_READELF, elf=ALL_ARCHS, ptx=""):
        tool(tmp_path, "readelf", {"-d": readelf})
        fake = tool(tmp_path, "cuobjdump", {"--list-elf": elf, "--list-ptx": ptx})
        monkeypatch.setenv("PATH", f"{tmp_path / 'bin'}:{os.environ['PATH']}")
        monkeypatch.setattr(linkage, "cuobjdump_path", lambda: str(fake))  # not a real toolkit's, where one is
    return use


def by_name(checks):
    return {c.name: c for c in checks}


def test_parse_readelf_reads_needed_runpath_rpath_and_soname():
    d = linkage.parse_readelf(GOOD_READELF + " 0x000000000000000f (RPATH)   Library rpath: [/opt/a:$ORIGIN/b]\n")
    assert d.needed == ["libnccl.so.2", "libtensorflow_framework.so.2", "libstdc++.so.6"]
    assert d.runpath == ["$ORIGIN/../../nvidia/nccl/lib", "/usr/local/cuda/lib64"] and d.rpath == ["/opt/a", "$ORIGIN/b"]
    assert d.soname == "mpi_lib.cpython-311-x86_64-linux-gnu.so"
    assert linkage.resolve(["$ORIGIN/../../nvidia/nccl/lib", "${ORIGIN}/x"], Path("/v/sp/horovod/tensorflow")) == [
        Path("/v/sp/nvidia/nccl/lib"), Path("/v/sp/horovod/tensorflow/x")]


def test_a_gpu_build_linked_to_the_venvs_nccl_passes(tmp_path, gpu_tools):
    gpu_tools()
    checks = by_name(linkage.check(site(tmp_path), expect="gpu"))
    assert checks["nccl linkage"].status == "ok", checks["nccl linkage"]
    assert "NEEDED libnccl.so.2, none compiled in, RUNPATH reaches" in checks["nccl linkage"].detail
    assert checks["cuda archs"].status == "ok" and "sm_60, sm_70, sm_75, sm_80, sm_90" in checks["cuda archs"].detail


def test_nccl_compiled_in_fails_and_says_its_version(tmp_path, gpu_tools):
    gpu_tools()
    so = b"\x7fELF" + b"\0" * 32 + b"NCCL version 2.28.9+cuda13.0\0" + b"\0" * 32
    c = by_name(linkage.check(site(tmp_path, so), expect="gpu"))["nccl linkage"]
    assert c.status == "fail" and "NCCL 2.28.9+cuda13.0 compiled in" in c.detail
    assert "HOROVOD_NCCL_LINK=SHARED" in c.fix


def test_a_runpath_that_misses_the_wheel_fails(tmp_path, gpu_tools):
    gpu_tools(readelf=GOOD_READELF.replace("$ORIGIN/../../nvidia/nccl/lib:", "/usr/lib/x86_64-linux-gnu:"))
    c = by_name(linkage.check(site(tmp_path)))["nccl linkage"]
    assert c.status == "fail" and "does not reach" in c.detail and "nvidia/nccl/lib" in c.detail


def test_rpath_counts_and_a_missing_wheel_fails(tmp_path, gpu_tools):
    gpu_tools(readelf=GOOD_READELF.replace("(RUNPATH)            Library runpath", "(RPATH)   Library rpath"))
    assert "RPATH reaches" in by_name(linkage.check(site(tmp_path)))["nccl linkage"].detail
    c = by_name(linkage.check(site(tmp_path / "b", wheel=False)))["nccl linkage"]
    assert c.status == "fail" and "no libnccl.so.2 there" in c.detail


def test_archs_of_a_cuda13_toolkit_miss_p100_and_v100(tmp_path, gpu_tools):
    gpu_tools(elf=CUDA13_ARCHS)
    c = by_name(linkage.check(site(tmp_path)))["cuda archs"]
    assert c.status == "fail" and "sm_60 (P100), sm_70 (V100)" in c.detail and "HOROVOD_BUILD_CUDA_CC_LIST" in c.fix


def test_coverage_by_cubin_of_the_same_major_or_by_ptx():
    assert linkage.coverage({60, 70, 80}, set())[75] == "cubin sm_70"
    assert linkage.coverage({61}, set())[60] is None  # sm_61 code does not run on sm_60
    assert set(linkage.coverage(set(), {52}).values()) == {"PTX sm_52 (JIT)"}
    assert linkage.parse_archs("ELF file 1: x.sm_90a.cubin\nELF file 2: x.sm_80.cubin", "PTX file 1: x.sm_90.ptx") == (
        {80, 90}, {90})


def test_without_cuobjdump_the_archs_are_skipped_with_a_line(tmp_path, gpu_tools, monkeypatch):
    gpu_tools()
    monkeypatch.setattr(linkage, "cuobjdump_path", lambda: None)
    c = by_name(linkage.check(site(tmp_path)))["cuda archs"]
    assert c.status == "skip" and "no cuobjdump" in c.detail


def test_a_build_without_nccl_is_a_cpu_build_unless_a_gpu_one_is_expected(tmp_path, gpu_tools):
    gpu_tools(readelf=GOOD_READELF.replace("[libnccl.so.2]", "[libgloo.so]"))
    assert [(c.status, c.detail) for c in linkage.check(site(tmp_path))] == [("skip", "no NCCL (CPU build)")]
    c = linkage.check(site(tmp_path / "b"), expect="gpu")[0]
    assert c.status == "fail" and "built without it" in c.detail


def test_no_horovod_library_fails(tmp_path):
    c = linkage.check(tmp_path)[0]
    assert c.status == "fail" and "mpi_lib" in c.detail


def test_the_cpu_build_installed_here_says_so(tmp_path):
    """The real file and the real readelf: this machine's Horovod is the CPU variant."""
    hvd = linkage.horovod_dir()
    assert hvd is not None and linkage.find_mpi_lib(hvd) is not None
    dyn = linkage.read_dynamic(linkage.find_mpi_lib(hvd))
    assert "libtensorflow_framework.so.2" in dyn.needed and linkage.NCCL_SONAME not in dyn.needed
    r = subprocess.run([sys.executable, "-m", "appliance.node.linkage"], capture_output=True, text=True, cwd=ROOT,
                       env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert r.returncode == 0 and r.stdout.startswith("skip nccl linkage  no NCCL (CPU build)"), r.stdout + r.stderr
    r = subprocess.run([sys.executable, "-m", "appliance.node.linkage", "--expect", "gpu", "--json"],
                       capture_output=True, text=True, cwd=ROOT, env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert r.returncode == 1 and json.loads(r.stdout)[0]["status"] == "fail"
