#!/usr/bin/env bash
# make image: build the appliance image with diskimage-builder, layered on Chameleon's CC-Ubuntu24.04-CUDA.
#
#   CC_IMAGES=/path/to/CC-Images images/build.sh [OUTPUT]      (default OUTPUT: build/appliance-gpu)
#
# Needs: root, diskimage-builder (`pip install diskimage-builder`), qemu-utils, debootstrap, kpartx, a loop
# device, ~30 GB free, and a checkout of ChameleonCloud/CC-Images (its elements build CC-Ubuntu24.04-CUDA:
# cc-ubuntu24.04-cuda). Our element, images/elements/appliance-stack, runs images/install-stack.sh --variant gpu
# inside the image: the same steps as `make install` (cpu) and `appliance up --install` (boot time).
# Then: appliance image upload build/appliance-gpu.qcow2 --name appliance-gpu --site CHI@UC (per site).
set -euo pipefail
here=$(cd "$(dirname "$0")" && pwd)
root=$(dirname "$here")
out=${1:-$root/build/appliance-gpu}
variant=${DIB_APPLIANCE_VARIANT:-gpu}

die() { printf 'make image: error: %s\n' "$*" >&2; exit 1; }
command -v disk-image-create >/dev/null ||
  die "diskimage-builder is not installed (fix: pip install diskimage-builder; apt-get install qemu-utils debootstrap kpartx)"
[ "$(id -u)" = 0 ] || die "diskimage-builder needs root (it mounts the image)"
command -v qemu-img >/dev/null || die "qemu-img missing (fix: apt-get install qemu-utils)"
[ -d "${CC_IMAGES:-/nonexistent}/elements/cc-ubuntu24.04-cuda" ] ||
  die "set CC_IMAGES to a checkout of ChameleonCloud/CC-Images (its elements build the CC-Ubuntu24.04-CUDA base)"
losetup -f >/dev/null 2>&1 || die "no free loop device (containers usually have none: build on a VM or a Chameleon node)"

mkdir -p "$(dirname "$out")"
export ELEMENTS_PATH="$here/elements:$CC_IMAGES/elements${ELEMENTS_PATH:+:$ELEMENTS_PATH}"
export DIB_RELEASE=jammy DIB_APPLIANCE_SRC="$root" DIB_APPLIANCE_VARIANT="$variant"
echo "building $out.qcow2: cc-ubuntu24.04-cuda + appliance-stack ($variant); ~40 min"
disk-image-create -a amd64 -t qcow2 -o "$out" cc-ubuntu24.04-cuda appliance-stack
echo "built $out.qcow2; upload it per site: appliance image upload $out.qcow2 --name appliance-$variant --site CHI@UC"
