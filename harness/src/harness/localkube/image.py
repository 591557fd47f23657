"""The process kubelet's image runtime: containers run from an image's root filesystem.

`ImageRoot(image, state_dir).open()` makes a buildah working container of the image
(`buildah from --pull-never`), mounts it (`buildah mount`) and reads the image's config
(USER, ENV, WORKDIR, ENTRYPOINT, CMD). The mount is only ever a read-only lower layer:
each container gets its own throwaway overlay over it (sandbox.py). `close()` removes
the working container. The kubelet mounts each image it runs once (one ImageRoot per
image): every working container's name is recorded, one per line, in
`<state_dir>/image-container`, so that `remove_recorded` (the kubelet's start, the
plane's `down`) can remove them after a kubelet that was killed. An image buildah does
not have locally is ImageNotPresent: nothing is ever pulled.
"""

from __future__ import annotations

import json
import logging
import os
import subprocess
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from harness.children import spawn

log = logging.getLogger(__name__)

SANDBOX = Path(__file__).with_name("sandbox.py")
RECORD = "image-container"
SERVICE_ACCOUNT_DIR = "/var/run/secrets/kubernetes.io/serviceaccount"
# The host files every container sees read-only (networking is the host's).
HOST_FILES = ("/etc/resolv.conf", "/etc/hosts")


class ImageNotPresent(RuntimeError):
    """buildah has no such image on this machine (and nothing is pulled)."""


class RunAsError(ValueError):
    """The container's identity cannot be settled (CreateContainerConfigError)."""


@dataclass(frozen=True)
class Identity:
    uid: int
    gid: int
    groups: tuple[int, ...] = ()


@dataclass(frozen=True)
class ImageConfig:
    user: str = ""
    env: dict[str, str] = field(default_factory=dict)
    workdir: str = "/"
    entrypoint: tuple[str, ...] = ()
    cmd: tuple[str, ...] = ()

    @classmethod
    def from_inspect(cls, inspected: dict[str, Any]) -> ImageConfig:
        config = (inspected.get("OCIv1") or {}).get("config") or {}
        env = dict(item.split("=", 1) for item in config.get("Env") or [] if "=" in item)
        return cls(
            user=config.get("User") or "",
            env=env,
            workdir=config.get("WorkingDir") or "/",
            entrypoint=tuple(config.get("Entrypoint") or ()),
            cmd=tuple(config.get("Cmd") or ()),
        )


def buildah(*args: str) -> str:
    try:
        result = subprocess.run(
            ["buildah", *args], capture_output=True, text=True, timeout=300, check=False
        )
    except FileNotFoundError:
        raise RuntimeError("buildah is not installed (`make image` installs it)") from None
    if result.returncode != 0:
        raise RuntimeError(f"buildah {' '.join(args)}: {result.stderr.strip()}")
    return result.stdout


def remove_recorded(state_dir: Path, only: str | None = None) -> None:
    """Remove the working containers a kubelet recorded (and did not remove itself);
    `only`: just that one (and its line)."""
    record = state_dir / RECORD
    if not record.exists():
        return
    names = [line.strip() for line in record.read_text().splitlines() if line.strip()]
    for name in names:
        if only is not None and name != only:
            continue
        # `rm` unmounts first; a container already gone is not an error here.
        result = subprocess.run(
            ["buildah", "rm", name], capture_output=True, text=True, timeout=120, check=False
        )
        if result.returncode == 0:
            log.info("Removed the image's working container %s", name)
    left = [name for name in names if only is not None and name != only]
    if left:
        record.write_text("".join(f"{name}\n" for name in left))
    else:
        record.unlink(missing_ok=True)


def _record(state_dir: Path, container: str) -> None:
    with (state_dir / RECORD).open("a") as record:
        record.write(f"{container}\n")


def parse_stand_ins(items: list[str]) -> dict[str, Path]:
    """`IMAGE=PATH` items (--local-image, SHOAL_KUBELET_LOCAL_IMAGES) as image -> path."""
    stand_ins: dict[str, Path] = {}
    for item in items:
        for part in item.split(","):
            image, sep, path = part.strip().rpartition("=")
            if not part.strip():
                continue
            if not sep or not image or not path:
                raise ValueError(f"--local-image wants IMAGE=PATH, got {part!r}")
            stand_ins[image] = Path(path).resolve()
    return stand_ins


def sandbox_command() -> list[str]:
    """sandbox.py uses the standard library only: no site, no user environment."""
    return [sys.executable, "-I", "-S", str(SANDBOX)]


def _first(*values: Any) -> Any:
    return next((v for v in values if v is not None), None)


class ImageRoot:
    def __init__(self, image: str, state_dir: Path) -> None:
        self.image = image
        self.state_dir = state_dir
        self.container = ""
        self.path = Path("/nonexistent")
        self.config = ImageConfig()

    def open(self) -> None:
        """Mount the image (ImageNotPresent: buildah does not have it). The kubelet
        removes what an earlier, killed kubelet left (remove_recorded) before the first."""
        if os.geteuid() != 0:
            # Mount namespaces, chroot and setuid, and buildah's storage.
            raise RuntimeError("the kubelet's image runtime needs root")
        try:
            inspected = buildah("inspect", "--type", "image", self.image)
        except RuntimeError as exc:
            raise ImageNotPresent(f"buildah has no image {self.image!r}: {exc}") from None
        self.config = ImageConfig.from_inspect(json.loads(inspected))
        self.container = buildah("from", "--pull-never", "--quiet", self.image).strip()
        _record(self.state_dir, self.container)
        self.path = Path(buildah("mount", self.container).strip())
        log.info("Image %s mounted at %s (container %s)", self.image, self.path, self.container)

    def close(self) -> None:
        if self.container:
            remove_recorded(self.state_dir, only=self.container)

    # -- what a container runs ----------------------------------------------------------

    def command(self, spec: Any) -> list[str]:
        """Kubernetes' rule: `command` replaces ENTRYPOINT (and drops CMD), `args` CMD."""
        if spec.command:
            return list(spec.command) + list(spec.args or [])
        return list(self.config.entrypoint) + list(spec.args or self.config.cmd)

    def resolve(self, name: str, path: str) -> str | None:
        """`name` as found on the container's PATH inside the image (None: not there)."""
        if "/" in name:
            return name if os.path.lexists(self.path / name.lstrip("/")) else None
        for directory in path.split(":"):
            if directory.startswith("/") and os.path.lexists(
                self.path / directory.lstrip("/") / name
            ):
                return f"{directory.rstrip('/')}/{name}"
        return None

    # -- who it runs as -----------------------------------------------------------------

    def identity(self, pod: Any, spec: Any, *, check: bool = True) -> Identity:
        """runAsUser/runAsGroup (container, then pod), else the image's USER; the pod's
        supplementalGroups and fsGroup. RunAsError: runAsNonRoot with uid 0."""
        pod_context = pod.spec.security_context
        context = spec.security_context
        image_uid, image_gid = self._image_user()
        uid = _first(
            getattr(context, "run_as_user", None), getattr(pod_context, "run_as_user", None)
        )
        gid = _first(
            getattr(context, "run_as_group", None), getattr(pod_context, "run_as_group", None)
        )
        if uid is None:
            uid, gid = image_uid, _first(gid, image_gid)
        if gid is None:
            gid = self._primary_group(int(uid))
        non_root = _first(
            getattr(context, "run_as_non_root", None),
            getattr(pod_context, "run_as_non_root", None),
        )
        if check and non_root and int(uid) == 0:
            raise RunAsError("container has runAsNonRoot and image will run as root")
        groups = list(getattr(pod_context, "supplemental_groups", None) or [])
        fs_group = getattr(pod_context, "fs_group", None)
        if fs_group is not None:
            groups.append(fs_group)
        return Identity(int(uid), int(gid), tuple(int(g) for g in groups))

    def _image_user(self) -> tuple[int, int | None]:
        user, _, group = self.config.user.partition(":")
        if not user:
            return 0, None
        uid = int(user) if user.isdigit() else self._lookup("passwd", user)
        if not group:
            return uid, None
        return uid, int(group) if group.isdigit() else self._lookup("group", group)

    def _lookup(self, database: str, name: str) -> int:
        for fields in self._entries(database):
            if fields[0] == name:
                return int(fields[2])
        raise RunAsError(f"unable to find user {name}: no matching entries in {database} file")

    def _primary_group(self, uid: int) -> int:
        for fields in self._entries("passwd"):
            if fields[2] == str(uid):
                return int(fields[3])
        return 0

    def _entries(self, database: str) -> list[list[str]]:
        try:
            text = (self.path / "etc" / database).read_text()
        except OSError:
            return []
        return [line.split(":") for line in text.splitlines() if line.count(":") >= 3]

    # -- the sandbox's specs ------------------------------------------------------------

    def run_spec(
        self,
        *,
        staging: Path,
        identity: Identity,
        binds: list[dict[str, Any]],
        spec: Any,
        env: dict[str, str],
        command: list[str],
    ) -> dict[str, Any]:
        context = spec.security_context
        return {
            **self.enter_spec(identity, spec, env),
            "mode": "run",
            "rootfs": str(self.path),
            "staging": str(staging),
            "binds": binds
            + [
                {"source": path, "target": path, "read_only": True, "optional": True}
                for path in HOST_FILES
            ],
            "read_only_root": bool(getattr(context, "read_only_root_filesystem", False)),
            "command": command,
        }

    def enter_spec(self, identity: Identity, spec: Any, env: dict[str, str]) -> dict[str, Any]:
        """What `enter` needs besides the pid and the command: the same identity."""
        context = spec.security_context
        return {
            "mode": "enter",
            "uid": identity.uid,
            "gid": identity.gid,
            "groups": list(identity.groups),
            "no_new_privs": getattr(context, "allow_privilege_escalation", None) is False,
            "workdir": spec.working_dir or self.config.workdir or "/",
            "env": env,
        }


def start(spec: dict[str, Any], out: Any) -> subprocess.Popen[bytes]:
    """The container's process (sandbox.py execs into it): pid, group and exit status.

    It dies with the kubelet (harness.children; sandbox.py keeps the signal across the
    change to the pod's user, which clears it)."""
    process = spawn(
        sandbox_command(),
        stdin=subprocess.PIPE,
        stdout=out,
        stderr=subprocess.STDOUT,
        env={},
        cwd="/",
        start_new_session=True,
    )
    assert process.stdin is not None
    try:
        process.stdin.write(json.dumps(spec).encode())
        process.stdin.close()
    except BrokenPipeError:
        pass  # it died before reading: its exit status and log say why
    return process


def run_inside(
    pid: int, spec: dict[str, Any], command: list[str], timeout: float
) -> subprocess.CompletedProcess[bytes]:
    """`command` in the mount namespace and root of the container `pid`, as its user."""
    payload = {**spec, "mode": "enter", "pid": pid, "command": command}
    return subprocess.run(
        sandbox_command(),
        input=json.dumps(payload).encode(),
        capture_output=True,
        env={},
        cwd="/",
        timeout=timeout,
        check=False,
    )
