"""What the package says about itself: its name, its one version, the torch it needs.

The supported-torch line is checked in real interpreters whose torch metadata
says an old version (a ``torch-X.dist-info`` ahead on the path): importing an
old torch itself is tests/test_torch_versions.py's business, on real installs.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import tomllib  # (Python 3.11+: the tests' Python)

import nand
from nand import torch_support

ROOT = Path(__file__).resolve().parent.parent
PYPROJECT = tomllib.loads((ROOT / "pyproject.toml").read_text())


def python_with_torch_metadata(tmp_path: Path, version: str, code: str):
    """Run ``code`` in a real interpreter whose installed torch reads as ``version``."""
    info = tmp_path / f"torch-{version}.dist-info"
    info.mkdir()
    (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: torch\nVersion: {version}\n")
    path = os.pathsep.join([str(tmp_path), str(ROOT), os.environ.get("PYTHONPATH", "")])
    env = {**os.environ, "PYTHONPATH": path}
    return subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=120
    )


def test_the_distribution_is_named_nand_torch_and_installs_the_nand_command():
    assert PYPROJECT["project"]["name"] == "nand-torch"
    assert PYPROJECT["project"]["scripts"] == {"nand": "nand.cli:main"}


def test_the_version_is_written_once_in_nand_init_and_read_from_there_by_the_build():
    assert PYPROJECT["project"]["dynamic"] == ["version"]
    assert "version" not in PYPROJECT["project"]
    assert PYPROJECT["tool"]["setuptools"]["dynamic"]["version"] == {"attr": "nand.__version__"}
    assert re.fullmatch(r"\d+\.\d+\.\d+((a|b|rc)\d+)?", nand.__version__)


def test_the_changelog_has_a_section_for_the_current_version():
    changelog = (ROOT / "CHANGELOG.md").read_text()
    assert re.search(rf"^## {re.escape(nand.__version__)}\b", changelog, re.MULTILINE)


def test_the_license_file_is_the_apache_2_license_the_metadata_names():
    assert PYPROJECT["project"]["license"] == "Apache-2.0"
    text = (ROOT / "LICENSE").read_text()
    assert "Apache License" in text and "Version 2.0, January 2004" in text
    assert "END OF TERMS AND CONDITIONS" in text


def test_the_agent_extra_declares_the_torch_minimum_that_nand_checks():
    agent = PYPROJECT["project"]["optional-dependencies"]["agent"]
    (torch_req,) = [r for r in agent if r.startswith("torch")]
    assert torch_req == "torch>={}.{}".format(*torch_support.TORCH_MIN)


def test_install_hints_name_the_distribution_not_the_other_projects_nand():
    # "pip install 'nand[postgres]'" would install an unrelated project's package.
    wrong = re.compile(r"pip install[^\n`]*['\"]?nand\[|['\"`]nand\[\w")
    files = [ROOT / "README.md", *sorted((ROOT / "nand").rglob("*.py"))]
    found = [f"{f.relative_to(ROOT)}: {m[0]}" for f in files for m in wrong.finditer(f.read_text())]
    assert found == []


@pytest.mark.parametrize(
    "version,line",
    [
        ("2.2.2", "nand needs torch >= 2.4 (found 2.2.2)"),
        ("2.3.1+cu121", "nand needs torch >= 2.4 (found 2.3.1+cu121)"),
        ("1.13.1", "nand needs torch >= 2.4 (found 1.13.1)"),
        ("2.4.0", None),
        ("2.4.0a0+git1234", None),
        ("2.15.0", None),
        ("10.0", None),
        (None, None),
    ],
)
def test_a_torch_older_than_the_minimum_gets_one_line_naming_both(version, line):
    assert torch_support.too_old(version) == line


def test_import_nand_on_an_old_torch_says_so_in_one_line(tmp_path):
    done = python_with_torch_metadata(tmp_path, "2.2.2", "import nand")
    assert done.returncode == 0, done.stderr  # a server host may have any torch
    assert done.stderr.splitlines() == ["nand needs torch >= 2.4 (found 2.2.2)"]


def test_nand_watch_on_an_old_torch_raises_that_line_not_a_missing_extra(tmp_path):
    done = python_with_torch_metadata(tmp_path, "2.3.1", "import nand\nnand.watch")
    assert done.returncode == 1
    last = done.stderr.strip().splitlines()[-1]
    assert last == "ImportError: nand needs torch >= 2.4 (found 2.3.1)"
    assert "pip install" not in done.stderr


def test_import_nand_on_a_supported_torch_says_nothing(tmp_path):
    done = python_with_torch_metadata(tmp_path, "2.15.0", "import nand\nnand.watch")
    assert done.returncode == 0, done.stderr
    assert done.stderr == ""
