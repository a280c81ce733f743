"""Hugging Face ``Trainer`` with nand: one callback.

    python examples/frameworks/hf_trainer.py                  # +inf planted at step 12
    python examples/frameworks/hf_trainer.py --policy stop    # the Trainer stops cleanly there

``NandCallback()`` takes the options of ``nand.watch``; ``step`` is the
Trainer's ``state.global_step``. (``TrainingArguments(report_to=["nand"])``
works too once ``nand.integrations.transformers`` is imported.)
"""

from __future__ import annotations

import tempfile

from common import Tokens, arguments, plant_fault, tiny_gpt2
from transformers import Trainer, TrainerCallback, TrainingArguments

from nand.integrations.transformers import NandCallback


def main() -> None:
    options = arguments(__doc__.splitlines()[0])
    model = tiny_gpt2()
    step = {"now": 0}

    class StepCounter(TrainerCallback):  # only for planting the fault at a step
        def on_step_begin(self, args, state, control, **kwargs):
            step["now"] = state.global_step

    plant_fault(model, lambda: step["now"], options.fault_step)
    nand_callback = NandCallback(on_nonfinite=options.policy)
    args = TrainingArguments(
        output_dir=tempfile.mkdtemp(prefix="nand-hf-"),
        max_steps=options.steps,
        per_device_train_batch_size=8,
        learning_rate=1e-3,
        logging_strategy="no",
        save_strategy="no",
        report_to="none",
        use_cpu=True,
        disable_tqdm=True,
    )
    trainer = Trainer(
        model=model, args=args, train_dataset=Tokens(), callbacks=[StepCounter(), nand_callback]
    )
    trainer.train()
    first = nand_callback.watch.first
    message = first.message if first else None
    print(f"trained {trainer.state.global_step} steps; nand's first event: {message}")


if __name__ == "__main__":
    main()
