"""One run summary, whichever way it is built: from every rank row loaded
(``views.run_summary``) and, for a run of more than ``big_run_ranks`` ranks,
by the database's counts (the read facade's big-run path, which the runs list
and the event stream both take) give the same body, the messages the agents
dropped included, for a run whose ranks failed in several ways."""

from __future__ import annotations

import time
from itertools import count

import httpx
from sqlalchemy.orm import Session

from nand import wire
from nand.cli.wait import stream_summaries
from nand.events import StepSummary
from nand.server.agents.writer import write_batch
from nand.server.analysis import views
from nand.server.embedded import EmbeddedServer
from nand.server.storage import store

DROPPED = {2: {"spool_full": 1000}, 250: {"queue_full": 3, "spool_full": 1}}


class Ranks:
    """Messages from a run's ranks, stored through the server's writer at chosen times."""

    def __init__(self, server: EmbeddedServer, run: str, world: int) -> None:
        self.engine = server.app.state.nand.engine
        self.run, self.world = run, world
        self.seqs: dict[int, count[int]] = {}

    def send(self, now: float, kind: str, ranks: range | list[int], **body: object) -> None:
        messages = [
            wire.decode(
                wire.encode(
                    wire.agent_message(
                        kind,
                        agent=f"{self.run}-{r}",
                        seq=next(self.seqs.setdefault(r, count(1))),
                        run=self.run,
                        rank=r,
                        body=body,
                    )
                )
            )
            for r in ranks
        ]
        for start in range(0, len(messages), 500):
            write_batch(self.engine, messages[start : start + 500], now)

    def story(self) -> None:
        """Rank 1 falls silent first, rank 0 goes non-finite 10 s later, rank 3 leaves
        with an exception 10 s after that; the others train on. Two ranks dropped
        messages before the server had them."""
        start, world = time.time() - 1000, self.world
        every, alive = range(world), [r for r in range(world) if r not in (1, 3)]
        self.send(start, "hello", every, world_size=world, host="h", pid=1)
        for rank in every:
            beat = StepSummary(step=5, steps_per_s=10.0).to_dict()
            if rank in DROPPED:
                beat["dropped"] = DROPPED[rank]
            self.send(start + 10, "heartbeat", [rank], **beat)
        event = {
            "step": 6,
            "micro_step": 0,
            "phase": "forward",
            "module": "fc",
            "order": 0,
            "cause": "produced",
            "nan": 1,
            "time": start + 20,
        }
        self.send(start + 20, "event", [0], event=event, flight=None)
        self.send(start + 30, "bye", [3], step=6, reason="exception: RuntimeError")
        self.send(time.time(), "heartbeat", alive, **StepSummary(step=9).to_dict())


def listed(server: EmbeddedServer, run: str) -> dict:
    runs = httpx.get(f"{server.http_url}/api/runs").json()
    return next(r for r in runs if r["run"] == run)


def streamed(server: EmbeddedServer, run: str) -> dict:
    return next(stream_summaries(server.http_url, run, 30.0))


def test_a_run_of_more_than_256_ranks_streams_what_its_agents_dropped(server) -> None:
    Ranks(server, "wide", 300).story()
    summary = streamed(server, "wide")
    assert summary["world_size"] == 300 > server.app.state.nand.settings.big_run_ranks
    assert summary["messages_dropped"] == 1004
    assert summary["dropped"] == {"spool_full": 1001, "queue_full": 3}
    assert summary["state"] == "lost"  # rank 1 fell silent before rank 0 went non-finite
    assert summary == listed(server, "wide")


def every_rank_loaded(server: EmbeddedServer, run: str) -> dict:
    """The summary built from every rank row, as for a small run."""
    state = server.app.state.nand
    with Session(state.engine) as session:
        found = store.run_by_name(session, run)
        assert found is not None
        rows = store.ranks_of(session, [found.id])[found.id]
        return views.run_summary(found, rows, state.settings, time.time()).model_dump(mode="json")


def test_the_light_and_the_full_summary_of_a_run_are_the_same(start_server) -> None:
    server = start_server(big_run_ranks=2)  # every run of 3 ranks or more is a big one
    Ranks(server, "mixed", 6).story()
    light, full = streamed(server, "mixed"), every_rank_loaded(server, "mixed")
    assert light == full == listed(server, "mixed")
    assert light["state"] == "lost" and light["origin"]["rank"] == 0
    assert light["messages_dropped"] == 1000 and light["ranks_seen"] == 6
