"""`shoal-analytics export`: a real nats-py consumer on a real nats-server's log stream."""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import pandas as pd
import pytest

from harness.servers import free_port
from shoal.analytics.export import ExportError, export_log
from shoal.analytics.generate import HistorySpec, history
from shoal.analytics.layout import input_files
from shoal.analytics.oracle import compute_path
from shoal.contracts.events import parse_event
from shoal.contracts.names import (
    assignments_subject,
    default_stream_name,
    default_subject_prefix,
    log_stream_name,
)


def cli(*args: str, timeout: float = 120) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "shoal.analytics.cli", *args],
        capture_output=True,
        text=True,
        timeout=timeout,
        check=False,
        env={**os.environ, "PYTHONUNBUFFERED": "1"},
    )


def test_unreachable_nats_is_one_clear_line_after_retries(tmp_path: Path) -> None:
    url = f"nats://127.0.0.1:{free_port()}"
    done = cli(
        "export",
        "-g",
        "orders",
        "-n",
        "prod",
        "-o",
        str(tmp_path),
        "--nats-url",
        url,
        "--connect-attempts",
        "3",
    )
    assert done.returncode == 1
    lines = done.stderr.strip().splitlines()
    assert sum("retrying in" in line for line in lines) == 2, done.stderr
    assert lines[-1].startswith(f"Error: NATS at {url} unreachable after 3 attempts"), lines
    assert not list(tmp_path.iterdir())


@pytest.mark.e2e
async def test_export_copies_the_log_stream(
    js: Any, nats_url: str, namespace: str, group: str, tmp_path: Path
) -> None:
    prefix = default_subject_prefix(namespace, group)
    stream = log_stream_name(default_stream_name(namespace, group))
    await js.add_stream(name=stream, subjects=[assignments_subject(prefix)])
    events = list(history(HistorySpec(namespace=namespace, group=group, generations=60, seed=9)))
    payloads = [e.to_bytes() for e in events]
    payloads.insert(10, b'{"not": "an event"}')
    payloads.insert(20, b'{"schema": 2, "group": "from the future"}')
    for payload in payloads:
        await js.publish(assignments_subject(prefix), payload)

    out = tmp_path / "jsonl"
    result = await export_log(nats_url=nats_url, namespace=namespace, group=group, out=out)
    assert result.messages == len(payloads) and (result.first_seq, result.last_seq) == (1, 62)
    today = datetime.now(UTC).date().isoformat()
    files = input_files(out)
    assert [p.relative_to(out).as_posix() for p in files] == [
        f"date={today}/part-{namespace}.{group}-000000000001.jsonl"
    ]
    assert files[0].read_bytes().splitlines() == payloads  # verbatim, in order
    computed = compute_path(out)
    assert computed.stats["used"] == 60
    assert computed.stats["malformed"] == computed.stats["unknown_schema"] == 1

    # Parquet: typed columns, only the valid events.
    out_pq = tmp_path / "parquet"
    result = await export_log(
        nats_url=nats_url, namespace=namespace, group=group, out=out_pq, fmt="parquet"
    )
    assert result.messages == 62 and len(result.rejected) == 2
    table = pd.read_parquet(out_pq)
    assert list(table["generation"]) == list(range(1, 61))
    first = dict(table.iloc[1])
    assert dict(first["assignment"]) == {p: m for p, m in events[1].assignment.items()}
    assert first["members"].tolist() == events[1].members
    assert first["ts"] == pd.Timestamp(events[1].ts)

    # --since: from a time (nothing stored after tomorrow) or a duration (everything).
    tomorrow = (datetime.now(UTC) + timedelta(days=1)).strftime("%Y-%m-%dT%H:%M:%SZ")
    none = await asyncio.to_thread(
        cli,
        "export",
        "-g",
        group,
        "-n",
        namespace,
        "-o",
        str(tmp_path / "none"),
        "--nats-url",
        nats_url,
        "--since",
        tomorrow,
    )
    assert none.returncode == 0, none.stderr
    assert json.loads(none.stdout)["messages"] == 0
    recent = await asyncio.to_thread(
        cli,
        "export",
        "-g",
        group,
        "-n",
        namespace,
        "-o",
        str(tmp_path / "recent"),
        "--nats",  # as every other Shoal command names it (--nats-url too)
        nats_url,
        "--since",
        "1h",
    )
    assert recent.returncode == 0, recent.stderr
    summary = json.loads(recent.stdout)
    assert summary["messages"] == 62 and summary["stream"] == stream
    assert parse_event(input_files(tmp_path / "recent")[0].read_bytes().splitlines()[0])


@pytest.mark.e2e
async def test_export_of_a_group_without_a_log_says_so(nats_url: str, tmp_path: Path) -> None:
    with pytest.raises(ExportError, match="stream shoal_nowhere_nothing_log does not exist"):
        await export_log(nats_url=nats_url, namespace="nowhere", group="nothing", out=tmp_path)
