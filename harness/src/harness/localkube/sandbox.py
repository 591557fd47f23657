"""Start a container of the process kubelet inside an image's root filesystem (as root).

    python -I -S sandbox.py < spec.json

The kubelet runs this file (standard library only, so `-I -S` keeps its start cheap) with
a JSON spec on stdin, and it becomes the container: it never forks, so its pid, process
group and exit status are the container's. Two modes:

`run`: a new mount namespace (private propagation: nothing leaks back to the host), a
tmpfs at `staging` holding the upper layer of an overlay whose lower layer is the image's
root filesystem (so mountpoints can be made without writing to the image, and
`readOnlyRootFilesystem` can be honoured either way), chroot into it, a fresh /proc, a
minimal /dev, /sys read-only, the bind mounts the spec lists, the root remounted
read-only if asked, then the pod's uid/gid/groups, no_new_privs if asked, and exec.
Everything it mounts lives in that namespace and goes when its last process exits.

`enter`: join the mount namespace, root and network namespace of the running container
`pid`, take the same identity and exec: what exec probes (and tests) use.

`netns` (the kubelet's --pod-network): the path of the pod's network namespace, which
`run` joins first, so every container of a pod shares one loopback (podnet.py).

Bind sources are opened (O_PATH) before the chroot and mounted through /proc/self/fd
after it, so that mountpoints are resolved inside the image (where /var/run is a symlink
to /run), never on the host.
"""

from __future__ import annotations

import ctypes
import json
import os
import stat
import sys
from typing import Any

CLONE_NEWNS = 0x00020000
CLONE_NEWNET = 0x40000000
MS_RDONLY = 0x1
MS_NOSUID = 0x2
MS_NODEV = 0x4
MS_NOEXEC = 0x8
MS_REMOUNT = 0x20
MS_BIND = 0x1000
MS_REC = 0x4000
MS_PRIVATE = 0x40000
PR_SET_NO_NEW_PRIVS = 38
PR_SET_PDEATHSIG = 1
PR_GET_PDEATHSIG = 2

# The character devices a container runtime gives every container (major, minor).
DEVICES = {
    "null": (1, 3),
    "zero": (1, 5),
    "full": (1, 7),
    "random": (1, 8),
    "urandom": (1, 9),
    "tty": (5, 0),
}
DEV_LINKS = {
    "fd": "/proc/self/fd",
    "stdin": "/proc/self/fd/0",
    "stdout": "/proc/self/fd/1",
    "stderr": "/proc/self/fd/2",
}
# Exit status when the container could not be set up (as runc's "container init" errors).
SETUP_FAILED = 128
NOT_FOUND = 127

_libc = ctypes.CDLL(None, use_errno=True)


class SetupError(RuntimeError):
    pass


def _check(result: int, what: str) -> None:
    if result != 0:
        errno = ctypes.get_errno()
        raise SetupError(f"{what}: {os.strerror(errno)}")


def mount(source: str | None, target: str, fstype: str | None, flags: int, data: str = "") -> None:
    _check(
        _libc.mount(
            source.encode() if source is not None else None,
            target.encode(),
            fstype.encode() if fstype is not None else None,
            ctypes.c_ulong(flags),
            data.encode() if data else None,
        ),
        f"mount {source or ''} on {target}",
    )


def _overlay_root(lower: str, staging: str) -> str:
    """A throwaway writable layer over the image (tmpfs in this namespace): the root."""
    mount("tmpfs", staging, "tmpfs", MS_NOSUID | MS_NODEV, "mode=0700")
    for name in ("upper", "work", "root"):
        os.mkdir(os.path.join(staging, name), 0o755)
    root = os.path.join(staging, "root")
    options = f"lowerdir={lower},upperdir={staging}/upper,workdir={staging}/work"
    mount("overlay", root, "overlay", 0, options)
    return root


def _open_sources(binds: list[dict[str, Any]]) -> list[tuple[int, dict[str, Any]]]:
    """O_PATH descriptors of the host files and directories to bind (before the chroot)."""
    opened = []
    for bind in binds:
        try:
            opened.append((os.open(bind["source"], os.O_PATH), bind))
        except FileNotFoundError:
            if not bind.get("optional"):
                raise SetupError(f"bind source {bind['source']} does not exist") from None
    return opened


def _make_target(target: str, is_dir: bool) -> None:
    """The mountpoint, made inside the container's root (the overlay takes the writes)."""
    if is_dir:
        os.makedirs(target, exist_ok=True)
        return
    os.makedirs(os.path.dirname(target) or "/", exist_ok=True)
    if not os.path.lexists(target):
        os.close(os.open(target, os.O_WRONLY | os.O_CREAT, 0o644))


def _bind(fd: int, target: str, read_only: bool, recursive: bool = True) -> None:
    is_dir = stat.S_ISDIR(os.fstat(fd).st_mode)
    _make_target(target, is_dir)
    mount(f"/proc/self/fd/{fd}", target, None, MS_BIND | (MS_REC if recursive else 0))
    if read_only:
        mount(None, target, None, MS_REMOUNT | MS_BIND | MS_RDONLY | MS_NOSUID | MS_NODEV)


def _mount_dev() -> None:
    os.makedirs("/dev", exist_ok=True)
    mount("tmpfs", "/dev", "tmpfs", MS_NOSUID | MS_NOEXEC, "mode=0755,size=65536k")
    for name, (major, minor) in DEVICES.items():
        os.mknod(f"/dev/{name}", 0o666 | stat.S_IFCHR, os.makedev(major, minor))
        os.chmod(f"/dev/{name}", 0o666)  # mknod's mode goes through the umask
    for name, target in DEV_LINKS.items():
        os.symlink(target, f"/dev/{name}")
    os.mkdir("/dev/shm")
    mount("shm", "/dev/shm", "tmpfs", MS_NOSUID | MS_NODEV | MS_NOEXEC, "mode=1777,size=65536k")


def _mount_kernel_filesystems(sys_fd: int) -> None:
    os.makedirs("/proc", exist_ok=True)
    mount("proc", "/proc", "proc", MS_NOSUID | MS_NODEV | MS_NOEXEC)
    _mount_dev()
    # Not recursive: the host's cgroup mounts under /sys stay out (and so writable ones).
    _bind(sys_fd, "/sys", read_only=True, recursive=False)


def _become(spec: dict[str, Any]) -> None:
    """The container's identity: groups, gid, uid (root's capabilities go with uid 0).

    The kernel clears the parent-death signal the kubelet gave this process (so that its
    containers die with it: harness.children) when the uid or gid changes: set it again.
    """
    death = ctypes.c_int(0)
    _check(_libc.prctl(PR_GET_PDEATHSIG, ctypes.byref(death), 0, 0, 0), "prctl(GET_PDEATHSIG)")
    parent = os.getppid()
    os.setgroups([int(g) for g in spec.get("groups", [])])
    os.setgid(int(spec["gid"]))
    os.setuid(int(spec["uid"]))
    if death.value:
        _check(_libc.prctl(PR_SET_PDEATHSIG, death.value, 0, 0, 0), "prctl(SET_PDEATHSIG)")
        if os.getppid() != parent:  # the kubelet died while the signal was unset
            os.kill(os.getpid(), death.value)
    if spec.get("no_new_privs"):
        _check(_libc.prctl(PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0), "prctl(NO_NEW_PRIVS)")


def _exec(spec: dict[str, Any]) -> None:
    os.chdir(spec.get("workdir") or "/")
    _become(spec)
    command = [str(c) for c in spec["command"]]
    env = {str(k): str(v) for k, v in spec["env"].items()}
    try:
        # execvpe searches the container's PATH, inside the image.
        os.execvpe(command[0], command, env)
    except OSError as exc:
        print(f"sandbox: exec {command[0]}: {exc.strerror}", file=sys.stderr, flush=True)
        os._exit(NOT_FOUND)


def _join_network(path: str | None) -> None:
    """The pod's network namespace (the kubelet's --pod-network: podnet.py holds it)."""
    if not path:
        return
    fd = os.open(path, os.O_RDONLY)
    try:
        _check(_libc.setns(fd, CLONE_NEWNET), f"setns into the pod's network {path}")
    finally:
        os.close(fd)


def run(spec: dict[str, Any]) -> None:
    _join_network(spec.get("netns"))
    _check(_libc.unshare(CLONE_NEWNS), "unshare(CLONE_NEWNS)")
    mount(None, "/", None, MS_REC | MS_PRIVATE)
    root = _overlay_root(spec["rootfs"], spec["staging"])
    sources = _open_sources(spec.get("binds", []))
    sys_fd = os.open("/sys", os.O_PATH)
    os.chdir(root)
    os.chroot(".")
    _mount_kernel_filesystems(sys_fd)
    # Shallow mountpoints first: a volume inside another one is mounted on top of it.
    for fd, bind in sorted(sources, key=lambda pair: pair[1]["target"].count("/")):
        _bind(fd, bind["target"], bool(bind.get("read_only")))
        os.close(fd)
    os.close(sys_fd)
    if spec.get("read_only_root"):
        mount(None, "/", None, MS_REMOUNT | MS_BIND | MS_RDONLY)
    _exec(spec)


def enter(spec: dict[str, Any]) -> None:
    pid = int(spec["pid"])
    # Its network too (the pod's own with --pod-network; else the host's, as ours).
    _join_network(f"/proc/{pid}/ns/net")
    namespace = os.open(f"/proc/{pid}/ns/mnt", os.O_RDONLY)
    root = os.open(f"/proc/{pid}/root", os.O_RDONLY | os.O_DIRECTORY)
    _check(_libc.setns(namespace, CLONE_NEWNS), f"setns into pid {pid}")
    os.fchdir(root)
    os.chroot(".")
    os.close(namespace)
    os.close(root)
    _exec(spec)


def main() -> None:
    spec = json.loads(sys.stdin.buffer.read())
    # The container's stdin is /dev/null, as under the venv runtime.
    null = os.open("/dev/null", os.O_RDONLY)
    os.dup2(null, 0)
    os.close(null)
    try:
        (run if spec["mode"] == "run" else enter)(spec)
    except (SetupError, OSError) as exc:
        print(f"sandbox: cannot start the container: {exc}", file=sys.stderr, flush=True)
        sys.exit(SETUP_FAILED)


if __name__ == "__main__":
    main()
