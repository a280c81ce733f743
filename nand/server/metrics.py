"""Counters of this server process, rendered in the Prometheus text format.

Counters are per process (as Prometheus expects: scrape every server);
``nand_runs`` by state comes from the database, so it is the same on every
server.

>>> m = Metrics()
>>> m.rejected("not_msgpack")
>>> 'nand_messages_rejected_total{reason="not_msgpack"} 1' in m.render({"healthy": 2})
True
"""

from __future__ import annotations

import threading
from collections import Counter
from collections.abc import Mapping

from nand.wire import REASONS

#: Reasons the server adds to nand.wire.REASONS.
SERVER_REASONS = ("store_error",)
RUN_STATES = ("healthy", "diverged", "stalled", "finished", "lost", "crashed")


class Metrics:
    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._received = 0
        self._stored: Counter[str] = Counter()
        self._rejected: Counter[str] = Counter({r: 0 for r in (*REASONS, *SERVER_REASONS)})
        self._duplicates = 0
        self._acked = 0
        self._write_errors = 0
        self._commands = 0
        self._batches = 0
        self._batch_seconds = 0.0
        self._lag = 0.0

    def received(self, n: int) -> None:
        with self._lock:
            self._received += n

    def rejected(self, reason: str) -> None:
        with self._lock:
            self._rejected[reason] += 1

    def batch(
        self, *, kinds: Mapping[str, int], duplicates: int, acked: int, seconds: float, lag: float
    ) -> None:
        with self._lock:
            self._stored.update(kinds)
            self._duplicates += duplicates
            self._acked += acked
            self._batches += 1
            self._batch_seconds += seconds
            self._lag = lag

    def write_error(self) -> None:
        with self._lock:
            self._write_errors += 1

    def command_sent(self) -> None:
        with self._lock:
            self._commands += 1

    def snapshot(self) -> dict[str, object]:
        with self._lock:
            return {
                "received": self._received,
                "stored": dict(self._stored),
                "rejected": dict(self._rejected),
                "duplicates": self._duplicates,
                "acked": self._acked,
            }

    def render(self, runs_by_state: Mapping[str, int]) -> str:
        with self._lock:
            lines = [
                *_counter(
                    "nand_messages_received_total", "Frames received from agents.", self._received
                ),
                "# HELP nand_messages_stored_total Messages stored, by kind.",
                "# TYPE nand_messages_stored_total counter",
                *(
                    f'nand_messages_stored_total{{kind="{k}"}} {v}'
                    for k, v in sorted(self._stored.items())
                ),
                "# HELP nand_messages_rejected_total Messages rejected, by reason.",
                "# TYPE nand_messages_rejected_total counter",
                *(
                    f'nand_messages_rejected_total{{reason="{k}"}} {v}'
                    for k, v in sorted(self._rejected.items())
                ),
                *_counter(
                    "nand_messages_duplicate_total",
                    "Messages received again and acked, not stored.",
                    self._duplicates,
                ),
                *_counter(
                    "nand_messages_acked_total", "Messages acknowledged after commit.", self._acked
                ),
                *_counter(
                    "nand_events_total", "Non-finite events stored.", self._stored.get("event", 0)
                ),
                *_counter(
                    "nand_store_errors_total", "Batches that failed to commit.", self._write_errors
                ),
                *_counter("nand_commands_sent_total", "Commands sent to agents.", self._commands),
                *_counter("nand_ingest_batches_total", "Committed ingest batches.", self._batches),
                *_counter(
                    "nand_ingest_batch_seconds_total",
                    "Time spent writing batches.",
                    round(self._batch_seconds, 6),
                ),
                "# HELP nand_ingest_lag_seconds Agent send to commit, largest in the last batch.",
                "# TYPE nand_ingest_lag_seconds gauge",
                f"nand_ingest_lag_seconds {self._lag:.6f}",
            ]
        lines += ["# HELP nand_runs Runs by state.", "# TYPE nand_runs gauge"]
        lines += [f'nand_runs{{state="{s}"}} {runs_by_state.get(s, 0)}' for s in RUN_STATES]
        return "\n".join(lines) + "\n"


def _counter(name: str, help_text: str, value: float) -> list[str]:
    return [f"# HELP {name} {help_text}", f"# TYPE {name} counter", f"{name} {value}"]
