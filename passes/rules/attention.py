"""Scaled dot-product attention, forward and backward: split the batch or the heads."""

import torch
from torch import fx

from autopar.placement import R, S
from autopar.passes.rules import Row, register, tensor_args, val

aten = torch.ops.aten


def _rows(node: fx.Node) -> list[Row]:
    outs = val(node)
    num_in = len(tensor_args(node))

    def out_row(p):
        return tuple(None if not isinstance(o, torch.Tensor) else p for o in outs)

    return [
        (out_row(R), (R,) * num_in),
        (out_row(S(0)), (S(0),) * num_in),  # split the batch: every sequence stays on one rank
        (out_row(S(1)), (S(1),) * num_in),  # split the heads: attention is per head
    ]


register(
    aten._scaled_dot_product_flash_attention_for_cpu.default,
    aten._scaled_dot_product_flash_attention_for_cpu_backward.default,
    aten._scaled_dot_product_efficient_attention.default,
    aten._scaled_dot_product_efficient_attention_backward.default,
    aten._scaled_dot_product_flash_attention.default,
    aten._scaled_dot_product_flash_attention_backward.default,
)(_rows)
