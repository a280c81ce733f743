import subprocess
import sys
import types

import nand


def test_all_is_exactly_what_nand_exports():
    exported = {
        name
        for name, value in vars(nand).items()
        if not name.startswith("_") and not isinstance(value, types.ModuleType)
    }
    # watch and Watch are lazy (they import torch): not in vars() until first use.
    assert exported | {"watch", "Watch", "__version__"} == set(nand.__all__)
    for name in nand.__all__:
        assert getattr(nand, name) is not None


def test_importing_nand_does_not_import_torch_or_fastapi():
    code = "import sys, nand, nand.wire; print('torch' in sys.modules, 'fastapi' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.split() == ["False", "False"]
