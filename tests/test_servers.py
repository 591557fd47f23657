"""The server fixtures work: real etcd and real JetStream, and stop() frees the ports."""

from __future__ import annotations

import socket
from pathlib import Path

import etcd3
import nats
import pytest

from harness.servers import HOST, EtcdServer, NatsServer, free_port

pytestmark = pytest.mark.e2e


def _port_is_free(port: int) -> bool:
    """Nothing listens on the port and a new server could listen there. SO_REUSEADDR as
    servers use it: connections the stopped server closed may linger in TIME_WAIT."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            sock.bind((HOST, port))
        except OSError:
            return False
        return True


def _accepts(port: int) -> bool:
    try:
        with socket.create_connection((HOST, port), timeout=1):
            return True
    except OSError:
        return False


def test_etcd_put_get(etcd_endpoint: str, namespace: str, group: str) -> None:
    host, port = etcd_endpoint.rsplit(":", 1)
    client = etcd3.client(host=host, port=int(port), timeout=5)
    try:
        key = f"/shoal/{namespace}/{group}/probe"
        client.put(key, "hello")
        value, _meta = client.get(key)
        assert value == b"hello"
    finally:
        client.close()


async def test_nats_jetstream_enabled(nats_url: str) -> None:
    nc = await nats.connect(nats_url, connect_timeout=5, allow_reconnect=False)
    try:
        info = await nc.jetstream().account_info()
        assert info.limits is not None
    finally:
        await nc.close()


@pytest.mark.parametrize("server_class", [EtcdServer, NatsServer])
def test_stop_frees_ports_and_restart_keeps_them(
    server_class: type[EtcdServer] | type[NatsServer], tmp_path: Path
) -> None:
    server = server_class(tmp_path / "server")
    if isinstance(server, EtcdServer):
        ports = [server.port, server.peer_port]
    else:
        ports = [server.port, server.monitor_port]
    with server:
        assert server.running
        assert all(_accepts(p) for p in ports)
        server.restart(kill=True)  # a crash, then the same ports and data again
        assert server.running and server.port == ports[0]
    assert not server.running
    assert not any(_accepts(p) for p in ports)
    assert all(_port_is_free(p) for p in ports)
    server.stop()  # idempotent
    assert server.log_path.exists()


def test_missing_binary_says_how_to_get_it(tmp_path: Path) -> None:
    with pytest.raises(RuntimeError, match="make servers"):
        NatsServer(tmp_path, binary=tmp_path / "no-such-nats-server")


def test_free_port_is_bindable() -> None:
    assert _port_is_free(free_port())
