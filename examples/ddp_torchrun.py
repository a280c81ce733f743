"""A plain DDP training script with nand: one added line.

    NAND_SERVER=tcp://127.0.0.1:5557 \
        torchrun --standalone --nproc-per-node 2 examples/ddp_torchrun.py

Without NAND_SERVER the agent works alone: it logs the first non-finite value
on each rank. Module names are reported as written (no ``module.`` prefix).
"""

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel

import nand


def main() -> None:
    dist.init_process_group("gloo")  # "nccl" on GPUs
    torch.manual_seed(0)
    model = DistributedDataParallel(
        nn.Sequential(nn.Linear(16, 64), nn.ReLU(), nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, 1))
    )
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    with nand.watch(model, optimizer=optimizer) as watch:  # the one line
        for _ in range(200):
            x = torch.randn(32, 16)
            loss = nn.functional.mse_loss(model(x), x.sum(dim=1, keepdim=True))
            loss.backward()
            watch.loss(loss)  # optional: the loss in heartbeats, without a sync
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
    if watch.first is not None:
        print(f"rank {dist.get_rank()}: first non-finite value: {watch.first.describe()}")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
