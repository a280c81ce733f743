"""Framework runs named by the framework itself, for the run-name tests
(:mod:`tests.integrations.test_run_names`, :mod:`tests.web.test_framework_runs`).

Each trains a one-layer regression for :data:`STEPS` steps on data that holds a
NaN in batch :data:`NAN_AT`, so the first event (that step's input) is known
without nand.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
from torch import nn

STEPS = 4
NAN_AT = 2  # the batch (and optimizer step) whose input holds a NaN


def batches() -> list[tuple[torch.Tensor, torch.Tensor]]:
    generator = torch.Generator().manual_seed(0)
    data = [(torch.randn(8, 4, generator=generator), torch.randn(8, 1, generator=generator))]
    data *= STEPS
    x, y = data[NAN_AT]
    data[NAN_AT] = (x.clone().index_fill_(0, torch.tensor([3]), float("nan")), y)
    return data


def fit_lightning_with_its_default_logger(root: Path, **options: Any) -> str | None:
    """``Trainer(default_root_dir=root, callbacks=[NandCallback(**options)])``, the
    logger left as Lightning makes it; the run id nand used."""
    import lightning.pytorch as pl
    from torch.utils.data import DataLoader

    from nand.integrations.lightning import NandCallback

    class Regression(pl.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.fc = nn.Linear(4, 1)

        def training_step(self, batch: tuple[torch.Tensor, torch.Tensor], _: int) -> torch.Tensor:
            x, y = batch
            return nn.functional.mse_loss(self.fc(x), y)

        def configure_optimizers(self) -> torch.optim.Optimizer:
            return torch.optim.SGD(self.parameters(), lr=0.1)

    callback = NandCallback(**options)
    trainer = pl.Trainer(
        default_root_dir=str(root),
        max_steps=STEPS,
        accelerator="cpu",
        devices=1,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        callbacks=[callback],
    )
    trainer.fit(Regression(), DataLoader(batches(), batch_size=None))
    assert (trainer.logger.name, trainer.logger.version) == ("lightning_logs", 0)
    return callback.watch.first.run if callback.watch and callback.watch.first else None
