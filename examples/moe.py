"""A mixture-of-experts decoder: GPT-style blocks whose MLP is a set of experts with top-k gating.

The MoE layer is the GShard / Switch Transformer dense dispatch, written with static shapes so
that ``torch.export`` captures it. Tokens are cut into groups of ``group_size``; in each group
every token picks its ``top_k`` experts from a softmax router, and each expert takes at most
``capacity`` tokens per group (first choices before second choices, in token order; a token
over capacity is dropped from that expert and keeps only its residual). Routing is a pair of
one-hot tensors of shape ``[groups, tokens_per_group, experts, capacity]``:

- ``dispatch`` says which token fills which slot of which expert, and
  ``einsum("gsec,gsd->egcd")`` gathers the experts' inputs;
- the experts run as one batched matmul over the expert dim with weights of shape
  ``[experts, dim, hidden]`` and ``[experts, hidden, dim]``;
- ``combine`` (``dispatch`` weighted by the gates) sums each token's expert outputs back with
  ``einsum("gsec,egcd->gsd")``.

A split of the tokens by group and a split of the experts' work by expert are the same tensor
split on two different dims, so moving between them is one all-to-all, which is how GShard
runs expert parallelism. A Switch-style load-balancing term, computed per group as GShard
does, is added to the loss.
"""

import math
from dataclasses import dataclass

import torch
from autopar.examples.gpt import Attention, GPTConfig
from torch import nn
from torch.nn import functional as F


@dataclass(frozen=True, slots=True)
class MoEConfig:
    """Sizes of a :class:`MoEGPT`."""

    vocab_size: int = 256
    """Number of token ids."""
    block_size: int = 32
    """Longest sequence the position embedding covers."""
    dim: int = 64
    """Width of the residual stream."""
    num_heads: int = 4
    """Attention heads; ``dim`` must be a multiple of it."""
    num_layers: int = 2
    """Transformer blocks, each with attention and an MoE MLP."""
    num_experts: int = 8
    """Experts per MoE layer."""
    expert_hidden: int = 128
    """Width of each expert's MLP."""
    top_k: int = 2
    """Experts each token is sent to."""
    group_size: int = 32
    """Tokens per routing group; the batch's token count must be a multiple of it."""
    capacity_factor: float = 1.25
    """Slots per expert and group, relative to an even share of the group's ``top_k`` choices."""
    aux_loss_weight: float = 0.01
    """Weight of the load-balancing term in the returned loss."""

    @property
    def capacity(self) -> int:
        """Tokens each expert takes from one group."""
        return math.ceil(self.top_k * self.group_size * self.capacity_factor / self.num_experts)


def routing(probs: torch.Tensor, top_k: int, capacity: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(dispatch, combine, first_choice)`` from router probabilities ``probs[G, S, E]``.

    ``dispatch[g, s, e, c]`` is 1 where token ``s`` of group ``g`` fills slot ``c`` of expert
    ``e``; ``combine`` holds the token's normalised gate there instead; ``first_choice[g, s, e]``
    is the one-hot of each token's top expert (for the load-balancing term).
    """
    groups, size, num_experts = probs.shape
    gates, chosen_ids = probs.topk(top_k, dim=-1)  # [G, S, k]
    gates = gates / gates.sum(-1, keepdim=True)
    experts = torch.arange(num_experts, device=probs.device)
    chosen = (chosen_ids.unsqueeze(-1) == experts).to(probs.dtype)  # [G, S, k, E]
    # slot of each choice in its expert: count earlier choices, all first choices before seconds
    choice_major = chosen.transpose(1, 2).reshape(groups, top_k * size, num_experts)
    position = (choice_major.cumsum(1) - 1).reshape(groups, top_k, size, num_experts).transpose(1, 2)
    slots = torch.arange(capacity, device=probs.device).to(probs.dtype)
    in_slot = (position.unsqueeze(-1) == slots).to(probs.dtype) * chosen.unsqueeze(-1)  # [G, S, k, E, C]
    dispatch = in_slot.sum(2)
    combine = (in_slot * gates[..., None, None]).sum(2)
    return dispatch, combine, chosen[:, :, 0]


class MoE(nn.Module):
    """Top-k routed experts with a capacity per expert and group (see the module docstring)."""

    def __init__(self, cfg: MoEConfig):
        super().__init__()
        self.cfg = cfg
        self.router = nn.Linear(cfg.dim, cfg.num_experts, bias=False)
        self.w1 = nn.Parameter(torch.randn(cfg.num_experts, cfg.dim, cfg.expert_hidden) * cfg.dim**-0.5)
        self.w2 = nn.Parameter(torch.randn(cfg.num_experts, cfg.expert_hidden, cfg.dim) * cfg.expert_hidden**-0.5)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """``x[B, T, D]`` → the experts' output of the same shape and the load-balancing term."""
        cfg = self.cfg
        if x.shape[0] * x.shape[1] % cfg.group_size:
            raise ValueError(
                f"MoE: the batch's {x.shape[0] * x.shape[1]} tokens ({x.shape[0]} x {x.shape[1]}) do not "
                f"split into groups of group_size={cfg.group_size}; pass a batch whose token count is a "
                "multiple of it"
            )
        tokens = x.reshape(-1, cfg.group_size, cfg.dim)  # [G, S, D]
        probs = self.router(tokens).softmax(-1)
        dispatch, combine, first_choice = routing(probs, cfg.top_k, cfg.capacity)
        expert_in = torch.einsum("gsec,gsd->egcd", dispatch, tokens)
        groups = tokens.shape[0]
        hidden = F.gelu(torch.bmm(expert_in.reshape(cfg.num_experts, -1, cfg.dim), self.w1))
        expert_out = torch.bmm(hidden, self.w2).reshape(cfg.num_experts, groups, cfg.capacity, cfg.dim)
        out = torch.einsum("gsec,egcd->gsd", combine, expert_out)
        # Switch Transformer, per group as GShard computes it: experts' share of the group's first
        # choices times their mean probability in the group
        balance = cfg.num_experts * (first_choice.mean(1) * probs.mean(1)).sum(-1).mean()
        return out.reshape(x.shape), balance


class Block(nn.Module):
    def __init__(self, cfg: MoEConfig):
        super().__init__()
        self.ln1 = nn.LayerNorm(cfg.dim)
        self.attn = Attention(GPTConfig(dim=cfg.dim, num_heads=cfg.num_heads))
        self.ln2 = nn.LayerNorm(cfg.dim)
        self.moe = MoE(cfg)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        x = x + self.attn(self.ln1(x))
        out, balance = self.moe(self.ln2(x))
        return x + out, balance


class MoEGPT(nn.Module):
    """``forward(idx, targets)`` returns the mean cross-entropy of next-token prediction plus
    the weighted load-balancing terms of the MoE layers."""

    def __init__(self, cfg: MoEConfig = MoEConfig()):
        super().__init__()
        self.cfg = cfg
        self.tok = nn.Embedding(cfg.vocab_size, cfg.dim)
        self.pos = nn.Embedding(cfg.block_size, cfg.dim)
        self.blocks = nn.ModuleList(Block(cfg) for _ in range(cfg.num_layers))
        self.ln_f = nn.LayerNorm(cfg.dim)
        self.head = nn.Linear(cfg.dim, cfg.vocab_size, bias=False)
        for table in (self.tok, self.pos):
            nn.init.normal_(table.weight, std=0.02)

    def forward(self, idx: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        positions = torch.arange(idx.shape[1], device=idx.device)
        x = self.tok(idx) + self.pos(positions)
        balances = []
        for block in self.blocks:
            x, balance = block(x)
            balances.append(balance)
        logits = self.head(self.ln_f(x))
        return F.cross_entropy(logits.flatten(0, 1), targets.flatten()) + self.cfg.aux_loss_weight * sum(balances)
