#!/usr/bin/env bash
# Make sure an etcd binary is available and print its absolute path on the last line of
# stdout (everything else goes to stderr). Uses etcd from PATH if there is one, otherwise
# installs Debian's etcd-server package (bookworm: 3.4.x).
#
# Installing the package may start a system etcd on 127.0.0.1:2379 (where an init system
# runs services). Shoal's tests never use it: harness.servers starts its own etcd on free
# ports with its own data directory.
set -euo pipefail

found() {
    local path
    path="$(command -v etcd || true)"
    [[ -n "$path" && -x "$path" ]] || return 1
    echo "$path"
}

if found; then
    exit 0
fi

sudo=()
if [[ $EUID -ne 0 ]]; then
    if command -v sudo >/dev/null && sudo -n true 2>/dev/null; then
        sudo=(sudo -n)
    else
        echo "ensure-etcd: etcd not found; run 'apt-get install etcd-server' as root" >&2
        exit 1
    fi
fi

export DEBIAN_FRONTEND=noninteractive
echo "ensure-etcd: installing Debian's etcd-server package ..." >&2
# The package lists of a fresh machine may be missing or stale: update only if needed.
"${sudo[@]}" apt-get install -y -q etcd-server >&2 \
    || { "${sudo[@]}" apt-get update -q >&2 && "${sudo[@]}" apt-get install -y -q etcd-server >&2; }

if ! found; then
    echo "ensure-etcd: etcd-server installed but no etcd binary in PATH" >&2
    exit 1
fi
