"""Code a newcomer can read: no file in nand/ over 400 lines, no function over 60.

Generated Alembic migrations aside. A file or function that grows past these
is split along a seam, not trimmed of its comments.
"""

from __future__ import annotations

import ast
from pathlib import Path

NAND = Path(__file__).resolve().parents[1] / "nand"
MAX_FILE_LINES = 400
MAX_FUNCTION_LINES = 60


def sources() -> list[Path]:
    return [p for p in sorted(NAND.rglob("*.py")) if "migrations" not in p.parts]


def test_no_file_is_over_400_lines():
    long = {
        str(p.relative_to(NAND)): n
        for p in sources()
        if (n := len(p.read_text().splitlines())) > MAX_FILE_LINES
    }
    assert not long, long


def test_no_function_is_over_60_lines():
    long = {}
    for path in sources():
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                assert node.end_lineno is not None
                lines = node.end_lineno - node.lineno + 1
                if lines > MAX_FUNCTION_LINES:
                    long[f"{path.relative_to(NAND)}:{node.name}"] = lines
    assert not long, long
