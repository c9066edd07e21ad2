#!/usr/bin/env bash
# The appliance's training stack, installed by ONE set of steps used three ways:
#   - `make install` here and in CI:               --variant cpu --venv .venv --editable
#   - the image build (DIB element appliance-stack): --variant gpu --venv /opt/appliance/venv
#   - the boot-time installer (`appliance up --install`) on a stock CC-Ubuntu CUDA node: --variant gpu
#
# Steps: (1) a venv with the wanted Python; (2) every package of the lock, exactly, with --no-deps
# (the gpu variant swaps tensorflow-cpu for the lock's `# gpu:` lines: the GPU TensorFlow and the CUDA,
# cuDNN and NCCL wheels it was built against), installed by uv (pinned in the lock: the same wheels as pip,
# unpacked in parallel; it reads UV_INDEX_URL, not pip.conf); (3) Horovod built from source against that
# TensorFlow (Gloo always, NCCL on gpu), or a wheel already built for the same TF/variant/Python taken from
# --wheels; (4) the appliance package; (5) the build check: Horovod's TensorFlow extension loads and was built
# with Gloo (and NCCL on gpu). Idempotent: a step whose result is there already is skipped.
#
# Usage: install-stack.sh --variant cpu|gpu --venv DIR --lock FILE --appliance SRC
#                         [--wheels DIR] [--python PY] [--editable] [--system-deps]
set -euo pipefail

variant=cpu venv="" lock="" src="" wheels="" python=python3.11 editable=0 system_deps=0
say() { printf 'install-stack: %s\n' "$*"; }
die() { printf 'install-stack: error: %s\n' "$*" >&2; exit 1; }

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
    -h|--help) sed -n '2,17p' "$0"; exit 0 ;;
    *) die "unknown argument $1 (see --help)" ;;
  esac
done
[ "$variant" = cpu ] || [ "$variant" = gpu ] || die "--variant must be cpu or gpu, not '$variant'"
if [ -z "$venv" ] || [ -z "$lock" ] || [ -z "$src" ]; then
  die "--venv, --lock and --appliance are required (see --help)"
fi
[ -f "$lock" ] || die "lock file $lock not found"
wheels=${wheels:-$venv/.wheels}

# -- 0. system packages (image build and boot-time install; make install has its own list) ------------
if [ "$system_deps" = 1 ]; then
  pkgs="build-essential cmake g++ git python3.11 python3.11-venv python3.11-dev openssh-client firewalld"
  [ "$variant" = gpu ] && pkgs="$pkgs libnccl2 libnccl-dev"  # from the CUDA apt repo the CC CUDA images have
  say "system packages: $pkgs"
  export DEBIAN_FRONTEND=noninteractive
  apt-get update -qq
  # shellcheck disable=SC2086  # a word list on purpose
  apt-get install -y -qq $pkgs >/dev/null
fi

# -- 1. the venv ------------------------------------------------------------------------------------
command -v "$python" >/dev/null || die "$python not found (fix: apt-get install python3.11-venv, or --python PY)"
pyver=$("$python" -c 'import sys; print("%d.%d" % sys.version_info[:2])')
[ "$pyver" = 3.11 ] || die "$python is Python $pyver; TensorFlow 2.18 + Horovod 0.28.1 are pinned for 3.11"
if [ ! -x "$venv/bin/python" ]; then
  say "creating $venv"
  "$python" -m venv "$venv"
fi
pip() { "$venv/bin/python" -m pip --disable-pip-version-check "$@"; }
pip install -q --upgrade pip setuptools wheel
uv_version=$(sed -n 's/^uv==//p' "$lock")
[ -n "$uv_version" ] || die "$lock lacks the uv pin"
pip install -q "uv==$uv_version"

# -- 2. the lock, exactly ------------------------------------------------------------------------------
tf_version=$(sed -n 's/^tensorflow_cpu==//p' "$lock")
hvd_version=$(sed -n 's/^horovod==//p' "$lock")
if [ -z "$tf_version" ] || [ -z "$hvd_version" ]; then die "$lock lacks the tensorflow_cpu or horovod pin"; fi
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

# -- 3. Horovod, built against the installed TensorFlow (once per TF version, variant and Python) ------------
tag="tf$tf_version-$variant-py$pyver"
mkdir -p "$wheels/$tag"
find_wheel() { find "$wheels/$tag" -maxdepth 1 -name "horovod-$hvd_version-*.whl" | head -n 1; }
wheel=$(find_wheel)
if [ -z "$wheel" ]; then
  say "building horovod $hvd_version against tensorflow $tf_version ($variant; ~5 min on 2 cores)"
  build_env=(HOROVOD_WITH_TENSORFLOW=1 HOROVOD_WITHOUT_PYTORCH=1 HOROVOD_WITHOUT_MXNET=1
             HOROVOD_WITH_GLOO=1 HOROVOD_WITHOUT_MPI=1 "MAKEFLAGS=-j$(nproc)")
  if [ "$variant" = gpu ]; then
    cuda=${CUDA_HOME:-/usr/local/cuda}
    [ -x "$cuda/bin/nvcc" ] || die "no CUDA toolkit at $cuda (fix: use a CC-Ubuntu*-CUDA image, or set CUDA_HOME)"
    build_env+=(HOROVOD_GPU_OPERATIONS=NCCL "HOROVOD_CUDA_HOME=$cuda" "PATH=$cuda/bin:$PATH")
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
say "ok: $venv has tensorflow $tf_version + horovod $hvd_version ($want)"
echo "APPLIANCE_STACK ok variant=$variant venv=$venv wheel=$wheel"
