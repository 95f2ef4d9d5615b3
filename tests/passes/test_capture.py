"""Capture of in-place buffer updates, of batch norm, and of what models written by others
return and take."""

import dataclasses
import importlib.util
import inspect

import pytest
import torch
from autopar.examples.convnet import ConvNet
from autopar.examples.gpt import GPT, GPTConfig
from autopar.examples.mlp import MLP
from autopar.passes.analysis.capture import OutputKind, capture
from torch import nn

import autopar
from autopar.core.placement import S
from tests.cases import BYTES_DEAR
from tests.passes.rule_check import joint_args

HAS_TRANSFORMERS = importlib.util.find_spec("transformers") is not None

aten = torch.ops.aten
BATCH = (torch.randn(8, 3, 8, 8), torch.randint(0, 10, (8,)))


def test_buffers_updated_in_place_become_outputs_of_their_new_values():
    captured = capture(ConvNet(), BATCH)
    buffers = [k for k in captured.outputs if k is not None and k.kind == "buffer"]
    assert buffers == [
        OutputKind("buffer", f"blocks.{i}.bn.{name}")
        for i in range(2)
        for name in ("running_mean", "running_var", "num_batches_tracked")
    ]
    values = dict(zip(captured.outputs, captured.graph.graph.output_node().args[0]))
    new_mean = values[OutputKind("buffer", "blocks.0.bn.running_mean")]
    assert tuple(new_mean.meta["val"].shape) == (8,)


def test_batch_norm_in_training_is_captured_as_one_op_each_way():
    captured = capture(ConvNet(), BATCH)
    targets = [str(n.target) for n in captured.graph.graph.nodes if n.op == "call_function"]
    assert targets.count("aten._native_batch_norm_legit_functional.default") == 2
    assert targets.count("aten.native_batch_norm_backward.default") == 2
    assert not [t for t in targets if "var" in t]  # not decomposed into sums


def test_batch_split_all_reduces_batch_norm_statistics():
    """Data parallelism on 4 ranks: each batch norm all-reduces its per-channel sums (mean and
    variance) in the forward, so every rank normalises with the whole batch's statistics; the
    op makes them itself, on its batch-split input."""
    model = ConvNet()
    pins = {"images": "S(0)", "labels": "S(0)", **{name: "R" for name, _ in model.named_parameters()}}
    plan = autopar.plan(model, autopar.Mesh((4,), ("dp",)), BATCH, hardware=BYTES_DEAR, pins=pins)
    module_of = {n.name: n.module for n in plan.nodes}
    for bn, channels in (("blocks.0.bn", 8), ("blocks.1.bn", 16)):
        synced = [
            c
            for c in plan.collectives
            if c.kind == "all_reduce" and c.phase == "forward" and module_of.get(c.tensor) == bn
        ]
        assert len(synced) == 2, f"{bn}: {synced}"
        assert all(c.bytes == 4 * channels and c.src == c.dst == ((S(0),),) for c in synced)


@dataclasses.dataclass
class _LossAndOutput:
    loss: torch.Tensor
    output: torch.Tensor
    aux: torch.Tensor | None = None


class _ReturnsDataclass(MLP):
    def forward(self, x, target):
        out = self.layers[1](torch.relu(self.layers[0](x)))
        return _LossAndOutput(nn.functional.mse_loss(out, target), out)


class _ReturnsCache(MLP):
    def forward(self, x, target):
        return {"loss": nn.functional.mse_loss(self.layers[1](self.layers[0](x)), target), "cache": object()}


def test_dataclass_outputs_are_captured_and_rebuilt_as_the_same_type():
    model = _ReturnsDataclass(8, 16)
    captured = capture(model, (torch.randn(4, 8), torch.randn(4, 8)))
    assert captured.num_forward_outputs == 2  # the loss and the output; the None field holds nothing
    rebuilt = torch.utils._pytree.tree_unflatten([torch.tensor(1.0), torch.zeros(4, 8)], captured.out_spec)
    assert isinstance(rebuilt, _LossAndOutput) and rebuilt.aux is None


def test_outputs_that_are_not_tensors_are_refused_by_path_with_the_fix():
    with pytest.raises(autopar.CaptureError, match=r"(?s)output\['cache'\] of type object.*use_cache=False"):
        capture(_ReturnsCache(8, 16), (torch.randn(4, 8), torch.randn(4, 8)))


@pytest.mark.skipif(
    not HAS_TRANSFORMERS, reason="Hugging Face transformers is not installed (pip install -e '.[test]')"
)
def test_a_hugging_face_model_returns_its_model_output_and_refuses_a_cache():
    from autopar.examples.hf import gpt2
    from transformers import GPT2Config, GPT2LMHeadModel
    from transformers.modeling_outputs import CausalLMOutputWithCrossAttentions

    model = gpt2(vocab_size=32, seq=8, dim=16, num_layers=1)
    ids = torch.randint(0, 32, (4, 8))

    class Whole(nn.Module):
        def __init__(self, model):
            super().__init__()
            self.model = model

        def forward(self, input_ids, labels):
            return self.model(input_ids=input_ids, labels=labels)

    captured = capture(Whole(model.model), (ids, ids))
    assert captured.out_spec.type is CausalLMOutputWithCrossAttentions and captured.num_forward_outputs == 2
    cached = GPT2LMHeadModel(GPT2Config(vocab_size=32, n_positions=8, n_embd=16, n_head=4, n_layer=1, use_cache=True))
    cache_field = r"(past_key_values|cache)"  # transformers 5.24 renamed the field
    with pytest.raises(
        autopar.CaptureError, match=rf"(?s)output\['{cache_field}'\] of type DynamicCache.*use_cache=False"
    ):
        capture(Whole(cached), (ids, ids))


@pytest.mark.skipif(
    not HAS_TRANSFORMERS, reason="Hugging Face transformers is not installed (pip install -e '.[test]')"
)
def test_a_model_taking_keyword_inputs_says_how_the_inputs_bound_and_to_pass_them_by_keyword():
    from autopar.examples.hf import gpt2
    from transformers import GPT2LMHeadModel

    ids = torch.randint(0, 32, (4, 8))
    model = gpt2(vocab_size=32, seq=8, dim=16, num_layers=1).model
    second = list(inspect.signature(GPT2LMHeadModel.forward).parameters)[2]  # past_key_values, or cache from 5.24
    with pytest.raises(autopar.CaptureError, match=rf"(?s)forward\(input_ids, {second}\).*in order or by keyword"):
        capture(model, (ids, ids))
    captured = capture(model, (ids, ids), keywords=("input_ids", "labels"), fixed={"return_dict": True})
    assert [k.name for k in captured.inputs if k.kind == "input"] == ["input_ids", "labels"]


def test_inputs_passed_by_keyword_are_cast_to_the_compute_dtype():
    captured = capture(nn.Linear(4, 4), (torch.randn(2, 4),), torch.bfloat16, keywords=("input",))
    matmuls = [n for n in captured.graph.graph.nodes if n.target is aten.addmm.default]
    assert matmuls and all(a.meta["val"].dtype == torch.bfloat16 for n in matmuls for a in n.args[:3])


def test_a_model_built_on_the_meta_device_keeps_its_tied_parameters_tied():
    with torch.device("meta"):
        model = GPT(GPTConfig(vocab_size=32, block_size=8, dim=16, num_heads=4, num_layers=1))
        ids = torch.randint(0, 32, (2, 8))
    params = [k.name for k in capture(model, (ids, ids)).inputs if k.kind == "param"]
    assert "tok.weight" in params and "head.weight" not in params  # one parameter, as on a real device


def test_batch_norm_keeps_its_parameters_dtype_under_a_compute_dtype():
    """Its kernel refuses bfloat16 weights beside float32 running statistics; the graph runs."""
    model = ConvNet()
    captured = capture(model, BATCH, param_dtype=torch.bfloat16)
    # the batch norms run on bfloat16 inputs with float32 parameters
    torch.fx.Interpreter(captured.graph).run(*joint_args(model, captured, BATCH))
    norms = [n for n in captured.graph.graph.nodes if "batch_norm_legit" in str(n.target)]
    assert norms and all(n.args[1].meta["val"].dtype == torch.float32 for n in norms)
    assert all(n.args[0].meta["val"].dtype == torch.bfloat16 for n in norms)


class _HalvedGradient(torch.autograd.Function):
    """The identity, whose backward halves the gradient: a backward the forward's ops do not make."""

    @staticmethod
    def forward(ctx, x):
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        return grad * 0.5


_halved_gradient = _HalvedGradient.apply
"""Saved once, as libraries do: calls it make reach no patched ``Function.apply``."""


class _Hooked(nn.Module):
    """A linear layer whose output's gradient the forward changes, by ``how``."""

    def __init__(self, how: str):
        super().__init__()
        self.layer, self.how = nn.Linear(4, 4), how

    def forward(self, x):
        h = self.layer(x)
        if self.how == "function":
            h = _HalvedGradient.apply(h)
        elif self.how == "saved function":
            h = _halved_gradient(h)
        elif self.how == "tensor hook":
            h.register_hook(lambda g: g * 0.5)
        elif self.how == "module hook in the forward" and not self.layer._backward_hooks:
            self.layer.register_full_backward_hook(lambda m, grad_in, grad_out: (grad_in[0] * 0.5,))
            h = self.layer(x)
        return h.sum()


@pytest.mark.parametrize(
    "how, named",
    [
        ("function", "torch.autograd.Function tests.passes.test_capture._HalvedGradient"),
        ("saved function", "torch.autograd.Function tests.passes.test_capture._HalvedGradient"),
        ("tensor hook", "registers gradient hooks on tensors (_Hooked.forward.<locals>.<lambda>)"),
        ("module hook", "backward hooks are registered on layer"),
        ("module hook in the forward", "backward hooks are registered on layer"),
    ],
)
def test_gradients_changed_outside_the_forwards_ops_are_refused_by_name(how, named):
    model = _Hooked(how)
    if how == "module hook":
        model.layer.register_full_backward_hook(lambda m, grad_in, grad_out: (grad_in[0] * 0.5,))
    contexts = torch.autograd.function.BackwardCFunction
    init, register_hook = contexts.__dict__.get("__init__"), torch.Tensor.register_hook
    with pytest.raises(autopar.CaptureError) as info:
        capture(model, (torch.randn(2, 4),))
    assert named in str(info.value) and "register_autograd" in str(info.value)
    assert contexts.__dict__.get("__init__") is init and torch.Tensor.register_hook is register_hook


class _Cubed(torch.autograd.Function):
    """``x³``, whose backward is the derivative of its forward."""

    @staticmethod
    def forward(ctx, x):
        ctx.save_for_backward(x)
        return x**3

    @staticmethod
    def backward(ctx, grad):
        (x,) = ctx.saved_tensors
        return 3 * x**2 * grad


class _CubedLayer(nn.Module):
    def __init__(self):
        super().__init__()
        self.layer = nn.Linear(4, 4)

    def forward(self, x):
        return _Cubed.apply(self.layer(x)).sum()


def test_a_function_declared_the_derivative_of_its_forward_is_differentiated(monkeypatch):
    from autopar.passes.analysis import hooks

    monkeypatch.setattr(hooks, "_DIFFERENTIATED", set())
    model, x = _CubedLayer(), torch.randn(2, 4)
    with pytest.raises(autopar.CaptureError, match="autopar.differentiate_forward"):
        capture(model, (x,))
    assert autopar.differentiate_forward(_Cubed) is _Cubed
    captured = capture(model, (x,))
    outputs, gradients = torch.fx.Interpreter(captured.graph).run(*joint_args(model, captured, (x,)))
    model(x).backward()
    results = zip(captured.outputs, [*outputs, *gradients])
    grads = {kind.name: value for kind, value in results if kind is not None and kind.kind == "grad"}
    assert grads.keys() == {"layer.weight", "layer.bias"}
    for name, param in model.named_parameters():
        torch.testing.assert_close(grads[name], param.grad)
    with pytest.raises(TypeError, match="torch.autograd.Function subclass"):
        autopar.differentiate_forward(lambda x: x)


class _PooledTokens(nn.Module):
    """Tokens pooled over the sequence by ``AdaptiveAvgPool1d`` on their transpose, as Swin's
    pooler pools: AOT autograd replays its views through ``as_strided``."""

    def __init__(self):
        super().__init__()
        self.layer, self.pool = nn.Linear(4, 6), nn.AdaptiveAvgPool1d(1)

    def forward(self, x):
        return self.pool(self.layer(x).transpose(1, 2)).flatten(1).square().sum()


def test_as_strided_over_a_whole_contiguous_tensor_is_captured_as_a_view():
    model, x = _PooledTokens(), torch.randn(2, 5, 4)
    captured = capture(model, (x,))
    targets = {n.target for n in captured.graph.graph.nodes}
    assert aten.as_strided.default not in targets and aten.as_strided_scatter.default not in targets
    outputs, gradients = torch.fx.Interpreter(captured.graph).run(*joint_args(model, captured, (x,)))
    model(x).backward()
    results = zip(captured.outputs, [*outputs, *gradients])
    grads = {kind.name: value for kind, value in results if kind is not None and kind.kind == "grad"}
    for name, param in model.named_parameters():
        torch.testing.assert_close(grads[name], param.grad)


def test_forward_hooks_are_traced_in_and_said_not_to_be_called_at_each_step(caplog):
    model = _Hooked("none")
    model.layer.register_forward_hook(lambda m, args, out: out * 2.0)
    captured = capture(model, (torch.randn(2, 4),))
    assert any(n.target == torch.ops.aten.mul.Tensor for n in captured.graph.graph.nodes)
    assert "forward hooks of layer run while the model is captured" in caplog.text


@pytest.mark.skipif(
    not HAS_TRANSFORMERS, reason="Hugging Face transformers is not installed (pip install -e '.[test]')"
)
def test_hugging_face_gradient_checkpointing_is_captured_unless_reentrant():
    from autopar.examples.hf import zoo

    make = zoo()["llama"]
    for reentrant in (False, True):
        model, inputs = make()
        model.model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": reentrant})
        if not reentrant:
            assert len(capture(model, inputs).graded) == sum(1 for _ in model.parameters())
            continue
        with pytest.raises(autopar.CaptureError, match="use_reentrant=True.*Fix: checkpoint with use_reentrant=False"):
            capture(model, inputs)


def test_a_capture_under_torchs_flop_counter_keeps_its_hooks_out():
    from torch.utils.flop_counter import FlopCounterMode

    model, x = _Hooked("none"), torch.randn(2, 4)
    with FlopCounterMode(display=False):
        counted = capture(model, (x,))
    assert counted.graph_hash == capture(model, (x,)).graph_hash
