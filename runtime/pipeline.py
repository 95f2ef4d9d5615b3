"""Running a plan with pipeline stages: one position's stages' programs, micro-batch by micro-batch.

Each rank lowers the graph of each stage its position on the pipeline axis runs (one, or
several under the interleaved schedule; :func:`~autopar.passes.analysis.stages.stage_graph`)
with the plan, for its position on the mesh inside the stages, into a forward and a backward
program, as a plan without stages is lowered. A step runs the schedule's order of forwards and
backwards (:func:`~autopar.core.pipeline.order`); before each, the rank receives what the stages
before (forward) or after (backward) sent for that micro-batch, and after it sends on what it
made for them, point to point to the rank at its own position inside the other stage's
(``isend`` / ``irecv``, which gloo and NCCL both run; torch.distributed.pipelining's stages run
whole modules through autograd, where the planned programs here are forward and backward graphs
of their own). Each message's tag names its micro-batch, its two stages and its direction, so
that the stages of one position never take each other's.

The step's loss is the batch's, made of the micro-batches' parts: a mean cross-entropy's sum over
each micro-batch divides by the batch's count of targets (computed from the inputs,
:func:`~autopar.passes.analysis.stages.loss_divisor`, and given to the programs in place of the
micro-batch's own count), and the parts are added; a plain mean is the mean of the
micro-batches'. Each backward starts from its part's gradient (1, or one over the
micro-batches), so the gradients add up to the batch's. Within the micro-batches but the last,
each backward keeps its gradients as made and sums them; the last one's adds the sums before its
collectives, which then run once per step (the ``"unreduced"`` and ``"accumulated"`` programs of gradient accumulation).
Under ``no_sync`` every micro-batch keeps its gradients so, and the last one of the next call
outside adds the sums of all.
"""

from collections.abc import Sequence
from dataclasses import dataclass

import torch
import torch.distributed as dist
from autopar.passes.analysis.capture import Captured, InputKind
from autopar.passes.analysis.stages import Staged, check_stageable, stage_graph
from autopar.passes.propagation.redistribute import local_shape
from autopar.passes.propagation.samples import check_samples_apart
from autopar.runtime.program import Lowered, Unsynced, lower, named_timeouts

from autopar.core.errors import InputError
from autopar.core.pipeline import Send, order
from autopar.core.plan import ShardingPlan
from autopar.core.strategy import getitem_aliases


@dataclass(frozen=True)
class PositionInputs:
    """The inputs of the graphs of one position's stages, each once, in the order of the stages:
    the parameters and buffers its ranks hold and the model inputs they read."""

    inputs: tuple[InputKind, ...]


class _Stage:
    """One stage's programs on this rank, and the stages it receives from and sends to."""

    def __init__(
        self, captured: Captured, plan: ShardingPlan, staged: Staged, stage: int, aliases, lowering, given, unsynced
    ):
        self.stage = stage
        self.captured = stage_graph(captured, staged, stage, aliases, given)
        self.unsynced = unsynced
        """The sums of the gradients made before their collectives, over micro-batches and over
        calls under ``no_sync`` (shared by the stage's programs for every input size)."""
        self._lowering = lowering
        self.forms = ("reduced",) if plan.stages.microbatches == 1 else ("unreduced", "accumulated")
        self.lowered: dict[str, Lowered] = {form: lowering(self.captured, form, self.unsynced) for form in self.forms}
        kinds = self.captured.inputs
        self.state = [k.name for k in kinds if k.kind in ("param", "buffer")]
        self.inputs = [k.name for k in kinds if k.kind == "input"]
        self.given = [k.name for k in kinds if k.kind == "given"]
        self.forward_kinds = [k for k in self.captured.outputs if not k.in_backward]
        self.backward_kinds = [k for k in self.captured.outputs if k.in_backward]
        self.received = [(k, n) for k, n in zip(kinds, self.captured.placeholders) if k.kind in ("recv", "recv_grad")]
        self.sources = {c.value: c.src for c in staged.crossings if c.dst == stage}
        self.targets: dict[str, list[int]] = {}
        for c in staged.crossings:
            if c.src == stage:
                self.targets.setdefault(c.value, []).append(c.dst)

    def form(self, m: int, microbatches: int, sync: bool, continuing: bool) -> str:
        """Micro-batch ``m``'s program: each keeps its gradients as made (``"unreduced"``) but
        the last of a call that synchronises, which adds the sums (``"accumulated"``), or has
        none to add (``"reduced"``, one micro-batch and no calls under ``no_sync`` before)."""
        if not sync or m < microbatches - 1:
            form = "unreduced"
        else:
            form = "accumulated" if microbatches > 1 or continuing else "reduced"
        if form not in self.lowered:  # one micro-batch per call, accumulated under no_sync
            self.lowered[form] = self._lowering(self.captured, form, self.unsynced)
        return form


class StageRunner:
    """The stages of one rank's position on the pipeline axis: their programs and the peers
    they send to (``peers[p]``: the rank at position ``p``, at this rank's place inside)."""

    def __init__(
        self,
        captured: Captured,
        plan: ShardingPlan,
        staged: Staged,
        position: int,
        coordinate: tuple[int, ...],
        groups: list[str],
        peers: Sequence[int],
        backend: str,
        timeout_s: float | None,
        device: torch.device,
        unsynced: dict[int, Unsynced],
    ):
        self.plan, self.stages = plan, plan.stages
        """The plan its programs run: the module's, or one of other ops in the same stages."""
        self.device = device
        self.position, self.peers, self.timeout_s = position, list(peers), timeout_s
        self.graph_hash = captured.graph_hash
        """The fingerprint of the graph of one micro-batch whose stages these are."""
        self.divisor = check_stageable(captured)
        given = frozenset({self.divisor[1]} if self.divisor else ())
        check_samples_apart(captured, self.stages.microbatches, self.divisor)
        nodes = {n.name: n for n in captured.graph.graph.nodes}
        self.divisor_dtype = nodes[self.divisor[1]].meta["val"].dtype if self.divisor else None

        def lowering(part: Captured, form: str, unsynced: Unsynced) -> Lowered:
            return lower(part, plan, plan.mesh, coordinate, groups, backend, timeout_s, form, unsynced)

        mine = list(self.stages.on_position(position))
        aliases = getitem_aliases(captured.graph.graph)
        self.chunks = {
            s: _Stage(captured, plan, staged, s, aliases, lowering, given, unsynced.setdefault(s, Unsynced()))
            for s in mine
        }
        self.output_position = self.stages.position_of(staged.output_stage)
        self.makes_loss = staged.output_stage in self.chunks
        self.loss_dtype = next(
            v.meta["val"].dtype
            for v, k in zip(captured.graph.graph.output_node().args[0], captured.outputs)
            if k is not None and k.kind == "output"
        )
        self.coordinate, self.mesh = coordinate, plan.mesh
        seen: dict[str, InputKind] = {}
        for chunk in self.chunks.values():
            for k in chunk.captured.inputs:
                if k.kind in ("param", "buffer", "input"):
                    seen.setdefault(k.name, k)
        self.captured = PositionInputs(tuple(seen.values()))
        self.layouts = {
            name: p for chunk in self.chunks.values() for name, p in chunk.lowered[chunk.forms[0]].layouts.items()
        }
        self.collectives = [c for chunk in self.chunks.values() for c in chunk.lowered[chunk.forms[-1]].collectives]
        """The collectives of the last micro-batch's programs: their own and the step's gradient buckets."""
        self._tie(captured, staged)

    def _tie(self, captured: Captured, staged: Staged) -> None:
        """Which weights tied across stages this position holds a copy of, and which gradients of
        them it sends to or receives from the other positions once per step."""
        where = self.stages.position_of
        holder = {
            k.name: where(staged.stage_of[n.name])
            for n, k in zip(captured.placeholders, captured.inputs)
            if k.name in staged.shared
        }
        here = {name for name, readers in staged.shared.items() if any(s in self.chunks for s in readers)}
        self.copies = {name for name in here if holder[name] != self.position}
        """Tensors tied across stages whose copy another position counts (and makes the gradient of)."""
        graded = captured.graded
        self.tied = sorted(name for name in staged.shared if name in graded)
        """Every stage's weights tied across stages whose gradients are sent, in one order on every rank."""
        self.tied_in = {name: holder[name] for name in self.copies if name in graded}
        """Weights tied across stages whose gradient another position makes: it sends it once per step."""
        self.tied_out = {
            name: sorted({where(s) for s in readers} - {self.position})
            for name, readers in staged.shared.items()
            if holder[name] == self.position and name in graded
        }
        """Weights tied across stages whose gradient this position makes, and the positions it sends it to."""

    def batch_divisor(self, microbatches: list[tuple[torch.Tensor, ...]]) -> torch.Tensor | None:
        """The divisor of the batch's loss (:func:`~autopar.passes.analysis.stages.loss_divisor`),
        from every micro-batch's whole inputs; ``None`` for a mean over a fixed number of values."""
        if self.divisor is None:
            return None
        total = sum(self.divisor[0](*inputs).to(torch.float64) for inputs in microbatches)
        return total.to(self.divisor_dtype)

    def step(
        self,
        state: dict[str, torch.Tensor],
        microbatches: list[dict[str, torch.Tensor]],
        divisor,
        backward: bool,
        sync: bool = True,
        continuing: bool = False,
    ) -> tuple[torch.Tensor | None, dict[str, torch.Tensor]]:
        """Run the schedule (forwards only without ``backward``) on ``microbatches`` (each one's
        local inputs by name) whose batch's loss divides by ``divisor`` (:meth:`batch_divisor`),
        with the local pieces of ``state`` by name: the batch's loss at the position making it,
        and each parameter's gradient by name. Without ``sync`` (under ``no_sync``) every
        gradient is kept as made and added to the sums, and none is returned; ``continuing``
        says the sums hold earlier such calls' (else they are dropped: a step that failed
        half-way left them)."""
        count = len(microbatches)
        self.sent: list[Send] = []
        """This step's sends, as :attr:`~autopar.core.pipeline.Stages.sends` prices them."""
        self.handed: dict[tuple, torch.Tensor] = {}
        """Values one of this position's stages made for another of them (interleaved), by
        micro-batch, stages, direction and value: handed over, not sent."""
        if backward and not continuing:
            for chunk in self.chunks.values():
                chunk.unsynced.take()
        weight = 1.0 if divisor is not None else 1.0 / count
        saved: dict[tuple[int, int], list[torch.Tensor]] = {}
        sends: list = []
        loss, grads = None, {}
        stages = self.stages
        actions = order(stages.schedule, self.position, stages.positions, count, stages.stages_per_rank)
        if not backward:
            actions = [a for a in actions if a[0] == "F"]
        for action, m, s in actions:
            chunk = self.chunks[s]
            form = chunk.form(m, count, sync, continuing) if backward else chunk.forms[0]
            program = chunk.lowered[form].program
            if action == "F":
                got = self._receive(chunk, m, False)
                given = [self._piece(divisor, name) for name in chunk.given]
                args = [state[n] for n in chunk.state] + [microbatches[m][n] for n in chunk.inputs]
                with named_timeouts(self.timeout_s, "forward"):
                    results = program.forward(*args, *got, *given)
                if backward:
                    saved[m, s] = list(results[program.num_outputs :])
                for kind, value in zip(chunk.forward_kinds, results[: program.num_outputs]):
                    if kind.kind == "output":
                        loss = value.detach() * weight if loss is None else loss + value.detach() * weight
                    else:
                        sends += self._send(chunk, kind.name, value, m, False)
                results = value = None  # what the backward reads is in saved, freed by its backward
            else:
                if form != "reduced" and chunk.unsynced.layouts not in (None, program.unreduced_layouts):
                    raise InputError(
                        "the calls under no_sync ran a plan that makes their gradients in other placements than this "
                        "call's (the model ran other ops at their sizes or in their mode, planned again). Fix: "
                        "accumulate calls of one size and mode, or without no_sync()"
                    )
                made = self._backward(chunk, program, form, m, saved.pop((m, s)), weight)
                mine = []
                for kind, value in zip(chunk.backward_kinds, made):
                    if kind.kind == "send_grad":
                        sends += self._send(chunk, kind.name, value, m, True)
                    else:
                        mine.append((kind.name, value))
                if form == "unreduced":
                    chunk.unsynced.add([v for _, v in mine], program.unreduced_layouts)
                else:
                    grads.update(mine)
                made = mine = value = None  # added into the sums: held no longer than they are
        if backward and sync:
            sends += self._share_tied(grads, count)
        for work in sends:
            with named_timeouts(self.timeout_s, "pipeline sends"):
                work.wait()
        return loss, grads

    def _share_tied(self, grads: dict[str, torch.Tensor], microbatches: int) -> list:
        """Send the gradients of tied weights this position makes to the positions holding
        copies, and put those the others make into ``grads``."""
        first = self._tag(microbatches, 0, 0, False)  # after every micro-batch's tags
        tag = {name: first + i for i, name in enumerate(self.tied)}
        sends = []
        for name, targets in self.tied_out.items():
            tensor = grads[name].contiguous()
            for t in targets:
                sends.append(dist.isend(tensor, dst=self.peers[t], tag=tag[name]))
                self.sent.append(Send(self.position, t, tensor.numel() * tensor.element_size(), tied=True))
        parts = [chunk.captured for chunk in self.chunks.values()]
        node = {k.name: n for part in parts for k, n in zip(part.inputs, part.placeholders)}
        for name, source in self.tied_in.items():
            val = node[name].meta["val"]
            shape = local_shape(tuple(val.shape), self.layouts[name], self.mesh)
            buffer = torch.empty(shape, dtype=val.dtype, device=self.device)
            with named_timeouts(self.timeout_s, "pipeline receives"):
                dist.irecv(buffer, src=self.peers[source], tag=tag[name]).wait()
            grads[name] = buffer
        return sends

    def _backward(self, chunk: _Stage, program, form: str, m: int, saved: list, weight: float) -> list:
        """Micro-batch ``m``'s backward through ``chunk``, from ``weight`` as the loss's gradient
        and the gradients the later stages sent."""
        tangents = iter(self._receive(chunk, m, True))
        args = list(saved)
        for kind, node in zip(chunk.captured.inputs, chunk.captured.placeholders):
            if kind.kind == "tangent":
                val = node.meta["val"]
                args.append(torch.full(tuple(val.shape), weight, dtype=val.dtype, device=self.device))
            elif kind.kind == "recv_grad":
                args.append(next(tangents))
        if form == "accumulated":
            args += chunk.unsynced.take()
        program.given.owned = True
        with named_timeouts(self.timeout_s, "backward"):
            return program.backward(args)

    def _piece(self, whole: torch.Tensor, name: str) -> torch.Tensor:
        """This rank's piece of a scalar the runtime gives the program, laid out as planned: the
        value itself, or on an axis where it is a partial sum, the value at the axis's first
        position and zero at the others."""
        first = all(c == 0 for c, p in zip(self.coordinate, self.layouts[name]) if p.is_partial())
        return (whole if first else torch.zeros_like(whole)).to(self.device)

    def _receive(self, chunk: _Stage, m: int, backward: bool) -> list[torch.Tensor]:
        """What the other stages sent ``chunk`` for micro-batch ``m`` in the forward (or the
        backward), in the order of its placeholders."""
        works, got = [], []
        for kind, node in chunk.received:
            if (kind.kind == "recv_grad") != backward:
                continue
            source = chunk.sources[kind.name]
            if self.stages.position_of(source) == self.position:
                got.append(self.handed.pop((m, source, chunk.stage, backward, kind.name)))
                continue
            val = node.meta["val"]
            layout = self.layouts[kind.name]
            buffer = torch.empty(local_shape(tuple(val.shape), layout, self.mesh), dtype=val.dtype, device=self.device)
            tag = self._tag(m, source, chunk.stage, backward)
            works.append(dist.irecv(buffer, src=self.peers[self.stages.position_of(source)], tag=tag))
            got.append(buffer)
        for work in works:
            with named_timeouts(self.timeout_s, "pipeline receives"):
                work.wait()
        return got

    def _send(self, chunk: _Stage, value: str, tensor: torch.Tensor, m: int, backward: bool) -> list:
        tensor = tensor.contiguous()
        works = []
        for t in chunk.targets[value]:
            position = self.stages.position_of(t)
            if position == self.position:  # another stage of this position: handed over
                self.handed[m, chunk.stage, t, backward, value] = tensor
                continue
            works.append(dist.isend(tensor, dst=self.peers[position], tag=self._tag(m, chunk.stage, t, backward)))
            self.sent.append(Send(self.position, position, tensor.numel() * tensor.element_size()))
        return works

    def _tag(self, m: int, src: int, dst: int, backward: bool) -> int:
        """The tag of micro-batch ``m``'s message from stage ``src`` to stage ``dst``."""
        count = self.stages.count
        return ((m * count + src) * count + dst) * 2 + int(backward)
