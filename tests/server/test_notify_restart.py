"""Notifications outlive the server: a real ``nand server`` process killed with
SIGKILL between a run's state change and the delivery, and a new one on the
same database that delivers it, once."""

from __future__ import annotations

import time

import pytest
from sqlalchemy import select
from sqlalchemy.orm import Session

from nand.server.storage.db import make_engine
from nand.server.storage.models import Notification
from nand.testing import free_port
from tests.server.agents import FakeAgent
from tests.server.helpers import eventually
from tests.server.hooks import WebhookProcess, signed_correctly
from tests.server.processes import ServerProcess

pytestmark = pytest.mark.slow

SECRET = "restart-secret"


def outbox(db_url: str) -> list[Notification]:
    engine = make_engine(db_url)
    try:
        with Session(engine) as session:
            return list(session.scalars(select(Notification)).all())
    finally:
        engine.dispose()


def diverge(server: ServerProcess, run: str) -> None:
    agent = FakeAgent(server.zmq_endpoint, run=run)
    agent.hello()
    agent.heartbeat(4)
    agent.event(step=4, phase="forward", module="fc1", cause="produced", nan=1)
    agent.wait_acked()
    agent.close()


def delivered_once(hook: WebhookProcess, run: str) -> None:
    eventually(lambda: len(hook.requests()) >= 1, timeout=30)
    time.sleep(2.5)  # a couple more turns of the notifier: nothing sent again
    assert [(p["run"], p["state"]) for p in hook.payloads()] == [(run, "diverged")]
    assert signed_correctly(hook.requests()[0], SECRET)


def test_a_notification_written_but_not_delivered_is_sent_by_the_next_server(db_url, tmp_path):
    hook = WebhookProcess(tmp_path)  # down while the first server tries
    env = {"NAND_NOTIFY_URL": hook.url, "NAND_NOTIFY_SECRET": SECRET}
    first = ServerProcess(db_url, free_port(), **env).start()
    try:
        diverge(first, "killed-before-delivery")
        eventually(lambda: [row.attempts for row in outbox(db_url)] >= [1], timeout=30)
    finally:
        first.kill9()
    assert [row.delivered_at for row in outbox(db_url)] == [None]
    hook.start()
    second = ServerProcess(db_url, free_port(), **env).start()
    try:
        delivered_once(hook, "killed-before-delivery")
        assert eventually(lambda: outbox(db_url)[0].delivered_at is not None)
    finally:
        second.stop()
        hook.stop()


def test_a_state_change_the_killed_server_never_wrote_down_is_found_after_the_restart(
    sqlite_url, tmp_path
):
    hook = WebhookProcess(tmp_path).start()
    first = ServerProcess(sqlite_url, free_port()).start()  # no notifier: nothing written
    try:
        diverge(first, "killed-before-the-sweep")
    finally:
        first.kill9()
    assert outbox(sqlite_url) == []
    env = {"NAND_NOTIFY_URL": hook.url, "NAND_NOTIFY_SECRET": SECRET}
    second = ServerProcess(sqlite_url, free_port(), **env).start()
    try:
        delivered_once(hook, "killed-before-the-sweep")
    finally:
        second.stop()
        hook.stop()
