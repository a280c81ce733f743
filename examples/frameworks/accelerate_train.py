"""accelerate with nand: watch what ``accelerator.prepare`` returned.

    python examples/frameworks/accelerate_train.py                 # +inf planted at step 12
    accelerate launch --num_processes 2 examples/frameworks/accelerate_train.py

``nand.watch`` looks through accelerate's optimizer wrapper and its DDP
wrapper; the training loop is accelerate's own.
"""

from __future__ import annotations

import torch
from accelerate import Accelerator
from common import Tokens, arguments, plant_fault, tiny_gpt2

import nand


def main() -> None:
    options = arguments(__doc__.splitlines()[0])
    accelerator = Accelerator(cpu=True)
    model = tiny_gpt2()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    data = torch.utils.data.DataLoader(Tokens(), batch_size=8)
    model, optimizer, data = accelerator.prepare(model, optimizer, data)
    step = {"now": 0}
    plant_fault(accelerator.unwrap_model(model), lambda: step["now"], options.fault_step)
    with nand.watch(model, optimizer, on_nonfinite=options.policy) as watch:
        for step["now"], batch in enumerate(data):
            if step["now"] == options.steps:
                break
            accelerator.backward(model(**batch).loss)
            optimizer.step()
            optimizer.zero_grad()
    first = watch.first
    print(f"trained {watch.step} steps; nand's first event: {first and first.message}")


if __name__ == "__main__":
    main()
