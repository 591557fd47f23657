"""Many groups under one operator on the local plane (issue 29's "Groups").

The local plane (one node: kube-apiserver, controller-manager, scheduler, the process
kubelet, the plane's nats-server and etcd) and one operator process watching one
namespace. ``--groups`` (default 50) ConsumerGroups of ``--partitions`` (default 128)
partitions each, one member each (``replicas: 1``, the in-process ``noop`` handler, no
autoscaling, a stream of one replica, no ledger), are applied with ``kubectl apply`` one
after another, each once the one before it is Ready. 50 x 128 = 6,400 durables.

* ``ready_seconds``: from the start of a group's ``kubectl apply`` to its Ready condition
  True (seen by a ``kubectl get --watch``), over the groups with a member: p50, p95, max,
  and every group's time in order (``each``), to see whether it grows with the groups
  already there; value None with ``not_ready`` when a group was not Ready in 180 s;
* ``last_group_ready_seconds``: the same for the last group, applied once all the others
  were Ready and ``--settle-seconds`` (15) had passed (target: a new group Ready within
  10 s when 49 already run);
* over ``--idle-seconds`` (30) once every group is Ready and ``--settle-seconds`` more have
  passed, CPU % (of one core) and RSS (MB) of: the operator (``operator_cpu_pct``,
  ``operator_rss_mb``; its busiest threads beside), nats-server (``nats_cpu_pct``,
  ``nats_rss_mb``; with the durables it holds, counted through JetStream, and the
  messages a second it sends and receives, from its /varz), the groups' etcd
  (``etcd_cpu_pct``; writes a second from its /metrics), the members (``member_cpu_pct``:
  the median, the worst beside; ``member_rss_mb``: the median), the members' exec probes
  (``probe_cpu_pct``: the kubelet's reaped children, i.e. ``shoal-ready`` processes), the
  API server, its etcd, the kubelet, the controller-manager and the scheduler
  (``plane_cpu_pct``), and the API server's requests a second by verb and resource
  (``apiserver_requests_per_s``: its ``apiserver_request_total``; with
  ``consumergroup_updates_per_s``, the writes that changed a group), which says what the
  operator asks of it per group;
* ``delete_all_seconds``: ``kubectl delete cg --all`` until no group is left;
* ``operator_log_problems``: ERROR lines and tracebacks in the operator's log (target 0;
  the delete handler's "waiting for N consumer pods to leave" retries apart).

Every line carries ``load1``, the machine's 1-minute load average when it was measured
(the machine is shared). ``--member-groups N``: only N groups (and the last) get a
member, the others ``replicas: 0`` (their stream, durables and status timer, no pod),
for a machine that cannot run a member pod per group with exec probes: each pod's
readiness probe then starts a Python process every 2 s (see README, "Many groups under one
operator"); ``ready_seconds_without_member`` then gives their times apart.
``--pod-network`` (root, buildah) runs the pods from the image, each in a network
namespace of its own, as on a real cluster: the operator then gives them HTTP probes on
the member's health port (consumer/healthport.py, the chart's default), and
``probe_cpu_pct`` is 0 (no process per probe; the kubelet's prober is in its own CPU);
the default as root, with a member in every group. ``--profile-operator FILE`` runs the
operator under cProfile. Everything started is stopped on the way out, failed or not,
SIGTERM and SIGINT included (the plane's and the operator's context managers; the members
are the plane's pods).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import signal
import statistics
import subprocess
import sys
import threading
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import nats

from harness.bench import cpu_seconds, emit, log_problems, note, percentile, thread_cpu, workdir
from harness.kubetest import apiserver_requests, create_namespace, operator_process
from harness.localkube.plane import LocalKube
from shoal.contracts.names import default_stream_name

REPO = Path(__file__).resolve().parents[1]
BENCH = "groups"
NAMESPACE = "groups"
NOOP = "shoal.consumer.handlers:noop"
READY_TIMEOUT = 180.0
_HTTP = urllib.request.build_opener(urllib.request.ProxyHandler({}))


def load1() -> float:
    return os.getloadavg()[0]


def rss_mb(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    return 0.0


def children_cpu_seconds(pid: int) -> float:
    """CPU seconds of the process's children that it has waited for (cutime + cstime):
    for the kubelet, its exec probes (each a `shoal-ready` process), as its pods run on."""
    fields = Path(f"/proc/{pid}/stat").read_text().rpartition(")")[2].split()
    # fields[0] is field 3 (state) of proc(5): cutime and cstime are fields 16 and 17.
    return (int(fields[13]) + int(fields[14])) / os.sysconf("SC_CLK_TCK")


def cmdline_flag(pid: int, prefix: str) -> str | None:
    """The value of a `--flag=value` or `-m value` style argument in a process's command
    line (the plane records the servers' pids, not their monitoring ports)."""
    args = Path(f"/proc/{pid}/cmdline").read_bytes().decode().split("\0")
    for i, arg in enumerate(args):
        if arg.startswith(prefix + "="):
            return arg.partition("=")[2]
        if arg == prefix and i + 1 < len(args):
            return args[i + 1]
    return None


def http_text(url: str) -> str:
    with _HTTP.open(url, timeout=5) as page:
        return str(page.read().decode())


def manifest(name: str, partitions: int, replicas: int = 1) -> str:
    return json.dumps(
        {
            "apiVersion": "shoal.dev/v1alpha1",
            "kind": "ConsumerGroup",
            "metadata": {"name": name, "namespace": NAMESPACE},
            "spec": {
                "handler": NOOP,
                "partitions": partitions,
                # One member: the smallest group that has a leader and consumes (0 only
                # for the groups past --member-groups: no pod, the rest as with one).
                "replicas": replicas,
                "autoscaling": {"enabled": False},
                "nats": {"stream": {"replicas": 1, "ledger": False}},
            },
        }
    )


class ReadyWatch:
    """When each group's Ready condition was first seen True, from one `kubectl get
    --watch` (polling 50 groups with a kubectl process each would load the two cores the
    figures are about)."""

    TEMPLATE = '{.metadata.name}{" "}{.status.conditions[?(@.type=="Ready")].status}{"\\n"}'

    def __init__(self, plane: LocalKube) -> None:
        self.plane = plane
        self.ready_at: dict[str, float] = {}
        # Every event the watch saw: an update that changes nothing of a group's object
        # (same resourceVersion) sends none, so this counts real writes.
        self.events = 0
        self.cond = threading.Condition()
        self.process: subprocess.Popen[str] | None = None
        self.thread: threading.Thread | None = None

    def start(self) -> None:
        kubectl = str(self.plane._tools().kubectl)
        self.process = subprocess.Popen(
            [
                kubectl,
                f"--kubeconfig={self.plane.kubeconfig_path}",
                "get",
                "cg",
                "-n",
                NAMESPACE,
                "--watch",
                "-o",
                f"jsonpath={self.TEMPLATE}",
            ],
            stdout=subprocess.PIPE,
            stderr=subprocess.DEVNULL,
            text=True,
        )
        self.thread = threading.Thread(target=self._read, name="ready-watch", daemon=True)
        self.thread.start()

    def _read(self) -> None:
        assert self.process is not None and self.process.stdout is not None
        for line in self.process.stdout:
            seen = time.monotonic()
            self.events += 1
            name, _, ready = line.strip().partition(" ")
            if ready == "True":
                with self.cond:
                    self.ready_at.setdefault(name, seen)
                    self.cond.notify_all()

    def wait(self, names: set[str], timeout: float) -> None:
        deadline = time.monotonic() + timeout
        with self.cond:
            while not names <= self.ready_at.keys():
                left = deadline - time.monotonic()
                if left <= 0 or (self.process and self.process.poll() is not None):
                    missing = sorted(names - self.ready_at.keys())
                    raise TimeoutError(f"not Ready after {timeout:.0f} s: {missing[:10]}")
                self.cond.wait(min(left, 1.0))

    def stop(self) -> None:
        if self.process is not None:
            self.process.terminate()
            try:
                self.process.wait(10)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()


@contextlib.contextmanager
def ready_watch(plane: LocalKube) -> Iterator[ReadyWatch]:
    watch = ReadyWatch(plane)
    watch.start()
    try:
        yield watch
    finally:
        watch.stop()


def etcd_writes(metrics_url: str) -> float:
    total = 0.0
    for line in http_text(metrics_url).splitlines():
        if line.startswith(("etcd_mvcc_put_total ", "etcd_mvcc_delete_total ")):
            total += float(line.split()[1])
    return total


def nats_msgs(monitor_url: str) -> float:
    varz = json.loads(http_text(f"{monitor_url}/varz"))
    return float(varz["in_msgs"]) + float(varz["out_msgs"])


def build_image(tag: str = "shoal:dev") -> str:
    """The image the pods run with --pod-network (scripts/build-image.sh: root, buildah;
    its layer cache makes a rebuild of unchanged sources quick)."""
    started = time.monotonic()
    # Its output to stderr: stdout is the figures' JSON lines.
    subprocess.run(
        ["bash", str(REPO / "scripts" / "build-image.sh"), tag], check=True, stdout=sys.stderr
    )
    note(f"image {tag} built in {time.monotonic() - started:.0f} s")
    return tag


def member_pids(plane: LocalKube) -> list[int]:
    """The pods' processes, as the kubelet records them (one per member pod here)."""
    pids = []
    for path in (plane.root / "kubelet" / "pids").glob("*.pid"):
        with contextlib.suppress(ValueError, OSError):
            pid = int(path.read_text())
            if Path(f"/proc/{pid}").exists():
                pids.append(pid)
    return pids


async def durables(nats_url: str, streams: list[str]) -> int:
    nc = await nats.connect(nats_url)
    try:
        js = nc.jetstream()
        total = 0
        for stream in streams:
            total += int((await js.stream_info(stream)).state.consumer_count)
        return total
    finally:
        await nc.close()


class Bench:
    def __init__(self, args: argparse.Namespace, root: Path) -> None:
        self.args = args
        self.root = root

    def run(self) -> None:
        a = self.args
        names = [f"g{i:03d}" for i in range(a.groups)]
        image = build_image() if a.pod_network else None
        with LocalKube(self.root / "plane", image=image, pod_network=a.pod_network) as plane:
            pids = {c.name: c.pid for c in plane.state.components}
            note(f"plane up: {sorted(pids)}")
            log_path = self.root / "operator.log"
            profile = a.profile_operator
            python_args = ("-m", "cProfile", "-o", str(profile)) if profile else ()
            with operator_process(
                plane, [NAMESPACE], log_path, python_args=python_args
            ) as operator:
                create_namespace(plane, NAMESPACE)
                try:
                    with ready_watch(plane) as watch:
                        self.groups(plane, watch, names, operator.pid)
                        self.idle(plane, watch, pids, operator.pid, names)
                finally:
                    self.teardown(plane, names)
            problems = log_problems([log_path])
            # kopf logs a handler's TemporaryError at ERROR: the delete handler's "waiting
            # for N consumer pods to leave" is its expected retry, not a problem.
            retries = sum(
                int(e.split("x ", 1)[0])
                for e in problems["examples"]
                if "failed temporarily: waiting for" in e
            )
            emit(
                BENCH,
                "operator_log_problems",
                problems["error"] + problems["traceback"] - retries,
                delete_retries=retries,
                warnings=problems["warning"],
                examples=problems["examples"],
                target="0",
            )

    def replicas(self, index: int) -> int:
        """1, or 0 for the groups past --member-groups (the last group always has its
        member: it is the one timed on its own)."""
        a = self.args
        return 1 if index < a.member_groups or index == a.groups - 1 else 0

    def apply(self, plane: LocalKube, index: int, name: str) -> float:
        text = manifest(name, self.args.partitions, self.replicas(index))
        started = time.monotonic()
        plane.kubectl("apply", "-f", "-", input_text=text)
        return started

    def groups(self, plane: LocalKube, watch: ReadyWatch, names: list[str], op: int) -> None:
        a = self.args
        times: dict[str, float] = {}
        op_cpu0, t0 = cpu_seconds(op), time.monotonic()
        for i, name in enumerate(names[:-1]):
            started = self.apply(plane, i, name)
            try:
                watch.wait({name}, READY_TIMEOUT)
            except TimeoutError:
                # An overloaded machine (the members' exec probes time out, so their pods
                # stay unready): say how far it got, with what load, before giving up.
                emit(
                    BENCH,
                    "ready_seconds",
                    None,
                    not_ready=name,
                    ready_before=i,
                    each=[round(t, 2) for t in times.values()],
                    members=len(member_pids(plane)),
                    load1=load1(),
                )
                raise
            times[name] = watch.ready_at[name] - started
            if i % 10 == 9 or i < 3:
                note(
                    f"{name} Ready in {times[name]:.1f} s ({i + 1} groups; load "
                    f"{load1():.2f}; operator RSS {rss_mb(op):.0f} MB)"
                )
        ramp = time.monotonic() - t0
        ramp_cpu = 100 * (cpu_seconds(op) - op_cpu0) / ramp if ramp else 0.0
        note(
            f"{len(names) - 1} groups Ready in {ramp:.0f} s, the operator at "
            f"{ramp_cpu:.0f} % CPU meanwhile; settling {a.settle_seconds:.0f} s"
        )
        time.sleep(a.settle_seconds)
        last = names[-1]
        before = load1()
        started = self.apply(plane, len(names) - 1, last)
        watch.wait({last}, READY_TIMEOUT)
        times[last] = watch.ready_at[last] - started
        note(f"{last} (the last) Ready in {times[last]:.1f} s")
        # Groups without a member (--member-groups) are Ready at the status timer's first
        # tick: their times apart, so that they do not flatter the percentiles.
        values = [times[n] for i, n in enumerate(names) if self.replicas(i)]
        memberless = [times[n] for i, n in enumerate(names) if not self.replicas(i)]
        common = {
            "groups": len(names),
            "partitions": a.partitions,
            "member_groups": len(values),
        }
        emit(
            BENCH,
            "ready_seconds",
            percentile(values, 50),
            p95=percentile(values, 95),
            max=max(values),
            each=[round(times[n], 2) for n in names],
            ramp_seconds=round(ramp, 1),
            operator_cpu_pct_during_ramp=round(ramp_cpu, 1),
            **common,
            load1=load1(),
        )
        if memberless:
            emit(
                BENCH,
                "ready_seconds_without_member",
                percentile(memberless, 50),
                p95=percentile(memberless, 95),
                max=max(memberless),
                **common,
                load1=load1(),
            )
        emit(
            BENCH,
            "last_group_ready_seconds",
            times[last],
            **common,
            already_running=len(names) - 1,
            target="<= 10",
            ok=times[last] <= 10,
            load1=before,
        )

    def idle(
        self,
        plane: LocalKube,
        watch: ReadyWatch,
        pids: dict[str, int],
        op: int,
        names: list[str],
    ) -> None:
        a = self.args
        time.sleep(a.settle_seconds)
        nats_pid, etcd_pid = pids["nats-server"], pids["etcd"]
        nats_monitor = f"http://127.0.0.1:{cmdline_flag(nats_pid, '-m')}"
        # Without TLS etcd serves /metrics on its client URL.
        etcd_url = cmdline_flag(etcd_pid, "--listen-metrics-urls") or cmdline_flag(
            etcd_pid, "--listen-client-urls"
        )
        etcd_metrics = f"{etcd_url}/metrics"
        streams = [default_stream_name(NAMESPACE, n) for n in names]
        held = asyncio.run(durables(plane.state.nats_url, streams))
        members = member_pids(plane)
        note(f"idle for {a.idle_seconds:.0f} s: {len(members)} member processes, {held} durables")
        plane_pids = {n: p for n, p in pids.items() if n not in ("nats-server", "etcd")}
        watched = {"operator": op, "nats": nats_pid, "etcd": etcd_pid, **plane_pids}
        c0 = {n: cpu_seconds(p) for n, p in watched.items()}
        m0 = {p: cpu_seconds(p) for p in members}
        threads0 = thread_cpu(op)
        r0, w0, n0 = apiserver_requests(plane), etcd_writes(etcd_metrics), nats_msgs(nats_monitor)
        load_before = load1()
        e0 = watch.events
        probes0 = children_cpu_seconds(pids["kubelet"])
        t0 = time.monotonic()
        time.sleep(a.idle_seconds)
        seconds = time.monotonic() - t0
        c1 = {n: cpu_seconds(p) for n, p in watched.items()}
        probes1 = children_cpu_seconds(pids["kubelet"])
        m1 = {p: cpu_seconds(p) for p in members if Path(f"/proc/{p}").exists()}
        threads1 = thread_cpu(op)
        r1, w1, n1 = apiserver_requests(plane), etcd_writes(etcd_metrics), nats_msgs(nats_monitor)
        events = watch.events - e0
        load = round((load_before + load1()) / 2, 2)

        def pct(before: float, after: float) -> float:
            return round(100 * (after - before) / seconds, 2)

        cpu = {n: pct(c0[n], c1[n]) for n in watched}
        member_cpu = [pct(m0[p], m1[p]) for p in m1]
        per_thread = {t: pct(threads0.get(t, 0.0), v) for t, v in threads1.items()}
        busiest = dict(sorted(per_thread.items(), key=lambda kv: -kv[1])[:5])
        requests = {k: round((v - r0.get(k, 0.0)) / seconds, 2) for k, v in r1.items()}
        requests = {k: v for k, v in sorted(requests.items(), key=lambda kv: -kv[1]) if v > 0}
        common = {
            "groups": len(names),
            "partitions": a.partitions,
            "member_groups": sum(self.replicas(i) for i in range(len(names))),
            "idle_seconds": round(seconds, 1),
            "load1": load,
        }
        emit(
            BENCH,
            "operator_cpu_pct",
            cpu["operator"],
            per_group=round(cpu["operator"] / len(names), 3),
            threads=busiest,
            **common,
        )
        emit(BENCH, "operator_rss_mb", round(rss_mb(op), 1), **common)
        emit(
            BENCH,
            "nats_cpu_pct",
            cpu["nats"],
            durables=held,
            msgs_per_s=round((n1 - n0) / seconds, 1),
            **common,
        )
        emit(BENCH, "nats_rss_mb", round(rss_mb(nats_pid), 1), durables=held, **common)
        emit(
            BENCH,
            "etcd_cpu_pct",
            cpu["etcd"],
            writes_per_s=round((w1 - w0) / seconds, 1),
            **common,
        )
        emit(
            BENCH,
            "member_cpu_pct",
            statistics.median(member_cpu) if member_cpu else None,
            max=max(member_cpu, default=None),
            members=len(member_cpu),
            **common,
        )
        rss = [rss_mb(p) for p in m1]
        emit(
            BENCH,
            "member_rss_mb",
            statistics.median(rss) if rss else None,
            total=round(sum(rss), 0),
            **common,
        )
        emit(
            BENCH,
            "probe_cpu_pct",
            pct(probes0, probes1),
            per_member=round(pct(probes0, probes1) / max(len(member_cpu), 1), 2),
            **common,
        )
        emit(BENCH, "plane_cpu_pct", None, **{n: cpu[n] for n in plane_pids}, **common)
        emit(
            BENCH,
            "apiserver_requests_per_s",
            round(sum(requests.values()), 2),
            by_kind=requests,
            consumergroup_updates_per_s=round(events / seconds, 2),
            **common,
        )

    def teardown(self, plane: LocalKube, names: list[str]) -> None:
        """Delete the groups while the operator runs (its finalizer clears each group's
        etcd keys), and wait for them to go; the plane's shutdown stops whatever pods are
        left anyway. Best effort: this runs after a failure too."""
        started = time.monotonic()
        plane.kubectl("delete", "cg", "--all", "-n", NAMESPACE, "--wait=false", check=False)
        deadline = started + 300
        left = len(names)
        while time.monotonic() < deadline:
            found = plane.kubectl("get", "cg", "-n", NAMESPACE, "-o", "name", check=False)
            left = len(found.stdout.split()) if found.returncode == 0 else -1
            if left == 0:
                break
            time.sleep(1)
        seconds = time.monotonic() - started
        note(f"groups deleted in {seconds:.1f} s ({left} left)")
        emit(BENCH, "delete_all_seconds", seconds, groups=len(names), left=left, load1=load1())


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description="Many groups under one operator on the local plane: time to Ready, "
        "idle CPU and memory (issue 29).",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    parser.add_argument("--groups", type=int, default=50)
    parser.add_argument("--partitions", type=int, default=128)
    parser.add_argument("--idle-seconds", type=float, default=30.0)
    parser.add_argument(
        "--settle-seconds",
        type=float,
        default=15.0,
        help="wait before the last group, and again before the idle window",
    )
    parser.add_argument(
        "--member-groups",
        type=int,
        default=argparse.SUPPRESS,
        help="how many groups get their member (the last always does); the others get "
        "replicas 0: their stream, durables and status timer, no pod (0 or more than "
        "--groups: all). Default: all with --pod-network; 10 without, because pods "
        "probed by exec start a Python process every 2 s each, more than a core at 50 "
        "on this 2-core machine (README, 'Many groups under one operator')",
    )
    network = parser.add_mutually_exclusive_group()
    network.add_argument(
        "--pod-network",
        dest="pod_network",
        action="store_true",
        default=argparse.SUPPRESS,
        help="run the pods from the image (built first; root, buildah), each in a network "
        "namespace of its own, as on a real cluster: their probes are then HTTP (GET "
        "/readyz on the member's health port, the chart's default) instead of a "
        "shoal-ready process each (default when run as root)",
    )
    network.add_argument(
        "--no-pod-network",
        dest="pod_network",
        action="store_false",
        default=argparse.SUPPRESS,
        help="run the pods as local processes sharing the host's loopback, probed by exec "
        "(the default without root)",
    )
    parser.add_argument(
        "--profile-operator",
        type=Path,
        default=None,
        help="run the operator under cProfile, its stats written to this file on exit "
        "(for where its time goes; the figures then include the profiler's overhead)",
    )
    parser.add_argument("--keep", action="store_true", help="keep the work directory")
    args = parser.parse_args(argv)
    if args.groups < 2:
        parser.error("--groups must be at least 2 (the last one is timed apart)")
    if "pod_network" not in vars(args):
        args.pod_network = os.geteuid() == 0
        if not args.pod_network:
            note("not root: pods as local processes probed by exec (--no-pod-network)")
    if "member_groups" not in vars(args):
        args.member_groups = args.groups if args.pod_network else 10
    if args.member_groups <= 0 or args.member_groups > args.groups:
        args.member_groups = args.groups
    return args


def _stop(signum: int, _frame: Any) -> None:
    raise SystemExit(128 + signum)


def main(argv: list[str] | None = None) -> int:
    # SIGTERM, and SIGINT where a shell started this in the background with SIGINT
    # ignored, raise SystemExit: the groups are deleted and the plane stopped on the way
    # out, not left to the parent-death signal.
    signal.signal(signal.SIGTERM, _stop)
    signal.signal(signal.SIGINT, _stop)
    args = parse_args(argv)
    started = time.monotonic()
    with workdir("shoal-bench-groups-", args.keep) as root:
        Bench(args, root).run()
    note(f"wall time {time.monotonic() - started:.1f} s")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
