"""`shoal-operator` names itself to kopf without asking the passwd database."""

from __future__ import annotations

import getpass
import os

import pytest
from kopf._core.engines.peering import detect_own_id

from shoal.operator.cli import set_identity


@pytest.fixture(autouse=True)
def restore_pod_id(monkeypatch: pytest.MonkeyPatch) -> None:
    """set_identity() writes POD_ID into os.environ itself; without this it stayed there
    for the rest of the session, and every operator process a later test started
    inherited this test's identity (e2e/test_operator_ha.py saw its replicas' Lease held
    by "shoal-operator-7d9f-abcde")."""
    monkeypatch.setenv("POD_ID", "")  # recorded: restored (or removed) afterwards
    monkeypatch.delenv("POD_ID")


def no_passwd_entry() -> str:
    # What getpass.getuser() does for a uid the image's /etc/passwd does not name.
    raise KeyError("getpwuid(): uid not found: 12345")


def test_the_pod_name_is_kopfs_identity_without_a_passwd_entry(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(getpass, "getuser", no_passwd_entry)
    monkeypatch.delenv("POD_ID", raising=False)
    monkeypatch.setenv("POD_NAME", "shoal-operator-7d9f-abcde")
    set_identity()
    assert detect_own_id(manual=False) == "shoal-operator-7d9f-abcde"


def test_outside_a_pod_host_and_pid_name_it(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(getpass, "getuser", no_passwd_entry)
    monkeypatch.delenv("POD_ID", raising=False)
    monkeypatch.delenv("POD_NAME", raising=False)
    set_identity()
    identity = detect_own_id(manual=False)
    assert identity.endswith(f"/{os.getpid()}")


def test_an_explicit_pod_id_wins(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("POD_ID", "chosen")
    monkeypatch.setenv("POD_NAME", "ignored")
    set_identity()
    assert detect_own_id(manual=False) == "chosen"
