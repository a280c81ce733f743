"""Shared test settings. Area fixtures live in tests/<area>/conftest.py."""

from __future__ import annotations

import logging
import os
import sys
from collections.abc import Callable, Iterator
from typing import Any

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


class _ErrorRecords(logging.Handler):
    """Keeps the ERROR records of nand's loggers (``nand``, ``nand.*``)."""

    def __init__(self) -> None:
        super().__init__(logging.ERROR)
        self.records: list[logging.LogRecord] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.records.append(record)


def _internal_errors(guards: list[Any], records: list[logging.LogRecord]) -> list[str]:
    """What nand said of its own failures: a guard's recorded error (not a
    peer gone: a rank killed on purpose) and any ERROR record with a traceback
    or naming an internal error."""
    found = []
    for guard in guards:
        error = guard.error
        if error is not None and type(error).__name__ != "PeerGone":
            found.append(f"nand switched itself off: {type(error).__name__}: {error}")
    for record in records:
        message = record.getMessage()
        if record.exc_info or "internal error" in message:
            found.append(f"{record.name} logged: {message}")
    return found


@pytest.fixture(autouse=True)
def _nand_stayed_on(request: pytest.FixtureRequest) -> Iterator[None]:
    """A test fails when nand switched itself off or logged an internal error
    (``nand/agent/safety.py``): a healthy run that ends with ``first is None``
    proves nothing if nand stopped looking. A test that plants such an error
    on purpose says so: ``@pytest.mark.nand_internal_error_expected``.

    The guards are read where the test's process made them (a test that has
    imported torch: its watches); the log catches the rest. Jobs in other
    processes are checked by their harnesses (their output is read).
    """
    guards: list[Any] = []
    handler = _ErrorRecords()
    logger = logging.getLogger("nand")
    logger.addHandler(handler)
    restore = _track_guards(guards) if "torch" in sys.modules else None
    try:
        yield
    finally:
        logger.removeHandler(handler)
        if restore is not None:
            restore()
    if request.node.get_closest_marker("nand_internal_error_expected") is None:
        found = _internal_errors(guards, handler.records)
        if found:
            pytest.fail(
                "nand failed inside this test (mark it nand_internal_error_expected "
                "if the error is planted):\n  " + "\n  ".join(found),
                pytrace=False,
            )


def _track_guards(guards: list[Any]) -> Callable[[], None]:
    """Collect every :class:`~nand.agent.safety.Guard` made from now on."""
    from nand.agent.safety import Guard

    init = Guard.__init__

    def tracked(self: Guard) -> None:
        init(self)
        guards.append(self)

    Guard.__init__ = tracked  # type: ignore[method-assign]

    def restore() -> None:
        Guard.__init__ = init  # type: ignore[method-assign]

    return restore


#: On CI (``CI`` set, as ``.ci/run`` does) the set-up installs every part the
#: tests use (PostgreSQL, Chromium, the frameworks, a tmpfs as root): a skip
#: there hides a part that was meant to be tested. Only a GPU may be missing
#: (tests marked ``gpu``); xfails and doctest directives are not skips.
ON_CI = bool(os.environ.get("CI"))


def _skip_fails_on_ci(report: pytest.TestReport | pytest.CollectReport, gpu: bool) -> None:
    if ON_CI and report.skipped and not gpu and not hasattr(report, "wasxfail"):
        reason = report.longrepr[2] if isinstance(report.longrepr, tuple) else report.longrepr
        report.outcome = "failed"
        report.longrepr = f"skipped on CI, where nothing but a GPU may be missing: {reason}"


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo[None]) -> Iterator[None]:
    outcome = yield
    if type(item).__name__ != "DoctestItem":
        _skip_fails_on_ci(outcome.get_result(), item.get_closest_marker("gpu") is not None)


@pytest.hookimpl(hookwrapper=True)
def pytest_make_collect_report(collector: pytest.Collector) -> Iterator[None]:
    outcome = yield
    _skip_fails_on_ci(outcome.get_result(), gpu=False)
