"""The local plane's pod networks (harness.localkube.podnet, the kubelet's --pod-network):
a namespace of its own, whose loopback reaches the forwarded ports of the host's and
nothing else, and whose listeners the host does not see. Needs root (marked `image`,
like the rest of the image runtime)."""

from __future__ import annotations

import http.server
import socket
import subprocess
import sys
import threading
import urllib.request
from collections.abc import Iterator

import pytest

from harness.children import spawn
from harness.localkube.kubelet import PODNET, in_network_namespace
from harness.servers import free_port

pytestmark = [pytest.mark.image, pytest.mark.timeout(60)]


@pytest.fixture
def host_server() -> Iterator[int]:
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), http.server.SimpleHTTPRequestHandler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        yield int(server.server_address[1])
    finally:
        server.shutdown()
        server.server_close()


def test_a_pod_network_forwards_its_ports_and_keeps_its_own(host_server: int) -> None:
    process = spawn(
        [sys.executable, "-I", "-S", str(PODNET), str(host_server)],
        stdout=subprocess.PIPE,
        start_new_session=True,
    )
    try:
        assert process.stdout is not None
        assert process.stdout.readline().strip() == b"ready"
        netns = f"/proc/{process.pid}/ns/net"
        opener = urllib.request.build_opener(urllib.request.ProxyHandler({}))

        def get(port: int) -> int:
            with opener.open(f"http://127.0.0.1:{port}/", timeout=5) as answer:
                return int(answer.status)

        # The forwarded port reaches the host's server from inside.
        assert in_network_namespace(netns, lambda: get(host_server)) == 200
        # Another port of the host does not exist inside...
        other = free_port()
        with socket.create_server(("127.0.0.1", other)):
            with pytest.raises(OSError):
                in_network_namespace(
                    netns, lambda: socket.create_connection(("127.0.0.1", other), 2)
                )
        # ... and a port taken inside is free on the host (two pods can both use it).
        inside = in_network_namespace(netns, lambda: socket.create_server(("127.0.0.1", other)))
        with inside, socket.create_server(("127.0.0.1", other)):
            pass
    finally:
        process.terminate()
        assert process.wait(5) == 0
