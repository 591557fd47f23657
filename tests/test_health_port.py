"""The member's probes over HTTP (consumer/healthport.py): GET /readyz and /livez say what
`shoal-ready` says, from the same state file.

The server on state files first (a real HTTP server, real requests), then a real member
(real etcd and nats-server, NATS reached through a proxy the test owns) cut from NATS,
frozen and stopped, as the kubelet's httpGet probes see it.
"""

from __future__ import annotations

import asyncio
import signal
import socket
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from harness.fleet import Fleet
from harness.proxy import TcpProxy
from harness.servers import free_port
from shoal.consumer.healthport import IDLE_CONNECTION_SECONDS, HealthPortInUse, HealthServer
from shoal.consumer.ready import MemberState, check, write_state


def state(age: float = 0.5, **change: Any) -> MemberState:
    healthy = MemberState(
        member="c-0",
        pid=42,
        mono=time.monotonic() - age,
        ts=time.time(),
        joined=True,
        safe=True,
        nats=True,
        leaving=False,
    )
    return healthy._replace(**change)


def get(port: int, path: str, timeout: float = 2.0, host: str = "127.0.0.1") -> tuple[int, str]:
    """(status, body) of GET host:port/path, as a kubelet's prober asks it."""
    opener = urllib.request.build_opener(urllib.request.ProxyHandler({}))
    try:
        with opener.open(f"http://{host}:{port}{path}", timeout=timeout) as response:
            return int(response.status), response.read().decode()
    except urllib.error.HTTPError as exc:
        return exc.code, exc.read().decode()


@pytest.fixture
def served(tmp_path: Path) -> Iterator[tuple[Path, int]]:
    path = tmp_path / "ready"
    server = HealthServer(str(path), 0, addr="127.0.0.1")
    try:
        yield path, server.port
    finally:
        server.close()


def test_a_healthy_member_answers_200_with_shoal_ready_s_line(served: tuple[Path, int]) -> None:
    path, port = served
    write_state(path, state())
    status, body = get(port, "/readyz")
    assert status == 200 and body.startswith("ready: member c-0"), (status, body)
    assert body.strip() == check(str(path))[1]
    status, body = get(port, "/livez")
    assert status == 200 and body.startswith("alive: member c-0"), (status, body)


@pytest.mark.parametrize(
    ("change", "why"),
    [
        ({"nats": False}, "cannot reach NATS"),
        ({"safe": False}, "is fenced"),
        ({"joined": False}, "has not joined its group yet"),
        ({"leaving": True}, "is leaving the group"),
        ({"stalled": [3]}, "stalled partition(s) [3]"),
        ({"age": 6.0}, "has not refreshed its state"),
    ],
)
def test_an_unready_member_answers_503_and_why(
    served: tuple[Path, int], change: dict[str, Any], why: str
) -> None:
    path, port = served
    write_state(path, state(**change))
    status, body = get(port, "/readyz")
    assert status == 503 and why in body, (status, body)
    # Liveness ignores all of that (a 6 s old state is far from its 60 s).
    assert get(port, "/livez")[0] == 200


def test_liveness_fails_on_a_stuck_loop_or_a_wedged_member(served: tuple[Path, int]) -> None:
    path, port = served
    write_state(path, state(age=61.0))
    status, body = get(port, "/livez")
    assert status == 503 and "its event loop is stuck" in body, body
    write_state(path, state(wedged=True, stalled=[1]))
    status, body = get(port, "/livez")
    assert status == 503 and "long after the leader should have moved them" in body, body


def test_no_state_garbage_and_unknown_paths(served: tuple[Path, int]) -> None:
    path, port = served
    status, body = get(port, "/readyz")
    assert status == 503 and "does not exist (the member has not started yet)" in body
    path.write_text("{not json")
    status, body = get(port, "/livez?verbose=1")  # (a query changes nothing)
    assert status == 503 and "is not a member state" in body, body
    status, body = get(port, "/metrics")
    assert status == 404 and "/readyz" in body, body


def test_every_address_by_default_ipv6_and_ipv4(tmp_path: Path) -> None:
    """A kubelet probes the pod's IP: an IPv6 one in an IPv6 or dual-stack cluster."""
    path = tmp_path / "ready"
    write_state(path, state())
    server = HealthServer(str(path), 0)
    try:
        assert get(server.port, "/readyz")[0] == 200
        assert get(server.port, "/readyz", host="[::1]")[0] == 200
    finally:
        server.close()


def test_a_connection_that_sends_nothing_is_closed_and_holds_nothing_up(
    served: tuple[Path, int],
) -> None:
    path, port = served
    write_state(path, state())
    with socket.create_connection(("127.0.0.1", port), timeout=15) as quiet:
        assert get(port, "/readyz")[0] == 200  # answered meanwhile
        started = time.monotonic()
        assert quiet.recv(1) == b""  # closed by the server
        assert time.monotonic() - started < IDLE_CONNECTION_SECONDS + 3


def test_a_taken_port_is_a_clear_error(tmp_path: Path) -> None:
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        with pytest.raises(HealthPortInUse, match=rf"127.0.0.1:{port}: .*in use.*SHOAL_CONSUMER"):
            HealthServer(str(tmp_path / "ready"), port, addr="127.0.0.1")


# -- a real member ---------------------------------------------------------------------------


async def until(port: int, path: str, want: int, timeout: float) -> tuple[float, str]:
    """GET every 0.25 s until the status is `want` (0: no answer within 1 s, what a
    kubelet counts as a failure); (seconds it took, the body)."""
    started = time.monotonic()
    while True:
        try:
            status, body = await asyncio.to_thread(get, port, path, 1.0)
        except (OSError, TimeoutError) as exc:
            status, body = 0, repr(exc)
        if status == want:
            return time.monotonic() - started, body
        if time.monotonic() - started > timeout:
            raise AssertionError(f"GET {path} still {status} {body!r} after {timeout:.0f} s")
        await asyncio.sleep(0.25)


@pytest.mark.e2e
@pytest.mark.timeout(120)
async def test_a_real_member_answers_its_http_probes_as_its_state_changes(
    tmp_path: Path, nats_url: str, etcd_endpoint: str, namespace: str, group: str
) -> None:
    port = free_port()
    with (
        TcpProxy(nats_url.removeprefix("nats://"), name="nats") as nats_proxy,
        Fleet(
            tmp_path / "members",
            nats_url=nats_url,
            etcd_endpoint=etcd_endpoint,
            namespace=namespace,
            group=group,
            partitions=8,
            env={"SHOAL_LEASE_TTL": "5", "SHOAL_KEEPALIVE_INTERVAL": "1"},
        ) as fleet,
    ):
        fleet.start(
            "c-0",
            SHOAL_READY_FILE=str(tmp_path / "c-0" / "ready"),
            SHOAL_HEALTH_PORT=str(port),
            NATS_URL=f"nats://{nats_proxy.address}",
        )
        try:
            await until(port, "/readyz", 200, 30)
            nats_proxy.blackhole()
            _, why = await until(port, "/readyz", 503, 15)
            assert "cannot reach NATS" in why, why
            assert (await asyncio.to_thread(get, port, "/livez"))[0] == 200
            nats_proxy.pass_through()
            await until(port, "/readyz", 200, 20)

            # Frozen, the whole process with its server thread: no answer, which a kubelet
            # counts as a failure (and the state goes stale meanwhile, so the first
            # answer after a SIGCONT is not a stale "ready").
            fleet.signal("c-0", signal.SIGSTOP)
            await until(port, "/readyz", 0, 5)
            fleet.signal("c-0", signal.SIGCONT)
            await until(port, "/readyz", 200, 30)

            fleet.term("c-0")
            assert await asyncio.to_thread(fleet.wait_exit, "c-0", 30) == 0
            with pytest.raises(OSError):  # the port is closed with the process
                get(port, "/livez", 1.0)
        finally:
            if fleet.members["c-0"].alive():
                fleet.signal("c-0", signal.SIGCONT)
