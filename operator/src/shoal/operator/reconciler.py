"""The ConsumerGroup reconciler: kopf handlers, thin over builders and observe.

Intent (create, update, resume): apply the children built from the spec (Deployment,
ServiceAccount, Role, RoleBinding, PodDisruptionBudget), all adopted so deletion
cascades, and make sure the JetStream stream and per-partition durables exist.
Observation (a timer): read the Deployment, etcd and JetStream into status, with an
Event for each new assignment generation, each change of replicas, each stall episode
(a watch on the members' keys catches stalls shorter than the timer's period) and each
member NATS refuses (its problems/ key: Degraded with NatsAuthFailed / NatsTLSFailed).
While the Deployment has pods that are not ready it also lists them: pods the scheduler
refuses make MembersSchedulable False (the scheduler's message in it and in Ready's)
with one MembersUnschedulable Warning per episode; containers of theirs that crash-loop or
cannot start (shoal.operator.failing) make the group Degraded (MembersCrashLooping,
MembersCannotStart: pod, container and last exit in Degraded's, Ready's and Progressing's
message) with one Warning per episode. What the operator made and someone
removed the timer puts back: streams JetStream says are missing (StreamRecreated), the
Deployment (DeploymentRecreated) and the other children (RoleRecreated, ...: childwatch.py);
nothing else would, since no handler sees a change.
Pause (spec.paused): the operator writes the group's `paused` etcd key (who, from the
managed fields of the change, and when), which the members watch: no pod restarts.
Reconcile writes or deletes it at once, the status timer keeps it following the spec;
the Paused condition, the Status column (Progressing: Paused) and Paused/Resumed Events
say so.
Deletion: a finalizer clears the group's etcd prefix; the streams go only with
deletionPolicy Delete (retried for a bounded time when JetStream does not delete them,
then left with a StreamsKept Warning naming them). A spec that passes the schema but
cannot work (unreachable NATS, an unknown handler, a missing or unusable
spec.etcd.tlsSecret or NATS Secret, NATS refusing the group's credentials or
certificates) becomes Degraded with a Warning Event and is retried with backoff: a step
of reconcile raises GroupProblem, and reconcile alone reports it.

What all groups share is in the operator's memo, filled by the startup handler: settings,
the Kubernetes client, etcd connections with the files of the groups' etcd Secrets
(memo.etcd, shoal.operator.etcdsecret.EtcdClients) and NATS connections with the files of
the groups' NATS Secrets (memo.nats, shoal.operator.natssecret.NatsClients). What one group
remembers is in its own memo (shoal.operator.state.GroupState).
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import time
from typing import Any, NoReturn

import kopf
from kubernetes.client.rest import ApiException
from nats.js.errors import NotFoundError

from shoal.clients.etcd import TRANSIENT_ERRORS, Etcd, EtcdUnavailable, describe
from shoal.clients.nats import connect
from shoal.clients.natsauth import NatsConfigError, redacted
from shoal.contracts.names import (
    API_GROUP,
    API_VERSION,
    FINALIZER,
    PLURAL,
    Keys,
    format_time,
)
from shoal.contracts.spec import ConsumerGroupSpec, NatsSpec, SpecError, parse_spec
from shoal.contracts.values import MemberStats, PauseRecord, ScaleRecord
from shoal.group.config import GroupConfig
from shoal.group.handlerref import HandlerError, import_handler, is_url_handler
from shoal.group.jetstream import (
    StreamConfigConflict,
    ensure_group,
    partition_list,
    partition_progress,
)
from shoal.group.pause import SPEC_SOURCE, lift_if_source, pause_group
from shoal.group.status import GroupStatus, status_from_view
from shoal.group.view import GroupView
from shoal.operator import failing, observe, scheduling
from shoal.operator.builders import (
    NatsPodSecrets,
    build_deployment,
    children,
    pod_config,
    resource_names,
    selector_string,
)
from shoal.operator.childwatch import missing_children
from shoal.operator.deployments import DeploymentIndex, replica_counts
from shoal.operator.etcdalarms import AlarmReader
from shoal.operator.etcdsecret import EtcdClients, EtcdSecretProblem
from shoal.operator.kube import Kube, api_client
from shoal.operator.natssecret import NatsClients, NatsSecretProblem
from shoal.operator.settings import OperatorSettings, settings_from_env
from shoal.operator.stallwatch import StallWatch
from shoal.operator.state import OperatorMemo

log = logging.getLogger(__name__)

OBSERVE_INTERVAL = 5.0


def now() -> str:
    return format_time()


def spec_model(spec: Any) -> ConsumerGroupSpec:
    """The spec as the one model every step reads (kopf hands a mapping view)."""
    return parse_spec(spec if isinstance(spec, ConsumerGroupSpec) else dict(spec))


def deletable_spec(spec: Any) -> ConsumerGroupSpec:
    """The spec a deletion works from.

    A group stored before the CRD refused `replicas: 0` with autoscaling on (issue 24)
    fails the model; its finalizer must still run, or the group could never be deleted.
    Autoscaling does not matter to a deletion, so such a spec is read with it off. Any
    other problem raises, as before (kopf retries and logs it).
    """
    try:
        return spec_model(spec)
    except SpecError:
        if isinstance(spec, ConsumerGroupSpec):
            raise
        autoscaling = dict(spec.get("autoscaling") or {})
        return spec_model({**dict(spec), "autoscaling": {**autoscaling, "enabled": False}})


def handler_problem(spec: Any, settings: OperatorSettings) -> str | None:
    """An unknown handler, when the pods run the operator's own image (we can check it)."""
    model = spec_model(spec)
    if model.image and model.image != settings.default_image:
        return None  # a custom image may carry handlers the operator cannot import
    if is_url_handler(model.handler):
        return None  # a service, reached at run time: nothing to import
    try:
        import_handler(model.handler)
    except HandlerError as exc:
        return str(exc)
    return None


@kopf.on.startup()
async def startup(settings: kopf.OperatorSettings, memo: OperatorMemo, **_: Any) -> None:
    settings.persistence.finalizer = FINALIZER
    settings.posting.level = logging.INFO
    settings.watching.server_timeout = 60
    settings.watching.client_timeout = 90
    memo.settings = settings_from_env(os.environ)
    memo.kube = Kube(api_client())
    memo.etcd = EtcdClients(memo.kube)
    memo.alarms = AlarmReader(max_age=OBSERVE_INTERVAL - 1)
    own = memo.settings.nats_security()
    try:
        own.check()
    except NatsConfigError as exc:
        # Not fatal: groups with Secrets of their own may still work; the others say
        # NatsUnavailable with this line in their status.
        log.error("The operator's own NATS settings cannot work: %s", exc)
    memo.nats = NatsClients(memo.kube, own)
    # Nothing per group here: kopf shallow-copies this memo into every group's memo, so a
    # dict set here would be one dict for all groups (see shoal.operator.state).
    log.info(
        "Shoal operator started: default image %s, NATS %s, etcd %s",
        memo.settings.default_image,
        memo.settings.nats_url,
        memo.settings.etcd_endpoints,
    )


@kopf.on.cleanup()
async def cleanup_clients(memo: OperatorMemo, **_: Any) -> None:
    if memo.has("etcd"):
        memo.etcd.close()  # and removes the Secrets' files
    if memo.has("nats"):
        await memo.nats.close()  # and removes the Secrets' files


@kopf.on.probe(id="operator")
async def alive(**_: Any) -> str:
    return "ok"


# The longest a failed reconcile waits before it tries again. kopf keeps a handler's
# retry delay across later changes of the object (the same handler, the same purpose),
# so a longer one also held back every spec change made meanwhile: `kubectl scale cg`,
# the autoscaler's decisions, the fix for the very problem reported, for up to 5 minutes.
MAX_RETRY_DELAY = 60


class GroupProblem(Exception):
    """A group's spec cannot work now: the Degraded reason (CamelCase), a message for
    people, and how long to wait before trying again (seconds, at most MAX_RETRY_DELAY)."""

    def __init__(self, reason: str, message: str, delay: float) -> None:
        super().__init__(message)
        self.reason = reason
        self.message = message
        self.delay = min(delay, MAX_RETRY_DELAY)


async def _nats(
    memo: OperatorMemo,
    config: GroupConfig,
    spec: NatsSpec,
    attempts: int,
    *,
    stale_ok: bool = False,
) -> Any:
    """One NATS connection per server and credentials, kept across handler calls: with the
    group's own NATS Secrets (spec.nats.tlsSecret, credentialsSecret), read through the
    API, else the operator's own settings.

    The status timer runs every few seconds per group: connecting each time would cost
    two connections (probe and real) per tick. A failed connect is not cached, so the
    next call tries again; a kept connection reconnects by itself. NatsSecretProblem:
    the Secrets cannot be used, or NATS refused them.
    """
    clients: NatsClients = memo.nats
    return await clients.get(
        config.nats_url,
        config.namespace,
        spec,
        connect=connect,
        attempts=attempts,
        stale_ok=stale_ok,
        user=id(memo.group),
    )


def check_handler(spec: Any, settings: OperatorSettings, retry: int) -> None:
    """GroupProblem HandlerInvalid if the pods could not import the spec's handler."""
    problem = handler_problem(spec, settings)
    if problem is not None:
        raise GroupProblem("HandlerInvalid", problem, delay=min(300, 10 * 2 ** min(retry, 5)))


async def etcd_secret_version(
    clients: EtcdClients, namespace: str, spec: Any, retry: int
) -> str | None:
    """The version of the group's etcd Secret (a digest of its data), read and checked
    (None: no Secret).

    GroupProblem (EtcdSecretMissing, EtcdSecretInvalid, EtcdSecretForbidden) if it
    cannot be used.
    """
    secret = etcd_secret_name(spec)
    if not secret:
        return None
    try:
        return (await clients.files(namespace, secret)).version
    except EtcdSecretProblem as exc:
        # Capped low: a Secret is usually created right after the group.
        delay = min(60, 5 * 2 ** min(retry, 4))
        raise GroupProblem(exc.reason, exc.message, delay=delay) from exc


async def nats_secrets(
    clients: NatsClients, namespace: str, spec: Any, retry: int
) -> NatsPodSecrets:
    """What the group's NATS Secrets hold (the pods' mounts and env follow it), read and
    checked: GroupProblem (NatsSecretMissing, NatsSecretForbidden) if they cannot be used."""
    try:
        return (await clients.group(namespace, spec_model(spec).nats)).pods
    except NatsSecretProblem as exc:
        delay = min(60, 5 * 2 ** min(retry, 4))  # as for the etcd Secret
        raise GroupProblem(exc.reason, exc.message, delay=delay) from exc


async def report_scale(
    memo: OperatorMemo,
    config: GroupConfig,
    spec: Any,
    old: Any,
    secret: str | None,
    patch: kopf.Patch,
    body: kopf.Body,
) -> None:
    """status.lastScale when spec.replicas changed, and a Scaled Event unless the
    autoscaler made the change (the leader posts its own ScaledUp/ScaledDown Event).

    Once per change: kopf stores the spec it compares with (`old`) only when a handler
    succeeds, so each retry of a failed reconcile sees the same old -> new replicas. A
    retry writes the lastScale the first attempt decided (its time, and the autoscaler's
    reason even once the record is too old to explain the change) and posts nothing."""
    state = memo.group
    after = int(spec_model(spec).replicas or 0)
    if state.scale_reported is not None and state.scale_reported[1] != after:
        state.scale_reported = None  # the spec asks for other replicas now: a new change
    before = ((old or {}).get("spec") or {}).get("replicas")
    if before is None or before == after:
        return
    if state.scale_reported is not None and state.scale_reported[0] == before:
        patch.status["lastScale"] = state.scale_reported[2]
        return
    # Whoever set spec.replicas (kubectl scale, an HPA, the leader) came through here.
    record = await _scale_record(memo, config, secret)
    last, by_autoscaler = observe.last_scale(int(before), after, record, time.time())
    state.scale_reported = (int(before), after, last)
    patch.status["lastScale"] = last
    if not by_autoscaler:
        kopf.info(body, reason="Scaled", message=f"Replicas {before} -> {after}")


async def apply_children(
    kube: Kube,
    body: kopf.Body,
    name: str,
    namespace: str,
    spec: Any,
    settings: OperatorSettings,
    secret_version: str | None,
    nats: NatsPodSecrets | None = None,
    retry: int = 0,
) -> None:
    """Server-side apply the Deployment, RBAC and PDB, owned by the group so that
    deleting it deletes them.

    GroupProblem ApplyFailed when the API server does not take one, with its own
    message, which says what to fix: a spec the CRD accepts may still build an invalid
    Deployment (two `env` entries of one name: 500 "duplicate entries for key" from the
    server-side apply; a resources quantity like "banana": 4xx)."""
    for obj in children(name, namespace, spec_model(spec), settings, secret_version, nats):
        kopf.adopt(obj, owner=body)
        try:
            await kube.apply(obj)
        except ApiException as exc:
            what = f"{obj['kind']} {obj['metadata']['name']}"
            refused = exc.status is not None and 400 <= int(exc.status) < 500
            message = f"{what} not applied: the API server answered {exc.status} {exc.reason}"
            said = api_message(exc)
            if said:
                message += f": {said}"
            # A 4xx stands until the spec changes (which reconciles at once): retry
            # slowly. Anything else may pass on its own (though a server-side apply
            # answers some invalid specs with 500 too).
            delay = min(300, 30 * 2 ** min(retry, 3)) if refused else min(60, 5 * 2**retry)
            raise GroupProblem("ApplyFailed", message[:2000], delay=delay) from exc


def api_message(exc: ApiException) -> str:
    """The `message` of the API server's Status answer (the body of an ApiException), or
    its body as it came, shortened."""
    body = exc.body.decode(errors="replace") if isinstance(exc.body, bytes) else exc.body
    if not body:
        return ""
    try:
        said = json.loads(body).get("message")
    except (ValueError, AttributeError):
        said = None
    return str(said) if said else str(body)[:1000]


async def ensure_jetstream(
    memo: OperatorMemo, config: GroupConfig, retry: int, nats: NatsSpec | None = None
) -> list[int]:
    """The group's streams and one durable per partition, through a connection with the
    group's NATS Secrets (`nats`, the spec's section) if it names them. Returns the
    partitions whose missing durables were created at the stream's start on a stream
    that keeps acked messages (jetstream.ensure_group).

    GroupProblem StreamConfigConflict if the stream exists with a configuration JetStream
    cannot change in place; NatsAuthFailed, NatsTLSFailed (NATS refused the credentials
    or the certificates) or NatsSecretMissing; NatsUnavailable if JetStream cannot be
    reached or refuses.
    """
    try:
        nc = await _nats(memo, config, nats or NatsSpec(), attempts=2)
        return await ensure_group(nc.jetstream(), config)
    except StreamConfigConflict as exc:
        raise GroupProblem("StreamConfigConflict", str(exc), delay=60) from exc
    except NatsSecretProblem as exc:
        delay = min(60, 5 * 2 ** min(retry, 4))  # someone must act; check again soon
        raise GroupProblem(exc.reason, exc.message, delay=delay) from exc
    except Exception as exc:
        message = f"JetStream at {redacted(config.nats_url)} unavailable: {exc}"
        delay = min(300, 5 * 2 ** min(retry, 6))
        raise GroupProblem("NatsUnavailable", message, delay=delay) from exc


@kopf.on.create(API_GROUP, API_VERSION, PLURAL)
@kopf.on.update(API_GROUP, API_VERSION, PLURAL)
@kopf.on.resume(API_GROUP, API_VERSION, PLURAL)
async def reconcile(
    name: str,
    namespace: str | None,
    spec: kopf.Spec,
    meta: kopf.Meta,
    status: kopf.Status,
    body: kopf.Body,
    memo: OperatorMemo,
    patch: kopf.Patch,
    retry: int,
    old: Any = None,
    **_: Any,
) -> None:
    """kopf's: a change (or the group seen at the operator's start); see _reconcile."""
    state = memo.group
    async with state.reconciling:
        state.timer_retry_at = None  # kopf retries what this one finds, if anything
        await _reconcile(name, namespace, spec, meta, status, body, memo, patch, retry, old)


async def _reconcile(
    name: str,
    namespace: str | None,
    spec: kopf.Spec,
    meta: kopf.Meta,
    status: kopf.Status,
    body: kopf.Body,
    memo: OperatorMemo,
    patch: kopf.Patch,
    retry: int,
    old: Any = None,
) -> None:
    """Make the group's children and JetStream match its spec, step by step.

    A step that finds the spec cannot work raises GroupProblem; this handler alone turns
    it into Degraded, a Warning Event and a retry after the problem's delay. Any other
    exception is kopf's to retry, the group Degraded (ReconcileFailed) meanwhile. Only a
    reconcile that succeeded sets status.observedGeneration (the status timer repeats it).
    """
    namespace = namespace or "default"  # ConsumerGroups are namespaced
    settings: OperatorSettings = memo.settings
    state = memo.group
    patch.status["selector"] = selector_string(name)
    try:
        # 0. The spec, parsed once. The API server's schema normally refuses what the
        #    model would; a spec that gets past it still becomes Degraded, not a crash.
        try:
            model = spec_model(spec)
        except SpecError as exc:
            raise GroupProblem("SpecInvalid", str(exc), delay=300) from exc
        # 1. The handler: a group whose pods could not import it gets no pods.
        check_handler(model, settings, retry)
        # 2. The etcd Secret, before any pod exists: pods would only wait for a volume
        #    that cannot mount.
        secret_version = await etcd_secret_version(memo.etcd, namespace, model, retry)
        #    And the NATS Secrets, for the same reason (and the pods' mounts follow them).
        nats = await nats_secrets(memo.nats, namespace, model, retry)
        # 3. The consumers' configuration.
        config = pod_config(name, namespace, model, settings)
        # 3b. spec.paused reaches the members through etcd (never the pods' env, which
        #     would restart them); best effort here, the status timer follows it up.
        await follow_pause(memo, config, model, meta, body)
        # 4. A change of spec.replicas: status.lastScale and who made it.
        await report_scale(memo, config, model, old, etcd_secret_name(model), patch, body)
        # 5. The children (Deployment, RBAC, PDB); the status timer compares later
        #    versions of the Secret with the one applied here.
        await apply_children(
            memo.kube, body, name, namespace, model, settings, secret_version, nats, retry
        )
        state.applied, state.secret_version, state.nats_secrets = True, secret_version, nats
        # 6. JetStream: the streams and the durables, with the group's NATS Secrets.
        restarted = await ensure_jetstream(memo, config, retry, model.nats)
        if restarted:
            kopf.warn(
                body,
                reason="DurablesRecreated",
                message=f"the durables of partitions {partition_list(restarted)} were missing "
                f"on stream {config.stream} ({config.retention} retention keeps acked "
                "messages): created at the stream's start, they deliver those partitions' "
                "messages again; shoal-consumer reset chooses another place",
            )
    except GroupProblem as problem:
        # The status timer sees only etcd and NATS: it keeps reporting this problem
        # until a reconcile succeeds.
        state.problem = (problem.reason, problem.message)
        state.problem_spec = _plain(spec)
        patch.status["conditions"] = observe.degraded(
            status.get("conditions", []),
            problem.reason,
            problem.message,
            int(meta.get("generation") or 0),
            now(),
        )
        kopf.warn(body, reason=problem.reason, message=problem.message)
        raise kopf.TemporaryError(problem.message, delay=problem.delay) from problem
    except Exception as exc:
        # Anything else is kopf's to retry (with its own backoff), but the group must not
        # look healthy meanwhile: Degraded says it, and the status timer keeps saying it
        # (state.problem) until a reconcile succeeds.
        message = f"Reconcile failed: {type(exc).__name__}: {exc}"[:2000]
        state.problem = ("ReconcileFailed", message)
        state.problem_spec = _plain(spec)
        patch.status["conditions"] = observe.degraded(
            status.get("conditions", []),
            "ReconcileFailed",
            message,
            int(meta.get("generation") or 0),
            now(),
        )
        kopf.warn(body, reason="ReconcileFailed", message=message)
        raise
    # 7. Done: whatever went wrong before is fixed, and this generation is applied: the
    #    status timer writes no later one into observedGeneration.
    state.problem, state.problem_spec = None, None
    state.scale_reported = None  # kopf compares the next change with this spec
    state.reconciled_generation = int(meta.get("generation") or 0)
    patch.status["observedGeneration"] = state.reconciled_generation
    kopf.info(
        body,
        reason="Reconciled",
        message=f"Applied {resource_names(name)['deployment']} with "
        f"{model.replicas} replicas; stream {config.stream} with "
        f"{config.partitions} durable consumers",
    )


def _plain(spec: kopf.Spec) -> dict[str, Any]:
    """The spec as plain data, to compare with a later one."""
    plain: dict[str, Any] = json.loads(json.dumps(dict(spec)))
    return plain


# How long the status timer leaves a spec that differs from the one reconcile failed
# with to kopf (an ordinary change: kopf calls reconcile at once), and how long after a
# reconcile of its own failed it tries again.
UNDONE_GRACE_SECONDS = OBSERVE_INTERVAL
TIMER_RETRY_SECONDS = 60.0


async def _reconcile_undone_change(
    name: str,
    namespace: str | None,
    spec: kopf.Spec,
    meta: kopf.Meta,
    status: kopf.Status,
    body: kopf.Body,
    memo: OperatorMemo,
    patch: kopf.Patch,
) -> None:
    """Reconcile from the status timer when kopf will not: the last reconcile failed
    (state.problem) with a spec that is no longer the group's. kopf compares a new spec
    with the one it last handled successfully; a change undone before kopf's retry brings
    that one back, so kopf calls no handler and drops the retry, and the refusal (say
    HandlerInvalid) stood until the next change or an operator restart. Once the timer has
    reconciled, a failure is retried here every TIMER_RETRY_SECONDS (kopf has no retry of
    its own pending), until kopf reconciles again."""
    state = memo.group
    if state.problem is None or state.problem_spec is None:
        state.spec_undone_since = None
        return
    now_ = time.monotonic()
    undone = state.problem_spec != _plain(spec)
    if undone:
        if state.spec_undone_since is None:
            state.spec_undone_since = now_
        if now_ - state.spec_undone_since < UNDONE_GRACE_SECONDS:
            return  # kopf may be about to reconcile it
    elif state.timer_retry_at is None or now_ < state.timer_retry_at:
        state.spec_undone_since = None
        return
    async with state.reconciling:
        if state.problem is None or (undone and state.problem_spec == _plain(spec)):
            return  # kopf's reconcile got there first
        reason = state.problem[0]
        log.info(
            "Group %s/%s: reconciling from the status timer (%s with %s; kopf has no "
            "change to handle)",
            namespace,
            name,
            reason,
            "a spec since changed back" if undone else "this spec, tried again",
        )
        state.spec_undone_since = None
        try:
            await _reconcile(name, namespace, spec, meta, status, body, memo, patch, retry=0)
        except Exception as exc:  # said by Degraded and an Event already (_reconcile)
            state.timer_retry_at = time.monotonic() + TIMER_RETRY_SECONDS
            log.info(
                "Group %s/%s: still %s; again in %.0f s", namespace, name, exc, TIMER_RETRY_SECONDS
            )
        else:
            state.timer_retry_at = None


async def _roll_on_rotation(
    memo: OperatorMemo,
    name: str,
    namespace: str,
    spec: kopf.Spec,
    body: kopf.Body,
    *,
    etcd_ok: bool,
    nats_ok: bool,
) -> None:
    """A new version of the group's etcd Secret or NATS Secrets: re-apply the Deployment
    with it, which rolls the pods (they read their certificates and credentials only at
    start). Only versions this process has used successfully just now (`etcd_ok`,
    `nats_ok`): rolling onto a Secret that fails would leave every new pod unready."""
    state = memo.group
    if not state.applied:
        return  # not reconciled by this process yet: the resume handler applies it
    if state.problem is not None:
        # The spec is one the last reconcile refused (a handler no pod can import, a
        # Secret missing): rolling the pods onto it would do what reconcile would not.
        # The reconcile that succeeds applies the Secret's new version anyway.
        return
    model = spec_model(spec)
    etcd_secret = model.etcd.tls_secret
    etcd_version = state.secret_version
    if etcd_secret and etcd_ok:
        etcd_version = memo.etcd.known_version(namespace, etcd_secret) or etcd_version
    nats = state.nats_secrets
    if nats_ok and (model.nats.tls_secret or model.nats.credentials_secret):
        clients: NatsClients = memo.nats
        nats = clients.known(namespace, model.nats) or nats
    rotated: list[tuple[str, str]] = []
    if etcd_version != state.secret_version:
        rotated.append(("EtcdSecretRotated", f"Secret {etcd_secret} (version {etcd_version})"))
    if nats != state.nats_secrets and state.nats_secrets is not None and nats is not None:
        for secret, old, new in (
            (model.nats.tls_secret, state.nats_secrets.tls_version, nats.tls_version),
            (
                model.nats.credentials_secret,
                state.nats_secrets.credentials_version,
                nats.credentials_version,
            ),
        ):
            if secret and old != new:
                rotated.append(("NatsSecretRotated", f"Secret {secret} (version {new})"))
    if not rotated:
        return
    deployment = build_deployment(name, namespace, model, memo.settings, etcd_version, nats)
    kopf.adopt(deployment, owner=body)
    await memo.kube.apply(deployment)
    state.secret_version, state.nats_secrets = etcd_version, nats
    for reason, what in rotated:
        kopf.info(body, reason=reason, message=f"{what} changed: rolling the consumer pods")


async def follow_pause(
    memo: OperatorMemo,
    config: GroupConfig,
    model: ConsumerGroupSpec,
    meta: Any,
    body: kopf.Body,
    current: PauseRecord | bool | None = False,
) -> PauseRecord | None:
    """Make the group's `paused` key say what spec.paused says; post a Paused or
    Resumed Event when this call changed it. `current`: the record etcd holds, if the
    caller has just read it (None: not paused), so that nothing is written when the key
    is as it should be; False: not known. Returns the record in force (None: running).
    etcd errors are logged, never raised: the status timer tries again.

    spec.paused: false lifts only the pause spec.paused made (SPEC_SOURCE). Another
    stands: `shoal-consumer pause`'s (operations tooling, lifted by `shoal-consumer
    resume`; before, the operator lifted it within seconds, in an Event naming whoever
    last set spec.paused), a reset's (lifted by the reset), or one it cannot read."""
    if current is not False and (current is not None) == model.paused:
        return current if isinstance(current, PauseRecord) else None
    if not model.paused and isinstance(current, PauseRecord) and current.source != SPEC_SOURCE:
        return current  # not the spec's pause: not the spec's to lift
    managed = meta.get("managedFields") if hasattr(meta, "get") else None
    try:
        etcd = await _etcd(memo, config.etcd_endpoints, config.namespace, etcd_secret_name(model))
        if model.paused:
            record = observe.pause_record(managed, time.time())
            existing = await pause_group(etcd, config.keys, record)
            if existing is not None:
                return existing
            log.info("Paused group %s/%s %s", config.namespace, config.group, record.describe())
            kopf.info(body, reason="Paused", message=observe.paused_message(record))
            return record
        # Only as read: a pause written meanwhile by someone else is not deleted unseen.
        # (A reset's pause, `shoal-consumer reset` recreating the durables, above all:
        # resumed meanwhile, members would pull while a durable is missing, and recreate
        # it at the old position: group/reset.py.)
        removed, left = await lift_if_source(etcd, config.keys, SPEC_SOURCE)
    except Exception as exc:
        log.warning(
            "Could not make %s/%s %s (etcd: %r); retrying with the status timer",
            config.namespace,
            config.group,
            "paused" if model.paused else "resumed",
            exc,
        )
        return None
    if removed is not None:
        # spec.paused made this pause, so whoever set spec.paused false lifted it.
        who = observe.pause_manager(managed)
        message = observe.resumed_message(who[0] if who else "unknown", removed, time.time())
        log.info("Group %s/%s: %s", config.namespace, config.group, message)
        kopf.info(body, reason="Resumed", message=message)
    return left


def etcd_secret_name(spec: Any) -> str | None:
    return spec_model(spec).etcd.tls_secret or None


async def _etcd(
    memo: OperatorMemo,
    endpoints: str,
    namespace: str | None = None,
    secret: str | None = None,
    *,
    stale_ok: bool = False,
) -> Etcd:
    """A connected etcd client, cached; with the group's tlsSecret (namespace, name) if any.

    EtcdSecretProblem: the Secret is missing or unusable (stale_ok: a Secret that is gone
    may be served from the version read before).
    """
    clients: EtcdClients = memo.etcd
    return await clients.get(endpoints, namespace, secret, stale_ok=stale_ok, user=id(memo.group))


async def _scale_record(
    memo: OperatorMemo, config: GroupConfig, secret: str | None
) -> ScaleRecord | None:
    """The autoscaler's last decision, if etcd can tell (a best effort: status only)."""
    try:
        etcd = await _etcd(memo, config.etcd_endpoints, config.namespace, secret)
        _, kvs = await etcd.get_prefix(config.keys.scale)
    except Exception as exc:
        log.debug("Autoscaler record unavailable: %r", exc)
        return None
    kv = kvs.get(config.keys.scale)
    return None if kv is None else ScaleRecord.parse(kv.value)


@kopf.timer(API_GROUP, API_VERSION, PLURAL, interval=OBSERVE_INTERVAL, initial_delay=1.0)
async def observe_group(
    name: str,
    namespace: str | None,
    spec: kopf.Spec,
    meta: kopf.Meta,
    status: kopf.Status,
    body: kopf.Body,
    memo: OperatorMemo,
    patch: kopf.Patch,
    group_deployments: DeploymentIndex | None = None,
    **indexes: Any,  # childwatch's, by their ids (and kopf's other arguments)
) -> None:
    await _reconcile_undone_change(name, namespace, spec, meta, status, body, memo, patch)
    namespace = namespace or "default"  # ConsumerGroups are namespaced
    settings: OperatorSettings = memo.settings
    try:
        model = spec_model(spec)
    except SpecError as exc:
        _report_refused_spec(exc, meta, status, patch)
        return
    config = pod_config(name, namespace, model, settings)
    deployment = resource_names(name)["deployment"]
    children_problem: tuple[str, str] | None = None
    gone: list[tuple[str, str, str]] = []
    dep = replica_counts(group_deployments, namespace, deployment)
    if dep is None:  # not seen by the watch (yet): ask
        found = await memo.kube.deployment_status(namespace, deployment)
        if found is None:
            gone.append(("apps/v1", "Deployment", deployment))
        dep = found or {"replicas": 0, "ready": 0}
    for api_version, kind, child in missing_children(indexes, namespace, name):
        # Not seen by its watch: gone, or applied a moment ago (ask).
        if not await memo.kube.exists(api_version, kind, namespace, child):
            gone.append((api_version, kind, child))
    if gone:
        children_problem = await _reapply_deleted_children(
            memo, body, meta, name, namespace, model, gone
        )
    unschedulable, failing_pods, pods_unread = await _member_pods(
        memo, body, status, namespace, name, dep, model.replicas
    )
    members: dict[str, int] = {}
    leader, generation_seen, unowned, unclaimed = None, 0, config.partitions, config.partitions
    problem: tuple[str, str] | None = None
    moving = 0
    stalled: tuple[tuple[int, str], ...] = ()
    refused: tuple[tuple[str, str, str], ...] = ()
    waiting: tuple[tuple[str, str, float], ...] = ()
    paused: PauseRecord | None = None
    nats_reached: dict[str, bool] = {}
    etcd_read = False  # if not, the status keeps what etcd told before (ETCD_FIELDS)
    member_stats: dict[str, MemberStats] = {}
    try:
        etcd = await _etcd(memo, config.etcd_endpoints, namespace, etcd_secret_name(model))
        group, revision = await _read_group(
            etcd, namespace, name, config.partitions, memo.group.garbage_logged
        )
        etcd_read = True
        paused = await follow_pause(memo, config, model, meta, body, group.paused)
        members = {m: group.counts.get(m, 0) for m in group.members}
        member_stats = group.members
        # (A member whose HTTP handler accepts no connection is left without a share
        # too: election._eligible.)
        nats_reached = {
            m: stats.nats_ok and stats.handler_ok is not False for m, stats in group.members.items()
        }
        leader, generation_seen = group.leader, group.generation
        unowned, unclaimed = len(group.unowned), len(group.unclaimed)
        moving = sum(1 for p, owner in group.owners.items() if group.claims.get(p) != owner)
        stalled = observe.stalled_partitions(group.members, config.partitions)
        between = await _stalls_between(memo, etcd, config.keys, config.partitions, revision)
        _report_stalls(
            body, memo, status, stalled, between, model.stall_after_seconds, len(members)
        )
        refused = tuple(
            sorted(
                (m, p.reason, p.message)
                for m, p in group.problems.items()
                if not p.waits_for_handler
            )
        )
        waiting = tuple(
            sorted(
                (m, p.message, p.since) for m, p in group.problems.items() if p.waits_for_handler
            )
        )
        _report_refusals(body, memo, status, refused)
        problem = await _no_space(etcd, body, memo, status, config.etcd_endpoints)
    except EtcdSecretProblem as exc:
        problem = (exc.reason, exc.message)
    except Exception as exc:
        problem = ("EtcdUnavailable", f"etcd at {config.etcd_endpoints} unavailable: {exc}")
    etcd_ok = problem is None
    # A Deployment that could not be applied again says so (above), after etcd's problems.
    problem = problem or children_problem
    # A problem the last reconcile found (a handler, a stream change) stands until fixed.
    problem = problem or memo.group.problem
    lag: int | None = None
    dead_letters: int | None = None
    nats_ok = False
    try:
        nc = await _nats(memo, config, model.nats, attempts=1)
        nats_ok = True
        js = nc.jetstream()
        infos = await _stream_infos(js, config)
        missing = [stream for stream, info in infos.items() if info is None]
        if missing:
            # NATS answers, and says the streams are gone: put them back (with backoff),
            # whatever else is wrong (an etcd outage must not keep them gone).
            recreating = await _recreate_streams(memo, body, config, model, missing)
            problem = problem or recreating
        else:
            _streams_present(memo)
        info = infos[config.stream] or await js.stream_info(config.stream)
        if config.retention == "workqueue":
            lag = int(info.state.messages)
        elif etcd_read:
            try:
                lag = await _durables_lag(js, config, member_stats)
            except Exception as exc:  # NATS answers (the streams above): no lag this time
                log.debug("Lag of %s/%s unavailable: %r", namespace, name, exc)
        dlq = infos[config.dlq_stream]
        dead_letters = int(dlq.state.messages) if dlq is not None else None
    except NatsSecretProblem as exc:
        problem = problem or (exc.reason, exc.message)
    except Exception as exc:
        problem = problem or ("NatsUnavailable", f"JetStream at {redacted(config.nats_url)}: {exc}")
    # _etcd and _nats above have just read the Secrets: compare versions without reading
    # them again.
    await _roll_on_rotation(memo, name, namespace, spec, body, etcd_ok=etcd_ok, nats_ok=nats_ok)

    generation = int(meta.get("generation") or 0)
    old = dict(status or {})
    observed = observe.Observed(
        generation=generation,
        spec_replicas=model.replicas,
        replicas=dep["replicas"],
        ready_replicas=dep["ready"],
        members=members,
        leader=leader,
        assignment_generation=generation_seen,
        partitions=config.partitions,
        unowned=unowned,
        unclaimed=unclaimed,
        moving=moving,
        nats_ok=nats_reached,
        etcd_read=etcd_read,
        stalled=stalled,
        refused=refused,
        waiting=waiting,
        stall_after=model.stall_after_seconds,
        lag=lag,
        dead_letters=dead_letters,
        problem=problem,
        selector=selector_string(name),
        # Paused by the spec: who and when as etcd has it, else as the managed fields say.
        # Not by the spec: by a reset (follow_pause leaves its pause in force), or not.
        paused=paused
        or (observe.pause_record(meta.get("managedFields"), time.time()) if model.paused else None),
        unschedulable=unschedulable,
        failing=failing_pods,
        pods_unread=pods_unread,
    )
    new = observe.status(observed, old.get("conditions", []), now())
    # observedGeneration: the generation a reconcile applied, not merely the one seen
    # (until then, the status keeps what it had).
    if memo.group.reconciled_generation is None:
        del new["observedGeneration"]
    else:
        new["observedGeneration"] = memo.group.reconciled_generation
    # Only from what etcd said (an outage reads as generation 0, and its end as a change).
    if etcd_read and generation_seen and generation_seen != old.get("assignmentGeneration"):
        new["lastRebalanceTime"] = now()
        kopf.info(
            body,
            reason="Rebalanced",
            message=f"Assignment generation {generation_seen}: {len(members)} members, "
            f"leader {leader}, skew {observe.skew(observed)}",
        )
    # Only what changed: a status PATCH that changes nothing still costs the API server a
    # request (decode, admission, compare) every 5 s per group, half its requests at 50
    # idle groups (bench/groups.py).
    for key, value in observe.status_changes(old, new).items():
        patch.status[key] = value


def _report_refused_spec(
    exc: SpecError, meta: kopf.Meta, status: kopf.Status, patch: kopf.Patch
) -> None:
    """The status for a stored spec the model refuses, which the API server's schema let
    through (a spec stored before this operator's model refused it): what the reconcile
    writes (SpecInvalid), with no traceback and Error Event every tick. The reconcile's
    retries post the Warning; nothing else can be observed without a spec to read."""
    old = dict(status or {})
    found = observe.degraded(
        old.get("conditions", []),
        "SpecInvalid",
        str(exc),
        int(meta.get("generation") or 0),
        now(),
    )
    for key, value in observe.status_changes(old, {"conditions": found}).items():
        patch.status[key] = value


async def _reapply_deleted_children(
    memo: OperatorMemo,
    body: kopf.Body,
    meta: Any,
    name: str,
    namespace: str,
    model: ConsumerGroupSpec,
    missing: list[tuple[str, str, str]],
) -> tuple[str, str] | None:
    """Children of the group are gone although this process applied them (someone ran
    `kubectl delete deploy`, or deleted its Role, RoleBinding, ServiceAccount or PDB):
    apply the children again, with the Secrets' versions last applied, and post one
    Warning for each (DeploymentRecreated, RoleRecreated, ...). Nothing runs the
    reconcile handlers for it (the ConsumerGroup did not change), so without this the
    group would have no pods (or no autoscaling, no protection from drains) until its
    spec changed. Left alone: a group this process has not applied (the resume handler
    will), one whose last reconcile failed (that reconcile retries, and its spec may be
    what cannot work) and one being deleted (its finalizer removed the Deployment).
    Returns a Degraded (reason, message) if the apply failed."""
    state = memo.group
    if not state.applied or state.problem is not None or meta.get("deletionTimestamp"):
        return None
    what = ", ".join(f"{kind} {child}" for _, kind, child in missing)
    try:
        await apply_children(
            memo.kube,
            body,
            name,
            namespace,
            model,
            memo.settings,
            state.secret_version,
            state.nats_secrets,
        )
    except Exception as exc:  # the next observation tries again
        message = f"{what} missing and could not be applied again: {exc}"
        log.warning("Group %s/%s: %s", namespace, name, message)
        return f"{missing[0][1]}Missing", message[:1000]
    for _, kind, child in missing:
        message = f"{kind} {child} was deleted while the group exists: applied again"
        if kind == "Deployment":
            message += f" with {model.replicas} replicas"
        log.warning("Group %s/%s: %s", namespace, name, message)
        kopf.warn(body, reason=f"{kind}Recreated", message=message)
    return None


async def _stream_infos(js: Any, config: GroupConfig) -> dict[str, Any | None]:
    """The info of each of the group's streams, in ensure_group's order; None for one
    JetStream says does not exist (STREAM.INFO answered "not found"). Any other error
    raises: NATS is not answering, and nothing can be said about the streams. (One
    request a stream per tick; the status reads its lag and dead letters from these.)"""
    streams = [config.stream, config.dlq_stream, config.log_stream]
    if config.ledger:
        streams.append(config.ledger_stream)

    async def info(stream: str) -> Any | None:
        try:
            return await js.stream_info(stream)
        except NotFoundError:
            return None

    found = await asyncio.gather(*(info(stream) for stream in streams))
    return dict(zip(streams, found, strict=True))


def _streams_present(memo: OperatorMemo) -> None:
    state = memo.group
    state.streams_retry, state.streams_next_try, state.streams_problem = 0, 0.0, None


async def _recreate_streams(
    memo: OperatorMemo,
    body: kopf.Body,
    config: GroupConfig,
    model: ConsumerGroupSpec,
    missing: list[str],
) -> tuple[str, str] | None:
    """Some of the group's streams are gone while NATS answers (`nats stream rm`, or a
    `storage: memory` stream lost with its server's restart): run the JetStream step of
    reconcile again, which creates the streams and the durables. Only the reconcile
    handlers ran it before, on changes of the ConsumerGroup; the members wait for the
    operator to do it (partition.py). One Warning Event per recreation, saying the
    messages are gone; a failure is retried with backoff and is the Degraded problem
    returned (also at the observations between two attempts). Left alone while the
    group's last reconcile failed or this process has not reconciled it: that reconcile
    runs the step itself, with its own backoff."""
    state = memo.group
    if not state.applied or state.problem is not None:
        return None
    names = ", ".join(missing)
    if time.monotonic() < state.streams_next_try:
        return state.streams_problem
    try:
        await ensure_jetstream(memo, config, state.streams_retry, model.nats)
    except GroupProblem as failed:
        state.streams_retry += 1
        state.streams_next_try = time.monotonic() + min(failed.delay, 60.0)
        message = f"stream(s) {names} missing; recreating them failed: {failed.message}"
        state.streams_problem = (failed.reason, message)
        log.warning("Group %s/%s: %s", config.namespace, config.group, message)
        return state.streams_problem
    _streams_present(memo)
    message = (
        f"stream(s) {names} were missing (deleted, or lost with a restart of a NATS server "
        f"that kept them in memory): recreated, with the durables of {config.partitions} "
        "partitions; the messages they held are gone"
    )
    log.warning("Group %s/%s: %s", config.namespace, config.group, message)
    kopf.warn(body, reason="StreamRecreated", message=message)
    return None


async def _member_pods(
    memo: OperatorMemo,
    body: kopf.Body,
    status: Any,
    namespace: str,
    name: str,
    dep: dict[str, int],
    replicas: int,
) -> tuple[scheduling.Unschedulable | None, failing.Failing | None, str | None]:
    """Whether the scheduler refuses some of the group's pods, whether containers of
    theirs crash-loop or cannot start (and, if the pods could not be read, why not), with
    a Warning Event when either starts (_report_unschedulable, _report_failing). One LIST
    answers both.

    The pods are listed (one LIST by the group's label selector, in this timer) only when
    the Deployment has fewer ready pods than it has or should have: a pod the scheduler
    cannot place is never ready, so a healthy group costs no API call here. Listing in
    the timer rather than a kopf handler on pods: a pod watch would keep a stream open
    and every member pod's updates flowing into the operator all the time (each probe
    result, each pod-deletion-cost the leader sets), for an answer needed only while pods
    are not ready; it would need `watch` on pods; and its handler would have to hand what
    it saw to this timer, which writes the Ready condition the answer belongs in. The
    timer's period (5 s) is delay enough: a pod the scheduler refuses stays refused until
    someone changes the spec or the nodes. A crash loop keeps its pod not ready too
    (a native sidecar's as well: the pod is not ready without it), so it is seen here.

    While the pods cannot be read, what the last read found crash-looping stands (the
    Degraded condition does not flap to AsExpected and back).
    """
    if dep["ready"] >= max(dep["replicas"], replicas):
        found, broken = None, None  # every pod ready, so placed and running: nothing to read
    else:
        try:
            pods = await memo.kube.list_pods(namespace, selector_string(name))
        except ApiException as exc:  # 403 without `list` on pods: say so, keep going
            return None, memo.group.failing_last, f"{exc.status} {exc.reason}"
        except Exception as exc:  # the status timer must still write the rest
            log.debug("Pods of %s/%s unreadable: %r", namespace, name, exc)
            return None, memo.group.failing_last, repr(exc)[:200]
        found = scheduling.unschedulable(pods)
        broken = failing.failing(pods, time.time())
    _report_unschedulable(body, memo, status, found)
    _report_failing(body, memo, status, broken)
    return found, broken, None


def _report_failing(
    body: kopf.Body, memo: OperatorMemo, status: Any, found: failing.Failing | None
) -> None:
    """A Warning Event (MembersCrashLooping or MembersCannotStart) when member pods
    start crash-looping or failing to start: once per episode (from the first observation
    that finds such a container to the first that finds none), not at every observation,
    and not again when the pods, containers or exits change within it. The end posts
    nothing: Degraded turns False, with its lastTransitionTime. A new operator process
    takes an episode going on from the `status` the last one wrote
    (failing.failing_in_status)."""
    state = memo.group
    was = state.failing if state.failing is not None else failing.failing_in_status(status)
    if found is not None and not was:
        kopf.warn(body, reason=found.reason, message=found.message())
    state.failing = found is not None
    state.failing_last = found


def _report_unschedulable(
    body: kopf.Body, memo: OperatorMemo, status: Any, found: scheduling.Unschedulable | None
) -> None:
    """A Warning Event MembersUnschedulable when the scheduler starts refusing member
    pods: once per episode (from the first observation that finds such pods to the first
    that finds none), not once per observation, and not again when the refused pods or the
    scheduler's words change within the episode. The end posts nothing: the
    MembersSchedulable condition turns True, with its lastTransitionTime. Called only when
    the pods were read (or need not be), so an unreadable list ends no episode. A new
    operator process takes an episode going on from the `status` the last one wrote."""
    state = memo.group
    was = (
        state.unschedulable
        if state.unschedulable is not None
        else scheduling.unschedulable_in_status(status)
    )
    if found is not None and not was:
        kopf.warn(body, reason=scheduling.EVENT_REASON, message=found.message())
    state.unschedulable = found is not None


async def _durables_lag(js: Any, config: GroupConfig, members: dict[str, MemberStats]) -> int:
    """The lag of a `limits` or `interest` stream's group: what its members report, and
    the durables of the partitions none of them runs (all of them for a group scaled to
    zero), asked at once. A durable that does not answer fails the whole figure: a lag
    that leaves partitions out would look like progress."""
    reported, unrun = observe.members_lag(members, config.partitions)
    progress = await asyncio.gather(*(partition_progress(js, config, p) for p in unrun))
    return reported + sum(lag for lag, _ in progress)


async def _read_group(
    etcd: Etcd,
    namespace: str,
    name: str,
    partitions: int,
    garbage_logged: set[tuple[str, int]] | None = None,
) -> tuple[GroupStatus, int]:
    """The group as etcd holds it now (shoal.group.status.read_status), and the
    revision of that listing. Garbage values are logged once per `garbage_logged`."""
    view = GroupView(etcd, Keys(namespace, name), partitions, garbage_logged=garbage_logged)
    view.load(*await etcd.get_prefix(view.keys.prefix))
    return status_from_view(view, namespace, name), view.revision


async def _stalls_between(
    memo: OperatorMemo, etcd: Etcd, keys: Keys, partitions: int, revision: int
) -> set[tuple[int, str]]:
    """The stalls members reported since the last observation, up to `revision` (the
    listing just read), from the group's StallWatch; started here at the first
    observation, and again after it failed or the etcd client changed (a rotated
    Secret), from `revision` on."""
    state = memo.group
    watch = state.stall_watch
    if watch is not None and not watch.failed and watch.etcd is etcd:
        return watch.take(revision)
    if watch is not None:
        await watch.stop()
    state.stall_watch = None
    watch = StallWatch(etcd, keys.members, partitions)
    try:
        await watch.start(revision + 1)
    except Exception as exc:  # a best effort: the listing still shows what is stalled now
        log.warning("Could not watch the members of %s: %s", keys.prefix, describe(exc))
        return set()
    state.stall_watch = watch
    return set()


def _report_stalls(
    body: kopf.Body,
    memo: OperatorMemo,
    status: Any,
    stalled: tuple[tuple[int, str], ...],
    between: set[tuple[int, str]],
    stall_after: int,
    members: int,
) -> None:
    """A Warning Event PartitionStalled when a member starts reporting partitions stalled,
    a Normal PartitionStallEnded when it stops: one pair per episode, not one per
    observation, even for an episode that began and ended between two observations
    (`between`). Called only when etcd was read, so an etcd outage ends no episode (and
    does not repeat the Warning once etcd is back). A new operator process takes the
    episodes going on from the `status` the last one wrote."""
    state = memo.group
    known = state.stalled if state.stalled is not None else observe.stalls_in_status(status)
    started, ended = observe.stall_changes(known, stalled, between)
    for member, partitions in started.items():
        kopf.warn(
            body,
            reason="PartitionStalled",
            message=observe.stall_started_message(member, partitions, stall_after, members),
        )
    for member, partitions in ended.items():
        kopf.info(
            body,
            reason="PartitionStallEnded",
            message=observe.stall_ended_message(member, partitions),
        )
    state.stalled = frozenset(stalled)


def _report_refusals(
    body: kopf.Body, memo: OperatorMemo, status: Any, refused: tuple[tuple[str, str, str], ...]
) -> None:
    """A Warning Event (reason NatsAuthFailed / NatsTLSFailed) when a member starts
    reporting that NATS refuses it, a Normal NatsRefusalEnded when it stops: once per
    episode, not per observation. Like _report_stalls, called only when etcd was read,
    and a new operator process takes the episodes going on from the `status`."""
    state = memo.group
    known = state.refused if state.refused is not None else observe.refusals_in_status(status)
    messages = {(m, reason): message for m, reason, message in refused}
    started, ended = observe.refusal_changes(known, messages)
    for member, reason in started:
        kopf.warn(
            body,
            reason=reason,
            message=observe.refused_message([(member, reason, messages[member, reason])]),
        )
    for member, reason in ended:
        kopf.info(
            body,
            reason="NatsRefusalEnded",
            message=f"Member {member} no longer reports that NATS refuses it ({reason}): "
            "NATS accepts it now, or the member left",
        )
    state.refused = frozenset(messages)


async def _no_space(
    etcd: Etcd, body: kopf.Body, memo: OperatorMemo, status: Any, endpoints: str
) -> tuple[str, str] | None:
    """EtcdNoSpace while the group's etcd has its NOSPACE alarm raised (a Warning Event
    when it is raised, a Normal one when it is cleared; nothing in between). A new
    operator process takes whether it was raised from the `status` the last one wrote
    (observe.no_space_in_status), so a restart neither posts the Warning again nor misses
    the end of an alarm cleared meanwhile."""
    state = memo.group
    known = (
        state.etcd_no_space
        if state.etcd_no_space is not None
        else observe.no_space_in_status(status)
    )
    message = (
        f"etcd at {endpoints} has its NOSPACE alarm raised and refuses writes: members "
        "consume the partitions they hold, but none can join, claim or move a partition "
        "until space is freed (etcdctl compact, defrag, alarm disarm)"
    )
    try:
        raised = await memo.alarms.nospace(etcd)
    except Exception as exc:  # a best effort (the status read itself has just worked):
        log.debug("etcd alarms unavailable: %r", exc)  # keep what we knew
        state.etcd_no_space = known
        return ("EtcdNoSpace", message) if known else None
    if raised and not known:
        kopf.warn(body, reason="EtcdNoSpace", message=message)
    elif known and not raised:
        kopf.info(
            body,
            reason="EtcdSpaceRecovered",
            message=f"etcd at {endpoints} accepts writes again (NOSPACE alarm cleared)",
        )
    state.etcd_no_space = raised
    return ("EtcdNoSpace", message) if raised else None


# What an unreachable etcd raises (connecting, or a call on a cached client).
_ETCD_DOWN: tuple[type[BaseException], ...] = (EtcdUnavailable, *TRANSIENT_ERRORS)

# A deleted group whose etcd Secret is gone (and was never read by this process) keeps
# its etcd keys after this many retries, rather than blocking its namespace's deletion
# (and its streams likewise, for its NATS Secrets).
DELETE_SECRET_RETRIES = 5


def _secret_retry(memo: OperatorMemo, message: str, exc: BaseException) -> None:
    """Deleting the group, its etcd or NATS Secret cannot be used (gone, forbidden,
    invalid): retry, with backoff, until DELETE_SECRET_RETRIES such failures; then return
    (the caller leaves what the Secret was for in place). Counted here, not by kopf's
    `retry`, which also counts the retries that waited for the consumer pods to leave or
    for etcd to answer: those must not use up the Secret's. One count for both Secrets: a
    finalizer that gave up on one does not wait as long again for the other."""
    state = memo.group
    if state.delete_secret_failures < DELETE_SECRET_RETRIES:
        delay = min(30, 3 * 2**state.delete_secret_failures)
        state.delete_secret_failures += 1
        raise kopf.TemporaryError(message, delay=delay) from exc


def _etcd_unreachable_on_delete(
    memo: OperatorMemo,
    body: kopf.Body,
    status: kopf.Status,
    patch: kopf.Patch,
    meta: kopf.Meta,
    model: ConsumerGroupSpec,
    endpoints: str,
    prefix: str,
    exc: BaseException,
) -> None:
    """Deleting a group, etcd is unreachable: retry for a bounded time, saying so in status
    (Degraded, EtcdUnreachable) and in one Warning Event, then let deletionPolicy decide.

    Retain: the user keeps what the group leaves outside Kubernetes, so the etcd keys stay
    (an EtcdKeysKept Event names them) and the group goes. Delete: the user asked for
    everything gone, so the finalizer keeps waiting for etcd (one more Event says so, and
    how to give up by hand), retrying every 30 s. Either way no Event per retry.
    """
    state = memo.group
    timeout = float(memo.settings.delete_etcd_timeout_seconds)
    if state.delete_etcd_failing_since is None:
        state.delete_etcd_failing_since = time.monotonic()
        kopf.warn(
            body,
            reason="EtcdUnreachable",
            message=f"Deleting: etcd at {endpoints} unreachable ({describe(exc)}); retrying "
            f"for {timeout:.0f} s, then deletionPolicy {model.deletion_policy} decides",
        )
    waited = time.monotonic() - state.delete_etcd_failing_since
    if waited < timeout:
        message = (
            f"Deleting: etcd at {endpoints} unreachable for {waited:.0f} s ({describe(exc)}); "
            f"the keys under {prefix} are not cleared yet"
        )
        delay = min(10.0, max(1.0, timeout - waited))
        _degraded_retry(status, patch, meta, "EtcdUnreachable", message, delay, exc)
    if model.deletion_policy == "Retain":
        message = (
            f"etcd at {endpoints} unreachable for {waited:.0f} s while deleting; "
            f"deletionPolicy Retain: the group's etcd keys under {prefix} are left in place "
            f"(etcdctl del --prefix {prefix} once etcd is back)"
        )
        kopf.warn(body, reason="EtcdKeysKept", message=message)
        log.warning("Group %s: %s", body.get("metadata", {}).get("name"), message)
        return
    message = (
        f"etcd at {endpoints} unreachable for {waited:.0f} s while deleting; deletionPolicy "
        f"Delete: waiting for etcd to clear the keys under {prefix} (to give up, set "
        f"deletionPolicy: Retain, or remove the finalizer {FINALIZER})"
    )
    if not state.delete_etcd_decided:
        state.delete_etcd_decided = True
        kopf.warn(body, reason="EtcdUnreachable", message=message)
    _degraded_retry(status, patch, meta, "EtcdUnreachable", message, 30, exc)


def _degraded_retry(
    status: kopf.Status,
    patch: kopf.Patch,
    meta: kopf.Meta,
    reason: str,
    message: str,
    delay: float,
    exc: BaseException,
) -> NoReturn:
    """A deletion step that must wait: Degraded (reason, message) in status, and kopf
    retries the handler in `delay` seconds."""
    patch.status["conditions"] = observe.degraded(
        status.get("conditions", []), reason, message, int(meta.get("generation") or 0), now()
    )
    raise kopf.TemporaryError(message, delay=delay) from exc


def _streams_not_deleted(
    memo: OperatorMemo,
    body: kopf.Body,
    status: kopf.Status,
    patch: kopf.Patch,
    meta: kopf.Meta,
    nats_url: str,
    streams: list[str],
    exc: BaseException,
) -> None:
    """Deleting a group with deletionPolicy Delete, its streams could not be deleted (NATS
    unreachable, or refusing): retry for a bounded time, saying so in status (Degraded,
    StreamsNotDeleted) and in one Warning Event, then let the group go and leave the
    streams (a StreamsKept Warning names them, and how to delete them by hand).

    Bounded, unlike an unreachable etcd with Delete: the streams are outside the cluster
    and can be deleted by hand at any time, while a finalizer that never ends blocks the
    namespace's deletion with it. Returns once the time is up (the caller lets the
    finalizer go); raises kopf.TemporaryError before.
    """
    state = memo.group
    timeout = float(memo.settings.delete_nats_timeout_seconds)
    names = ", ".join(streams)
    if state.delete_streams_failing_since is None:
        state.delete_streams_failing_since = time.monotonic()
        kopf.warn(
            body,
            reason="StreamsNotDeleted",
            message=f"Deleting: stream(s) {names} not deleted (JetStream at {redacted(nats_url)}: "
            f"{exc!r}); retrying for {timeout:.0f} s, then they are left in place",
        )
    waited = time.monotonic() - state.delete_streams_failing_since
    if waited < timeout:
        message = (
            f"Deleting: stream(s) {names} not deleted for {waited:.0f} s (JetStream at "
            f"{redacted(nats_url)}: {exc!r}); retrying"
        )
        delay = min(10.0, max(1.0, timeout - waited))
        _degraded_retry(status, patch, meta, "StreamsNotDeleted", message, delay, exc)
    message = (
        f"stream(s) {names} could not be deleted for {waited:.0f} s (JetStream at "
        f"{redacted(nats_url)}: {exc!r}); deletionPolicy Delete, but they are left in place: "
        "delete them by hand (nats stream rm) once NATS lets you"
    )
    kopf.warn(body, reason="StreamsKept", message=message)
    log.warning("Group %s: %s", body.get("metadata", {}).get("name"), message)


@kopf.on.delete(API_GROUP, API_VERSION, PLURAL)
async def delete(
    name: str,
    namespace: str | None,
    spec: kopf.Spec,
    memo: OperatorMemo,
    body: kopf.Body,
    status: kopf.Status,
    patch: kopf.Patch,
    meta: kopf.Meta,
    **_: Any,  # kopf's `retry` too: the deletion steps count their own (_secret_retry)
) -> None:
    try:
        await _delete(name, namespace, spec, memo, body, status, patch, meta)
    finally:
        # The clients only this group used: closed. A retry takes them up again.
        clients: NatsClients = memo.nats
        await clients.release(id(memo.group))
        etcds: EtcdClients = memo.etcd
        await etcds.release(id(memo.group))


async def _delete(
    name: str,
    namespace: str | None,
    spec: kopf.Spec,
    memo: OperatorMemo,
    body: kopf.Body,
    status: kopf.Status,
    patch: kopf.Patch,
    meta: kopf.Meta,
) -> None:
    namespace = namespace or "default"  # ConsumerGroups are namespaced
    settings: OperatorSettings = memo.settings
    # The group's own state needs no clearing (kopf drops its memo with the object), but
    # its etcd watch would outlive it.
    watch = memo.group.stall_watch
    if watch is not None:
        memo.group.stall_watch = None
        await watch.stop()
    model = deletable_spec(spec)
    config = pod_config(name, namespace, model, settings)
    # The consumers must be gone first: garbage collection would remove them only after
    # this finalizer, and a live leader would write the assignment straight back.
    remaining = await memo.kube.remove_consumers(
        namespace, resource_names(name)["deployment"], selector_string(name)
    )
    if remaining:
        raise kopf.TemporaryError(f"waiting for {remaining} consumer pods to leave", delay=3)
    prefix = Keys(namespace, name).prefix
    try:
        etcd = await _etcd(
            memo, config.etcd_endpoints, namespace, etcd_secret_name(model), stale_ok=True
        )
        await etcd.delete_prefix(prefix)
    except EtcdSecretProblem as exc:
        _secret_retry(memo, exc.message, exc)
        message = f"{exc.message}: the group's etcd keys under {prefix} are left in place"
        kopf.warn(body, reason="EtcdKeysKept", message=message)
    except _ETCD_DOWN as exc:
        _etcd_unreachable_on_delete(
            memo, body, status, patch, meta, model, config.etcd_endpoints, prefix, exc
        )
    if model.deletion_policy == "Delete":
        streams = [config.stream, config.dlq_stream, config.log_stream, config.ledger_stream]
        try:
            nc = await _nats(memo, config, model.nats, attempts=2, stale_ok=True)
        except NatsSecretProblem as exc:
            _secret_retry(memo, exc.message, exc)
            message = f"{exc.message}: the group's streams are left in place"
            kopf.warn(body, reason="StreamsKept", message=message)
            return
        except Exception as exc:  # NATS unreachable: as a refused delete, below
            _streams_not_deleted(memo, body, status, patch, meta, config.nats_url, streams, exc)
            return
        if not nc.is_connected:
            # A kept connection that is reconnecting buffers what is published meanwhile
            # and sends it once NATS is back: a STREAM.DELETE timed out here would then
            # delete the streams later, after StreamsKept said they were left in place
            # (seen in e2e/test_operator_delete.py). Send nothing until it is connected.
            gone = ConnectionError("not connected: reconnecting")
            _streams_not_deleted(memo, body, status, patch, meta, config.nats_url, streams, gone)
            return
        js = nc.jetstream()
        failed: list[str] = []
        error: BaseException | None = None
        for stream in streams:
            try:
                await js.delete_stream(stream)
            except NotFoundError:
                pass  # already gone, or never made (the ledger stream is optional)
            except Exception as exc:
                # Anything else (a timeout, NATS away, a permission refused) left the
                # stream in place: deletionPolicy Delete promised it gone.
                log.warning("Stream %s not deleted: %r", stream, exc)
                failed.append(stream)
                error = exc
        if error is not None:
            _streams_not_deleted(memo, body, status, patch, meta, config.nats_url, failed, error)
            return
        log.info("Deleted group %s/%s with its streams", namespace, name)
    else:
        log.info(
            "Deleted group %s/%s; kept stream %s (deletionPolicy Retain)",
            namespace,
            name,
            config.stream,
        )
