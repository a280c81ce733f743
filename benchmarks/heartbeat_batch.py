"""What one batch of heartbeats costs the writer, by the size of the run's rank table.

    python benchmarks/heartbeat_batch.py --ranks 1000,100000

For each size: an SQLite file with one run of that many ranks (2,000 hellos
through ``write_batch``, the rest copied in SQL: the rank, agent and message
rows), then ``--rounds`` batches of ``--batch`` heartbeats, each from another
rank (as a 100,000-rank job's batches are: every heartbeat its own rank),
timed around ``write_batch`` (one transaction: dedup keys, heartbeats, the
ranks' progress, commit). The ranks of a batch are spread over the run
(``scattered``) or consecutive (``consecutive``: how ``loadgen.py`` sends
them, in rank order). Median of the rounds, milliseconds.
"""

from __future__ import annotations

import argparse
import sqlite3
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from benchmarks import loadgen  # noqa: E402
from nand import wire  # noqa: E402
from nand.events import StepSummary  # noqa: E402
from nand.server.agents.writer import write_batch  # noqa: E402
from nand.server.storage import migrate  # noqa: E402
from nand.server.storage.db import make_engine  # noqa: E402

#: Ranks said hello through the writer; the others are copies of them.
THROUGH_WRITER = 2_000


def _message(kind: str, rank: int, seq: int, body: dict) -> dict:
    made = wire.agent_message(kind, agent=f"a{rank}", seq=seq, run="hb", rank=rank, body=body)
    return wire.decode(wire.encode(made))


def build(path: Path, world: int) -> None:
    engine = make_engine(f"sqlite:///{path}")
    migrate.upgrade(engine)
    plan = loadgen.Plan(run="hb", world=world, servers=(), seconds=0)
    base = min(world, THROUGH_WRITER)
    for start in range(0, base, 1_000):
        ranks = range(start, min(base, start + 1_000))
        write_batch(engine, [_message("hello", r, 1, loadgen.hello(plan, r)) for r in ranks], 0.0)
    engine.dispose()
    db = sqlite3.connect(path)
    columns = [row[1] for row in db.execute("pragma table_info(ranks)") if row[1] != "id"]
    for k in range(1, world // base):
        moved = [f"rank + {k * base}" if c == "rank" else c for c in columns]
        db.execute(
            f"insert into ranks ({', '.join(columns)}) select {', '.join(moved)} from ranks "
            "where rank < ?",
            (base,),
        )
        db.execute(
            f"insert into agents select 'a' || (rank + {k * base}), run_id, rank + {k * base}, "
            "hello_at from agents where rank < ?",
            (base,),
        )
        db.execute(
            f"insert into messages select 'a' || (cast(substr(agent, 2) as integer) + {k * base}),"
            " seq, run_id from messages where cast(substr(agent, 2) as integer) < ?",
            (base,),
        )
    db.commit()
    db.close()


def heartbeats(world: int, batch: int, round_: int, spread: bool) -> list[dict]:
    """Round ``round_``'s batch: ``batch`` heartbeats, each of another rank, the ranks
    spread over the run or consecutive (seqs rise from round to round)."""
    stride = world // batch if spread else 1
    first = round_ if spread else round_ * batch
    ranks = [(first + i * stride) % world for i in range(batch)]
    beat = StepSummary(step=1 + round_, steps_per_s=1.0, loss=2.0, grad_norm=1.0).to_dict()
    seq = 2 + round_ + (0 if spread else 1_000)  # (spread runs first: seqs only rise)
    return [_message("heartbeat", r, seq, beat) for r in ranks]


def time_batches(path: Path, world: int, batch: int, rounds: int, spread: bool) -> list[float]:
    engine = make_engine(f"sqlite:///{path}")
    seconds = []
    for round_ in range(rounds):
        messages = heartbeats(world, batch, round_, spread)
        started = time.perf_counter()
        write_batch(engine, messages, time.time())
        seconds.append(time.perf_counter() - started)
    engine.dispose()
    return seconds


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--ranks", default="1000,100000")
    parser.add_argument("--batch", type=int, default=1_000)
    parser.add_argument("--rounds", type=int, default=9)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        for world in [int(n) for n in args.ranks.split(",")]:
            path = Path(tmp) / f"hb{world}.db"
            build(path, world)
            for spread in (True, False):
                times = time_batches(path, world, args.batch, args.rounds, spread)
                print(
                    f"{world:,} ranks, {args.batch:,} heartbeats of "
                    f"{'scattered' if spread else 'consecutive'} ranks: write_batch median "
                    f"{1000 * statistics.median(times):.0f} ms "
                    f"({', '.join(f'{1000 * t:.0f}' for t in times)})",
                    flush=True,
                )


if __name__ == "__main__":
    main()
