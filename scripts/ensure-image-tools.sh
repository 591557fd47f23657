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

sudo=()
if [[ $EUID -ne 0 ]]; then
    if command -v sudo >/dev/null && sudo -n true 2>/dev/null; then
        sudo=(sudo -n)
    else
        echo "ensure-image-tools: run 'apt-get install ${missing[*]}' as root" >&2
        exit 1
    fi
fi

export DEBIAN_FRONTEND=noninteractive
echo "ensure-image-tools: installing ${missing[*]} ..." >&2
"${sudo[@]}" apt-get install -y -q --no-install-recommends "${missing[@]}" >&2 \
    || { "${sudo[@]}" apt-get update -q >&2 \
        && "${sudo[@]}" apt-get install -y -q --no-install-recommends "${missing[@]}" >&2; }
