"""Synthetic assignment logs: membership histories run through the real assignor.

A history starts with a few members and then, one generation per step, members join,
leave gracefully, crash, scale in steps of several, are replaced (one leaves and one joins
in the same generation), the leader fails over, or (sticky only) the leader rebalances
measured load. Every assignment comes from :func:`shoal.assignor.assign` with the
history's strategy, so sticky histories move the minimum and modulo ones do not. Events
carry partition loads (a drifting log-normal rate per partition) and hand-over times
(tens of milliseconds for planned moves, seconds for crashes). Optionally the group empties
now and then (a generation without members), and :func:`corrupt` mixes bad lines in.
"""

from __future__ import annotations

import json
import math
import random
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, replace
from datetime import UTC, datetime, timedelta
from pathlib import Path

from shoal.analytics.layout import PartWriter, part_prefix
from shoal.assignor import assign, moved
from shoal.contracts.events import AssignmentEvent

__all__ = [
    "HistorySpec",
    "corrupt",
    "edge_cases",
    "history",
    "specs_for",
    "write_edge_cases",
    "write_history",
]

_STEPS = {
    # step: weight
    "join": 22,
    "leave": 18,
    "crash": 8,
    "scale": 12,
    "replace": 10,
    "failover": 8,
    "rebalance": 12,
    "empty": 0,  # weight set from the spec
}


@dataclass(frozen=True)
class HistorySpec:
    namespace: str = "synthetic"
    group: str = "g0"
    strategy: str = "sticky"
    partitions: int = 128
    generations: int = 100
    seed: int = 0
    start: datetime = datetime(2026, 11, 1, tzinfo=UTC)
    mean_interval_s: float = 120.0
    initial_members: int = 3
    min_members: int = 1
    max_members: int = 12
    loads: bool = True
    handover: bool = True
    # Weight of a step that empties the group (0: never); the next step starts it again.
    empty_weight: int = 0


def specs_for(
    groups: int,
    generations: int,
    *,
    strategies: Iterable[str] = ("sticky", "modulo"),
    partitions: int = 128,
    seed: int = 0,
    namespace: str = "synthetic",
    **options: object,
) -> list[HistorySpec]:
    """``groups`` histories per strategy, ``generations`` each, with distinct seeds."""
    specs = []
    for s, strategy in enumerate(strategies):
        for g in range(groups):
            base = HistorySpec(
                namespace=namespace,
                group=f"{strategy}-{g}",
                strategy=strategy,
                partitions=partitions,
                generations=generations,
                seed=seed * 1000 + s * 100 + g,
            )
            specs.append(replace(base, **options))  # type: ignore[arg-type]
    return specs


class _State:
    def __init__(self, spec: HistorySpec) -> None:
        self.spec = spec
        self.rng = random.Random(spec.seed)
        self.next_id = 0
        self.members: list[str] = []
        self.leader = ""
        self.epoch = 1000 + spec.seed % 1000
        self.generation = 0
        self.assignment: dict[int, str] = {}
        self.ts = spec.start
        self.rates = [self.rng.lognormvariate(math.log(100.0), 0.8) for _ in range(spec.partitions)]

    def new_member(self) -> str:
        self.next_id += 1
        # Pod-like ids whose sort order is unrelated to the order they joined in.
        return f"{self.spec.group}-{self.rng.randrange(16**5):05x}{self.next_id}"

    def tick(self) -> None:
        gap = self.rng.expovariate(1.0 / self.spec.mean_interval_s)
        self.ts += timedelta(milliseconds=max(1, round(gap * 1000)))
        self.rates = [r * self.rng.lognormvariate(0.0, 0.1) for r in self.rates]

    def loads(self) -> dict[int, float]:
        return {p: round(r, 1) for p, r in enumerate(self.rates)}

    def pick_step(self) -> str:
        n, spec = len(self.members), self.spec
        weights = dict(_STEPS, empty=spec.empty_weight)
        if n >= spec.max_members:
            weights["join"] = weights["scale"] = 0
        if n <= spec.min_members:
            weights["leave"] = weights["crash"] = 0
        if spec.strategy != "sticky":
            weights["rebalance"] = 0
        steps = [s for s, w in weights.items() if w > 0]
        return self.rng.choices(steps, [weights[s] for s in steps])[0]


def _handover(
    rng: random.Random, moves: list[tuple[int, str, str]], crash: bool
) -> dict[int, float]:
    if crash:
        return {p: round(rng.uniform(4000.0, 9000.0), 1) for p, _, _ in moves}
    return {p: round(rng.lognormvariate(math.log(40.0), 0.6), 1) for p, _, _ in moves}


def history(spec: HistorySpec) -> Iterator[AssignmentEvent]:
    """The events of one synthetic group, generation 1, 2, ... in order."""
    st = _State(spec)
    rng = st.rng
    for _ in range(spec.generations):
        st.tick()
        crash = False
        loads_for_assign: dict[int, float] | None = None
        if not st.members:
            step = "initial"
            st.members = [st.new_member() for _ in range(spec.initial_members)]
            st.leader = min(st.members)
            st.assignment = {}
        else:
            step = st.pick_step()
        reason = step
        if step == "join":
            st.members.append(st.new_member())
        elif step in ("leave", "crash"):
            gone = rng.choice([m for m in st.members if m != st.leader] or st.members)
            st.members.remove(gone)
            crash = step == "crash"
            reason = "leave"
        elif step == "scale":
            k = rng.randint(2, 3)
            up = rng.random() < 0.5
            if up and len(st.members) + k <= spec.max_members:
                st.members += [st.new_member() for _ in range(k)]
            elif len(st.members) - k >= spec.min_members:
                for gone in rng.sample([m for m in st.members if m != st.leader], k):
                    st.members.remove(gone)
            else:
                st.members.append(st.new_member())
        elif step == "replace":
            # One member leaves and another joins in the same generation.
            if len(st.members) > 1:
                st.members.remove(rng.choice([m for m in st.members if m != st.leader]))
            st.members.append(st.new_member())
            reason = "rebalance"
        elif step == "failover":
            st.epoch += rng.randint(1, 50)
            if len(st.members) > spec.min_members:
                st.members.remove(st.leader)  # the old leader crashed
                crash = True
            st.leader = min(st.members)
        elif step == "rebalance":
            loads_for_assign = st.loads()
        elif step == "empty":
            st.members = []
            reason = "leave"
        if st.leader not in st.members and st.members:
            st.leader = min(st.members)
            st.epoch += 1
        st.generation += 1
        previous = st.assignment
        if st.members:
            current = assign(
                spec.partitions,
                st.members,
                previous or None,
                strategy=spec.strategy,
                loads=loads_for_assign,
            )
        else:
            current = {}
        moves = moved(previous, current)
        st.assignment = current
        yield AssignmentEvent.of(
            ts=st.ts,
            namespace=spec.namespace,
            group=spec.group,
            generation=st.generation,
            epoch=st.epoch,
            leader=st.leader or "none",
            reason=reason,
            strategy=spec.strategy,
            members=st.members,
            assignment=current,
            moved=moves,
            handover_ms=_handover(rng, moves, crash) if spec.handover else None,
            loads=st.loads() if spec.loads else None,
        )


def corrupt(
    lines: list[bytes],
    rng: random.Random,
    *,
    malformed: int = 0,
    unknown_schema: int = 0,
    out_of_order: int = 0,
) -> list[bytes]:
    """``lines`` with bad lines mixed in (never before the first line): ``malformed`` ones
    (truncated JSON, not JSON, not an object, a schema-1 object missing fields or with a bad
    time), ``unknown_schema`` ones (schema 2) and ``out_of_order`` ones (an earlier line of
    the same group repeated later, so its generation is not above the ones before it)."""
    out = list(lines)
    if not out:
        return out

    def insert(line: bytes, after: int = 0) -> None:
        out.insert(rng.randint(after + 1, len(out)), line)

    for i in range(malformed):
        sample = json.loads(rng.choice(lines))
        variants = [
            rng.choice(lines)[: rng.randint(1, 40)],
            b"this is not json",
            b"[1, 2, 3]",
            json.dumps({k: v for k, v in sample.items() if k != "members"}).encode(),
            json.dumps({**sample, "ts": "yesterday"}).encode(),
            json.dumps({**sample, "reason": "boredom"}).encode(),
            b"\xff\xfe not utf-8",
        ]
        insert(variants[i % len(variants)])
    for _ in range(unknown_schema):
        sample = json.loads(rng.choice(lines))
        insert(json.dumps({**sample, "schema": 2}).encode())
    for _ in range(out_of_order):
        at = rng.randrange(len(lines) - 1) if len(lines) > 1 else 0
        line = lines[at]
        insert(line, out.index(line) + 1 if at + 1 < len(lines) else len(out) - 1)
    return out


def write_history(
    events: Iterable[AssignmentEvent],
    out: Path,
    *,
    max_lines: int = 20_000,
    bad: dict[str, int] | None = None,
    seed: int = 0,
) -> tuple[int, list[Path]]:
    """Write one group's events (plus bad lines if ``bad`` asks for them, see
    :func:`corrupt`) as date-partitioned JSON lines; returns (lines, files)."""
    pairs = [(e.ts.date(), e.to_bytes(), part_prefix(e.namespace, e.group)) for e in events]
    if not pairs:
        return 0, []
    prefix = pairs[0][2]
    lines = [line for _, line, _ in pairs]
    if bad:
        lines = corrupt(lines, random.Random(seed), **bad)
    day_of = {line: day for day, line, _ in pairs}
    day = pairs[0][0]
    with PartWriter(out, prefix, max_lines=max_lines) as writer:
        for seq, line in enumerate(lines, start=1):
            # Inserted lines stay in the current date folder, so reading the folders in
            # order reads the lines in the order written.
            day = max(day, day_of.get(line, day))
            writer.write(day, seq, line)
    return writer.lines, writer.files


def _edge_event(
    group: str,
    generation: int,
    minute: int,
    members: list[str],
    assignment: dict[int, str],
    previous: dict[int, str] | None = None,
    *,
    reason: str = "rebalance",
    strategy: str = "sticky",
    epoch: int = 1,
    handover_ms: dict[int, float] | None = None,
    loads: dict[int, float] | None = None,
) -> bytes:
    return AssignmentEvent.of(
        ts=datetime(2026, 11, 2, 12, 0, tzinfo=UTC) + timedelta(minutes=minute),
        namespace="edge",
        group=group,
        generation=generation,
        epoch=epoch,
        leader=min(members) if members else "none",
        reason=reason,
        strategy=strategy,
        members=members,
        assignment=assignment,
        moved=moved(previous or {}, assignment),
        handover_ms=handover_ms,
        loads=loads,
    ).to_bytes()


def edge_cases() -> dict[str, bytes]:
    """Hand-written corner cases: relative path -> file content (namespace ``edge``).

    * ``single``: one member throughout (initial, a fail-over, an unchanged rebalance).
    * ``swap``: a member leaves and another joins in one generation, then the group empties
      (a generation without members or assignment) and starts again.
    * ``quota``: 7 partitions where the +1 quotas decide the minimum (ties by id), with a
      hand-made assignment that moves more than the minimum.
    * ``outsider``: an owner that is not in ``members``; partial loads; a generation
      without loads; hand-over times for some moves.
    * ``gap``: a partition missing from one generation (not a move when it comes back).
    * ``split``: one group over two files, with an out-of-order repeat, CRLF line ends,
      blank lines, a naive and an offset time stamp.
    * files readers must skip (hidden names, other suffixes) and a file of blank lines.
    """
    files: dict[str, bytes] = {}
    a8 = assign(8, ["a"])
    single = [
        _edge_event("single", 1, 0, ["a"], a8, reason="initial"),
        _edge_event("single", 2, 5, ["a"], a8, a8, reason="failover", epoch=2),
        _edge_event("single", 3, 9, ["a"], a8, a8, epoch=2),
    ]
    ab = assign(8, ["a", "b"])
    bc = assign(8, ["b", "c"], ab)
    d = assign(8, ["d"])
    swap = [
        _edge_event("swap", 1, 0, ["a", "b"], ab, reason="initial"),
        _edge_event("swap", 2, 3, ["b", "c"], bc, ab, handover_ms={p: 10.0 + p for p in range(8)}),
        _edge_event("swap", 3, 4, [], {}, bc, reason="leave"),
        _edge_event("swap", 5, 8, ["d"], d, reason="initial"),
    ]
    q1 = {0: "a", 1: "a", 2: "a", 3: "b", 4: "b", 5: "b", 6: "c"}
    # Quotas for a, b, c, d: 2, 2, 2, 1 (a and b held 3 each): minimum 2; this one moves 3.
    q2 = {0: "a", 1: "a", 2: "d", 3: "b", 4: "b", 5: "c", 6: "c"}
    t1 = {0: "a", 1: "a", 2: "b", 3: "b", 4: "c", 5: "c", 6: "d"}
    # Five members, 7 partitions: +1 quotas to a and b (ties by id): c gives 1: minimum 1.
    t2 = assign(7, ["a", "b", "c", "d", "e"], t1)
    quota = [
        _edge_event("quota", 1, 0, ["a", "b", "c"], q1, reason="initial"),
        _edge_event("quota", 2, 1, ["a", "b", "c", "d"], q2, q1, reason="join"),
        _edge_event("quota", 3, 2, ["a", "b", "c", "d"], t1, q2),
        _edge_event("quota", 4, 3, ["a", "b", "c", "d", "e"], t2, t1, reason="join"),
    ]
    o1 = {0: "x", 1: "x", 2: "y", 3: "y"}
    o2 = {0: "x", 1: "y", 2: "y", 3: "gone"}
    outsider = [
        _edge_event(
            "outsider", 1, 0, ["x", "y"], o1, reason="initial", loads={0: 5.0, 2: 1.5, 9: 7.0}
        ),
        _edge_event("outsider", 2, 2, ["x", "y"], o2, o1, handover_ms={1: 40.0}),
        _edge_event(
            "outsider",
            3,
            4,
            ["x", "y", "z"],
            assign(4, ["x", "y", "z"], o2),
            o2,
            reason="join",
            loads={1: 2.0, 3: 0.0},
        ),
    ]
    g1 = {0: "a", 1: "a", 2: "b", 3: "b"}
    g2 = {0: "a", 1: "b", 2: "b"}
    g3 = {0: "a", 1: "b", 2: "b", 3: "a"}
    gap = [
        _edge_event("gap", 1, 0, ["a", "b"], g1, reason="initial"),
        _edge_event("gap", 2, 1, ["a", "b"], g2, g1),
        _edge_event("gap", 3, 2, ["a", "b"], g3, g2),
    ]
    s1 = assign(16, ["m1", "m2"])
    s2 = assign(16, ["m1", "m2", "m3"], s1)
    s3 = assign(16, ["m2", "m3"], s2)
    s4 = assign(16, ["m2", "m3", "m4", "m5"], s3)
    split_a = [
        _edge_event("split", 1, 0, ["m1", "m2"], s1, reason="initial", strategy="modulo"),
        _edge_event("split", 2, 1, ["m1", "m2", "m3"], s2, s1, reason="join"),
    ]
    naive = json.loads(_edge_event("split", 3, 2, ["m2", "m3"], s3, s2, reason="leave"))
    naive["ts"] = "2026-11-02T12:02:00"  # no offset: taken as UTC
    offset = json.loads(_edge_event("split", 4, 3, ["m2", "m3", "m4", "m5"], s4, s3))
    offset["ts"] = "2026-11-02T14:03:00.250+02:00"
    offset["reason"] = "scale"
    files["part-edge-a.jsonl"] = b"\n".join([*single, *swap, *quota]) + b"\n"
    files["nested/part-edge-b.jsonl"] = b"\n".join([*outsider, *gap]) + b"\n"
    files["split/1.jsonl"] = b"\r\n".join(split_a) + b"\r\n\r\n"
    files["split/2.jsonl"] = b"\n".join(
        [
            b"",
            json.dumps(naive).encode(),
            b"   ",
            split_a[1],  # out of order: generation 2 after 3
            json.dumps(offset).encode(),
        ]
    )
    hidden = _edge_event("hidden", 1, 0, ["h"], assign(4, ["h"]), reason="initial")
    files[".hidden.jsonl"] = hidden + b"\n"
    files["_temporary/part.jsonl"] = hidden + b"\n"
    files["split/.part-x.jsonl.tmp"] = hidden + b"\n"
    files["notes.txt"] = hidden + b"\n"
    files["blank.jsonl"] = b"\n\n  \n"
    return files


def write_edge_cases(out: Path) -> list[Path]:
    """Write :func:`edge_cases` below ``out``."""
    written = []
    for name, content in edge_cases().items():
        path = out / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(content)
        written.append(path)
    return written
