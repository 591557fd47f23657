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

source "$(dirname "${BASH_SOURCE[0]}")/apt-install.sh"
apt_install ensure-etcd etcd-server

if ! found; then
    echo "ensure-etcd: etcd-server installed but no etcd binary in PATH" >&2
    exit 1
fi
