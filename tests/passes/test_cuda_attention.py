"""The CUDA attention kernels (flash, memory-efficient, cuDNN) split the batch and the heads.

Their graphs are traced on the meta device, whose kernels give every output's shape, so the
strategies are checked on any machine; the rows are checked against the kernels themselves
where a CUDA device is present (the CPU build has none).
"""

import pytest
import torch
from autopar.passes.propagation.propagate import _op_strategies
from autopar.passes.rules import arg_layout, rule_for
from torch.fx.experimental.proxy_tensor import make_fx

from autopar.core.mesh import Mesh
from autopar.core.placement import R, S
from tests.passes.rule_check import Recorder, check_row

aten = torch.ops.aten
SHAPE = (2, 4, 64, 32)  # batch, heads, sequence, head dim


def _cudnn(q, k, v, grad):
    out = aten._scaled_dot_product_cudnn_attention(q, k, v, None, True, 0.0, True, False)
    return aten._scaled_dot_product_cudnn_attention_backward(
        grad, q, k, v, out[0], out[1], out[6], out[7], None, out[2], out[3], out[4], out[5], 0.0, True
    )


def _flash(q, k, v, grad):
    out = aten._scaled_dot_product_flash_attention(q, k, v, 0.0, True, False)
    return aten._scaled_dot_product_flash_attention_backward(
        grad, q, k, v, out[0], out[1], out[2], out[3], out[4], out[5], 0.0, True, out[6], out[7]
    )


def _efficient(q, k, v, grad):
    out = aten._scaled_dot_product_efficient_attention(q, k, v, None, True, 0.0, True)
    return aten._scaled_dot_product_efficient_attention_backward(
        grad, q, k, v, None, out[0], out[1], out[2], out[3], 0.0, [True, True, True, False], True
    )


KERNELS = {"cudnn": _cudnn, "flash": _flash, "efficient": _efficient}


def _attention_nodes(gm):
    return [n for n in gm.graph.nodes if n.op == "call_function" and "attention" in str(n.target)]


@pytest.mark.parametrize("kernel", KERNELS)
def test_a_cuda_attention_kernel_splits_the_batch_and_the_heads(kernel):
    gm = make_fx(KERNELS[kernel])(*(torch.empty(SHAPE, device="meta", dtype=torch.bfloat16) for _ in range(4)))
    nodes = _attention_nodes(gm)
    assert len(nodes) == 2 and all(rule_for(n.target) is not None for n in nodes)
    for node in nodes:
        splits = {s.outputs[0] for s in _op_strategies(node, Mesh((2,)))}
        assert splits == {(R,), (S(0),), (S(1),)}, node.target


@pytest.mark.skipif(not torch.cuda.is_available(), reason="the CUDA attention kernels need a CUDA device")
@pytest.mark.parametrize("kernel", KERNELS)
def test_every_row_of_a_cuda_attention_kernel_matches_the_kernel(kernel):
    inputs = [torch.randn(SHAPE, device="cuda", dtype=torch.bfloat16) for _ in range(4)]
    gm = make_fx(KERNELS[kernel])(*inputs)
    recorder = Recorder(gm)
    recorder.run(*inputs)
    gen = torch.Generator().manual_seed(0)
    nodes = _attention_nodes(gm)
    checked = []
    for node in nodes:
        outs = node.meta["val"]
        state = tuple(i for i, o in enumerate(outs) if isinstance(o, torch.Tensor) and o.ndim < 3)
        checked += [
            check_row(node, recorder.values, row, gen, rtol=2e-2, atol=2e-2, skip=state)
            for row in rule_for(node.target)(node)
        ]
    assert len(checked) == 6 and all(checked)


def test_the_memory_efficient_backward_gets_its_output_in_the_kernels_layout():
    fix = arg_layout(aten._scaled_dot_product_efficient_attention_backward.default)
    as_made = torch.randn(2, 64, 4, 32).transpose(1, 2)  # [batch, heads, query, head dim] over [b, q, h, d]
    moved = as_made.contiguous()  # a piece as a move or a copy back from the host gives it
    args = [None] * 5 + [moved]
    fixed = fix(args)[5]
    assert torch.equal(fixed, moved) and fixed.stride() == as_made.stride()
    kept = fix([None] * 5 + [as_made])[5]
    assert kept.data_ptr() == as_made.data_ptr() and kept.stride() == as_made.stride()  # no copy where it is
