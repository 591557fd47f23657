"""The reconciler's per-group state, without servers.

Kubernetes, NATS and etcd are fakes here: these tests pin down the state reconcile and
the status timer keep per group, and that groups do not share it. That
the operator really works against an API server, NATS and etcd is e2e/test_operator.py's
and e2e/test_etcd_tls.py's to prove.
"""

from __future__ import annotations

import base64
import copy
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

import kopf
import pytest

from shoal.operator import reconciler
from shoal.operator.etcdsecret import SecretData
from shoal.operator.state import MEMO_KEY, GroupState, group_state

NAMESPACE = "prod"
GOOD = "shoal.consumer.handlers:noop"
BAD = "no_such_module:handle"
NATS_URL = "nats://nats.test:4222"

CA = b"-----BEGIN CERTIFICATE-----\nMIIB\n-----END CERTIFICATE-----\n"
KEY = b"-----BEGIN PRIVATE KEY-----\nMIIE\n-----END PRIVATE KEY-----\n"


def b64(raw: bytes) -> str:
    return base64.b64encode(raw).decode()


TLS_DATA = {"ca.crt": b64(CA), "tls.crt": b64(CA), "tls.key": b64(KEY)}


# -- fakes -------------------------------------------------------------------------------------


class FakeKube:
    """The operator's Kube: applies recorded, Secrets from a dict, one Deployment status."""

    def __init__(self) -> None:
        self.applied: list[dict[str, Any]] = []
        self.secrets: dict[tuple[str, str], SecretData] = {}

    async def apply(self, obj: dict[str, Any]) -> None:
        self.applied.append(obj)

    async def read_secret(self, namespace: str, name: str) -> SecretData | None:
        return self.secrets.get((namespace, name))

    async def deployment_status(self, namespace: str, name: str) -> dict[str, int]:
        return {"replicas": 0, "ready": 0}

    def kinds(self) -> list[str]:
        return [obj["kind"] for obj in self.applied]


@dataclass
class FakeStreamState:
    messages: int = 0


@dataclass
class FakeStreamInfo:
    state: FakeStreamState = field(default_factory=FakeStreamState)


class FakeJetStream:
    async def stream_info(self, name: str) -> FakeStreamInfo:
        return FakeStreamInfo()


class FakeNats:
    def __init__(self) -> None:
        self.is_closed = False

    def jetstream(self) -> FakeJetStream:
        return FakeJetStream()

    async def close(self) -> None:
        self.is_closed = True


class FakeEtcd:
    """An empty etcd: no members, no leader, no autoscaler record."""

    async def get_prefix(self, prefix: str) -> tuple[int, dict[str, Any]]:
        return 1, {}


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
async def operator_memo(monkeypatch: pytest.MonkeyPatch) -> AsyncIterator[kopf.Memo]:
    """The operator's memo as the real startup handler fills it (with a fake Kube), and
    the real cleanup handler at the end."""
    monkeypatch.setattr(reconciler, "api_client", lambda: object())
    monkeypatch.setattr(reconciler, "Kube", lambda api: FakeKube())
    monkeypatch.setenv("NATS_URL", NATS_URL)
    memo = kopf.Memo()
    await reconciler.startup(settings=kopf.OperatorSettings(), memo=memo)
    yield memo
    await reconciler.cleanup_clients(memo=memo)


def resource_memo(operator_memo: kopf.Memo) -> kopf.Memo:
    """A group's memo, made as kopf makes it (kopf._core.reactor.inventory): copy.copy of
    the operator's memo, i.e. a shallow copy."""
    memo: kopf.Memo = copy.copy(operator_memo)
    return memo


def body(name: str, uid: str | None = None) -> kopf.Body:
    return kopf.Body(
        {
            "apiVersion": "shoal.dev/v1alpha1",
            "kind": "ConsumerGroup",
            "metadata": {"name": name, "namespace": NAMESPACE, "uid": uid or f"uid-{name}"},
        }
    )


async def reconcile(
    memo: kopf.Memo,
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
    await reconciler.reconcile(
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


async def observe(memo: kopf.Memo, name: str, spec: dict[str, Any]) -> dict[str, Any]:
    """Call the status timer as kopf would; the status it wrote."""
    patch = kopf.Patch()
    await reconciler.observe_group(
        name=name,
        namespace=NAMESPACE,
        spec=spec,
        meta={"generation": 1},
        status={},
        body=body(name),
        memo=memo,
        patch=patch,
    )
    return dict(patch["status"])


# -- per-group state ---------------------------------------------------------------------------


async def test_two_groups_do_not_share_state(world: World, operator_memo: kopf.Memo) -> None:
    memo_a, memo_b = resource_memo(operator_memo), resource_memo(operator_memo)

    with pytest.raises(kopf.TemporaryError):
        await reconcile(memo_a, "alpha", {"replicas": 1, "handler": BAD})
    await reconcile(memo_b, "beta", {"replicas": 1, "handler": GOOD})

    a, b = group_state(memo_a), group_state(memo_b)
    assert a is not b
    assert a.problem is not None and a.problem[0] == "HandlerInvalid"
    assert not a.applied  # nothing was applied for a group that cannot work
    assert b == GroupState(problem=None, applied=True, secret_version=None)
    # Nothing per group landed where every group's memo is copied from.
    assert MEMO_KEY not in operator_memo
    # The status timer of each group reports its own problem only.
    st_a = await observe(memo_a, "alpha", {"replicas": 1, "handler": BAD})
    st_b = await observe(memo_b, "beta", {"replicas": 1, "handler": GOOD})
    assert degraded_reason(st_a) == "HandlerInvalid"
    assert degraded_reason(st_b) == "AsExpected"


async def test_groups_share_the_operator_wide_things(
    world: World, operator_memo: kopf.Memo
) -> None:
    memo_a, memo_b = resource_memo(operator_memo), resource_memo(operator_memo)
    await reconcile(memo_a, "alpha", {"replicas": 1, "handler": GOOD})
    for key in ("settings", "kube", "etcd", "nats"):
        assert memo_a[key] is memo_b[key] is operator_memo[key], key
    # The NATS connection alpha made is the one beta gets.
    assert len(operator_memo.nats) == 1
    await reconcile(memo_b, "beta", {"replicas": 1, "handler": GOOD})
    assert len(operator_memo.nats) == 1
    assert world.ensured == [f"shoal_{NAMESPACE}_alpha", f"shoal_{NAMESPACE}_beta"]


def test_group_state_is_created_once_per_memo() -> None:
    memo = kopf.Memo()
    state = group_state(memo)
    assert state == GroupState() and group_state(memo) is state
    memo[MEMO_KEY] = "not a state"
    with pytest.raises(TypeError):
        group_state(memo)


def degraded_reason(st: dict[str, Any]) -> str:
    return str(next(c for c in st["conditions"] if c["type"] == "Degraded")["reason"])


# -- the status timer and a rotated etcd Secret ------------------------------------------------


async def test_a_rotated_secret_rolls_only_its_own_group(
    world: World, operator_memo: kopf.Memo
) -> None:
    kube: FakeKube = operator_memo.kube
    for name in ("alpha", "beta"):
        kube.secrets[(NAMESPACE, f"{name}-etcd")] = SecretData("1", TLS_DATA)
    memos = {name: resource_memo(operator_memo) for name in ("alpha", "beta")}
    specs = {
        name: {"replicas": 1, "handler": GOOD, "etcd": {"tlsSecret": f"{name}-etcd"}}
        for name in memos
    }
    for name, memo in memos.items():
        await reconcile(memo, name, specs[name])
        assert group_state(memo).secret_version == "1"

    # alpha's Secret is rotated; the operator reads it (as its etcd client does).
    kube.secrets[(NAMESPACE, "alpha-etcd")] = SecretData("2", TLS_DATA)
    await operator_memo.etcd.files(NAMESPACE, "alpha-etcd")
    kube.applied.clear()
    world.events.clear()
    for name, memo in memos.items():
        await observe(memo, name, specs[name])

    assert [obj["metadata"]["name"] for obj in kube.applied] == ["alpha-consumer"]
    assert world.reasons("Normal") == ["EtcdSecretRotated"]
    assert group_state(memos["alpha"]).secret_version == "2"
    assert group_state(memos["beta"]).secret_version == "1"


async def test_the_timer_leaves_a_group_not_yet_reconciled_alone(
    world: World, operator_memo: kopf.Memo
) -> None:
    kube: FakeKube = operator_memo.kube
    kube.secrets[(NAMESPACE, "alpha-etcd")] = SecretData("1", TLS_DATA)
    await operator_memo.etcd.files(NAMESPACE, "alpha-etcd")
    memo = resource_memo(operator_memo)
    spec = {"replicas": 1, "handler": GOOD, "etcd": {"tlsSecret": "alpha-etcd"}}
    st = await observe(memo, "alpha", spec)
    assert kube.applied == []  # the resume handler applies it
    assert degraded_reason(st) == "AsExpected"
    assert group_state(memo) == GroupState()
