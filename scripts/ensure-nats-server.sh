#!/usr/bin/env bash
# Make sure a nats-server binary is available and print its absolute path on the last
# line of stdout (everything else goes to stderr).
#
#   scripts/ensure-nats-server.sh [VERSION]
#
# VERSION defaults to NATS_SERVER_VERSION from harness/tools/versions.mk, where every tool
# version is pinned.
# The binary is built once with `go install` into
#   ${XDG_CACHE_HOME:-$HOME/.cache}/shoal/nats-server-<VERSION>/nats-server
# (outside the repo, shared by every clone); later runs reuse it and build nothing.
# Without Go, or if the build fails, falls back to Debian's nats-server package (2.9).
set -euo pipefail

repo_root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
version="${1:-}"
if [[ -z "$version" ]]; then
    version="$(sed -n 's/^NATS_SERVER_VERSION[[:space:]]*[:?]*=[[:space:]]*//p' \
        "$repo_root/harness/tools/versions.mk" | head -n1 | tr -d '[:space:]')"
fi
if [[ -z "$version" ]]; then
    echo "ensure-nats-server: no version given and none in harness/tools/versions.mk" >&2
    exit 2
fi

cache_root="${XDG_CACHE_HOME:-$HOME/.cache}/shoal"
dest_dir="$cache_root/nats-server-$version"
bin="$dest_dir/nats-server"

# True if $1 is a working nats-server of exactly $version ("nats-server: v2.12.15").
is_wanted() {
    [[ -x "$1" ]] && [[ "$("$1" --version 2>/dev/null)" == "nats-server: $version" ]]
}

if is_wanted "$bin"; then
    echo "$bin"
    exit 0
fi

mkdir -p "$cache_root"
# One build at a time per machine: a second caller waits, then finds the binary.
exec 9>"$cache_root/.nats-server-$version.lock"
flock 9
if is_wanted "$bin"; then
    echo "$bin"
    exit 0
fi

# $GO overrides the toolchain (GO=none: pretend there is none, e.g. to test the fallback).
if [[ -n "${GO:-}" ]]; then
    go_bin="$(command -v "$GO" || true)"
else
    go_bin="$(command -v go || true)"
    if [[ -z "$go_bin" && -x /usr/local/go/bin/go ]]; then
        go_bin=/usr/local/go/bin/go
    fi
fi

if [[ -n "$go_bin" ]]; then
    echo "ensure-nats-server: building nats-server $version with $("$go_bin" version)" \
        "into $dest_dir (once per machine) ..." >&2
    start=$SECONDS
    mkdir -p "$dest_dir"
    rm -f "$bin"
    # CGO is not needed by nats-server; disabling it means no C toolchain is required.
    if CGO_ENABLED=0 GOBIN="$dest_dir" \
        "$go_bin" install "github.com/nats-io/nats-server/v2@$version" >&2 \
        && is_wanted "$bin"; then
        echo "ensure-nats-server: built nats-server $version in $((SECONDS - start)) s" >&2
        echo "$bin"
        exit 0
    fi
    echo "ensure-nats-server: the Go build of nats-server $version failed" >&2
fi

# Fallback: Debian's package (bookworm has 2.9.10: older, but JetStream works).
apt_install() {
    local sudo=()
    if [[ $EUID -ne 0 ]]; then
        if command -v sudo >/dev/null && sudo -n true 2>/dev/null; then
            sudo=(sudo -n)
        else
            return 1
        fi
    fi
    export DEBIAN_FRONTEND=noninteractive
    "${sudo[@]}" apt-get install -y -q "$@" >&2 \
        || { "${sudo[@]}" apt-get update -q >&2 && "${sudo[@]}" apt-get install -y -q "$@" >&2; }
}

# The package installs /usr/sbin/nats-server (not in a normal user's PATH).
debian_bin=/usr/sbin/nats-server
if [[ ! -x "$debian_bin" ]]; then
    apt_install nats-server || true
fi
if [[ -x "$debian_bin" ]]; then
    echo "ensure-nats-server: no Go toolchain or build failed: falling back to Debian's" \
        "$("$debian_bin" --version 2>/dev/null || echo nats-server) (wanted $version)" >&2
    echo "$debian_bin"
    exit 0
fi

echo "ensure-nats-server: cannot get nats-server: install Go (https://go.dev/dl/) or" \
    "run 'apt-get install nats-server' as root" >&2
exit 1
