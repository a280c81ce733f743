"""Which micro-step each probe entry belongs to, and what a pipeline stage received.

:func:`entries` labels the window's activation and gradient entries with
their micro-step: a root call starts one (a :data:`~nand.agent.detect.probes.MICRO`
mark), unless the stage of a pipeline said which micro-batch its entries
are (``detect/pipeline.py``): then the stage's index holds, in forward and
in backward alike, whatever order its schedule ran them in.

:func:`handed_over` turns a pipeline stage's finding into what it is when
the value came from a neighbouring stage: a non-finite input of a stage
other than the first is the activation the previous stage sent, a non-finite
gradient arriving at the output of a stage other than the last is the one
the next stage sent back. Both are ``received``, through the pipeline's
send/recv, in the forward and the backward phase respectively (not ``data``,
not the ``loss``).
"""

from __future__ import annotations

import dataclasses

from nand.agent.detect.probes import Site
from nand.agent.detect.stage import Handoff
from nand.agent.step.finding import Finding, Probed
from nand.events import VIA_PIPELINE, Phase

Entry = tuple[int, Site, float, float, int]
#: A stage's orders within a phase, at most (see :func:`across_stages`).
STAGE_SPAN = 1_000_000


def entries(buf: Probed, values: list[float], micro_base: int) -> list[Entry]:
    """(micro, site, lo, hi, call) for every activation/gradient entry."""
    out = []
    micro, i = micro_base - 1, 0
    calls: dict[int, int] = {}
    marks = iter(buf.pipeline.marks if buf.pipeline is not None else ())
    mark, label = next(marks, None), None
    for position, site in enumerate(buf.sites):
        while mark is not None and mark[0] <= position:  # a stage's chunk starts here
            label, calls = mark[1], {}
            mark = next(marks, None)
        if site is None:
            micro, calls = micro + 1, {}
            continue
        call = calls.get(id(site), 0)
        calls[id(site)] = call + 1
        at = max(micro, micro_base) if label is None else label
        out.append((at, site, values[i], values[i + 1], call))
        i += 2
    return out


def handed_over(finding: Finding, pipeline: Handoff | None) -> Finding:
    """``finding``, as received from a neighbouring stage where it was (see
    the module), its ``order`` counted across the stages (:func:`across_stages`)."""
    if pipeline is None:
        return finding
    phase: Phase
    if finding.phase == "input" and not pipeline.first:
        sender, what = pipeline.stage - 1, "the activation"
        phase = "forward"
    elif finding.phase == "loss" and not pipeline.last:
        sender, what = pipeline.stage + 1, "the output gradient"
        phase = "backward"
    else:
        finding.order = across_stages(finding.phase, finding.order, pipeline)
        return finding
    via = VIA_PIPELINE.format(sender)
    note = f"{what} stage {sender} sent to this stage was non-finite: received through {via}"
    order = across_stages(phase, finding.order, pipeline)
    return dataclasses.replace(
        finding,
        phase=phase,
        module="",
        cause="received",
        via=via,
        order=order,
        note=f"{finding.note}; {note}" if finding.note else note,
    )


def across_stages(phase: Phase, order: int, pipeline: Handoff) -> int:
    """A micro-batch passes the stages in turn, forward from the first to the
    last and backward the other way: ``order`` (the execution index within
    the phase) counted across them, so that the ranks' logical order (the
    server's) puts a stage's own finding before what the next stage got from
    it in the same phase (several stages per rank, interleaved)."""
    if phase in ("input", "forward"):
        return pipeline.stage * STAGE_SPAN + order
    if phase in ("loss", "backward"):
        return (pipeline.stages - 1 - pipeline.stage) * STAGE_SPAN + order
    return order  # (a stage's own parameters: nothing passes between stages)
