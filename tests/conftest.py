"""Shared test settings. Area fixtures live in tests/<area>/conftest.py."""

from __future__ import annotations

import os

import pytest

# One thread per test process: the CI machine has 2 cores, and multi-rank
# tests start several processes at once.
os.environ.setdefault("OMP_NUM_THREADS", "1")
#: ``NAND_TEST_MODE=full`` (or ``light``, the default mode) runs every test's
#: watch in that mode (``NAND_MODE``), so that the suite holds both (CI runs
#: both: see scripts/test); read before the isolation below. A test about one
#: mode's probes is marked ``@pytest.mark.nand_mode("full")`` and keeps it
#: (an argument ``mode=`` too).
TEST_MODE = os.environ.get("NAND_TEST_MODE")


@pytest.fixture(scope="session", autouse=True)
def _isolated_session_env(tmp_path_factory: pytest.TempPathFactory) -> None:
    """The same for module- and session-scoped fixtures, which start before any
    test's own isolation: their jobs must not spool into the developer's
    ~/.cache (a spool left there is replayed by the next run of that name)."""
    for name in list(os.environ):
        if name.startswith("NAND_") and not name.startswith("NAND_TEST_"):
            del os.environ[name]  # (NAND_TEST_*: the test set-up's own, e.g. PG binaries)
    os.environ["NAND_SPOOL_DIR"] = str(tmp_path_factory.mktemp("session-spool"))
    if TEST_MODE:
        os.environ["NAND_MODE"] = TEST_MODE


@pytest.fixture(autouse=True)
def _isolated_nand_env(
    request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch, tmp_path
) -> None:
    """No test sees the developer's NAND_* settings; spools go to a temp dir."""
    for name in list(os.environ):
        if name.startswith("NAND_"):
            monkeypatch.delenv(name)
    monkeypatch.setenv("NAND_SPOOL_DIR", str(tmp_path / "spool"))
    marker = request.node.get_closest_marker("nand_mode")
    mode = marker.args[0] if marker is not None else TEST_MODE
    if mode:
        monkeypatch.setenv("NAND_MODE", mode)
