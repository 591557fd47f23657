"""The ConsumerGroup spec model (shoal.contracts.spec) against the CRD, and its parsing.

The CRD's schema (crds/consumergroup.yaml) and the model hold the same defaults, enums and
bounds: the API server applies the CRD's, everything else the model's, and a change to one
without the other fails here.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import pytest
import yaml
from pydantic import ValidationError

from shoal.consumer.scaler import Policy
from shoal.contracts.spec import (
    HANDLER_PATTERN,
    HANDLER_SOCKET_MAX_LENGTH,
    HANDLER_SOCKET_PATTERN,
    MAX_RATE_LIMIT,
    READY_PATH_PATTERN,
    STREAM_NAME_PATTERN,
    SUBJECT_PREFIX_PATTERN,
    AutoscalingSpec,
    ConsumerGroupSpec,
    ConsumerSpec,
    SpecError,
    StreamSpec,
    parse_spec,
)
from shoal.group.config import GroupConfig, group_config

ROOT = Path(__file__).resolve().parent.parent
CRD = ROOT / "crds" / "consumergroup.yaml"


def crd_spec_schema() -> dict[str, Any]:
    crd = yaml.safe_load(CRD.read_text())
    (version,) = crd["spec"]["versions"]
    schema: dict[str, Any] = version["schema"]["openAPIV3Schema"]["properties"]["spec"]
    return schema


def model_schema() -> dict[str, Any]:
    schema: dict[str, Any] = ConsumerGroupSpec.model_json_schema(by_alias=True)
    return schema


def resolve(node: dict[str, Any], defs: dict[str, Any]) -> dict[str, Any]:
    """Follow $ref, and take the non-null branch of an Optional (anyOf [X, null])."""
    if "$ref" in node:
        return resolve(defs[node["$ref"].rsplit("/", 1)[1]], defs)
    if "anyOf" in node:
        (branch,) = [b for b in node["anyOf"] if b.get("type") != "null"]
        return resolve({**branch, **{k: v for k, v in node.items() if k != "anyOf"}}, defs)
    return node


def pairs(
    crd: dict[str, Any], model: dict[str, Any], defs: dict[str, Any], path: str = "spec"
) -> list[tuple[str, dict[str, Any], dict[str, Any]]]:
    """(path, CRD property, model property) for every property of both, recursively."""
    out = []
    crd_props = crd.get("properties", {})
    model_props = resolve(model, defs).get("properties", {})
    assert set(crd_props) == set(model_props), (
        f"{path}: CRD-only {sorted(set(crd_props) - set(model_props))}, "
        f"model-only {sorted(set(model_props) - set(crd_props))}"
    )
    for name, crd_prop in crd_props.items():
        model_prop = resolve(model_props[name], defs)
        out.append((f"{path}.{name}", crd_prop, model_prop))
        if crd_prop.get("type") == "object" and "properties" in crd_prop:
            out += pairs(crd_prop, model_props[name], defs, f"{path}.{name}")
    return out


ALL_PAIRS = pairs(crd_spec_schema(), model_schema(), model_schema().get("$defs", {}))


def test_the_crd_and_the_model_have_the_same_fields() -> None:
    # pairs() asserts equal property sets at every level; this also covers `required`.
    assert len(ALL_PAIRS) >= 40
    assert crd_spec_schema()["required"] == model_schema()["required"] == ["handler"]


@pytest.mark.parametrize(("path", "crd", "model"), ALL_PAIRS, ids=[p for p, _, _ in ALL_PAIRS])
def test_defaults_enums_and_bounds_agree(
    path: str, crd: dict[str, Any], model: dict[str, Any]
) -> None:
    if crd.get("type") == "object" and "properties" in crd:
        # An object section: the CRD defaults it to {} so that its fields' defaults apply;
        # the model's default is the section with every field at its default.
        # (Sections without a default, like etcd, stay absent until someone sets them.)
        assert crd.get("default", {}) == {}, f"{path}: a section's default can only be {{}}"
        return
    if "default" in crd:
        assert model.get("default") == crd["default"], path
    else:
        # No CRD default: the model's is "unset" (empty or None), never a value the API
        # server would not show.
        assert model.get("default") in (None, "", [], {}), path
    if "enum" in crd:
        assert sorted(model["enum"]) == sorted(crd["enum"]), path
    # pydantic writes a bound it cannot place on the JSON type (inside an Optional) as
    # ge/le (gt for an exclusive one); the meaning is the same. OpenAPI v3 (the CRD) says
    # "exclusive" with a boolean beside the minimum, JSON Schema (the model) with a number.
    if crd.get("exclusiveMinimum"):
        assert model.get("exclusiveMinimum", model.get("gt")) == crd.get("minimum"), path
    else:
        assert model.get("minimum", model.get("ge")) == crd.get("minimum"), path
    assert model.get("maximum", model.get("le")) == crd.get("maximum"), path
    if "pattern" in crd:
        # The same string: the API server (Go's RE2) and pydantic then accept the same
        # values, as long as the pattern means the same to both engines (no `\s`, `\d`,
        # `\w`, whose sets differ: test_patterns_mean_the_same_to_both_engines).
        assert model.get("pattern") == crd["pattern"], path


def test_a_minimal_spec_gets_every_default() -> None:
    spec = parse_spec({"handler": "pkg.mod:fn"})
    assert spec.replicas == 3 and spec.partitions == 128
    assert (spec.min_replicas, spec.max_replicas) == (1, 10)
    assert spec.nats.stream == StreamSpec()
    assert spec.nats.consumer.ack_wait_seconds == 5
    assert spec.autoscaling == AutoscalingSpec()
    assert spec.assignment.strategy == "sticky"
    assert spec.deletion_policy == "Retain"


def test_camel_case_in_snake_case_out() -> None:
    spec = parse_spec(
        {
            "handler": "pkg.mod:fn",
            "nats": {"consumer": {"ackWaitSeconds": 2.5, "backoffSeconds": [1, 2]}},
            "etcd": {"tlsSecret": "etcd-client"},
            "deletionPolicy": "Delete",
        }
    )
    assert spec.nats.consumer == ConsumerSpec(ack_wait_seconds=2.5, backoff_seconds=[1.0, 2.0])
    assert spec.etcd.tls_secret == "etcd-client"
    assert spec.deletion_policy == "Delete"


@pytest.mark.parametrize(
    ("spec", "message"),
    [
        ({}, "spec.handler is required ('package.module:function' or an http(s) URL)"),
        ({"handler": "nocolon"}, "spec.handler"),
        ({"handler": "a:b", "autoscaling": {"enabled": "yes"}}, "spec.autoscaling.enabled"),
        ({"handler": "a:b", "autoscaling": {"cpuThreshold": "90"}}, "cpuThreshold"),
        ({"handler": "a:b", "partitions": 2.5}, "spec.partitions"),
        ({"handler": "a:b", "replicas": True}, "spec.replicas"),
        ({"handler": "a:b", "minReplicas": 4, "maxReplicas": 2}, "minReplicas must not exceed"),
        ({"handler": "a:b", "minReplicas": 0}, "spec.minReplicas must be at least 1: a group"),
        ({"handler": "a:b", "maxReplicas": 200}, "maxReplicas must not exceed partitions"),
        (
            {"handler": "a:b", "partitions": 4, "maxReplicas": 4, "replicas": 5},
            "replicas must not exceed partitions",
        ),
        (
            {"handler": "a:b", "replicas": 0, "autoscaling": {"enabled": True}},
            "spec: replicas must be at least 1 while autoscaling is enabled",
        ),
        (
            {"handler": "a:b", "assignment": {"strategy": "modulo", "loadAware": True}},
            "loadAware needs strategy sticky",
        ),
        ({"handler": "a:b", "nats": {"subjectPrefix": "a..b"}}, "spec.nats.subjectPrefix"),
        ({"handler": "a:b", "nats": {"consumer": {"backoffSeconds": [-1]}}}, "backoffSeconds"),
        *(
            (
                {"handler": "a:b", "nats": {"consumer": {"maxMessagesPerSecond": rate}}},
                "spec.nats.consumer.maxMessagesPerSecond must be a positive number of "
                "messages a second (leave it out, or null, for no limit)",
            )
            for rate in (-5, 0, 0.0, -0.5)
        ),
        # Before: accepted, and a member's share (limit x owned / partitions) was nan
        # or inf, which crashed its worker at every start.
        *(
            (
                {"handler": "a:b", "nats": {"consumer": {"maxMessagesPerSecond": rate}}},
                f"spec.nats.consumer.maxMessagesPerSecond must be {what} messages a second",
            )
            for rate, what in (
                (float("inf"), "a finite number of"),
                (float("nan"), "a finite number of"),
                (1e308, "at most 1e9"),
                (1e9 + 1, "at most 1e9"),
            )
        ),
        (
            {"handler": "a:b", "nats": {"consumer": {"maxMessagesPerSecond": "100"}}},
            "spec.nats.consumer.maxMessagesPerSecond",
        ),
        ("not a mapping", "spec must be a mapping"),
    ],
)
def test_bad_specs_are_one_readable_error(spec: Any, message: str) -> None:
    with pytest.raises(SpecError, match=re.escape(message)):
        parse_spec(spec)


REPLICAS_RULE = "!has(self.autoscaling) || !self.autoscaling.enabled || self.replicas >= 1"


def test_replicas_zero_stops_a_group_only_without_autoscaling() -> None:
    """Issue 24, defect 10d: `replicas: 0` was accepted with autoscaling on, and the group
    never came back: the autoscaler runs in the members, so with none there is no leader
    to bring it back to minReplicas. Without autoscaling, 0 keeps its meaning (the group
    is stopped by hand, its messages wait in the stream; the operator reports it Ready,
    ScaledToZero), as for a Deployment. The CRD refuses the same specs as the model, with
    the same message (e2e/test_crd.py proves the API server applies the rule, through
    the scale subresource too)."""
    assert parse_spec({"handler": "a:b", "replicas": 0}).replicas == 0
    with pytest.raises(SpecError) as refused:
        parse_spec({"handler": "a:b", "replicas": 0, "autoscaling": {"enabled": True}})
    message = str(refused.value).removeprefix("spec: ")
    rules = {
        r["rule"]: " ".join(r["message"].split())
        for r in crd_spec_schema()["x-kubernetes-validations"]
    }
    assert rules.get(REPLICAS_RULE) == message
    assert "disable autoscaling" in message


def test_max_messages_per_second_is_a_positive_number_or_unset() -> None:
    """Issue 27: no limit unless set; an integer or a fraction; null is unset (as the API
    server shows a field a merge patch removed)."""
    assert parse_spec({"handler": "a:b"}).nats.consumer.max_messages_per_second is None
    for rate in (200, 2000.0, 0.5):
        consumer = {"maxMessagesPerSecond": rate}
        spec = parse_spec({"handler": "a:b", "nats": {"consumer": consumer}})
        assert spec.nats.consumer.max_messages_per_second == rate
    unset = {"handler": "a:b", "nats": {"consumer": {"maxMessagesPerSecond": None}}}
    assert parse_spec(unset).nats.consumer.max_messages_per_second is None
    (field,) = [crd for path, crd, _ in ALL_PAIRS if path.endswith(".maxMessagesPerSecond")]
    assert (field["minimum"], field["exclusiveMinimum"], "default" in field) == (0, True, False)
    assert field["maximum"] == MAX_RATE_LIMIT == 1e9
    top = {"handler": "a:b", "nats": {"consumer": {"maxMessagesPerSecond": 1e9}}}
    assert parse_spec(top).nats.consumer.max_messages_per_second == 1e9
    with pytest.raises(ValidationError, match="finite number"):
        GroupConfig(group="g", max_messages_per_second=float("inf"))


def test_integral_floats_are_integers() -> None:
    assert parse_spec({"handler": "a:b", "replicas": 2.0}).replicas == 2


def test_unknown_fields_are_ignored() -> None:
    # A newer CRD's fields must not break an older reader of the same object.
    assert parse_spec({"handler": "a:b", "futureField": 1}).handler == "a:b"


def test_group_config_and_policy_derive_from_the_spec() -> None:
    spec = {
        "handler": "pkg.mod:fn",
        "partitions": 16,
        "maxReplicas": 8,
        "nats": {
            "stream": {"replicas": 3, "ledger": True},
            "consumer": {"maxDeliver": 9, "backoffSeconds": [1, 2], "maxMessagesPerSecond": 250},
        },
        "assignment": {"strategy": "modulo"},
        "autoscaling": {"enabled": True, "cooldownSeconds": 60},
    }
    config = group_config("prod", "orders", spec, nats_url="nats://n", etcd_endpoints="e:1")
    assert (config.partitions, config.stream_replicas, config.ledger) == (16, 3, True)
    assert (config.max_deliver, config.backoff, config.strategy) == (9, (1.0, 2.0), "modulo")
    assert config.max_messages_per_second == 250
    assert (config.nats_url, config.etcd_endpoints) == ("nats://n", "e:1")
    assert config.stream == "shoal_prod_orders"
    policy = Policy.from_spec(spec)
    assert (policy.enabled, policy.cooldown_seconds, policy.max_replicas) == (True, 60, 8)
    assert policy.partitions == 16


def test_the_consumers_defaults_are_the_specs() -> None:
    config = GroupConfig(group="g", member_id="m")
    spec = parse_spec({"handler": "a:b"})
    consumer, stream = spec.nats.consumer, spec.nats.stream
    assert config.partitions == spec.partitions
    assert (config.ack_wait, config.max_ack_pending, config.max_deliver) == (
        consumer.ack_wait_seconds,
        consumer.max_ack_pending,
        consumer.max_deliver,
    )
    assert config.max_messages_per_second is consumer.max_messages_per_second is None
    assert (config.retention, config.storage, config.stream_replicas, config.ledger) == (
        stream.retention,
        stream.storage,
        stream.replicas,
        stream.ledger,
    )
    assert (config.strategy, config.load_aware) == (
        spec.assignment.strategy,
        spec.assignment.load_aware,
    )
    policy = Policy()
    auto = spec.autoscaling
    assert (policy.interval_seconds, policy.cooldown_seconds, policy.cpu_threshold) == (
        auto.interval_seconds,
        auto.cooldown_seconds,
        auto.cpu_threshold,
    )
    assert (policy.min_replicas, policy.max_replicas, policy.partitions) == (
        spec.min_replicas,
        spec.max_replicas,
        spec.partitions,
    )


# -- the patterns: what the API server accepts, the model accepts ------------------------------


def test_patterns_mean_the_same_to_both_engines() -> None:
    r"""`\s`, `\d`, `\w` and `\b` are ASCII in Go's RE2 and Unicode in Python's re and
    pydantic's engine: a value the API server stored (e.g. "a\u00a0b") failed the model,
    and with it the status timer and the finalizer (deletable_spec). The CRD's patterns and
    CEL rules name their sets instead."""
    text = CRD.read_text()
    for escape in (r"\s", r"\S", r"\d", r"\D", r"\w", r"\W", r"\b"):
        assert escape not in text, f"the CRD uses {escape}"


# U+00A0 (no-break space), U+2003 (em space), U+0085 (next line), \v: whitespace to Python,
# not to RE2, so the API server accepts them in these fields and so must the model.
NOT_RE2_SPACE = ["\u00a0", "\u2003", "\u0085", "\v"]
RE2_SPACE = ["\t", "\n", "\f", "\r", " "]


def with_field(field: str, value: str) -> dict[str, Any]:
    spec: dict[str, Any] = {"handler": "pkg.mod:fn"}
    if field == "streamName":
        spec["nats"] = {"stream": {"name": value}}
    elif field == "subjectPrefix":
        spec["nats"] = {"subjectPrefix": value}
    elif field == "handlerReadyPath":
        spec["handlerReadyPath"] = value
    else:
        spec["handler"] = value
    return spec


FIELD_VALUES = {
    "streamName": "orders{}x",
    "subjectPrefix": "orders.in{}x",
    "handlerReadyPath": "/ready{}x",
    "handler": "http://127.0.0.1:8080/messages{}x",
}


@pytest.mark.parametrize("char", NOT_RE2_SPACE, ids=[f"U+{ord(c):04X}" for c in NOT_RE2_SPACE])
@pytest.mark.parametrize("field", sorted(FIELD_VALUES))
def test_what_is_no_whitespace_to_the_api_server_passes_the_model(field: str, char: str) -> None:
    value = FIELD_VALUES[field].format(char)
    crd_pattern = {
        "streamName": STREAM_NAME_PATTERN,
        "subjectPrefix": SUBJECT_PREFIX_PATTERN,
        "handlerReadyPath": READY_PATH_PATTERN,
        "handler": HANDLER_PATTERN,
    }[field]
    assert re.fullmatch(crd_pattern, value)
    parse_spec(with_field(field, value))


@pytest.mark.parametrize("char", RE2_SPACE, ids=[f"U+{ord(c):04X}" for c in RE2_SPACE])
@pytest.mark.parametrize("field", sorted(FIELD_VALUES))
def test_whitespace_to_the_api_server_is_refused_by_the_model(field: str, char: str) -> None:
    with pytest.raises(SpecError):
        parse_spec(with_field(field, FIELD_VALUES[field].format(char)))


def test_a_subject_prefix_with_a_unicode_space_reaches_the_members_config() -> None:
    """The members' configuration checks the prefix again (names.check_token): with the
    same set, or pod_config would fail where the model passed."""
    config = group_config(
        "prod",
        "orders",
        parse_spec(with_field("subjectPrefix", "orders.in\u00a0x")),
        nats_url="nats://n:4222",
        etcd_endpoints="e:2379",
    )
    assert config.subject_prefix == "orders.in\u00a0x"


@pytest.mark.parametrize("field", ["streamName", "subjectPrefix"])
def test_empty_stream_name_and_subject_prefix_mean_the_default(field: str) -> None:
    """As the CRD's descriptions say (the CRD's patterns refused "" before)."""
    spec = parse_spec(with_field(field, ""))
    config = group_config("prod", "orders", spec, nats_url="nats://n:4222", etcd_endpoints="e:2379")
    assert (config.stream, config.subject_prefix) == ("shoal_prod_orders", "shoal.prod.orders")


# -- spec.handlerSocket -------------------------------------------------------------------------


def test_a_handler_socket_with_an_http_handler() -> None:
    spec = parse_spec({"handler": "http://localhost/messages", "handlerSocket": "/run/h/s.sock"})
    assert spec.handler_socket == "/run/h/s.sock"
    for where in ("/var/run/h.sock", "/tmp/h.sock", "/run/a/b/h.sock"):
        parse_spec({"handler": "http://localhost/messages", "handlerSocket": where})
    assert parse_spec({"handler": "a:b"}).handler_socket == ""
    config = group_config("prod", "orders", spec, nats_url="nats://n:4222", etcd_endpoints="e:1")
    assert config.handler_socket == "/run/h/s.sock"


@pytest.mark.parametrize(
    ("spec", "words"),
    [
        ({"handler": "a:b"}, "handlerSocket needs an http:// URL handler"),
        ({"handler": "https://svc/m"}, "handlerSocket needs an http:// URL handler"),
        ({"handlerSocket": "run/s.sock"}, "spec.handlerSocket must be the absolute path"),
        ({"handlerSocket": "/s.sock"}, "spec.handlerSocket must be the absolute path"),
        ({"containers": [{"name": "a", "image": "i", "volumeMounts": "x"}]}, "must be a list"),
        ({"handlerSocket": "/run/../s.sock"}, "spec.handlerSocket must be the absolute path"),
        ({"handlerSocket": "/run/h s.sock"}, "spec.handlerSocket must be the absolute path"),
        ({"handlerSocket": "/run/" + "s" * 103}, "spec.handlerSocket must be at most 107"),
        ({"handlerSocket": "/etc/shoal/s.sock"}, "spec.handlerSocket must be the absolute path"),
        # An emptyDir there would hide the image's own files.
        ({"handlerSocket": "/opt/s.sock"}, "under /run/, /var/run/ or /tmp/"),
        ({"handlerSocket": "/run"}, "spec.handlerSocket must be the absolute path"),
    ],
)
def test_a_handler_socket_that_cannot_work_is_refused_readably(
    spec: dict[str, Any], words: str
) -> None:
    with pytest.raises(SpecError, match=re.escape(words)):
        parse_spec({"handler": "http://localhost/m", "handlerSocket": "/run/h/s.sock", **spec})


def test_the_handler_socket_pattern_is_the_crds() -> None:
    crd = yaml.safe_load(CRD.read_text())
    schema = crd["spec"]["versions"][0]["schema"]["openAPIV3Schema"]["properties"]["spec"]
    field = schema["properties"]["handlerSocket"]
    assert field["pattern"] == HANDLER_SOCKET_PATTERN
    assert field["maxLength"] == HANDLER_SOCKET_MAX_LENGTH
