#!/usr/bin/env bash
# Build the local control plane's tools once per version into the cache:
#   ${XDG_CACHE_HOME:-~/.cache}/shoal/kube-<v>/{kube-apiserver,kube-controller-manager,
#                                                 kube-scheduler,kubectl}
#   .../etcd-<v>/etcd  .../helm-<v>/helm  .../natscli-<v>/nats
# Versions: versions.mk beside this script (the one place they are pinned). A second run
# builds nothing. Prints the cache directories on stdout, progress on stderr.
set -euo pipefail
here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
cache="${XDG_CACHE_HOME:-$HOME/.cache}/shoal"

version() { sed -n "s/^$1[[:space:]]*[:?]*=[[:space:]]*//p" "$here/versions.mk" | tr -d '[:space:]'; }
KUBE="$(version KUBERNETES_VERSION)"; ETCD="$(version ETCD_VERSION)"
HELM="$(version HELM_VERSION)"; NATSCLI="$(version NATSCLI_VERSION)"

go_bin="${GO:-$(command -v go || true)}"
[[ -z "$go_bin" && -x /usr/local/go/bin/go ]] && go_bin=/usr/local/go/bin/go
if [[ -z "$go_bin" ]]; then
    echo "build: Go is missing: install Go >= 1.25 (https://go.dev/dl or Debian's golang-go) and re-run" >&2
    exit 1
fi

# go.mod must pin the same Kubernetes and etcd as versions.mk.
grep -q "k8s.io/kubernetes $KUBE" "$here/go.mod" \
    || { echo "build: harness/tools/go.mod does not require k8s.io/kubernetes $KUBE (versions.mk)" >&2; exit 1; }
grep -q "go.etcd.io/etcd/server/v3 $ETCD" "$here/go.mod" \
    || { echo "build: harness/tools/go.mod does not require go.etcd.io/etcd/server/v3 $ETCD" >&2; exit 1; }

mkdir -p "$cache"
exec 9>"$cache/.tools.lock"
flock 9

build() {  # build <dest dir> <binary names...> -- <go command...>
    local dest="$1"; shift
    local names=()
    while [[ "$1" != "--" ]]; do names+=("$1"); shift; done
    shift
    local missing=0
    for n in "${names[@]}"; do [[ -x "$dest/$n" ]] || missing=1; done
    if [[ $missing -eq 0 ]]; then echo "$dest"; return; fi
    echo "build: building ${names[*]} into $dest (once per machine) ..." >&2
    local start=$SECONDS tmp="$dest.partial"
    rm -rf "$tmp"; mkdir -p "$tmp"
    if ! (cd "$here" && CGO_ENABLED=0 GOBIN="$tmp" "$@" >&2); then
        echo "build: building ${names[*]} failed (see above)" >&2
        rm -rf "$tmp"; exit 1
    fi
    # One binary at a time into place, so that a directory that already holds others
    # (kube-scheduler joined kube-<v> later) keeps them and never shows a partial file.
    mkdir -p "$dest"
    for n in "${names[@]}"; do mv -f "$tmp/$n" "$dest/$n"; done
    rm -rf "$tmp"
    echo "build: built ${names[*]} in $((SECONDS - start)) s" >&2
    echo "$dest"
}

# The version the official build stamps in (hack/lib/version.sh); without it the
# binaries say v0.0.0-master, which kubectl cannot parse and Helm's kubeVersion rejects.
minor="$(echo "$KUBE" | cut -d. -f2)"
ldflags=""
for pkg in k8s.io/component-base/version k8s.io/client-go/pkg/version; do
    ldflags="$ldflags -X $pkg.gitVersion=$KUBE -X $pkg.gitMajor=1 -X $pkg.gitMinor=$minor"
    ldflags="$ldflags -X $pkg.gitTreeState=clean"
done
kube="$cache/kube-$KUBE"
build "$kube" kube-apiserver kube-controller-manager kubectl -- \
    sh -c "\"$go_bin\" build -ldflags \"$ldflags\" -o \"\$GOBIN/\" k8s.io/kubernetes/cmd/kube-apiserver k8s.io/kubernetes/cmd/kube-controller-manager k8s.io/kubernetes/cmd/kubectl"
# Its own step, so that a machine that built the three above before the scheduler joined
# builds only the scheduler (from the same module, with Go's build cache).
build "$kube" kube-scheduler -- \
    sh -c "\"$go_bin\" build -ldflags \"$ldflags\" -o \"\$GOBIN/\" k8s.io/kubernetes/cmd/kube-scheduler"
build "$cache/etcd-$ETCD" etcd -- sh -c "\"$go_bin\" build -o \"\$GOBIN/etcd\" ./etcd"
build "$cache/helm-$HELM" helm -- "$go_bin" install "helm.sh/helm/v3/cmd/helm@$HELM"
grep -q "github.com/nats-io/natscli $NATSCLI" "$here/natscli/go.mod" \
    || { echo "build: harness/tools/natscli/go.mod does not require natscli $NATSCLI" >&2; exit 1; }
build "$cache/natscli-$NATSCLI" nats -- \
    sh -c "cd natscli && \"$go_bin\" build -o \"\$GOBIN/nats\" github.com/nats-io/natscli/nats"
