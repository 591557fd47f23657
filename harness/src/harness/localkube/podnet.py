"""A pod's own network namespace for the process kubelet (`--pod-network`; as root).

    python -I -S podnet.py PORT [PORT ...]

The kubelet starts one per pod before its containers (the pause container of a real
kubelet): it makes a new network namespace, brings its loopback up, prints `ready`, and
holds the namespace until it is stopped; every container of the pod joins it
(sandbox.py's `netns`), so the pod has a loopback of its own, as in Kubernetes, and two
pods can both listen on 127.0.0.1:8080. The pods still need the plane's servers, which
listen on the host's loopback: for each PORT it listens on 127.0.0.1:PORT inside the pod
and forwards each connection to 127.0.0.1:PORT of the host (a socket made in the host's
namespace: setns there and back around socket()). That is all the network a pod has: no
interface but lo, no route out, nothing reaches in but the kubelet's probes (which run in
a thread that joined the namespace) and the forwarded ports.

Standard library only, like sandbox.py. It dies with the kubelet (harness.children).
"""

from __future__ import annotations

import asyncio
import ctypes
import fcntl
import os
import signal
import socket
import struct
import sys

CLONE_NEWNET = 0x40000000
SIOCGIFFLAGS = 0x8913
SIOCSIFFLAGS = 0x8914
IFF_UP = 0x1
CHUNK = 1 << 16

_libc = ctypes.CDLL(None, use_errno=True)


def _check(result: int, what: str) -> None:
    if result != 0:
        raise OSError(ctypes.get_errno(), f"{what}: {os.strerror(ctypes.get_errno())}")


def setns(fd: int) -> None:
    _check(_libc.setns(fd, CLONE_NEWNET), "setns(CLONE_NEWNET)")


def loopback_up() -> None:
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        request = struct.pack("16sH22x", b"lo", 0)
        flags = struct.unpack("16sH22x", fcntl.ioctl(s, SIOCGIFFLAGS, request))[1]
        fcntl.ioctl(s, SIOCSIFFLAGS, struct.pack("16sH22x", b"lo", flags | IFF_UP))


async def _pump(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
    try:
        while data := await reader.read(CHUNK):
            writer.write(data)
            await writer.drain()
        if writer.can_write_eof():
            writer.write_eof()
    except (ConnectionError, OSError):
        writer.transport.abort()


class Forwarder:
    def __init__(self, host_ns: int, pod_ns: int) -> None:
        self.host_ns = host_ns
        self.pod_ns = pod_ns

    def host_socket(self) -> socket.socket:
        """A TCP socket of the host's namespace (a socket keeps the namespace it was
        made in)."""
        setns(self.host_ns)
        try:
            sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        finally:
            setns(self.pod_ns)
        sock.setblocking(False)
        return sock

    async def serve(self, port: int) -> asyncio.Server:
        async def forward(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
            sock = self.host_socket()
            try:
                await asyncio.get_running_loop().sock_connect(sock, ("127.0.0.1", port))
            except OSError:
                sock.close()
                writer.transport.abort()
                return
            host_reader, host_writer = await asyncio.open_connection(sock=sock)
            await asyncio.gather(_pump(reader, host_writer), _pump(host_reader, writer))
            host_writer.close()
            writer.close()

        return await asyncio.start_server(forward, "127.0.0.1", port, reuse_address=True)


async def main(ports: list[int]) -> None:
    host_ns = os.open("/proc/self/ns/net", os.O_RDONLY)
    _check(_libc.unshare(CLONE_NEWNET), "unshare(CLONE_NEWNET)")
    loopback_up()
    pod_ns = os.open("/proc/self/ns/net", os.O_RDONLY)
    forwarder = Forwarder(host_ns, pod_ns)
    servers = [await forwarder.serve(port) for port in ports]
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    print("ready", flush=True)
    await stop.wait()
    for server in servers:
        server.close()


if __name__ == "__main__":
    asyncio.run(main([int(p) for p in sys.argv[1:]]))
