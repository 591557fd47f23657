"""The member's probes over HTTP: GET /readyz and /livez on the health port.

`shoal-ready` (ready.py) is an exec probe: Kubernetes starts a Python process in the
container every 2 s for readiness and every 10 s for liveness, 30 ms of CPU each, and on
a real kubelet a runc exec on top. That is 1.8-1.9 % of a core per member, more than the
idle member itself costs (bench/probes.py), and at 50 groups on one machine the probes
outlasted their timeouts and turned healthy pods unready (README, "Many groups"). An
HTTP probe costs the kubelet a request and the member 0.6-0.7 ms of CPU.

The answers are shoal-ready's, word for word: the server reads the same state file with
the same checks (ready.check, ready.check_live), so a stale file still means "the event
loop did not run" and an HTTP answer can never be greener than the file. It runs in a
thread of its own for that reason too: a probe answered by the event loop would say
nothing about the loop but "it answered", and would time out exactly when the loop is
busy with a burst.

200 with the line shoal-ready prints when ready (alive); 503 with its line when not;
404 for any other path. Pods need a network namespace of their own for a fixed port
(every real Kubernetes pod has one; the local plane only with --pod-network), so the
operator declares HTTP probes only when given a port (SHOAL_CONSUMER_HEALTH_PORT, the
chart's consumerProbes.port) and exec probes otherwise.
"""

from __future__ import annotations

import errno
import logging
import socket
import threading
from collections.abc import Callable
from http import HTTPStatus
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

from shoal.consumer.ready import check, check_live
from shoal.contracts.names import LIVE_PATH, READY_PATH

log = logging.getLogger(__name__)

IDLE_CONNECTION_SECONDS = 5.0


class _DualStackServer(ThreadingHTTPServer):
    """Listens on :: for IPv6 and, through IPv4-mapped addresses, IPv4 as well."""

    address_family = socket.AF_INET6

    def server_bind(self) -> None:
        self.socket.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 0)
        super().server_bind()


def _server(
    addr: str | None, port: int, handler: type[BaseHTTPRequestHandler]
) -> ThreadingHTTPServer:
    if addr is not None:
        return ThreadingHTTPServer((addr, port), handler)
    try:
        return _DualStackServer(("::", port), handler)
    except OSError as exc:
        if exc.errno not in (errno.EAFNOSUPPORT, errno.EADDRNOTAVAIL):
            raise  # (the port in use, say: the same on IPv4)
        return ThreadingHTTPServer(("0.0.0.0", port), handler)


class HealthPortInUse(RuntimeError):
    """The health port is taken: the member cannot answer its probes."""


def _checks(state_file: str) -> dict[str, Callable[[], tuple[bool, str]]]:
    return {
        READY_PATH: lambda: check(state_file),
        LIVE_PATH: lambda: check_live(state_file),
    }


class HealthServer:
    """Answers /readyz and /livez from `state_file` in a daemon thread until close()."""

    def __init__(self, state_file: str, port: int, addr: str | None = None) -> None:
        """`addr` None: every address, IPv6 and IPv4 (a kubelet probes the pod's IP, which
        is an IPv6 one in an IPv6 cluster), or IPv4 only where the host has no IPv6."""
        checks = _checks(state_file)

        class Handler(BaseHTTPRequestHandler):
            # HTTP/1.0: one request per connection, as the kubelet's prober makes them
            # (it closes each); nothing to keep open.
            # A connection that sends nothing (a port scan, a client gone quiet) gives
            # its thread back after this many seconds instead of holding it for good.
            timeout = IDLE_CONNECTION_SECONDS

            def do_GET(self) -> None:
                probe = checks.get(self.path.split("?", 1)[0])
                if probe is None:
                    line = f"not found: {self.path} (try {READY_PATH}, {LIVE_PATH})"
                    status = HTTPStatus.NOT_FOUND
                else:
                    ok, line = probe()
                    status = HTTPStatus.OK if ok else HTTPStatus.SERVICE_UNAVAILABLE
                body = (line + "\n").encode()
                self.send_response(status)
                self.send_header("Content-Type", "text/plain; charset=utf-8")
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def log_message(self, format: str, *args: object) -> None:
                pass  # a line per probe, every 2 s in every pod, would say nothing

        try:
            self._server = _server(addr, port, Handler)
        except OSError as exc:
            addr = addr or "*"
            raise HealthPortInUse(
                f"cannot serve the health probes on {addr}:{port}: {exc.strerror or exc} "
                "(does another container of the pod listen there? The operator's "
                "SHOAL_CONSUMER_HEALTH_PORT, the chart's consumerProbes.port, moves it)"
            ) from exc
        self._server.daemon_threads = True
        self.port = int(self._server.server_address[1])
        self._thread = threading.Thread(
            target=self._server.serve_forever,
            kwargs={"poll_interval": 0.5},
            daemon=True,
            name="health-port",
        )
        self._thread.start()
        log.info(
            "Serving probes on %s:%d%s and %s",
            self._server.server_address[0],
            self.port,
            READY_PATH,
            LIVE_PATH,
        )

    def close(self) -> None:
        self._server.shutdown()
        self._server.server_close()
        self._thread.join(timeout=5)
