"""Runs of thousands of ranks: what the server does per message and per request
must not grow with the number of ranks in the run.

Work is counted, not timed (the test machine is shared): SQLite's virtual
machine instructions for the ingest, SQL statements for a request.

    python -m pytest tests/server/test_big_runs.py -q
"""

from __future__ import annotations

import time
from typing import Any

from sqlalchemy import Engine, create_engine, event

from nand import wire
from nand.server import migrate
from nand.server.writer import write_batch


def _hello(run: str, rank: int, world: int) -> dict[str, Any]:
    body = {"world_size": world, "host": f"node{rank // 8}", "pid": 1000 + rank}
    message = wire.agent_message(
        "hello", agent=f"{run}-{rank}", seq=1, run=run, rank=rank, body=body
    )
    return wire.decode(wire.encode(message))


class VmSteps:
    """SQLite virtual-machine instructions run on ``engine``'s connections, in thousands."""

    def __init__(self, engine: Engine) -> None:
        self.count = 0
        event.listen(engine, "connect", self._connected)

    def _connected(self, dbapi_connection: Any, _record: Any) -> None:
        dbapi_connection.set_progress_handler(self._tick, 1000)

    def _tick(self) -> int:
        self.count += 1
        return 0


def _hellos_cost(engine: Engine, steps: VmSteps, run: str, ranks: range, world: int) -> int:
    before = steps.count
    write_batch(engine, [_hello(run, r, world) for r in ranks], time.time())
    return steps.count - before


def test_a_new_ranks_hello_costs_the_same_in_a_run_of_200_and_of_4000_ranks(tmp_path) -> None:
    engine = create_engine(f"sqlite:///{tmp_path / 'n.db'}")
    steps = VmSteps(engine)
    migrate.upgrade(engine)
    write_batch(engine, [_hello("small", r, 400) for r in range(200)], time.time())
    write_batch(engine, [_hello("wide", r, 4200) for r in range(4000)], time.time())

    small = _hellos_cost(engine, steps, "small", range(200, 400), 400)
    wide = _hellos_cost(engine, steps, "wide", range(4000, 4200), 4200)

    # Each hello used to read every rank already in the run (20 times more here).
    assert wide < 3 * small, (small, wide)
