"""Plans that Alpa, XLA auto-sharding and GShard record as optimal, found by autopar's solver
under a synthetic α-β profile, asserted on placements and on collective counts and bytes."""

import torch
import torch.nn.functional as F
from autopar.examples.bert import BertConfig, EncoderBlock
from autopar.examples.mlp import MLP
from autopar.examples.moe import Block as MoEBlock
from autopar.examples.moe import MoEConfig
from torch import nn

import autopar
from autopar import Mesh
from autopar.core.placement import R, S

# A FLOP costs what a byte sent costs and each collective call 1 us, about NCCL's latency: the
# published plans are the ones that also keep the number of collectives down.
ALPHA_BETA = autopar.SyntheticProfile(s_per_flop=1e-12, s_per_byte=1e-12, latency_s=1e-6)


def _collectives(plan, phase=None):
    return sorted((c.kind, c.axis, c.bytes) for c in plan.collectives if phase is None or c.phase == phase)


def test_six_layer_mlp_alternates_column_and_row_splits():
    # Alpa tests/shard_parallel/test_mlp.py: L Linear+ReLU layers, batch 32, hidden 256, 4 devices.
    # Data parallelism moves 10x Megatron's bytes, but its gradients go in one bucket, one call
    # against Megatron's 5: bytes decide on a 100 GB/s link; on ALPHA_BETA's 1 TB/s the one call wins
    link_100gbs = autopar.SyntheticProfile(s_per_flop=1e-12, s_per_byte=1e-11, latency_s=1e-6)
    layers, batch, hidden = 6, 32, 256
    plan = autopar.plan(
        MLP(hidden, hidden, num_layers=layers),
        Mesh((4,), ("tp",)),
        (torch.randn(batch, hidden), torch.randn(batch, hidden)),
        hardware=link_100gbs,
    )
    for i in range(layers):
        assert plan.placements[f"layers.{i}.weight"] == ((S(0),) if i % 2 == 0 else (S(1),)), i
    activation = batch * hidden * 4
    assert _collectives(plan) == [("all_reduce", "tp", activation)] * (layers - 1)
    assert len(_collectives(plan, "forward")) == layers // 2  # after each row-split layer
    assert len(_collectives(plan, "backward")) == layers // 2 - 1  # input gradients of the column-split layers


def test_batch_heavy_six_layer_mlp_is_data_parallel():
    layers, batch, hidden = 6, 256, 32
    model = MLP(hidden, hidden, num_layers=layers)
    # the 12 gradients are all-reduced in one bucket, one call against Megatron's 5
    plan = autopar.plan(
        model, Mesh((4,), ("dp",)), (torch.randn(batch, hidden), torch.randn(batch, hidden)), hardware=ALPHA_BETA
    )
    assert all(p == (R,) for p in plan.placements.values())
    assert _collectives(plan, "forward") == []
    assert _collectives(plan, "backward") == [("all_reduce", "dp", sum(p.numel() * 4 for p in model.parameters()))]
    assert [c.tensor for c in plan.collectives if c.phase == "backward"] == ["bucket of 12 gradients"]


def test_2d_mesh_puts_tensor_parallelism_on_the_cheap_axis():
    # Alpa's 2-D MLP case and XLA auto-sharding's TwoMatmul: axis "b" is 10x cheaper than "a"
    batch, dim, hidden = 4096, 256, 1024
    profile = autopar.SyntheticProfile(s_per_flop=1e-12, s_per_byte=(1e-10, 1e-11), latency_s=1e-6)
    plan = autopar.plan(
        MLP(dim, hidden), Mesh((2, 2), ("a", "b")), (torch.randn(batch, dim), torch.randn(batch, dim)), hardware=profile
    )
    assert plan.placements["layers.0.weight"] == (R, S(0))  # column split on the cheap axis
    assert plan.placements["layers.1.weight"] == (R, S(1))  # row split on the cheap axis
    assert plan.node("addmm").outputs == ((S(0), S(1)),)  # batch split on the other
    assert _collectives(plan, "forward") == [("all_reduce", "b", batch // 2 * dim * 4)]
    # gradients summed over the batch split, in one bucket
    assert _collectives(plan, "backward") == [
        ("all_reduce", "a", dim * hidden * 4 // 2 * 2 + hidden * 4 // 2 + dim * 4)
    ]


class _EncoderStack(nn.Module):
    def __init__(self, cfg: BertConfig):
        super().__init__()
        self.blocks = nn.ModuleList(EncoderBlock(cfg) for _ in range(cfg.num_layers))

    def forward(self, x: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = block(x)
        return F.mse_loss(x, target)


def test_bert_layer_stack_is_megatron_with_4l_minus_1_all_reduces():
    # Alpa tests/shard_parallel/test_bert.py: hidden >> batch * sequence
    layers, batch, seq = 2, 2, 8
    cfg = BertConfig(dim=512, num_heads=8, hidden=2048, num_layers=layers, max_seq=seq)
    plan = autopar.plan(
        _EncoderStack(cfg),
        Mesh((4,), ("tp",)),
        (torch.randn(batch, seq, cfg.dim), torch.randn(batch, seq, cfg.dim)),
        hardware=ALPHA_BETA,
    )
    for i in range(layers):
        for column in ("query", "key", "value", "fc1"):
            assert plan.placements[f"blocks.{i}.{column}.weight"] == (S(0),), (i, column)
        for row in ("out", "fc2"):
            assert plan.placements[f"blocks.{i}.{row}.weight"] == (S(1),), (i, row)
    activation = batch * seq * cfg.dim * 4
    assert _collectives(plan) == [("all_reduce", "tp", activation)] * (4 * layers - 1)


class _FusedQKVBlock(EncoderBlock):
    """A BERT layer projecting q, k and v as one tensor, head by head (Megatron's and GPT-NeoX's
    layout), and unbinding them: ``unbind`` in the forward, ``stack`` in the backward."""

    def __init__(self, cfg: BertConfig):
        super().__init__(cfg)
        del self.query, self.key, self.value
        self.qkv = nn.Linear(cfg.dim, 3 * cfg.dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        batch, seq, dim = x.shape
        q, k, v = self.qkv(x).view(batch, seq, self.num_heads, 3, dim // self.num_heads).unbind(3)
        y = F.scaled_dot_product_attention(*(t.transpose(1, 2) for t in (q, k, v)))
        x = self.ln1(x + self.out(y.transpose(1, 2).reshape(batch, seq, dim)))
        return self.ln2(x + self.fc2(F.gelu(self.fc1(x))))


def test_bert_layers_unbinding_a_fused_qkv_are_megatron_with_4l_minus_1_all_reduces():
    layers, batch, seq = 2, 2, 8
    cfg = BertConfig(dim=512, num_heads=8, hidden=2048, num_layers=layers, max_seq=seq)
    model = _EncoderStack(cfg)
    model.blocks = nn.ModuleList(_FusedQKVBlock(cfg) for _ in range(layers))
    plan = autopar.plan(
        model,
        Mesh((4,), ("tp",)),
        (torch.randn(batch, seq, cfg.dim), torch.randn(batch, seq, cfg.dim)),
        hardware=ALPHA_BETA,
    )
    for i in range(layers):
        assert plan.placements[f"blocks.{i}.qkv.weight"] == plan.placements[f"blocks.{i}.fc1.weight"] == (S(0),)
        assert plan.placements[f"blocks.{i}.out.weight"] == plan.placements[f"blocks.{i}.fc2.weight"] == (S(1),)
    activation = batch * seq * cfg.dim * 4
    assert _collectives(plan) == [("all_reduce", "tp", activation)] * (4 * layers - 1)


def test_bert_layer_stack_recomputed_repeats_its_forward_all_reduces():
    # Alpa tests/shard_parallel/test_remat.py: recomputing every layer of the tensor-parallel
    # stack runs each layer's 2 forward all-reduces again in the backward, 4L-1 -> 6L-1
    layers, batch, seq = 2, 2, 8
    cfg = BertConfig(dim=512, num_heads=8, hidden=2048, num_layers=layers, max_seq=seq)
    plan = autopar.plan(
        _EncoderStack(cfg),
        Mesh((4,), ("tp",)),
        (torch.randn(batch, seq, cfg.dim), torch.randn(batch, seq, cfg.dim)),
        hardware=ALPHA_BETA,
        recompute="layers",
    )
    activation = batch * seq * cfg.dim * 4
    assert _collectives(plan) == [("all_reduce", "tp", activation)] * (6 * layers - 1)
    assert len(_collectives(plan, "forward")) == len(_collectives(plan, "recompute")) == 2 * layers
    kept = [n for n in plan.nodes if n.module.startswith("blocks.") and n.activation == "keep"]
    assert [n.module for n in kept] == [f"blocks.{i}.ln2" for i in range(layers)]  # only each layer's output
    assert plan.placements["blocks.1.fc1.weight"] == (S(0),) and plan.placements["blocks.1.fc2.weight"] == (S(1),)


class _MoEStack(nn.Module):
    def __init__(self, cfg: MoEConfig):
        super().__init__()
        self.cfg = cfg
        self.blocks = nn.ModuleList(MoEBlock(cfg) for _ in range(cfg.num_layers))

    def forward(self, x: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        balances = []
        for block in self.blocks:
            x, balance = block(x)
            balances.append(balance)
        return F.mse_loss(x, target) + self.cfg.aux_loss_weight * sum(balances)


def test_moe_block_splits_the_experts_and_dispatches_with_all_to_all():
    # GShard (Lepikhin et al., 2021): expert weights split on the expert dim, dense
    # weights replicated with the tokens split by group, all-to-all dispatch and combine. Many
    # tokens and big experts: all-reducing 16 experts' gradients costs more than moving tokens.
    batch, seq = 16, 512
    cfg = MoEConfig(
        dim=512, num_heads=8, num_layers=1, num_experts=16, expert_hidden=2048, group_size=64, block_size=seq
    )
    with torch.device("meta"):  # planning needs only the shapes
        model = _MoEStack(cfg)
    x = torch.randn(batch, seq, cfg.dim)
    plan = autopar.plan(model, Mesh((4,), ("ep",)), (x, x), hardware=ALPHA_BETA, fallback=False)
    experts = {f"blocks.0.moe.{w}" for w in ("w1", "w2")}
    for name, placements in plan.placements.items():
        assert placements == ((S(0),) if name in experts else (R,)), name
    groups = batch * seq // cfg.group_size
    dispatched = cfg.num_experts * groups * cfg.capacity * cfg.dim * 4 // 4  # [E, G, C, D], a quarter per rank
    assert _collectives(plan, "forward") == [("all_to_all", "ep", dispatched)] * 2  # dispatch, combine
    dense_grads = ("all_reduce", "ep", sum(p.numel() * 4 for n, p in model.named_parameters() if n not in experts))
    assert _collectives(plan, "backward") == sorted(
        [dense_grads] + [("all_to_all", "ep", dispatched)] * 2
    )  # one bucket
    assert _collectives(plan, "output") == [("all_reduce", "ep", 4)]  # the loss, made whole
