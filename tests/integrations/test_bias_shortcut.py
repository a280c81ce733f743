"""The bias shortcut is exact: only a layer whose forward is its type's is read through its bias.

nand reads a Linear's, convolution's or norm's output gradient from its bias
gradient. That is the output gradient only when the forward is the type's
own: a subclass adding an op after the bias (LoRA, quantised layers), an
instance ``forward`` replaced (patching libraries), or a user's forward hook
changing the output put code between the bias and the output. A NaN made in
that code's backward must be blamed on the layer, not the module after it.
"""

from __future__ import annotations

import types

import pytest
import torch.nn.functional as F
from torch import Tensor, nn

from tests.integrations.check import assert_reported_as_the_truth_says
from tests.integrations.faults import BadGradient, Fault, Planted
from tests.integrations.loops import FP32

pytest.importorskip("transformers")

LAYER = "bert.encoder.layer.1.output.dense"  # an nn.Linear with a bias


class AfterBias(nn.Linear):
    """A Linear whose forward does one more op after the bias; its backward makes the NaN."""

    value: Tensor

    def forward(self, x: Tensor) -> Tensor:
        return BadGradient.apply(super().forward(x), self.value)


def subclass(model: nn.Module, planted: Planted) -> None:
    planted.remove()  # the fault lives in the forward itself, not in a hook
    layer = model.get_submodule(LAYER)
    layer.__class__ = AfterBias
    layer.value = planted.value


def instance_forward(model: nn.Module, planted: Planted) -> None:
    planted.remove()
    layer = model.get_submodule(LAYER)

    def forward(self: nn.Linear, x: Tensor) -> Tensor:
        return BadGradient.apply(F.linear(x, self.weight, self.bias), planted.value)

    layer.forward = types.MethodType(forward, layer)


@pytest.mark.parametrize(
    "prepare",
    [
        pytest.param(subclass, id="subclass-of-linear"),
        pytest.param(instance_forward, id="instance-forward"),
        pytest.param(None, id="user-forward-hook"),
    ],
)
def test_a_nan_made_after_the_bias_of_a_linear_is_blamed_on_that_linear(prepare):
    # Without prepare the fault is the default backward plant: a forward hook.
    assert_reported_as_the_truth_says("bert", FP32, Fault("backward", 2, LAYER), prepare=prepare)


@pytest.mark.parametrize(
    "model,layer",
    [
        pytest.param("gpt2", "transformer.h.0.ln_2", id="gpt2-LayerNorm"),
        pytest.param("vit", "vit.layers.1.mlp.fc1", id="vit-Linear"),
        pytest.param(
            "resnet18",
            "resnet.encoder.stages.1.layers.1.layer.0.normalization",
            id="resnet18-BatchNorm2d",
        ),
    ],
)
def test_a_user_forward_hook_on_a_layer_with_a_bias_keeps_the_blame_on_that_layer(model, layer):
    # BERT's Linear is the user-forward-hook cell above; these are the other layer types.
    assert_reported_as_the_truth_says(model, FP32, Fault("backward", 2, layer))
