"""The Go examples (examples/go), built with the machine's Go (harness.goexamples): the
producer passes the partition vectors and feeds a real Shoal member; the HTTP handler
answers as the README says."""

from __future__ import annotations

import asyncio
import base64
import json
import re
import signal
import subprocess
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Callable
from pathlib import Path
from typing import Any, cast

import pytest

from harness import REPO_ROOT
from harness.children import spawn
from harness.fleet import Fleet, settled, wait_for_status
from harness.goexamples import build
from harness.servers import free_port
from harness.waiting import eventually, eventually_async
from shoal.clients.etcd import Etcd
from shoal.clients.natsclient import parse_headers
from shoal.consumer.ledger import audit, read_ledger
from shoal.contracts.names import (
    MSG_ID_HEADER,
    PROJECT_HEADER,
    SEQ_HEADER,
    partition_for,
    partition_subject,
)
from shoal.group.config import GroupConfig
from shoal.group.jetstream import ensure_group

# The first build downloads nats.go and compiles it: up to a few minutes on 2 cores.
pytestmark = [pytest.mark.e2e, pytest.mark.timeout(420)]

VECTORS = REPO_ROOT / "contracts" / "partition-vectors.json"
PARTITIONS = 16
_HTTP = urllib.request.build_opener(urllib.request.ProxyHandler({}))  # never via a proxy


@pytest.fixture(scope="module")
def binaries() -> dict[str, Path]:
    return build()


def test_the_go_producer_passes_the_vectors(binaries: dict[str, Path]) -> None:
    result = subprocess.run(
        [binaries["producer"], "-vectors", VECTORS], capture_output=True, text=True, timeout=60
    )
    count = len(json.loads(VECTORS.read_text(encoding="utf-8"))["vectors"])
    assert result.returncode == 0, result.stdout + result.stderr
    assert result.stdout.strip() == f"{count} vectors, 0 mismatches"


def test_the_go_producer_fails_a_wrong_vector(binaries: dict[str, Path], tmp_path: Path) -> None:
    data = json.loads(VECTORS.read_text(encoding="utf-8"))
    wrong = next(v for v in data["vectors"] if v["partitions"] == 7)
    wrong["partition"] = (wrong["partition"] + 1) % 7
    path = tmp_path / "vectors.json"
    path.write_text(json.dumps(data, ensure_ascii=False), encoding="utf-8")
    result = subprocess.run(
        [binaries["producer"], "-vectors", path], capture_output=True, text=True, timeout=60
    )
    assert result.returncode == 1
    assert "MISMATCH" in result.stdout and "1 mismatches" in result.stdout


def test_the_builds_are_cached(binaries: dict[str, Path]) -> None:
    started = time.monotonic()
    assert build() == binaries
    assert time.monotonic() - started < 5


async def test_a_shoal_member_consumes_what_the_go_producer_publishes(
    binaries: dict[str, Path],
    make_config: Callable[..., GroupConfig],
    make_fleet: Callable[..., Fleet],
    etcd: Etcd,
    js: Any,
) -> None:
    config = make_config(partitions=PARTITIONS)
    await ensure_group(js, config)
    count, projects = 900, 60
    command = [str(binaries["producer"]), "-url", config.nats_url]
    command += ["-prefix", config.subject_prefix]
    command += ["-partitions", str(PARTITIONS), "-count", str(count)]
    command += ["-projects", str(projects), "-run-id", "go1"]
    result = await asyncio.to_thread(
        lambda: subprocess.run(command, capture_output=True, text=True, timeout=120)
    )
    assert result.returncode == 0, result.stderr
    assert json.loads(result.stdout)["published"] == count

    # In the stream, before any member: each on its project's partition, with its headers.
    info = await js.stream_info(config.stream)
    assert info.state.messages == count
    seqs: dict[str, int] = {}
    for seq in range(info.state.first_seq, info.state.last_seq + 1):
        msg = await js.get_msg(config.stream, seq)
        headers = parse_headers(base64.b64decode(msg.hdrs))
        project = headers[PROJECT_HEADER]
        n = seqs[project] = seqs.get(project, -1) + 1  # stream order is publish order
        assert msg.subject == partition_subject(
            config.subject_prefix, partition_for(project, PARTITIONS)
        )
        assert headers[SEQ_HEADER] == str(n)
        assert headers[MSG_ID_HEADER] == f"go1-{project}-{n}"
        assert msg.data == f"{project}:{n}".encode()
    assert len(seqs) == projects

    # A Shoal member (the ledger handler) consumes every one from the right partition.
    fleet = make_fleet(partitions=PARTITIONS)
    fleet.start("m-0")
    await wait_for_status(etcd, config.namespace, config.group, PARTITIONS, settled({"m-0"}), 30)

    async def left() -> int:
        return int((await js.stream_info(config.stream)).state.messages)

    await eventually_async(left, 90, "the stream to drain", until=lambda n: n == 0, interval=0.2)
    records = await read_ledger(js, config.ledger_stream)
    expected = [f"go1-project-{i % projects}-{i // projects}" for i in range(count)]
    assert audit(records, expected).summary() == {
        "expected": count,
        "processed": count,
        "lost": 0,
        "duplicates": 0,
        "out_of_order": 0,
        "overlaps": 0,
    }
    assert all(r.partition == partition_for(r.project_id, PARTITIONS) for r in records)
    numbered = [r.seq for r in records if r.project_id == "project-7"]
    assert None not in numbered  # the Go producer numbers every message (Shoal-Seq)
    assert sorted(n for n in numbered if n is not None) == list(range(15))


async def test_two_go_producer_runs_with_default_run_ids_both_land(
    binaries: dict[str, Path], make_config: Callable[..., GroupConfig], js: Any
) -> None:
    """Two runs without -run-id publish the same project ids: each run's default id is
    its own (clock and random suffix, named in its summary), so JetStream keeps both
    runs' messages instead of dropping the second as duplicates of the first."""
    config = make_config(partitions=PARTITIONS)
    await ensure_group(js, config)
    command = [str(binaries["producer"]), "-url", config.nats_url]
    command += ["-prefix", config.subject_prefix, "-partitions", str(PARTITIONS)]
    command += ["-count", "50", "-projects", "5"]

    def run() -> dict[str, Any]:
        result = subprocess.run(command, capture_output=True, text=True, timeout=120)
        assert result.returncode == 0, result.stderr
        return cast(dict[str, Any], json.loads(result.stdout))

    first, second = await asyncio.gather(asyncio.to_thread(run), asyncio.to_thread(run))
    for summary in (first, second):
        assert re.fullmatch(r"\d{13}_[0-9a-f]{6}", summary["run_id"]), summary
    assert first["run_id"] != second["run_id"]
    assert (await js.stream_info(config.stream)).state.messages == 100


def _request(
    url: str, *, method: str = "GET", headers: dict[str, str] | None = None
) -> tuple[int, bytes]:
    request = urllib.request.Request(url, data=b"{}" if method == "POST" else None, method=method)
    for name, value in (headers or {}).items():
        request.add_header(name, value)
    try:
        with _HTTP.open(request, timeout=10) as response:
            return response.status, response.read()
    except urllib.error.HTTPError as exc:
        return exc.code, exc.read()


def test_the_go_handler_answers_and_finishes_open_requests_on_sigterm(
    binaries: dict[str, Path],
) -> None:
    port = free_port()
    base = f"http://127.0.0.1:{port}"
    command = [str(binaries["handler"]), "-listen", f"127.0.0.1:{port}", "-delay", "300ms"]
    handler = spawn(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    try:
        eventually(
            lambda: _request(f"{base}/healthz")[0],
            10,
            "the handler's /healthz",
            until=lambda status: status == 200,
            retry_on=(OSError,),
        )
        message = {
            "Shoal-Project-Id": "project-1",
            "Shoal-Partition": "3",
            "Shoal-Message-Id": "m-1",
            "Shoal-Delivery-Count": "1",
            "Shoal-Stream-Sequence": "42",
        }
        started = time.monotonic()
        assert _request(f"{base}/messages", method="POST", headers=message)[0] == 200
        assert time.monotonic() - started >= 0.3  # -delay
        status, body = _request(f"{base}/messages", method="POST")
        assert status == 400 and b"Shoal-Project-Id" in body  # a 4xx: dead-lettered
        assert _request(f"{base}/messages")[0] == 405

        # SIGTERM while a message is in flight: it is still answered, then the
        # handler exits 0.
        answers: list[int] = []
        open_request = threading.Thread(
            target=lambda: answers.append(
                _request(f"{base}/messages", method="POST", headers=message)[0]
            )
        )
        open_request.start()
        time.sleep(0.1)
        handler.send_signal(signal.SIGTERM)
        open_request.join(10)
        assert answers == [200]
        assert handler.wait(10) == 0
    finally:
        if handler.poll() is None:
            handler.kill()
            handler.wait()
    output = handler.stdout.read().decode() if handler.stdout else ""
    assert f"listening on 127.0.0.1:{port}" in output and "stopped" in output
