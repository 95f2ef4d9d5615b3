"""The closed sets of names that kinds, phases and choices take across autopar's layers.

They are ``Literal`` types, not enums: a plan's JSON stores them as these very strings, and the
code compares them as strings, so a type checker catches a misspelt value while the data, the
JSON format and the public API stay plain strings. Code that must check a string it was given
reads the values from the one definition with :func:`typing.get_args`.
"""

from typing import Literal

CollectiveKind = Literal["all_reduce", "all_gather", "reduce_scatter", "all_to_all"]
"""A collective the per-rank program runs: :attr:`autopar.core.plan.Collective.kind`, the kinds a
link measures apart (:attr:`autopar.core.mesh.Link.per_kind`), and the collective steps of a
transition (:class:`autopar.core.move.Step`)."""

Phase = Literal["forward", "backward"]
"""Where a node of the joint graph runs: in the backward when it depends on the outputs'
tangents, else in the forward (:attr:`autopar.core.strategy.NodeSpace.phase`,
:attr:`autopar.core.plan.NodePlan.phase`)."""

CollectivePhase = Literal[Phase, "recompute", "output"]
"""When a collective runs (:attr:`autopar.core.plan.Collective.phase`): in the forward, in the
backward, again in the backward for a recomputed op, or making a result whole for the caller."""

Activation = Literal["", "keep", "recompute", "offload"]
"""How the step holds a forward op's outputs for the backward
(:attr:`autopar.core.plan.NodePlan.activation`): kept on the device, recomputed, or offloaded to
host memory; ``""`` for an op whose outputs the backward does not need."""

GraphInputKind = Literal["param", "buffer", "input", "tangent", "recv", "recv_grad", "given"]
"""What a placeholder of the joint graph stands for
(:attr:`autopar.passes.analysis.capture.InputKind.kind`): a parameter, a buffer, a forward
argument, or the tangent of a forward output; in a pipeline stage's graph
(:mod:`autopar.passes.analysis.stages`) also an activation or a gradient another stage sends, or
a value the runtime gives (the batch's loss divisor)."""

GraphOutputKind = Literal["output", "grad", "buffer", "send", "send_grad"]
"""What an output of the joint graph stands for
(:attr:`autopar.passes.analysis.capture.OutputKind.kind`): a forward result, a parameter's
gradient, or the new value of a buffer the forward updates in place; in a pipeline stage's graph
also an activation or a gradient it sends to another stage."""

NodeKind = Literal["op", GraphInputKind, "constant", "output"]
"""What a node of the strategy space is (:attr:`autopar.core.strategy.NodeSpace.kind`): an op,
a placeholder (by its :data:`GraphInputKind`), a tensor literal of the model's code, or the
graph's results."""

SolverStatus = Literal["OPTIMAL", "FEASIBLE", "START", "LAYOUT"]
"""How a solve ended (:attr:`autopar.core.plan.SolverInfo.status`): proven optimal, the best
found in the time limit, the start kept when the search found nothing in time, or a standard
layout returned instead."""
