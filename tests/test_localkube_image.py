"""The kubelet's image runtime, the parts that need no root: the image's config, the
command a container runs, who it runs as, where its executable is."""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace as NS
from typing import Any

import pytest

from harness.localkube.image import Identity, ImageConfig, ImageRoot, RunAsError

INSPECTED = {
    "OCIv1": {
        "config": {
            "User": "10001:10001",
            "Env": ["PATH=/opt/shoal/bin:/usr/bin:/bin", "HOME=/tmp", "EMPTY="],
            "WorkingDir": "/",
            "Cmd": ["shoal-operator"],
        }
    }
}


def image(tmp_path: Path, user: str = "10001:10001") -> ImageRoot:
    root = ImageRoot("shoal:dev", tmp_path)
    root.path = tmp_path / "rootfs"
    (root.path / "etc").mkdir(parents=True)
    (root.path / "etc" / "passwd").write_text(
        "root:x:0:0:root:/root:/bin/sh\napp:x:2000:3000::/home/app:/bin/sh\n"
    )
    (root.path / "etc" / "group").write_text("root:x:0:\napp:x:3000:\nextra:x:4000:\n")
    (root.path / "opt" / "shoal" / "bin").mkdir(parents=True)
    (root.path / "opt" / "shoal" / "bin" / "shoal-consumer").write_text("#!/bin/sh\n")
    root.config = ImageConfig(user=user, env={}, workdir="/", cmd=("shoal-operator",))
    return root


def pod(**security: Any) -> Any:
    return NS(spec=NS(security_context=NS(**security) if security else None))


def container(command: list[str] | None = None, args: list[str] | None = None, **sec: Any) -> Any:
    return NS(command=command, args=args, security_context=NS(**sec) if sec else None)


def test_the_config_comes_from_buildah_inspect() -> None:
    config = ImageConfig.from_inspect(INSPECTED)
    assert config.user == "10001:10001"
    assert config.env == {"PATH": "/opt/shoal/bin:/usr/bin:/bin", "HOME": "/tmp", "EMPTY": ""}
    assert config.cmd == ("shoal-operator",) and config.entrypoint == ()
    assert ImageConfig.from_inspect({}).workdir == "/"


def test_command_and_args_replace_entrypoint_and_cmd(tmp_path: Path) -> None:
    root = image(tmp_path)
    assert root.command(container()) == ["shoal-operator"]
    assert root.command(container(args=["--help"])) == ["--help"]
    assert root.command(container(["shoal-consumer"])) == ["shoal-consumer"]
    assert root.command(container(["shoal-consumer"], ["run"])) == ["shoal-consumer", "run"]


def test_executables_are_looked_up_inside_the_image(tmp_path: Path) -> None:
    root = image(tmp_path)
    path = "/usr/bin:/opt/shoal/bin"
    assert root.resolve("shoal-consumer", path) == "/opt/shoal/bin/shoal-consumer"
    assert root.resolve("/opt/shoal/bin/shoal-consumer", "") == "/opt/shoal/bin/shoal-consumer"
    assert root.resolve("python3", path) is None  # the host has one; the image here does not


def test_the_image_user_unless_the_pod_says_otherwise(tmp_path: Path) -> None:
    root = image(tmp_path)
    assert root.identity(pod(), container()) == Identity(10001, 10001)
    assert root.identity(pod(run_as_user=5), container()) == Identity(5, 0)
    assert root.identity(pod(run_as_user=2000), container()) == Identity(2000, 3000)
    chosen = root.identity(pod(run_as_user=5, run_as_group=6), container(run_as_user=7))
    assert chosen == Identity(7, 6)
    groups = root.identity(pod(supplemental_groups=[4000], fs_group=4001), container())
    assert groups == Identity(10001, 10001, (4000, 4001))


def test_user_names_are_looked_up_in_the_image(tmp_path: Path) -> None:
    assert image(tmp_path, "app").identity(pod(), container()) == Identity(2000, 3000)
    assert image(tmp_path / "b", "app:extra").identity(pod(), container()) == Identity(2000, 4000)
    with pytest.raises(RunAsError, match="unable to find user nobody"):
        image(tmp_path / "c", "nobody").identity(pod(), container())


def test_run_as_non_root_refuses_uid_0(tmp_path: Path) -> None:
    root = image(tmp_path, "")
    with pytest.raises(RunAsError, match="runAsNonRoot"):
        root.identity(pod(run_as_non_root=True), container())
    with pytest.raises(RunAsError, match="runAsNonRoot"):
        image(tmp_path / "b").identity(pod(), container(run_as_user=0, run_as_non_root=True))
    assert root.identity(pod(run_as_non_root=True), container(), check=False).uid == 0
    assert root.identity(pod(), container()) == Identity(0, 0)
