"""Reading one environment variable, with an error that names it.

The variables themselves, and what each does, are in :mod:`nand.config`
(which re-exports these readers: ``config.get_float(config.NAND_..., 5.0)``).

>>> import os
>>> os.environ["NAND_EXAMPLE_S"] = "2.5"
>>> get_float("NAND_EXAMPLE_S", 1.0), get_float("NAND_UNSET_EXAMPLE_S", 1.0)
(2.5, 1.0)
"""

from __future__ import annotations

import os

from nand.errors import ConfigError


def get_str(name: str, default: str | None = None) -> str | None:
    value = os.environ.get(name)
    return default if value is None or value == "" else value


def get_int(name: str, default: int) -> int:
    value = get_str(name)
    if value is None:
        return default
    try:
        return int(value)
    except ValueError:
        raise ConfigError(f"{name}={value!r} is not an integer") from None


def get_float(name: str, default: float) -> float:
    value = get_str(name)
    if value is None:
        return default
    try:
        return float(value)
    except ValueError:
        raise ConfigError(f"{name}={value!r} is not a number") from None


def get_bool(name: str, default: bool = False) -> bool:
    value = get_str(name)
    if value is None:
        return default
    lowered = value.strip().lower()
    if lowered in ("1", "true", "yes", "on"):
        return True
    if lowered in ("0", "false", "no", "off"):
        return False
    raise ConfigError(f"{name}={value!r} is not a boolean (use 1/0, true/false)")
