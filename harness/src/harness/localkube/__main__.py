"""`python -m harness.localkube up|down|status [--root .localkube] [--nodes N]`
(`make cluster-up [NODES=3]`)."""

from __future__ import annotations

import argparse
import logging
import os
import sys
import time
from pathlib import Path

from harness.localkube.image import parse_stand_ins
from harness.localkube.plane import LocalKube, State, alive
from harness.localkube.tools import ToolMissing


def main() -> None:
    parser = argparse.ArgumentParser(
        prog="python -m harness.localkube",
        description="Start or stop the local Kubernetes control plane (no containers).",
    )
    parser.add_argument("command", choices=["up", "down", "status"])
    parser.add_argument(
        "--root",
        type=Path,
        default=Path(".localkube"),
        help="where the plane keeps its state, logs and env (.localkube)",
    )
    parser.add_argument(
        "--image",
        default=os.environ.get("SHOAL_KUBELET_IMAGE") or None,
        help="run shoal:dev pods from this image (`make image`; as root), not the venv "
        "(default: $SHOAL_KUBELET_IMAGE)",
    )
    parser.add_argument(
        "--local-image",
        action="append",
        default=[item for item in [os.environ.get("SHOAL_KUBELET_LOCAL_IMAGES")] if item],
        metavar="IMAGE=PATH",
        help="a local executable standing in for IMAGE where it cannot run from an image "
        "(no --image, or buildah lacks it); repeatable or comma-separated "
        "(default: $SHOAL_KUBELET_LOCAL_IMAGES)",
    )
    parser.add_argument(
        "--pod-network",
        action="store_true",
        default=os.environ.get("SHOAL_KUBELET_POD_NETWORK", "") not in ("", "0", "false"),
        help="each pod in a network namespace of its own, with the API server's, NATS' and "
        "etcd's ports forwarded into it (needs --image; default: $SHOAL_KUBELET_POD_NETWORK)",
    )
    parser.add_argument(
        "--nodes",
        type=int,
        default=int(os.environ.get("SHOAL_LOCALKUBE_NODES") or 1),
        help="how many nodes (process kubelets): 1 is `localkube`; more are localkube-a, "
        "-b, ... in zones zone-a, zone-b, zone-c (default: $SHOAL_LOCALKUBE_NODES or 1)",
    )
    parser.add_argument(
        "--node-monitor-grace",
        type=float,
        default=50.0,
        metavar="SECONDS",
        help="how long a node may be silent before it turns NotReady and is tainted "
        "unreachable (kube-controller-manager's --node-monitor-grace-period; 50)",
    )
    args = parser.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    # `up` returns with the plane running: its processes outlive this one.
    plane = LocalKube(
        args.root,
        image=args.image,
        local_images=parse_stand_ins(args.local_image),
        outlive=True,
        pod_network=args.pod_network and args.command == "up",
        nodes=args.nodes,
        node_monitor_grace=args.node_monitor_grace,
    )
    if args.command == "up":
        started = time.monotonic()
        try:
            plane.up()
        except ToolMissing as exc:
            sys.exit(f"cluster-up: {exc}")
        except RuntimeError as exc:
            sys.exit(f"cluster-up: {exc}")
        nodes = ", ".join(f"{node.name} ({node.zone})" for node in plane.nodes)
        print(
            f"Local plane up in {time.monotonic() - started:.1f} s, nodes {nodes}: "
            f"API {plane.state.apiserver_url}, NATS {plane.state.nats_url}, "
            f"etcd {plane.state.etcd_endpoint}"
        )
        print(f"Use it:   source {plane.root / 'env'}   (then kubectl, helm and nats work)")
        print(
            "Install:  helm install shoal charts/shoal -n shoal-system --create-namespace "
            f"-f {plane.root / 'values.yaml'}"
        )
        print("Stop it:  make cluster-down")
    elif args.command == "down":
        plane.down()
        print("Local plane stopped")
    else:
        if not plane.state_path.exists():
            print(f"Local plane: not running from {plane.root.resolve()} (--root)")
            return
        state = State.load(plane.state_path)
        for component in state.components:
            up = alive(component.pid)
            print(f"{component.name:<24} pid {component.pid:<8} {'up' if up else 'DOWN'}")


if __name__ == "__main__":
    main()
