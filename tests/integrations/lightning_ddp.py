"""A Lightning DDP job (gloo, CPU) with a fault planted on one rank, for the tests.

    torchrun --standalone --nproc-per-node=2 tests/integrations/lightning_ddp.py OUT_DIR

Rank :data:`FAULT_RANK`'s ``net.2`` makes a NaN in forward at step
:data:`FAULT_STEP` (a hook registered before nand's: nand is not told). The
``training_step`` logs with ``sync_dist=True``, an all-reduce: a replay that
logged would make it on one rank only. Each rank writes its first event to
``OUT_DIR/rank<r>.json``.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import lightning as L
import torch
from torch import nn

from nand.integrations.lightning import NandCallback

FAULT_RANK, FAULT_STEP, FAULT_MODULE, STEPS = 1, 2, "net.2", 4


class Regression(L.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 16), nn.Linear(16, 1))

    def training_step(self, batch: list[torch.Tensor], batch_idx: int) -> torch.Tensor:
        x, y = batch
        loss = (self.net(x) - y).pow(2).mean()
        self.log("train_loss", loss, sync_dist=True)
        return loss

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=1e-2)


def plant(module: Regression, trainer: L.Trainer) -> None:
    def nan_at_step(_: nn.Module, args: object, output: torch.Tensor) -> torch.Tensor | None:
        if trainer.global_rank == FAULT_RANK and trainer.global_step == FAULT_STEP:
            return output + (-torch.ones_like(output)).log()  # (log of -1: an op makes it)
        return None

    module.net[2].register_forward_hook(nan_at_step)


def main(out: Path) -> None:
    torch.manual_seed(0)
    data = torch.utils.data.TensorDataset(torch.randn(64, 8), torch.randn(64, 1))
    module, callback = Regression(), NandCallback(log_events=False)
    trainer = L.Trainer(
        accelerator="cpu",
        devices=2,
        strategy="ddp",
        max_steps=STEPS,
        callbacks=[callback],
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    plant(module, trainer)
    trainer.fit(module, torch.utils.data.DataLoader(data, batch_size=4))
    first = callback.watch.first if callback.watch is not None else None
    fields = ("step", "phase", "module", "cause", "reproduced", "replay")
    said = {name: getattr(first, name) for name in fields} if first is not None else None
    (out / f"rank{trainer.global_rank}.json").write_text(json.dumps(said))


if __name__ == "__main__":
    main(Path(sys.argv[1]))
