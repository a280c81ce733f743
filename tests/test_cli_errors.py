"""Every command-line failure is one line on stderr with the fix and its own exit
code, through real ``python -m nand`` processes; the traceback only with ``-v``."""

from __future__ import annotations

import argparse
import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from nand import exitcodes
from nand.testing import free_port
from tests.server.processes import ServerProcess


def nand(*args: str, timeout: float = 60, env: dict[str, str] | None = None):
    return subprocess.run(
        [sys.executable, "-m", "nand", *args],
        capture_output=True,
        text=True,
        timeout=timeout,
        env={**os.environ, **(env or {})},
    )


def assert_one_line(done: subprocess.CompletedProcess[str], code: int, *words: str) -> None:
    err = done.stderr.strip()
    assert done.returncode == code, (done.returncode, done.stderr)
    assert "Traceback" not in err and len(err.splitlines()) == 1, err
    assert err.startswith("nand: ")
    for word in words:
        assert word in err, err


SERVER_ARGS = ["server", "--http", "127.0.0.1:0", "--zmq", "tcp://127.0.0.1:*"]


@pytest.mark.parametrize(
    ("flags", "code", "words"),
    [
        (["--http", "0.0.0.0:99999"], exitcodes.BAD_ADDRESS, ["99999", "--http 0.0.0.0:8080"]),
        (["--zmq", "5557"], exitcodes.BAD_ADDRESS, ["tcp://127.0.0.1:5557"]),
        (
            ["--db", "postgres://me:pw@db/nand"],
            exitcodes.BAD_DATABASE_URL,
            ["postgresql+psycopg://"],
        ),
        (["--db", "mysql://me@db/nand"], exitcodes.BAD_DATABASE_URL, ["SQLite or PostgreSQL"]),
        (["--db", "::not a url::"], exitcodes.BAD_DATABASE_URL, ["not a database URL"]),
        (["--db", "sqlite:///"], exitcodes.BAD_DATABASE_URL, ["in-memory", "sqlite:///nand.db"]),
        (["--db", "sqlite:////proc/no/such/dir/n.db"], exitcodes.DATABASE_ERROR, ["writable"]),
    ],
)
def test_server_refuses_bad_settings_in_one_line(flags, code, words, tmp_path) -> None:
    args = [*SERVER_ARGS, "--db", f"sqlite:///{tmp_path / 'n.db'}", *flags]
    assert_one_line(nand(*args), code, *words)


def test_verbose_adds_the_traceback() -> None:
    done = nand("-v", *SERVER_ARGS, "--db", "sqlite:///")
    assert done.returncode == exitcodes.BAD_DATABASE_URL
    assert "Traceback" in done.stderr and "nand: --db sqlite:/// is an in-memory" in done.stderr


def test_postgres_without_the_extra_names_the_extra(tmp_path) -> None:
    # A real interpreter in which psycopg cannot be imported, as without nand[postgres].
    (tmp_path / "sitecustomize.py").write_text("import sys\nsys.modules['psycopg'] = None\n")
    path = os.pathsep.join([str(tmp_path), os.environ.get("PYTHONPATH", "")])
    done = nand(*SERVER_ARGS, "--db", "postgresql+psycopg://u@db/n", env={"PYTHONPATH": path})
    assert_one_line(done, exitcodes.MISSING_EXTRA, "pip install 'nand-torch[postgres]'")


def test_ports_in_use_are_said_for_http_and_zeromq(tmp_path) -> None:
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        db = f"sqlite:///{tmp_path / 'n.db'}"
        http = nand(
            "server", "--db", db, "--http", f"127.0.0.1:{port}", "--zmq", "tcp://127.0.0.1:*"
        )
        assert_one_line(http, exitcodes.ADDRESS_IN_USE, "HTTP", "already in use", "--http")
        zmq = nand(
            "server", "--db", db, "--http", "127.0.0.1:0", "--zmq", f"tcp://127.0.0.1:{port}"
        )
        assert_one_line(zmq, exitcodes.ADDRESS_IN_USE, "ZeroMQ", "already in use", "--zmq")


def test_a_zeromq_port_taken_after_the_probe_is_said_in_one_line(tmp_path) -> None:
    # Two servers started at once on one port: both probes pass, one bind fails.
    # The probe is made to pass here; the bind in the ingest thread must say why.
    (tmp_path / "sitecustomize.py").write_text(
        "import nand.server.preflight as preflight\n"
        "preflight.probe_zmq_bind = lambda endpoint: None\n"
    )
    path = os.pathsep.join([str(tmp_path), os.environ.get("PYTHONPATH", "")])
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        db = f"sqlite:///{tmp_path / 'n.db'}"
        zmq_args = ["--http", "127.0.0.1:0", "--zmq", f"tcp://127.0.0.1:{port}"]
        done = nand("server", "--db", db, *zmq_args, env={"PYTHONPATH": path})
    assert_one_line(done, exitcodes.ADDRESS_IN_USE, "ZeroMQ", "already in use", "--zmq")


def test_prune_refuses_a_bad_database_in_one_line() -> None:
    done = nand("prune", "--older-than", "30d", "--db", "postgres://db/nand")
    assert_one_line(done, exitcodes.BAD_DATABASE_URL, "postgresql+psycopg://")


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    db = tmp_path_factory.mktemp("cli") / "s.db"
    process = ServerProcess(f"sqlite:///{db}", free_port(), module="nand").start()
    yield process
    process.stop()


def test_unreachable_server_is_said_in_words() -> None:
    done = nand("verdict", "r", "--url", f"http://127.0.0.1:{free_port()}")
    assert_one_line(done, exitcodes.UNREACHABLE, "Connection refused", "NAND_URL")
    assert "urlopen error" not in done.stderr


def test_url_with_api_suffix_is_explained(server) -> None:
    done = nand("runs", "--url", f"{server.http_url}/api")
    assert_one_line(done, exitcodes.USAGE, "ends in /api", f"--url {server.http_url}")
    elsewhere = nand("runs", "--url", f"{server.http_url}/nand")
    assert_one_line(elsewhere, exitcodes.USAGE, "no nand API")


def test_unknown_run_exits_not_found(server) -> None:
    done = nand("verdict", "no-such-run", "--url", server.http_url)
    assert_one_line(done, exitcodes.NOT_FOUND, "unknown run 'no-such-run'")


def test_wait_for_an_unknown_run_says_so_and_times_out(server) -> None:
    done = nand("wait", "ghost", "--url", server.http_url, "--timeout", "2")
    assert done.returncode == exitcodes.TIMEOUT, done.stderr
    lines = done.stderr.strip().splitlines()
    assert "'ghost' has not reported" in lines[0] and "timed out" in lines[-1], lines


def test_help_is_plain_text_with_help_for_every_option() -> None:
    from nand.cli import build_parser

    for name, command in _commands(build_parser()):
        for action in command._actions:
            if isinstance(action, argparse._SubParsersAction):
                continue  # its commands are listed with their own help
            assert action.help, f"nand {name}: {action.option_strings or action.dest} has no help"
    for name in ("wait", "server", "stop"):
        text = nand(name, "--help").stdout
        assert "``" not in text and "====" not in text, text


def _commands(parser, prefix: str = ""):
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for name, sub in action.choices.items():
                yield f"{prefix}{name}", sub
                yield from _commands(sub, f"{prefix}{name} ")


def commands_taking_a_run() -> list[str]:
    from nand.cli import build_parser

    return [
        name
        for name, command in _commands(build_parser())
        if any(action.dest == "run" for action in command._actions)
    ]


def test_verbs_that_take_a_run_id_are_verdict_stop_wait_and_watchdog() -> None:
    # (the test below covers each; a new verb taking a run joins it here)
    assert sorted(commands_taking_a_run()) == ["stop", "verdict", "wait", "watchdog"]


@pytest.mark.parametrize("command", commands_taking_a_run())
@pytest.mark.parametrize(
    ("run", "words"),
    [
        ("lightning_logs/0", ["contains '/'", "reported as 'lightning_logs-0'"]),
        ("..", ["is a path step"]),
        ("x" * 300, ["has 300 characters, more than 256"]),
    ],
)
def test_a_run_id_no_run_can_have_is_said_in_one_line_before_any_request(
    server, command, run, words
) -> None:
    extra = ["--timeout", "5"] if command == "wait" else []  # (only wait has --timeout)
    given = [run]
    if command == "watchdog":  # (the run is an option there; a command follows)
        given, extra = ["--run", run], ["--", "true"]
    done = nand(command, *given, "--url", server.http_url, *extra)
    assert_one_line(done, exitcodes.USAGE, "no run can have the id", *words)
    assert "no nand API" not in done.stderr
    # A request would have met no server here: the id was refused before any.
    nowhere = nand(command, *given, "--url", f"http://127.0.0.1:{free_port()}", *extra)
    assert_one_line(nowhere, exitcodes.USAGE, "no run can have the id")


def test_server_logs_agents_and_refusals_and_warns_when_open(tmp_path) -> None:
    from tests.server.agents import FakeAgent

    zmq_port = free_port()
    args = [sys.executable, "-m", "nand", "server", "--db", f"sqlite:///{tmp_path / 'n.db'}"]
    args += ["--http", "0.0.0.0:0", "--zmq", f"tcp://0.0.0.0:{zmq_port}"]
    proc = subprocess.Popen(args, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        assert proc.stdout is not None and "http=" in proc.stdout.readline()
        agent = FakeAgent(f"tcp://127.0.0.1:{zmq_port}", run="logged", rank=1, world_size=2)
        agent.hello()
        agent.bye(7, "closed")
        agent.wait_acked()
        agent.close()
    finally:
        proc.terminate()
        _, err = proc.communicate(timeout=20)
    assert "without NAND_TOKEN" in err and "0.0.0.0" in err, err
    assert "run logged: rank 1 of 2 joined from" in err, err
    assert "run logged: rank 1 left at step 7 (closed)" in err, err


def test_server_logs_an_agent_refused_for_its_token(tmp_path) -> None:
    from tests.server.agents import FakeAgent

    server = ServerProcess(f"sqlite:///{tmp_path / 'n.db'}", free_port(), module="nand")
    server.env["NAND_TOKEN"] = "right"
    log = Path(tmp_path / "server.log")
    with log.open("w") as sink:
        server.start(stderr=sink)
        try:
            agent = FakeAgent(server.zmq_endpoint, run="intruder", rank=3)
            agent.hello(token="wrong")
            agent.wait_for("reject")
            agent.close()
        finally:
            server.stop()
    text = log.read_text()
    assert "refused agent" in text and "run intruder, rank 3" in text, text
