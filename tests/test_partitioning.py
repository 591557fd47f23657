"""partition_for and the subject names: the contracts producers and consumers share."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from shoal.consumer import partitioning
from shoal.contracts.names import (
    Keys,
    assignments_subject,
    default_stream_name,
    default_subject_prefix,
    dlq_subject,
    durable_name,
    ledger_subject,
    partition_for,
    partition_subject,
    stream_subjects,
)

# Computed by the seed design's Go function (sha256, big.Int, Mod), not by this code.
VECTORS = [
    ("project-0", 56, 1, 184),
    ("project-1", 53, 2, 565),
    ("project-42", 35, 4, 163),
    ("project-999", 2, 5, 130),
    ("a", 59, 1, 187),
    ("日本語", 37, 6, 165),
    ("p/with.dots", 69, 6, 837),
    ("0", 105, 2, 1001),
]


@pytest.mark.parametrize(("project", "p128", "p7", "p1024"), VECTORS)
def test_vectors_match_the_seed_go_implementation(
    project: str, p128: int, p7: int, p1024: int
) -> None:
    assert partition_for(project) == p128
    assert partition_for(project, 7) == p7
    assert partition_for(project, 1024) == p1024


@given(st.text(min_size=1), st.integers(min_value=1, max_value=5000))
def test_always_in_range_and_stable(project: str, partitions: int) -> None:
    p = partition_for(project, partitions)
    assert 0 <= p < partitions
    assert partition_for(project, partitions) == p


@pytest.mark.parametrize("bad", ["", None, 42, b"bytes", ["x"]])
def test_bad_project_ids_are_value_errors_naming_the_value(bad: object) -> None:
    with pytest.raises(ValueError, match="project id") as info:
        partition_for(bad)  # type: ignore[arg-type]
    assert repr(bad) in str(info.value)


def test_bad_partition_count() -> None:
    with pytest.raises(ValueError, match="partitions"):
        partition_for("x", 0)


def test_spread_over_1000_projects_is_even_enough() -> None:
    counts = [0] * 128
    for i in range(1000):
        counts[partition_for(f"project-{i}")] += 1
    assert max(counts) < 20 and min(counts) >= 1


def test_subjects_follow_the_contract() -> None:
    prefix = default_subject_prefix("prod", "orders")
    assert prefix == "shoal.prod.orders"
    assert partition_subject(prefix, 7) == "shoal.prod.orders.7"
    assert stream_subjects(prefix) == ["shoal.prod.orders.*"]
    # Two tokens below the prefix: never captured by the partition stream's "<prefix>.*".
    assert dlq_subject(prefix, 7) == "shoal.prod.orders.dlq.7"
    assert assignments_subject(prefix) == "shoal.prod.orders.log.assignments"
    assert ledger_subject(prefix, 7) == "shoal.prod.orders.ledger.7"
    assert durable_name(7) == "p7"
    assert default_stream_name("prod", "orders-v2") == "shoal_prod_orders-v2"


@pytest.mark.parametrize("bad", ["a.b", "a b", "*", ">", ""])
def test_names_that_break_subjects_are_refused(bad: str) -> None:
    with pytest.raises(ValueError, match="NATS subject token"):
        default_subject_prefix("ns", bad)


def test_etcd_keys_follow_the_contract() -> None:
    keys = Keys("prod", "orders")
    assert keys.member("c-1") == "/shoal/prod/orders/members/c-1"
    assert keys.leader == "/shoal/prod/orders/leader"
    assert keys.partition(5) == "/shoal/prod/orders/partitions/5"
    assert keys.claim(5) == "/shoal/prod/orders/claims/5"


def test_the_documented_import_path_still_works() -> None:
    # DESIGN.md names shoal.consumer.partitioning.partition_for as a public contract.
    assert partitioning.partition_for is partition_for
    assert partitioning.partition_for("project-0") == partition_for("project-0", 128)
