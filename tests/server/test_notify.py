"""Notifications from a real server to a real HTTP receiver process
(``tests/server/webhook.py``): every state once, with the documented fields
and a valid signature; a receiver that is down and comes back."""

from __future__ import annotations

import re
import time
from collections import Counter
from collections.abc import Iterator

import httpx
import pytest

from nand.server import embedded
from nand.server.notify.notifier import NOTIFY_STATES, Notifier
from nand.server.settings import Settings
from tests.server.agents import FakeAgent
from tests.server.helpers import eventually
from tests.server.hooks import WebhookProcess, signed_correctly

SECRET = "hook-secret"
TOKEN = "tok"
NAMES = ["embed.weight", "head.weight"]


@pytest.fixture
def webhook(tmp_path) -> Iterator[WebhookProcess]:
    hook = WebhookProcess(tmp_path).start()
    yield hook
    hook.stop()


def notifying(start_server, url: str, **overrides):
    settings = {"notify_urls": (url,), "notify_secret": SECRET, "notify_poll_s": 0.2}
    return start_server(**{**settings, "token": TOKEN, **overrides})


def ranks(server, run: str, world: int = 1) -> list[FakeAgent]:
    agents = [
        FakeAgent(server.zmq_endpoint, run=run, rank=r, world_size=world) for r in range(world)
    ]
    for agent in agents:
        agent.hello(token=TOKEN)
        agent.heartbeat(5)
    return agents


def warning(kind: str) -> dict:
    return {
        "kind": kind,
        "step": 6,
        "module": "",
        "value": 9.0,
        "reference": 1.0,
        "message": f"{kind} at step 6",
        "time": 0.0,
    }


def states_of(hook: WebhookProcess) -> Counter[tuple[str, str]]:
    """How many POSTs each (run, state key) got."""
    return Counter(
        (p["run"], p["state"] + (":" + p["warning"]["kind"] if "warning" in p else ""))
        for p in hook.payloads()
    )


@pytest.fixture
def turns(monkeypatch: pytest.MonkeyPatch) -> Counter[str]:
    """The notifier turns (sweep, then deliveries) the servers of this test finished."""
    done: Counter[str] = Counter()
    turn = Notifier.turn

    def counted(self: Notifier, since: float, now: float) -> None:
        turn(self, since, now)
        done["turns"] += 1

    monkeypatch.setattr(Notifier, "turn", counted)
    return done


def more_turns(turns: Counter[str], n: int) -> None:
    """Wait until the notifiers took ``n`` more turns (each sees what was stored)."""
    start = turns["turns"]
    eventually(lambda: turns["turns"] >= start + n, timeout=30)


def received_all(hook: WebhookProcess, expected: set[tuple[str, str]]) -> bool:
    missing = expected - set(states_of(hook))
    assert not missing, f"not received: {sorted(missing)}; received: {states_of(hook)}"
    return True


def test_every_state_is_posted_once_with_the_documented_fields_and_a_valid_signature(
    start_server, webhook, turns
):
    server = notifying(start_server, webhook.url, lost_after_s=4.0, stalled_after_s=6.0)
    [diverged] = ranks(server, "n-diverged")
    diverged.event(
        step=7, phase="forward", module="fc2", module_type="Linear", cause="produced", nan=3
    )
    replica = ranks(server, "n-replica", world=3)
    for agent in replica:
        values = [1, 99] if agent.rank == 2 else [1, 2]
        agent.send("fingerprint", {"step": 10, "names": NAMES, "values": values})
    lost = ranks(server, "n-lost")
    lost[0].wait_acked()  # then silent
    [crashed] = ranks(server, "n-crashed")
    crashed.bye(5, "exception: RuntimeError")
    [warned] = ranks(server, "n-warned")
    for kind in ("loss_spike", "loss_spike", "grad_growth"):
        warned.send("warning", warning(kind))
    [stopped] = ranks(server, "n-stopped")
    stopped.wait_acked()
    answer = httpx.post(
        f"{server.http_url}/api/runs/n-stopped/stop",
        json={"reason": "on-call said so"},
        headers={"Authorization": f"Bearer {TOKEN}"},
    )
    assert answer.status_code == 200, answer.text
    stopped.bye(5, "exception: StopRequested")  # as a rank that stopped says
    for agent in (*replica, warned):  # done: no lost or stalled rank there
        agent.bye(5)
    [healthy] = ranks(server, "n-healthy")
    healthy.bye(5)
    [stalled] = ranks(server, "n-stalled")
    deadline = time.monotonic() + 15
    while ("n-stalled", "stalled") not in states_of(webhook):  # heartbeats, no progress
        assert time.monotonic() < deadline, states_of(webhook)
        stalled.heartbeat(5)
        time.sleep(0.3)
    stalled.bye(5)
    expected = {
        ("n-diverged", "diverged"),
        ("n-replica", "replica_mismatch"),
        ("n-lost", "lost"),
        ("n-crashed", "crashed"),
        ("n-stalled", "stalled"),
        ("n-warned", "warning:loss_spike"),
        ("n-warned", "warning:grad_growth"),
        ("n-stopped", "stopped"),
    }
    assert {state.partition(":")[0] for _, state in expected} == set(NOTIFY_STATES)
    eventually(lambda: received_all(webhook, expected), timeout=20)
    more_turns(turns, 3)  # several more sweeps: nothing is sent twice, nothing else is sent
    assert states_of(webhook) == Counter(dict.fromkeys(expected, 1))

    for request in webhook.requests():
        assert signed_correctly(request, SECRET)
        assert request["path"] == "/hooks/nand"
    by_state = {(p["run"], p["state"]): p for p in webhook.payloads()}
    first = by_state[("n-diverged", "diverged")]
    verdict = httpx.get(f"{server.http_url}/api/runs/n-diverged/verdict").json()
    assert first["origin"]["module"] == "fc2" and first["origin"]["rank"] == 0
    assert first["summary"] == verdict["summary"] and first["hint"] == verdict["hint"]
    assert first["url"] == f"{server.http_url}/#/runs/n-diverged"
    assert (first["attempt"], first["run_state"], first["id"]) == (
        1,
        "diverged",
        "n-diverged/1/diverged",
    )
    assert first["text"].startswith("nand: run n-diverged (attempt 1) diverged. ")
    assert first["text"].endswith(first["url"]) and verdict["summary"] in first["text"]
    assert "rank 2" in by_state[("n-replica", "replica_mismatch")]["summary"]
    assert by_state[("n-stopped", "stopped")]["stop"]["reason"] == "on-call said so"
    assert "on-call said so" in by_state[("n-stopped", "stopped")]["text"]
    spike = [p for p in webhook.payloads() if p.get("warning", {}).get("kind") == "loss_spike"]
    assert "loss_spike at step 6" in spike[0]["text"]
    metrics = httpx.get(f"{server.http_url}/metrics").text
    assert re.search(r"^nand_notifications_sent_total 8\.0$", metrics, re.M)
    assert re.search(r"^nand_notifications_pending 0\.0$", metrics, re.M)


def failures(server, reason: str) -> float:
    text = httpx.get(f"{server.http_url}/metrics").text
    found = re.search(rf'^nand_notifications_failed_total{{reason="{reason}"}} (\S+)$', text, re.M)
    return float(found.group(1)) if found else 0.0


def test_a_receiver_that_is_down_gets_the_notification_once_when_it_is_back(
    start_server, tmp_path, caplog, turns
):
    hook = WebhookProcess(tmp_path)  # not started: its port refuses connections
    server = notifying(start_server, hook.url)
    [agent] = ranks(server, "n-later")
    agent.event(step=3, phase="loss", nan=1)
    eventually(lambda: failures(server, "unreachable") >= 2, timeout=20)
    said = [r.getMessage() for r in caplog.records if r.name == "nand.server.notify.notifier"]
    assert len(said) == 1 and f"127.0.0.1:{hook.port}" in said[0], said  # once a minute
    assert "/hooks/nand" not in said[0]  # the URL's path may be a secret: not logged
    hook.start()
    try:
        eventually(lambda: len(hook.requests()) == 1, timeout=20)
        more_turns(turns, 3)  # nothing sent again
        assert [p["state"] for p in hook.payloads()] == ["diverged"]
        assert signed_correctly(hook.requests()[0], SECRET)
    finally:
        hook.stop()


def ack_latencies(agent: FakeAgent, seconds: float) -> list[float]:
    """Send heartbeats one at a time for ``seconds``; each one's send-to-ack time, sorted."""
    latencies: list[float] = []
    end = time.monotonic() + seconds
    while time.monotonic() < end:
        sent = time.perf_counter()
        seq = agent.heartbeat(6 + agent.seq)
        while seq not in agent.acked:
            assert time.perf_counter() - sent < 30, "never acked"
            agent.pump(0.002)
        latencies.append(time.perf_counter() - sent)
        time.sleep(0.02)
    return sorted(latencies)


@pytest.mark.timed
def test_a_slow_receiver_does_not_slow_ingest(start_server, tmp_path):
    hook = WebhookProcess(tmp_path, delay=3.0).start()  # each answer takes 3 s
    try:
        server = notifying(start_server, hook.url)
        [steady] = ranks(server, "n-steady")
        calm = ack_latencies(steady, 2.0)
        for n in range(8):  # 8 notifications: the receiver is busy for several seconds
            [agent] = ranks(server, f"n-slow-{n}")
            agent.event(step=2, phase="loss", nan=1)
            agent.wait_acked()
        began = time.time()
        busy = ack_latencies(steady, 5.0)
        ended = time.time()
        eventually(lambda: len(hook.requests()) == 8, timeout=60)
        median = {name: got[len(got) // 2] for name, got in (("calm", calm), ("busy", busy))}
        print(
            f"ack latency: median {median['calm'] * 1e3:.1f} ms calm, "
            f"{median['busy'] * 1e3:.1f} ms while the receiver sleeps "
            f"(max {busy[-1] * 1e3:.1f} ms over {len(busy)} heartbeats)"
        )
        # A notifier that held up ingest would show here as a wait of about 3 s.
        assert busy[-1] < 1.5 and median["busy"] < median["calm"] + 0.25
        answering = [r for r in hook.requests() if r["received"] < ended and r["answered"] > began]
        assert len(answering) >= 4, "the receiver was not answering while ingest was measured"
    finally:
        hook.stop()


@pytest.mark.postgres
def test_two_servers_on_one_postgresql_send_each_notification_once(postgres, webhook, turns):
    with postgres.database() as db_url:
        settings = Settings(
            db_url=db_url, notify_urls=(webhook.url,), notify_secret=SECRET, notify_poll_s=0.1
        )
        servers = [embedded.start(db_url, settings=settings) for _ in range(2)]
        try:
            for n in range(12):  # each run reports to one server; both sweep and deliver
                agent = FakeAgent(servers[n % 2].zmq_endpoint, run=f"n-shared-{n}")
                agent.hello()
                agent.event(step=1, phase="loss", nan=1)
                agent.wait_acked()
                agent.close()
            eventually(lambda: len(webhook.requests()) >= 12, timeout=30)
            more_turns(turns, 6)  # three more of each server: nothing sent twice
            assert sorted(p["run"] for p in webhook.payloads()) == sorted(
                f"n-shared-{n}" for n in range(12)
            )
        finally:
            for server in servers:
                server.stop()
