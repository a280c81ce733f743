"""How a tensor-parallel layer's finding is settled from this rank's own part
of the reduction (``nand.agent.detect.tensor_parallel``), for NaN, +inf,
-inf and finite parts. The hooks that take the parts run in real gloo jobs:
``tests/e2e/test_tensor_parallel.py``."""

from __future__ import annotations

import math

import pytest
import torch

from nand.agent.detect.probes import Site
from nand.agent.detect.tensor_parallel import Partial, received_through_tp
from nand.agent.step.finding import Finding
from nand.events import VIA_TP_ALL_REDUCE, VIA_TP_GRAD_ALL_REDUCE


def _finding(phase: str = "forward", module: str = "mlp.fc2", cause: str = "produced") -> Finding:
    site = Site(phase=phase, module=module, module_type="Linear")  # type: ignore[arg-type]
    return Finding(
        site=site,
        phase=phase,
        module=module,
        module_type="Linear",
        micro=1,
        order=3,
        lo=-math.inf,
        hi=math.inf,
        cause=cause,  # type: ignore[arg-type]
    )


def _part(value: float, module: str = "mlp.fc2", phase: str = "forward", micro: int = 1) -> Partial:
    t = torch.tensor([0.5, value])
    return Partial(module, phase, micro, tuple(torch.aminmax(t)))


@pytest.mark.parametrize("own", [math.nan, math.inf, -math.inf])
def test_a_layer_whose_own_part_was_non_finite_made_it_here(own):
    finding = _finding()
    received_through_tp(finding, [_part(1.0, micro=0), _part(own)])
    assert (finding.cause, finding.via) == ("produced", "")


@pytest.mark.parametrize(
    ("phase", "via"), [("forward", VIA_TP_ALL_REDUCE), ("backward", VIA_TP_GRAD_ALL_REDUCE)]
)
def test_a_layer_whose_own_parts_were_finite_received_it_through_the_reduction(phase, via):
    finding = _finding(phase)
    received_through_tp(finding, [_part(2.0, phase=phase), _part(-3.0, phase=phase)])
    assert (finding.cause, finding.via) == ("received", via)
    assert "own partial result was finite" in finding.note


def test_a_part_of_another_layer_phase_or_micro_step_settles_nothing():
    for other in (_part(1.0, module="mlp.fc1"), _part(1.0, phase="backward"), _part(1.0, micro=0)):
        finding = _finding()
        received_through_tp(finding, [other])
        assert (finding.cause, finding.via) == ("produced", "")


def test_data_and_parameter_findings_are_left_as_they_are():
    data = _finding(cause="data")
    param = _finding(phase="param", module="mlp.fc2.weight")
    for finding in (data, param):
        received_through_tp(finding, [_part(1.0, module=finding.module, phase=finding.phase)])
    assert (data.cause, param.cause) == ("data", "produced")
