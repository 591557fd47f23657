# Shoal: build, test, demo and benchmark entry points.
#
#   make test       lint + typecheck + every pytest test (unit and e2e; starts real servers)
#   make test-fast  unit tests only (pytest -m "not e2e and not spark and not image")
#   make image      build the image with buildah (scripts/build-image.sh) and test it, also
#                   as the local plane's kubelet runs it (SHOAL_KUBELET_IMAGE=shoal:dev
#                   make cluster-up / make demo: pods from the image, not the venv)
#   make lint       ruff check + ruff format --check
#   make typecheck  mypy --strict on the shoal packages, the harness and the tests (tests/,
#                   e2e/, faults/, bench/)
#   make faults     the fault suite (faults/): one fault per scenario on a real group under
#                   load; one JSON line of figures per scenario in .tmp/faults/<time>.jsonl
#   make soak       long runs, not in CI (faults/soak/, marker soak): a group of 3 under a
#                   varying load for SOAK_MINUTES (default 30) with a member restart, a leader
#                   kill and a 2-minute NATS outage; an idle group with a 1 s doze sweep for
#                   SOAK_IDLE_MINUTES (20); NATS down 330 s with one member, 240 s with three
#                   (SOAK_NATS_DOWN_ONE_S, SOAK_NATS_DOWN_THREE_S). RSS and ledger audits;
#                   figures in .tmp/soak/<time>.jsonl. About SOAK_MINUTES + 32 minutes.
#   make bench      run every bench/*.py; JSON lines go to bench/results/<time>/<name>.jsonl
#   make demo       python -m harness.kubedemo: the local control plane, helm, a ConsumerGroup
#   make demo-local python -m harness.demo against real servers (DEMO_ARGS=... to pass options)
#   make servers    only make sure nats-server, etcd and promtool are available; print their paths
#   make venv       (implied by the others) .venv with `pip install -e '.[test,analytics]'`
#   make clean      remove .venv, .tmp, caches and build metadata (keeps bench/results)
#
# Nothing needs installing by hand: Python packages come from PyPI, nats-server is built
# once per machine with Go into $(SHOAL_CACHE) (Debian's 2.9 package if Go is missing),
# etcd comes from Debian's etcd-server package. Set SHOAL_NATS_SERVER / SHOAL_ETCD to use
# other binaries.

# Every tool version (nats-server, Kubernetes, etcd, helm, the nats CLI) is pinned in
# one place: harness/tools/versions.mk.
include harness/tools/versions.mk

SHELL := bash
.SHELLFLAGS := -euo pipefail -c
.DEFAULT_GOAL := test
.DELETE_ON_ERROR:

PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
PYM := $(PY) -m
STAMP := $(VENV)/.shoal-installed
PYTEST_ARGS ?=
DEMO_ARGS ?=

# Runs before recipes that need the servers: makes sure the binaries exist (building
# nats-server on first use; Debian's etcd-server and prometheus packages) and exports their
# paths for harness/src/harness/servers.py and the promtool / Prometheus tests.
define servers_env
nats="$${SHOAL_NATS_SERVER:-$$(bash scripts/ensure-nats-server.sh $(NATS_SERVER_VERSION) | tail -n1)}"; \
etcd="$${SHOAL_ETCD:-$$(bash scripts/ensure-etcd.sh | tail -n1)}"; \
promtool="$${SHOAL_PROMTOOL:-$$(bash scripts/ensure-prometheus.sh | tail -n1)}"; \
echo "nats-server: $$nats ($$("$$nats" --version 2>&1 | head -n1))"; \
echo "etcd: $$etcd ($$("$$etcd" --version 2>&1 | head -n1))"; \
echo "promtool: $$promtool ($$("$$promtool" --version 2>&1 | head -n1))"; \
export SHOAL_NATS_SERVER="$$nats" SHOAL_ETCD="$$etcd" SHOAL_PROMTOOL="$$promtool";
endef

.PHONY: venv bytecode test test-fast e2e-nodes faults soak lint typecheck bench demo demo-local servers clean tools cluster-up cluster-down image

venv: $(STAMP)

# Re-runs only when pyproject.toml changes (or the venv is gone). The editable install is
# a .pth of the source folders (pyproject.toml: dev-mode-dirs), so edits apply at once and
# `python -m shoal.consumer` works from anywhere, the repo root included.
$(STAMP): pyproject.toml
	@start=$$SECONDS; \
	$(PYTHON) -m venv $(VENV); \
	$(PYM) pip install --quiet --upgrade pip; \
	$(PYM) pip install --quiet -e '.[test,analytics]'; \
	(cd / && $(CURDIR)/$(PY) -c "import shoal.consumer.partitioning, shoal.contracts.events, harness") \
	  || { echo "venv: the editable install cannot import shoal.consumer / harness" >&2; exit 1; }; \
	touch $@; \
	echo "venv: ready in $$((SECONDS - start)) s"

servers:
	@$(servers_env)

# Our own sources' bytecode, written once before the suites: where PYTHONDONTWRITEBYTECODE
# is set (it is on the CI machine) every process a test starts (members, operators,
# kubelets) would otherwise compile shoal's modules again, 0.1-0.3 s of CPU each on two
# cores. Python checks each .pyc against its source, so edits still apply.
bytecode: venv
	@$(PYM) compileall -q common/src consumer/src operator/src analytics/src harness/src

lint: venv
	$(PYM) ruff check .
	$(PYM) ruff format --check .
	$(PY) scripts/check_imports.py

# The source folders and the files to check are in pyproject.toml ([tool.mypy]).
typecheck: venv
	$(PYM) mypy

# Everything but the image build, which has its own target (root, minutes of CPU).
test: lint typecheck tools bytecode
	@$(servers_env) \
	$(PYM) pytest -m "not image" $(PYTEST_ARGS)

# The image, built with buildah on a debootstrapped bookworm base (scripts/build-image.sh),
# then checked: both commands as the non-root user, no build leftovers, its size; and a
# ConsumerGroup on the local plane whose pods the kubelet runs from it (the plane needs
# the tools and servers).
image: venv bytecode tools
	@$(servers_env) \
	$(PYM) pytest -m image -s $(PYTEST_ARGS)

# kube-apiserver, kube-controller-manager, kube-scheduler, kubectl, etcd 3.6, helm and the
# nats CLI, built with Go once per machine into ~/.cache/shoal (the first build takes a
# while and says how long; later runs build nothing).
tools:
	@harness/tools/build.sh >/dev/null

# The local Kubernetes control plane (no containers): see harness/src/harness/localkube/plane.py.
# NODES=3: three nodes (process kubelets) in zones zone-a, zone-b, zone-c.
NODES ?= 1
cluster-up: venv tools
	@$(servers_env) \
	$(PYM) harness.localkube up --root .localkube --nodes $(NODES)

cluster-down: venv
	@$(PYM) harness.localkube down --root .localkube

# The 3-node plane's tests alone (they are in `make test` too), with their figures
# (drain: members unavailable at once, partition gaps; a lost node: time to move its
# partitions; the audits): about 4 minutes on two cores.
e2e-nodes: venv bytecode tools
	@$(servers_env) \
	$(PYM) pytest -s e2e/test_localkube_nodes.py e2e/test_group_on_nodes.py $(PYTEST_ARGS)

test-fast: venv bytecode
	$(PYM) pytest -m "not e2e and not spark and not image" $(PYTEST_ARGS)

# One scenario at a time (they kill and freeze servers, and time their recovery).
# FAULTS_RESULTS=file to choose where the figures go.
faults: venv bytecode
	@$(servers_env) \
	start=$$SECONDS; results="$${FAULTS_RESULTS:-.tmp/faults/$$(date -u +%Y%m%dT%H%M%SZ).jsonl}"; \
	mkdir -p "$$(dirname "$$results")"; status=0; \
	SHOAL_FAULTS_RESULTS="$$results" $(PYM) pytest faults -m faults $(PYTEST_ARGS) || status=$$?; \
	echo "faults: $$((SECONDS - start)) s; figures ($$results):"; \
	cat "$$results" 2>/dev/null || true; \
	exit $$status

# Not in CI. PYTEST_ARGS='-k varying' for the loaded soak alone; SOAK_MINUTES=3 for a
# short one.
SOAK_MINUTES ?= 30
soak: venv bytecode
	@$(servers_env) \
	start=$$SECONDS; results="$${SOAK_RESULTS:-.tmp/soak/$$(date -u +%Y%m%dT%H%M%SZ).jsonl}"; \
	mkdir -p "$$(dirname "$$results")"; status=0; \
	SOAK_MINUTES=$(SOAK_MINUTES) SHOAL_FAULTS_RESULTS="$$results" \
	  $(PYM) pytest faults/soak -m soak $(PYTEST_ARGS) || status=$$?; \
	echo "soak: $$((SECONDS - start)) s; figures ($$results):"; \
	cat "$$results" 2>/dev/null || true; \
	exit $$status

# The real thing: the local plane (left up), helm install, the example group, scaling.
demo: venv bytecode tools
	@$(servers_env) \
	$(PYM) harness.kubedemo $(DEMO_ARGS)

# The consumer runtime alone: real etcd and nats-server, consumer processes, no Kubernetes.
demo-local: venv bytecode
	@$(servers_env) \
	$(PYM) harness.demo $(DEMO_ARGS)

bench: venv bytecode
	@$(servers_env) \
	shopt -s nullglob; \
	out="bench/results/$$(date -u +%Y%m%dT%H%M%SZ)"; mkdir -p "$$out"; failed=0; \
	for script in bench/*.py; do \
	  name="$$(basename "$$script" .py)"; \
	  case "$$name" in __init__|_*) continue;; esac; \
	  echo "bench: $$script -> $$out/$$name.jsonl"; \
	  $(PY) "$$script" | tee "$$out/$$name.jsonl" \
	    || { echo "bench: $$script FAILED" >&2; failed=1; }; \
	done; \
	exit $$failed

clean:
	rm -rf $(VENV) .tmp .pytest_cache .mypy_cache .ruff_cache .hypothesis build dist
	find . -name '*.egg-info' -prune -exec rm -rf {} +
	find . -name __pycache__ -prune -exec rm -rf {} +
