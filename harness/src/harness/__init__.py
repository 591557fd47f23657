"""What tests, benchmarks and demos run: real servers, member fleets, the local control
plane, demos and benchmark helpers. Importable in the development venv only (never part of
the wheel or the image); tests live in tests/ and e2e/."""

from pathlib import Path

# The checkout this harness belongs to (harness/src/harness/ -> the repository root): the
# CRD, the chart and the examples are read from there.
REPO_ROOT = Path(__file__).resolve().parents[3]
