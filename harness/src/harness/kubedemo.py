"""`make demo`: Shoal on a real (local) Kubernetes control plane.

Brings up the local plane (unless it is already up), installs the operator with Helm,
applies the example ConsumerGroup, produces over 1,000 project ids while the group is
scaled up and down with `kubectl scale cg`, and prints `kubectl get cg` and the ledger's
lost / duplicate / out-of-order counts as it goes. The cluster stays up afterwards for
you to explore with kubectl; `make cluster-down` stops it.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import nats

from harness import REPO_ROOT
from harness.demo import drain
from harness.localkube.plane import LocalKube, State, alive
from harness.waiting import WaitTimeout, eventually
from shoal.consumer.ledger import audit, read_ledger
from shoal.consumer.producer import Outgoing, Producer
from shoal.contracts.names import SEQ_HEADER, default_stream_name, ledger_stream_name

ROOT = REPO_ROOT
NAMESPACE, GROUP = "default", "orders"


def say(text: str) -> None:
    print(text, flush=True)


def run(plane: LocalKube, *args: str, show: bool = False) -> str:
    result = subprocess.run(
        list(args),
        env={**os.environ, **plane.env()},
        capture_output=True,
        text=True,
        check=False,
        timeout=300,
    )
    if result.returncode != 0:
        raise SystemExit(f"demo: {' '.join(args[:3])} failed:\n{result.stderr.strip()}")
    if show:
        say(result.stdout.rstrip())
    return result.stdout


def get_cg(plane: LocalKube) -> None:
    say(run(plane, "kubectl", "get", "cg", "-n", NAMESPACE).rstrip())


def wait_ready(plane: LocalKube, members: int, timeout: float = 120) -> None:
    path = '{.status.conditions[?(@.type=="Ready")].status} {.status.members}'
    try:
        eventually(
            lambda: run(
                plane, "kubectl", "get", "cg", GROUP, "-n", NAMESPACE, "-o", f"jsonpath={path}"
            ).split(),
            timeout,
            f"the group to be Ready with {members} members",
            until=lambda out: out[:2] == ["True", str(members)],
            interval=1,
        )
    except WaitTimeout as exc:
        raise SystemExit(
            f"demo: the group did not become Ready with {members} members "
            f"(Ready, members: {exc.last})"
        ) from exc


def plane_up(root: Path, image: str | None = None) -> LocalKube:
    # The plane stays up after the demo (`make cluster-down` stops it).
    plane = LocalKube(root, image=image, outlive=True)
    if plane.state_path.exists() and any(
        alive(c.pid) for c in State.load(plane.state_path).components
    ):
        plane.state = State.load(plane.state_path)
        say(f"Using the local plane already running from {root}")
        return plane
    say("Starting the local Kubernetes control plane (make cluster-up) ...")
    started = time.monotonic()
    plane.up()
    say(f"  API server {plane.state.apiserver_url} ready in {time.monotonic() - started:.1f} s")
    return plane


async def produce(plane: LocalKube, total: int, rate: float) -> list[str]:
    nc = await nats.connect(plane.state.nats_url)
    ids: list[str] = []
    try:
        producer = Producer(nc.jetstream(), f"shoal.{NAMESPACE}.{GROUP}", 128)
        started = time.monotonic()
        run_id = str(int(time.time()))
        step = max(1, int(rate / 5))
        for start in range(0, total, step):
            items = [
                Outgoing(
                    f"project-{i % 1000}", b"demo", f"{run_id}-{i}", {SEQ_HEADER: str(i // 1000)}
                )
                for i in range(start, min(total, start + step))
            ]
            await producer.publish_many(items)
            ids += [item.message_id or "" for item in items]
            ahead = (start + step) / rate - (time.monotonic() - started)
            if ahead > 0:
                await asyncio.sleep(ahead)
    finally:
        await nc.close()
    return ids


async def ledger_counts(plane: LocalKube, ids: list[str]) -> dict[str, int]:
    nc = await nats.connect(plane.state.nats_url)
    try:
        js = nc.jetstream()
        await drain(js, f"shoal_{NAMESPACE}_{GROUP}", 120)
        wanted = set(ids)
        # The ledger keeps earlier runs' records too: audit this run's messages only.
        records = [
            r
            for r in await read_ledger(
                js, ledger_stream_name(default_stream_name(NAMESPACE, GROUP))
            )
            if r.message_id in wanted
        ]
        return audit(records, ids).summary()
    finally:
        await nc.close()


async def scenario(plane: LocalKube, args: argparse.Namespace) -> dict[str, Any]:
    say(f"> producing {args.messages} messages over 1,000 projects at {args.rate:.0f}/s")
    production = asyncio.create_task(produce(plane, args.messages, args.rate))
    for replicas in (5, 2):
        await asyncio.sleep(args.step_seconds)
        say(f"> kubectl scale cg {GROUP} --replicas={replicas}")
        await asyncio.to_thread(
            run, plane, "kubectl", "scale", "cg", GROUP, "-n", NAMESPACE, f"--replicas={replicas}"
        )
        await asyncio.to_thread(wait_ready, plane, replicas)
        await asyncio.to_thread(get_cg, plane)
    ids = await production
    say("> production finished; auditing the ledger")
    return await ledger_counts(plane, ids)


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--root", type=Path, default=ROOT / ".localkube")
    parser.add_argument("--messages", type=int, default=20000)
    parser.add_argument("--rate", type=float, default=800.0)
    parser.add_argument("--step-seconds", type=float, default=6.0)
    parser.add_argument(
        "--image",
        default=os.environ.get("SHOAL_KUBELET_IMAGE") or None,
        help="the kubelet runs the pods from this image (`make image`; as root), not the "
        "venv (default: $SHOAL_KUBELET_IMAGE)",
    )
    args = parser.parse_args()
    plane = plane_up(args.root, args.image)
    say("> helm upgrade --install shoal charts/shoal -n shoal-system")
    run(
        plane,
        "helm",
        "upgrade",
        "--install",
        "shoal",
        str(ROOT / "charts" / "shoal"),
        "-n",
        "shoal-system",
        "--create-namespace",
        "-f",
        str(plane.root / "values.yaml"),
        "--wait",
        "--timeout",
        "180s",
    )
    say("> kubectl apply -f examples/consumergroup.yaml")
    run(plane, "kubectl", "apply", "-f", str(ROOT / "examples" / "consumergroup.yaml"))
    wait_ready(plane, 3)
    get_cg(plane)
    counts = asyncio.run(scenario(plane, args))
    say(
        f"Ledger: {counts['expected']} published, {counts['processed']} processed, "
        f"{counts['lost']} lost, {counts['duplicates']} duplicates, "
        f"{counts['out_of_order']} out of order"
    )
    run(plane, "kubectl", "describe", "cg", GROUP, "-n", NAMESPACE, show=True)
    say("\nThe cluster is still up. Explore it:")
    say(f"  source {plane.root / 'env'}")
    say("  kubectl get cg; kubectl describe cg orders; kubectl get pods")
    say("Stop it with: make cluster-down")
    sys.exit(0 if counts["lost"] == 0 and counts["duplicates"] == 0 else 1)


if __name__ == "__main__":
    main()
