"""A GPT-style decoder: token and position embeddings, pre-norm blocks of causal attention
(through ``scaled_dot_product_attention``) and a GELU MLP, a final layer norm, a language-model
head tied to the token embedding (as GPT-2's) and a cross-entropy loss."""

from dataclasses import dataclass

import torch
from torch import nn
from torch.nn import functional as F


@dataclass(frozen=True, slots=True)
class GPTConfig:
    """Sizes of a :class:`GPT`."""

    vocab_size: int = 256
    """Number of token ids."""
    block_size: int = 32
    """Longest sequence the position embedding covers."""
    dim: int = 64
    """Width of the residual stream."""
    num_heads: int = 4
    """Attention heads; ``dim`` must be a multiple of it."""
    num_layers: int = 2
    """Transformer blocks."""
    tie_embeddings: bool = True
    """Whether the output head shares the token embedding's weight, as in GPT-2."""


class Attention(nn.Module):
    def __init__(self, cfg: GPTConfig):
        super().__init__()
        self.num_heads = cfg.num_heads
        # no bias: a key bias has zero gradient by construction (softmax ignores a shift shared
        # by all keys), so Adam would amplify rounding noise in it
        self.qkv = nn.Linear(cfg.dim, 3 * cfg.dim, bias=False)
        self.proj = nn.Linear(cfg.dim, cfg.dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        batch, seq, dim = x.shape
        q, k, v = self.qkv(x).split(dim, dim=2)
        shape = (batch, seq, self.num_heads, dim // self.num_heads)
        q, k, v = (t.view(shape).transpose(1, 2) for t in (q, k, v))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.proj(y.transpose(1, 2).reshape(batch, seq, dim))


class Block(nn.Module):
    def __init__(self, cfg: GPTConfig):
        super().__init__()
        self.ln1 = nn.LayerNorm(cfg.dim)
        self.attn = Attention(cfg)
        self.ln2 = nn.LayerNorm(cfg.dim)
        self.fc1 = nn.Linear(cfg.dim, 4 * cfg.dim)
        self.fc2 = nn.Linear(4 * cfg.dim, cfg.dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln1(x))
        return x + self.fc2(F.gelu(self.fc1(self.ln2(x))))


class GPT(nn.Module):
    """``forward(idx, targets)`` returns the mean cross-entropy of next-token prediction."""

    def __init__(self, cfg: GPTConfig = GPTConfig()):
        super().__init__()
        self.tok = nn.Embedding(cfg.vocab_size, cfg.dim)
        self.pos = nn.Embedding(cfg.block_size, cfg.dim)
        self.blocks = nn.ModuleList(Block(cfg) for _ in range(cfg.num_layers))
        self.ln_f = nn.LayerNorm(cfg.dim)
        self.head = nn.Linear(cfg.dim, cfg.vocab_size, bias=False)
        for table in (self.tok, self.pos):
            nn.init.normal_(table.weight, std=0.02)  # GPT-2's init; N(0, 1) tied logits saturate the softmax
        if cfg.tie_embeddings:
            self.head.weight = self.tok.weight  # GPT-2 reads logits off the token embedding

    def forward(self, idx: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        positions = torch.arange(idx.shape[1], device=idx.device)
        x = self.tok(idx) + self.pos(positions)
        for block in self.blocks:
            x = block(x)
        logits = self.head(self.ln_f(x))
        return F.cross_entropy(logits.flatten(0, 1), targets.flatten())
