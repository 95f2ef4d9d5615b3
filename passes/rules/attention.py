"""Scaled dot-product attention, forward and backward: split the batch or the heads.

The kernels of every backend are covered: the CPU's flash attention, and CUDA's flash,
memory-efficient and cuDNN kernels (torch picks cuDNN for bfloat16 on Hopper GPUs). An attention
mask (``attn_mask``, or ``attn_bias`` for the CUDA kernels) broadcasts to ``[batch, heads,
query, key]`` from the right; a mask shared along the split dim (one mask for every head) stays
whole on every rank. The CUDA kernels also return and read their random-number state (a seed and
an offset, scalars) and a debug mask (empty): those stay whole on every rank. The memory-efficient
kernel's backward needs its forward's output in the layout that forward made it.
"""

import torch
from autopar.passes.rules import Row, register, register_arg_layout, tensor_args, val
from torch import fx

from autopar.core.placement import R, S

aten = torch.ops.aten


_MASKS = ("attn_mask", "attn_bias")


def _rows(node: fx.Node) -> list[Row]:
    outs = val(node)
    args = tensor_args(node)
    named = {**dict(zip((a.name for a in node.target._schema.arguments), node.args)), **node.kwargs}
    masks = [named[name] for name in _MASKS if isinstance(named.get(name), fx.Node)]

    def out_row(p):
        return tuple(None if not isinstance(o, torch.Tensor) else _batched(o, p) for o in outs)

    def in_row(dim):
        return tuple(_mask_split(val(a), dim) if a in masks else _batched(val(a), S(dim)) for a in args)

    return [
        (out_row(R), (R,) * len(args)),
        (out_row(S(0)), in_row(0)),  # split the batch: every sequence stays on one rank
        (out_row(S(1)), in_row(1)),  # split the heads: attention is per head
    ]


def _batched(value: torch.Tensor, placement):
    """``placement`` for a tensor with batch and head dims; a random-number seed or offset or an
    empty debug mask (fewer than 3 dims) stays whole."""
    return placement if value.ndim >= 3 else R


def _mask_split(mask: torch.Tensor, dim: int):
    """The mask's placement when attention splits ``dim`` of ``[batch, heads, query, key]``."""
    d = dim - (4 - mask.ndim)
    return S(d) if d >= 0 and mask.shape[d] > 1 else R


register(
    aten._scaled_dot_product_flash_attention_for_cpu.default,
    aten._scaled_dot_product_flash_attention_for_cpu_backward.default,
    aten._scaled_dot_product_efficient_attention.default,
    aten._scaled_dot_product_efficient_attention_backward.default,
    aten._scaled_dot_product_flash_attention.default,
    aten._scaled_dot_product_flash_attention_backward.default,
    aten._scaled_dot_product_cudnn_attention.default,
    aten._scaled_dot_product_cudnn_attention_backward.default,
)(_rows)


@register_arg_layout(aten._scaled_dot_product_efficient_attention_backward.default)
def _efficient_backward_layout(args: list) -> list:
    """The memory-efficient kernel's backward reads ``out`` (argument 5) as its forward lays it
    out, ``[batch, query, heads, head dim]`` in memory; given a contiguous ``[batch, heads, query,
    head dim]`` (a piece moved to another layout, or copied back from host memory) it returns
    wrong gradients in bfloat16 (seen on an H200 with torch 2.11; a copy only where the layout
    differs)."""
    args = list(args)
    args[5] = args[5].transpose(1, 2).contiguous().transpose(1, 2)
    return args
