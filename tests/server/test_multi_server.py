"""Several real ``nand server`` processes on one PostgreSQL: every answer is the
database's, whichever server a message reached (issue 34, part 1).

Each test starts two or three servers on a fresh database and sends what
agents send (real ZeroMQ DEALER sockets speaking the wire protocol) to
different servers *at the same moment* (a barrier releases the sends), many
times over, so that a decision taken by one server alone would show.
"""

from __future__ import annotations

import json
import threading
import time
from collections import Counter
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import httpx
import pytest
from sqlalchemy import create_engine, func, select

from nand.server.storage.models import EventRow
from nand.testing import free_port
from tests.server.agents import FakeAgent
from tests.server.helpers import eventually
from tests.server.hooks import WebhookProcess
from tests.server.processes import ServerProcess

pytestmark = [pytest.mark.postgres, pytest.mark.slow]

TOKEN = "tok"


@contextmanager
def servers(db_url: str, count: int, **env: str) -> Iterator[list[ServerProcess]]:
    """``count`` real server processes on ``db_url``; stopped afterwards."""
    started: list[ServerProcess] = []
    try:
        for _ in range(count):
            started.append(ServerProcess(db_url, free_port(), NAND_TOKEN=TOKEN, **env).start())
        yield started
    finally:
        for server in started:
            server.stop()


@pytest.fixture
def database(postgres) -> Iterator[str]:
    with postgres.database() as url:
        yield url


def at_once(sends: list[Callable[[], Any]]) -> None:
    """Run every send on its own thread, released together by a barrier."""
    barrier = threading.Barrier(len(sends))

    def go(send: Callable[[], Any]) -> None:
        barrier.wait()
        send()

    threads = [threading.Thread(target=go, args=(send,)) for send in sends]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()


def spread(fleet: list[ServerProcess], run: str, world: int, **hello: Any) -> list[FakeAgent]:
    """One agent per rank, rank r connected to server r mod len(fleet), introduced."""
    agents = [
        FakeAgent(fleet[r % len(fleet)].zmq_endpoint, run=run, rank=r, world_size=world)
        for r in range(world)
    ]
    at_once([lambda a=a: a.hello(token=TOKEN, **hello) for a in agents])
    for agent in agents:
        agent.wait_acked(timeout=30)
    return agents


def get(server: ServerProcess, path: str) -> Any:
    response = httpx.get(f"{server.http_url}{path}", timeout=30)
    response.raise_for_status()
    return response.json()


def rejected(server: ServerProcess, reason: str) -> float:
    for line in httpx.get(f"{server.http_url}/metrics").text.splitlines():
        if line.startswith(f'nand_messages_rejected_total{{reason="{reason}"}}'):
            return float(line.split()[-1])
    return 0.0


def event_body(step: int) -> dict[str, Any]:
    event = {
        "step": step,
        "micro_step": 0,
        "phase": "forward",
        "module": "fc1",
        "order": 0,
        "cause": "produced",
        "nan": 1,
    }
    return {"event": event, "flight": None}


def close(agents: list[FakeAgent]) -> None:
    for agent in agents:
        agent.close()


def test_first_events_reaching_three_servers_at_once_give_one_origin_and_one_attempt(database):
    """Rank 2 produces a NaN in the forward of step 5; ranks 0 and 1 receive it
    through the gradient all-reduce. Each rank's hello and first event go to a
    different server at the same moment, twenty times: every run has one
    attempt, rank 2 as its origin and 0, 1 as received, on every server."""
    with servers(database, 3) as fleet:
        for n in range(20):
            run = f"race-{n}"
            agents = [
                FakeAgent(fleet[r].zmq_endpoint, run=run, rank=r, world_size=3) for r in range(3)
            ]
            try:

                def first(agent: FakeAgent, launch: str = f"launch-{n}") -> None:
                    agent.hello(token=TOKEN, launch=launch)
                    if agent.rank == 2:
                        agent.event(step=5, phase="forward", module="fc2", cause="produced", nan=3)
                    else:
                        agent.event(step=5, phase="grad", module="fc2.weight", nan=64)

                at_once([lambda a=a: first(a) for a in agents])
                for agent in agents:
                    agent.wait_acked(timeout=30)
                verdicts = [get(server, f"/api/runs/{run}/verdict") for server in fleet]
                assert verdicts[0] == verdicts[1] == verdicts[2], run
                found = verdicts[0]
                assert found["origin"]["rank"] == 2, (run, found["origin"])
                assert found["ranks_received"] == [0, 1], run
                assert found["attempt"] == 1, run
                attempts = get(fleet[0], f"/api/runs/{run}")["attempts"]
                assert len(attempts) == 1, (run, attempts)
                ranks = get(fleet[n % 3], f"/api/runs/{run}/ranks")
                relations = {r["rank"]: r["relation"] for r in ranks["items"]}
                assert relations == {0: "received", 1: "received", 2: "origin"}, run
            finally:
                close(agents)


def test_a_relaunch_whose_ranks_reach_three_servers_at_once_starts_one_new_attempt(database):
    """A run id launched again (a re-applied Job: a new ``NAND_LAUNCH``) is a new
    attempt; its three ranks' hellos reach three servers at the same moment,
    ten times over: each time exactly one new attempt, holding all three ranks."""
    with servers(database, 3) as fleet:
        run = "relaunched"
        for n in range(10):
            agents = [
                FakeAgent(fleet[r].zmq_endpoint, run=run, rank=r, world_size=3) for r in range(3)
            ]
            try:
                launch = f"launch-{n}"
                at_once([lambda a=a, k=launch: a.hello(token=TOKEN, launch=k) for a in agents])
                for agent in agents:
                    agent.heartbeat(1)
                    agent.wait_acked(timeout=30)
                detail = get(fleet[n % 3], f"/api/runs/{run}")
                assert [a["attempt"] for a in detail["attempts"]] == list(range(1, n + 2)), n
                assert detail["attempts"][-1]["launch"] == f"launch-{n}"
                ranks = get(fleet[0], f"/api/runs/{run}/ranks")
                assert sorted(r["rank"] for r in ranks["items"]) == [0, 1, 2], n
            finally:
                close(agents)


def test_replicas_that_differ_are_found_when_their_fingerprints_reach_two_servers_at_once(
    database,
):
    """A fingerprint is compared with the other ranks' of its step when it is
    stored; two servers storing the two halves of a step at the same moment
    must still compare them (ten runs, each with a mismatch at step 10)."""
    names = ["embed.weight", "head.weight"]
    with servers(database, 2) as fleet:
        for n in range(10):
            run = f"fp-{n}"
            agents = spread(fleet, run, 2)
            try:
                at_once(
                    [
                        lambda a=a: a.send(
                            "fingerprint",
                            {"step": 10, "names": names, "values": [11, 22 + a.rank]},
                        )
                        for a in agents
                    ]
                )
                for agent in agents:
                    agent.wait_acked(timeout=30)
                replica = get(fleet[0], f"/api/runs/{run}/verdict")["replica"]
                assert replica is not None and replica["state"] == "mismatch", (run, replica)
                assert replica["ranks"] == [0, 1] and replica["first_bad_step"] == 10
            finally:
                close(agents)


def test_a_gradient_outlier_is_found_when_the_ranks_norms_reach_three_servers_at_once(database):
    """A step's local gradient norms are compared once every rank's are in;
    three servers each storing one rank's at the same moment must still compare
    them: rank 1's norm at step 7 is 100x the others' (ten runs)."""
    with servers(database, 3) as fleet:
        for n in range(10):
            run = f"gn-{n}"
            agents = spread(fleet, run, 3)
            try:
                at_once(
                    [
                        lambda a=a: a.heartbeat(
                            7, local_grad_norms=[[7, 200.0 if a.rank == 1 else 2.0]]
                        )
                        for a in agents
                    ]
                )
                for agent in agents:
                    agent.wait_acked(timeout=30)
                warnings = get(fleet[0], f"/api/runs/{run}/warnings")
                found = [(w["rank"], w["step"]) for w in warnings if w["kind"] == "grad_outlier"]
                assert found == [(1, 7)], run
            finally:
                close(agents)


def test_an_agent_id_held_through_one_server_is_refused_by_another_until_its_lease_ends(
    database,
):
    """The identity binding is a lease in the database: while server A holds an
    agent id (its agent is connected and speaking), server B refuses messages
    under that id, even with the right run, rank and token; once A is killed
    and the lease has run out, B takes the agent over, and the messages the
    agent resends (already stored through A) are stored once."""
    lease_s = 3.0
    with servers(database, 2, NAND_AGENT_LEASE_S=str(lease_s)) as (a, b):
        real = FakeAgent(a.zmq_endpoint, run="leased", rank=0)
        impostor = FakeAgent(b.zmq_endpoint, run="leased", rank=0, agent=real.agent)
        try:
            real.hello(token=TOKEN)
            for step in range(5):
                real.send("event", event_body(step))
            real.wait_acked()
            impostor.seq = 100
            # Keep A's lease alive by speaking through A while B is tried.
            deadline = time.monotonic() + 2 * lease_s
            while time.monotonic() < deadline:
                real.heartbeat(1)
                impostor.heartbeat(1)
                impostor.pump(0.3)
            assert impostor.acked == set(), "server B stored messages of an agent A holds"
            assert rejected(b, "agent_in_use") > 0

            a.kill9()
            killed = time.monotonic()
            taken_over = FakeAgent(b.zmq_endpoint, run="leased", rank=0, agent=real.agent)
            taken_over.seq = real.seq
            impostor.close()
            taken_over.send_until_acked("heartbeat", {"step": 2}, timeout=10 * lease_s)
            waited = time.monotonic() - killed
            assert waited < 4 * lease_s, f"B took {waited:.1f} s to take the agent over"
            for step in range(5):  # the five events again (seqs 2-6), as after a lost ack
                taken_over.send("event", event_body(step), seq=step + 2)
            taken_over.wait_acked(set(range(2, 7)), timeout=30)
            engine = create_engine(database)
            with engine.connect() as conn:
                assert conn.scalar(select(func.count()).select_from(EventRow)) == 5
            engine.dispose()
            taken_over.close()
        finally:
            real.close()
            impostor.close()


def test_a_server_that_stops_cleanly_hands_its_agents_over_at_once(database):
    """A server that shuts down (a rolling restart) releases its leases: its
    agents are accepted by another server at once, not a lease later."""
    with servers(database, 2, NAND_AGENT_LEASE_S="60") as (a, b):
        agent = FakeAgent(a.zmq_endpoint, run="handed-over", rank=0)
        agent.hello(token=TOKEN)
        agent.heartbeat(1)
        agent.wait_acked()
        agent.close()
        a.stop()
        moved = FakeAgent(b.zmq_endpoint, run="handed-over", rank=0, agent=agent.agent)
        moved.seq = agent.seq
        try:
            started = time.monotonic()
            moved.send_until_acked("heartbeat", {"step": 2}, timeout=30)
            assert time.monotonic() - started < 10
        finally:
            moved.close()


def test_a_stop_asked_on_one_server_reaches_agents_connected_to_the_others(database):
    with servers(database, 3) as fleet:
        agents = spread(fleet, "stopped", 6)
        try:
            for agent in agents:
                agent.heartbeat(40, steps_per_s=2.0)
            for agent in agents:
                agent.wait_acked()
            stop = httpx.post(
                f"{fleet[0].http_url}/api/runs/stopped/stop",
                headers={"Authorization": f"Bearer {TOKEN}"},
            ).json()
            started = time.monotonic()
            for agent in agents:
                assert agent.wait_for("stop", timeout=15)["step"] == stop["step"]
            assert time.monotonic() - started < 15
        finally:
            close(agents)


def test_three_servers_notify_each_state_change_once(database, tmp_path):
    """Every server sweeps for state changes and delivers; each diverged run
    is POSTed to the receiver exactly once, whichever server stored it."""
    hook = WebhookProcess(tmp_path).start()
    try:
        with servers(database, 3, NAND_NOTIFY_URL=hook.url) as fleet:
            runs = [f"hook-{n}" for n in range(9)]
            for n, run in enumerate(runs):
                agents = spread(fleet[n % 3 :] + fleet[: n % 3], run, 2)
                agents[0].event(step=3, phase="loss", nan=1)
                agents[0].wait_acked()
                close(agents)

            def diverged() -> Counter[str]:
                posted = [p for p in hook.payloads() if p["state"] == "diverged"]
                assert len(posted) >= len(runs), posted
                return Counter(p["run"] for p in posted)

            eventually(diverged, timeout=60)
            time.sleep(12.0)  # two more sweeps of every server
            assert diverged() == Counter(dict.fromkeys(runs, 1))
    finally:
        hook.stop()


def test_a_dashboard_stream_on_one_server_shows_events_stored_through_another(database):
    """``GET /api/stream`` polls the database, not its own server's ingest: a
    stream opened on server A follows a run whose agents all report to B and C."""
    with servers(database, 3) as (a, b, c):
        seen: list[dict[str, Any]] = []
        diverged = threading.Event()

        def listen() -> None:
            url = f"{a.http_url}/api/stream?run=streamed"
            with httpx.stream("GET", url, timeout=30) as response:
                for line in response.iter_lines():
                    if line.startswith("data: "):
                        seen.append(json.loads(line[6:]))
                        if seen[-1]["state"] == "diverged":
                            diverged.set()
                            return

        threading.Thread(target=listen, daemon=True).start()
        agents = spread([b, c], "streamed", 2)
        try:
            for agent in agents:
                agent.heartbeat(3)
            eventually(lambda: any(s["run"] == "streamed" for s in seen), timeout=15)
            agents[1].event(step=4, phase="forward", module="fc1", nan=2)
            agents[1].wait_acked()
            assert diverged.wait(15), seen
            assert seen[-1]["origin"]["rank"] == 1
        finally:
            close(agents)
