"""The transport's settings: ``NAND_*`` variables, overridable in code.

>>> TransportSettings.resolve(queue_max=10).queue_max
10
"""

from __future__ import annotations

import dataclasses
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from nand import config, wire
from nand.errors import ConfigError


def default_spool_dir() -> Path:
    cache = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(cache) / "nand" / "spool"


@dataclass(frozen=True)
class TransportSettings:
    #: Messages held in memory (hand-off queue, and again queue + in flight).
    queue_max: int = 10_000
    spool_dir: Path = dataclasses.field(default_factory=default_spool_dir)
    spool_max_bytes: int = 256 * 1024 * 1024
    ack_timeout_s: float = 5.0
    close_timeout_s: float = 2.0
    curve_server_key: str | None = None
    #: Frames sent and not yet acknowledged, at most.
    window: int = 256
    #: How long messages wait in memory for a first connection before spooling.
    connect_grace_s: float = 1.0
    #: The sender wakes at least this often (events and close wake it at once).
    poll_interval_s: float = 0.1
    max_frame_bytes: int = wire.DEFAULT_MAX_BYTES
    #: With no heartbeat from the training thread for this long, the sender
    #: thread repeats the last one (``keepalive: true``): a rank blocked in a
    #: collective then reads as *stalled* (alive, no progress), not *lost*.
    keepalive_s: float = 10.0

    @classmethod
    def resolve(cls, **overrides: Any) -> TransportSettings:
        """Settings from the environment; keyword arguments win."""
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = set(overrides) - known
        if unknown:
            raise ConfigError(
                f"unknown transport setting(s) {sorted(unknown)}; known: {sorted(known)}"
            )
        spool_dir = config.get_str(config.NAND_SPOOL_DIR)
        values: dict[str, Any] = {
            "queue_max": config.get_int(config.NAND_QUEUE_MAX, cls.queue_max),
            "spool_dir": Path(spool_dir) if spool_dir else default_spool_dir(),
            "spool_max_bytes": config.get_int(config.NAND_SPOOL_MAX_BYTES, cls.spool_max_bytes),
            "ack_timeout_s": config.get_float(config.NAND_ACK_TIMEOUT_S, cls.ack_timeout_s),
            "close_timeout_s": config.get_float(config.NAND_CLOSE_TIMEOUT_S, cls.close_timeout_s),
            "curve_server_key": config.get_str(config.NAND_CURVE_SERVER_KEY),
            "keepalive_s": 2 * config.get_float(config.NAND_HEARTBEAT_S, cls.keepalive_s / 2),
        }
        values.update({k: v for k, v in overrides.items() if v is not None})
        values["spool_dir"] = Path(values["spool_dir"])
        settings = cls(**values)
        if settings.queue_max < 1 or settings.window < 1 or settings.ack_timeout_s <= 0:
            raise ConfigError("queue_max and window must be >= 1 and ack_timeout_s > 0")
        return settings
