"""The permission lists themselves (permissions.py) and `shoal-consumer permissions`.

Pure, except that the printed block is checked by a real nats-server (`-t`: parse the
configuration and exit). tests/test_nats_permissions.py runs a group with these lists.
"""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest
from click.testing import CliRunner

from harness.natssecurity import subject_matches
from harness.servers import NatsServer
from shoal.consumer.cli import main
from shoal.consumer.permissions import (
    default_inbox_prefix,
    member_permissions,
    operator_permissions,
    producer_permissions,
)
from shoal.group.config import GroupConfig


def config(group: str, **changes: object) -> GroupConfig:
    return GroupConfig.model_validate(
        {"group": group, "namespace": "shop", "ensure_jetstream": False, **changes}
    )


def test_a_member_may_use_its_own_group_only() -> None:
    a, b = config("orders"), config("payments")
    mine = member_permissions(a, default_inbox_prefix(a))
    # What a member of `orders` does, by subject.
    own = {
        "publish": [
            "$JS.API.CONSUMER.MSG.NEXT.shoal_shop_orders.p7",
            "$JS.ACK.shoal_shop_orders.p7.1.2.3.4.5",
            "$JS.API.CONSUMER.INFO.shoal_shop_orders.p7",
            "$JS.API.STREAM.MSG.GET.shoal_shop_orders",
            "$JS.API.STREAM.MSG.DELETE.shoal_shop_orders",
            "shoal.shop.orders.dlq.7",
            "shoal.shop.orders.log.assignments",
            "_SHOAL.HEALTH",
        ],
        "subscribe": [
            "_SHOAL_INBOX.shop.orders.abc.*",
            "shoal.shop.orders.7",
            "$JS.EVENT.ADVISORY.STREAM.DELETED.shoal_shop_orders",
            "$JS.EVENT.ADVISORY.CONSUMER.DELETED.shoal_shop_orders.p7",
            "$JS.EVENT.ADVISORY.CONSUMER.MAX_DELIVERIES.shoal_shop_orders.p7",
        ],
    }
    for subject in own["publish"]:
        assert any(subject_matches(p, subject) for p in mine.publish), subject
    for subject in own["subscribe"]:
        assert any(subject_matches(p, subject) for p in mine.subscribe), subject
    # The same things of the other group, or of JetStream at large, are not allowed.
    theirs = member_permissions(b, default_inbox_prefix(b))
    for subject in [
        *(s.replace("orders", "payments") for s in own["publish"] if "orders" in s),
        "$JS.API.STREAM.DELETE.shoal_shop_orders",
        "$JS.API.STREAM.CREATE.shoal_shop_orders",
        "$JS.API.CONSUMER.DURABLE.CREATE.shoal_shop_orders.p7",
        "$JS.API.STREAM.LIST",
        "shoal.shop.orders.7",  # a member never publishes work
    ]:
        assert not any(subject_matches(p, subject) for p in mine.publish), subject
    for subject in theirs.subscribe:
        concrete = subject.replace(">", "x").replace("*", "p1")
        assert not any(subject_matches(p, concrete) for p in mine.subscribe), subject
    assert not any(subject_matches(p, "_INBOX.abc.1") for p in mine.subscribe)
    # No user's inbox permission covers another's replies: the operator's _INBOX.> is
    # no prefix of the members' or the producers'.
    op, producer = operator_permissions(a), producer_permissions(a, "_SHOAL_PRODUCER.shop.orders")
    member_reply = default_inbox_prefix(a) + ".abc.1"
    producer_reply = "_SHOAL_PRODUCER.shop.orders.abc.1"
    assert not any(subject_matches(p, member_reply) for p in op.subscribe + producer.subscribe)
    assert not any(subject_matches(p, producer_reply) for p in op.subscribe + mine.subscribe)


def test_standalone_members_and_the_operator_manage_the_streams() -> None:
    managed = member_permissions(config("orders", ledger=True))
    assert not [s for s in managed.publish if "CREATE" in s or "UPDATE" in s]
    assert "shoal.shop.orders.ledger.*" in managed.publish
    standalone = member_permissions(config("orders", ensure_jetstream=True, ledger=True))
    for stream in ("shoal_shop_orders", "shoal_shop_orders_dlq", "shoal_shop_orders_log"):
        assert f"$JS.API.STREAM.CREATE.{stream}" in standalone.publish
        assert f"$JS.API.STREAM.UPDATE.{stream}" in standalone.publish
    assert "$JS.API.STREAM.CREATE.shoal_shop_orders_ledger" in standalone.publish
    assert "$JS.API.CONSUMER.DURABLE.CREATE.shoal_shop_orders.*" in standalone.publish
    assert "$JS.API.CONSUMER.LIST.shoal_shop_orders" in standalone.publish
    assert len(set(standalone.publish)) == len(standalone.publish)

    op = operator_permissions(config("orders"))
    assert "$JS.API.STREAM.INFO.shoal_shop_orders" in op.publish
    assert "$JS.API.STREAM.DELETE.shoal_shop_orders_ledger" in op.publish
    assert "$JS.API.CONSUMER.MSG.NEXT.shoal_shop_orders.*" not in op.publish
    assert not [s for s in op.publish if s.startswith("shoal.") or s.startswith("$JS.ACK")]
    assert op.subscribe == ("_INBOX.>",)

    producer = producer_permissions(config("orders"), "_INBOX.producer")
    # The partition subjects, and the stream's info: `produce` reads the group's
    # partition count there.
    assert producer.publish == ("shoal.shop.orders.*", "$JS.API.STREAM.INFO.shoal_shop_orders")
    assert producer.subscribe == ("_INBOX.producer.>",)


def test_custom_subject_prefix_and_stream() -> None:
    c = config("orders", subject_prefix="acme.orders", stream="ORDERS")
    perms = member_permissions(c, "_INBOX.acme")
    assert "$JS.API.CONSUMER.MSG.NEXT.ORDERS.*" in perms.publish
    assert "acme.orders.dlq.*" in perms.publish
    assert "acme.orders.*" in perms.subscribe
    assert "_INBOX.acme.>" in perms.subscribe


def test_the_cli_prints_a_block_nats_server_accepts(tmp_path: Path) -> None:
    result = CliRunner().invoke(main, ["permissions", "-g", "orders", "-n", "shop"])
    assert result.exit_code == 0, result.output
    out = result.output
    assert "# Members: NATS_USER=shoal-member NATS_INBOX_PREFIX=_SHOAL_INBOX.shop.orders" in out
    assert '"_SHOAL_INBOX.shop.orders.>"' in out
    assert '"_SHOAL_PRODUCER.shop.orders.>"' in out
    assert "password: $SHOAL_MEMBER_PASSWORD" in out
    (tmp_path / "auth.conf").write_text(out)
    conf = tmp_path / "server.conf"
    conf.write_text(
        f'listen: 127.0.0.1:-1\njetstream {{store_dir: "{tmp_path}/js"}}\ninclude "auth.conf"\n'
    )
    binary = NatsServer._find_binary(None)
    env = {
        "SHOAL_MEMBER_PASSWORD": "m",
        "SHOAL_OPERATOR_PASSWORD": "o",
        "SHOAL_PRODUCER_PASSWORD": "p",
        "SHOAL_ANALYTICS_PASSWORD": "x",
        "SHOAL_ADMIN_PASSWORD": "a",
    }
    checked = subprocess.run(
        [binary, "-t", "-c", str(conf)], capture_output=True, text=True, env=env, timeout=30
    )
    assert checked.returncode == 0, checked.stdout + checked.stderr
    # Without the passwords in its environment the server refuses to start: none is
    # ever written into the file.
    unset = subprocess.run(
        [binary, "-t", "-c", str(conf)], capture_output=True, text=True, env={}, timeout=30
    )
    assert unset.returncode != 0
    assert "SHOAL_MEMBER_PASSWORD" in unset.stdout + unset.stderr


@pytest.mark.parametrize("flag", ["--standalone", "--ledger"])
def test_cli_flags(flag: str) -> None:
    result = CliRunner().invoke(main, ["permissions", "-g", "orders", flag])
    assert result.exit_code == 0, result.output
    word = "STREAM.CREATE" if flag == "--standalone" else ".ledger.*"
    member_block = result.output.split('user: "shoal-operator"')[0]
    assert word in member_block
