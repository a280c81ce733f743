"""A server host never imports torch; the CLI module imports nothing heavy."""

from __future__ import annotations

import subprocess
import sys


def _modules_after(code: str) -> set[str]:
    probe = f"{code}; import sys; print(' '.join(sorted(sys.modules)))"
    out = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, check=True)
    return set(out.stdout.split())


def test_the_whole_server_runs_without_torch() -> None:
    loaded = _modules_after(
        "import nand.server.http.app, nand.server.embedded, nand.cli.server_args; "
        "nand.server.http.app.create_app()"
    )
    assert "fastapi" in loaded
    assert "torch" not in loaded


def test_the_command_module_is_light_at_import() -> None:
    loaded = _modules_after("import nand.cli.server_args")
    assert not {"fastapi", "sqlalchemy", "zmq", "torch", "uvicorn"} & loaded
