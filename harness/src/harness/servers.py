"""Real etcd and nats-server processes for tests, the demo and benchmarks.

Each server binds only to 127.0.0.1, on free ports, keeps its data and log in the work
directory it is given, and runs in its own session (a Ctrl-C to the test runner does not
reach it; an ``atexit`` hook stops whatever is still running, and the kernel kills it if
this process dies without running that hook: harness.children).

Binaries: the ``binary`` argument, else ``$SHOAL_ETCD`` / ``$SHOAL_NATS_SERVER`` (the
Makefile sets both), else the shoal cache (``${XDG_CACHE_HOME:-~/.cache}/shoal``, where
``scripts/ensure-nats-server.sh`` builds the pinned nats-server) and ``PATH``.

    with NatsServer(tmp_path / "nats") as nats, EtcdServer(tmp_path / "etcd") as etcd:
        ...  # nats.url, etcd.endpoint
"""

from __future__ import annotations

import atexit
import json
import logging
import os
import re
import shutil
import signal
import socket
import subprocess
import threading
import time
import urllib.error
import urllib.parse
import urllib.request
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any, ClassVar, Self

from harness.children import spawn
from harness.lifecycle import StartStop
from harness.natssecurity import NatsServerSecurity
from harness.waiting import WaitTimeout, eventually

__all__ = [
    "EtcdServer",
    "EtcdTLS",
    "NatsCluster",
    "NatsServer",
    "ServerProcess",
    "cache_dir",
    "free_port",
]

logger = logging.getLogger(__name__)

HOST = "127.0.0.1"
READY_TIMEOUT = 20.0
STOP_TIMEOUT = 5.0
BIND_ATTEMPTS = 3
LOG_TAIL_LINES = 20

_BIND_ERROR = re.compile(r"address already in use|bind: address|can't listen", re.IGNORECASE)

# Requests to our own servers must never go through an HTTP proxy from the environment.
_HTTP = urllib.request.build_opener(urllib.request.ProxyHandler({}))


def free_port() -> int:
    """A TCP port on 127.0.0.1 that was free a moment ago (the kernel picks it)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind((HOST, 0))
        port: int = sock.getsockname()[1]
        return port


def cache_dir() -> Path:
    """Where the scripts/ensure-*.sh put binaries they build: outside any clone."""
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "shoal"


def _version_key(path: Path) -> tuple[int, ...]:
    return tuple(int(n) for n in re.findall(r"\d+", path.parent.name))


def _http_get(url: str, timeout: float = 1.0) -> tuple[int, bytes]:
    try:
        with _HTTP.open(url, timeout=timeout) as response:
            status: int = response.status
            return status, response.read()
    except urllib.error.HTTPError as exc:
        return exc.code, exc.read()


_live: set[ServerProcess] = set()
_live_lock = threading.Lock()


@atexit.register
def _stop_all() -> None:
    with _live_lock:
        servers = list(_live)
    for server in servers:
        try:
            server.stop()
        except Exception:
            logger.exception("stopping %s at exit", server)


class ServerProcess(StartStop):
    """One server process; subclasses say how to find, run and probe it."""

    name: ClassVar[str]  # binary name, e.g. "etcd"
    env_var: ClassVar[str]  # e.g. "SHOAL_ETCD"
    ensure_script: ClassVar[str]  # e.g. "scripts/ensure-etcd.sh"

    def __init__(
        self, workdir: str | os.PathLike[str], binary: str | os.PathLike[str] | None = None
    ):
        self.workdir = Path(workdir).resolve()
        self.binary = self._find_binary(binary)
        self._proc: subprocess.Popen[bytes] | None = None
        self._started_once = False
        self._outlive = False
        self._allocate_ports()

    # -- subclass hooks --------------------------------------------------------------------

    def _allocate_ports(self) -> None:
        raise NotImplementedError

    def _command(self) -> list[str]:
        raise NotImplementedError

    def _reset_data(self) -> None:
        """Forget data written by a start attempt that could not bind its ports."""

    def _is_ready(self) -> bool:
        raise NotImplementedError

    # -- binaries --------------------------------------------------------------------------

    @classmethod
    def _find_binary(cls, binary: str | os.PathLike[str] | None) -> str:
        candidates: list[str] = []
        if binary is not None:
            candidates.append(os.fspath(binary))
        elif os.environ.get(cls.env_var):
            candidates.append(os.environ[cls.env_var])
        else:
            # The cache holds the pinned build (newest version first); PATH may hold an
            # older distribution package.
            cached = sorted(
                cache_dir().glob(f"{cls.name}-*/{cls.name}"), key=_version_key, reverse=True
            )
            candidates.extend(str(p) for p in cached)
            on_path = shutil.which(cls.name)
            if on_path:
                candidates.append(on_path)
        for candidate in candidates:
            path = Path(candidate)
            if path.is_file() and os.access(path, os.X_OK):
                return str(path.resolve())
        where = candidates[0] if candidates else f"PATH or {cache_dir()}"
        raise RuntimeError(
            f"{cls.name} not found ({where}): run `make servers` (or {cls.ensure_script}), "
            f"or set {cls.env_var} to the binary"
        )

    # -- lifecycle -------------------------------------------------------------------------

    @property
    def log_path(self) -> Path:
        return self.workdir / f"{self.name}.log"

    @property
    def running(self) -> bool:
        return self._proc is not None and self._proc.poll() is None

    @property
    def pid(self) -> int | None:
        return self._proc.pid if self.running and self._proc is not None else None

    def start(self, *, outlive: bool = False) -> Self:
        """Start the server and wait until it is ready (at most 20 s).

        The first start picks new ports if the chosen ones were taken in the meantime
        (up to 3 attempts); a restart keeps its ports, so clients can reconnect. The
        server dies with this process (harness.children) unless ``outlive=True``, which
        `detach()` needs.
        """
        if self.running:
            return self
        self._outlive = outlive
        attempts = 1 if self._started_once else BIND_ATTEMPTS
        for attempt in range(1, attempts + 1):
            if self._spawn_and_wait():
                self._started_once = True
                return self
            if attempt < attempts and _BIND_ERROR.search(self._log_tail()):
                logger.info("%s: port taken, retrying with other ports", self.name)
                self._reset_data()
                self._allocate_ports()
                continue
            break
        raise RuntimeError(
            f"{self.name} did not become ready ({self.log_path}); last log lines:\n"
            + self._log_tail()
        )

    def _spawn_and_wait(self) -> bool:
        self.workdir.mkdir(parents=True, exist_ok=True)
        command = self._command()
        logger.info("starting %s", " ".join(command))
        with self.log_path.open("ab") as log:
            log.write(f"\n=== {time.strftime('%H:%M:%S')} {' '.join(command)}\n".encode())
            log.flush()
            self._proc = spawn(
                command,
                outlive=self._outlive,
                stdin=subprocess.DEVNULL,
                stdout=log,
                stderr=subprocess.STDOUT,
                cwd=self.workdir,
                env=self._env(),
                start_new_session=True,
            )
        with _live_lock:
            _live.add(self)
        proc = self._proc

        def outcome() -> str | None:
            # An exit ends the wait at once (e.g. the port was taken): start() may retry.
            if proc.poll() is not None:
                return "exited"
            return "ready" if self._is_ready() else None

        try:
            result = eventually(outcome, READY_TIMEOUT, f"{self.name} to be ready", interval=0.05)
        except WaitTimeout:
            logger.warning("%s not ready after %.0f s", self.name, READY_TIMEOUT)
            self.kill()
            return False
        if result == "exited":
            logger.warning("%s exited with %s during start", self.name, proc.returncode)
            self._reap()
            return False
        logger.info("%s ready (pid %d)", self.name, proc.pid)
        return True

    def _env(self) -> dict[str, str]:
        return dict(os.environ)

    def _signal(self, sig: signal.Signals) -> None:
        if self._proc is None:
            return
        try:
            # The server leads its own process group (start_new_session).
            os.killpg(self._proc.pid, sig)
        except (ProcessLookupError, PermissionError):
            pass

    def _reap(self) -> None:
        with _live_lock:
            _live.discard(self)

    def stop(self) -> None:
        """SIGTERM, then SIGKILL after 5 s. Safe to call any number of times."""
        self._end(signal.SIGTERM)

    def detach(self) -> int:
        """Hand the running server over to the caller, who stops it by pid; its pid.

        No atexit stop. For the local plane, whose `down()` stops its servers from any
        process: with `make cluster-up`, which returns with the servers up, they were
        started with ``start(outlive=True)``; any other still dies with this process.
        """
        if self._proc is None or self._proc.poll() is not None:
            raise RuntimeError(f"{self.name} is not running")
        self._reap()
        pid = self._proc.pid
        self._proc = None
        return pid

    def kill(self) -> None:
        """SIGKILL, as in a crash (for failure tests)."""
        self._end(signal.SIGKILL)

    def _end(self, sig: signal.Signals) -> None:
        """Send `sig` to a running server and wait for it to exit (SIGKILL after
        STOP_TIMEOUT if it does not); forget it either way."""
        proc = self._proc
        if proc is None:
            return
        if proc.poll() is None:
            self._signal(sig)
            try:
                proc.wait(STOP_TIMEOUT)
            except subprocess.TimeoutExpired:
                logger.warning(
                    "%s ignored %s for %.0f s: killing", self.name, sig.name, STOP_TIMEOUT
                )
                self._signal(signal.SIGKILL)
                proc.wait()
        self._reap()

    def restart(self, *, kill: bool = False) -> Self:
        """Stop (or with ``kill=True`` crash) the server and start it again, same ports
        and data (and whether it outlives this process)."""
        if kill:
            self.kill()
        else:
            self.stop()
        return self.start(outlive=self._outlive)

    def _log_tail(self, lines: int = LOG_TAIL_LINES) -> str:
        try:
            text = self.log_path.read_text(errors="replace")
        except FileNotFoundError:
            return "(no log)"
        return "\n".join(text.splitlines()[-lines:])

    def __repr__(self) -> str:
        state = f"pid {self._proc.pid}" if self.running and self._proc else "stopped"
        return f"<{type(self).__name__} {self.workdir} {state}>"


@dataclass(frozen=True)
class EtcdTLS:
    """Client TLS for an EtcdServer: its serving certificate and key (valid for 127.0.0.1)
    and the CA whose client certificates it accepts (and, with client_cert_auth, requires)."""

    cert_file: Path
    key_file: Path
    trusted_ca_file: Path
    client_cert_auth: bool = True


class EtcdServer(ServerProcess):
    """A single-member etcd cluster on 127.0.0.1 (client and peer ports both free ports).

    With `tls`, clients speak TLS (https) on the client port; /health and /metrics then
    move to a plain-HTTP metrics port of their own, which readiness checks use.
    """

    name = "etcd"
    env_var = "SHOAL_ETCD"
    ensure_script = "scripts/ensure-etcd.sh"

    _flag_cache: ClassVar[dict[str, bool]] = {}

    port: int
    peer_port: int
    metrics_port: int

    def __init__(
        self,
        workdir: str | os.PathLike[str],
        binary: str | os.PathLike[str] | None = None,
        *,
        tls: EtcdTLS | None = None,
    ):
        self.tls = tls
        super().__init__(workdir, binary)

    def _allocate_ports(self) -> None:
        taken: set[int] = set()
        for attr in ("port", "peer_port", "metrics_port"):
            port = free_port()
            while port in taken:
                port = free_port()
            taken.add(port)
            setattr(self, attr, port)

    @property
    def endpoint(self) -> str:
        """host:port for etcd clients (etcd3.client(host, port))."""
        return f"{HOST}:{self.port}"

    @property
    def client_url(self) -> str:
        scheme = "https" if self.tls else "http"
        return f"{scheme}://{HOST}:{self.port}"

    @property
    def monitor_url(self) -> str:
        """/health and /metrics: the client port, or with TLS the plain metrics port."""
        return f"http://{HOST}:{self.metrics_port}" if self.tls else self.client_url

    @property
    def data_dir(self) -> Path:
        return self.workdir / "data"

    def _supports(self, flag: str) -> bool:
        key = f"{self.binary} {flag}"
        if key not in self._flag_cache:
            out = subprocess.run(
                [self.binary, "--help"], capture_output=True, text=True, timeout=30, check=False
            )
            self._flag_cache[key] = flag in out.stdout + out.stderr
        return self._flag_cache[key]

    def _command(self) -> list[str]:
        peer_url = f"http://{HOST}:{self.peer_port}"
        command = [
            self.binary,
            "--name=default",
            f"--data-dir={self.data_dir}",
            f"--listen-client-urls={self.client_url}",
            f"--advertise-client-urls={self.client_url}",
            f"--listen-peer-urls={peer_url}",
            f"--initial-advertise-peer-urls={peer_url}",
            f"--initial-cluster=default={peer_url}",
            "--initial-cluster-state=new",
            "--logger=zap",
            "--log-outputs=stderr",
        ]
        if self.tls is not None:
            command += [
                f"--cert-file={self.tls.cert_file}",
                f"--key-file={self.tls.key_file}",
                f"--trusted-ca-file={self.tls.trusted_ca_file}",
                f"--listen-metrics-urls={self.monitor_url}",
            ]
            if self.tls.client_cert_auth:
                command.append("--client-cert-auth")
        # etcd >= 3.5: tests need no durability and run much faster without fsync.
        # Debian bookworm's 3.4.23 does not have the flag.
        if self._supports("--unsafe-no-fsync"):
            command.append("--unsafe-no-fsync")
        return command

    def _env(self) -> dict[str, str]:
        # ETCD_* variables would override our flags (e.g. a stray ETCD_DATA_DIR).
        return {
            k: v
            for k, v in os.environ.items()
            if not k.startswith("ETCD_") or k == "ETCD_UNSUPPORTED_ARCH"
        }

    def _reset_data(self) -> None:
        # The member's peer URL is written into the data dir: a retry with new ports
        # needs a fresh one.
        shutil.rmtree(self.data_dir, ignore_errors=True)

    def _is_ready(self) -> bool:
        try:
            status, body = _http_get(f"{self.monitor_url}/health")
        except (OSError, ValueError):
            return False
        if status != 200:
            return False
        try:
            health = json.loads(body).get("health")
        except (ValueError, AttributeError):
            return False
        return health is True or health == "true"


class NatsServer(ServerProcess):
    """A nats-server with JetStream on 127.0.0.1 (client and monitoring ports).

    Plain and anonymous by default. With `security` (harness.natssecurity), it runs from a
    generated config file (``nats-server.conf`` in the work directory): TLS on the client
    port (``tls { verify: true }``: clients present a certificate from the CA), users with
    passwords and subject permissions in one account with JetStream; ``url`` is then a
    ``tls://`` URL. Monitoring stays plain HTTP on its own port.
    """

    name = "nats-server"
    env_var = "SHOAL_NATS_SERVER"
    ensure_script = "scripts/ensure-nats-server.sh"

    port: int
    monitor_port: int

    def __init__(
        self,
        workdir: str | os.PathLike[str],
        binary: str | os.PathLike[str] | None = None,
        *,
        extra_args: Sequence[str] = (),
        security: NatsServerSecurity | None = None,
        jetstream: bool = True,
    ):
        super().__init__(workdir, binary)
        self.extra_args = list(extra_args)
        self.security = security
        # False: a plain NATS server, for what a client meets where JetStream is off.
        self.jetstream = jetstream

    def _allocate_ports(self) -> None:
        self.port = free_port()
        self.monitor_port = free_port()
        while self.monitor_port == self.port:
            self.monitor_port = free_port()

    @property
    def url(self) -> str:
        scheme = "tls" if self.security is not None else "nats"
        return f"{scheme}://{HOST}:{self.port}"

    @property
    def monitor_url(self) -> str:
        return f"http://{HOST}:{self.monitor_port}"

    @property
    def store_dir(self) -> Path:
        return self.workdir / "jetstream"

    @property
    def config_path(self) -> Path:
        return self.workdir / "nats-server.conf"

    def _write_config(self, security: NatsServerSecurity) -> None:
        # Ports and the store in the file too: one place to read what the server ran.
        self.workdir.mkdir(parents=True, exist_ok=True)
        self.config_path.write_text(
            f"listen: {HOST}:{self.port}\n"
            f"http: {HOST}:{self.monitor_port}\n"
            f"jetstream: {{store_dir: {json.dumps(str(self.store_dir))}}}\n"
            + security.config_text()
        )

    def violations(self, user: str | None = None) -> list[str]:
        """The server's log lines that say "Violation" (e.g. a permissions violation) and
        name `user` (None: any user)."""
        text = self.log_path.read_text(errors="replace")
        about = f'user:{user}"' if user is not None else ""
        return [line for line in text.splitlines() if about in line and "Violation" in line]

    def reload(self, security: NatsServerSecurity) -> None:
        """Give the running secured server new users, passwords, permissions or
        certificates, as an operator would: rewrite its config file and send SIGHUP.
        nats-server disconnects the clients whose login no longer holds."""
        if self.security is None:
            raise RuntimeError("reload() is for a server started with security")
        self.security = security
        self._write_config(security)
        self._signal(signal.SIGHUP)

    def _command(self) -> list[str]:
        if self.security is not None:
            self._write_config(self.security)
            return [self.binary, "-c", str(self.config_path), *self.extra_args]
        store = ["-js", "-sd", str(self.store_dir)] if self.jetstream else []
        return [
            self.binary,
            *store,
            "-a",
            HOST,
            "-p",
            str(self.port),
            "-m",
            str(self.monitor_port),
            *self.extra_args,
        ]

    def _is_ready(self) -> bool:
        try:
            status, _ = _http_get(f"{self.monitor_url}/healthz?js-enabled-only=true")
        except (OSError, ValueError):
            return False
        return status == 200


class NatsClusterNode(NatsServer):
    """One node of a NatsCluster: a NatsServer with a route port, a server name and the
    other nodes' routes (set by the cluster before the first start)."""

    cluster_port: int

    def __init__(self, workdir: str | os.PathLike[str], *, server_name: str, cluster_name: str):
        self.server_name = server_name
        self.cluster_name = cluster_name
        self.routes: list[str] = []
        super().__init__(workdir)

    def _allocate_ports(self) -> None:
        super()._allocate_ports()
        self.cluster_port = free_port()
        while self.cluster_port in (self.port, self.monitor_port):
            self.cluster_port = free_port()

    @property
    def route_url(self) -> str:
        return f"nats://{HOST}:{self.cluster_port}"

    def _command(self) -> list[str]:
        command = [
            *super()._command(),
            "--server_name",
            self.server_name,
            "--cluster_name",
            self.cluster_name,
            "--cluster",
            self.route_url,
        ]
        if self.routes:
            command += ["--routes", ",".join(self.routes)]
        return command

    def healthy(self) -> bool:
        """Fully healthy: JetStream current with its meta leader (the full /healthz)."""
        try:
            status, _ = _http_get(f"{self.monitor_url}/healthz")
        except (OSError, ValueError):
            return False
        return status == 200


class NatsCluster(StartStop):
    """Three nats-server nodes with JetStream clustered on free loopback ports.

    Each node has its own client, monitoring and route ports and its own store directory
    (``<workdir>/n<i>/jetstream``); every node routes to the others. ``urls`` is every
    node's client URL (give clients all of them); ``url`` is the first. ``stop()`` stops
    every node, whatever state each is in (a test calls it in ``finally``).

        with NatsCluster(tmp_path / "nats") as cluster:
            cluster.node("n1").kill(); cluster.node("n1").start()
    """

    def __init__(self, workdir: str | os.PathLike[str], size: int = 3) -> None:
        name = f"shoal-{os.getpid()}"
        self.nodes = [
            NatsClusterNode(Path(workdir) / f"n{i}", server_name=f"n{i}", cluster_name=name)
            for i in range(size)
        ]
        for node in self.nodes:
            node.routes = [other.route_url for other in self.nodes if other is not node]

    @property
    def urls(self) -> list[str]:
        return [node.url for node in self.nodes]

    @property
    def url(self) -> str:
        return self.nodes[0].url

    def node(self, server_name: str) -> NatsClusterNode:
        for node in self.nodes:
            if node.server_name == server_name:
                return node
        raise KeyError(server_name)

    def start(self, timeout: float = 30.0) -> Self:
        """Start every node (together), then wait until each is fully healthy (the
        JetStream meta group has a leader and every node is current with it)."""
        try:
            with ThreadPoolExecutor(len(self.nodes)) as pool:
                for future in [pool.submit(node.start) for node in self.nodes]:
                    future.result()
            eventually(
                lambda: all(node.healthy() for node in self.nodes if node.running),
                timeout,
                "the NATS cluster to be healthy",
                interval=0.2,
            )
        except BaseException:
            self.stop()
            raise
        return self

    def stop(self) -> None:
        for node in self.nodes:
            try:
                node.stop()
            except Exception:
                logger.exception("stopping %s", node)


class PrometheusServer(ServerProcess):
    """A Prometheus on 127.0.0.1 (a free port), its TSDB and config in `workdir`.

    The binary comes from Debian's prometheus package (scripts/ensure-prometheus.sh) or
    SHOAL_PROMETHEUS. `config` is the prometheus.yml to run with; file_sd files it names
    may be rewritten while it runs (Prometheus watches them).
    """

    name = "prometheus"
    env_var = "SHOAL_PROMETHEUS"
    ensure_script = "scripts/ensure-prometheus.sh"

    port: int

    def __init__(
        self,
        workdir: str | os.PathLike[str],
        config: str,
        binary: str | os.PathLike[str] | None = None,
    ):
        super().__init__(workdir, binary)
        self.config = config

    def _allocate_ports(self) -> None:
        self.port = free_port()

    @property
    def url(self) -> str:
        return f"http://{HOST}:{self.port}"

    def _reset_data(self) -> None:
        shutil.rmtree(self.workdir / "data", ignore_errors=True)

    def _command(self) -> list[str]:
        config = self.workdir / "prometheus.yml"
        config.write_text(self.config)
        return [
            self.binary,
            f"--config.file={config}",
            f"--storage.tsdb.path={self.workdir / 'data'}",
            f"--web.listen-address={HOST}:{self.port}",
        ]

    def _is_ready(self) -> bool:
        try:
            status, _ = _http_get(f"{self.url}/-/ready")
        except (OSError, ValueError):
            return False
        return status == 200

    def api(self, path: str, **params: str) -> Any:
        """The `data` of an HTTP API answer, e.g. api("query", query=...), api("rules")."""
        url = f"{self.url}/api/v1/{path}"
        if params:
            url += "?" + urllib.parse.urlencode(params)
        status, body = _http_get(url, timeout=10.0)
        answer = json.loads(body)
        if status != 200 or answer.get("status") != "success":
            raise RuntimeError(f"{path} {params} failed: {status} {body[:500]!r}")
        return answer["data"]

    def query(self, promql: str) -> list[dict[str, Any]]:
        """An instant query's result vector (raises on an API error)."""
        result: list[dict[str, Any]] = self.api("query", query=promql)["result"]
        return result
