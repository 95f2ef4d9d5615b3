"""Compute cost of a node under a strategy: roofline time of the rank's share of the work.

FLOPs come from :mod:`torch.utils.flop_counter`'s formulas (matmuls, convolutions, attention,
and its attention formulas for the CPU flash-attention kernels a model captured on a CPU runs,
which the flop counter does not list); other ops count one FLOP per output element.
Bytes moved are the op's inputs and outputs.
A matrix product's FLOPs run at the profile's rate for the format of its multiply-adds
(:func:`math_format`): on a GPU, float32 without TF32 is 15 times slower than bfloat16.
Views and other metadata-only ops are free. A rank's share is what its local shapes hold: a mesh
axis on which the strategy splits (``S``) an input or output divides the work by its size. On an
axis where the operands are replicated (``R``) or partial sums (``P``) every rank holds them whole
and runs the whole op, so redundant compute costs its full price.
"""

import math

import torch
from autopar.cost_model.hardware import Profile
from autopar.passes.rules import tensor_args
from torch import fx
from torch.utils._pytree import tree_flatten, tree_map
from torch.utils.flop_counter import flop_registry, sdpa_backward_flop_count, sdpa_flop_count

from autopar.core.mesh import Mesh
from autopar.core.placement import Shard
from autopar.core.strategy import Strategy

aten = torch.ops.aten

FREE_OPS = {
    aten.view.default,
    aten._unsafe_view.default,
    aten.reshape.default,
    aten.t.default,
    aten.transpose.int,
    aten.permute.default,
    aten.expand.default,
    aten.detach.default,
    aten.alias.default,
    aten.unsqueeze.default,
    aten.squeeze.dim,
    aten.squeeze.dims,
    aten.squeeze.default,
    aten.split.Tensor,
    aten.split_with_sizes.default,
    aten.slice.Tensor,
    aten.select.int,
    aten._assert_tensor_metadata.default,
}


_CPU_ATTENTION = {
    aten._scaled_dot_product_flash_attention_for_cpu.default: lambda query, key, value, *_, **__: sdpa_flop_count(
        query.shape, key.shape, value.shape
    ),
    aten._scaled_dot_product_flash_attention_for_cpu_backward.default: lambda grad_out, query, key, value, *_, **__: (
        sdpa_backward_flop_count(grad_out.shape, query.shape, key.shape, value.shape)
    ),
}


_TF32_FLAGS = {
    # float32 matmuls run on TF32 tensor cores when torch.backends.cuda.matmul.allow_tf32 is set
    # (torch.set_float32_matmul_precision("high")); convolutions when torch.backends.cudnn.allow_tf32
    # is (torch's default)
    **dict.fromkeys((aten.mm, aten.addmm, aten.bmm, aten.baddbmm), lambda: torch.backends.cuda.matmul.allow_tf32),
    **dict.fromkeys(
        (
            aten.convolution,
            aten._convolution,
            aten.convolution_backward,
            aten.cudnn_convolution,
            aten.convolution_overrideable,
            aten._slow_conv2d_forward,
        ),
        lambda: torch.backends.cudnn.allow_tf32,
    ),
}


def math_format(node: fx.Node) -> str | None:
    """The format a matrix product (an op with a FLOP formula: matmul, convolution, attention)
    runs its multiply-adds in, which sets its peak rate: its first operand's dtype, or
    ``"tf32"`` for a float32 matmul or convolution that torch's TF32 flags, read when planning,
    let onto tensor cores. ``None`` for other ops."""
    if node.op != "call_function" or not hasattr(node.target, "overloadpacket"):
        return None
    packet = node.target.overloadpacket
    if packet not in flop_registry and node.target not in _CPU_ATTENTION:
        return None
    operands = tensor_args(node)
    if not operands:
        return None
    operand = operands[0].meta["val"]
    if operand.dtype == torch.float32 and (allowed := _TF32_FLAGS.get(packet)) is not None and allowed():
        return "tf32"
    return str(operand.dtype).removeprefix("torch.")


def _tensors(value) -> list[torch.Tensor]:
    flat, _ = tree_flatten(value)
    return [t for t in flat if isinstance(t, torch.Tensor)]


def node_work(node: fx.Node) -> tuple[float, float]:
    """Whole-tensor ``(flops, bytes_moved)`` of one op node."""
    if node.op != "call_function" or node.target in FREE_OPS or not hasattr(node.target, "overloadpacket"):
        return 0.0, 0.0
    out = node.meta.get("val")
    outs = _tensors(out)
    ins = [
        a.meta["val"]
        for a in tree_flatten((node.args, node.kwargs))[0]
        if isinstance(a, fx.Node) and isinstance(a.meta.get("val"), torch.Tensor)
    ]
    nbytes = sum(t.numel() * t.element_size() for t in outs + ins)
    if node.target in _CPU_ATTENTION:
        args = tree_map(lambda a: a.meta["val"] if isinstance(a, fx.Node) else a, node.args)
        flops = float(_CPU_ATTENTION[node.target](*args))
    elif (formula := flop_registry.get(node.target.overloadpacket)) is not None:
        args, kwargs = tree_map(lambda a: a.meta["val"] if isinstance(a, fx.Node) else a, (node.args, node.kwargs))
        flops = float(formula(*args, out_val=out, **kwargs))
    else:
        flops = float(sum(t.numel() for t in outs))
    return flops, float(nbytes)


def work_divisor(strategy: Strategy, mesh: Mesh) -> int:
    """How many ranks share the op's work under ``strategy``: the product of the axes on which
    it splits an input or output."""
    placements = [p for p in strategy.outputs + strategy.inputs if p is not None]
    return math.prod(n for axis, n in enumerate(mesh.shape) if any(isinstance(p[axis], Shard) for p in placements))


def compute_s(
    work: tuple[float, float], strategy: Strategy, mesh: Mesh, hardware: Profile, fmt: str | None = None
) -> float:
    """Roofline time of a rank's share of ``work`` (:func:`node_work`) under ``strategy``, its
    multiply-adds in the format ``fmt`` (:func:`math_format`)."""
    flops, nbytes = work
    if flops == 0 and nbytes == 0:
        return hardware.compute_s(0.0, 0.0)  # a view: no work, but a profile may charge running an op
    divisor = work_divisor(strategy, mesh)
    return hardware.compute_s(flops / divisor, nbytes / divisor, fmt)
