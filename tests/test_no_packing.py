"""No Python of the repository is packed: no ``# fmt: skip`` or ``# fmt: off``
keeps the formatter from laying arguments, lists or conditions out one to a
line, in nand/, tests/, benchmarks/ or examples/ (generated Alembic migrations
aside).

Packing hides how long a file or a function really is: it squeezed code under
the 400-line and 60-line caps of tests/test_code_shape.py instead of making it
readable. A file or function near a cap is split along a seam instead (a
coherent group moved to a module of its own, a helper named for what it does).
"""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
CHECKED = ("nand", "tests", "benchmarks", "examples")
PACKING = re.compile(r"#\s*fmt:\s*(skip|off)\b")
#: This file names the markers in its own fixtures (below), not to pack code.
THIS = Path(__file__).resolve()


def packed_files() -> list[str]:
    return sorted(
        str(path.relative_to(ROOT))
        for top in CHECKED
        for path in (ROOT / top).rglob("*.py")
        if "migrations" not in path.parts
        and path.resolve() != THIS
        and PACKING.search(path.read_text())
    )


def test_no_python_file_of_the_repository_packs_code_with_fmt_skip() -> None:
    packed = packed_files()
    assert not packed, f"split these along a seam instead of packing them: {packed}"


def test_the_check_sees_a_packed_block() -> None:
    assert PACKING.search("    )  # fmt: skip") and PACKING.search("# fmt: off")
    assert not PACKING.search("# format: the skip list")
