"""The OpenAPI document tells the truth: schemathesis (its CLI, a real process)
sends generated and mutated requests to a real server, with a bounded budget
and a fixed seed, and every response must match the document: status codes,
bodies, headers, ``Allow`` on a wrong method, and never a 5xx."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import httpx
import pytest

from nand.events import FlightWindow
from nand.server import embedded
from nand.server.settings import Settings
from tests.server.agents import FakeAgent

TOKEN = "schema-token"
SEED = 20
#: Generated cases per operation, and a wall-clock bound for the whole run.
MAX_EXAMPLES = 15
TIME_LIMIT_S = 240
#: The fuzz: thousands of cases per operation (the 500 of a stop step past
#: 2**63 took a few thousand to find), seeded, so CI runs the same cases.
FUZZ_EXAMPLES = 1000
FUZZ_TIME_LIMIT_S = 1500


#: Runs a stop can still reach: the first stop of a run is recorded and every
#: later one answers the recorded step, so one run would let only the first
#: generated stop body reach the store (the 500 of a step past 2**63 hid so).
STOPPABLE_RUNS = 40


@pytest.fixture
def server(sqlite_url):
    # Ranks stay live (not lost) for the whole run, so a stop reaches them.
    settings = Settings(db_url=sqlite_url, token=TOKEN, lost_after_s=3600.0)
    with embedded.start(sqlite_url, settings=settings) as server:
        for i in range(STOPPABLE_RUNS):
            runner = FakeAgent(server.zmq_endpoint, run=f"stoppable-{i}", world_size=1)
            runner.hello(token=TOKEN)
            runner.heartbeat(3)
            runner.wait_acked()
            runner.close()
        agent = FakeAgent(server.zmq_endpoint, run="run-1", world_size=2)
        agent.hello(token=TOKEN)
        agent.heartbeat(3)
        # a flight window, so that GET /flight has one to answer with
        window = FlightWindow(steps=[2, 3], modules=["fc1"], act_max_abs=[[1.0], [None]])
        agent.event(flight=window, step=3, phase="forward", module="fc1", cause="produced", nan=1)
        agent.wait_acked()
        agent.close()
        yield server


def schemathesis(server, cwd: Path, examples: int, checks: str, limit_s: int) -> None:
    """Run schemathesis's CLI on the server's document; fail with its report."""
    st = shutil.which("st", path=str(Path(sys.executable).parent))
    if st is None:
        pytest.fail("schemathesis is not installed: pip install -e '.[dev]'")
    # The first request builds the document in the server's process, which a
    # loaded machine can stretch past schemathesis's 10 s: build it first.
    httpx.get(f"{server.http_url}/openapi.json", timeout=60).raise_for_status()
    command = [
        st,
        "run",
        f"{server.http_url}/openapi.json",
        f"--checks={checks}",
        f"--max-examples={examples}",
        f"--seed={SEED}",
        "--generation-database=none",
        "--request-timeout=10",
        f"--header=Authorization: Bearer {TOKEN}",
        # The event stream is endless by design (tests/server/test_ingest.py
        # covers it): every request to it would only wait for the timeout.
        "--exclude-path=/api/stream",
        "--no-color",
    ]
    done = subprocess.run(command, capture_output=True, text=True, timeout=limit_s, cwd=cwd)
    assert done.returncode == 0, done.stdout[-6000:] + done.stderr[-2000:]


@pytest.mark.slow
@pytest.mark.timeout(TIME_LIMIT_S + 60)
def test_every_response_matches_the_openapi_document(server, tmp_path: Path) -> None:
    schemathesis(server, tmp_path, MAX_EXAMPLES, "all", TIME_LIMIT_S)


@pytest.mark.slow
@pytest.mark.timeout(FUZZ_TIME_LIMIT_S + 60)
def test_a_thousand_generated_requests_per_operation_get_no_server_error(
    server, tmp_path: Path
) -> None:
    # Every check, not only "no 5xx": a body past a bound must be a 422 the
    # document declares, and what the document allows must be accepted.
    schemathesis(server, tmp_path, FUZZ_EXAMPLES, "all", FUZZ_TIME_LIMIT_S)


def test_the_document_declares_what_the_run_routes_answer(server) -> None:
    # (the first request builds the document in the server's process, which a
    # loaded machine can stretch past httpx's default 5 s)
    document = httpx.get(f"{server.http_url}/openapi.json", timeout=60).json()
    for path, operations in document["paths"].items():
        for method, operation in operations.items():
            if "{run}" in path:
                assert "404" in operation["responses"], (method, path)
    stop = document["paths"]["/api/runs/{run}/stop"]["post"]["responses"]
    assert {"400", "401", "403", "404", "409", "422"} <= set(stop)


def test_a_wrong_method_on_an_api_route_names_the_right_one(server) -> None:
    response = httpx.options(f"{server.http_url}/api/runs/run-1/stop")
    assert response.status_code == 405
    assert response.headers["allow"] == "POST"
    missing = httpx.get(f"{server.http_url}/api/no-such-thing")
    assert missing.status_code == 404
    assert missing.json() == {"detail": "Not Found"}
