"""A group's streams in one account, its members in another (accounts.py) and the
member's JetStream API prefix (NATS_JS_API_PREFIX).

Pure, except that the printed block is checked by a real nats-server (`-t`).
tests/test_nats_accounts.py runs a group across the two accounts.
"""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest
from click.testing import CliRunner
from pydantic import ValidationError

from harness.natssecurity import subject_matches
from harness.servers import NatsServer
from shoal.consumer.accounts import Export, default_api_prefix, group_exports
from shoal.consumer.cli import main
from shoal.consumer.permissions import default_inbox_prefix, member_permissions
from shoal.group.config import GroupConfig, config_from_env

PREFIX = "JS.SHOAL.API"


def config(group: str, **changes: object) -> GroupConfig:
    return GroupConfig.model_validate(
        {"group": group, "namespace": "shop", "ensure_jetstream": False, **changes}
    )


def local(e: Export) -> str:
    """The subject a member of the importing account uses."""
    return e.to or e.subject


def test_the_api_prefix_setting() -> None:
    assert GroupConfig(group="g").nats_js_api_prefix == "$JS.API"
    c = config_from_env({"SHOAL_GROUP": "g", "NATS_JS_API_PREFIX": PREFIX})
    assert c.nats_js_api_prefix == PREFIX
    for bad in ("JS.SHOAL.API.", "JS.*.API", "JS.>", "JS SHOAL", ""):
        with pytest.raises(ValidationError):
            GroupConfig(group="g", nats_js_api_prefix=bad)


@pytest.mark.parametrize("ledger", [False, True])
@pytest.mark.parametrize("standalone", [False, True])
def test_the_imports_cover_exactly_what_a_member_uses(ledger: bool, standalone: bool) -> None:
    c = config("orders", ledger=ledger, ensure_jetstream=standalone)
    exports = group_exports(c, PREFIX)
    services = [local(e) for e in exports if e.kind == "service"]
    streams = [local(e) for e in exports if e.kind == "stream"]
    perms = member_permissions(c, default_inbox_prefix(c), PREFIX)
    # Every subject the member may publish to reaches the JetStream account through a
    # service import, but the health probe: answered "no responders" in any account.
    assert [p for p in perms.publish if p not in services] == ["_SHOAL.HEALTH"]
    assert sorted(services) == sorted(p for p in perms.publish if p != "_SHOAL.HEALTH")
    # Everything it listens to, but its own inbox, is a stream import.
    assert sorted(streams) == sorted(perms.subscribe[1:])
    # API services are imported under the prefix, from the account's own $JS.API.
    for e in exports:
        if e.subject.startswith("$JS.API."):
            assert e.to == PREFIX + e.subject.removeprefix("$JS.API"), e
        else:
            assert e.to is None, e
    # Only a pull may have many answers.
    assert [e.subject for e in exports if e.response] == [
        "$JS.API.CONSUMER.MSG.NEXT.shoal_shop_orders.*"
    ]
    assert any("ledger" in s for s in services) == ledger
    assert any("CREATE" in s for s in services) == standalone


def test_nothing_of_another_group_or_of_jetstream_at_large_is_exported() -> None:
    exports = group_exports(config("orders", ledger=True), PREFIX)
    for subject in [
        "$JS.API.CONSUMER.MSG.NEXT.shoal_shop_payments.p0",
        "$JS.ACK.shoal_shop_payments.p0.1.2.3.4.5",
        "$JS.API.STREAM.DELETE.shoal_shop_orders",
        "$JS.API.STREAM.CREATE.shoal_shop_orders",
        "$JS.API.CONSUMER.DURABLE.CREATE.shoal_shop_orders.p0",
        "$JS.API.STREAM.LIST",
        "$JS.API.INFO",
        "shoal.shop.payments.0",
        "shoal.shop.payments.dlq.0",
    ]:
        assert not any(subject_matches(e.subject, subject) for e in exports), subject


def test_the_cli_prints_accounts_nats_server_accepts(tmp_path: Path) -> None:
    result = CliRunner().invoke(
        main, ["permissions", "-g", "orders", "-n", "shop", "--accounts", "--ledger"]
    )
    assert result.exit_code == 0, result.output
    out = result.output
    assert "NATS_JS_API_PREFIX=JS.SHOAL.API" in out
    shoal, team = out.split("  TEAM {")
    assert "jetstream: enabled" in shoal and "jetstream" not in team
    assert 'user: "shoal-operator"' in shoal and 'user: "shoal-producer"' in shoal
    assert 'user: "shoal-admin"' in shoal  # the dlq and reset commands
    assert 'user: "shoal-member"' in team and 'user: "shoal-member"' not in shoal
    assert (
        '{service: "$JS.API.CONSUMER.MSG.NEXT.shoal_shop_orders.*", accounts: [TEAM], '
        "response: stream}" in shoal
    )
    assert (
        '{service: {account: SHOAL, subject: "$JS.API.CONSUMER.MSG.NEXT.shoal_shop_orders.*"}, '
        'to: "JS.SHOAL.API.CONSUMER.MSG.NEXT.shoal_shop_orders.*"}' in team
    )
    assert '{stream: {account: SHOAL, subject: "shoal.shop.orders.*"}}' in team
    assert '"JS.SHOAL.API.CONSUMER.INFO.shoal_shop_orders.*"' in team  # the member's own
    (tmp_path / "accounts.conf").write_text(out)
    conf = tmp_path / "server.conf"
    conf.write_text(
        f'listen: 127.0.0.1:-1\njetstream {{store_dir: "{tmp_path}/js"}}\ninclude "accounts.conf"\n'
    )
    env = {
        f"SHOAL_{role}_PASSWORD": "pw"
        for role in ("MEMBER", "OPERATOR", "PRODUCER", "ANALYTICS", "ADMIN")
    }
    checked = subprocess.run(
        [NatsServer._find_binary(None), "-t", "-c", str(conf)],
        capture_output=True,
        text=True,
        env=env,
        timeout=30,
    )
    assert checked.returncode == 0, checked.stdout + checked.stderr


def test_cli_account_names_and_prefix() -> None:
    result = CliRunner().invoke(
        main,
        [
            "permissions",
            "-g",
            "orders",
            "--accounts",
            "--js-account",
            "STREAMS",
            "--member-account",
            "ORDERS_TEAM",
            "--api-prefix",
            "JS.X.API",
        ],
    )
    assert result.exit_code == 0, result.output
    assert "  STREAMS {" in result.output and "  ORDERS_TEAM {" in result.output
    assert "accounts: [ORDERS_TEAM]" in result.output
    assert "{account: STREAMS, subject:" in result.output
    assert 'to: "JS.X.API.CONSUMER.INFO.' in result.output
    assert default_api_prefix("STREAMS") == "JS.STREAMS.API"
