"""Suite-wide rules for tests/ and e2e/.

A test that asks for a real server (etcd, nats-server, the local control plane) is an e2e
test wherever it lives: it gets the ``e2e`` marker here, so ``pytest -m "not e2e"`` (``make
test-fast``) never starts a server, whether or not its module remembered to say so.
"""

from __future__ import annotations

import pytest

from shoal.logs import quiet_known_noise

# What the commands install through setup_logging (no Shoal module does it on import):
# without it, each closed etcd client's watcher thread ends in a traceback.
quiet_known_noise()

# Fixtures that start real servers (tests/conftest.py, e2e/conftest.py); any fixture that
# depends on one of them pulls it into the test's closure, so that is caught too.
SERVER_FIXTURES = frozenset({"etcd_server", "nats_server", "localkube"})


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    for item in items:
        if SERVER_FIXTURES & set(getattr(item, "fixturenames", ())):
            item.add_marker(pytest.mark.e2e)
