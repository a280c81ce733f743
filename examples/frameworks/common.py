"""What the three framework examples share: a small GPT-2 built from a config
(random init, nothing downloaded), random token data, and a fault to plant.

The fault is a forward hook registered *before* nand's, so it is part of the
module's call, the way a real overflow in that layer would be: at one step it
sets one element of the layer's output to +inf.
"""

from __future__ import annotations

import argparse
from collections.abc import Callable

import torch
from transformers import GPT2Config, GPT2LMHeadModel

#: The layer the fault is planted in (its qualified name, as nand reports it).
FAULT_LAYER = "transformer.h.1.mlp.c_fc"


def arguments(description: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=description)
    parser.add_argument("--steps", type=int, default=20, help="optimizer steps to train")
    parser.add_argument(
        "--fault-step", type=int, default=12, help="step at which +inf is planted (-1: none)"
    )
    parser.add_argument(
        "--policy", default="warn", choices=["warn", "raise", "skip", "stop"], help="on_nonfinite"
    )
    return parser.parse_args()


def tiny_gpt2() -> GPT2LMHeadModel:
    torch.manual_seed(0)
    config = GPT2Config(
        n_layer=2,
        n_embd=64,
        n_head=4,
        vocab_size=256,
        n_positions=64,
        bos_token_id=0,
        eos_token_id=0,
    )
    return GPT2LMHeadModel(config)


class Tokens(torch.utils.data.Dataset):
    """Random token sequences, the same on every run."""

    def __len__(self) -> int:
        return 1024

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        ids = torch.randint(0, 256, (32,), generator=torch.Generator().manual_seed(i))
        return {"input_ids": ids, "labels": ids}


def plant_fault(model: GPT2LMHeadModel, current_step: Callable[[], int], fault_step: int) -> None:
    """+inf in one element of ``FAULT_LAYER``'s output when ``current_step()`` is ``fault_step``."""

    def overflow(
        module: torch.nn.Module, args: object, output: torch.Tensor
    ) -> torch.Tensor | None:
        if current_step() != fault_step:
            return None
        output = output.clone()
        output.view(-1)[7] = float("inf")
        return output

    model.get_submodule(FAULT_LAYER).register_forward_hook(overflow)
