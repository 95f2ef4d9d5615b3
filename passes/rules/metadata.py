"""Ops that only read a tensor's metadata: dtype, device and layout assertions."""

import torch
from autopar.passes.rules import Row, register, val
from torch import fx

from autopar.core.placement import P, R, S

aten = torch.ops.aten


@register(aten._assert_tensor_metadata.default)
def assert_metadata_rule(node: fx.Node) -> list[Row]:
    """``_assert_tensor_metadata(x, size, stride, dtype, device=, layout=)`` returns nothing;
    ``torch.export`` puts one before each ``Tensor.to``."""
    x = val(node.args[0])
    checks_shape = any(node.args[i] is not None for i in (1, 2) if i < len(node.args)) or any(
        node.kwargs.get(k) is not None for k in ("size", "stride")
    )
    rows: list[Row] = [((None,), (R,))]  # a whole tensor has every property checked
    if checks_shape:
        return rows  # a local piece has another size and strides
    rows += [((None,), (S(d),)) for d in range(x.ndim)]  # a piece has the whole tensor's dtype, device, layout
    if x.is_floating_point():
        rows.append(((None,), (P,)))  # so has a partial sum
    return rows
