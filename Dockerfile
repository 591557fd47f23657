# syntax=docker/dockerfile:1
# The Shoal image: the operator (`shoal-operator`, the default command) and the consumer
# (`shoal-consumer run`, which the operator sets as the consumer pods' command).
#
#   docker build -t shoal:dev .
#
# Runs as the numeric user 10001 (so runAsNonRoot can verify it) on a read-only root
# filesystem: nothing is written outside /tmp, which the chart mounts as an emptyDir.

ARG PYTHON_IMAGE=python:3.11-slim

# -- builder: a virtualenv at /opt/shoal with the project and its runtime dependencies ----
FROM ${PYTHON_IMAGE} AS builder
ENV PIP_DISABLE_PIP_VERSION_CHECK=1 PIP_NO_CACHE_DIR=1 PYTHONDONTWRITEBYTECODE=1
# python3: the name both python:3.11-slim and a Debian base (scripts/build-image.sh) have.
RUN python3 -m venv /opt/shoal
WORKDIR /src
# Only what the build reads: each folder holds one part of the `shoal` namespace package
# (pyproject.toml; hatchling builds the wheel from all four).
COPY pyproject.toml README.md ./
COPY common ./common
COPY consumer ./consumer
COPY operator ./operator
COPY analytics ./analytics
# A regular (not editable) install without the test extra; pip compiles the bytecode here,
# since the running image cannot write it. Behind a TLS-inspecting proxy, pass its CA
# bundle as the build secret pip-ca (scripts/build-image.sh does, from PIP_CERT or
# SSL_CERT_FILE): mounted for this step only, it never lands in a layer.
RUN --mount=type=secret,id=pip-ca \
    if [ -s /run/secrets/pip-ca ]; then export PIP_CERT=/run/secrets/pip-ca; fi \
 && /opt/shoal/bin/pip install . \
 && cd / \
 && /opt/shoal/bin/python -c "import shoal.operator.reconciler, shoal.consumer.cli" \
 && /opt/shoal/bin/shoal-operator --help >/dev/null \
 && /opt/shoal/bin/shoal-consumer --help >/dev/null \
 && /opt/shoal/bin/shoal-ready --help >/dev/null \
 && /opt/shoal/bin/pip uninstall --yes pip

# -- runtime: the same Python, only the virtualenv copied (no sources, no build tools) ----
FROM ${PYTHON_IMAGE}
LABEL org.opencontainers.image.title="shoal" \
      org.opencontainers.image.description="Elastic consumer groups for NATS JetStream on Kubernetes" \
      org.opencontainers.image.licenses="Apache-2.0"
# The user has a name: kopf (the operator) names itself after getpass.getuser(), which
# fails for a uid that /etc/passwd does not list (the local plane's image runtime found
# the operator crash-looping without it). Appended, not useradd: no shadow, no logs.
RUN echo 'shoal:x:10001:10001:shoal:/tmp:/usr/sbin/nologin' >> /etc/passwd \
 && echo 'shoal:x:10001:' >> /etc/group
COPY --from=builder /opt/shoal /opt/shoal
ENV PATH=/opt/shoal/bin:$PATH \
    PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1 \
    HOME=/tmp \
    TMPDIR=/tmp
# / as the working directory: nothing there shadows a module (python -c puts it on sys.path).
WORKDIR /
USER 10001:10001
CMD ["shoal-operator"]
