"""The light mode's per-layer history: a rotating sample of module outputs
(``detect/sampling.py``) in the flight recorder and the headroom warning."""

from __future__ import annotations

import dataclasses
import itertools
import logging
import math

import torch
from torch import nn

import nand
from nand.agent.detect.probes import Site
from nand.agent.detect.sampling import PERIOD, SAMPLE, per_step
from nand.agent.step.analysis import first_finding

LAYERS = 6  # Linear layers: a step samples some of them (two)


def deep_mlp() -> nn.Sequential:
    parts: list[nn.Module] = [nn.Linear(8, 16)]
    for _ in range(LAYERS - 2):
        parts += [nn.Tanh(), nn.Linear(16, 16)]
    parts += [nn.Tanh(), nn.Linear(16, 4)]
    return nn.Sequential(*parts)


def test_the_light_flight_recorder_samples_each_layer_in_turn_with_its_true_max():
    torch.manual_seed(0)
    model = deep_mlp()
    linears = [name for name, m in model.named_children() if isinstance(m, nn.Linear)]
    truth: dict[tuple[int, str], float] = {}  # (step, layer) -> max|x|, measured without nand
    steps_done = [0]

    def record(name: str):
        def hook(module: nn.Module, args: object, output: torch.Tensor) -> None:
            truth[(steps_done[0], name)] = output.detach().abs().max().item()

        return hook

    for name in linears:
        model.get_submodule(name).register_forward_hook(record(name))
    opt = torch.optim.SGD(model.parameters(), lr=1e-2)
    period = math.ceil(LAYERS / per_step(LAYERS))
    assert 1 < period <= PERIOD
    steps = 3 * period
    with nand.watch(model, opt, mode="light") as watch:
        for step in range(steps):
            model(torch.randn(4, 8)).pow(2).mean().backward()
            opt.step()
            opt.zero_grad()
            steps_done[0] = step + 1
        window = watch.flight_window()
    assert window.steps == list(range(steps))
    column = {name: window.modules.index(name) for name in linears}
    seen_at: dict[str, list[int]] = {name: [] for name in linears}
    for step, row in zip(window.steps, window.act_max_abs, strict=True):
        sampled = [name for name in linears if row[column[name]] is not None]
        assert len(sampled) == per_step(LAYERS)  # a few layers a step, never all of them
        for name in sampled:
            assert row[column[name]] == truth[(step, name)]
            seen_at[name].append(step)
        tanhs = [m for m in window.modules if m and m not in column]
        assert all(row[window.modules.index(m)] is None for m in tanhs)  # not sampled
    for name, at in seen_at.items():
        assert at, f"{name} never sampled"
        assert at[0] < period and all(b - a == period for a, b in itertools.pairwise(at))


class RunAway(nn.Module):
    """Its output climbs toward float32's limit from step 3 on, still finite;
    the Tanh after it keeps everything downstream small."""

    def __init__(self) -> None:
        super().__init__()
        self.linear = nn.Linear(16, 16)
        self.step = 0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = self.linear(x)
        if self.step >= 3:
            return out + (2e38 - out).detach()  # the gradient stays the identity's
        return out


def test_a_layer_near_its_dtype_limit_warns_headroom_in_the_light_mode_too(caplog):
    torch.manual_seed(0)
    runaway = RunAway()
    model = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), runaway, nn.Tanh(), nn.Linear(16, 4))
    opt = torch.optim.SGD(model.parameters(), lr=0.0)
    caplog.set_level(logging.WARNING, logger="nand")
    with nand.watch(model, opt, mode="light") as watch:
        for step in range(8):
            runaway.step = step
            model(torch.randn(4, 8)).pow(2).mean().backward()
            opt.step()
            opt.zero_grad()
    messages = [r.getMessage() for r in caplog.records if r.name == "nand"]
    assert watch.first is None
    headroom = [m for m in messages if "overflow headroom" in m]
    assert len(headroom) == 1
    assert "overflow headroom: 2 (RunAway) reached max |x| 2e+38" in headroom[0]  # the layer
    assert "float32" in headroom[0]


@dataclasses.dataclass
class Read:
    """A window as the analysis reads it (``analysis.Probed``): its sites in
    the order the hooks probed them, ``None`` where a micro-step starts."""

    sites: list[Site | None]
    norm_sites: list[Site] = dataclasses.field(default_factory=list)
    pipeline: None = None


def test_a_sampled_layer_is_never_the_finding_nor_hides_the_root_s_output_after_it():
    # The light mode's window: two layers sampled (the first finite, the
    # second NaN), then the root's output, NaN. A sample is telemetry: the
    # finding is the first non-finite entry that is not one, the root's
    # output (the light mode's replay then finds the op).
    root = Site(phase="forward", module="", module_type="Sequential", index=0)
    early = Site(phase="forward", module="0", module_type="Linear", index=1, kind=SAMPLE)
    late = Site(phase="forward", module="4", module_type="Linear", index=5, kind=SAMPLE)
    nan = math.nan
    finding = first_finding(Read([None, early, late, root]), [-1.0, 2.0, nan, nan, nan, nan])
    assert finding is not None
    assert finding.site is root and finding.phase == "forward"
    assert finding.module == "" and finding.cause == "produced"


def test_a_finding_s_order_counts_the_entries_of_its_phase_before_it_in_its_micro_step():
    # Event.order: the position in execution order among the micro-step's
    # probed entries of that phase (a light-mode sample is not one).
    # Two forward entries come before the NaN, one in the micro-step before.
    names = ["0", "2", "4"]
    sites = [
        Site(phase="forward", module=n, module_type="Linear", index=i) for i, n in enumerate(names)
    ]
    window = [None, sites[0], None, sites[0], sites[1], sites[2]]
    nan = math.nan
    values = [0.0, 1.0, 0.0, 1.0, -1.0, 1.0, nan, nan]
    finding = first_finding(Read(window), values)
    assert finding is not None
    assert (finding.module, finding.micro, finding.order) == ("4", 1, 2)
