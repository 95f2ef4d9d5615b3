"""One rank's program: a plan lowered for a captured graph, and the autograd function that runs it.

:func:`lower` rewrites the captured joint graph for this rank (its pieces and collectives) and
splits it into a forward and a backward :class:`Program`; :class:`Step` runs a program as one
autograd function, so that ``backward()`` on the model's outputs runs the program's backward.
:func:`check_plan` refuses a plan made for another mesh or graph before it is lowered.
"""

import contextlib
import time
from collections.abc import Mapping, Sequence
from typing import NamedTuple

import torch
import torch.distributed as dist
from autopar.passes.analysis.capture import Captured
from autopar.passes.analysis.liveness import forward_made
from autopar.passes.lower.partition import Partitioned, boxed, layer_by_layer, partition
from autopar.passes.lower.rewrite import Gradients, placeholder_layouts, rewrite, unreduced_gradients
from autopar.passes.propagation.propagate import whole_on_one_rank
from autopar.passes.propagation.rank_ops import graph_collectives
from autopar.runtime.release import GivenRelease, release_collective_buffers
from autopar.runtime.state import gradient_as, piece_of
from torch.distributed.tensor import DTensor

from autopar.core.errors import CollectiveError, InputError, StalePlanError
from autopar.core.graph import ancestors
from autopar.core.mesh import Mesh
from autopar.core.offload_ops import OFFLOAD_OPS, host_copies_done
from autopar.core.placement import Placements, format_placements
from autopar.core.plan import ShardingPlan

BACKENDS = ("eager", "inductor")


class Program:
    """One rank's compiled forward and backward graphs and how to feed them."""

    def __init__(
        self,
        parts: Partitioned,
        backend: str,
        grad_slots: list[bool],
        updated_buffers: list[str | None],
        timeout_s: float | None = None,
        gradients: Gradients = "reduced",
        unsynced: "Unsynced | None" = None,
        unreduced_layouts: tuple = (),
        outputs: "Outputs | None" = None,
    ):
        self.num_outputs = parts.num_outputs
        buffers = [name is not None for name in updated_buffers]
        none = [False] * len(buffers)
        self.outputs = outputs or Outputs([not b for b in buffers], buffers, {}, none, buffers)
        self.timeout_s = timeout_s
        self.gradients = gradients
        self.unsynced = unsynced
        """Where an ``"unreduced"`` program's backward adds its gradients, and an ``"accumulated"``
        one's takes them from."""
        self.unreduced_layouts = unreduced_layouts
        """The placements of the gradients as the backward makes them (:func:`unreduced_gradients`)."""
        self.grad_slots = grad_slots
        self.updated_buffers = updated_buffers
        """Per forward output: the buffer it is the new value of, or ``None`` for a model output."""
        self.grads_to_host = any(n.target in OFFLOAD_OPS for n in parts.backward.graph.nodes)
        self.given = GivenRelease()
        """Frees saved tensors that collectives read in the backward, once the backward owns them."""
        if backend == "inductor":
            self.forward = _inductor(parts.forward)
            layers = layer_by_layer(parts.backward)
            if layers is None:
                whole = _inductor(parts.backward)
                self.backward = lambda args: whole(*args)
            else:
                for name, layer in list(layers.named_children()):
                    setattr(layers, name, _inductor(layer))
                self.backward = boxed(layers)
        else:
            self.forward = release_collective_buffers(parts.forward)
            self.backward = boxed(release_collective_buffers(parts.backward, (forward_made(parts.forward), self.given)))


def _inductor(graph: torch.fx.GraphModule):
    return torch.compile(graph, backend="inductor", fullgraph=True, dynamic=False, options=_offload_safe(graph))


def _offload_safe(graph: torch.fx.GraphModule) -> dict:
    """Inductor options for a graph: where it copies values to the host (activations in the
    forward, gradients of parameters kept on the host in the backward), Inductor must not write
    a later kernel's output into a copied value's buffer (its buffer reuse and in-place kernels
    bypass the caching allocator), since on CUDA the copy may still be reading it on the side
    stream. Freed buffers then go back to the caching allocator, which reuses them only once
    the copy is done. Nor may Inductor reorder the graph's ops (for peak memory or locality): it
    would move the copies out of the forward behind its compute, so that the activations being
    copied are all held on the device at once, above the plan's peak, and the copies run after
    the forward instead of beside it."""
    if any(n.target in OFFLOAD_OPS for n in graph.graph.nodes):
        return {
            "allow_buffer_reuse": False,
            "inplace_buffers": False,
            "reorder_for_peak_memory": False,
            "reorder_for_locality": False,
        }
    return {}


class Step(torch.autograd.Function):
    """A program's forward and backward as one autograd function of its inputs: parameters and
    buffers (DTensors, run on their local pieces; each parameter's gradient comes back as a
    DTensor laid out as the parameter) and the local pieces of the model's inputs."""

    @staticmethod
    def forward(ctx, program: Program, *flat):
        ctx.specs = [x._spec if isinstance(x, DTensor) else None for x in flat]
        with named_timeouts(program.timeout_s, "forward"):
            results = program.forward(*(piece_of(x) for x in flat))
        ctx.program = program
        ctx.save_for_backward(*results[program.num_outputs :])
        outputs = tuple(results[: program.num_outputs])
        ctx.mark_non_differentiable(*(o for o, constant in zip(outputs, program.outputs.constant) if constant))
        return outputs

    @staticmethod
    def backward(ctx, *tangents):
        refuse_second_order()
        program = ctx.program
        program.outputs.refuse_lost_gradients(tangents)
        tangents = [t for t, taken in zip(tangents, program.outputs.tangents) if taken]
        args = [*ctx.saved_tensors, *(t.contiguous() for t in tangents)]
        if program.gradients == "accumulated":
            sums = program.unsynced.take()
            if not sums and program.unreduced_layouts:
                raise RuntimeError(
                    "the backward of a call after micro-batches under pmodel.no_sync() found their gradients taken "
                    "already: a second backward of one call (retain_graph=True), or of another call made outside "
                    "no_sync() before the first's backward. Fix: run one forward and one backward outside no_sync() "
                    "per round"
                )
            args += sums
        ctx.maybe_clear_saved_tensors()  # unless retain_graph: the backward frees each after its last read
        program.given.owned = not torch._C._autograd._get_current_graph_task_keep_graph()
        with named_timeouts(program.timeout_s, "backward"):
            grads = program.backward(args)
        if program.grads_to_host:
            host_copies_done()
        if program.gradients == "unreduced":
            program.unsynced.add(grads, program.unreduced_layouts)
            return (None,) * (1 + len(program.grad_slots))
        grads = iter(grads)
        return (
            None,
            *(
                gradient_as(next(grads), spec) if has_grad else None
                for has_grad, spec in zip(program.grad_slots, ctx.specs)
            ),
        )


class Outputs(NamedTuple):
    """What the backward takes of the forward's outputs (model outputs and buffers' new values).
    AOT autograd takes no gradient for an output that views another (CLIP's ``logits_per_text``,
    ``logits_per_image.t()``): the module makes it again from that output, outside the program,
    so that autograd carries its gradient there (:meth:`again`)."""

    tangents: list[bool]
    """Per forward output: whether the backward takes its gradient."""
    buffers: list[bool]
    """Per forward output: whether it is a buffer's new value rather than a model output."""
    views: dict[int, tuple[int, list[torch.fx.Node]]]
    """Per model output made again, by its index among the model's outputs: the output it views
    and the view ops (of the captured graph, on whole tensors) that make it from that one."""
    lost: list[bool]
    """Per forward output: a model output that depends on a parameter, whose gradient the
    backward cannot take."""
    constant: list[bool]
    """Per forward output: a buffer's new value, or a model output that depends on no
    parameter (an input returned, integers), which autograd then treats as a constant."""

    def again(self, outputs: list[torch.Tensor]) -> list[torch.Tensor]:
        """``outputs`` (the model's) with those that view another made again from it."""
        for index, (base, ops) in self.views.items():
            value = outputs[base]
            for op in ops:
                value = op.target(value, *op.args[1:], **op.kwargs)
            outputs[index] = value
        return outputs

    def refuse_lost_gradients(self, tangents: Sequence[torch.Tensor | None]) -> None:
        """Raise where a gradient reached an output whose gradient the backward cannot take."""
        model_outputs = [i for i, buffer in enumerate(self.buffers) if not buffer]
        lost = [
            model_outputs.index(i)
            for i, (t, gone) in enumerate(zip(tangents, self.lost))
            if gone and t is not None and t.any()
        ]
        if lost:
            raise RuntimeError(
                f"a gradient reached output{'s' if len(lost) > 1 else ''} {', '.join(map(str, lost))} of the compiled "
                "model, which alias an intermediate or input of its graph, and whose gradients its program does not "
                "take. Fix: return a copy (.clone()) from forward, or compute the loss from other outputs"
            )


def outputs_of(captured: Captured) -> Outputs:
    """:class:`Outputs` of ``captured``'s forward outputs."""
    forward = [k for k in captured.outputs if k is not None and not k.in_backward]
    nodes = dict(zip(captured.outputs, captured.graph.graph.output_node().args[0]))
    tangents = {k.name for k in captured.inputs if k.is_tangent}
    taken = [k.kind == "output" and k.name in tangents for k in forward]
    model_outputs = [k for k in forward if k.kind == "output"]
    index = {nodes[k]: i for i, k in enumerate(model_outputs) if k.name in tangents}
    params = {n for n, k in zip(captured.placeholders, captured.inputs) if k.kind == "param"}
    views, lost, constant = {}, [], []
    for k, has in zip(forward, taken):
        if k.kind != "output" or has:
            lost.append(False)
            constant.append(k.kind != "output")
            continue
        ops, node = [], nodes[k]
        while isinstance(node, torch.fx.Node) and node not in index and _is_view(node):
            ops.append(node)
            node = node.args[0]
        replayable = all(not isinstance(a, torch.fx.Node) for op in ops for a in (*op.args[1:], *op.kwargs.values()))
        if ops and node in index and replayable:
            views[model_outputs.index(k)] = (index[node], ops[::-1])
            lost.append(False)
            constant.append(False)
        else:
            reads_params = isinstance(nodes[k], torch.fx.Node) and bool(ancestors(nodes[k]) & params)
            lost.append(reads_params)
            constant.append(not reads_params)
    return Outputs(taken, [k.kind != "output" for k in forward], views, lost, constant)


def _is_view(node: torch.fx.Node) -> bool:
    """Whether ``node`` is an aten op whose result views its first argument."""
    schema = getattr(node.target, "_schema", None)
    if node.op != "call_function" or schema is None or not schema.returns or not schema.arguments:
        return False
    alias = schema.returns[0].alias_info
    return alias is not None and not alias.is_write and schema.arguments[0].alias_info is not None


class Unsynced:
    """The gradients of the micro-batches run under ``no_sync``, each summed as the backward
    makes it (before its collectives; the placements of :func:`unreduced_gradients`), until the
    backward of the micro-batch that synchronises adds them before its collectives."""

    def __init__(self):
        self.grads: list[torch.Tensor] | None = None
        self.layouts: tuple | None = None
        """The placements the sums are in, which the synchronising program must make its gradients in."""

    def add(self, grads: Sequence[torch.Tensor | None], layouts: tuple) -> None:
        made = [g for g in grads if g is not None]
        if self.grads is None:
            self.grads, self.layouts = made, layouts
            return
        assert len(made) == len(self.grads) and layouts == self.layouts, "micro-batches of different gradients"
        for total, g in zip(self.grads, made):
            total.add_(g)

    def take(self) -> list[torch.Tensor]:
        """The sums, dropped from here (an empty list when none are held)."""
        grads, self.grads, self.layouts = self.grads or [], None, None
        return grads


_PEER_FAILURES = ("timed out", "timeout", "closed by peer", "connection reset")
"""What gloo and NCCL say when a collective's peer stalls past the timeout or leaves the job. gloo
raises a bare ``RuntimeError`` for these as for any other failure (torch 2.13), so its text is all
that tells them apart."""


@contextlib.contextmanager
def named_timeouts(timeout_s: float | None, phase: str):
    """Turn a collective's failure for want of a peer (in the program, or in the per-call check
    of the inputs' sizes) into a :class:`CollectiveError` saying what waited and why."""
    try:
        yield
    except RuntimeError as exc:
        if timeout_s is None or not any(s in str(exc).lower() for s in _PEER_FAILURES):
            raise
        silent = _silent_ranks(min(timeout_s, ROLL_CALL_S))
        who = (
            f"rank{'s' if len(silent) > 1 else ''} {', '.join(map(str, silent))} of the mesh did not"
            if silent
            else "another rank of the mesh did not"
        )
        raise CollectiveError(
            f"rank {dist.get_rank()}: a collective of the {phase} failed because {who} join it within the timeout of "
            f"{timeout_s:g} s (it stalled) or left the job (it died). The collective's own error: "
            f"{str(exc).strip().splitlines()[0]}"
        ) from exc


ROLL_CALL_S = 3.0
"""Seconds a rank whose collective failed waits for the other ranks to say theirs failed too."""


def _silent_ranks(wait_s: float) -> list[int]:
    """The ranks that do not report a failed collective within ``wait_s`` of this rank's own
    report, through the process group's store: every rank that waited in a collective fails at
    its timeout and reports, so those that stay silent are the ones that stalled or died. Empty
    when the job has no store to ask, or no longer has one."""
    try:
        store = dist.distributed_c10d._get_default_store()
    except (RuntimeError, ValueError):
        return []
    key = "autopar/failed/{}".format
    deadline = time.monotonic() + wait_s
    silent = list(range(dist.get_world_size()))
    try:
        store.set(key(dist.get_rank()), "1")
        while silent and time.monotonic() < deadline:
            silent = [rank for rank in silent if not store.check([key(rank)])]
            time.sleep(0.1)
    except RuntimeError:  # the store's host (rank 0) has left the job already
        return []
    return silent


class Lowered(NamedTuple):
    """The program of one input size and mode."""

    captured: Captured
    program: Program
    per_rank_graph: torch.fx.GraphModule
    collectives: list
    layouts: dict[str, Placements]
    plan: ShardingPlan


def lower(
    captured: Captured,
    plan: ShardingPlan,
    mesh: Mesh,
    coordinate: tuple[int, ...],
    group_names: list[str],
    backend: str,
    timeout_s: float | None,
    gradients: Gradients = "reduced",
    unsynced: Unsynced | None = None,
) -> Lowered:
    """The program of ``plan`` for ``captured`` on the rank at ``coordinate``, whose collectives
    run on the process groups ``group_names`` (one per mesh axis), doing ``gradients`` with the
    gradients (with ``unsynced`` holding those of micro-batches under ``no_sync``)."""
    joint = rewrite(captured, plan, coordinate=coordinate, group_names=group_names, gradients=gradients)
    collectives = [
        (kind, mesh.axis_names[axis], nbytes) for kind, axis, nbytes in graph_collectives(joint, group_names)
    ]
    is_tangent = [k.is_tangent for k in captured.inputs]
    unreduced = tuple(p for _, _, p in unreduced_gradients(captured, plan)) if gradients != "reduced" else ()
    if gradients == "accumulated":  # the sums of the micro-batches before are inputs of the backward
        is_tangent += [True] * len(unreduced)
    output_is_grad = [None if k is None else k.in_backward for k in captured.outputs]
    graded = captured.graded
    grad_slots = [k.kind == "param" and k.name in graded for k in captured.inputs if not k.is_tangent]
    updated_buffers = [
        k.name if k.kind == "buffer" else None for k in captured.outputs if k is not None and not k.in_backward
    ]
    parts = partition(joint, is_tangent, output_is_grad)
    program = Program(
        parts, backend, grad_slots, updated_buffers, timeout_s, gradients, unsynced, unreduced, outputs_of(captured)
    )
    layouts = {k.name: p for k, p in zip(captured.inputs, placeholder_layouts(captured, plan))}
    return Lowered(captured, program, joint, collectives, layouts, plan)


def check_plan(
    plan: ShardingPlan, captured: Captured, mesh: Mesh, pins: Mapping[str, Placements] | None = None
) -> None:
    """Refuse a plan made for another mesh, another graph (any op, argument, shape or dtype),
    or with other placements than ``pins`` asks for, naming the difference."""
    if plan.mesh != mesh:
        raise StalePlanError(
            f"the plan was made for {plan.mesh} but the model is compiled for {mesh}. Fix: plan again for {mesh}"
        )
    for name, placements in (pins or {}).items():
        planned = plan.placements.get(name, plan.inputs.get(name))
        asked = whole_on_one_rank(placements, mesh)  # as planning reads a pin
        if planned is not None and planned != asked:
            raise StalePlanError(
                f"the plan places {name!r} as {format_placements(planned)} "
                f"but pins ask for {format_placements(asked)}. "
                "Fix: plan again with these pins, or drop the pins to run the plan as it is"
            )
    if plan.graph_hash != captured.graph_hash:
        raise StalePlanError(
            f"the plan was made for another graph (plan {plan.graph_hash}, this model {captured.graph_hash})"
            + _first_difference(plan.graph_lines, captured.graph_lines)
            + ": the model, its input shapes or dtypes, or autopar changed since planning. Fix: plan this model again"
        )


def _first_difference(planned: Sequence[str], captured: Sequence[str]) -> str:
    for k, (a, b) in enumerate(zip(planned, captured)):
        if a != b:
            return f"; node {k} differs, planned as `{a}`, now `{b}`"
    if len(planned) != len(captured):
        return f"; the plan's graph has {len(planned)} nodes, this model's {len(captured)}"
    return ""


def refuse_autocast() -> None:
    """The per-rank program is captured without ``torch.autocast``; run under it, its matmuls
    alone would change dtype. Casting inside the model's forward is captured and planned."""
    if torch.is_autocast_enabled("cpu") or torch.is_autocast_enabled("cuda"):
        raise RuntimeError(
            "the compiled model is called under torch.autocast, which its per-rank program cannot follow: it was "
            "captured and planned without it. Fix: enter autocast inside the model's forward (wrap the model in a "
            "module whose forward runs it under torch.autocast) before autopar.compile; autopar captures the casts "
            "and prices the matmuls at the lower precision"
        )


def check_tensors(inputs: tuple) -> None:
    """Refuse inputs other than tensors: the program takes tensors only."""
    bad = [f"argument {i} is a {type(x).__name__}" for i, x in enumerate(inputs) if not isinstance(x, torch.Tensor)]
    if bad:
        raise InputError(
            f"the compiled model takes tensors: {'; '.join(bad)}. Fix: pass each input as a tensor "
            "(torch.tensor(...) or torch.stack(...)), and bind other arguments with functools.partial "
            "or module attributes before autopar.compile"
        )


def refuse_input_gradients(inputs: tuple) -> None:
    """Refuse, with gradients on, a call's inputs that require a gradient: the program makes the
    parameters' gradients only."""
    wanted = [str(i) for i, x in enumerate(inputs) if x.requires_grad]
    if wanted and torch.is_grad_enabled():
        raise InputError(
            f"argument{'s' if len(wanted) > 1 else ''} {', '.join(wanted)} of the compiled model require"
            f"{'' if len(wanted) > 1 else 's'} a gradient, which its program does not make: that gradient, and those "
            "of whatever made the input, would stay None where one device's hold them. Fix: pass "
            "x.detach(), or compile the modules that make the input with the model (an embedding outside it)"
        )


def refuse_second_order() -> None:
    """Refuse a backward that builds a graph of itself (``create_graph=True``): the program's
    backward runs outside autograd, so gradients of the gradients would silently be missing."""
    if torch.is_grad_enabled():
        raise InputError(
            "the compiled model's gradients were asked for with create_graph=True (a gradient penalty, a Hessian "
            "product), but its program's backward is not differentiable: second-order terms would be missing. Fix: "
            "compute them with the model uncompiled, or train without them"
        )
