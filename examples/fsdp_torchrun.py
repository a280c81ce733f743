"""FSDP2 (``fully_shard``) training with nand; runs on CPU with gloo.

    NAND_SERVER=tcp://127.0.0.1:5557 \
        torchrun --standalone --nproc-per-node 2 examples/fsdp_torchrun.py

nand checks each rank's local parameter shard after the optimizer step, so
the server can name the rank that owns a shard that went non-finite, even
though every rank sees it once it is all-gathered into the next forward.
"""

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.fsdp import fully_shard

import nand


def main() -> None:
    dist.init_process_group("gloo")  # "nccl" on GPUs
    torch.manual_seed(0)
    model = nn.Sequential(
        nn.Linear(16, 64), nn.ReLU(), nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, 1)
    )
    for layer in model:
        if isinstance(layer, nn.Linear):
            fully_shard(layer)
    fully_shard(model)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    with nand.watch(model, optimizer=optimizer, on_nonfinite="skip") as watch:
        for _ in range(200):
            x = torch.randn(32, 16)
            loss = nn.functional.mse_loss(model(x), x.sum(dim=1, keepdim=True))
            loss.backward()
            watch.loss(loss)
            optimizer.step()  # skipped on every rank if any rank went non-finite
            optimizer.zero_grad(set_to_none=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
