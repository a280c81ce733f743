"""What a replay must leave as it found it: :class:`Saved`.

- **RNG**: the CPU generator and the model's CUDA device, saved before the
  replay and put back after it (the replay itself starts from the states
  the micro-step held, so dropout draws the same masks again).
- **Buffers**: every buffer of the model, copied before the replay and
  copied back after it. They are not kept per step: in training mode a
  BatchNorm normalises with the batch's statistics, so the running
  statistics the replay starts from (those after the step's forwards) do
  not change its outputs; they only must not keep the replay's update.
- **Plain attributes** of the model's own modules: those the micro-step
  started with are set for the replay, those of now put back after it
  (``attrs.py``).
- **Determinism**: ``torch.use_deterministic_algorithms(True, warn_only=True)``
  during the replay, where the user had it off.
- **Gradients** are not touched: the replay's backward is a
  ``torch.autograd.grad`` (nothing accumulates into ``.grad``).
"""

from __future__ import annotations

import warnings
from typing import Any

import torch
from torch import nn

from nand.agent.rerun.attrs import put_back, restore
from nand.agent.rerun.held import HeldStep


class Saved:
    """The state a replay changes, taken now; :meth:`restore` puts it back."""

    def __init__(self, root: nn.Module, device: torch.device) -> None:
        self.device = device
        self.rng = torch.get_rng_state()
        self.cuda_rng = torch.cuda.get_rng_state(device) if device.type == "cuda" else None
        self.buffers = [
            (module, name, b, b.clone())
            for module in root.modules()
            for name, b in module._buffers.items()
            if b is not None
        ]
        self.deterministic = torch.are_deterministic_algorithms_enabled()
        self.warn_only = torch.is_deterministic_algorithms_warn_only_enabled()
        self.attrs: list[tuple[dict[str, Any], str, Any]] = []

    def start(self, held: HeldStep) -> None:
        """Set the micro-step's RNG states; deterministic algorithms on."""
        torch.set_rng_state(held.rng)
        self.attrs = put_back(held.attrs)
        if held.cuda_rng is not None and self.device.type == "cuda":
            torch.cuda.set_rng_state(held.cuda_rng, self.device)
        if not self.deterministic:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                torch.use_deterministic_algorithms(True, warn_only=True)

    def restore(self) -> None:
        restore(self.attrs)
        torch.set_rng_state(self.rng)
        if self.cuda_rng is not None:
            torch.cuda.set_rng_state(self.cuda_rng, self.device)
        with torch.no_grad():
            for module, name, buffer, copy in self.buffers:
                module._buffers[name] = buffer  # (a forward may rebind it)
                buffer.copy_(copy)
        torch.use_deterministic_algorithms(self.deterministic, warn_only=self.warn_only)
