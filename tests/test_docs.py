"""The docs site builds strictly, its generated references hold everything the code
has, the defaults its text states are the code's, and its runnable examples run.

    python -m pytest -q tests/test_docs.py
"""

from __future__ import annotations

import argparse
import doctest
import importlib.util
import os
import re
import subprocess
import sys
import types
from pathlib import Path
from typing import Any

import pytest

import nand.config
from nand import exitcodes, wire

ROOT = Path(__file__).resolve().parents[1]
DOCS = ROOT / "docs"
#: Marks the fenced ``python`` block right after it as one the tests run.
RUNNABLE = "<!-- docs-test: run -->"


def load_hooks() -> types.ModuleType:
    spec = importlib.util.spec_from_file_location("docs_hooks", DOCS / "hooks.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def clean_env() -> dict[str, str]:
    """The environment without NAND_* settings, with this tree's nand first."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("NAND_")}
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT), env.get("PYTHONPATH", "")]).rstrip(os.pathsep)
    env["NO_MKDOCS_2_WARNING"] = "1"
    return env


@pytest.fixture(scope="module")
def site(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("site")
    build = subprocess.run(
        [sys.executable, "-m", "mkdocs", "build", "--strict", "--site-dir", str(out)],
        cwd=ROOT,
        env=clean_env(),
        capture_output=True,
        text=True,
        timeout=240,
    )
    assert build.returncode == 0, f"mkdocs build --strict failed:\n{build.stderr[-4000:]}"
    return out


def page(site: Path, name: str) -> str:
    return (site / name / "index.html").read_text()


def test_the_docs_site_builds_strictly_with_every_page_of_its_nav(site: Path) -> None:
    for name in ("concepts/step-boundary", "reference/rest", "performance/benchmarks"):
        assert (site / name / "index.html").is_file(), name


def test_every_environment_variable_of_config_is_on_its_page(site: Path) -> None:
    names = [n for n in vars(nand.config) if n.startswith("NAND_")]
    assert len(names) > 30
    text = page(site, "reference/environment")
    assert [n for n in names if f"<code>{n}</code>" not in text] == []


def test_every_command_of_the_cli_parser_is_on_its_page(site: Path) -> None:
    from nand.cli import build_parser

    def commands(parser: argparse.ArgumentParser, words: str) -> list[str]:
        found = []
        for action in parser._actions:
            if isinstance(action, argparse._SubParsersAction):
                for name, sub in action.choices.items():
                    found += [f"{words} {name}", *commands(sub, f"{words} {name}")]
        return found

    names = commands(build_parser(), "nand")
    assert {"nand server", "nand wait", "nand spool replay"} <= set(names)
    text = page(site, "reference/cli")
    assert [n for n in names if f'id="{n.replace(" ", "-")}"' not in text] == []


def server_operations() -> list[str]:
    from fastapi.routing import APIRoute

    from nand.server.http.api import ROUTERS

    return [
        f"{method} {route.path}"
        for router in ROUTERS
        for route in router.routes
        if isinstance(route, APIRoute) and route.include_in_schema
        for method in route.methods
    ]


def test_every_route_of_the_server_is_on_the_rest_page(site: Path) -> None:
    operations = server_operations()
    assert "POST /api/runs/{run}/stop" in operations
    text = page(site, "reference/rest")
    assert [op for op in operations if f"<code>{op}</code>" not in text] == []


def test_the_rest_guide_names_only_calls_the_server_has() -> None:
    text = (DOCS / "rest-guide.md").read_text()
    named = re.findall(r"`((?:GET|POST|PUT|DELETE) /[^`?\s]*)", text)
    assert len(named) >= 10
    assert sorted(set(named) - set(server_operations())) == []


def test_every_message_kind_is_on_its_page_and_in_the_wire_grammar(site: Path) -> None:
    kinds = [*wire.AGENT_KINDS, *wire.SERVER_KINDS]
    assert "warning" in kinds
    grammar = wire.__doc__ or ""
    assert [k for k in kinds if not re.search(rf"^ {{6}}{k} ", grammar, re.M)] == []
    text = page(site, "reference/wire")
    assert [k for k in kinds if f"<td><code>{k}</code></td>" not in text] == []


def test_every_exit_code_is_on_its_page_with_its_name(site: Path) -> None:
    codes = {n: v for n, v in vars(exitcodes).items() if n.isupper() and isinstance(v, int)}
    assert codes["TIMEOUT"] == 124
    text = page(site, "reference/exit-codes")
    rows = re.findall(r"<td>(\d+)</td>\s*<td><code>([A-Z_]+)</code></td>", text)
    assert {name: int(code) for code, name in rows} == codes


def test_the_exit_codes_the_scheduler_page_lists_are_the_code_s() -> None:
    text = (DOCS / "schedulers.md").read_text()
    listed = {int(c) for c in re.findall(r"^\| (\d+) \|", text, re.M)}
    codes = {v for n, v in vars(exitcodes).items() if n.isupper() and isinstance(v, int)}
    assert listed and listed <= codes
    assert exitcodes.REPLICA_MISMATCH in listed and exitcodes.TIMEOUT in listed


def test_every_option_and_member_of_the_python_api_is_on_its_page() -> None:
    import inspect

    import nand
    from nand.agent.api import Watch, watch

    text = (DOCS / "python-api.md").read_text()
    options = list(inspect.signature(watch).parameters)
    members = [n for n in dir(Watch) if not n.startswith("_")]  # (Readout's too)
    assert {"on_event", "mode"} <= set(options) and {"first", "close"} <= set(members)
    assert [o for o in options if f"| `{o}` |" not in text] == []
    assert [m for m in members if not re.search(rf"^\| `{m}[`(]", text, re.M)] == []
    assert [n for n in nand.__all__ if f"`{n}`" not in text] == []


def test_every_error_nand_raises_is_in_the_hierarchy_its_docstring_draws() -> None:
    from nand import errors

    classes = [
        name
        for name, value in vars(errors).items()
        if isinstance(value, type) and issubclass(value, errors.NandError)
    ]
    assert "EarlyWarning" in classes
    tree = errors.__doc__ or ""
    assert [c for c in classes if not re.search(rf"(^\s*|── ){c} ", tree, re.M)] == []


#: Variables whose stated default is not a value of the variable itself.
DEFAULT_FROM_ELSEWHERE = {
    "NAND_RUN": "the launcher's id (TORCHELASTIC_RUN_ID, SLURM_JOB_ID), else one agreed",
    "NAND_SPOOL_DIR": "$XDG_CACHE_HOME, expanded when read",
    "NAND_URL": "the CLI's default; the agent and the server have none",
}


def stated_default(doc: str) -> str | None:
    """The default a config docstring states, as the variable's text."""
    patterns = (
        r"``([^`]+)`` \(default\)",
        r"Default:? ``([^`]+)``",
        r"Default:? (\d+(?:\.\d+)?)",
        r"Default (on|off)\b",
    )
    found = [(m.start(), m.group(1)) for p in patterns if (m := re.search(p, doc))]
    if not found:
        return None
    value = min(found)[1]
    return {"on": "1", "off": "0"}.get(value, value)


def resolved() -> tuple[Any, Any]:
    from nand.server.settings import Settings

    return nand.config.AgentConfig.resolve(), Settings.from_env()


def test_the_defaults_the_config_text_states_are_the_ones_the_code_uses(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    hooks = load_hooks()
    for name in [n for n in os.environ if n.startswith("NAND_")]:
        monkeypatch.delenv(name)
    baseline = resolved()
    checked, wrong = [], []
    for _, name, doc in hooks.config_variables():
        value = stated_default(doc)
        if value is None or name in DEFAULT_FROM_ELSEWHERE:
            continue
        monkeypatch.setenv(name, value)
        if resolved() != baseline:
            wrong.append(f"{name}: the text says {value!r}")
        monkeypatch.delenv(name)
        checked.append(name)
    assert wrong == []
    assert {"NAND_MODE", "NAND_ON_NONFINITE", "NAND_HEARTBEAT_S", "NAND_DB"} <= set(checked)


def test_a_mode_default_stated_wrong_is_caught(monkeypatch: pytest.MonkeyPatch) -> None:
    # The drift this test was written for: config.py said NAND_MODE defaults to "full".
    assert stated_default("``full`` (default): a probe on every module") == "full"
    monkeypatch.delenv("NAND_MODE", raising=False)
    baseline = resolved()
    monkeypatch.setenv("NAND_MODE", "full")
    assert resolved() != baseline


def test_the_generators_refuse_text_that_disagrees_with_the_code(tmp_path: Path) -> None:
    hooks = load_hooks()
    codes = types.ModuleType("codes", "0  OK  done\n3  DIVERGED  the run diverged\n")
    codes.OK, codes.DIVERGED, codes.LOST = 0, 3, 4  # type: ignore[attr-defined]
    with pytest.raises(ValueError, match="differ"):
        hooks.exit_codes(codes)
    config = tmp_path / "config.py"
    config.write_text('NAND_A = "NAND_A"\n"""Documented."""\nNAND_B = "NAND_B"\n')
    with pytest.raises(ValueError, match="NAND_B has no docstring"):
        hooks.config_variables(config)


def test_the_generators_docstring_examples_hold() -> None:
    result = doctest.testmod(load_hooks())
    assert result.attempted > 0 and result.failed == 0


def runnable_blocks() -> list[tuple[str, str]]:
    blocks = []
    for path in sorted(DOCS.rglob("*.md")):
        text = path.read_text()
        for m in re.finditer(re.escape(RUNNABLE) + r"\n```python\n(.*?)\n```", text, re.S):
            line = text[: m.start()].count("\n") + 1
            blocks.append((f"{path.relative_to(DOCS)}:{line}", m.group(1)))
    return blocks


def test_the_docs_mark_examples_to_run() -> None:
    marks = sum(p.read_text().count(RUNNABLE) for p in DOCS.rglob("*.md"))
    assert marks >= 2 and len(runnable_blocks()) == marks


BLOCKS = runnable_blocks()


@pytest.mark.parametrize(("where", "code"), BLOCKS, ids=[where for where, _ in BLOCKS])
def test_a_runnable_example_of_the_docs_runs(where: str, code: str, tmp_path: Path) -> None:
    script = tmp_path / "example.py"
    script.write_text(code)
    run = subprocess.run(
        [sys.executable, str(script)],
        cwd=tmp_path,
        env=clean_env(),
        capture_output=True,
        text=True,
        timeout=240,
    )
    assert run.returncode == 0, f"{where} failed:\n{run.stderr[-3000:]}"


def markdown_links(path: Path) -> list[str]:
    text = re.sub(r"```.*?```", "", path.read_text(), flags=re.S)  # (code is not links)
    return re.findall(r"\]\(([^)\s]+)\)", text)


def heading_ids(path: Path) -> set[str]:
    """The anchors of a Markdown file's headings, as GitHub and mkdocs make them."""
    ids = set()
    for line in path.read_text().splitlines():
        if m := re.match(r"^#{1,6} (.+?)\s*$", line):
            words = re.sub(r"[^\w\- ]", "", m.group(1).lower())
            ids.add(words.replace(" ", "-"))
    return ids


@pytest.mark.parametrize("name", ["README.md", "CONTRIBUTING.md"])
def test_every_link_of_the_landing_pages_resolves(name: str) -> None:
    source = ROOT / name
    links = markdown_links(source)
    assert links
    broken = []
    for link in links:
        if re.match(r"^[a-z]+:", link):
            continue  # (no absolute URL is checked: no network in CI)
        target, _, anchor = link.partition("#")
        path = (source.parent / target).resolve() if target else source
        if not path.exists() or (anchor and anchor not in heading_ids(path)):
            broken.append(link)
    assert broken == []


def test_the_readme_is_a_landing_page_with_the_two_commands_first() -> None:
    text = (ROOT / "README.md").read_text()
    assert len(text.splitlines()) <= 250
    first_block = text.split("```")[1]
    assert "scripts/demo" in first_block and "scripts/test" in first_block
    assert "docs/" in text and "CONTRIBUTING.md" in text
