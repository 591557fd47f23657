# Every version of the local control plane's tools, pinned in one place. The Makefile,
# scripts/ensure-*.sh and harness/tools/build.sh read this file; go.mod repeats the
# Kubernetes and etcd versions (build.sh refuses to build when the two disagree).
KUBERNETES_VERSION = v1.35.4
ETCD_VERSION = v3.6.16
HELM_VERSION = v3.22.0
NATS_SERVER_VERSION = v2.12.15
NATSCLI_VERSION = v0.3.0
