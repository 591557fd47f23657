"""The reconciler's steps and its per-group state, without servers.

Kubernetes, NATS and etcd are fakes here: these tests pin down what reconcile decides and
reports (Degraded reasons, messages, backoff, Events, the state it keeps per group). That
the operator really works against an API server, NATS and etcd is e2e/test_operator.py's
and e2e/test_etcd_tls.py's to prove.
"""

from __future__ import annotations

import asyncio
import base64
import copy
import dataclasses
import json
import logging
import tempfile
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, cast

import kopf
import pytest
from kubernetes.client.rest import ApiException
from nats import errors as nats_errors
from nats.js.errors import NotFoundError

from harness.localkube.pki import ensure_pki
from shoal.clients.natsauth import NatsSecurity
from shoal.contracts.spec import SpecError
from shoal.contracts.values import ScaleRecord
from shoal.group.jetstream import StreamConfigConflict
from shoal.operator import reconciler
from shoal.operator.builders import (
    NATS_CREDENTIALS_SECRET_VERSION,
    NATS_TLS_SECRET_VERSION,
    NatsPodSecrets,
    pod_config,
    selector_string,
)
from shoal.operator.etcdsecret import EtcdClients, SecretData
from shoal.operator.kube import Kube
from shoal.operator.natssecret import NatsClients
from shoal.operator.reconciler import (
    GroupProblem,
    check_handler,
    ensure_jetstream,
    etcd_secret_version,
    nats_secrets,
)
from shoal.operator.settings import OperatorSettings
from shoal.operator.state import GroupState, OperatorMemo

NAMESPACE = "prod"
GOOD = "shoal.consumer.handlers:noop"
BAD = "no_such_module:handle"
NATS_URL = "nats://nats.test:4222"
SPEC = {"handler": GOOD}  # the least a spec has

CA = b"-----BEGIN CERTIFICATE-----\nMIIB\n-----END CERTIFICATE-----\n"
KEY = b"-----BEGIN PRIVATE KEY-----\nMIIE\n-----END PRIVATE KEY-----\n"


def b64(raw: bytes) -> str:
    return base64.b64encode(raw).decode()


TLS_DATA = {"ca.crt": b64(CA), "tls.crt": b64(CA), "tls.key": b64(KEY)}


def _real_ca() -> bytes:
    # The operator loads a NATS Secret's certificates before use: a real one.
    with tempfile.TemporaryDirectory() as directory:
        return ensure_pki(Path(directory), {}).ca_cert.read_bytes()


NATS_TLS_DATA = {"ca.crt": b64(_real_ca())}


async def call_handler(handler: object, **kwargs: Any) -> Any:
    """Call a kopf handler with only the kwargs it reads. kopf's decorators type a handler
    as kopf's callback protocol, which requires every kwarg kopf passes (logger, runtime,
    ...) and Spec/Meta/Status rather than the dicts these tests give."""
    return await cast(Callable[..., Awaitable[Any]], handler)(**kwargs)


# -- fakes -------------------------------------------------------------------------------------


class FakeKube(Kube):
    """The operator's Kube: applies recorded, Secrets from a dict, one Deployment status.

    A subclass, so that it goes where a Kube goes and mypy checks its methods against
    Kube's; it talks to no API server (Kube.__init__ is not called)."""

    def __init__(self) -> None:
        self.applied: list[dict[str, Any]] = []
        self.secrets: dict[tuple[str, str], SecretData] = {}

    async def apply(self, obj: dict[str, Any]) -> None:
        self.applied.append(obj)

    async def read_secret(self, namespace: str, name: str) -> SecretData | None:
        return self.secrets.get((namespace, name))

    async def deployment_status(self, namespace: str, name: str) -> dict[str, int]:
        return {"replicas": 0, "ready": 0}

    async def list_pods(self, namespace: str, selector: str) -> list[dict[str, Any]]:
        return []  # no pod yet, so none the scheduler refuses

    async def remove_consumers(self, namespace: str, deployment: str, selector: str) -> int:
        return 0  # the consumers are gone

    def kinds(self) -> list[str]:
        return [obj["kind"] for obj in self.applied]


def fake_kube(memo: OperatorMemo) -> FakeKube:
    """The memo's Kube: the FakeKube the operator_memo fixture had startup install."""
    kube = memo.kube
    assert isinstance(kube, FakeKube), kube
    return kube


@dataclass
class FakeStreamState:
    messages: int = 0


@dataclass
class FakeStreamInfo:
    state: FakeStreamState = field(default_factory=FakeStreamState)


class FakeJetStream:
    deleted: list[str] = []  # every FakeJetStream's: each test resets it
    missing: set[str] = set()  # streams STREAM.INFO says do not exist (tests monkeypatch it)
    # What delete_stream raises for a stream (none: it deletes it); tests monkeypatch it.
    delete_errors: dict[str, Exception] = {}

    async def stream_info(self, name: str) -> FakeStreamInfo:
        if name in self.missing:
            raise NotFoundError()
        return FakeStreamInfo()

    async def delete_stream(self, name: str) -> None:
        error = self.delete_errors.get(name)
        if error is not None:
            raise error
        self.deleted.append(name)


class FakeNats:
    connected = True  # every FakeNats's: tests monkeypatch it

    def __init__(self) -> None:
        self.is_closed = False

    @property
    def is_connected(self) -> bool:
        return self.connected

    def jetstream(self) -> FakeJetStream:
        return FakeJetStream()

    async def close(self) -> None:
        self.is_closed = True


class FakeEtcd:
    """An empty etcd: no members, no leader, no autoscaler record."""

    async def get_prefix(self, prefix: str) -> tuple[int, dict[str, Any]]:
        return 1, {}

    async def delete_prefix(self, prefix: str) -> None:
        pass


@dataclass
class World:
    """What the fakes saw: Events, ensure_group calls; what they should do next."""

    events: list[tuple[str, str, str]] = field(default_factory=list)  # type, reason, message
    ensured: list[str] = field(default_factory=list)  # streams ensure_group was asked for
    nats_error: Exception | None = None
    stream_error: Exception | None = None

    def reasons(self, kind: str) -> list[str]:
        return [reason for type_, reason, _ in self.events if type_ == kind]


@pytest.fixture
def world(monkeypatch: pytest.MonkeyPatch) -> World:
    """kopf's Events, NATS and etcd replaced by fakes that record into a World."""
    w = World()

    def event(kind: str) -> Any:
        def post(body: Any, *, reason: str, message: str = "") -> None:
            w.events.append((kind, reason, message))

        return post

    async def connect(url: str, **_: Any) -> FakeNats:
        if w.nats_error is not None:
            raise w.nats_error
        return FakeNats()

    async def ensure_group(js: Any, config: Any, *, ledger: bool = False) -> None:
        if w.stream_error is not None:
            raise w.stream_error
        w.ensured.append(config.stream)

    async def etcd(*_: Any, **__: Any) -> FakeEtcd:
        return FakeEtcd()

    monkeypatch.setattr(kopf, "info", event("Normal"))
    monkeypatch.setattr(kopf, "warn", event("Warning"))
    monkeypatch.setattr(reconciler, "connect", connect)
    monkeypatch.setattr(reconciler, "ensure_group", ensure_group)
    monkeypatch.setattr(reconciler, "_etcd", etcd)
    return w


@pytest.fixture
async def operator_memo(monkeypatch: pytest.MonkeyPatch) -> AsyncIterator[OperatorMemo]:
    """The operator's memo as the real startup handler fills it (with a fake Kube), and
    the real cleanup handler at the end."""
    monkeypatch.setattr(reconciler, "api_client", lambda: object())
    monkeypatch.setattr(reconciler, "Kube", lambda api: FakeKube())
    monkeypatch.setenv("NATS_URL", NATS_URL)
    memo = OperatorMemo()
    await call_handler(reconciler.startup, settings=kopf.OperatorSettings(), memo=memo)
    yield memo
    await call_handler(reconciler.cleanup_clients, memo=memo)


def resource_memo(operator_memo: OperatorMemo) -> OperatorMemo:
    """A group's memo, made as kopf makes it (kopf._core.reactor.inventory): copy.copy of
    the operator's memo, i.e. a shallow copy."""
    return copy.copy(operator_memo)


def body(name: str, uid: str | None = None) -> kopf.Body:
    return kopf.Body(
        {
            "apiVersion": "shoal.dev/v1alpha1",
            "kind": "ConsumerGroup",
            "metadata": {"name": name, "namespace": NAMESPACE, "uid": uid or f"uid-{name}"},
        }
    )


async def reconcile(
    memo: OperatorMemo,
    name: str,
    spec: dict[str, Any],
    *,
    retry: int = 0,
    status: dict[str, Any] | None = None,
    old: dict[str, Any] | None = None,
    generation: int = 1,
    patch: kopf.Patch | None = None,
) -> kopf.Patch:
    """Call the reconcile handler as kopf would; the patch it made (pass one to see it
    when the handler raises)."""
    patch = kopf.Patch() if patch is None else patch
    await call_handler(
        reconciler.reconcile,
        name=name,
        namespace=NAMESPACE,
        spec=spec,
        meta={"generation": generation},
        status=status or {},
        body=body(name),
        memo=memo,
        patch=patch,
        retry=retry,
        old=old,
    )
    return patch


async def observe(
    memo: OperatorMemo, name: str, spec: dict[str, Any], **indexes: Any
) -> dict[str, Any]:
    """Call the status timer as kopf would (with these kopf indexes); the status it wrote."""
    patch = kopf.Patch()
    await call_handler(
        reconciler.observe_group,
        name=name,
        namespace=NAMESPACE,
        spec=spec,
        meta={"generation": 1},
        status={},
        body=body(name),
        memo=memo,
        patch=patch,
        **indexes,
    )
    return dict(patch["status"])


def degraded_of(patch: kopf.Patch) -> dict[str, Any]:
    return next(c for c in patch["status"]["conditions"] if c["type"] == "Degraded")


# -- per-group state ---------------------------------------------------------------------------


async def test_two_groups_do_not_share_state(world: World, operator_memo: OperatorMemo) -> None:
    memo_a, memo_b = resource_memo(operator_memo), resource_memo(operator_memo)

    with pytest.raises(kopf.TemporaryError):
        await reconcile(memo_a, "alpha", {"replicas": 1, "handler": BAD})
    await reconcile(memo_b, "beta", {"replicas": 1, "handler": GOOD})

    a, b = memo_a.group, memo_b.group
    assert a is not b
    assert a.problem is not None and a.problem[0] == "HandlerInvalid"
    assert not a.applied  # nothing was applied for a group that cannot work
    assert b == GroupState(
        problem=None,
        applied=True,
        secret_version=None,
        nats_secrets=NatsPodSecrets(),
        reconciled_generation=1,
    )
    # Nothing per group landed where every group's memo is copied from.
    assert operator_memo.group == GroupState()
    # The status timer of each group reports its own problem only.
    st_a = await observe(memo_a, "alpha", {"replicas": 1, "handler": BAD})
    st_b = await observe(memo_b, "beta", {"replicas": 1, "handler": GOOD})
    assert degraded_reason(st_a) == "HandlerInvalid"
    assert degraded_reason(st_b) == "AsExpected"


async def test_groups_share_the_operator_wide_things(
    world: World, operator_memo: OperatorMemo
) -> None:
    memo_a, memo_b = resource_memo(operator_memo), resource_memo(operator_memo)
    await reconcile(memo_a, "alpha", {"replicas": 1, "handler": GOOD})
    for key in ("settings", "kube", "etcd", "nats"):
        assert getattr(memo_a, key) is getattr(memo_b, key) is getattr(operator_memo, key), key
    # The NATS connection alpha made is the one beta gets.
    assert len(operator_memo.nats) == 1
    await reconcile(memo_b, "beta", {"replicas": 1, "handler": GOOD})
    assert len(operator_memo.nats) == 1
    assert world.ensured == [f"shoal_{NAMESPACE}_alpha", f"shoal_{NAMESPACE}_beta"]


def test_each_copy_of_the_memo_has_a_fresh_group_state_and_the_shared_clients() -> None:
    memo = OperatorMemo()
    memo.kube = FakeKube()
    memo.group.applied = True
    copied = copy.copy(memo)
    assert copied.group == GroupState() and copied.group is not memo.group
    assert copied.kube is memo.kube
    assert copied.has("kube") and not copied.has("nats")


def degraded_reason(st: dict[str, Any]) -> str:
    return str(next(c for c in st["conditions"] if c["type"] == "Degraded")["reason"])


# -- step 1: the handler -----------------------------------------------------------------------

SETTINGS = OperatorSettings(nats_url=NATS_URL)


def test_a_known_handler_passes() -> None:
    check_handler({"handler": GOOD}, SETTINGS, retry=0)


def test_a_custom_image_may_carry_handlers_the_operator_cannot_import() -> None:
    check_handler({"handler": BAD, "image": "registry.example/app:1"}, SETTINGS, retry=0)


@pytest.mark.parametrize(
    ("retry", "delay"), [(0, 10), (1, 20), (2, 40), (3, 60), (4, 60), (5, 60), (9, 60)]
)
def test_an_unknown_handler_is_handler_invalid_with_backoff(retry: int, delay: int) -> None:
    with pytest.raises(GroupProblem) as caught:
        check_handler({"handler": BAD}, SETTINGS, retry=retry)
    assert caught.value.reason == "HandlerInvalid"
    assert "no_such_module" in caught.value.message
    assert caught.value.delay == delay


# -- step 2: the etcd Secret -------------------------------------------------------------------


@pytest.fixture
def clients(tmp_path: Path) -> Iterator[tuple[EtcdClients, FakeKube]]:
    kube = FakeKube()
    etcd_clients = EtcdClients(kube, tmp_path / "etcd-secrets")
    yield etcd_clients, kube
    etcd_clients.close()


async def test_no_etcd_secret_no_version(clients: tuple[EtcdClients, FakeKube]) -> None:
    etcd_clients, _ = clients
    assert await etcd_secret_version(etcd_clients, NAMESPACE, {**SPEC, "etcd": {}}, retry=0) is None
    assert await etcd_secret_version(etcd_clients, NAMESPACE, SPEC, retry=0) is None


async def test_the_etcd_secret_version(clients: tuple[EtcdClients, FakeKube]) -> None:
    etcd_clients, kube = clients
    kube.secrets[(NAMESPACE, "etcd-client")] = SecretData("42", TLS_DATA)
    spec = {**SPEC, "etcd": {"tlsSecret": "etcd-client"}}
    assert await etcd_secret_version(etcd_clients, NAMESPACE, spec, retry=0) == "42"


@pytest.mark.parametrize(("retry", "delay"), [(0, 5), (1, 10), (3, 40), (4, 60), (8, 60)])
async def test_a_missing_etcd_secret_is_a_problem_with_backoff(
    clients: tuple[EtcdClients, FakeKube], retry: int, delay: int
) -> None:
    etcd_clients, _ = clients
    spec = {**SPEC, "etcd": {"tlsSecret": "etcd-client"}}
    with pytest.raises(GroupProblem) as caught:
        await etcd_secret_version(etcd_clients, NAMESPACE, spec, retry=retry)
    assert caught.value.reason == "EtcdSecretMissing"
    assert caught.value.message == f"Secret {NAMESPACE}/etcd-client (spec.etcd.tlsSecret) not found"
    assert caught.value.delay == delay


async def test_an_invalid_etcd_secret_is_a_problem(clients: tuple[EtcdClients, FakeKube]) -> None:
    etcd_clients, kube = clients
    kube.secrets[(NAMESPACE, "etcd-client")] = SecretData("1", {"ca.crt": b64(CA)})
    with pytest.raises(GroupProblem) as caught:
        await etcd_secret_version(
            etcd_clients, NAMESPACE, {**SPEC, "etcd": {"tlsSecret": "etcd-client"}}, retry=0
        )
    assert caught.value.reason == "EtcdSecretInvalid"
    assert "tls.crt, tls.key" in caught.value.message


# -- step 6: JetStream -------------------------------------------------------------------------


def config_of(name: str = "orders") -> Any:
    return pod_config(name, NAMESPACE, {"replicas": 1, "handler": GOOD}, SETTINGS)


@pytest.fixture
async def nats_memo(tmp_path: Path) -> AsyncIterator[OperatorMemo]:
    """A memo with the operator's NATS connections (Secrets from a FakeKube)."""
    kube = FakeKube()
    memo = OperatorMemo()
    memo.kube = kube
    memo.nats = NatsClients(kube, NatsSecurity(), tmp_path / "nats")
    yield memo
    await memo.nats.close()


async def test_jetstream_ensured(world: World, nats_memo: OperatorMemo) -> None:
    memo = nats_memo
    await ensure_jetstream(memo, config_of(), retry=0)
    assert world.ensured == [f"shoal_{NAMESPACE}_orders"]


async def test_a_stream_conflict_is_retried_after_a_minute(
    world: World, nats_memo: OperatorMemo
) -> None:
    world.stream_error = StreamConfigConflict("stream shoal_prod_orders: retention differs")
    with pytest.raises(GroupProblem) as caught:
        await ensure_jetstream(nats_memo, config_of(), retry=3)
    problem = caught.value
    assert (problem.reason, problem.message, problem.delay) == (
        "StreamConfigConflict",
        "stream shoal_prod_orders: retention differs",
        60,
    )


@pytest.mark.parametrize(
    ("retry", "delay"), [(0, 5), (1, 10), (2, 20), (3, 40), (4, 60), (6, 60), (10, 60)]
)
async def test_unreachable_nats_is_nats_unavailable_with_backoff(
    world: World, nats_memo: OperatorMemo, retry: int, delay: int
) -> None:
    world.nats_error = OSError("connection refused")
    memo = nats_memo
    with pytest.raises(GroupProblem) as caught:
        await ensure_jetstream(memo, config_of(), retry=retry)
    problem = caught.value
    assert problem.reason == "NatsUnavailable"
    assert problem.message == f"JetStream at {NATS_URL} unavailable: connection refused"
    assert problem.delay == delay
    assert len(memo.nats) == 0  # a failed connect is not kept: the next call tries again


# -- reconcile: the one place that reports problems --------------------------------------------


async def test_a_reconciled_group(world: World, operator_memo: OperatorMemo) -> None:
    memo = resource_memo(operator_memo)
    patch = await reconcile(memo, "orders", {"replicas": 2, "handler": GOOD})
    assert patch["status"] == {"selector": selector_string("orders"), "observedGeneration": 1}
    kinds = fake_kube(operator_memo).kinds()
    assert set(kinds) == {
        "Deployment",
        "ServiceAccount",
        "Role",
        "RoleBinding",
        "PodDisruptionBudget",
    }
    for obj in fake_kube(operator_memo).applied:  # adopted: deleting the group deletes them
        assert obj["metadata"]["ownerReferences"][0]["uid"] == "uid-orders"
    assert world.reasons("Warning") == []
    assert world.reasons("Normal") == ["Reconciled"]
    assert "orders-consumer with 2 replicas" in world.events[-1][2]


@dataclass
class Case:
    spec: dict[str, Any]
    reason: str
    delay: int
    applied: bool  # whether the children were applied before the problem was found
    stream_error: Exception | None = None
    nats_error: Exception | None = None
    secrets: dict[str, dict[str, str]] = field(default_factory=dict)


def refused(message: str) -> Exception:
    """What shoal.clients.nats.connect raises when NATS refuses the login."""
    error = ConnectionError(f"NATS at {NATS_URL} unreachable after 2 attempts")
    error.__cause__ = nats_errors.Error(message)
    return error


AUTH_DATA = {"user": b64(b"orders"), "password": b64(b"wrong-password")}

CASES = {
    "handler": Case({"handler": BAD}, "HandlerInvalid", 20, applied=False),
    "etcd-secret": Case(
        {"handler": GOOD, "etcd": {"tlsSecret": "gone"}}, "EtcdSecretMissing", 10, applied=False
    ),
    "stream": Case(
        {"handler": GOOD},
        "StreamConfigConflict",
        60,
        applied=True,
        stream_error=StreamConfigConflict("retention differs"),
    ),
    "nats": Case(
        {"handler": GOOD}, "NatsUnavailable", 10, applied=True, nats_error=OSError("refused")
    ),
    "nats-secret": Case(
        {"handler": GOOD, "nats": {"tlsSecret": "gone"}}, "NatsSecretMissing", 10, applied=False
    ),
    "nats-credentials-unusable": Case(
        {"handler": GOOD, "nats": {"credentialsSecret": "auth"}},
        "NatsSecretMissing",
        10,
        applied=False,
        secrets={"auth": {"user": b64(b"orders")}},
    ),
    "nats-auth": Case(
        {"handler": GOOD, "nats": {"credentialsSecret": "auth"}},
        "NatsAuthFailed",
        10,
        applied=True,
        nats_error=refused("nats: 'Authorization Violation'"),
        secrets={"auth": AUTH_DATA},
    ),
}


@pytest.mark.parametrize("case", CASES.values(), ids=CASES.keys())
async def test_each_problem_degrades_warns_and_retries(
    case: Case, world: World, operator_memo: OperatorMemo
) -> None:
    memo = resource_memo(operator_memo)
    world.stream_error, world.nats_error = case.stream_error, case.nats_error
    for secret, data in case.secrets.items():
        fake_kube(operator_memo).secrets[(NAMESPACE, secret)] = SecretData("1", data)
    ready = {
        "type": "Ready",
        "status": "True",
        "reason": "GroupReady",
        "message": "3 members",
        "observedGeneration": 1,
        "lastTransitionTime": "2026-01-01T00:00:00Z",
    }
    patch = kopf.Patch()
    with pytest.raises(kopf.TemporaryError) as caught:
        await reconcile(
            memo,
            "orders",
            {"replicas": 1, **case.spec},
            retry=1,
            status={"conditions": [ready]},
            generation=4,
            patch=patch,
        )
    degraded = degraded_of(patch)
    message = degraded["message"]
    assert (degraded["status"], degraded["reason"]) == ("True", case.reason)
    assert degraded["observedGeneration"] == 4
    # Ready says the problem at once, as the status timer will (Ready was True).
    first = patch["status"]["conditions"][0]
    assert (first["type"], first["status"], first["reason"]) == ("Ready", "False", case.reason)
    assert (
        first["message"] == message and first["lastTransitionTime"] != ready["lastTransitionTime"]
    )
    assert world.events == [("Warning", case.reason, message)]
    assert caught.value.delay == case.delay
    assert str(caught.value) == message
    assert isinstance(caught.value.__cause__, GroupProblem)
    state = memo.group
    assert state.problem == (case.reason, message)
    assert state.applied is case.applied
    assert bool(fake_kube(operator_memo).applied) is case.applied


async def test_a_problem_stands_until_a_reconcile_succeeds(
    world: World, operator_memo: OperatorMemo
) -> None:
    memo = resource_memo(operator_memo)
    spec = {"replicas": 1, "handler": GOOD}
    world.stream_error = StreamConfigConflict("retention differs")
    with pytest.raises(kopf.TemporaryError):
        await reconcile(memo, "orders", spec)
    # The status timer sees NATS and etcd working, and still reports the conflict.
    assert degraded_reason(await observe(memo, "orders", spec)) == "StreamConfigConflict"

    world.stream_error = None
    await reconcile(memo, "orders", spec, retry=1)
    assert memo.group.problem is None
    assert degraded_reason(await observe(memo, "orders", spec)) == "AsExpected"
    assert world.reasons("Warning") == ["StreamConfigConflict"]
    assert world.reasons("Normal") == ["Reconciled"]


async def test_other_errors_are_kopfs_to_retry_and_degrade_the_group(
    world: World, operator_memo: OperatorMemo, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Before, such an error left Degraded False (and the status timer said the group was
    fine) while kopf retried."""

    async def refuse(obj: dict[str, Any]) -> None:
        raise RuntimeError("something unforeseen")

    monkeypatch.setattr(operator_memo.kube, "apply", refuse)
    memo = resource_memo(operator_memo)
    spec = {"replicas": 1, "handler": GOOD}
    patch = kopf.Patch()
    with pytest.raises(RuntimeError, match="something unforeseen"):
        await reconcile(memo, "orders", spec, patch=patch)
    assert memo.group.problem == (
        "ReconcileFailed",
        "Reconcile failed: RuntimeError: something unforeseen",
    )
    assert degraded_of(patch)["reason"] == "ReconcileFailed"
    assert world.reasons("Warning") == ["ReconcileFailed"]
    assert degraded_reason(await observe(memo, "orders", spec)) == "ReconcileFailed"


async def test_a_child_the_api_server_refuses_is_degraded_with_its_words(
    world: World, operator_memo: OperatorMemo, monkeypatch: pytest.MonkeyPatch
) -> None:
    said = 'Deployment.apps "orders-consumer" is invalid: spec.template...: quantities must match'

    async def refuse(obj: dict[str, Any]) -> None:
        refused = ApiException(status=422, reason="Unprocessable Entity")
        refused.body = json.dumps({"kind": "Status", "message": said})  # as the client sets it
        raise refused

    monkeypatch.setattr(operator_memo.kube, "apply", refuse)
    memo = resource_memo(operator_memo)
    patch = kopf.Patch()
    with pytest.raises(kopf.TemporaryError) as caught:
        await reconcile(memo, "orders", {"replicas": 1, "handler": GOOD}, retry=1, patch=patch)
    assert caught.value.delay == 60  # a 4xx stands until the spec changes
    degraded = degraded_of(patch)
    assert degraded["reason"] == "ApplyFailed"
    assert degraded["message"] == (
        "ServiceAccount orders-consumer not applied: the API server answered 422 "
        f"Unprocessable Entity: {said}"
    )
    assert world.reasons("Warning") == ["ApplyFailed"]
    assert "observedGeneration" not in patch["status"]


async def test_observed_generation_is_the_last_one_applied(
    world: World, operator_memo: OperatorMemo, monkeypatch: pytest.MonkeyPatch
) -> None:
    memo = resource_memo(operator_memo)
    spec = {"replicas": 1, "handler": GOOD}

    async def observe_at(generation: int) -> dict[str, Any]:
        patch = kopf.Patch()
        await call_handler(
            reconciler.observe_group,
            name="orders",
            namespace=NAMESPACE,
            spec=spec,
            meta={"generation": generation},
            status={},
            body=body("orders"),
            memo=memo,
            patch=patch,
        )
        return dict(patch["status"])

    # Not reconciled by this process yet: the status keeps what it had.
    assert "observedGeneration" not in await observe_at(1)
    patch = await reconcile(memo, "orders", spec, generation=1)
    assert patch["status"]["observedGeneration"] == 1
    assert (await observe_at(1))["observedGeneration"] == 1

    async def refuse(obj: dict[str, Any]) -> None:
        raise RuntimeError("refused")

    monkeypatch.setattr(operator_memo.kube, "apply", refuse)
    with pytest.raises(RuntimeError):
        await reconcile(memo, "orders", spec, generation=2)
    st = await observe_at(2)
    assert st["observedGeneration"] == 1  # generation 2 was never applied
    assert degraded_reason(st) == "ReconcileFailed"


# -- step 4: a change of replicas --------------------------------------------------------------


async def test_a_replicas_change_is_recorded(world: World, operator_memo: OperatorMemo) -> None:
    memo = resource_memo(operator_memo)
    spec = {"replicas": 5, "handler": GOOD}
    patch = await reconcile(memo, "orders", spec, old={"spec": {"replicas": 3}})
    last = patch["status"]["lastScale"]
    assert (last["from"], last["to"], last["reason"]) == (3, 5, "spec.replicas changed")
    assert world.events[0] == ("Normal", "Scaled", "Replicas 3 -> 5")


async def test_a_retried_replicas_change_is_reported_once(
    world: World, operator_memo: OperatorMemo
) -> None:
    """kopf stores the spec it compares with only when a handler succeeds: each retry of a
    failed reconcile (NATS away) sees the same 3 -> 5. One Scaled Event, and lastScale as
    the first attempt wrote it; the change after is a new one."""
    memo = resource_memo(operator_memo)
    spec = {"replicas": 5, "handler": GOOD}
    world.nats_error = OSError("connection refused")
    written = []
    for retry in range(3):
        patch = kopf.Patch()
        with pytest.raises(kopf.TemporaryError):
            await reconcile(
                memo, "orders", spec, old={"spec": {"replicas": 3}}, retry=retry, patch=patch
            )
        written.append(patch["status"]["lastScale"])
        await asyncio.sleep(1.1)  # lastScale.time has whole seconds
    assert world.reasons("Normal") == ["Scaled"]
    assert written == [written[0]] * 3
    world.nats_error = None
    patch = await reconcile(memo, "orders", spec, old={"spec": {"replicas": 3}}, retry=3)
    assert patch["status"]["lastScale"] == written[0]
    assert world.reasons("Normal") == ["Scaled", "Reconciled"]

    patch = await reconcile(memo, "orders", {**spec, "replicas": 3}, old={"spec": spec})
    assert (patch["status"]["lastScale"]["from"], patch["status"]["lastScale"]["to"]) == (5, 3)
    assert world.reasons("Normal") == ["Scaled", "Reconciled", "Scaled", "Reconciled"]


async def test_a_retried_autoscaler_change_keeps_its_reason(
    world: World, operator_memo: OperatorMemo, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The autoscaler's record explains a change for SCALE_RECORD_MAX_AGE; a reconcile
    retried past that (kopf's 6th retry comes minutes later) still says the autoscaler's
    reason, not "spec.replicas changed", and posts no Scaled Event."""
    memo = resource_memo(operator_memo)
    spec = {"replicas": 5, "handler": GOOD}
    world.nats_error = OSError("connection refused")
    record = ScaleRecord(time=time.time() - 5, reason="lag 9000 > 3 x 2000", **{"from": 3, "to": 5})

    async def scale_record(*_: Any) -> ScaleRecord:
        return record

    monkeypatch.setattr(reconciler, "_scale_record", scale_record)
    reasons = []
    for retry in (0, 6):
        patch = kopf.Patch()
        with pytest.raises(kopf.TemporaryError):
            await reconcile(
                memo, "orders", spec, old={"spec": {"replicas": 3}}, retry=retry, patch=patch
            )
        reasons.append(patch["status"]["lastScale"]["reason"])
        record = record.model_copy(update={"time": time.time() - 301})  # minutes later
    assert reasons == ["autoscaler: lag 9000 > 3 x 2000"] * 2
    assert "Scaled" not in world.reasons("Normal")


async def test_an_unchanged_replicas_is_not_a_scale(
    world: World, operator_memo: OperatorMemo
) -> None:
    memo = resource_memo(operator_memo)
    spec = {"replicas": 3, "handler": GOOD}
    patch = await reconcile(memo, "orders", spec, old={"spec": {"replicas": 3}})
    assert "lastScale" not in patch["status"]
    assert world.reasons("Normal") == ["Reconciled"]


# -- the status timer and a rotated etcd Secret ------------------------------------------------


async def test_a_rotated_secret_rolls_only_its_own_group(
    world: World, operator_memo: OperatorMemo
) -> None:
    kube = fake_kube(operator_memo)
    for name in ("alpha", "beta"):
        kube.secrets[(NAMESPACE, f"{name}-etcd")] = SecretData("1", TLS_DATA)
    memos = {name: resource_memo(operator_memo) for name in ("alpha", "beta")}
    specs = {
        name: {"replicas": 1, "handler": GOOD, "etcd": {"tlsSecret": f"{name}-etcd"}}
        for name in memos
    }
    for name, memo in memos.items():
        await reconcile(memo, name, specs[name])
        assert memo.group.secret_version == "1"

    # alpha's Secret is rotated; the operator reads it (as its etcd client does).
    kube.secrets[(NAMESPACE, "alpha-etcd")] = SecretData("2", TLS_DATA)
    await operator_memo.etcd.files(NAMESPACE, "alpha-etcd")
    kube.applied.clear()
    world.events.clear()
    for name, memo in memos.items():
        await observe(memo, name, specs[name])

    assert [obj["metadata"]["name"] for obj in kube.applied] == ["alpha-consumer"]
    assert world.reasons("Normal") == ["EtcdSecretRotated"]
    assert memos["alpha"].group.secret_version == "2"
    assert memos["beta"].group.secret_version == "1"


async def test_the_timer_leaves_a_group_not_yet_reconciled_alone(
    world: World, operator_memo: OperatorMemo
) -> None:
    kube = fake_kube(operator_memo)
    kube.secrets[(NAMESPACE, "alpha-etcd")] = SecretData("1", TLS_DATA)
    await operator_memo.etcd.files(NAMESPACE, "alpha-etcd")
    memo = resource_memo(operator_memo)
    spec = {"replicas": 1, "handler": GOOD, "etcd": {"tlsSecret": "alpha-etcd"}}
    st = await observe(memo, "alpha", spec)
    assert kube.applied == []  # the resume handler applies it
    assert degraded_reason(st) == "AsExpected"
    # Nothing applied or remembered about Secrets; what it saw of stalls, of members NATS
    # refuses, of etcd's NOSPACE alarm, of pods the scheduler refuses and of pods that
    # crash-loop it may keep.
    kept = dataclasses.replace(
        memo.group,
        stalled=None,
        refused=None,
        etcd_no_space=None,
        unschedulable=None,
        failing=None,
        failing_last=None,
    )
    assert kept == GroupState()


async def test_the_timer_recreates_missing_streams_with_backoff_and_one_event(
    world: World, operator_memo: OperatorMemo, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Streams deleted after the reconcile: the timer runs the JetStream step again. A
    failure is in status and waits out its backoff; success posts one Warning and clears
    it. (e2e/test_operator_drift.py proves it on real servers.)"""
    stream = f"shoal_{NAMESPACE}_orders"
    memo = resource_memo(operator_memo)
    spec = {"replicas": 1, "handler": GOOD}
    await reconcile(memo, "orders", spec)
    world.ensured.clear()
    world.events.clear()
    monkeypatch.setattr(FakeJetStream, "missing", {stream, f"{stream}_log"})

    world.stream_error = RuntimeError("JetStream said no")
    for _ in range(2):  # the second observation is within the backoff: no new attempt
        st = await observe(memo, "orders", spec)
        assert degraded_reason(st) == "NatsUnavailable"
        message = next(c for c in st["conditions"] if c["type"] == "Degraded")["message"]
        assert f"{stream}, {stream}_log missing; recreating them failed" in message, message
        assert "JetStream said no" in message
        assert memo.group.streams_retry == 1
    assert world.events == []

    world.stream_error = None
    memo.group.streams_next_try = 0.0  # the backoff is over

    async def recreate(js: Any, config: Any) -> list[int]:
        FakeJetStream.missing = set()
        world.ensured.append(config.stream)
        return []

    monkeypatch.setattr(reconciler, "ensure_group", recreate)
    st = await observe(memo, "orders", spec)
    assert degraded_reason(st) == "AsExpected"
    assert world.ensured == [stream]
    assert world.reasons("Warning") == ["StreamRecreated"]
    assert "the messages they held are gone" in world.events[0][2]
    await observe(memo, "orders", spec)  # present again: nothing more
    assert world.ensured == [stream] and len(world.events) == 1


async def test_the_timer_recreates_missing_streams_while_etcd_is_down(
    world: World, operator_memo: OperatorMemo, monkeypatch: pytest.MonkeyPatch
) -> None:
    stream = f"shoal_{NAMESPACE}_orders"
    memo = resource_memo(operator_memo)
    spec = {"replicas": 1, "handler": GOOD}
    await reconcile(memo, "orders", spec)
    world.ensured.clear()
    monkeypatch.setattr(FakeJetStream, "missing", {f"{stream}_dlq"})

    async def etcd_down(*_: Any, **__: Any) -> FakeEtcd:
        raise ConnectionError("etcd is down")

    monkeypatch.setattr(reconciler, "_etcd", etcd_down)
    st = await observe(memo, "orders", spec)
    assert world.ensured == [stream]
    assert world.reasons("Warning") == ["StreamRecreated"]
    assert degraded_reason(st) == "EtcdUnavailable"


async def test_the_timer_applies_a_deleted_deployment_again(
    world: World, operator_memo: OperatorMemo, monkeypatch: pytest.MonkeyPatch
) -> None:
    kube = fake_kube(operator_memo)
    memo = resource_memo(operator_memo)
    spec = {"replicas": 2, "handler": GOOD}
    st = await observe(memo, "orders", spec)  # not applied by this process: left alone
    assert kube.applied == []

    await reconcile(memo, "orders", spec)
    kube.applied.clear()
    world.events.clear()

    async def no_deployment(namespace: str, name: str) -> None:
        return None

    monkeypatch.setattr(kube, "deployment_status", no_deployment)
    st = await observe(memo, "orders", spec)
    assert "Deployment" in kube.kinds()
    assert world.reasons("Warning") == ["DeploymentRecreated"]
    assert degraded_reason(st) == "AsExpected"


def test_a_group_stored_at_zero_with_autoscaling_can_still_be_deleted() -> None:
    """The CRD and the model now refuse replicas 0 with autoscaling on (issue 24, defect
    10d); a group stored before that must not block its own finalizer."""
    stored = {"handler": "a:b", "replicas": 0, "autoscaling": {"enabled": True}}
    with pytest.raises(SpecError, match="replicas must be at least 1 while autoscaling"):
        reconciler.spec_model(stored)
    model = reconciler.deletable_spec(stored)
    assert (model.replicas, model.autoscaling.enabled, model.handler) == (0, False, "a:b")
    with pytest.raises(SpecError, match="minReplicas must not exceed maxReplicas"):
        reconciler.deletable_spec({"handler": "a:b", "minReplicas": 5, "maxReplicas": 2})


# -- the group's NATS Secrets ------------------------------------------------------------------


async def test_the_pods_follow_the_nats_secrets_and_the_operator_reads_them(
    world: World, operator_memo: OperatorMemo, monkeypatch: pytest.MonkeyPatch
) -> None:
    kube = fake_kube(operator_memo)
    kube.secrets[(NAMESPACE, "nats-tls")] = SecretData("5", NATS_TLS_DATA)
    kube.secrets[(NAMESPACE, "nats-auth")] = SecretData("6", AUTH_DATA)
    used: list[NatsSecurity] = []

    async def connect(url: str, *, security: NatsSecurity, **_: Any) -> FakeNats:
        used.append(security)
        return FakeNats()

    monkeypatch.setattr(reconciler, "connect", connect)
    memo = resource_memo(operator_memo)
    nats = {"tlsSecret": "nats-tls", "credentialsSecret": "nats-auth"}
    spec = {"replicas": 1, "handler": GOOD, "nats": nats}
    await reconcile(memo, "orders", spec)

    (deployment,) = [obj for obj in kube.applied if obj["kind"] == "Deployment"]
    template = deployment["spec"]["template"]
    assert template["metadata"]["annotations"] == {
        NATS_TLS_SECRET_VERSION: "5",
        NATS_CREDENTIALS_SECRET_VERSION: "6",
    }
    env = {var["name"]: var for var in template["spec"]["containers"][0]["env"]}
    assert env["NATS_PASSWORD"]["valueFrom"]["secretKeyRef"] == {
        "name": "nats-auth",
        "key": "password",
    }
    assert env["NATS_CA_FILE"]["value"] == "/etc/shoal/nats-tls/ca.crt"
    assert "NATS_CERT_FILE" not in env  # a CA-only Secret
    # The operator connected with what it read through the API, not the pods' paths.
    (security,) = used
    assert security.user == "orders" and security.password == "wrong-password"
    assert security.ca_file is not None
    assert security.ca_file.startswith(str(operator_memo.nats.root))
    assert memo.group.nats_secrets == NatsPodSecrets(
        credentials="user", client_certificate=False, tls_version="5", credentials_version="6"
    )


async def test_nats_secrets_step(operator_memo: OperatorMemo) -> None:
    clients: NatsClients = operator_memo.nats
    assert await nats_secrets(clients, NAMESPACE, SPEC, retry=0) == NatsPodSecrets()
    spec = {**SPEC, "nats": {"credentialsSecret": "nats-auth"}}
    with pytest.raises(GroupProblem) as caught:
        await nats_secrets(clients, NAMESPACE, spec, retry=3)
    assert (caught.value.reason, caught.value.delay) == ("NatsSecretMissing", 40)
    assert caught.value.message == (
        f"Secret {NAMESPACE}/nats-auth (spec.nats.credentialsSecret) not found"
    )


async def test_a_refused_login_shows_in_status(world: World, operator_memo: OperatorMemo) -> None:
    fake_kube(operator_memo).secrets[(NAMESPACE, "auth")] = SecretData("1", AUTH_DATA)
    world.nats_error = refused("nats: 'Authorization Violation'")
    st = await observe(
        resource_memo(operator_memo),
        "orders",
        {"replicas": 1, "handler": GOOD, "nats": {"credentialsSecret": "auth"}},
    )
    degraded = next(c for c in st["conditions"] if c["type"] == "Degraded")
    assert degraded["reason"] == "NatsAuthFailed"
    assert f"Secret {NAMESPACE}/auth (spec.nats.credentialsSecret)" in degraded["message"]
    assert "wrong-password" not in degraded["message"]


async def test_a_rotated_nats_secret_rolls_only_its_own_group(
    world: World, operator_memo: OperatorMemo
) -> None:
    kube = fake_kube(operator_memo)
    for name in ("alpha", "beta"):
        kube.secrets[(NAMESPACE, f"{name}-nats")] = SecretData("1", NATS_TLS_DATA)
    memos = {name: resource_memo(operator_memo) for name in ("alpha", "beta")}
    specs = {
        name: {"replicas": 1, "handler": GOOD, "nats": {"tlsSecret": f"{name}-nats"}}
        for name in memos
    }
    for name, memo in memos.items():
        await reconcile(memo, name, specs[name])
    kube.secrets[(NAMESPACE, "alpha-nats")] = SecretData("2", NATS_TLS_DATA)
    kube.applied.clear()
    world.events.clear()
    for name, memo in memos.items():
        await observe(memo, name, specs[name])

    (deployment,) = kube.applied
    assert deployment["metadata"]["name"] == "alpha-consumer"
    annotations = deployment["spec"]["template"]["metadata"]["annotations"]
    assert annotations == {NATS_TLS_SECRET_VERSION: "2"}
    assert world.reasons("Normal") == ["NatsSecretRotated"]
    assert "alpha-nats (version 2)" in world.events[0][2]
    state = memos["alpha"].group.nats_secrets
    assert state is not None and state.tls_version == "2"
    # Observed again: nothing more to roll.
    kube.applied.clear()
    await observe(memos["alpha"], "alpha", specs["alpha"])
    assert kube.applied == []


async def test_a_rotated_nats_secret_that_is_refused_rolls_nothing(
    world: World, operator_memo: OperatorMemo
) -> None:
    kube = fake_kube(operator_memo)
    kube.secrets[(NAMESPACE, "auth")] = SecretData("1", AUTH_DATA)
    memo = resource_memo(operator_memo)
    spec = {"replicas": 1, "handler": GOOD, "nats": {"credentialsSecret": "auth"}}
    await reconcile(memo, "orders", spec)
    kube.secrets[(NAMESPACE, "auth")] = SecretData("2", AUTH_DATA)
    world.nats_error = refused("nats: 'Authorization Violation'")
    kube.applied.clear()
    st = await observe(memo, "orders", spec)
    assert degraded_reason(st) == "NatsAuthFailed"
    assert kube.applied == []  # new pods could not log in either: the old ones stay


async def delete(memo: OperatorMemo, name: str, spec: dict[str, Any], retry: int = 0) -> None:
    """Call the deletion handler as kopf would."""
    await call_handler(
        reconciler.delete,
        name=name,
        namespace=NAMESPACE,
        spec=spec,
        memo=memo,
        body=body(name),
        status={},
        patch=kopf.Patch(),
        meta={"generation": 1},
        retry=retry,
    )


async def test_deleting_uses_the_nats_secret_read_before_if_it_is_gone(
    world: World, operator_memo: OperatorMemo
) -> None:
    """Deleting a namespace removes the Secret before the group's finalizer runs."""
    FakeJetStream.deleted = []
    kube = fake_kube(operator_memo)
    kube.secrets[(NAMESPACE, "auth")] = SecretData("1", AUTH_DATA)
    memo = resource_memo(operator_memo)
    spec = {
        "replicas": 1,
        "handler": GOOD,
        "deletionPolicy": "Delete",
        "nats": {"credentialsSecret": "auth"},
    }
    await reconcile(memo, "orders", spec)
    del kube.secrets[(NAMESPACE, "auth")]
    await delete(memo, "orders", spec)
    assert FakeJetStream.deleted[0] == f"shoal_{NAMESPACE}_orders"


async def test_deleting_with_a_nats_secret_never_seen_keeps_the_streams_at_last(
    world: World, operator_memo: OperatorMemo
) -> None:
    FakeJetStream.deleted = []
    memo = resource_memo(operator_memo)
    spec = {"handler": GOOD, "deletionPolicy": "Delete", "nats": {"tlsSecret": "gone"}}
    for retry in range(reconciler.DELETE_SECRET_RETRIES):
        with pytest.raises(kopf.TemporaryError, match="gone"):
            await delete(memo, "orders", spec, retry=retry)
    await delete(memo, "orders", spec, retry=reconciler.DELETE_SECRET_RETRIES)
    assert FakeJetStream.deleted == []
    assert world.reasons("Warning") == ["StreamsKept"]
    assert "streams are left in place" in world.events[-1][2]


async def test_waiting_for_the_pods_to_leave_spends_none_of_the_secret_retries(
    world: World, operator_memo: OperatorMemo, monkeypatch: pytest.MonkeyPatch
) -> None:
    """kopf's `retry` also counts the retries that waited for the consumer pods to leave:
    the Secret still gets its DELETE_SECRET_RETRIES retries after they have left."""
    FakeJetStream.deleted = []
    memo = resource_memo(operator_memo)
    spec = {"handler": GOOD, "deletionPolicy": "Delete", "nats": {"tlsSecret": "gone"}}
    pods = [2, 2, 1, 1, 1, 1]  # members draining for ~20 s (kopf retries every 3 s)

    async def remove_consumers(*_: Any) -> int:
        return pods.pop(0) if pods else 0

    monkeypatch.setattr(fake_kube(operator_memo), "remove_consumers", remove_consumers)
    waited: list[str] = []
    retry = 0
    while True:
        try:
            await delete(memo, "orders", spec, retry=retry)
            break
        except kopf.TemporaryError as exc:
            waited.append("pods" if "consumer pods to leave" in str(exc) else "secret")
            retry += 1
    assert waited == ["pods"] * 6 + ["secret"] * reconciler.DELETE_SECRET_RETRIES
    assert world.reasons("Warning") == ["StreamsKept"]


async def delete_with(
    memo: OperatorMemo, name: str, spec: dict[str, Any], patch: kopf.Patch
) -> None:
    """The deletion handler, with a patch of the caller's (to read the status it wrote)."""
    await call_handler(
        reconciler.delete,
        name=name,
        namespace=NAMESPACE,
        spec=spec,
        memo=memo,
        body=body(name),
        status={},
        patch=patch,
        meta={"generation": 1},
        retry=0,
    )


async def test_deleting_ignores_streams_that_are_already_gone(
    world: World, operator_memo: OperatorMemo, monkeypatch: pytest.MonkeyPatch
) -> None:
    stream = f"shoal_{NAMESPACE}_orders"
    FakeJetStream.deleted = []
    monkeypatch.setattr(
        FakeJetStream,
        "delete_errors",
        {f"{stream}_ledger": NotFoundError(), stream: NotFoundError()},
    )
    memo = resource_memo(operator_memo)
    await delete(memo, "orders", {"handler": GOOD, "deletionPolicy": "Delete"})
    assert FakeJetStream.deleted == [f"{stream}_dlq", f"{stream}_log"]
    assert world.events == []


async def test_streams_that_cannot_be_deleted_are_retried_then_kept_and_named(
    world: World, operator_memo: OperatorMemo, monkeypatch: pytest.MonkeyPatch
) -> None:
    """deletionPolicy Delete with a stream JetStream does not delete (here a timeout): the
    finalizer retries, says so in status and in one Warning, and after
    SHOAL_DELETE_NATS_TIMEOUT lets the group go with a StreamsKept Warning naming it.
    Before, the error was logged at debug level and the group went, the stream left."""
    stream = f"shoal_{NAMESPACE}_orders"
    FakeJetStream.deleted = []
    monkeypatch.setattr(FakeJetStream, "delete_errors", {stream: nats_errors.TimeoutError()})
    memo = resource_memo(operator_memo)
    spec = {"handler": GOOD, "deletionPolicy": "Delete"}

    for _ in range(2):  # the first failure and a retry
        patch = kopf.Patch()
        with pytest.raises(kopf.TemporaryError) as caught:
            await delete_with(memo, "orders", spec, patch)
        assert caught.value.delay is not None and 1 <= caught.value.delay <= 10
        degraded = degraded_of(patch)
        assert (degraded["status"], degraded["reason"]) == ("True", "StreamsNotDeleted")
        assert stream in degraded["message"], degraded
    # The others went; one Warning for the episode, not one per retry.
    assert set(FakeJetStream.deleted) == {f"{stream}_dlq", f"{stream}_log", f"{stream}_ledger"}
    assert world.reasons("Warning") == ["StreamsNotDeleted"]

    # The bounded time is up: the finalizer ends, and the kept stream is named.
    timeout = operator_memo.settings.delete_nats_timeout_seconds
    assert memo.group.delete_streams_failing_since is not None
    memo.group.delete_streams_failing_since -= timeout + 1
    await delete_with(memo, "orders", spec, kopf.Patch())
    assert world.reasons("Warning") == ["StreamsNotDeleted", "StreamsKept"]
    kept = world.events[-1][2]
    assert stream in kept and "left in place" in kept
    assert f"{stream}_dlq" not in kept  # only the one not deleted


async def test_unreachable_nats_while_deleting_is_retried_then_the_streams_kept(
    world: World, operator_memo: OperatorMemo
) -> None:
    world.nats_error = nats_errors.NoServersError()
    memo = resource_memo(operator_memo)
    spec = {"handler": GOOD, "deletionPolicy": "Delete"}
    with pytest.raises(kopf.TemporaryError, match="not deleted"):
        await delete(memo, "orders", spec)
    assert memo.group.delete_streams_failing_since is not None
    memo.group.delete_streams_failing_since -= operator_memo.settings.delete_nats_timeout_seconds
    await delete(memo, "orders", spec)
    assert world.reasons("Warning") == ["StreamsNotDeleted", "StreamsKept"]
    assert f"shoal_{NAMESPACE}_orders" in world.events[-1][2]


async def test_deleting_sends_nothing_on_a_reconnecting_connection(
    world: World, operator_memo: OperatorMemo, monkeypatch: pytest.MonkeyPatch
) -> None:
    """nats-py buffers what is published while it reconnects and sends it when NATS is
    back: a delete sent then would remove the streams after StreamsKept said they stay."""
    FakeJetStream.deleted = []
    monkeypatch.setattr(FakeNats, "connected", False)
    memo = resource_memo(operator_memo)
    spec = {"handler": GOOD, "deletionPolicy": "Delete"}
    with pytest.raises(kopf.TemporaryError, match="reconnecting"):
        await delete(memo, "orders", spec)
    assert FakeJetStream.deleted == []
    assert world.reasons("Warning") == ["StreamsNotDeleted"]


async def test_the_timer_applies_other_deleted_children_again(
    world: World, operator_memo: OperatorMemo
) -> None:
    """The watches (childwatch.py) no longer see the Role and the PDB, and a GET
    confirms them gone: the children are applied again, one Warning for each."""
    kube = fake_kube(operator_memo)
    memo = resource_memo(operator_memo)
    spec = {"replicas": 2, "handler": GOOD}
    await reconcile(memo, "orders", spec)
    kube.applied.clear()
    world.events.clear()
    child = "orders-consumer"
    seen = {(NAMESPACE, child): [True]}
    indexes = {
        "group_service_accounts": seen,
        "group_roles": {},
        "group_role_bindings": seen,
        "group_pdbs": {},
    }
    gone = {"Role", "PodDisruptionBudget"}
    asked: list[str] = []

    async def exists(api_version: str, kind: str, namespace: str, name: str) -> bool:
        asked.append(kind)
        return kind not in gone

    kube.exists = exists  # type: ignore[method-assign]
    st = await observe(memo, "orders", spec, **indexes)
    assert sorted(asked) == ["PodDisruptionBudget", "Role"]
    assert {"Role", "PodDisruptionBudget", "Deployment"} <= set(kube.kinds())
    assert sorted(world.reasons("Warning")) == ["PodDisruptionBudgetRecreated", "RoleRecreated"]
    assert degraded_reason(st) == "AsExpected"

    # Applied a moment ago and not seen by its watch yet: nothing to do.
    gone.clear()
    kube.applied.clear()
    world.events.clear()
    await observe(memo, "orders", spec, **indexes)
    assert kube.applied == [] and world.reasons("Warning") == []


# -- a refused change undone before kopf's retry ----------------------------------------------


async def test_the_timer_reconciles_a_refused_change_that_was_undone(
    world: World, operator_memo: OperatorMemo, monkeypatch: pytest.MonkeyPatch
) -> None:
    """kopf retries a refused change after its delay, but a change undone meanwhile is
    the spec kopf last handled: no handler, the retry dropped. The status timer
    reconciles it (after a grace of one tick, which kopf gets for an ordinary change);
    for the refused spec itself, it leaves the retry to kopf."""
    monkeypatch.setattr(reconciler, "UNDONE_GRACE_SECONDS", 0.0)
    memo = resource_memo(operator_memo)
    good, bad = {"replicas": 1, "handler": GOOD}, {"replicas": 1, "handler": BAD}
    await reconcile(memo, "orders", good, generation=1)
    with pytest.raises(kopf.TemporaryError):
        await reconcile(memo, "orders", bad, generation=2)
    world.events.clear()
    # Still the refused spec: kopf's to retry, the timer only reports it.
    assert degraded_reason(await observe(memo, "orders", bad)) == "HandlerInvalid"
    assert world.events == []
    # Undone: the timer reconciles what kopf will not.
    st = await observe(memo, "orders", good)
    assert degraded_reason(st) == "AsExpected"
    assert memo.group.problem is None and memo.group.problem_spec is None
    assert world.reasons("Normal") == ["Reconciled"]


async def test_a_timer_reconcile_that_fails_is_tried_again_later(
    world: World, operator_memo: OperatorMemo, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(reconciler, "UNDONE_GRACE_SECONDS", 0.0)
    memo = resource_memo(operator_memo)
    spec = {"replicas": 1, "handler": GOOD}
    await reconcile(memo, "orders", spec, generation=1)
    with pytest.raises(kopf.TemporaryError):
        await reconcile(memo, "orders", {"replicas": 1, "handler": BAD}, generation=2)
    world.stream_error = RuntimeError("JetStream said no")
    st = await observe(memo, "orders", spec)  # undone, but the reconcile fails now
    assert memo.group.problem is not None
    assert degraded_reason(st) == memo.group.problem[0] == "NatsUnavailable"
    retry_at = memo.group.timer_retry_at
    assert retry_at is not None
    world.stream_error = None
    world.events.clear()
    await observe(memo, "orders", spec)  # not yet: nothing tried
    assert world.events == [] and memo.group.problem is not None
    memo.group.timer_retry_at = time.monotonic()  # its time has come
    st = await observe(memo, "orders", spec)
    assert degraded_reason(st) == "AsExpected" and memo.group.timer_retry_at is None


async def test_a_rotated_secret_does_not_roll_pods_onto_a_refused_spec(
    world: World, operator_memo: OperatorMemo
) -> None:
    """The timer re-applies the Deployment when a Secret is rotated, from the live spec:
    one reconcile refused (a handler no pod can import) must not reach the pods that way."""
    kube = fake_kube(operator_memo)
    kube.secrets[(NAMESPACE, "orders-etcd")] = SecretData("1", TLS_DATA)
    memo = resource_memo(operator_memo)
    good = {"replicas": 1, "handler": GOOD, "etcd": {"tlsSecret": "orders-etcd"}}
    bad = {**good, "handler": BAD}
    await reconcile(memo, "orders", good, generation=1)
    with pytest.raises(kopf.TemporaryError):
        await reconcile(memo, "orders", bad, generation=2)
    kube.secrets[(NAMESPACE, "orders-etcd")] = SecretData("2", TLS_DATA)
    await operator_memo.etcd.files(NAMESPACE, "orders-etcd")
    kube.applied.clear()
    world.events.clear()
    st = await observe(memo, "orders", bad)
    assert kube.applied == []
    assert "EtcdSecretRotated" not in world.reasons("Normal")
    assert degraded_reason(st) == "HandlerInvalid"


async def test_the_timer_reports_a_stored_spec_the_model_refuses_without_raising(
    world: World, operator_memo: OperatorMemo, caplog: pytest.LogCaptureFixture
) -> None:
    """A spec stored before the model refused it (replicas 0 with autoscaling on, issue
    24) is SpecInvalid to the reconcile, which warns on each of its retries. The status
    timer used to raise SpecError every tick (kopf logs a traceback and posts an Error
    Event each time) and wrote nothing; it now writes the same conditions, once."""
    memo = resource_memo(operator_memo)
    stored = {"handler": GOOD, "replicas": 0, "autoscaling": {"enabled": True}}
    with pytest.raises(kopf.TemporaryError):
        await reconcile(memo, "orders", stored, generation=3)
    world.events.clear()
    with caplog.at_level(logging.WARNING):
        st = await observe(memo, "orders", stored)
    found = {c["type"]: c for c in st["conditions"]}
    for kind in ("Ready", "Progressing", "Degraded"):
        assert found[kind]["reason"] == "SpecInvalid", found
        assert "replicas must be at least 1 while autoscaling" in found[kind]["message"]
    assert found["Degraded"]["status"] == "True"
    assert world.events == []  # the reconcile's retries warn; the timer does not
    # Written once: the next tick, given the status it wrote, changes nothing.
    patch = kopf.Patch()
    await call_handler(
        reconciler.observe_group,
        name="orders",
        namespace=NAMESPACE,
        spec=stored,
        meta={"generation": 1},  # as observe() passes
        status=st,
        body=body("orders"),
        memo=memo,
        patch=patch,
    )
    assert "status" not in patch or not patch["status"]
