"""Running a plan with pipeline stages: one stage's programs, micro-batch by micro-batch.

Each rank lowers its stage's graph (:func:`~autopar.passes.analysis.stages.stage_graph`) with
the plan, for its position on the mesh inside the stages, into a forward and a backward
program, as a plan without stages is lowered. A step runs the schedule's order of forwards and
backwards (:func:`schedule`); before each, the rank receives what the stages before it (forward)
or after it (backward) sent for that micro-batch, and after it sends on what it made for them,
point to point to the rank at its own position in the other stage (``isend`` / ``irecv``, which
gloo and NCCL both run; torch.distributed.pipelining's stages run whole modules through
autograd, where the planned programs here are forward and backward graphs of their own).

The step's loss is the batch's, made of the micro-batches' parts: a mean cross-entropy's sum over
each micro-batch divides by the batch's count of targets (computed from the inputs,
:func:`~autopar.passes.analysis.stages.loss_divisor`, and given to the programs in place of the
micro-batch's own count), and the parts are added; a plain mean is the mean of the
micro-batches'. Each backward starts from its part's gradient (1, or one over the
micro-batches), so the gradients add up to the batch's. Within the micro-batches but the last,
each backward keeps its gradients as made and sums them; the last one's adds the sums before its
collectives, which then run once per step (the ``"unreduced"`` and ``"accumulated"`` programs of gradient accumulation).
"""

from collections.abc import Sequence

import torch
import torch.distributed as dist
from autopar.passes.analysis.capture import Captured
from autopar.passes.analysis.stages import Staged, check_stageable, stage_graph
from autopar.passes.propagation.redistribute import local_shape
from autopar.runtime.program import Lowered, Unsynced, lower, named_timeouts

from autopar.core.mesh import Mesh
from autopar.core.pipeline import Schedule
from autopar.core.plan import ShardingPlan
from autopar.core.strategy import getitem_aliases


def schedule(kind: Schedule, stage: int, stages: int, microbatches: int) -> list[tuple[str, int]]:
    """The order stage ``stage`` runs its forwards (``("F", m)``) and backwards (``("B", m)``)."""
    if kind == "gpipe":
        return [("F", m) for m in range(microbatches)] + [("B", m) for m in range(microbatches)]
    warmup = min(stages - 1 - stage, microbatches)
    order = [("F", m) for m in range(warmup)]
    for m in range(warmup, microbatches):
        order += [("F", m), ("B", m - warmup)]
    order += [("B", m) for m in range(microbatches - warmup, microbatches)]
    return order


class StageRunner:
    """One rank's stage of a pipelined plan: its programs and the peers it sends to."""

    def __init__(
        self,
        captured: Captured,
        plan: ShardingPlan,
        staged: Staged,
        stage: int,
        coordinate: tuple[int, ...],
        groups: list[str],
        peers: Sequence[int],
        backend: str,
        timeout_s: float | None,
        device: torch.device,
    ):
        self.stages = plan.stages
        self.device = device
        self.stage, self.peers, self.timeout_s = stage, list(peers), timeout_s
        self.output_stage = staged.output_stage
        self.divisor = check_stageable(captured)
        given = frozenset({self.divisor[1]} if self.divisor else ())
        nodes = {n.name: n for n in captured.graph.graph.nodes}
        self.divisor_dtype = nodes[self.divisor[1]].meta["val"].dtype if self.divisor else None
        self.captured = stage_graph(captured, staged, stage, getitem_aliases(captured.graph.graph), given)
        self.loss_dtype = next(
            v.meta["val"].dtype
            for v, k in zip(captured.graph.graph.output_node().args[0], captured.outputs)
            if k is not None and k.kind == "output"
        )
        self.coordinate = coordinate
        self.unsynced = Unsynced()
        forms = ("reduced",) if self.stages.microbatches == 1 else ("unreduced", "accumulated")
        self.lowered: dict[str, Lowered] = {
            form: lower(self.captured, plan, plan.mesh, coordinate, groups, backend, timeout_s, form, self.unsynced)
            for form in forms
        }
        first = self.lowered[forms[0]]
        self.layouts = first.layouts
        self.collectives = self.lowered[forms[-1]].collectives
        """The collectives of the last micro-batch's program: its own and the step's gradient buckets."""
        self.forward_kinds = [k for k in self.captured.outputs if not k.in_backward]
        self.backward_kinds = [k for k in self.captured.outputs if k.in_backward]
        inputs = self.captured.inputs
        self.received = [(k, n) for k, n in zip(inputs, self.captured.placeholders) if k.kind in ("recv", "recv_grad")]
        self.sources = {c.value: c.src for c in staged.crossings if c.dst == stage}
        self.targets: dict[str, list[int]] = {}
        for c in staged.crossings:
            if c.src == stage:
                self.targets.setdefault(c.value, []).append(c.dst)
        self.mesh: Mesh = plan.mesh
        shared = staged.shared
        holder = {
            k.name: staged.stage_of[n.name] for n, k in zip(captured.placeholders, captured.inputs) if k.name in shared
        }
        self.copies = {name for name, readers in shared.items() if stage in readers and holder[name] != stage}
        """Tensors tied across stages whose copy another stage counts (and makes the gradient of)."""
        graded = {k.name for k in captured.outputs if k is not None and k.kind == "grad"}
        self.tied = sorted(name for name in shared if name in graded)
        """Every stage's weights tied across stages whose gradients are sent, in one order on every rank."""
        self.tied_in = {name: holder[name] for name in self.copies if name in graded}
        """Weights tied across stages whose gradient another stage makes: it sends it once per step."""
        self.tied_out = {
            name: [r for r in readers if r != stage]
            for name, readers in shared.items()
            if holder[name] == stage and name in graded
        }
        """Weights tied across stages whose gradient this stage makes, and the stages it sends it to."""

    def _form(self, m: int) -> str:
        if self.stages.microbatches == 1:
            return "reduced"
        return "accumulated" if m == self.stages.microbatches - 1 else "unreduced"

    def batch_divisor(self, microbatches: list[tuple[torch.Tensor, ...]]) -> torch.Tensor | None:
        """The divisor of the batch's loss (:func:`~autopar.passes.analysis.stages.loss_divisor`),
        from every micro-batch's whole inputs; ``None`` for a mean over a fixed number of values."""
        if self.divisor is None:
            return None
        total = sum(self.divisor[0](*inputs).to(torch.float64) for inputs in microbatches)
        return total.to(self.divisor_dtype)

    def step(
        self, state: list[torch.Tensor], microbatches: list[list[torch.Tensor]], divisor, backward: bool
    ) -> tuple[torch.Tensor | None, dict[str, torch.Tensor]]:
        """Run the schedule (forwards only without ``backward``) on ``microbatches`` (each one's
        local inputs) whose batch's loss divides by ``divisor`` (:meth:`batch_divisor`): the
        batch's loss on the stage making it, and each parameter's gradient by name."""
        self.unsynced.take()  # what a step that failed half-way left
        weight = 1.0 if divisor is not None else 1.0 / len(microbatches)
        given = [self._piece(divisor, k.name) for k in self.captured.inputs if k.kind == "given"]
        saved: dict[int, list[torch.Tensor]] = {}
        sends: list = []
        loss, grads = None, {}
        order = schedule(self.stages.schedule, self.stage, self.stages.count, len(microbatches))
        if not backward:
            order = [a for a in order if a[0] == "F"]
        for action, m in order:
            program = self.lowered[self._form(m) if backward else next(iter(self.lowered))].program
            if action == "F":
                got = self._receive(m, False)
                with named_timeouts(self.timeout_s, "forward"):
                    results = program.forward(*state, *microbatches[m], *got, *given)
                if backward:
                    saved[m] = list(results[program.num_outputs :])
                for kind, value in zip(self.forward_kinds, results[: program.num_outputs]):
                    if kind.kind == "output":
                        loss = value.detach() * weight if loss is None else loss + value.detach() * weight
                    else:
                        sends += self._send(kind.name, value, m, False)
            else:
                made = self._backward(program, m, saved.pop(m), weight)
                mine = []
                for kind, value in zip(self.backward_kinds, made):
                    if kind.kind == "send_grad":
                        sends += self._send(kind.name, value, m, True)
                    else:
                        mine.append((kind.name, value))
                if self._form(m) == "unreduced":
                    self.unsynced.add([v for _, v in mine], program.unreduced_layouts)
                else:
                    grads = dict(mine)
        if backward:
            sends += self._share_tied(grads, len(microbatches))
        for work in sends:
            with named_timeouts(self.timeout_s, "pipeline sends"):
                work.wait()
        return loss, grads

    def _share_tied(self, grads: dict[str, torch.Tensor], microbatches: int) -> list:
        """Send the gradients of tied weights this stage makes to the stages holding copies, and
        put those the others make into ``grads``."""
        tag = {name: 2 * microbatches + i for i, name in enumerate(self.tied)}  # after every micro-batch's
        sends = [
            dist.isend(grads[name].contiguous(), dst=self.peers[t], tag=tag[name])
            for name, targets in self.tied_out.items()
            for t in targets
        ]
        node = {k.name: n for k, n in zip(self.captured.inputs, self.captured.placeholders)}
        for name, source in self.tied_in.items():
            val = node[name].meta["val"]
            shape = local_shape(tuple(val.shape), self.layouts[name], self.mesh)
            buffer = torch.empty(shape, dtype=val.dtype, device=self.device)
            with named_timeouts(self.timeout_s, "pipeline receives"):
                dist.irecv(buffer, src=self.peers[source], tag=tag[name]).wait()
            grads[name] = buffer
        return sends

    def _backward(self, program, m: int, saved: list[torch.Tensor], weight: float) -> list:
        """Micro-batch ``m``'s backward, from ``weight`` as the loss's gradient and the gradients
        the later stages sent."""
        tangents = iter(self._receive(m, True))
        args = list(saved)
        for kind, node in zip(self.captured.inputs, self.captured.placeholders):
            if kind.kind == "tangent":
                val = node.meta["val"]
                args.append(torch.full(tuple(val.shape), weight, dtype=val.dtype, device=self.device))
            elif kind.kind == "recv_grad":
                args.append(next(tangents))
        if self._form(m) == "accumulated":
            args += self.unsynced.take()
        program.given.owned = True
        with named_timeouts(self.timeout_s, "backward"):
            return program.backward(args)

    def _piece(self, whole: torch.Tensor, name: str) -> torch.Tensor:
        """This rank's piece of a scalar the runtime gives the program, laid out as planned: the
        value itself, or on an axis where it is a partial sum, the value at the axis's first
        position and zero at the others."""
        first = all(c == 0 for c, p in zip(self.coordinate, self.layouts[name]) if p.is_partial())
        return (whole if first else torch.zeros_like(whole)).to(self.device)

    def _receive(self, m: int, backward: bool) -> list[torch.Tensor]:
        """What the other stages sent this stage for micro-batch ``m`` in the forward (or the
        backward), in the order of its placeholders."""
        works, got = [], []
        for kind, node in self.received:
            if (kind.kind == "recv_grad") != backward:
                continue
            val = node.meta["val"]
            layout = self.layouts[kind.name]
            buffer = torch.empty(local_shape(tuple(val.shape), layout, self.mesh), dtype=val.dtype, device=self.device)
            works.append(dist.irecv(buffer, src=self.peers[self.sources[kind.name]], tag=_tag(m, backward)))
            got.append(buffer)
        for work in works:
            with named_timeouts(self.timeout_s, "pipeline receives"):
                work.wait()
        return got

    def _send(self, value: str, tensor: torch.Tensor, m: int, backward: bool) -> list:
        tensor = tensor.contiguous()
        return [dist.isend(tensor, dst=self.peers[t], tag=_tag(m, backward)) for t in self.targets[value]]


def _tag(m: int, backward: bool) -> int:
    return 2 * m + int(backward)
