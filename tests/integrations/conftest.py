"""Settings of the real-model suite: nothing is downloaded, runs are deterministic."""

from __future__ import annotations

import os

import pytest

# The shared asserts of check.py say what differed, as a test's own do.
pytest.register_assert_rewrite("tests.integrations.check")

# Every model is built from a config with random init: a test that tried to
# reach the hub would hang or fail on a machine without network.
os.environ["HF_HUB_OFFLINE"] = "1"
os.environ["TRANSFORMERS_OFFLINE"] = "1"
os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
# With NAND_TEST_DEVICE=cuda (loops.DEVICE) twin runs must still compute the
# same losses bit for bit: cuBLAS needs a fixed workspace for that, set
# before CUDA starts, and torch its deterministic kernels (below).
ON_CUDA = os.environ.get("NAND_TEST_DEVICE", "cpu").startswith("cuda")
if ON_CUDA:
    os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")


@pytest.fixture(autouse=True)
def _one_thread_and_a_fixed_seed() -> None:
    import torch

    torch.set_num_threads(1)
    torch.manual_seed(0)  # CUDA's generators too
    if ON_CUDA:  # warn_only: an op without a deterministic kernel still runs
        torch.use_deterministic_algorithms(True, warn_only=True)
