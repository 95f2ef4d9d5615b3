"""Capture of in-place buffer updates and of batch norm."""

import torch

import autopar
from autopar.examples.convnet import ConvNet
from autopar.passes.capture import OutputKind, capture
from tests.cases import BYTES_DEAR

BATCH = (torch.randn(8, 3, 8, 8), torch.randint(0, 10, (8,)))


def test_buffers_updated_in_place_become_outputs_of_their_new_values():
    captured = capture(ConvNet(), BATCH)
    buffers = [k for k in captured.outputs if k is not None and k.kind == "buffer"]
    assert buffers == [OutputKind("buffer", f"blocks.{i}.bn.{name}") for i in range(2)
                       for name in ("running_mean", "running_var", "num_batches_tracked")]
    values = dict(zip(captured.outputs, captured.graph.graph.output_node().args[0]))
    new_mean = values[OutputKind("buffer", "blocks.0.bn.running_mean")]
    assert tuple(new_mean.meta["val"].shape) == (8,)


def test_batch_norm_is_captured_as_sums():
    captured = capture(ConvNet(), BATCH)
    targets = {str(n.target) for n in captured.graph.graph.nodes if n.op == "call_function"}
    assert not [t for t in targets if "batch_norm" in t or "var" in t]
    assert "aten.sum.dim_IntList" in targets


def test_batch_split_all_reduces_batch_norm_statistics():
    """Data parallelism on 4 ranks: each batch norm all-reduces its per-channel sums (mean and
    variance) in the forward, so every rank normalises with the whole batch's statistics."""
    model = ConvNet()
    pins = {"images": "S(0)", "labels": "S(0)", **{name: "R" for name, _ in model.named_parameters()}}
    plan = autopar.plan(model, autopar.Mesh((4,), ("dp",)), BATCH, hardware=BYTES_DEAR, pins=pins)
    module_of = {n.name: n.module for n in plan.nodes}
    for bn, channels in (("blocks.0.bn", 8), ("blocks.1.bn", 16)):
        synced = [c for c in plan.collectives
                  if c.kind == "all_reduce" and c.phase == "forward" and module_of.get(c.tensor) == bn]
        assert len(synced) == 2, f"{bn}: {synced}"
        assert all(c.bytes == 4 * channels and (c.src, c.dst) == ("(P)", "(R)") for c in synced)
