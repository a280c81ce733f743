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


@pytest.fixture(autouse=True)
def _one_thread_and_a_fixed_seed() -> None:
    import torch

    torch.set_num_threads(1)
    torch.manual_seed(0)
