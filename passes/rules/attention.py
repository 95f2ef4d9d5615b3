"""Scaled dot-product attention, forward and backward: split the batch or the heads.

An attention mask (``attn_mask``) broadcasts to ``[batch, heads, query, key]`` from the right; a
mask shared along the split dim (one mask for every head) stays whole on every rank.
"""

import torch
from torch import fx

from autopar.placement import R, S
from autopar.passes.rules import Row, register, tensor_args, val

aten = torch.ops.aten


def _rows(node: fx.Node) -> list[Row]:
    outs = val(node)
    args = tensor_args(node)
    mask = node.kwargs.get("attn_mask")

    def out_row(p):
        return tuple(None if not isinstance(o, torch.Tensor) else p for o in outs)

    def in_row(dim):
        return tuple(_mask_split(val(a), dim) if a is mask else S(dim) for a in args)

    return [
        (out_row(R), (R,) * len(args)),
        (out_row(S(0)), in_row(0)),  # split the batch: every sequence stays on one rank
        (out_row(S(1)), in_row(1)),  # split the heads: attention is per head
    ]


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
)(_rows)
