#!/usr/bin/env bash
# The appliance's training stack, installed by ONE set of steps used three ways:
#   - `make install` here and in CI:               --variant cpu --venv .venv --editable
#   - the image build (DIB element appliance-stack): --variant gpu --venv /opt/appliance/venv
#   - the boot-time installer (`appliance up --install`) on a stock CC-Ubuntu CUDA node: --variant gpu
#
# Steps: (1) a venv with a Python the pins support: --python PY, or (auto) the image's own python3.11 where it is a
# release, else its python3.12 (Ubuntu 24.04 has no 3.11), else a Python that uv (pinned) installs; (2) every
# package of the lock, exactly, with --no-deps
# (the gpu variant swaps tensorflow-cpu for the lock's `# gpu:` lines: the GPU TensorFlow and the CUDA,
# cuDNN and NCCL wheels it was built against), installed by uv (pinned in the lock: the same wheels as pip,
# unpacked in parallel; it reads UV_INDEX_URL, not pip.conf); (3) Horovod built from source against that
# TensorFlow (Gloo always; on gpu NCCL, linked shared against the NCCL wheel TensorFlow brings, so a process holds
# one NCCL), or a wheel already built for the same key taken from --wheels (the key: TF, variant, Python, and on
# gpu the CUDA toolkit and NCCL; `--print-tag` prints it); (4) the appliance package; (5) the build check:
# Horovod's TensorFlow extension loads and was built with Gloo (and on gpu NCCL, linked as above:
# `python -m appliance.node.linkage`). Idempotent: a
# step whose result is there already is skipped.
#
# Usage: install-stack.sh --variant cpu|gpu --venv DIR --lock FILE --appliance SRC
#                         [--wheels DIR] [--python PY|auto] [--editable] [--system-deps] [--print-tag]
set -euo pipefail

variant=cpu venv="" lock="" src="" wheels="" python=auto editable=0 system_deps=0 print_tag=0
say() { printf 'install-stack: %s\n' "$*"; }
die() { printf 'install-stack: error: %s\n' "$*" >&2; exit 1; }

# The Pythons the pins support: TensorFlow 2.18.1 has cp311 and cp312 wheels, and Horovod 0.28.1 builds on both.
PYTHONS="3.11 3.12"
MANAGED_PYTHON=3.11  # what uv installs where the image has neither (CC-Ubuntu22.04: python3.11 is 3.11.0~rc1)
# The GPU build's compute capabilities: Chameleon's GPUs, P100 (sm_60), V100 (70), RTX 6000 (75), A100 (80),
# A30/A40 (86), H100 (90); those the CUDA toolkit cannot build (CUDA 13 has no sm_60/sm_70) are said and left out
CUDA_CCS="60 70 75 80 86 90"

while [ $# -gt 0 ]; do
  case "$1" in
    --variant) variant=$2; shift 2 ;;
    --venv) venv=$2; shift 2 ;;
    --lock) lock=$2; shift 2 ;;
    --appliance) src=$2; shift 2 ;;
    --wheels) wheels=$2; shift 2 ;;
    --python) python=$2; shift 2 ;;
    --editable) editable=1; shift ;;
    --system-deps) system_deps=1; shift ;;
    --print-tag) print_tag=1; shift ;;
    -h|--help) sed -n '2,21p' "$0"; exit 0 ;;
    *) die "unknown argument $1 (see --help)" ;;
  esac
done
[ "$variant" = cpu ] || [ "$variant" = gpu ] || die "--variant must be cpu or gpu, not '$variant'"
if [ -z "$venv" ] || [ -z "$lock" ] || [ -z "$src" ]; then
  die "--venv, --lock and --appliance are required (see --help)"
fi
[ -f "$lock" ] || die "lock file $lock not found"
venv=$(realpath -m "$venv")  # absolute: the Horovod build runs in a directory of its own and reads paths under it
wheels=${wheels:-$venv/.wheels}
pin() { sed -n "s/^$1==//p" "$lock"; }
tf_version=$(pin tensorflow_cpu) hvd_version=$(pin horovod) uv_version=$(pin uv)
if [ -z "$tf_version" ] || [ -z "$hvd_version" ] || [ -z "$uv_version" ]; then
  die "$lock lacks the tensorflow_cpu, horovod or uv pin"
fi
# cmake >= 4 (CC-Ubuntu26.04) refuses Gloo's cmake_minimum_required of 2.8 without this; older cmake ignores it
export CMAKE_POLICY_VERSION_MINIMUM=3.5

# -- 0. system packages (image build and boot-time install; make install has its own list) ------------
# No apt NCCL: NVIDIA's repository serves CUDA 13 builds of libnccl2 now; Horovod links the NCCL wheel TensorFlow
# brings (step 3). python3-venv/-dev: the image's own Python (3.12 on Ubuntu 24.04; 3.10 on 22.04, where uv brings one).
if [ "$system_deps" = 1 ] && [ "$print_tag" = 0 ]; then
  pkgs="build-essential cmake g++ git python3-venv python3-dev openssh-client firewalld"
  say "system packages: $pkgs"
  export DEBIAN_FRONTEND=noninteractive
  apt-get update -qq
  # shellcheck disable=SC2086  # a word list on purpose
  apt-get install -y -qq $pkgs >/dev/null
fi

# -- 1. the venv, with a Python the pins support ----------------------------------------------------------
py_minor() {  # "3.11" or "3.12" for a final release of a supported Python that can make a venv with pip
  # (Debian and Ubuntu ship ensurepip apart, in pythonX.Y-venv); nothing otherwise
  "$1" -c 'import sys
v = sys.version_info
try:
    import ensurepip, venv
except ImportError:
    sys.exit()
if v.releaselevel == "final" and "%d.%d" % v[:2] in sys.argv[1].split(): print("%d.%d" % v[:2])' "$PYTHONS" \
    2>/dev/null || true
}
py_says() { "$1" -c 'import sys; print(sys.version.split()[0])' 2>/dev/null || echo "?"; }
fresh=""
find_python() {  # sets python (a path, or "managed") and pyver
  if [ -x "$venv/bin/python" ] && "$venv/bin/python" -c 'import pip' 2>/dev/null; then
    local asked=$python  # a re-run keeps the venv's Python (and so the wheel-cache key)
    python=$venv/bin/python pyver=$(py_minor "$venv/bin/python")
    [ -n "$pyver" ] || die "$venv has Python $(py_says "$venv/bin/python"), not one of $PYTHONS (fix: remove $venv)"
    if [ "$asked" != auto ] && [ "$(py_minor "$(command -v "$asked" || echo "$asked")")" != "$pyver" ]; then
      die "$venv has Python $pyver, not --python $asked's (fix: remove $venv, or --python auto)"
    fi
    return
  fi
  if [ -e "$venv/bin/python" ]; then  # an earlier run stopped while making it (no python3-venv, say)
    [ "$print_tag" = 1 ] || say "$venv has no working pip: it is made anew"
    fresh=--clear
  fi
  if [ "$python" != auto ]; then
    command -v "$python" >/dev/null || die "$python not found (fix: --python auto finds one)"
    python=$(command -v "$python") pyver=$(py_minor "$python")
    [ -n "$pyver" ] || die "$python is Python $(py_says "$python"); the pins need a $PYTHONS release (fix: --python auto)"
    return
  fi
  local c p
  for c in python3.11 python3.12 python3; do
    p=$(command -v "$c" 2>/dev/null) || continue
    pyver=$(py_minor "$p")
    if [ -n "$pyver" ]; then python=$p; return; fi
    [ "$print_tag" = 1 ] || say "python: $p is $(py_says "$p"): not a $PYTHONS release that makes venvs; not used"
  done
  python=managed pyver=$MANAGED_PYTHON
}
managed_python() {  # Python $MANAGED_PYTHON installed by uv (the lock's pin) beside the venv; prints its path
  local boot=${venv%/}.uv base
  if [ ! -x "$boot/bin/uv" ]; then
    base=$(command -v python3) || die "no python3 to run uv with (fix: apt-get install python3-venv)"
    "$base" -m venv "$boot" || die "$base -m venv failed (fix: apt-get install python3-venv)"
    "$boot/bin/python" -m pip --disable-pip-version-check install -q "uv==$uv_version" >&2 ||
      die "pip could not install uv==$uv_version into $boot (see above)"
  fi
  # --no-bin: no python3.11 link in ~/.local/bin; VIRTUAL_ENV unset: `find` would answer an active venv
  env -u VIRTUAL_ENV UV_PYTHON_INSTALL_DIR="${venv%/}.python" "$boot/bin/uv" python install -q --no-bin \
    "$MANAGED_PYTHON" >&2 || die "uv could not install Python $MANAGED_PYTHON (it downloads from GitHub; fix: let the" \
    "node reach github.com, or install a released Python 3.12 or 3.11 with its venv package)"
  env -u VIRTUAL_ENV UV_PYTHON_INSTALL_DIR="${venv%/}.python" "$boot/bin/uv" python find \
    --python-preference only-managed "$MANAGED_PYTHON"
}
find_python

# the wheel-cache key: what a built Horovod depends on (TF, variant, Python; on gpu the CUDA toolkit it was compiled
# with and the NCCL wheel it links)
tag="tf$tf_version-$variant-py$pyver"
# site-packages of the venv (a venv's layout on Linux), where the NCCL wheel and Horovod's mpi_lib land
site=$venv/lib/python$pyver/site-packages
build_env=(HOROVOD_WITH_TENSORFLOW=1 HOROVOD_WITHOUT_PYTORCH=1 HOROVOD_WITHOUT_MXNET=1
           HOROVOD_WITH_GLOO=1 HOROVOD_WITHOUT_MPI=1 "MAKEFLAGS=-j$(nproc)")
if [ "$variant" = gpu ]; then
  cuda=${CUDA_HOME:-/usr/local/cuda}
  cuda_version=$({ "$cuda/bin/nvcc" --version 2>/dev/null || true; } | sed -n 's/.*release \([0-9][0-9.]*\),.*/\1/p')
  [ -n "$cuda_version" ] || die "no CUDA toolkit at $cuda (fix: use a CC-Ubuntu*-CUDA image, or set CUDA_HOME)"
  nccl_version=$(sed -n 's/^# gpu: nvidia-nccl-cu12==//p' "$lock")
  [ -n "$nccl_version" ] || die "$lock has no '# gpu: nvidia-nccl-cu12==...' line"
  tag="$tag-cuda$cuda_version-nccl$nccl_version"
  # One NCCL in the process: TensorFlow's (the nvidia-nccl-cu12 wheel), linked shared (Horovod's FindNCCL.cmake
  # takes libnccl_static.a unless HOROVOD_NCCL_LINK=SHARED, and finds the library as libnccl.so, which the wheel
  # does not ship: a link to its libnccl.so.2 beside it). The RUNPATH reaches the wheel from
  # site-packages/horovod/tensorflow/mpi_lib*.so in any venv (CMake adds the build venv's own lib dir too).
  nccl=$site/nvidia/nccl
  can=$({ "$cuda/bin/nvcc" --list-gpu-arch 2>/dev/null || true; } | sed -n 's/^compute_//p' | tr '\n' ' ')
  ccs="" skipped=""
  for cc in $CUDA_CCS; do
    case " $can " in *" $cc "*) ccs="$ccs${ccs:+,}$cc" ;; *) skipped="$skipped sm_$cc" ;; esac
  done
  [ -n "$ccs" ] || die "CUDA $cuda_version at $cuda builds none of sm_${CUDA_CCS// /, sm_}"
  build_env+=(HOROVOD_GPU_OPERATIONS=NCCL "HOROVOD_CUDA_HOME=$cuda" "PATH=$cuda/bin:$PATH"
              "HOROVOD_NCCL_INCLUDE=$nccl/include" "HOROVOD_NCCL_LIB=$nccl/lib" HOROVOD_NCCL_LINK=SHARED
              "HOROVOD_BUILD_CUDA_CC_LIST=$ccs" "LDFLAGS=-Wl,-rpath,\$ORIGIN/../../nvidia/nccl/lib ${LDFLAGS:-}")
fi
if [ "$print_tag" = 1 ]; then  # the key and how Horovod would be built, nothing installed
  echo "APPLIANCE_STACK_TAG $tag python=$python"
  printf 'APPLIANCE_STACK_BUILD %s\n' "${build_env[@]}"
  [ -z "${skipped:-}" ] || echo "APPLIANCE_STACK_SKIPPED$skipped"
  exit 0
fi
[ "$python" = managed ] && { say "python: none of $PYTHONS here; uv installs $MANAGED_PYTHON"; python=$(managed_python); }
if [ ! -x "$venv/bin/python" ] || [ -n "$fresh" ]; then
  say "creating $venv (Python $(py_says "$python"), $python)"
  "$python" -m venv $fresh "$venv" || die "$python -m venv failed (fix: apt-get install python3-venv)"
fi
pip() { "$venv/bin/python" -m pip --disable-pip-version-check "$@"; }
pip install -q --upgrade pip setuptools wheel
pip install -q "uv==$uv_version"

# -- 2. the lock, exactly ------------------------------------------------------------------------------
reqs=$(mktemp)
trap 'rm -f "$reqs"' EXIT
if [ "$variant" = gpu ]; then
  grep -v -E '^(#|horovod==|tensorflow_cpu==)' "$lock" > "$reqs"
  sed -n 's/^# gpu: //p' "$lock" >> "$reqs"
  grep -q '^tensorflow==' "$reqs" || die "$lock has no '# gpu: tensorflow==...' line"
else
  grep -v -E '^(#|horovod==)' "$lock" > "$reqs"
fi
say "installing $(wc -l < "$reqs") locked packages ($variant)"
# --no-deps: exactly the lock (tf-keras would otherwise pull the full tensorflow wheel beside tensorflow-cpu);
# compiled to bytecode as pip does (the ranks run with PYTHONDONTWRITEBYTECODE and would compile at every start)
# pip's where-from settings in the environment apply to uv too (the local cloud's nodes: a wheelhouse, no index)
uv_from=()
[ -n "${PIP_INDEX_URL:-}" ] && uv_from+=(--index-url "$PIP_INDEX_URL")
[ -n "${PIP_FIND_LINKS:-}" ] && uv_from+=(--find-links "$PIP_FIND_LINKS")
case "${PIP_NO_INDEX:-}" in 1|true|yes) uv_from+=(--no-index) ;; esac
"$venv/bin/uv" pip install -q --no-deps --compile-bytecode --python "$venv/bin/python" "${uv_from[@]}" -r "$reqs"

# -- 3. Horovod, built against the installed TensorFlow (once per wheel-cache key) ------------------------------
purelib=$("$venv/bin/python" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')
[ "$(realpath -m "$site")" = "$(realpath -m "$purelib")" ] || die "$venv is not laid out as a venv on Linux ($purelib)"
mkdir -p "$wheels/$tag"
find_wheel() { find "$wheels/$tag" -maxdepth 1 -name "horovod-$hvd_version-*.whl" | head -n 1; }
wheel=$(find_wheel)
if [ -z "$wheel" ]; then
  say "building horovod $hvd_version against tensorflow $tf_version ($tag; ~5 min on 2 cores)"
  if [ "$variant" = gpu ]; then
    { [ -f "$nccl/include/nccl.h" ] && [ -f "$nccl/lib/libnccl.so.2" ]; } ||
      die "no NCCL wheel at $nccl (the lock's nvidia-nccl-cu12 line; fix: re-run, or check the lock's # gpu: lines)"
    ln -sf libnccl.so.2 "$nccl/lib/libnccl.so"
    [ -z "$skipped" ] || say "CUDA $cuda_version cannot build for$skipped: those GPUs cannot run this wheel"
    say "gpu: CUDA $cuda_version ($cuda), compute capabilities $ccs, NCCL $nccl_version from $nccl (shared)"
  fi
  env "${build_env[@]}" "$venv/bin/python" -m pip --disable-pip-version-check wheel -q --no-build-isolation \
    --no-deps --no-cache-dir -w "$wheels/$tag" "horovod==$hvd_version"
  wheel=$(find_wheel)
else
  say "horovod: using the wheel built before, $wheel"
fi
pip install -q --no-deps --force-reinstall "$wheel"

# -- 4. the appliance package ----------------------------------------------------------------------------
if [ "$editable" = 1 ]; then
  pip install -q --no-deps --no-build-isolation -e "$src"
else
  pip install -q --no-deps --no-build-isolation "$src"
fi

cp "$lock" "$venv/appliance-requirements.lock"  # what `appliance doctor` checks the versions against

# -- 5. check the build --------------------------------------------------------------------------------------
# What `horovodrun --check-build` reports, asked in one process: it asks each item in a process of its own, each
# importing TensorFlow (22 s here, against 4)
check=$(TF_CPP_MIN_LOG_LEVEL=2 "$venv/bin/python" -c '
import horovod, horovod.tensorflow as hvd
print("horovod", horovod.__version__)
for name, built in (("TensorFlow", True), ("Gloo", hvd.gloo_built()), ("NCCL", hvd.nccl_built()),
                    ("MPI", hvd.mpi_built())):
    print("[%s] %s" % ("X" if built else " ", name))' 2>"$venv/check-build.err") ||
  die "horovod.tensorflow does not load (see $venv/check-build.err)"
printf '%s\n' "$check" > "$venv/check-build.txt"
want="TensorFlow Gloo"
[ "$variant" = gpu ] && want="$want NCCL"
for w in $want; do
  grep -q "\[X\] $w" <<<"$check" || die "horovod was built without $w (see $venv/check-build.txt)"
done
if [ "$variant" = gpu ]; then  # one NCCL: the wheel's, shared, none compiled in; the compute capabilities inside
  "$venv/bin/python" -m appliance.node.linkage --expect gpu > "$venv/check-linkage.txt" 2>&1 ||
    die "Horovod's NCCL linkage is not TensorFlow's wheel, shared (see $venv/check-linkage.txt; fix: remove $wheels/$tag, re-run)"
  want="$want (NCCL linkage: $venv/check-linkage.txt)"
fi
say "ok: $venv has tensorflow $tf_version + horovod $hvd_version ($want)"
echo "APPLIANCE_STACK ok variant=$variant venv=$venv wheel=$wheel"
