"""The sentences a person reads: what went non-finite where, and who got it how.

>>> from nand.events import Event, value_kinds
>>> firsts = [Event(rank=1, step=5, phase="forward", module="fc", module_type="Linear", nan=1,
...                 host="node-2"),
...           Event(rank=0, step=5, phase="grad", module="fc.weight", nan=2)]
>>> print(diverged_summary(firsts, 2, "produced_in_layer", devices={1: "cuda:1"}))
rank 1 produced NaN in fc (Linear) during forward at step 5; rank 0 received it
through the gradient all-reduce. Only rank 1 (host node-2) produced it: suspect its batch
or its GPU. Hint: the layer made NaN from finite inputs.

Each sentence says only what the evidence supports: a faulty GPU is suspected
only for a value one rank made alone in forward on a CUDA device (not on a CPU
run, not for a backward bug, which repeats on any device), and the value kind
(NaN, +inf, -inf) is named wherever the value is.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

from nand.events import (
    VIA_GRAD_ALL_REDUCE,
    VIA_TP_ALL_REDUCE,
    VIA_TP_GRAD_ALL_REDUCE,
    Event,
    replay_words,
    value_kinds,
)
from nand.server.analysis.correlate import origin, relations
from nand.server.analysis.evidence import FlightEvidence
from nand.server.analysis.failures import Failure
from nand.server.analysis.losses import rank_ranges


def _ranks(ranks: Sequence[int]) -> str:
    ordered = sorted(ranks)
    return f"rank {ordered[0]}" if len(ordered) == 1 else "ranks " + ", ".join(map(str, ordered))


def _where(event: Event) -> str:
    name = event.module or "<root>"
    where = f"{name} ({event.module_type})" if event.module_type else name
    step = f"step {event.step}" + (f" (micro-step {event.micro_step})" if event.micro_step else "")
    return {
        "input": f"in its input data at {step}",
        "loss": f"in the loss gradient at {step}",
        "forward": f"in {where} during forward at {step}",
        "backward": f"in {where} during backward at {step}",
        "grad": f"in the gradient of {where} at {step}",
        "param": f"in parameter {where} after the optimizer step at {step}",
        "optimizer_state": f"in optimizer state {where} at {step}",
    }.get(event.phase, f"in {where} during {event.phase} at {step}")


_HINT_TEXT = {
    "input_data": "the input batch already held {kinds}: check the data pipeline of that rank",
    "loss": "the loss made {kinds} while the model's outputs were finite",
    "optimizer_update": (
        "the optimizer step turned finite gradients into {kinds} in the parameters: "
        "check the learning rate and the optimizer state"
    ),
    "param_written": (
        "the gradients were finite and the rest of the parameter stayed small{largest}, so "
        "no update made {kinds} there: something else wrote it (code that edits the weights, "
        "a checkpoint load) or the memory holding it is faulty"
    ),
}
_PRODUCED_TEXT = {
    "forward": "the layer made {kinds} from finite inputs",
    "backward": (
        "the layer's backward made {kinds} from a finite incoming gradient (the gradient "
        "arriving at its output): look at its backward, e.g. a custom autograd Function or "
        "log/sqrt/division at 0"
    ),
    "grad": "the gradient of this parameter became {kinds} in backward",
}


def _hint_sentence(hint_name: str, evidence: FlightEvidence | None, head: Event) -> str:
    if hint_name in ("overflow", "gradient_explosion"):
        label = "overflow" if hint_name == "overflow" else "gradient explosion"
        detail = evidence.text if evidence is not None else ""
        return f"Hint: {label}" + (f": {detail}." if detail else ".")
    if hint_name == "produced_in_layer":
        text = _PRODUCED_TEXT.get(head.phase, "")
    else:
        text = _HINT_TEXT.get(hint_name, "")
    largest = f" (largest finite |x| {head.max_abs:.3g})" if head.max_abs is not None else ""
    return f"Hint: {text.format(kinds=value_kinds(head), largest=largest)}." if text else ""


def _lone_producer(head: Event, hint_name: str, device: str, same_batch: bool) -> str:
    """The sentence for the one rank that made it alone, naming its host, with the
    suspicion the evidence supports (a GPU only in forward, on a CUDA device;
    its batch only where the others did not run the same one: ``same_batch``,
    the tensor-parallel peers that received it)."""
    host = f" (host {head.host})" if head.host else ""
    who = f"Only rank {head.rank}{host}"
    on_gpu = device.startswith("cuda")
    if hint_name == "input_data":
        return f"{who} got it."
    if hint_name == "param_written":
        return f"{who} produced it: suspect code that writes its weights" + (
            " or its GPU's memory." if on_gpu else "."
        )
    if head.phase == "forward" and hint_name == "produced_in_layer":
        if same_batch:  # (its peers ran the same batch through their shards)
            return f"{who} produced it from the batch its tensor-parallel peers ran too: " + (
                "suspect its shard of the weights or its GPU."
                if on_gpu
                else "suspect its shard of the weights."
            )
        return f"{who} produced it: suspect its batch" + (" or its GPU." if on_gpu else ".")
    return f"{who} produced it."


def _channel(phase: str, via: str) -> str:
    """The collective a rank received the value through: the one its agent
    named, else the one its first event's phase implies (DDP's gradient
    all-reduce for a gradient; for a later forward, a collective nand cannot
    name: an FSDP agent names its all-gather)."""
    if via:
        return via
    if phase == "grad":
        return VIA_GRAD_ALL_REDUCE
    if phase == "forward":
        return "a collective of the next step's forward"
    return "a collective"


#: The ranks of each (relation to the origin, phase of the rank's first event, the
#: collective its agent named), each list in rank order: how a big run's verdict
#: keeps them (``spread.py``).
Groups = Mapping[tuple[str, str, str], Sequence[int]]


def diverged_summary(
    firsts: Sequence[Event],
    world_size: int,
    hint_name: str,
    evidence: FlightEvidence | None = None,
    devices: Mapping[int, str] | None = None,
) -> str:
    """The sentence for a run that went non-finite; ``devices``: each rank's device."""
    head = origin(firsts)
    if head is None:
        return ""
    rel = relations(firsts)
    groups: dict[tuple[str, str, str], list[int]] = {}
    for event in sorted(firsts, key=lambda e: e.rank):
        groups.setdefault((rel[event.rank], event.phase, event.via), []).append(event.rank)
    device = (devices or {}).get(head.rank, "")
    return diverged_sentence(head, groups, world_size, hint_name, evidence, device)


def diverged_sentence(
    head: Event,
    groups: Groups,
    world_size: int,
    hint_name: str,
    evidence: FlightEvidence | None = None,
    device: str = "",
) -> str:
    """:func:`diverged_summary` from the origin and the diverged ranks grouped by
    relation, phase and the collective each named, as a big run's verdict keeps them
    without loading the events."""
    together = [r for (k, *_), ranks in groups.items() if k in _FIRST for r in ranks]
    world = max(world_size, sum(len(ranks) for ranks in groups.values()))
    parts = [_opening(head, together, world)]
    parts.extend(_followers(groups, world, len(together)))
    sentence = "; ".join(parts) + "."
    if len(together) == 1 and world > 1 and head.phase != "loss":
        same_batch = any(via in _TENSOR_PARALLEL for (_, _, via) in groups)
        sentence += " " + _lone_producer(head, hint_name, device, same_batch)
    extras = (_replay_sentence(head), _hint_sentence(hint_name, evidence, head))
    extra = " ".join(s for s in extras if s)
    return f"{sentence} {extra}" if extra else sentence


_FIRST = ("origin", "simultaneous")
#: The collectives of ranks that ran the same batch as the origin.
_TENSOR_PARALLEL = (VIA_TP_ALL_REDUCE, VIA_TP_GRAD_ALL_REDUCE)


def _replay_sentence(head: Event) -> str:
    """What the origin rank's replay of the step found ("" without one)."""
    words = replay_words(head)
    return f"Rank {head.rank}'s replay of the step: {words}." if words else ""


def _opening(head: Event, together: list[int], world: int) -> str:
    what = f"{value_kinds(head)} {_where(head)}"
    if len(together) > 1:
        who = f"all {world} ranks" if len(together) >= world else _ranks(together)
        return (
            f"{who} went non-finite at the same point, {what}: a numerical problem of the "
            "model or its hyper-parameters, not one faulty GPU"
        )
    verb = "got" if head.phase == "input" or head.cause == "data" else "produced"
    return f"rank {head.rank} {verb} {what}"


def _followers(groups: Groups, world: int, n_together: int) -> list[str]:
    """Who received it through which collective (the channels in the order of their
    lowest rank), then who went non-finite later on their own."""
    by_channel: dict[str, list[int]] = {}
    for (relation, phase, via), ranks in groups.items():
        if relation == "received" and ranks:
            by_channel.setdefault(_channel(phase, via), []).extend(ranks)
    parts = []
    for channel, ranks in sorted(by_channel.items(), key=lambda item: min(item[1])):
        others = world - n_together
        who = f"the other {others} ranks" if len(ranks) == others and others > 1 else _ranks(ranks)
        parts.append(f"{who} received it through {channel}")
    later = [r for (relation, *_), ranks in groups.items() if relation == "produced" for r in ranks]
    if later:
        parts.append(f"{_ranks(later)} went non-finite later on their own")
    return parts


def calm_summary(state: str, steps: Sequence[int]) -> str:
    """The sentence for a run with no failure (see :func:`failures_summary`)."""
    latest = max(steps, default=0)
    n = len(steps)
    if state == "finished":
        plural = "s" if n != 1 else ""
        return f"Finished at step {latest} on {n} rank{plural}; no non-finite value seen."
    return (
        f"{n} rank{'s' if n != 1 else ''} running, latest step {latest}; no non-finite value seen."
    )


def failures_summary(
    found: Sequence[Failure], nonfinite: str, lost_s: float, stall_s: float
) -> str:
    """The sentence for a run that failed: the first failure in time, then the
    later ones as its consequences (``found`` in that order, see
    :mod:`nand.server.analysis.failures`); ``nonfinite``: the non-finite origin's
    sentence (:func:`diverged_summary`) when the run went non-finite.

    >>> killed = Failure("lost", (1,), 100.0, 5)
    >>> raised = Failure("crashed", (0,), 104.2, 5, "RuntimeError")
    >>> print(failures_summary([killed, raised], "", 60, 300))
    rank 1 lost: no message for more than 60 s (last heard at step 5). Then, as a consequence:
    rank 0 crashed 4.2 s later (left with an exception: RuntimeError, at step 5). No
    non-finite value seen.
    """
    if not found:
        return ""
    head, later = found[0], found[1:]
    if head.state == "diverged":
        opening = nonfinite.removesuffix(".")
    else:
        opening = _failure_opening(head, lost_s, stall_s)
    text = opening + "."
    if later:
        what = "a consequence" if len(later) == 1 else "consequences"
        clauses = "; ".join(_consequence(f, f.at - head.at) for f in later)
        text += f" Then, as {what}: {clauses}."
    if head.state != "diverged":
        text += f" The non-finite value: {nonfinite}" if nonfinite else " No non-finite value seen."
    return text


def _who(ranks: Sequence[int]) -> str:
    ordered = sorted(ranks)
    return f"rank {ordered[0]}" if len(ordered) == 1 else f"ranks {rank_ranges(ordered)}"


def _failure_opening(failure: Failure, lost_s: float, stall_s: float) -> str:
    who, step = _who(failure.ranks), f"(at step {failure.step})"
    if failure.state == "lost":
        heard = f"(last heard at step {failure.step})"
        return f"{who} lost: no message for more than {lost_s:g} s {heard}"
    if failure.state == "stalled":
        return f"{who} stalled: heartbeats but no step progress for more than {stall_s:g} s {step}"
    exception = f" ({failure.detail})" if failure.detail else ""
    return f"{who} crashed: left with an exception{exception}, not a normal exit {step}"


def _consequence(failure: Failure, after_s: float) -> str:
    who, when, step = _who(failure.ranks), _later(after_s), f"at step {failure.step}"
    if failure.state == "crashed":
        exception = f": {failure.detail}" if failure.detail else ""
        return f"{who} crashed {when} (left with an exception{exception}, {step})"
    if failure.state == "lost":
        return f"{who} went silent (lost) {when} (last heard at step {failure.step})"
    verb = "stalled" if failure.state == "stalled" else "went non-finite"
    return f"{who} {verb} {when} ({step})"


def _later(seconds: float) -> str:
    """How long after the first failure; failures within a heartbeat count as one time."""
    if seconds < 0.05:
        return "at about the same time"
    if seconds < 60:
        return f"{seconds:.1f} s later"
    if seconds < 3600:
        return f"{seconds / 60:.1f} min later"
    return f"{seconds / 3600:.1f} h later"
