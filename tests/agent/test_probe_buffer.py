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
    return Site(phase="forward", module=name, module_type="Linear")


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
def test_other_dtypes_go_to_slabs_of_their_own_and_are_read_in_execution_order(dtype):
    buf = ProbeBuffer()
    buf.probe(torch.tensor([1.0, 2.0]), site("a"))  # float32 slab
    buf.probe(torch.tensor([-4.0, 8.0], dtype=dtype), site("b"))  # its dtype's slab
    buf.probe(torch.tensor([0.5, float("inf")]), site("c"))  # float32 slab, after b's
    buf.add_norms([torch.tensor([3.0, 4.0], dtype=dtype)], [site("n")])
    assert not buf.spilled and buf.pairs[2]._base is buf.others.slabs[dtype][0]
    gathered = buf.gather()
    assert gathered is not None
    wide = torch.float64 if dtype is torch.float64 else torch.float32
    assert gathered.dtype is wide and gathered.tolist() == [1.0, 2.0, -4.0, 8.0, 0.5, math.inf, 5.0]
    buf.clear()
    # The next window has another layout: nothing of the last one's is read.
    buf.probe(torch.tensor([-4.0, 8.0], dtype=dtype), site("b"))
    buf.probe(torch.tensor([7.0]), site("a"))
    assert read(buf) == [-4.0, 8.0, 7.0, 7.0]


def test_a_window_of_many_dtypes_with_a_nan_in_each_reads_every_nan_where_it_was():
    buf = ProbeBuffer()
    for i, dtype in enumerate([torch.bfloat16, torch.float32, torch.float16, torch.float64] * 2):
        value = float("nan") if i % 3 == 0 else float(i)
        buf.probe(torch.tensor([value, -1.0], dtype=dtype), site(str(i)))
    values = read(buf)
    for i in range(8):
        lo, hi = values[2 * i : 2 * i + 2]
        if i % 3 == 0:
            assert math.isnan(lo) and math.isnan(hi)
        else:
            assert (lo, hi) == (-1.0, float(i))


def test_the_extras_ride_after_the_slabs_without_a_stack_of_the_probes():
    buf = ProbeBuffer()
    buf.probe(torch.tensor([1.0, 2.0], dtype=torch.bfloat16), site("a"))
    buf.extras.append(torch.tensor(65536.0))  # a GradScaler's scale
    assert not buf.spilled and read(buf) == [1.0, 2.0, 65536.0]


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


def test_a_bfloat16_model_is_checked_from_its_own_slab():
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
            assert not w._buf.spilled
            opt.step()
            opt.zero_grad()
    # Written between steps 1 and 2: labelled with step 1, like the optimizer's writes.
    assert w.first is not None and (w.first.step, w.first.phase) == (1, "param")
    assert w.first.module == "2.bias"
