"""The examples in the server's docstrings run."""

from __future__ import annotations

import doctest
import importlib

import pytest

MODULES = [
    "app",
    "correlate",
    "db",
    "evidence",
    "ingest",
    "metrics",
    "migrate",
    "sanitize",
    "settings",
    "stoprule",
    "summary",
]


@pytest.mark.parametrize("name", MODULES)
def test_docstring_examples(name: str) -> None:
    module = importlib.import_module(f"nand.server.{name}")
    result = doctest.testmod(module, optionflags=doctest.NORMALIZE_WHITESPACE)
    assert result.attempted > 0 and result.failed == 0
