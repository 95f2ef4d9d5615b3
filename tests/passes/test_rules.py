"""Every rule row checked against ground truth on the joint graphs of the example models.

For each op node and each row its rule offers on a 2-way axis, the node's real inputs are cut
into the two ranks' pieces as the row says (split, copied, or cut into two summands for a
partial sum), the op runs on each rank's pieces with local shape arguments, and the pieces of
the outputs are put back together (concatenated, checked equal, or summed) and compared with
the op's output on the whole tensors. Rows that the shapes do not allow on 2 ranks (odd sizes,
partial sums of integers) are skipped, except for the ops in ``EVERY_ROW_CHECKED``, whose every
row the cases exercise. Models from Hugging Face transformers are checked in a test of their own,
skipped where transformers is not installed.
"""

import functools
import importlib.util

import pytest
import torch
from autopar.examples.bert import Bert, BertConfig, masked_batch
from autopar.examples.convnet import ConvNet, ConvNetConfig
from autopar.examples.gpt import GPT, GPTConfig
from autopar.examples.llama import Llama, LlamaConfig
from autopar.examples.mlp import MLP
from autopar.examples.moe import MoEConfig, MoEGPT
from autopar.passes.analysis.capture import capture
from autopar.passes.propagation.rank_ops import local_call_args
from autopar.passes.rules import registered_ops, rule_for
from torch import nn
from torch.nn import functional as F

from autopar.core.placement import P, R, S
from autopar.core.strategy import Strategy
from tests.passes.opdb_samples import validate_op_db
from tests.passes.rule_check import MESH, Recorder, check_row, joint_args

aten = torch.ops.aten

HAS_TRANSFORMERS = importlib.util.find_spec("transformers") is not None

# ops whose every row is checked on every node that uses them: the MoE routing ops,
# convolutions, pooling and ReLU6's backward, advanced indexing and padding
EVERY_ROW_CHECKED = {
    aten.topk.default,
    aten.cumsum.default,
    aten.new_zeros.default,
    aten._assert_tensor_metadata.default,
    aten.scatter.src,
    aten.convolution.default,
    aten.convolution_backward.default,
    aten.max_pool2d_with_indices.default,
    aten.max_pool2d_with_indices_backward.default,
    aten.avg_pool2d.default,
    aten.avg_pool2d_backward.default,
    aten._adaptive_avg_pool2d.default,
    aten._adaptive_avg_pool2d_backward.default,
    aten.hardtanh_backward.default,
    aten.index.Tensor,
    aten.constant_pad_nd.default,
    aten.unbind.int,
    aten.stack.default,
    aten._safe_softmax.default,
    aten.select_backward.default,
    aten.copy.default,
    aten.fill.Tensor,
    aten.slice_scatter.default,
    aten.select_scatter.default,
    aten.repeat.default,
    aten.scatter_add.default,
    aten.baddbmm.default,
    aten.native_group_norm.default,
    aten.native_group_norm_backward.default,
    aten.softplus_backward.default,
    aten.elu_backward.default,
    aten.leaky_relu_backward.default,
    aten.hardswish.default,
    aten.hardswish_backward.default,
    aten.hardsigmoid_backward.default,
    aten.mish_backward.default,
    # ops with rows that split the dim they reduce or index (SplitOp)
    aten.embedding.default,
    aten.embedding_dense_backward.default,
    aten.gather.default,
    aten.scatter.value,
    aten._log_softmax.default,
    aten._log_softmax_backward_data.default,
}
# registered ops that neither validator can run, and why
_CUDA_ONLY = (
    "a CUDA kernel; this CPU build has none (the CPU flash attention op is validated, and "
    "tests/passes/test_cuda_attention.py checks the CUDA kernels where a GPU is present)"
)
_UNINITIALISED = "returns uninitialised memory: there are no values to compare"
_RANDOM = (
    "a random draw, run whole on every rank: its values match one device's when every rank draws "
    "from the same generator state, which the graph-diff run with dropout (hf-gpt2-dropout) checks"
)
NOT_RUNNABLE = {
    aten.bernoulli.p: _RANDOM,
    aten._scaled_dot_product_efficient_attention.default: _CUDA_ONLY,
    aten._scaled_dot_product_efficient_attention_backward.default: _CUDA_ONLY,
    aten._scaled_dot_product_flash_attention.default: _CUDA_ONLY,
    aten._scaled_dot_product_flash_attention_backward.default: _CUDA_ONLY,
    aten._scaled_dot_product_cudnn_attention.default: _CUDA_ONLY,
    aten._scaled_dot_product_cudnn_attention_backward.default: _CUDA_ONLY,
    aten.empty.memory_format: _UNINITIALISED,
    aten.empty_like.default: _UNINITIALISED,
}
# and in Hugging Face models: the indexing that builds attention masks, the padding of labels
HF_EVERY_ROW_CHECKED = {aten.index.Tensor, aten.new_ones.default, aten.constant_pad_nd.default}


class _PoolNet(nn.Module):
    """The convolution and pooling ops the ConvNet example leaves out: convolutions with a bias,
    a transposed convolution, average pooling and adaptive average pooling to more than 1x1; and
    ReLU6, MobileNetV2's activation, whose backward (``hardtanh_backward``) has a rule of its own."""

    def __init__(self):
        super().__init__()
        self.conv = nn.Conv2d(4, 4, 3, padding=1)
        self.up = nn.ConvTranspose2d(4, 4, 2, stride=2)
        self.head = nn.Linear(16, 4)

    def forward(self, x, target):
        x = self.up(F.avg_pool2d(F.relu6(self.conv(x)), 2))
        return F.mse_loss(self.head(F.adaptive_avg_pool2d(x, 2).flatten(1)), target)


class _UnbindNet(nn.Module):
    """q, k and v unbound from one projection (their gradients stacked back), a safe softmax and
    a selected position (its gradient put back by ``select_backward``)."""

    def __init__(self):
        super().__init__()
        self.qkv = nn.Linear(8, 24)

    def forward(self, x, target):
        q, k, v = self.qkv(x).view(4, 6, 3, 8).permute(2, 0, 1, 3).unbind(0)
        attended = torch.ops.aten._safe_softmax(q @ k.transpose(-2, -1), -1) @ v
        return F.mse_loss(attended[:, 0], target)


class _ShiftNet(nn.Module):
    """Labels shifted right into a new tensor with a start token, as encoder-decoders (T5, BART)
    make their decoder's inputs: a copy, a slice and a select written back, a constant filled in."""

    def __init__(self):
        super().__init__()
        self.emb = nn.Embedding(16, 8)
        self.start = 3

    def forward(self, labels, target):
        shifted = labels.new_zeros(labels.shape)
        shifted[:, 2:] = labels[:, :-2].clone()
        shifted[:, 0] = self.start
        return F.mse_loss(self.emb(shifted).sum(1), target)


class _ActivationNet(nn.Module):
    """Activations whose gradients torch does not tag pointwise (Mamba's softplus among them), a
    repeat that tiles one dim and keeps the others and a scatter_add along one dim (DeBERTa's
    relative attention), a batched matmul added to a broadcast bias (BLOOM's ALiBi) and a group
    norm."""

    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(8, 8)
        self.bias = nn.Parameter(torch.randn(1, 1, 4))
        self.norm = nn.GroupNorm(2, 4)

    def forward(self, x, index, target):
        h = self.norm(self.lin(x))
        acts = [F.softplus, F.elu, F.leaky_relu, F.hardswish, F.hardsigmoid, F.mish, F.softshrink, F.hardshrink]
        h = sum(act(h) for act in acts)
        tiled = h.repeat(1, 2, 1)[:, :4]
        added = torch.zeros_like(h).scatter_add(2, index, tiled)
        scores = torch.baddbmm(self.bias, added, h.transpose(1, 2), beta=0.5, alpha=2.0)
        return F.mse_loss((scores @ added).sum(1), target)


class _IndexPadNet(nn.Module):
    """Advanced indexing with the indexed dims adjacent and apart, and zero padding with its
    backward (a crop): the ops Hugging Face models build masks and shift labels with."""

    def __init__(self):
        super().__init__()
        self.head = nn.Linear(4, 4)

    def forward(self, x, rows, target):
        padded = F.pad(self.head(x), (0, 2))  # [4, 6, 6]
        return F.mse_loss(padded.sum(1), target) + x[:, rows].mean() + x[rows, :, rows].mean()


class _PaddedCausalLM(nn.Module):
    """A Hugging Face causal LM called with a padding mask, which the attention reads."""

    def __init__(self, model):
        super().__init__()
        self.model = model

    def forward(self, input_ids, attention_mask, labels):
        return self.model(input_ids=input_ids, attention_mask=attention_mask, labels=labels).loss


def _real_values(model, inputs):
    captured = capture(model, inputs)
    recorder = Recorder(captured.graph)
    recorder.run(*joint_args(model, captured, inputs))
    return captured, recorder.values


def _validate(cases, every_row: set, gen) -> tuple[set, int]:
    """Check every row of every op node of the cases' joint graphs; return the ops and the
    number of rows checked."""
    checked_ops, checked_rows = set(), 0
    for model, inputs in cases:
        captured, values = _real_values(model, inputs)
        for node in captured.graph.graph.nodes:
            if node.op != "call_function" or node.target.__name__ == "getitem":
                continue
            if NOT_RUNNABLE.get(node.target) in (_UNINITIALISED, _RANDOM):
                continue  # no values to compare
            rule = rule_for(node.target)
            assert rule is not None, f"{node.target} in {type(model).__name__} has no rule"
            rows = rule(node)
            done = [check_row(node, values, row, gen) for row in rows]
            assert any(done), f"no row of {node.target} could be checked"
            if node.target in every_row:
                skipped = [row for row, d in zip(rows, done) if not d]
                assert not skipped, f"rows {skipped} of {node.name} ({node.target}) were not checked"
            checked_rows += sum(done)
            checked_ops.add(node.target)
    assert every_row <= checked_ops, every_row - checked_ops
    return checked_ops, checked_rows


@functools.cache
def _validated_on_examples() -> tuple[set, int]:
    """Every row of every rule used by the example models, checked (cached: two tests read it)."""
    gen = torch.Generator().manual_seed(0)
    torch.manual_seed(0)
    gpt = GPT(GPTConfig(vocab_size=32, block_size=8, dim=16, num_heads=4, num_layers=1))
    bert_cfg = BertConfig(vocab_size=32, max_seq=8, dim=16, num_heads=4, hidden=32, num_layers=1)
    llama = Llama(LlamaConfig(vocab_size=32, dim=16, num_heads=4, num_kv_heads=2, hidden=32, num_layers=1, max_seq=8))
    # capacity 4 (even) so that every routing tensor splits in two
    moe = MoEGPT(
        MoEConfig(
            vocab_size=32,
            block_size=8,
            dim=16,
            num_heads=4,
            num_layers=1,
            num_experts=4,
            expert_hidden=32,
            group_size=8,
            capacity_factor=1.0,
        )
    )
    cases = [
        (MLP(8, 16, num_layers=3), (torch.randn(4, 8), torch.randn(4, 8))),
        (gpt, (torch.randint(0, 32, (4, 8)), torch.randint(0, 32, (4, 8)))),
        (llama, (torch.randint(0, 32, (4, 8)), torch.randint(0, 32, (4, 8)))),
        (Bert(bert_cfg), masked_batch(bert_cfg, 4, 8, gen)),
        (moe, (torch.randint(0, 32, (4, 8)), torch.randint(0, 32, (4, 8)))),
        # 4 input channels (even) so that every convolution's input channels split in two
        (ConvNet(ConvNetConfig(in_channels=4)), (torch.randn(4, 4, 8, 8), torch.randint(0, 10, (4,)))),
        (_PoolNet(), (torch.randn(4, 4, 8, 8), torch.randn(4, 4))),
        (_IndexPadNet(), (torch.randn(4, 6, 4), torch.randint(0, 4, (2, 2)), torch.randn(4, 6))),
        (_UnbindNet(), (torch.randn(4, 6, 8), torch.randn(4, 8))),
        (_ShiftNet(), (torch.randint(0, 16, (4, 8)), torch.randn(4, 8))),
        (_ActivationNet(), (torch.randn(4, 4, 8), torch.randint(0, 8, (4, 4, 8)), torch.randn(4, 8))),
    ]
    ops, rows = _validate(cases, EVERY_ROW_CHECKED, gen)
    # Mixtral's mixture of experts runs a grouped matmul op of its own; MobileNetV2 has depthwise
    # convolutions, TensorFlow-style padding and ReLU6
    if HAS_TRANSFORMERS:
        from autopar.examples.hf import zoo

        small = zoo(batch=4, seq=8, dim=16, num_layers=1)
        more_ops, more_rows = _validate([small["mixtral"](), small["mobilenet_v2"]()], set(), gen)
        ops, rows = ops | more_ops, rows + more_rows
    return ops, rows


def test_every_rule_row_matches_the_whole_tensor_result():
    checked_ops, checked_rows = _validated_on_examples()
    print(f"validated {checked_rows} rows of {len(checked_ops)} ops")
    assert len(checked_ops) >= 35
    assert checked_rows >= 250


@pytest.mark.skipif(
    not HAS_TRANSFORMERS, reason="Hugging Face transformers is not installed (pip install -e '.[test]')"
)
def test_every_rule_row_of_hugging_face_models_matches_the_whole_tensor_result():
    """GPT-2 and LLaMA from transformers, and GPT-2 with a padding mask: the mask is built by
    advanced indexing, and the labels are padded before they are shifted."""
    from autopar.examples import hf

    gen = torch.Generator().manual_seed(0)
    torch.manual_seed(0)
    ids = torch.randint(0, 32, (4, 8))
    padding = torch.ones(4, 8, dtype=torch.long)
    padding[0, 6:] = 0
    sizes = {"vocab_size": 32, "seq": 8, "dim": 16, "num_heads": 4, "num_layers": 1}
    cases = [
        (hf.gpt2(**sizes), (ids, ids)),
        (hf.llama(**sizes, hidden=32), (ids, ids)),
        (_PaddedCausalLM(hf.gpt2(**sizes).model), (ids, padding, ids)),
    ]
    checked_ops, checked_rows = _validate(cases, HF_EVERY_ROW_CHECKED, gen)
    print(f"validated {checked_rows} rows of {len(checked_ops)} ops")


def test_every_registered_rule_is_validated_on_example_graphs_or_op_db_samples():
    """No rule is exempt: each registered op has rows checked by one validator or the other."""
    on_examples, _ = _validated_on_examples()
    on_op_db = validate_op_db().registered_validated
    validated = {str(op) for op in on_examples | on_op_db | set(NOT_RUNNABLE)}  # rules may be registered by name
    missing = sorted(str(op) for op in registered_ops() if str(op) not in validated)
    assert not missing, (
        f"registered ops validated neither on the example models' graphs nor on op_db samples: {missing}"
    )


def test_registering_an_op_twice_raises():
    from autopar.passes.rules import register

    op = registered_ops()[0]
    with pytest.raises(ValueError, match="already registered"):
        register(op)(lambda node: [])


def test_the_bias_gradient_shape_of_a_convolution_backward_is_made_local():
    """``convolution_backward`` takes the bias gradient's shape as an argument (``bias_sizes``):
    with the output channels split, each rank passes its piece's, or a trace on fake tensors
    would give the whole shape."""
    captured = capture(_PoolNet(), (torch.randn(4, 4, 8, 8), torch.randn(4, 4)))
    node = next(n for n in captured.graph.graph.nodes if n.target is aten.convolution_backward.default)
    split_filters = Strategy(((P,), (S(0),), (S(0),)), ((S(1),), (R,), (S(0),)))
    args, _ = local_call_args(node, [torch.empty(0)] * 3, split_filters, MESH)
    assert node.args[3] == [4] and args[3] == [2]
