#!/usr/bin/env bash
# Build the Shoal image (Dockerfile) with buildah, no Docker engine: `make image`.
#
#   scripts/build-image.sh [TAG]      default shoal:dev; prints the tag on the last line
#
# No registry is reachable, so the base is assembled from Debian's packages: debootstrap
# bookworm (python3 3.11, python3-venv), committed once as localhost/shoal-base:bookworm
# and passed to the Dockerfile as PYTHON_IMAGE (whose default stays python:3.11-slim for
# everyone with a registry). buildah runs with --isolation chroot (no OCI runtime or
# cgroups needed) and CONTAINERS_CONF=scripts/containers.conf (see there).
# Needs root (debootstrap, buildah's storage) and buildah + debootstrap
# (scripts/ensure-image-tools.sh installs them).
set -euo pipefail

here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
repo="$(dirname "$here")"
tag="${1:-shoal:dev}"
base="${SHOAL_IMAGE_BASE:-localhost/shoal-base:bookworm}"
mirror="${DEBIAN_MIRROR:-http://deb.debian.org/debian}"
export CONTAINERS_CONF="$here/containers.conf"

bash "$here/ensure-image-tools.sh"

if ! buildah inspect --type image "$base" >/dev/null 2>&1; then
    started=$SECONDS
    rootfs="$(mktemp -d /var/tmp/shoal-rootfs.XXXXXX)"
    ctr=""
    cleanup() {
        [[ -n "$ctr" ]] && buildah rm "$ctr" >/dev/null 2>&1 || true
        rm -rf "$rootfs"
    }
    trap cleanup EXIT
    echo "build-image: debootstrap bookworm into $rootfs ..." >&2
    debootstrap --variant=minbase --include=python3,python3-venv,ca-certificates \
        bookworm "$rootfs" "$mirror" >&2
    # A base without package-manager caches (the downloaded .debs, the package lists) and
    # without documentation and translations nobody reads in a container (as Debian's
    # slim images leave them out).
    rm -rf "$rootfs"/var/cache/apt/archives/*.deb "$rootfs"/var/lib/apt/lists/* \
        "$rootfs"/var/cache/debconf/*-old "$rootfs"/var/log/* \
        "$rootfs"/usr/share/doc/* "$rootfs"/usr/share/man/* "$rootfs"/usr/share/info/* \
        "$rootfs"/usr/share/locale/*
    ctr="$(buildah from scratch)"
    mnt="$(buildah mount "$ctr")"
    cp -a "$rootfs"/. "$mnt"/
    buildah umount "$ctr" >/dev/null
    buildah config --env LANG=C.UTF-8 --cmd /bin/bash "$ctr"
    buildah commit --quiet "$ctr" "$base" >/dev/null
    echo "build-image: base $base ready in $((SECONDS - started)) s" >&2
    cleanup
    trap - EXIT
fi

# pip reaches PyPI through whatever this machine trusts: behind a TLS-inspecting proxy
# that is a CA bundle of its own, handed to the build as a secret (never stored).
secret=()
ca="${PIP_CERT:-${SSL_CERT_FILE:-}}"
if [[ -n "$ca" && -s "$ca" ]]; then
    secret=(--secret "id=pip-ca,src=$ca")
fi

started=$SECONDS
# --layers: an unchanged step (the base, the dependencies) is reused on the next build;
# --force-rm: a failed step leaves no working container behind.
buildah bud --isolation chroot --layers --force-rm "${secret[@]}" \
    --build-arg "PYTHON_IMAGE=$base" \
    -t "$tag" -f "$repo/Dockerfile" "$repo" >&2
echo "build-image: $tag built in $((SECONDS - started)) s" >&2
echo "$tag"
