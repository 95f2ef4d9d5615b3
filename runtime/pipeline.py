"""Running a plan with pipeline stages: one stage's programs, micro-batch by micro-batch.

Each rank lowers its stage's graph (:func:`~autopar.passes.analysis.stages.stage_graph`) with
the plan, for its position on the mesh inside the stages, into a forward and a backward
program, as a plan without stages is lowered. A step runs the schedule's order of forwards and
backwards (:func:`schedule`); before each, the rank receives what the stages before it (forward)
or after it (backward) sent for that micro-batch, and after it sends on what it made for them,
point to point to the rank at its own position in the other stage (``isend`` / ``irecv``, which
gloo and NCCL both run; torch.distributed.pipelining's stages run whole modules through
autograd, where the planned programs here are forward and backward graphs of their own).

The step's loss is the weighted sum of the micro-batches' losses that equals the batch's:
each micro-batch's weight is its share of the loss's divisor (the number of targets a mean
cross-entropy counts, computed from the inputs by :func:`loss_weights`), or one over the
micro-batches for a plain mean. Each micro-batch's backward starts from its weight, so the
gradients add up to the batch's. Within the micro-batches but the last, each backward keeps its
gradients as made and sums them; the last one's adds the sums before its collectives, which then
run once per step (the ``"unreduced"`` and ``"accumulated"`` programs of gradient accumulation).
"""

from collections.abc import Sequence

import torch
import torch.distributed as dist
from autopar.passes.analysis.capture import Captured
from autopar.passes.analysis.stages import Staged, stage_graph
from autopar.passes.propagation.redistribute import local_shape
from autopar.runtime.program import Lowered, Unsynced, lower, named_timeouts
from torch import fx

from autopar.core.errors import InputError
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


def loss_weights(captured: Captured) -> fx.GraphModule | None:
    """A graph computing, from a micro-batch's inputs, the divisor of its loss (a mean
    cross-entropy's count of targets), or ``None`` where the loss is a mean over a fixed number
    of values (every micro-batch weighs the same); refused for any other loss."""
    kinds = dict(zip(captured.placeholders, captured.inputs))
    results = [
        v for v, k in zip(captured.graph.graph.output_node().args[0], captured.outputs) if k and k.kind == "output"
    ]
    loss = results[0] if len(results) == 1 else None
    if loss is None or loss.meta["val"].ndim != 0:
        raise InputError(
            "with pipeline stages the model must return one scalar loss, which the stages' micro-batches add up to; "
            f"it returns {len(results)} results. Fix: return the loss alone, or compile without pipeline="
        )
    aten = torch.ops.aten
    if loss.target in (aten.mean.default, aten.mean.dim):
        return None
    divisor = loss.args[1] if loss.target == aten.div.Tensor else None
    ancestors = _ancestors(divisor) if isinstance(divisor, fx.Node) else None
    if ancestors is None or any(a in kinds and kinds[a].kind != "input" for a in ancestors):
        raise InputError(
            f"with pipeline stages the loss must be a mean over the batch (it is made by {loss.target}), so that "
            "the micro-batches' losses add up to the batch's. Fix: return a mean loss (torch.mean, "
            "F.cross_entropy with reduction='mean'), or compile without pipeline="
        )
    g = fx.Graph()
    env: dict[fx.Node, fx.Node] = {}
    for node in captured.graph.graph.nodes:
        if node.op == "placeholder" and kinds[node].kind == "input":
            env[node] = g.node_copy(node)
        elif node in ancestors and node.op != "placeholder":
            env[node] = g.node_copy(node, lambda n: env[n])
    g.output(env[divisor])
    return fx.GraphModule(captured.graph, g)


def _ancestors(node: fx.Node) -> set[fx.Node]:
    found, todo = {node}, [node]
    while todo:
        for a in todo.pop().all_input_nodes:
            if a not in found:
                found.add(a)
                todo.append(a)
    return found


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
        self.captured = stage_graph(captured, staged, stage, getitem_aliases(captured.graph.graph))
        self.divisor = loss_weights(captured)
        self.loss_dtype = next(
            v.meta["val"].dtype
            for v, k in zip(captured.graph.graph.output_node().args[0], captured.outputs)
            if k is not None and k.kind == "output"
        )
        updated = [k.name for k in captured.outputs if k is not None and k.kind == "buffer"]
        if updated:
            raise InputError(
                f"the forward updates buffers in place ({', '.join(updated)}: batch norm's running statistics, "
                "counters), which pipeline stages would update once per micro-batch instead of once per batch. "
                "Fix: compile without pipeline="
            )
        self.unsynced = Unsynced()
        forms = ("reduced",) if self.stages.microbatches == 1 else ("unreduced", "accumulated")
        self.lowered: dict[str, Lowered] = {
            form: lower(self.captured, plan, plan.mesh, coordinate, groups, backend, timeout_s, form, self.unsynced)
            for form in forms
        }
        first = self.lowered[forms[0]]
        self.layouts = first.layouts
        self.collectives = [c for form in forms for c in self.lowered[form].collectives]
        inputs = self.captured.inputs
        self.received = [(k, n) for k, n in zip(inputs, self.captured.placeholders) if k.kind in ("recv", "recv_grad")]
        self.sources = {c.value: c.src for c in staged.crossings if c.dst == stage}
        self.targets: dict[str, list[int]] = {}
        for c in staged.crossings:
            if c.src == stage:
                self.targets.setdefault(c.value, []).append(c.dst)
        self.mesh: Mesh = plan.mesh

    def _form(self, m: int) -> str:
        if self.stages.microbatches == 1:
            return "reduced"
        return "accumulated" if m == self.stages.microbatches - 1 else "unreduced"

    def weights(self, microbatches: list[tuple[torch.Tensor, ...]]) -> list[float]:
        """Each micro-batch's share of the step's loss."""
        if self.divisor is None:
            return [1.0 / len(microbatches)] * len(microbatches)
        divisors = [float(self.divisor(*inputs)) for inputs in microbatches]
        total = sum(divisors)
        if total == 0:
            return [1.0 / len(microbatches)] * len(microbatches)
        return [d / total for d in divisors]

    def step(
        self, state: list[torch.Tensor], microbatches: list[list[torch.Tensor]], weights: list[float], backward: bool
    ) -> tuple[torch.Tensor | None, dict[str, torch.Tensor], list[torch.Tensor | None]]:
        """Run the schedule (forwards only without ``backward``) on ``microbatches`` (each one's
        local inputs): the weighted loss on the stage making it, each parameter's gradient by
        name, and each micro-batch's new values of the buffers the forward updates."""
        saved: dict[int, list[torch.Tensor]] = {}
        sends: list = []
        loss, grads = None, {}
        order = schedule(self.stages.schedule, self.stage, self.stages.count, len(microbatches))
        if not backward:
            order = [a for a in order if a[0] == "F"]
        buffers: list = []
        for action, m in order:
            program = self.lowered[self._form(m) if backward else next(iter(self.lowered))].program
            if action == "F":
                got = self._receive(m, False)
                with named_timeouts(self.timeout_s, "forward"):
                    results = program.forward(*state, *microbatches[m], *got)
                outputs = results[: program.num_outputs]
                if backward:
                    saved[m] = list(results[program.num_outputs :])
                fwd_kinds = [k for k in self.captured.outputs if not k.in_backward]
                for kind, value in zip(fwd_kinds, outputs):
                    if kind.kind == "output":
                        part = value.detach() * weights[m]
                        loss = part if loss is None else loss + part
                    elif kind.kind == "buffer":
                        buffers.append((kind.name, value))
                    else:
                        sends += self._send(kind.name, value, m, False)
            else:
                got = self._receive(m, True)
                tangents = iter(got)
                args = list(saved.pop(m))
                for kind, node in zip(self.captured.inputs, self.captured.placeholders):
                    if kind.kind == "tangent":
                        val = node.meta["val"]
                        args.append(torch.full(tuple(val.shape), weights[m], dtype=val.dtype, device=self.device))
                    elif kind.kind == "recv_grad":
                        args.append(next(tangents))
                if self._form(m) == "accumulated":
                    args += self.unsynced.take()
                program.given.owned = True
                with named_timeouts(self.timeout_s, "backward"):
                    made = program.backward(args)
                bwd_kinds = [k for k in self.captured.outputs if k.in_backward]
                mine = []
                for kind, value in zip(bwd_kinds, made):
                    if kind.kind == "send_grad":
                        sends += self._send(kind.name, value, m, True)
                    else:
                        mine.append((kind.name, value))
                if self._form(m) == "unreduced":
                    self.unsynced.add([v for _, v in mine], program.unreduced_layouts)
                else:
                    grads = dict(mine)
        for work in sends:
            with named_timeouts(self.timeout_s, "pipeline sends"):
                work.wait()
        return loss, grads, buffers

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
