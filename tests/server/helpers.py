"""Small helpers shared by the server tests."""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import TypeVar

T = TypeVar("T")


def eventually(check: Callable[[], T], timeout: float = 10.0, interval: float = 0.05) -> T:
    """Call ``check`` until it returns a truthy value (or stops raising AssertionError)."""
    deadline = time.monotonic() + timeout
    while True:
        try:
            result = check()
            if result:
                return result
        except AssertionError:
            if time.monotonic() > deadline:
                raise
        if time.monotonic() > deadline:
            raise TimeoutError("condition not met in time")
        time.sleep(interval)
