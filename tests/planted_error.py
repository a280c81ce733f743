"""A pytest plugin that plants an internal error in nand: the early-warning
function (``BlowUpWatch.look``, run at every clean step boundary) raises.

``tests/test_nand_stayed_on.py`` runs healthy-run tests under it
(``python -m pytest -p tests.planted_error ...``): nand switches itself off at
the first boundary and the run still ends with ``first is None``, which is
what the fixture in ``tests/conftest.py`` must not let pass.
"""

from __future__ import annotations

from typing import Any

import pytest


def pytest_configure(config: pytest.Config) -> None:
    from nand.agent.step.blowup import BlowUpWatch

    def look(self: BlowUpWatch, *args: Any, **kwargs: Any) -> list[Any]:
        raise RuntimeError("planted: the early-warning function raised")

    BlowUpWatch.look = look  # type: ignore[method-assign]
