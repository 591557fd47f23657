#!/usr/bin/env python3
"""Write contracts/partition-vectors.json: the partition function's conformance vectors.

A producer in any language finds a project's partition as Shoal does
(shoal.contracts.names.partition_for): the SHA-256 of the project id's UTF-8 bytes, read
as one unsigned big-endian 256-bit integer, modulo the group's partitions; it publishes
to `<prefix>.<partition>` with the id in the `Shoal-Project-Id` header. The vectors pin
that down for ASCII, Unicode (several scripts, emoji, combining marks, the same text in
NFC and in NFD), ids of one character or one space, and long ids, for 1, 7, 128 and 4096
partitions. The file is generated, never edited: tests/test_partition_vectors.py checks
it against partition_for and against this script's output.

Usage: partition_vectors.py [--check] [PATH]
  (PATH: by default contracts/partition-vectors.json beside this script's parent;
   --check: exit 1 if the file differs from what this script writes, write nothing)
"""

from __future__ import annotations

import argparse
import json
import sys
import unicodedata
from pathlib import Path
from typing import Any

from shoal.contracts.names import PROJECT_HEADER, partition_for, partition_subject

REPO = Path(__file__).resolve().parent.parent
DEFAULT_PATH = REPO / "contracts" / "partition-vectors.json"

PARTITIONS = (1, 7, 128, 4096)
SAMPLE_PREFIX = "shoal.default.orders"  # shoal.<namespace>.<group>, the default prefix

# The same text in NFC and in NFD: different bytes, so (usually) different partitions.
# A producer must hash the bytes it was given and normalise nothing.
NORMALISED = ("café", "한국어", "Tiếng Việt")


def _cases() -> list[tuple[str, str]]:
    """(what it checks, project id), in the order of the file."""
    cases: list[tuple[str, str]] = [
        # ASCII
        ("ascii", "project-0"),
        ("ascii", "project-1"),
        ("ascii: case matters", "Project-1"),
        ("ascii", "orders/42"),
        ("ascii: digits", "1234567890"),
        ("ascii: a UUID", "3f2c9a0e-5b1d-4c7e-9f4a-2d8b6e1c0a57"),
        ("ascii: punctuation", "a.b*c>d e"),
        ("ascii: leading and trailing spaces are part of the id", " padded "),
        # Empty-adjacent: the empty id is refused (partition_for raises ValueError).
        ("empty-adjacent: one space", " "),
        ("empty-adjacent: one ASCII character", "a"),
        ("empty-adjacent: one digit", "0"),
        ("empty-adjacent: one character, 2 UTF-8 bytes", "é"),
        ("empty-adjacent: one character, 3 UTF-8 bytes", "€"),
        ("empty-adjacent: one character, 4 UTF-8 bytes", "😀"),
        ("empty-adjacent: no-break space U+00A0", "\u00a0"),
        # Unicode scripts
        ("unicode: Latin with diacritics", "Zürich-Øresund-Łódź"),
        ("unicode: Greek", "Ελληνικά"),
        ("unicode: Cyrillic", "проект-один"),
        ("unicode: Arabic (right to left)", "مشروع"),
        ("unicode: Hebrew (right to left)", "פרויקט"),
        ("unicode: Devanagari", "परियोजना"),
        ("unicode: Thai", "โครงการ"),
        ("unicode: Chinese", "项目一号"),
        ("unicode: Japanese", "プロジェクト東京"),
        ("unicode: outside the BMP (CJK Extension B)", "𠜎𠜱𠝹"),
        # "project" in MATHEMATICAL BOLD SMALL letters (U+1D41A is a bold a).
        (
            "unicode: mathematical alphanumerics",
            "".join(chr(0x1D41A + ord(c) - 97) for c in "project"),
        ),
        # Emoji
        ("emoji", "🚀"),
        ("emoji: ZWJ sequence", "👩\u200d💻"),
        ("emoji: skin-tone modifier", "👍🏽"),
        ("emoji: flag (regional indicators)", "🇳🇴"),
        ("emoji: keycap (variation selector)", "1\ufe0f\u20e3"),
        # Combining marks
        ("combining marks: stacked on one base", "a\u0301\u0302\u0303"),
        ("combining marks: a lone combining mark", "\u0301"),
    ]
    for text in NORMALISED:
        cases.append((f"normalisation: {text!r} in NFC", unicodedata.normalize("NFC", text)))
        cases.append((f"normalisation: {text!r} in NFD", unicodedata.normalize("NFD", text)))
    cases += [
        ("long: 1,024 ASCII characters", "".join(f"{i % 10}" for i in range(1024))),
        ("long: 1,000 characters, 2,500 UTF-8 bytes", "añ中😀" * 250),
    ]
    return cases


def vectors() -> dict[str, Any]:
    """The file's content."""
    out: list[dict[str, Any]] = []
    for note, project_id in _cases():
        for partitions in PARTITIONS:
            partition = partition_for(project_id, partitions)
            out.append(
                {
                    "note": note,
                    "project_id": project_id,
                    "project_id_utf8_hex": project_id.encode("utf-8").hex(),
                    "partitions": partitions,
                    "partition": partition,
                    "subject": partition_subject(SAMPLE_PREFIX, partition),
                }
            )
    return {
        "contract": (
            "partition = int.from_bytes(sha256(project_id.encode('utf-8')).digest(), 'big')"
            " % partitions; publish to <prefix>.<partition> with the project id in the"
            f" {PROJECT_HEADER} header"
        ),
        "notes": [
            "Hash the id's UTF-8 bytes exactly as given: no Unicode normalisation, no"
            " trimming, case-sensitive (project_id_utf8_hex holds the bytes).",
            "The SHA-256 digest is one unsigned big-endian 256-bit integer; the remainder"
            " must be taken of all of it (the low 64 bits give the right answer only for a"
            " power-of-two partition count: the 7-partition vectors catch that).",
            "The empty id is not a project id: Shoal refuses it. An id that starts or ends"
            " with whitespace, or holds CR or LF, hashes as any other but cannot travel in"
            " a NATS header (clients trim header values), so Shoal's producers refuse it;"
            " the one-space vectors test the function alone.",
            "Generated by scripts/partition_vectors.py; do not edit.",
        ],
        "header": PROJECT_HEADER,
        "sample_prefix": SAMPLE_PREFIX,
        "partition_counts": list(PARTITIONS),
        "vectors": out,
    }


def render() -> str:
    """The file's text: the header fields indented, one vector per line (diffable)."""
    data = vectors()
    items = data.pop("vectors")
    head = json.dumps(data, ensure_ascii=False, indent=2)
    lines = ",\n".join("    " + json.dumps(v, ensure_ascii=False) for v in items)
    return head[:-2] + ',\n  "vectors": [\n' + lines + "\n  ]\n}\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("path", nargs="?", type=Path, default=DEFAULT_PATH)
    parser.add_argument("--check", action="store_true", help="compare, write nothing")
    args = parser.parse_args(argv)
    text = render()
    if args.check:
        current = args.path.read_text(encoding="utf-8") if args.path.exists() else None
        if current != text:
            print(f"{args.path} is stale: run scripts/partition_vectors.py", file=sys.stderr)
            return 1
        return 0
    args.path.parent.mkdir(parents=True, exist_ok=True)
    args.path.write_text(text, encoding="utf-8")
    print(f"wrote {len(json.loads(text)['vectors'])} vectors to {args.path}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
