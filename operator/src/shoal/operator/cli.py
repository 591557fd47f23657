"""`shoal-operator`: run the ConsumerGroup operator (kopf, one replica, standalone)."""

from __future__ import annotations

import os
import socket

import click
import kopf

from shoal.logs import log_level_option, setup_logging


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
@log_level_option
def main(namespaces: tuple[str, ...], liveness: str, log_level: str) -> None:
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
    kopf.run(
        standalone=True,
        clusterwide=not spaces,
        namespaces=spaces,
        liveness_endpoint=liveness,
        memo=OperatorMemo(),
    )


def set_identity() -> None:
    """Tell kopf who this operator is (its documented POD_ID): the pod name, else host
    and pid. kopf's own default asks getpass.getuser(), which raises for a uid with no
    passwd entry: a runAsUser the image does not name crash-looped the operator pod."""
    name = os.environ.get("POD_NAME") or f"{socket.gethostname()}/{os.getpid()}"
    os.environ.setdefault("POD_ID", name)
