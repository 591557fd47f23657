"""The partition function's conformance vectors (contracts/partition-vectors.json).

Producers in other languages check their partition function against the file; these
tests check the file against partition_for, and that it is exactly what its generator
(scripts/partition_vectors.py) writes, so the two cannot drift apart.
"""

from __future__ import annotations

import hashlib
import importlib.util
import json
import subprocess
import sys
import unicodedata
from collections import defaultdict
from collections.abc import Callable
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest

from shoal.consumer.partitioning import partition_for
from shoal.contracts.names import PROJECT_HEADER, partition_subject

REPO = Path(__file__).resolve().parent.parent
VECTORS = REPO / "contracts" / "partition-vectors.json"
SCRIPT = REPO / "scripts" / "partition_vectors.py"


def _load() -> ModuleType:
    spec = importlib.util.spec_from_file_location("partition_vectors", SCRIPT)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


generator = _load()
DATA: dict[str, Any] = json.loads(VECTORS.read_text(encoding="utf-8"))
ALL: list[dict[str, Any]] = DATA["vectors"]


def test_the_file_is_what_the_generator_writes() -> None:
    assert VECTORS.read_text(encoding="utf-8") == generator.render(), (
        "contracts/partition-vectors.json is stale: run scripts/partition_vectors.py"
    )


def test_the_generator_checks_and_writes(tmp_path: Path) -> None:
    check = [sys.executable, str(SCRIPT), "--check"]
    assert subprocess.run(check, capture_output=True).returncode == 0
    stale = tmp_path / "vectors.json"
    stale.write_text("{}\n")
    result = subprocess.run([*check, str(stale)], capture_output=True, text=True)
    assert result.returncode == 1 and "stale" in result.stderr
    assert subprocess.run([sys.executable, str(SCRIPT), str(stale)]).returncode == 0
    assert stale.read_text(encoding="utf-8") == VECTORS.read_text(encoding="utf-8")


@pytest.mark.parametrize("vector", ALL, ids=lambda v: f"{v['note']}-{v['partitions']}")
def test_every_vector_is_partition_for(vector: dict[str, Any]) -> None:
    project_id = vector["project_id"]
    assert bytes.fromhex(vector["project_id_utf8_hex"]) == project_id.encode("utf-8")
    assert vector["partition"] == partition_for(project_id, vector["partitions"])
    assert vector["subject"] == partition_subject(DATA["sample_prefix"], vector["partition"])


def test_the_file_covers_the_contract() -> None:
    assert DATA["header"] == PROJECT_HEADER == "Shoal-Project-Id"
    assert DATA["partition_counts"] == [1, 7, 128, 4096]
    by_id: dict[str, set[int]] = defaultdict(set)
    for v in ALL:
        by_id[v["project_id"]].add(v["partitions"])
    assert all(counts == {1, 7, 128, 4096} for counts in by_id.values())
    ids = list(by_id)
    assert len(ids) >= 30
    assert any(len(i) == 1 and i.isascii() for i in ids) and " " in ids
    assert max(len(i) for i in ids) >= 1000
    assert {len(i.encode()) for i in ids if len(i) == 1} >= {1, 2, 3, 4}  # UTF-8 lengths
    assert any(unicodedata.combining(c) for i in ids for c in i)
    assert any(ord(c) > 0xFFFF for i in ids for c in i)  # outside the BMP (UTF-16 pairs)


def test_the_same_text_in_nfc_and_nfd_lands_elsewhere() -> None:
    pairs = 0
    for text in generator.NORMALISED:
        nfc, nfd = unicodedata.normalize("NFC", text), unicodedata.normalize("NFD", text)
        assert nfc != nfd
        got = {(v["project_id"], v["partitions"]): v["partition"] for v in ALL}
        differ = [n for n in (7, 128, 4096) if got[nfc, n] != got[nfd, n]]
        assert differ, text
        pairs += 1
    assert pairs >= 3


def _passes(function: Callable[[str, int], int]) -> bool:
    return all(function(v["project_id"], v["partitions"]) == v["partition"] for v in ALL)


def _digest(data: bytes) -> int:
    return int.from_bytes(hashlib.sha256(data).digest(), "big")


def test_the_vectors_catch_the_likely_mistakes() -> None:
    """Plausible wrong ports of the function fail the vectors (so passing them means
    something)."""
    assert _passes(lambda p, n: _digest(p.encode("utf-8")) % n)
    mistakes: dict[str, Callable[[str, int], int]] = {
        "the low 64 bits only": lambda p, n: (_digest(p.encode()) & (2**64 - 1)) % n,
        "the high 64 bits only": lambda p, n: (_digest(p.encode()) >> 192) % n,
        "little-endian": lambda p, n: (
            int.from_bytes(hashlib.sha256(p.encode()).digest(), "little") % n
        ),
        "a signed 64-bit remainder": lambda p, n: _truncated(_signed64(_digest(p.encode())), n),
        "UTF-16 instead of UTF-8": lambda p, n: _digest(p.encode("utf-16-le")) % n,
        "NFC first": lambda p, n: _digest(unicodedata.normalize("NFC", p).encode()) % n,
        "trimmed": lambda p, n: _digest(p.strip().encode()) % n,
        "lower-cased": lambda p, n: _digest(p.lower().encode()) % n,
        "Latin-1 where it fits": lambda p, n: _digest(_latin1_or_utf8(p)) % n,
    }
    passing = [name for name, function in mistakes.items() if _passes(function)]
    assert passing == []


def _signed64(value: int) -> int:
    low = value & (2**64 - 1)
    return low - 2**64 if low >= 2**63 else low


def _truncated(value: int, n: int) -> int:
    """C, Go and Java's remainder: the sign of the dividend."""
    return abs(value) % n * (-1 if value < 0 else 1)


def _latin1_or_utf8(text: str) -> bytes:
    try:
        return text.encode("latin-1")
    except UnicodeEncodeError:
        return text.encode("utf-8")
