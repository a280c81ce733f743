"""The torch versions nand supports, checked without importing torch.

``pyproject.toml``'s ``agent`` extra declares the same minimum (a test holds
them together); CI runs the agent's tests on that oldest torch and on the
newest release (``tests/test_torch_versions.py``).

>>> too_old("2.2.2+cu121")
'nand needs torch >= 2.4 (found 2.2.2+cu121)'
>>> too_old("2.4.0") is None and too_old("2.15.0") is None and too_old("2.6.0a0+git1234") is None
True
"""

from __future__ import annotations

import importlib.metadata
import re

#: The oldest torch nand works on (major, minor).
TORCH_MIN = (2, 4)
#: The newest torch release CI tests (raise it when torch releases; the
#: release steps in CONTRIBUTING.md say so).
TORCH_NEWEST_TESTED = "2.15.0"


def torches_tested() -> tuple[str, str]:
    """The oldest supported and the newest torch CI runs the agent's tests on.

    >>> torches_tested()
    ('2.4.0', '2.15.0')
    """
    return f"{TORCH_MIN[0]}.{TORCH_MIN[1]}.0", TORCH_NEWEST_TESTED


def installed_torch() -> str | None:
    """The installed torch's version string, read from its metadata (no import)."""
    try:
        return importlib.metadata.version("torch")
    except importlib.metadata.PackageNotFoundError:
        return None


def too_old(version: str | None) -> str | None:
    """The one line to say when ``version`` is older than :data:`TORCH_MIN`, else None.

    A version that does not start with numbers (a custom build) gets the benefit
    of the doubt: None.
    """
    if version is None:
        return None
    found = re.match(r"(\d+)\.(\d+)", version)
    if found is None or (int(found[1]), int(found[2])) >= TORCH_MIN:
        return None
    return f"nand needs torch >= {TORCH_MIN[0]}.{TORCH_MIN[1]} (found {version})"
