"""The command line against a real embedded server: runs, verdict, stop, wait."""

from __future__ import annotations

import json
import subprocess
import sys
import threading
from collections.abc import Iterator

import pytest

from nand import exitcodes
from nand.cli import wait
from nand.server import embedded
from nand.server.__main__ import main
from nand.server.embedded import EmbeddedServer
from nand.server.settings import Settings
from tests.server.agents import FakeAgent


@pytest.fixture
def srv(tmp_path) -> Iterator[EmbeddedServer]:
    url = f"sqlite:///{tmp_path / 'cli.db'}"
    server = embedded.start(url, settings=Settings(db_url=url, token="tok", lost_after_s=1.0))
    yield server
    server.stop()


def _agent(server: EmbeddedServer, run: str, rank: int = 0) -> FakeAgent:
    agent = FakeAgent(server.zmq_endpoint, run=run, rank=rank, world_size=2)
    agent.hello(token="tok")
    agent.heartbeat(10, steps_per_s=1.0)
    agent.wait_acked()
    return agent


def test_runs_and_verdict(srv, capsys) -> None:
    a = _agent(srv, "cli-run")
    a.event(step=11, phase="forward", module="fc1", module_type="Linear", nan=1)
    a.wait_acked()
    assert main(["runs", "--url", srv.http_url]) == 0
    out = capsys.readouterr().out
    assert "cli-run" in out and "diverged" in out and "rank 0 forward fc1 step 11" in out
    assert main(["verdict", "cli-run", "--url", srv.http_url]) == 0
    assert (
        "rank 0 produced NaN in fc1 (Linear) during forward at step 11" in capsys.readouterr().out
    )
    assert main(["verdict", "cli-run", "--url", srv.http_url, "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["origin"]["module"] == "fc1"
    assert main(["verdict", "nope", "--url", srv.http_url]) == exitcodes.NOT_FOUND
    assert "unknown run" in capsys.readouterr().err
    a.close()


def test_verdict_says_which_ranks_dropped_messages(srv, capsys) -> None:
    a = _agent(srv, "cli-gaps", rank=1)
    a.heartbeat(11, dropped={"spool_full": 1000, "rejected": 204})
    a.wait_acked()
    assert main(["verdict", "cli-gaps", "--url", srv.http_url]) == 0
    out = capsys.readouterr().out.splitlines()
    assert out[-1] == (
        "Rank 1 dropped 1,204 messages before the server had them "
        "(spool_full 1,000, rejected 204): its record here has gaps."
    )
    a.close()


def test_stop_with_and_without_token(srv, capsys) -> None:
    a = _agent(srv, "cli-stop")
    assert main(["stop", "cli-stop", "--url", srv.http_url]) == exitcodes.ERROR
    assert "valid token" in capsys.readouterr().err
    assert main(["stop", "cli-stop", "--url", srv.http_url, "--token", "tok"]) == 0
    said = "every rank stops at step 20 or the next step boundary after it (ranks 0)"
    assert said in capsys.readouterr().out
    assert a.wait_for("stop")["step"] == 20  # 10 + 2 heartbeats (5 s) x 1 step/s
    a.close()


def _wait_in_thread(args: list[str]) -> tuple[threading.Thread, list[int]]:
    codes: list[int] = []
    thread = threading.Thread(target=lambda: codes.append(main(args)), daemon=True)
    thread.start()
    return thread, codes


def test_wait_until_diverged_returns_0_when_it_diverges(srv) -> None:
    thread, codes = _wait_in_thread(
        ["wait", "later", "--until", "diverged", "--interval", "0.1", "--url", srv.http_url]
    )
    # The run did not exist when the wait began. The NaN goes with the hello,
    # unacked in between: a loaded machine that stored them a second apart
    # would show the run lost (silent for lost_after_s) before it diverged.
    a = FakeAgent(srv.zmq_endpoint, run="later", rank=0, world_size=2)
    a.hello(token="tok")
    a.event(step=12, phase="loss", nan=1)
    a.wait_acked()
    thread.join(10)
    assert codes == [exitcodes.OK]
    a.close()


def test_wait_exit_codes_for_other_outcomes(srv) -> None:
    url = ["--url", srv.http_url, "--interval", "0.1"]
    bad = _agent(srv, "bad")
    bad.event(step=12, phase="forward", module="x", nan=1)
    bad.wait_acked()
    assert main(["wait", "bad", "--until", "finished", *url]) == exitcodes.DIVERGED
    assert main(["wait", "bad", "--until", "any", *url]) == exitcodes.DIVERGED
    done = _agent(srv, "done")
    done.bye(10)
    done.wait_acked()
    assert main(["wait", "done", "--until", "diverged", *url]) == exitcodes.FINISHED
    assert main(["wait", "done", "--until", "finished", *url]) == exitcodes.OK
    quiet = _agent(srv, "quiet")  # lost after 1 s of silence
    assert main(["wait", "quiet", "--until", "finished", *url]) == exitcodes.LOST
    assert main(["wait", "ghost", "--timeout", "0.5", *url]) == exitcodes.TIMEOUT
    for agent in (bad, done, quiet):
        agent.close()


def test_wait_gives_up_on_an_unreachable_server() -> None:
    args = ["wait", "r", "--url", "http://127.0.0.1:1", "--retry-for", "0.3", "--interval", "0.1"]
    assert main(args) == exitcodes.UNREACHABLE


def test_wait_given_several_servers_goes_on_at_one_that_answers_without_a_word(srv, capsys) -> None:
    bad = _agent(srv, "listed")
    bad.event(step=12, phase="forward", module="x", nan=1)
    bad.wait_acked()
    down = "http://127.0.0.1:1"  # first in the list: a server that is gone
    args = ["wait", "listed", "--until", "any", "--interval", "0.1", "--retry-for", "5"]
    assert main([*args, "--url", f"{down},{srv.http_url}"]) == exitcodes.DIVERGED
    assert "lost the server" not in capsys.readouterr().err
    bad.close()


def test_wait_given_several_servers_gives_up_only_when_none_answers(capsys) -> None:
    urls = "http://127.0.0.1:1 http://127.0.0.1:2"
    args = ["wait", "r", "--url", urls, "--retry-for", "0.3", "--interval", "0.1"]
    assert main(args) == exitcodes.UNREACHABLE
    err = capsys.readouterr().err
    assert "lost the server at http://127.0.0.1:1, http://127.0.0.1:2" in err
    assert main(["wait", "r", "--url", "http://127.0.0.1:1,127.0.0.1:2"]) == exitcodes.USAGE
    assert "'127.0.0.1:2' is not an http(s) URL" in capsys.readouterr().err


def test_wait_exit_code_table() -> None:
    assert wait.wait_exit_code("diverged", "diverged") == 0
    assert wait.wait_exit_code("finished", "diverged") == 3
    assert wait.wait_exit_code("any", "finished") == 0
    assert wait.wait_exit_code("any", "stalled") == 5
    assert wait.wait_exit_code("diverged", "healthy") is None


def test_wait_as_a_real_process_for_job_scripts(srv) -> None:
    a = _agent(srv, "proc")
    a.event(step=11, phase="backward", module="fc2", nan=1)
    a.wait_acked()
    done = subprocess.run(
        [
            sys.executable,
            "-m",
            "nand.server",
            "wait",
            "proc",
            "--until",
            "diverged",
            "--url",
            srv.http_url,
            "--timeout",
            "20",
        ],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "proc: diverged"
    a.close()


def test_nand_server_command_serves_rest_and_ingest(tmp_path) -> None:
    from nand.testing import free_port
    from tests.server.processes import ServerProcess

    server = ServerProcess(f"sqlite:///{tmp_path / 's.db'}", free_port(), module="nand").start()
    try:
        agent = FakeAgent(server.zmq_endpoint, run="via-cli")
        agent.heartbeat(1)
        agent.wait_acked()
        assert main(["verdict", "via-cli", "--url", server.http_url]) == 0
        agent.close()
    finally:
        server.stop()
    assert server.proc is not None and server.proc.returncode == 0  # SIGTERM: clean exit


def test_runs_verdict_and_stop_given_several_servers_ask_the_next_when_one_is_down(
    srv, capsys
) -> None:
    a = _agent(srv, "listed-rest")
    a.event(step=11, phase="forward", module="fc1", module_type="Linear", nan=1)
    a.wait_acked()
    urls = f"http://127.0.0.1:1,{srv.http_url}"  # the first is gone
    assert main(["runs", "--url", urls]) == 0
    assert "listed-rest" in capsys.readouterr().out
    assert main(["verdict", "listed-rest", "--url", urls]) == 0
    assert "rank 0 produced NaN in fc1" in capsys.readouterr().out
    assert main(["stop", "listed-rest", "--url", urls, "--token", "tok"]) == 0
    assert "every rank stops" in capsys.readouterr().out
    assert main(["runs", "--url", "http://127.0.0.1:1 http://127.0.0.1:2"]) == (
        exitcodes.UNREACHABLE
    )
    assert "http://127.0.0.1:1, http://127.0.0.1:2" in capsys.readouterr().err
    a.close()
