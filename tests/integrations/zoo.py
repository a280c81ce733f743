"""Real model code (transformers), built small from configs with random init.

Nothing is downloaded: each :class:`Case` builds its model from a config,
makes its batches from a generator seeded with the batch index (so a batch
does not depend on what else drew random numbers), and names the places
where :mod:`faults` plants each kind of fault, in the model's own module
and parameter names. A Lightning ``LightningModule``, an HF ``Trainer`` or
an accelerate loop can reuse the same three pieces: ``build()``,
``batch(i)`` and ``loss(model, batch)``.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import Tensor, nn

BATCH, SEQ, VOCAB, IMAGE = 4, 16, 128, 32
HIDDEN, LAYERS, HEADS = 64, 2, 4


@dataclasses.dataclass(frozen=True)
class Case:
    """One real model: how to build it, feed it and train it, and where faults go."""

    name: str
    make: Callable[[], nn.Module]
    make_batch: Callable[[torch.Generator, bool], dict[str, Tensor]]
    sites: dict[str, str]  # fault kind -> module, parameter or batch key
    loss_outside: bool = False  # labels kept out of the model: the loop computes the loss

    def build(self, seed: int = 0) -> nn.Module:
        torch.manual_seed(seed)
        return self.make()

    def batch(self, index: int, float_input: bool = False) -> dict[str, Tensor]:
        """Batch ``index``; with ``float_input`` text models get ``inputs_embeds``."""
        return self.make_batch(torch.Generator().manual_seed(index), float_input)

    def loss(self, model: nn.Module, batch: dict[str, Tensor]) -> Tensor:
        if not self.loss_outside:
            return model(**batch).loss
        inputs = {k: v for k, v in batch.items() if k != "labels"}
        return F.cross_entropy(model(**inputs).logits.float(), batch["labels"])


def _tokens(gen: torch.Generator, float_input: bool) -> dict[str, Tensor]:
    ids = torch.randint(0, VOCAB, (BATCH, SEQ), generator=gen)
    if float_input:
        return {"inputs_embeds": torch.randn(BATCH, SEQ, HIDDEN, generator=gen), "labels": ids}
    return {"input_ids": ids, "labels": ids}


def _padded(gen: torch.Generator, float_input: bool) -> dict[str, Tensor]:
    """Sentences of different lengths, padded: the attention mask has zeros."""
    ids = torch.randint(1, VOCAB, (BATCH, SEQ), generator=gen)
    lengths = torch.tensor([SEQ, 12, 9, 5])
    mask = (torch.arange(SEQ)[None, :] < lengths[:, None]).long()
    labels = torch.randint(0, 3, (BATCH,), generator=gen)
    batch = {"attention_mask": mask, "labels": labels}
    if float_input:
        return {**batch, "inputs_embeds": torch.randn(BATCH, SEQ, HIDDEN, generator=gen)}
    return {**batch, "input_ids": ids * mask}  # 0 is the pad token


def _images(gen: torch.Generator, float_input: bool) -> dict[str, Tensor]:
    pixels = torch.randn(BATCH, 3, IMAGE, IMAGE, generator=gen)
    return {"pixel_values": pixels, "labels": torch.randint(0, 5, (BATCH,), generator=gen)}


def _gpt2() -> nn.Module:
    from transformers import GPT2Config, GPT2LMHeadModel

    config = GPT2Config(
        n_layer=LAYERS,
        n_embd=HIDDEN,
        n_head=HEADS,
        vocab_size=VOCAB,
        n_positions=SEQ,
        bos_token_id=0,
        eos_token_id=0,
        use_cache=False,
    )
    return GPT2LMHeadModel(config)  # lm_head.weight is transformer.wte.weight (tied)


def _bert() -> nn.Module:
    from transformers import BertConfig, BertForSequenceClassification

    config = BertConfig(
        num_hidden_layers=LAYERS,
        hidden_size=HIDDEN,
        num_attention_heads=HEADS,
        intermediate_size=2 * HIDDEN,
        vocab_size=VOCAB,
        max_position_embeddings=SEQ,
        num_labels=3,
    )
    return BertForSequenceClassification(config)


def _llama() -> nn.Module:
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(
        num_hidden_layers=LAYERS,
        hidden_size=HIDDEN,
        num_attention_heads=HEADS,
        num_key_value_heads=HEADS // 2,
        intermediate_size=2 * HIDDEN,
        vocab_size=VOCAB,
        max_position_embeddings=SEQ,
        bos_token_id=0,
        eos_token_id=0,
        use_cache=False,
    )
    return LlamaForCausalLM(config)


def _vit() -> nn.Module:
    from transformers import ViTConfig, ViTForImageClassification

    config = ViTConfig(
        num_hidden_layers=LAYERS,
        hidden_size=HIDDEN,
        num_attention_heads=HEADS,
        intermediate_size=2 * HIDDEN,
        image_size=IMAGE,
        patch_size=8,
        num_labels=5,
    )
    return ViTForImageClassification(config)


def _resnet18() -> nn.Module:
    from transformers import ResNetConfig, ResNetForImageClassification

    # ResNet-18's layout (basic blocks, 2-2-2-2), narrower.
    config = ResNetConfig(
        layer_type="basic",
        depths=[2, 2, 2, 2],
        hidden_sizes=[16, 32, 64, 128],
        embedding_size=16,
        num_labels=5,
    )
    return ResNetForImageClassification(config)


CASES = {
    case.name: case
    for case in (
        Case(
            "gpt2",
            _gpt2,
            _tokens,
            {
                "forward": "transformer.h.1.mlp.c_proj",
                "backward": "transformer.h.0.mlp.c_fc",
                "input": "inputs_embeds",
                "loss": "",
                "lr": "transformer.wte.weight",
            },
        ),
        Case(
            "bert",
            _bert,
            _padded,
            {
                "forward": "bert.encoder.layer.1.output.dense",
                "backward": "bert.encoder.layer.0.intermediate",
                "input": "inputs_embeds",
                "loss": "",
                "lr": "classifier.weight",
            },
            loss_outside=True,
        ),
        Case(
            "llama",
            _llama,
            _tokens,
            {
                "forward": "model.layers.0.self_attn.o_proj",
                "backward": "model.layers.1.self_attn.q_proj",
                "input": "inputs_embeds",
                "loss": "",
                "lr": "model.layers.1.mlp.gate_proj.weight",
            },
        ),
        Case(
            "vit",
            _vit,
            _images,
            {
                "forward": "vit.layers.0.attention",
                "backward": "vit.layers.1.mlp",
                "input": "pixel_values",
                "loss": "",
                "lr": "classifier.bias",
            },
            loss_outside=True,
        ),
        Case(
            "resnet18",
            _resnet18,
            _images,
            {
                "forward": "resnet.encoder.stages.2.layers.0.shortcut",
                "backward": "resnet.encoder.stages.1.layers.1.layer.0.convolution",
                "input": "pixel_values",
                "loss": "",
                "lr": "resnet.embedder.embedder.convolution.weight",
            },
        ),
    )
}


def case(name: str) -> Case:
    return CASES[name]


def float_input_needed(case: Case, kind: str) -> bool:
    """An input fault in a text model needs a float input: ``inputs_embeds``."""
    return kind == "input" and case.sites["input"] == "inputs_embeds"
