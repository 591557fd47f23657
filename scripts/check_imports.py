#!/usr/bin/env python3
"""Check the import rules between Shoal's layers (run by `make lint`).

The rules (issue 28), from the bottom up:

- `shoal.contracts`, `shoal.assignor` and `shoal.logs` import nothing of Shoal but
  `shoal.contracts`;
- `shoal.clients` (etcd, NATS, Kubernetes) imports nothing of Shoal but the contracts and
  itself;
- `shoal.group` (a group's configuration, JetStream objects, etcd view and status, which
  members, the operator and analytics share) imports only the layers below it: the
  contracts, the modules beside them, the clients, and itself;
- product code (`shoal.*`) never imports the test harness (`harness`);
- `shoal.operator` and `shoal.analytics` never import `shoal.consumer`.

KNOWN lists imports allowed to break a rule where they stand (none today: the 24 the
check found when it was written have moved); an entry that no longer exists fails the
check too, so that the list only shrinks. Imports inside functions count as much as those
at the top.

Usage: check_imports.py [ROOT]   (ROOT: the repository, by default this file's parent's)
"""

from __future__ import annotations

import ast
import sys
from collections.abc import Iterator
from pathlib import Path

# Where each distribution keeps its `shoal` modules.
SOURCE_ROOTS = ("common/src", "consumer/src", "operator/src", "analytics/src")

# Modules beside the contracts at the bottom: pure, shared by every part.
BOTTOM = frozenset({"shoal.assignor", "shoal.logs"})

# (importing module, imported module) pairs allowed to break a rule (see the docstring).
KNOWN: frozenset[tuple[str, str]] = frozenset()


def modules(root: Path) -> Iterator[tuple[str, Path]]:
    """(dotted module name, path) of every product module."""
    for source in SOURCE_ROOTS:
        base = root / source
        for path in sorted(base.rglob("*.py")):
            parts = list(path.relative_to(base).with_suffix("").parts)
            if parts[-1] == "__init__":
                parts.pop()
            yield ".".join(parts), path


def imported(module: str, path: Path) -> Iterator[tuple[str, int]]:
    """(imported module, line) for every import in `path`, relative ones resolved."""
    tree = ast.parse(path.read_text(), filename=str(path))
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                yield alias.name, node.lineno
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")
                anchor = anchor[: len(anchor) - node.level + 1]
                base = ".".join([*anchor, base] if base else anchor)
            # `from shoal import assignor` imports shoal.assignor.
            for alias in node.names:
                yield f"{base}.{alias.name}", node.lineno


def within(name: str, package: str) -> bool:
    return name == package or name.startswith(package + ".")


def broken_rule(importer: str, name: str) -> str | None:
    """Which rule importing `name` from `importer` breaks, if any."""
    if within(name, "harness"):
        return "product code never imports the test harness"
    if (within(importer, "shoal.contracts") or importer in BOTTOM) and (
        within(name, "shoal") and not within(name, "shoal.contracts")
    ):
        return "the contracts and the modules beside them import nothing of Shoal but the contracts"
    if within(importer, "shoal.clients") and (
        within(name, "shoal")
        and not within(name, "shoal.contracts")
        and not within(name, "shoal.clients")
    ):
        return "the clients import nothing of Shoal but the contracts and themselves"
    if within(importer, "shoal.group") and (
        within(name, "shoal")
        and not any(within(name, below) for below in ("shoal.contracts", "shoal.clients"))
        and not any(within(name, module) for module in BOTTOM)
        and not within(name, "shoal.group")
    ):
        return "shoal.group imports only the contracts, the modules beside them and the clients"
    if (within(importer, "shoal.operator") or within(importer, "shoal.analytics")) and within(
        name, "shoal.consumer"
    ):
        return "the operator and analytics never import shoal.consumer"
    return None


def check(root: Path, known: frozenset[tuple[str, str]] = KNOWN) -> list[str]:
    """Every broken rule under `root`, as a line a person can act on; [] if none."""
    problems: list[str] = []
    seen: set[tuple[str, str]] = set()
    found = dict(modules(root))
    for module, path in found.items():
        for name, line in imported(module, path):
            rule = broken_rule(module, name)
            if rule is None:
                continue
            # `from shoal.consumer.x import Name` names shoal.consumer.x.Name: the module
            # (shoal.consumer.x) is what KNOWN lists.
            target = next((m for m in _prefixes(name) if m in found), name)
            pair = (module, target)
            seen.add(pair)
            if pair not in known:
                where = path.relative_to(root)
                problems.append(f"{where}:{line}: {module} imports {target}: {rule}")
    for importer, name in sorted(known - seen):
        problems.append(
            f"scripts/check_imports.py: KNOWN lists {importer} -> {name}, which is gone: "
            "remove it from the list"
        )
    return problems


def _prefixes(name: str) -> Iterator[str]:
    parts = name.split(".")
    for end in range(len(parts), 0, -1):
        yield ".".join(parts[:end])


def main(argv: list[str]) -> int:
    root = Path(argv[1]) if len(argv) > 1 else Path(__file__).resolve().parent.parent
    problems = check(root)
    for problem in problems:
        print(problem, file=sys.stderr)
    if problems:
        print(f"{len(problems)} import rule violation(s)", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
