"""Real models in plain loops: nand's first event is where the ground truth saw the fault.

Every answer comes from a twin run with :class:`~tests.integrations.truth.Truth`
and without nand (``check.py``). The matrix is not the full cross product:
fp32 takes every model and fault kind, with NaN, +inf and -inf in turn (the
agent's own tests hold every check to all three); each other mode takes the fault
kinds whose code path it changes (autocast dtypes for forward/backward/loss,
the GradScaler for forward/input/lr, the micro-step label for accumulation,
the recomputed forward for checkpointing, the gradients autograd records
under a gradient penalty and ``backward(create_graph=True)``), with NaN.
"""

from __future__ import annotations

import dataclasses

import pytest

from tests.integrations.check import assert_healthy, assert_reported_as_the_truth_says
from tests.integrations.faults import KINDS, VALUES, Fault
from tests.integrations.loops import (
    ACCUMULATION,
    BF16,
    CHECKPOINTING,
    CLOSURE,
    CREATE_GRAPH,
    FP16_SCALER_NOT_PASSED,
    FP16_SCALER_PASSED,
    FP32,
    GRADIENT_PENALTY,
    Loop,
    Mode,
)
from tests.integrations.zoo import CASES, case

pytest.importorskip("transformers")

MODELS = list(CASES)
CHECKPOINTED = [name for name in MODELS if name != "resnet18"]  # HF ResNet cannot checkpoint
#: A loss scale that overflows in the first iterations of every model here:
#: the scaler skips some (all six for ResNet), then goes on.
SKIPPING = 2.0**20


def cells(models: list[str], kinds: tuple[str, ...] | list[str]) -> list:
    """(model, kind) parameters, named model-kind."""
    return [pytest.param(m, k, id=f"{m}-{k}") for m in models for k in kinds]


def fault(model: str, kind: str, step: int = 2, value: str = "nan", micro: int = 0) -> Fault:
    return Fault(kind, step, case(model).sites[kind], value, micro)


# --- faults -----------------------------------------------------------------


def rotated_values() -> list:
    """Every (model, kind) with one value, each kind with all three values across models."""
    values = list(VALUES)
    return [
        pytest.param(m, k, values[(i + j) % 3], id=f"{m}-{k}-{values[(i + j) % 3]}")
        for i, m in enumerate(MODELS)
        for j, k in enumerate(KINDS)
    ]


@pytest.mark.parametrize("model,kind,value", rotated_values())
def test_a_fault_in_fp32_is_reported_where_the_ground_truth_saw_it(model, kind, value):
    assert_reported_as_the_truth_says(model, FP32, fault(model, kind, value=value))


@pytest.mark.parametrize("model,kind", cells(MODELS, ("forward", "backward", "loss")))
def test_a_fault_under_bf16_autocast_is_reported_where_the_ground_truth_saw_it(model, kind):
    assert_reported_as_the_truth_says(model, BF16, fault(model, kind))


@pytest.mark.parametrize(
    "model,kind",
    cells(MODELS, ("forward", "input", "lr")),
)
def test_a_fault_under_fp16_with_the_scaler_passed_is_reported_as_the_truth_says(model, kind):
    # Iteration 4 of 6 at the usual initial scale 2**16: ResNet's first four
    # iterations overflow and are skipped, the transformers' none.
    assert_reported_as_the_truth_says(model, FP16_SCALER_PASSED, fault(model, kind, 4), steps=6)


@pytest.mark.parametrize(
    "model,kind",
    cells(MODELS, ("forward", "input", "lr")),
)
def test_a_fault_under_fp16_without_the_scaler_passed_is_reported_as_the_truth_says(model, kind):
    mode = FP16_SCALER_NOT_PASSED
    assert_reported_as_the_truth_says(model, mode, fault(model, kind, 4), steps=6)


@pytest.mark.parametrize("model", MODELS)
def test_an_lr_fault_read_deferred_is_the_weight_when_the_scaler_skips_the_next_update(model):
    # The bad weight makes the next forward non-finite, so the scaler skips
    # that update and no optimizer pre-hook runs; read one step late (CUDA's
    # default) there are no tensors left to look behind the forward with.
    # Found on an H200 (scripts/gpu-checks): bert and vit named the classifier.
    mode = FP16_SCALER_PASSED
    assert_reported_as_the_truth_says(model, mode, fault(model, "lr", 4), steps=6, read="deferred")


@pytest.mark.parametrize("model,kind", cells(MODELS, ("forward", "backward", "lr")))
def test_a_fault_in_an_accumulated_micro_step_is_labelled_with_it(model, kind):
    run = assert_reported_as_the_truth_says(model, ACCUMULATION, fault(model, kind, micro=1))
    assert run.watch is not None and run.watch.first is not None
    light = run.watch.settings.mode == "light"  # (a gradient's micro-step: see check.py)
    if kind == "forward" or (kind == "backward" and not light):
        assert run.watch.first.micro_step == 1  # (an update belongs to the last micro-step)


@pytest.mark.parametrize("model,kind", cells(CHECKPOINTED, ("forward", "backward")))
def test_a_fault_under_gradient_checkpointing_is_reported_where_the_truth_saw_it(model, kind):
    assert_reported_as_the_truth_says(model, CHECKPOINTING, fault(model, kind))


@pytest.mark.parametrize(
    "kind,where",
    [("forward", "lm_head"), ("backward", "lm_head"), ("lr", "transformer.wte.weight")],
)
def test_gpt2_tied_embeddings_are_named_as_the_model_names_them(kind, where):
    loop = Loop("gpt2", FP32)
    assert loop.model.lm_head.weight is loop.model.transformer.wte.weight  # tied
    loop.close()
    assert_reported_as_the_truth_says("gpt2", FP32, Fault(kind, 2, where))


def test_every_bert_batch_is_padded_so_every_bert_cell_runs_with_a_padding_mask():
    masks = [case("bert").batch(i)["attention_mask"] for i in range(3)]
    assert all(bool((m == 0).any()) and bool((m == 1).any()) for m in masks)


#: The probes alone blame the module whose gradient arrived just before the
#: first non-finite one; where two branches meet that is either branch. These
#: cases are named by the replay: its backward op's autograd node belongs to
#: the module that made it (nand/agent/rerun/owners.py).
BEYOND = "beyond issue 15's list: backward blame follows the order gradients arrive in"


@pytest.mark.parametrize(
    "model,where",
    [
        # The norm feeds q, k and v and sits on the residual: nand named
        # model.layers.1.self_attn while k and v re-probed the norm's output as
        # the attention's inline value (now it is probed once: detect/inline.py).
        ("llama", "model.layers.1.input_layernorm"),
        # A branch beside the block: nand named the block's layer.0.convolution.
        ("resnet18", "resnet.encoder.stages.2.layers.0.shortcut.convolution"),
        # Query, key and value read one input: nand named attention.self (bias
        # proxy), or query without the proxy.
        ("bert", "bert.encoder.layer.0.attention.self.value"),
        pytest.param(
            "vit",
            "vit.embeddings.patch_embeddings.projection",
            marks=pytest.mark.xfail(
                strict=True,
                reason=f"{BEYOND}; the first layer: no gradient after it is probed, nand names "
                "its parent (bias proxy), or a grad event of its weight without the proxy "
                "(a grad event names a parameter, and the replay keeps it)",
            ),
        ),
    ],
)
def test_a_backward_nan_in_a_layer_on_a_branch_is_blamed_on_that_layer(model, where):
    assert_reported_as_the_truth_says(model, FP32, Fault("backward", 2, where))


#: The models whose every op has a double backward on CPU (llama's and ViT's
#: CPU flash attention has none).
TWICE_DIFFERENTIABLE = ["gpt2", "bert", "resnet18"]


@pytest.mark.parametrize("mode", [GRADIENT_PENALTY, CREATE_GRAPH], ids=str)
@pytest.mark.parametrize("model,kind", cells(TWICE_DIFFERENTIABLE, ("forward", "backward", "lr")))
def test_a_fault_in_a_backward_with_create_graph_is_reported_where_the_truth_saw_it(
    model, kind, mode
):
    # The gradients nand probes, and with backward(create_graph=True) every
    # .grad it takes the norm of, are tensors autograd records: aminmax(out=...)
    # and a copy into the slab refuse them outside no_grad. Before this was
    # handled, the first backward (or boundary) switched nand off.
    run = assert_reported_as_the_truth_says(model, mode, fault(model, kind))
    assert run.watch is not None and not run.watch._guard.off


# --- healthy runs -----------------------------------------------------------

FP16_SKIPS_PASSED = dataclasses.replace(FP16_SCALER_PASSED, init_scale=SKIPPING)
FP16_SKIPS_NOT_PASSED = dataclasses.replace(FP16_SCALER_NOT_PASSED, init_scale=SKIPPING)
HEALTHY_MODES = [
    FP32,
    BF16,
    FP16_SKIPS_PASSED,
    FP16_SKIPS_NOT_PASSED,
    ACCUMULATION,
    CHECKPOINTING,
    CLOSURE,
    GRADIENT_PENALTY,
    CREATE_GRAPH,
]


def healthy_cells() -> list:
    return [
        pytest.param(
            m,
            mode,
            id=f"{m}-{mode.name}",
        )
        for m in MODELS
        for mode in HEALTHY_MODES
        if not (mode.checkpointing and m not in CHECKPOINTED)
        and not ((mode.penalty or mode.create_graph) and m not in TWICE_DIFFERENTIABLE)
    ]


@pytest.mark.parametrize("model,mode", healthy_cells())
def test_a_healthy_run_reports_nothing_and_trains_exactly_as_without_nand(model, mode: Mode):
    truth_run, run = assert_healthy(model, mode, steps=6)
    assert run.watch is not None and not run.watch._guard.off  # nand stayed on
    if mode.scaler:  # the scaler's skips are counted, whether or not it was passed
        assert truth_run.truth is not None and truth_run.truth.skipped
        assert run.watch is not None and run.watch.amp_skipped == len(truth_run.truth.skipped)
