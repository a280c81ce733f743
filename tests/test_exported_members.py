import nand


def test_all_lists_exactly_the_public_names():
    public = {name for name in dir(nand) if not name.startswith("_")} | {"__version__"}
    # Lazy attributes are not in dir() until first use; __all__ names them.
    assert set(nand.__all__) >= {"watch", "Watch", "Event", "NonFiniteError", "__version__"}
    for name in nand.__all__:
        assert getattr(nand, name) is not None
    unexpected = public - set(nand.__all__) - {"agent", "errors", "events", "config", "wire"}
    assert not unexpected, unexpected


def test_importing_nand_does_not_import_torch_or_fastapi():
    import subprocess
    import sys

    code = "import sys, nand, nand.wire; print('torch' in sys.modules, 'fastapi' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.split() == ["False", "False"]
