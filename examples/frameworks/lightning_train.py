"""PyTorch Lightning with nand: one callback.

    python examples/frameworks/lightning_train.py                 # +inf planted at step 12
    python examples/frameworks/lightning_train.py --policy raise  # NonFiniteError out of fit

``NandCallback()`` takes the options of ``nand.watch``; ``step`` is
``trainer.global_step``; each training batch is checked as the input data.
"""

from __future__ import annotations

import lightning as L
import torch
from common import Tokens, arguments, plant_fault, tiny_gpt2

from nand.integrations.lightning import NandCallback


class LanguageModel(L.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.model = tiny_gpt2()

    def training_step(self, batch: dict[str, torch.Tensor], batch_idx: int) -> torch.Tensor:
        return self.model(**batch).loss

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.AdamW(self.parameters(), lr=1e-3)


def main() -> None:
    options = arguments(__doc__.splitlines()[0])
    module = LanguageModel()
    trainer_ref: list[L.Trainer] = []
    plant_fault(module.model, lambda: trainer_ref[0].global_step, options.fault_step)
    nand_callback = NandCallback(on_nonfinite=options.policy)
    trainer = L.Trainer(
        accelerator="cpu",
        max_steps=options.steps,
        callbacks=[nand_callback],
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    trainer_ref.append(trainer)
    data = torch.utils.data.DataLoader(Tokens(), batch_size=8)
    trainer.fit(module, data)
    first = nand_callback.watch.first
    print(f"trained {trainer.global_step} steps; nand's first event: {first and first.message}")


if __name__ == "__main__":
    main()
