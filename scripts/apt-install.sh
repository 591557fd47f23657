# Sourced by the scripts/ensure-*.sh scripts: install Debian packages as root (or through
# passwordless sudo), for what the project needs on a fresh machine.
#
#   apt_install <who> [apt-get install options...] <package>...
#
# <who> prefixes the messages (e.g. ensure-etcd). The package lists of a fresh machine may
# be missing or stale: `apt-get update` runs only when the first install attempt fails.

apt_install() {
    local who="$1"
    shift
    local sudo=()
    if [[ $EUID -ne 0 ]]; then
        if command -v sudo >/dev/null && sudo -n true 2>/dev/null; then
            sudo=(sudo -n)
        else
            echo "$who: run 'apt-get install $*' as root" >&2
            return 1
        fi
    fi
    echo "$who: installing $* ..." >&2
    DEBIAN_FRONTEND=noninteractive "${sudo[@]}" apt-get install -y -q "$@" >&2 \
        || { DEBIAN_FRONTEND=noninteractive "${sudo[@]}" apt-get update -q >&2 \
            && DEBIAN_FRONTEND=noninteractive "${sudo[@]}" apt-get install -y -q "$@" >&2; }
}
