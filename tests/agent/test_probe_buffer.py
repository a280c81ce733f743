"""The probe buffer's slab: results written in place, read in one slice, and
everything it cannot take stacked in execution order instead."""

from __future__ import annotations

import math

import pytest
import torch
from torch import nn

import nand
from nand.agent.detect.probes import SLAB_START, ProbeBuffer, Site


def site(name: str) -> Site:
    return Site("forward", name, "Linear")


def read(buf: ProbeBuffer) -> list[float]:
    gathered = buf.gather()
    assert gathered is not None
    return gathered.tolist()


def test_float32_probes_and_norms_are_read_from_the_slab_in_order():
    buf = ProbeBuffer()
    buf.probe(torch.tensor([1.0, -2.0, 3.0]), site("a"))
    buf.probe(torch.tensor([float("nan"), 0.0]), site("b"))
    buf.add_norms([torch.tensor([3.0, 4.0])], [site("n")])
    assert not buf.spilled and all(p._base is buf.slab for p in buf.pairs)
    gathered = buf.gather()
    assert gathered is not None and gathered._base is buf.slab  # a slice, not a stack
    values = gathered.tolist()
    assert values[:2] == [-2.0, 3.0] and all(math.isnan(v) for v in values[2:4])
    assert values[4] == 5.0


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float64])
def test_other_dtypes_spill_and_are_stacked_in_execution_order(dtype):
    buf = ProbeBuffer()
    buf.probe(torch.tensor([1.0, 2.0]), site("a"))  # slab
    buf.probe(torch.tensor([-4.0, 8.0], dtype=dtype), site("b"))  # its own results
    buf.probe(torch.tensor([0.5, float("inf")]), site("c"))  # slab again, after b's
    buf.add_norms([torch.tensor([3.0, 4.0], dtype=dtype)], [site("n")])
    assert buf.spilled
    assert read(buf) == [1.0, 2.0, -4.0, 8.0, 0.5, math.inf, 5.0]
    buf.clear()
    assert not buf.spilled  # the next window starts on the slab again


def test_a_window_larger_than_the_slab_spills_once_and_the_slab_grows():
    buf = ProbeBuffer()
    probes = SLAB_START  # twice as many values as the slab holds
    for i in range(probes):
        buf.probe(torch.tensor([float(-i), float(i)]), site(str(i)))
    assert buf.spilled
    assert read(buf) == [v for i in range(probes) for v in (float(-i), float(i))]
    buf.clear()
    for i in range(probes):
        buf.probe(torch.tensor([float(-i), float(i)]), site(str(i)))
    assert not buf.spilled and len(buf.slots) >= 2 * probes
    assert read(buf) == [v for i in range(probes) for v in (float(-i), float(i))]


def test_float64_norms_are_not_rounded_into_the_slab():
    buf = ProbeBuffer()
    buf.probe(torch.tensor([1.0]), site("a"))
    big = torch.tensor([1e300], dtype=torch.float64)  # a float32 slab would make it inf
    buf.add_norms([big], [site("n")])
    assert read(buf) == [1.0, 1.0, 1e300]


def test_a_bfloat16_model_is_checked_through_the_stacked_path():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 8), nn.ReLU(), nn.Linear(8, 4)).to(torch.bfloat16)
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    with nand.watch(model, opt) as w:
        for step in range(3):
            x = torch.randn(4, 8, dtype=torch.bfloat16)
            if step == 2:
                with torch.no_grad():
                    model[2].bias[1] = float("nan")  # written by user code
            model(x).float().sum().backward()
            assert w._buf.spilled
            opt.step()
            opt.zero_grad()
    # Written between steps 1 and 2: labelled with step 1, like the optimizer's writes.
    assert w.first is not None and (w.first.step, w.first.phase) == (1, "param")
    assert w.first.module == "2.bias"
