"""The agent's settings: resolved once, from arguments, then NAND_*, then defaults."""

from __future__ import annotations

import ast
import dataclasses
import os
import pathlib

import pytest
import torch

import nand
from nand.agent.output.session import Session
from nand.config import AgentConfig
from nand.errors import ConfigError
from tests.agent.models import mlp, train
from tests.agent.test_optimizer_state import counting_norms

NAND = pathlib.Path(nand.__file__).parent


def test_defaults_without_environment_or_arguments(monkeypatch):
    for name in [n for n in os.environ if n.startswith("NAND_")]:
        monkeypatch.delenv(name)
    assert AgentConfig.resolve() == AgentConfig()


def test_arguments_win_over_the_environment_and_the_environment_over_defaults(monkeypatch):
    monkeypatch.setenv("NAND_ON_NONFINITE", "skip")
    monkeypatch.setenv("NAND_FLIGHT_STEPS", "8")
    monkeypatch.setenv("NAND_READ_PARAMS_EVERY_STEP", "1")
    monkeypatch.setenv("NAND_MODE", "full")
    resolved = AgentConfig.resolve(on_nonfinite="raise")
    assert resolved.mode == "full" and AgentConfig.resolve(mode="light").mode == "light"
    assert resolved.on_nonfinite == "raise"  # the argument
    assert resolved.flight_steps == 8 and resolved.read_params_every_step  # the environment
    assert resolved.max_events == AgentConfig.max_events  # the default


@pytest.mark.parametrize(
    ("variable", "value", "named"),
    [
        ("NAND_FLIGHT_STEPS", "many", "NAND_FLIGHT_STEPS='many' is not an integer"),
        ("NAND_DISABLE", "perhaps", "NAND_DISABLE='perhaps' is not a boolean"),
        ("NAND_ON_NONFINITE", "explode", "on_nonfinite='explode'"),
        ("NAND_MODE", "lite", "mode='lite': use one of full, light"),
        ("NAND_MAX_EVENTS", "0", "max_events must be at least 1"),
        ("NAND_FULL_STEPS", "-1", "replays and full_steps must not be negative"),
        ("NAND_RUN", "team/exp3", "contains '/'; use another character, e.g. 'team-exp3'"),
        ("NAND_RUN", "..", "is a path step"),
    ],
)
def test_a_bad_value_is_refused_naming_it(monkeypatch, variable, value, named):
    monkeypatch.setenv(variable, value)
    with pytest.raises(ConfigError, match=named):
        AgentConfig.resolve()


def test_disabled_sends_nothing_anywhere(monkeypatch, tmp_path):
    monkeypatch.setenv("NAND_DISABLE", "1")
    resolved = AgentConfig.resolve(server="tcp://127.0.0.1:1", events_file=str(tmp_path / "e"))
    assert (resolved.server, resolved.events_file, resolved.log_events) == (None, None, False)


def test_an_unknown_setting_is_refused():
    with pytest.raises(ConfigError, match="unknown agent setting"):
        AgentConfig.resolve(flight_step=3)


def test_read_params_every_step_turns_the_implied_finite_shortcuts_off():
    def tensors_normed(**options):
        model = mlp()  # 6 parameters
        opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
        with counting_norms() as counts, nand.watch(model, opt, log_events=False, **options):
            train(model, opt, 4)
        return counts

    # One launch a step, and the last look at close (the parameters).
    assert tensors_normed() == [6, 12, 6, 6, 6]  # the params once, then implied; no state
    # Every step after the first: gradients, parameters and both Adam moments.
    assert tensors_normed(read_params_every_step=True) == [6, 24, 24, 24, 18]


def test_only_the_settings_modules_read_the_environment():
    readers = set()
    for path in NAND.rglob("*.py"):
        tree = ast.parse(path.read_text())
        for node in ast.walk(tree):
            if isinstance(node, ast.Attribute) and node.attr in (
                "get_str",
                "get_int",
                "get_float",
                "get_bool",
            ):
                readers.add(str(path.relative_to(NAND)))
    # The agent's are AgentConfig's (nand/config.py); the server's its Settings;
    # the CLI's REST client reads the URL and token it is pointed at.
    assert readers == {"server/settings.py", "cli/rest_client.py"}, readers


def test_the_transport_runs_with_the_settings_watch_resolved(monkeypatch, tmp_path):
    monkeypatch.setenv("NAND_QUEUE_MAX", "77")
    monkeypatch.setenv("NAND_TOKEN", "from-the-environment")
    resolved = AgentConfig.resolve(server="tcp://127.0.0.1:1")
    monkeypatch.setenv("NAND_QUEUE_MAX", "5")  # read once: a later change is not seen
    settings = dataclasses.replace(
        resolved,
        transport=resolved.transport.but(spool_dir=tmp_path, close_timeout_s=0.0),
    )
    session = Session.open(settings)
    try:
        (remote,) = [s for s in session.sinks if type(s).__name__ == "ServerSink"]
        assert remote.settings.queue_max == 77 and remote.token == "from-the-environment"
    finally:
        session.close(0, "closed")
