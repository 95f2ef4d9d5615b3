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

import importlib.util

import pytest
import torch
from torch import fx, nn
from torch.nn import functional as F

from autopar.mesh import Mesh
from autopar.placement import P, Partial, R, Replicate, S, Shard
from autopar.passes.capture import capture
from autopar.passes.propagate import placement_problem
from autopar.passes.rewrite import local_call_args
from autopar.passes.rules import registered_ops, rule_for, tensor_args
from autopar.passes.strategy import Strategy
from autopar.examples.bert import Bert, BertConfig, masked_batch
from autopar.examples.convnet import ConvNet, ConvNetConfig
from autopar.examples.gpt import GPT, GPTConfig
from autopar.examples.llama import Llama, LlamaConfig
from autopar.examples.mlp import MLP
from autopar.examples.moe import MoEConfig, MoEGPT

MESH = Mesh((2,))
aten = torch.ops.aten

HAS_TRANSFORMERS = importlib.util.find_spec("transformers") is not None

# ops whose every row is checked on every node that uses them: the MoE routing ops,
# convolutions and pooling, advanced indexing and padding
EVERY_ROW_CHECKED = {aten.topk.default, aten.cumsum.default, aten.new_zeros.default,
                     aten._assert_tensor_metadata.default, aten.scatter.src,
                     aten.convolution.default, aten.convolution_backward.default,
                     aten.max_pool2d_with_indices.default, aten.max_pool2d_with_indices_backward.default,
                     aten.avg_pool2d.default, aten.avg_pool2d_backward.default,
                     aten._adaptive_avg_pool2d.default, aten._adaptive_avg_pool2d_backward.default,
                     aten.index.Tensor, aten.constant_pad_nd.default}
# and in Hugging Face models: the indexing that builds attention masks, the padding of labels
HF_EVERY_ROW_CHECKED = {aten.index.Tensor, aten.new_ones.default, aten.constant_pad_nd.default}


class _PoolNet(nn.Module):
    """The convolution and pooling ops the ConvNet example leaves out: convolutions with a bias,
    a transposed convolution, average pooling and adaptive average pooling to more than 1x1."""

    def __init__(self):
        super().__init__()
        self.conv = nn.Conv2d(4, 4, 3, padding=1)
        self.up = nn.ConvTranspose2d(4, 4, 2, stride=2)
        self.head = nn.Linear(16, 4)

    def forward(self, x, target):
        x = self.up(F.avg_pool2d(self.conv(x), 2))
        return F.mse_loss(self.head(F.adaptive_avg_pool2d(x, 2).flatten(1)), target)


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


class _Recorder(fx.Interpreter):
    def __init__(self, gm):
        super().__init__(gm)
        self.values = {}

    def run_node(self, n):
        out = super().run_node(n)
        self.values[n] = out
        return out


def _real_values(model, inputs):
    captured = capture(model, inputs)
    state = {**dict(model.named_parameters()), **dict(model.named_buffers())}
    args = []
    user = iter(inputs)
    for node, kind in zip(captured.placeholders, captured.inputs):
        if kind.kind in ("param", "buffer"):
            args.append(state[kind.name].detach())
        elif kind.kind == "input":
            args.append(next(user))
        else:
            args.append(torch.ones(node.meta["val"].shape, dtype=node.meta["val"].dtype))
    recorder = _Recorder(captured.graph)
    recorder.run(*args)
    return captured, recorder.values


def _pieces(value: torch.Tensor, placement, gen):
    if isinstance(placement, Shard):
        return [c.contiguous() for c in torch.chunk(value, 2, placement.dim)]  # as the rewriter slices
    if isinstance(placement, Replicate):
        return [value, value]
    share = torch.rand(value.shape, generator=gen, dtype=value.dtype)
    finite = torch.isfinite(value)  # an infinite entry (a mask's -inf) is one rank's summand, the other's is 0
    first = torch.where(finite, value * share, value)
    return [first, torch.where(finite, value - first, 0)]


def _combine(pieces, placement):
    if isinstance(placement, Shard):
        return torch.cat(pieces, placement.dim)
    if isinstance(placement, Partial):
        return pieces[0] + pieces[1]
    assert torch.equal(pieces[0], pieces[1]), "a replicated output differs between ranks"
    return pieces[0]


def _check_row(node, values, row, gen) -> bool:
    """True if the row was checked, False if the shapes do not allow it on 2 ranks."""
    outs, ins = row
    args = tensor_args(node)
    out_vals = values[node] if isinstance(values[node], (list, tuple)) else [values[node]]
    metas = [a.meta["val"] for a in args] + [o for o in out_vals]
    places = list(ins) + list(outs)
    if any(p is not None and t is not None and placement_problem(t, (p,), MESH) for t, p in zip(metas, places)):
        return False
    arg_pieces = [_pieces(values[a], p, gen) for a, p in zip(args, ins)]
    strategy = Strategy(tuple(None if o is None else (o,) for o in outs), tuple((p,) for p in ins))
    results = []
    for rank in range(2):
        call_args, call_kwargs = local_call_args(node, [p[rank] for p in arg_pieces], strategy, MESH)
        result = node.target(*call_args, **call_kwargs)
        results.append(result if isinstance(result, (list, tuple)) else [result])
    for i, placement in enumerate(outs):
        if placement is None or out_vals[i] is None:
            continue
        got = _combine([results[0][i], results[1][i]], placement)
        torch.testing.assert_close(got, out_vals[i], rtol=1e-4, atol=1e-5,
                                   msg=lambda m: f"{node.name} ({node.target}) row {row}: {m}")
    return True


def _validate(cases, every_row: set, gen) -> tuple[set, int]:
    """Check every row of every op node of the cases' joint graphs; return the ops and the
    number of rows checked."""
    checked_ops, checked_rows = set(), 0
    for model, inputs in cases:
        captured, values = _real_values(model, inputs)
        for node in captured.graph.graph.nodes:
            if node.op != "call_function" or node.target.__name__ == "getitem":
                continue
            rule = rule_for(node.target)
            assert rule is not None, f"{node.target} in {type(model).__name__} has no rule"
            rows = rule(node)
            done = [_check_row(node, values, row, gen) for row in rows]
            assert any(done), f"no row of {node.target} could be checked"
            if node.target in every_row:
                skipped = [row for row, d in zip(rows, done) if not d]
                assert not skipped, f"rows {skipped} of {node.name} ({node.target}) were not checked"
            checked_rows += sum(done)
            checked_ops.add(node.target)
    assert every_row <= checked_ops, every_row - checked_ops
    return checked_ops, checked_rows


def test_every_rule_row_matches_the_whole_tensor_result():
    gen = torch.Generator().manual_seed(0)
    torch.manual_seed(0)
    gpt = GPT(GPTConfig(vocab_size=32, block_size=8, dim=16, num_heads=4, num_layers=1))
    bert_cfg = BertConfig(vocab_size=32, max_seq=8, dim=16, num_heads=4, hidden=32, num_layers=1)
    llama = Llama(LlamaConfig(vocab_size=32, dim=16, num_heads=4, num_kv_heads=2, hidden=32, num_layers=1, max_seq=8))
    # capacity 4 (even) so that every routing tensor splits in two
    moe = MoEGPT(MoEConfig(vocab_size=32, block_size=8, dim=16, num_heads=4, num_layers=1, num_experts=4,
                           expert_hidden=32, group_size=8, capacity_factor=1.0))
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
    ]
    checked_ops, checked_rows = _validate(cases, EVERY_ROW_CHECKED, gen)
    print(f"validated {checked_rows} rows of {len(checked_ops)} ops")
    assert len(checked_ops) >= 35
    assert checked_rows >= 250


@pytest.mark.skipif(not HAS_TRANSFORMERS, reason="Hugging Face transformers is not installed (pip install -e '.[test]')")
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
