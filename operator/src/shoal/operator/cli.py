"""`shoal-operator`: run the ConsumerGroup operator (kopf, standalone).

One replica by default. With --leader-elect, several replicas may run: each first takes a
Lease (shoal.operator.leadership) and only its holder runs kopf.
"""

from __future__ import annotations

import contextlib
import http.server
import logging
import os
import socket
import threading
import urllib.parse
from collections.abc import Iterator

import click
import kopf

from shoal.logs import log_level_option, setup_logging
from shoal.operator.leadership import LeaseElector, lease_namespace

log = logging.getLogger(__name__)


@click.command(context_settings={"help_option_names": ["-h", "--help"]})
@click.option(
    "--namespace",
    "-n",
    "namespaces",
    multiple=True,
    envvar="SHOAL_WATCH_NAMESPACES",
    help="Watch only these namespaces (repeatable; default: the whole cluster).",
)
@click.option(
    "--liveness",
    default="http://0.0.0.0:8080/healthz",
    show_default=True,
    envvar="SHOAL_LIVENESS",
    help="Where to serve the liveness probe.",
)
@click.option(
    "--leader-elect/--no-leader-elect",
    default=False,
    envvar="SHOAL_LEADER_ELECT",
    help="Run only while holding a Lease, so that several replicas may run and one acts "
    "(off: this replica acts at once, as the only one).",
)
@click.option(
    "--leader-elect-lease",
    default="shoal-operator",
    show_default=True,
    envvar="SHOAL_LEADER_ELECT_LEASE",
    help="The Lease's name (with --leader-elect).",
)
@click.option(
    "--leader-elect-namespace",
    default=None,
    envvar="SHOAL_LEADER_ELECT_NAMESPACE",
    help="The Lease's namespace (with --leader-elect; default: POD_NAMESPACE, else the pod's own).",
)
@log_level_option
def main(
    namespaces: tuple[str, ...],
    liveness: str,
    leader_elect: bool,
    leader_elect_lease: str,
    leader_elect_namespace: str | None,
    log_level: str,
) -> None:
    """Reconcile ConsumerGroups into consumer Deployments, RBAC, PDBs and JetStream streams.

    NATS and etcd default to NATS_URL and ETCD_ENDPOINTS; the consumer image to
    SHOAL_OPERATOR_IMAGE. Credentials: in a pod, its service account; elsewhere KUBECONFIG.
    """
    # aiohttp.access: every liveness probe would otherwise be an INFO line.
    setup_logging(log_level, quiet=["aiohttp.access"])
    # Importing registers the handlers with kopf.
    import shoal.operator.reconciler  # noqa: F401
    from shoal.operator.state import OperatorMemo

    spaces = [n for item in namespaces for n in item.split(",") if n]
    os.environ.setdefault("SHOAL_WATCH_NAMESPACES", ",".join(spaces))
    set_identity()
    elector = None
    if leader_elect:
        elector = lead(leader_elect_namespace, leader_elect_lease, liveness)
    kopf.run(
        standalone=True,
        clusterwide=not spaces,
        namespaces=spaces,
        liveness_endpoint=liveness,
        memo=OperatorMemo(),
    )
    if elector is not None:
        # kopf has returned (a graceful stop): nothing acts any more, hand the Lease over.
        elector.release()


def lead(namespace: str | None, name: str, liveness: str) -> LeaseElector:
    """Block until this replica holds the Lease, then keep renewing it.

    Meanwhile the liveness endpoint answers (kopf serves it only once it runs), so that a
    standby's probes pass. Losing the Lease ends the process at once (os._exit: no
    handler may run a moment longer) with status 1, and Kubernetes restarts it as a
    standby: two replicas never act together.
    """
    from shoal.operator.kube import api_client

    elector = LeaseElector(api_client(), lease_namespace(namespace), name, os.environ["POD_ID"])
    with standby_health(liveness):
        elector.acquire()

    def lost(why: str) -> None:
        log.critical("leader election: stepping down (exiting): %s", why)
        logging.shutdown()
        os._exit(1)

    elector.keep(lost)
    return elector


class _Healthy(http.server.BaseHTTPRequestHandler):
    def do_GET(self) -> None:
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.end_headers()
        self.wfile.write(b'{"standby": true}')

    def log_message(self, format: str, *args: object) -> None:
        pass  # every probe would be a line


@contextlib.contextmanager
def standby_health(liveness: str) -> Iterator[None]:
    """Answer 200 on the liveness endpoint's host and port until the block ends (then
    kopf binds them)."""
    url = urllib.parse.urlsplit(liveness)
    server = http.server.ThreadingHTTPServer((url.hostname or "0.0.0.0", url.port or 80), _Healthy)
    thread = threading.Thread(target=server.serve_forever, name="standby-health", daemon=True)
    thread.start()
    try:
        yield
    finally:
        server.shutdown()
        server.server_close()


def set_identity() -> None:
    """Tell kopf who this operator is (its documented POD_ID): the pod name, else host
    and pid. kopf's own default asks getpass.getuser(), which raises for a uid with no
    passwd entry: a runAsUser the image does not name crash-looped the operator pod."""
    name = os.environ.get("POD_NAME") or f"{socket.gethostname()}/{os.getpid()}"
    os.environ.setdefault("POD_ID", name)
