"""The options several `shoal-consumer` commands share (which group, where its servers
are), and how a configuration error reads on the command line."""

from __future__ import annotations

import getpass
import os
import socket
from collections.abc import Callable, Mapping
from typing import Any

import click
from click.decorators import FC
from pydantic import ValidationError

from shoal.clients.natsauth import redacted
from shoal.contracts.names import DEFAULT_PARTITIONS
from shoal.group.config import ENV_VARS, GroupConfig, config_from_env

__all__ = [
    "EnvNamingOption",
    "command_config",
    "etcd_option",
    "group_option",
    "jetstream_refused",
    "namespace_option",
    "nats_option",
    "no_answer",
    "option",
    "or_dash",
    "partitions_option",
    "stream_option",
    "subject_prefix_option",
    "validation_message",
    "whoami",
]


class EnvNamingOption(click.Option):
    """An option whose bad value names the environment variable it came from: a member's
    settings come from SHOAL_* variables (the operator's, or spec.env), and "Invalid value
    for '--health-port'" leaves the user looking for a flag nobody passed."""

    def get_error_hint(self, ctx: click.Context | None) -> str:
        hint = super().get_error_hint(ctx)
        if (
            ctx is None
            or self.name is None
            or ctx.get_parameter_source(self.name) is not (click.core.ParameterSource.ENVIRONMENT)
        ):
            return hint
        names = [self.envvar] if isinstance(self.envvar, str) else list(self.envvar or ())
        given = [name for name in names if os.environ.get(name)]
        return f"{hint} (from {given[0]})" if given else hint


def option(*param_decls: str, **attrs: Any) -> Callable[[FC], FC]:
    """click.option, naming the environment variable a bad value came from."""
    attrs.setdefault("cls", EnvNamingOption)
    return click.option(*param_decls, **attrs)


group_option = option(
    "--group",
    "-g",
    envvar="SHOAL_GROUP",
    required=True,
    help="Consumer group name [env SHOAL_GROUP].",
)
namespace_option = option(
    "--namespace",
    "-n",
    envvar="SHOAL_NAMESPACE",
    default="default",
    show_default=True,
    help="Namespace of the group [env SHOAL_NAMESPACE].",
)
nats_option = option(
    "--nats",
    "nats_url",
    envvar="NATS_URL",
    default="nats://127.0.0.1:4222",
    show_default=True,
    help="NATS server URL [env NATS_URL].",
)
etcd_option = option(
    "--etcd",
    "etcd_endpoints",
    envvar="ETCD_ENDPOINTS",
    default="127.0.0.1:2379",
    show_default=True,
    help="etcd endpoints, host:port[,host:port] [env ETCD_ENDPOINTS].",
)
partitions_option = option(
    "--partitions",
    "-p",
    type=click.IntRange(1, 4096),
    envvar="SHOAL_PARTITIONS",
    default=DEFAULT_PARTITIONS,
    show_default=True,
    help="Number of partitions of the group.",
)
subject_prefix_option = option(
    "--subject-prefix",
    envvar="SHOAL_SUBJECT_PREFIX",
    default=None,
    help="Subject prefix (default shoal.<namespace>.<group>).",
)
stream_option = option(
    "--stream", envvar="SHOAL_STREAM", default=None, help="Stream name, if not the default."
)


def validation_message(exc: ValidationError, given: Mapping[str, Any] | None = None) -> str:
    """One line for every error. With `given` (the options a command passed on top of
    the environment), a field not among them came from the environment and is named by
    its variable, as the user wrote it: a bad SHOAL_MAX_MESSAGES_PER_SECOND read
    "max_messages_per_second: ...", a name found nowhere in the documentation."""
    parts = []
    for err in exc.errors():
        where = ".".join(str(x) for x in err["loc"]) or "config"
        field = str(err["loc"][0]) if err["loc"] else ""
        if given is not None and field in ENV_VARS and given.get(field) is None:
            where = f"{ENV_VARS[field]} ({where})"
        parts.append(f"{where}: {err['msg']}")
    return "; ".join(parts)


def command_config(**given: Any) -> GroupConfig:
    """The group's configuration from a command's options (`given`, by GroupConfig's
    field names; None: not given) and the environment, as `run` reads it (TLS,
    credentials, SHOAL_*); a bad value is a usage error that names the field."""
    try:
        return config_from_env(os.environ, **given)
    except ValidationError as exc:
        raise click.UsageError(validation_message(exc, given)) from None


def or_dash(value: object) -> object:
    """A value for a table cell: "-" for none."""
    return "-" if value is None else value


def whoami() -> str:
    """Who runs the command (user@host), for the records it writes (a pause, a reset)."""
    try:
        user = getpass.getuser()
    except Exception:
        user = "someone"
    return f"{user}@{socket.gethostname()}"


def jetstream_refused(exc: Exception, where: str) -> str:
    """The one line for JetStream's API refusing a command's request (an APIError), or
    nobody answering it (JetStream not enabled there, or another API prefix)."""
    from nats.errors import NoRespondersError
    from nats.js.errors import ServiceUnavailableError

    where = redacted(where)
    # A 503 from the API: nobody serves it (the description is None).
    if isinstance(exc, NoRespondersError | ServiceUnavailableError):
        return (
            f"nobody answers JetStream's API at {where} (is JetStream enabled on that "
            "server, and is the API prefix right?)"
        )
    return f"JetStream at {where} refused: {getattr(exc, 'description', None) or exc!r}"


def no_answer(where: str) -> str:
    """The one line for a NATS request nobody answered in time (nats-py raises a bare
    TimeoutError): a server refusing this user the subject looks exactly like that."""
    return (
        f"NATS at {redacted(where)} did not answer a JetStream request in time: is JetStream "
        "up, and may this NATS user use the group's streams? (`shoal-consumer permissions` lists "
        "what the dlq and reset commands need; the server logs a Permissions Violation)"
    )
