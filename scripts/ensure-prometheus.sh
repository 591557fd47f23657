#!/usr/bin/env bash
# Make sure Prometheus and promtool are available and print the absolute path of promtool
# on the last line of stdout (everything else goes to stderr; prometheus sits beside it).
# Uses them from PATH if there, otherwise installs Debian's prometheus package (bookworm:
# 2.42), which has both.
#
# Installing the package may start a system Prometheus on :9090 (where an init system runs
# services). Shoal's tests never use it: they start their own on a free loopback port
# with their own data directory.
set -euo pipefail

found() {
    local promtool prometheus
    promtool="$(command -v promtool || true)"
    prometheus="$(command -v prometheus || true)"
    [[ -n "$promtool" && -x "$promtool" && -n "$prometheus" && -x "$prometheus" ]] || return 1
    echo "$promtool"
}

if found; then
    exit 0
fi

source "$(dirname "${BASH_SOURCE[0]}")/apt-install.sh"
# --no-install-recommends: the exporters and the web console it recommends are not needed.
apt_install ensure-prometheus --no-install-recommends prometheus

if ! found; then
    echo "ensure-prometheus: prometheus installed but no promtool in PATH" >&2
    exit 1
fi
