"""Shared test settings. Area fixtures live in tests/<area>/conftest.py."""

from __future__ import annotations

import os

import pytest

# One thread per test process: the CI machine has 2 cores, and multi-rank
# tests start several processes at once.
os.environ.setdefault("OMP_NUM_THREADS", "1")
#: ``NAND_TEST_MODE=light`` runs every test's watch in the light mode
#: (``NAND_MODE``), to hold the suite to it; read before the isolation below.
TEST_MODE = os.environ.get("NAND_TEST_MODE")


@pytest.fixture(autouse=True)
def _isolated_nand_env(monkeypatch: pytest.MonkeyPatch, tmp_path) -> None:
    """No test sees the developer's NAND_* settings; spools go to a temp dir."""
    for name in list(os.environ):
        if name.startswith("NAND_"):
            monkeypatch.delenv(name)
    monkeypatch.setenv("NAND_SPOOL_DIR", str(tmp_path / "spool"))
    if TEST_MODE:
        monkeypatch.setenv("NAND_MODE", TEST_MODE)
