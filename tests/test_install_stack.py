"""images/install-stack.sh on the images users boot, without installing anything (`--print-tag`): which Python it
takes (a CC-Ubuntu24.04 node has no python3.11; CC-Ubuntu22.04's is a release candidate), the wheel-cache key, and
the GPU build's flags (one NCCL, TensorFlow's, linked shared; Chameleon's compute capabilities). The installs
themselves run in make install (cpu, 3.11 and 3.12) and test_image.py (a CC-Ubuntu24.04 node, its 3.12)."""

import os
import shutil
import subprocess
from pathlib import Path

import pytest

from appliance.provision import install
from appliance.errors import ApplianceError
from conftest import ROOT

SCRIPT = ROOT / "images" / "install-stack.sh"
LOCK = ROOT / "requirements.lock"
TOOLS = ("sed", "tr", "nproc", "mktemp", "realpath", "env", "bash", "sh", "cat", "grep")


def fake_python(bindir: Path, name: str, version: str, final: bool = True, pip: bool = True) -> None:
    """A `python3.X` that answers the script's two questions as that Python would: its version, and (for a final
    release of a version the pins support) its X.Y."""
    minor = ".".join(version.split(".")[:2])
    (bindir / name).write_text(f"""#!/bin/sh
case "$2" in
  *releaselevel*) case " $3 " in *" {minor} "*) {'echo ' + minor if final else 'true'} ;; esac ;;
  "import pip") {'exit 0' if pip else 'exit 1'} ;;
  *) echo {version} ;;
esac
""")
    os.chmod(bindir / name, 0o755)


def fake_cuda(root: Path, release: str, archs: range) -> Path:
    (root / "bin").mkdir(parents=True)
    nvcc = root / "bin" / "nvcc"
    listed = "\\n".join(f"compute_{a}" for a in archs)
    nvcc.write_text(f"""#!/bin/sh
case "$1" in
  --version) echo "Cuda compilation tools, release {release}, V{release}.1" ;;
  --list-gpu-arch) printf '{listed}\\n' ;;
esac
""")
    os.chmod(nvcc, 0o755)
    return root


def print_tag(tmp_path: Path, *args: str, variant: str = "cpu", env: dict | None = None):
    bindir = tmp_path / "bin"
    bindir.mkdir(exist_ok=True)
    for t in TOOLS:
        if not (bindir / t).exists():
            os.symlink(shutil.which(t), bindir / t)
    r = subprocess.run(["bash", str(SCRIPT), "--print-tag", "--variant", variant, "--venv", str(tmp_path / "venv"),
                        "--lock", str(LOCK), "--appliance", str(ROOT), *args],
                       capture_output=True, text=True, env={"PATH": str(bindir), **(env or {})})
    lines = {}
    for line in r.stdout.splitlines():
        key, _, rest = line.partition(" ")
        lines.setdefault(key, []).append(rest)
    return r, lines


def taken(tmp_path: Path, *pythons: tuple, **kw) -> list[str]:
    """[key, python=PATH] that --print-tag says with fake ``pythons`` ((name, version[, final]) each) on PATH."""
    (tmp_path / "bin").mkdir(exist_ok=True)
    for p in pythons:
        fake_python(tmp_path / "bin", *p)
    r, out = print_tag(tmp_path, **kw)
    assert r.returncode == 0, r.stderr
    return out["APPLIANCE_STACK_TAG"][0].split()


def test_a_24_04_node_without_python_3_11_takes_its_3_12(tmp_path):
    (tmp_path / "bin").mkdir()
    fake_python(tmp_path / "bin", "python3.12", "3.12.3")
    fake_python(tmp_path / "bin", "python3", "3.12.3")
    r, out = print_tag(tmp_path)
    assert r.returncode == 0, r.stderr
    tag, python = out["APPLIANCE_STACK_TAG"][0].split()
    assert tag == f"tf{install_pin('tensorflow_cpu')}-cpu-py3.12" and python == f"python={tmp_path}/bin/python3.12"


def test_a_release_candidate_3_11_is_passed_over(tmp_path):
    """CC-Ubuntu22.04's python3.11 is 3.11.0~rc1 (jammy-updates): not used; with no 3.12 either (22.04's python3
    is 3.10), uv installs one (said as python=managed)."""
    (tmp_path / "bin").mkdir()
    fake_python(tmp_path / "bin", "python3.11", "3.11.0rc1", final=False)
    fake_python(tmp_path / "bin", "python3", "3.10.12")
    r, out = print_tag(tmp_path)
    assert r.returncode == 0, r.stderr
    tag, python = out["APPLIANCE_STACK_TAG"][0].split()
    assert tag.endswith("-cpu-py3.11") and python == "python=managed"
    assert taken(tmp_path, ("python3.12", "3.12.3"))[0].endswith("-py3.12")


def test_a_released_3_11_is_taken_first(tmp_path):
    assert taken(tmp_path, ("python3.11", "3.11.2"), ("python3.12", "3.12.3")) == [f"tf{install_pin('tensorflow_cpu')}-cpu-py3.11",
                                                      f"python={tmp_path}/bin/python3.11"]


def test_a_python_the_pins_do_not_support_is_one_line(tmp_path):
    (tmp_path / "bin").mkdir()
    fake_python(tmp_path / "bin", "python3.14", "3.14.3")
    r, _ = print_tag(tmp_path, "--python", "python3.14")
    assert r.returncode == 1 and r.stderr.count("\n") == 1
    assert "python3.14 is Python 3.14.3; the pins need a 3.11 3.12 release (fix: --python auto)" in r.stderr


def test_a_python_that_cannot_make_a_venv_is_passed_over(tmp_path):
    """Ubuntu ships ensurepip apart (pythonX.Y-venv): a deadsnakes python3.11 without it beside a working 3.12."""
    import sys

    (tmp_path / "bin").mkdir()
    no_venv = tmp_path / "bin" / "python3.11"  # this machine's 3.11 (a release) with ensurepip taken away
    no_venv.write_text(f"""#!/bin/sh
exec {sys._base_executable} -c 'import sys; sys.modules["ensurepip"] = None; sys.argv = sys.argv[1:]; exec(sys.argv[0])' "$2" "$3"
""")
    os.chmod(no_venv, 0o755)
    assert taken(tmp_path, ("python3.12", "3.12.3"))[0].endswith("-py3.12")


def test_the_gpu_build_links_tensorflows_nccl_shared_for_chameleons_gpus(tmp_path):
    (tmp_path / "bin").mkdir()
    fake_python(tmp_path / "bin", "python3.12", "3.12.3")
    cuda = fake_cuda(tmp_path / "cuda-12.6", "12.6", range(50, 91))
    r, out = print_tag(tmp_path, variant="gpu", env={"CUDA_HOME": str(cuda)})
    assert r.returncode == 0, r.stderr
    nccl = install_pin_gpu("nvidia-nccl-cu12")
    assert out["APPLIANCE_STACK_TAG"][0].split()[0] == \
        f"tf{install_pin('tensorflow_cpu')}-gpu-py3.12-cuda12.6-nccl{nccl}"
    build = dict(kv.split("=", 1) for kv in out["APPLIANCE_STACK_BUILD"])
    site = f"{tmp_path}/venv/lib/python3.12/site-packages"
    assert build["HOROVOD_GPU_OPERATIONS"] == "NCCL" and build["HOROVOD_NCCL_LINK"] == "SHARED"
    assert build["HOROVOD_NCCL_INCLUDE"] == f"{site}/nvidia/nccl/include"
    assert build["HOROVOD_BUILD_CUDA_CC_LIST"] == "60,70,75,80,86,90"
    assert build["LDFLAGS"].startswith("-Wl,-rpath,$ORIGIN/../../nvidia/nccl/lib")
    assert build["HOROVOD_CUDA_HOME"] == str(cuda) and "APPLIANCE_STACK_SKIPPED" not in out


def test_a_cuda_13_toolkit_is_keyed_apart_and_says_which_gpus_it_leaves_out(tmp_path):
    """This machine's CUDA 13 builds a compile-and-link check, never a wheel a CUDA 12.6 node would take."""
    (tmp_path / "bin").mkdir()
    fake_python(tmp_path / "bin", "python3.11", "3.11.2")
    cuda = fake_cuda(tmp_path / "cuda-13", "13.0", range(75, 122))
    r, out = print_tag(tmp_path, variant="gpu", env={"CUDA_HOME": str(cuda)})
    assert "-cuda13.0-" in out["APPLIANCE_STACK_TAG"][0]
    assert dict(kv.split("=", 1) for kv in out["APPLIANCE_STACK_BUILD"])["HOROVOD_BUILD_CUDA_CC_LIST"] == "75,80,86,90"
    assert out["APPLIANCE_STACK_SKIPPED"] == ["sm_60 sm_70"]


def test_no_cuda_toolkit_is_one_line_with_the_fix(tmp_path):
    (tmp_path / "bin").mkdir()
    fake_python(tmp_path / "bin", "python3.11", "3.11.2")
    r, _ = print_tag(tmp_path, variant="gpu", env={"CUDA_HOME": str(tmp_path / "none")})
    assert r.returncode == 1 and "no CUDA toolkit at" in r.stderr and "CC-Ubuntu*-CUDA" in r.stderr


def test_the_script_asks_apt_for_no_nccl_and_no_python_3_11():
    """NVIDIA's apt NCCL is a CUDA 13 build now, and noble has no python3.11 package: --system-deps asks for
    neither (an apt-get of a missing package stops the whole install under set -e)."""
    line = next(ln for ln in SCRIPT.read_text().splitlines() if ln.strip().startswith('pkgs="'))
    assert "nccl" not in line and "python3.11" not in line and "python3-venv" in line


class _Res:
    def __init__(self, out, rc=0, err=""):
        self.out, self.rc, self.err = out, rc, err


class _Node:
    def __init__(self, name):
        self.name, self.workdir = name, "/w"


class _Remote:
    def __init__(self, name, answer):
        self.node, self.answer = _Node(name), answer

    def run(self, cmd, timeout=None):
        assert "--print-tag" in cmd and "--system-deps" not in cmd
        return self.answer


class _Session:
    def __init__(self, remotes):
        self.remotes = remotes

    def each(self, fn):
        return {r.node.name: fn(r) for r in self.remotes}


def test_every_node_says_its_key_and_a_mixed_cluster_is_refused():
    opts = dict(variant="cpu", venv="/v", python="auto", sudo=False, pip_env={})
    same = _Session([_Remote(n, _Res("APPLIANCE_STACK_TAG tfX-cpu-py3.12 python=/usr/bin/python3.12\n"))
                     for n in ("a", "b")])
    assert install.node_tags(same, lambda r: "/i", **opts) == "tfX-cpu-py3.12"
    mixed = _Session([_Remote("a", _Res("APPLIANCE_STACK_TAG tfX-cpu-py3.12 python=p\n")),
                      _Remote("b", _Res("APPLIANCE_STACK_TAG tfX-cpu-py3.11 python=p\n"))])
    with pytest.raises(ApplianceError, match="a tfX-cpu-py3.12, b tfX-cpu-py3.11"):
        install.node_tags(mixed, lambda r: "/i", **opts)
    broken = _Session([_Remote("a", _Res("", 1, "install-stack: error: python3.14 is Python 3.14.3; the pins ..."))])
    with pytest.raises(ApplianceError, match="a cannot install the stack: install-stack: error: python3.14"):
        install.node_tags(broken, lambda r: "/i", **opts)


def install_pin(name: str) -> str:
    from appliance import paths

    return paths.lock_pin(name)


def install_pin_gpu(name: str) -> str:
    import re

    return re.search(rf"^# gpu: {re.escape(name)}==(\S+)", LOCK.read_text(), re.M).group(1)


def test_a_relative_venv_gives_the_build_absolute_paths(tmp_path):
    """Horovod's build runs in a directory of its own (pip's), so a relative --venv (make gpu-wheel's
    build/stack-gpu) made CMake miss the NCCL wheel: "Could NOT find NCCL (missing: NCCL_INCLUDE_DIR ...)"."""
    (tmp_path / "bin").mkdir()
    fake_python(tmp_path / "bin", "python3.11", "3.11.2")
    cuda = fake_cuda(tmp_path / "cuda", "12.6", range(50, 91))
    bindir = tmp_path / "bin"
    for t in TOOLS:
        os.symlink(shutil.which(t), bindir / t)
    r = subprocess.run(["bash", str(SCRIPT), "--print-tag", "--variant", "gpu", "--venv", "rel/venv", "--lock",
                        str(LOCK), "--appliance", str(ROOT)], capture_output=True, text=True, cwd=tmp_path,
                       env={"PATH": str(bindir), "CUDA_HOME": str(cuda)})
    build = dict(line.split(" ", 1)[1].split("=", 1) for line in r.stdout.splitlines()
                 if line.startswith("APPLIANCE_STACK_BUILD "))
    assert build["HOROVOD_NCCL_INCLUDE"] == f"{tmp_path}/rel/venv/lib/python3.11/site-packages/nvidia/nccl/include"


def test_a_venv_an_earlier_run_left_without_pip_is_made_anew(tmp_path):
    """`python3 -m venv` without python3-venv dies after writing bin/python: the re-run the fix line asks for must
    not take that venv as made (it stopped at `No module named pip`, with no line of the script's)."""
    (tmp_path / "bin").mkdir()
    fake_python(tmp_path / "bin", "python3.12", "3.12.3")
    (tmp_path / "venv" / "bin").mkdir(parents=True)
    fake_python(tmp_path / "venv" / "bin", "python", "3.12.3", pip=False)
    r, out = print_tag(tmp_path)
    assert r.returncode == 0, r.stderr
    assert out["APPLIANCE_STACK_TAG"][0].split()[1] == f"python={tmp_path}/bin/python3.12"


def test_a_venv_keeps_its_python_and_refuses_another_one_asked_for(tmp_path):
    (tmp_path / "bin").mkdir()
    fake_python(tmp_path / "bin", "python3.12", "3.12.3")
    (tmp_path / "venv" / "bin").mkdir(parents=True)
    fake_python(tmp_path / "venv" / "bin", "python", "3.11.2")
    r, out = print_tag(tmp_path)
    assert out["APPLIANCE_STACK_TAG"][0].split() == [f"tf{install_pin('tensorflow_cpu')}-cpu-py3.11",
                                                      f"python={tmp_path}/venv/bin/python"]
    r, _ = print_tag(tmp_path, "--python", "python3.12")
    assert r.returncode == 1 and "has Python 3.11, not --python python3.12's (fix: remove" in r.stderr
