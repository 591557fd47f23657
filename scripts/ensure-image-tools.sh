#!/usr/bin/env bash
# Make sure buildah and debootstrap are available (Debian's packages), for `make image`.
# No Docker engine is needed: buildah builds with --isolation chroot, and debootstrap
# assembles the bookworm base from Debian's packages (no registry to pull from).
set -euo pipefail

missing=()
for tool in buildah debootstrap; do
    command -v "$tool" >/dev/null || missing+=("$tool")
done
if [[ ${#missing[@]} -eq 0 ]]; then
    exit 0
fi

source "$(dirname "${BASH_SOURCE[0]}")/apt-install.sh"
apt_install ensure-image-tools --no-install-recommends "${missing[@]}"
