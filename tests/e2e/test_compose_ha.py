"""docker-compose.yml's ``ha`` profile run here for real (no Docker engine in CI):
two nand servers with the compose command on one PostgreSQL, Debian's HAProxy
with deploy/haproxy/haproxy.cfg in front of them (service names replaced by
loopback addresses, as test_compose does), real agents through it; one server
is killed with -9 and its agents go on through the balancer."""

from __future__ import annotations

import contextlib
import os
import re
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from nand.agent.identity import Identity
from nand.agent.transport.server_sink import ServerSink
from nand.events import Event, StepSummary
from nand.testing import free_port
from tests.e2e import monitoring
from tests.e2e.conftest import TOKEN
from tests.e2e.test_compose import BIN, compose_service, wait_healthy, with_ports
from tests.server.conftest import postgres  # noqa: F401  (the session's PostgreSQL fixture)
from tests.server.helpers import eventually

pytestmark = [pytest.mark.slow, pytest.mark.postgres]
HAPROXY = "/usr/sbin/haproxy"
RUN = "balanced"


def _haproxy() -> str:
    if not Path(HAPROXY).exists():
        pytest.fail(f"{HAPROXY} is missing: `apt-get install -y haproxy` (scripts/test does)")
    return HAPROXY


def _config_path() -> Path:
    return monitoring.mounts(compose_service("balancer"))["/usr/local/etc/haproxy/haproxy.cfg"]


def _config_for_here(ports: dict[str, dict[str, int]], listen: dict[str, int]) -> str:
    """haproxy.cfg with each service name:port at its loopback port here, and the
    balancer's own ports (``bind :5557`` / ``:8080``) at ``listen``."""
    text = _config_path().read_text()
    for name in sorted(ports, key=len, reverse=True):  # server-2 before server
        for port, here in ports[name].items():
            text = re.sub(rf"\b(?<!-){re.escape(name)}:{port}\b", f"127.0.0.1:{here}", text)
    text = re.sub(  # the health check port, per server line
        r"server (\S+) 127\.0\.0\.1:(\d+) check port 8080",
        lambda m: f"server {m[1]} 127.0.0.1:{m[2]} check port {ports[m[1]]['8080']}",
        text,
    )
    for port, here in listen.items():
        text = text.replace(f"bind :{port}", f"bind 127.0.0.1:{here}")
    return text


def test_the_ha_profile_is_a_second_server_like_the_first_behind_a_valid_haproxy() -> None:
    first, second = compose_service("server"), compose_service("server-2")
    assert second["profiles"] == ["ha"] and compose_service("balancer")["profiles"] == ["ha"]
    assert second["ports"] == [] and second["environment"]["NAND_ALLOWED_HOSTS"] == "server-2"
    same = ("build", "command", "healthcheck", "depends_on")
    assert {k: second[k] for k in same} == {k: first[k] for k in same}
    others = {k: v for k, v in second["environment"].items() if k != "NAND_ALLOWED_HOSTS"}
    assert others == {k: v for k, v in first["environment"].items() if k != "NAND_ALLOWED_HOSTS"}
    checked = subprocess.run([_haproxy(), "-c", "-f", str(_config_path())], capture_output=True)
    assert checked.returncode == 0, checked.stderr.decode() + checked.stdout.decode()


@contextlib.contextmanager
def _server(name: str, db_url: str, ports: dict[str, int]) -> Iterator[subprocess.Popen[bytes]]:
    """One compose server (its command, its plain environment) on ``db_url``."""
    service = compose_service(name)
    plain = {k: v for k, v in service["environment"].items() if "${" not in v}
    env = {**os.environ, **plain, "NAND_DB": db_url, "NAND_TOKEN": TOKEN}
    env["PATH"] = f"{BIN}{os.pathsep}{env['PATH']}"
    command = with_ports(service["command"], ports)
    proc = subprocess.Popen(command, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        health = with_ports(service["healthcheck"]["test"][1:], ports)
        wait_healthy([sys.executable if w == "python" else w for w in health], timeout=60)
        yield proc
    finally:
        if proc.poll() is None:
            proc.terminate()
            proc.wait(10)


@contextlib.contextmanager
def _balancer(config: str, tmp_path: Path) -> Iterator[None]:
    path = tmp_path / "haproxy.cfg"
    path.write_text(config)
    proc = subprocess.Popen(
        [_haproxy(), "-db", "-f", str(path)], stdout=subprocess.DEVNULL, stderr=subprocess.PIPE
    )
    try:
        yield
    finally:
        proc.terminate()
        proc.wait(10)


def _received(http_port: int) -> float:
    metrics = httpx.get(f"http://127.0.0.1:{http_port}/metrics").text
    found = re.search(r"^nand_messages_received_total (\S+)", metrics, re.M)
    return float(found[1]) if found else 0.0


def _stored_once(db_url: str, sent: dict[str, int]) -> None:
    from sqlalchemy import create_engine, select

    from nand.server.storage.models import Message

    engine = create_engine(db_url)
    with engine.connect() as conn:
        for agent, count in sent.items():
            seqs = sorted(conn.scalars(select(Message.seq).where(Message.agent == agent)))
            assert seqs == list(range(1, count + 1)), (agent, seqs)
    engine.dispose()


def _sink(zmq_port: int, rank: int) -> ServerSink:
    me = Identity(run=RUN, rank=rank, local_rank=rank, world_size=2, host="h", pid=os.getpid())
    spool = tempfile.mkdtemp(prefix="nand-ha-")
    endpoint = f"tcp://127.0.0.1:{zmq_port}"
    # No keepalive: one sent on its own while the other sink flushes (over 10 s on a
    # loaded host) would be counted as submitted before it was stored.
    return ServerSink(
        endpoint, me, token=TOKEN, spool_dir=spool, ack_timeout_s=1.0, keepalive_s=3600.0
    )


def test_through_the_ha_balancer_agents_of_a_killed_server_go_on_at_the_other(
    postgres,  # noqa: F811
    tmp_path,
) -> None:
    ports = {name: {"8080": free_port(), "5557": free_port()} for name in ("server", "server-2")}
    listen = {"8080": free_port(), "5557": free_port()}
    with (
        postgres.database() as db_url,
        _server("server", db_url, ports["server"]) as first,
        _server("server-2", db_url, ports["server-2"]),
        _balancer(_config_for_here(ports, listen), tmp_path),
    ):
        sinks = [_sink(listen["5557"], rank) for rank in (0, 1)]
        try:
            for sink in sinks:
                sink.hello({})
                sink.heartbeat(StepSummary(step=1))
            # leastconn: one agent on each server (each has received a message).
            eventually(lambda: all(_received(p["8080"]) > 0 for p in ports.values()), 30)
            first.kill()  # SIGKILL
            first.wait(10)
            for step in range(2, 6):
                for sink in sinks:
                    sink.heartbeat(StepSummary(step=step))
            where = {"run": RUN, "world_size": 2, "step": 5, "nan": 1}
            sinks[1].event(Event(rank=1, phase="forward", module="fc", **where), None)
            sinks[0].event(Event(rank=0, phase="grad", module="fc.weight", **where), None)
            for sink in sinks:
                assert sink.flush(60), sink.stats()
                assert sink.dropped() == {}
            base = f"http://127.0.0.1:{listen['8080']}"
            verdict = httpx.get(f"{base}/api/runs/{RUN}/verdict", timeout=10).json()
            assert verdict["origin"]["rank"] == 1 and verdict["ranks_received"] == [0], verdict
            _stored_once(db_url, {sink.agent: sink.stats()["submitted"] for sink in sinks})
            waited = subprocess.run(
                [sys.executable, "-m", "nand", "wait", RUN, "--until", "diverged", "--url", base],
                capture_output=True,
                text=True,
                timeout=60,
            )
            assert waited.returncode == 0, waited.stderr
        finally:
            for sink in sinks:
                sink.close(1.0)
