"""A stack of LLaMA-style blocks with hand-written softmax attention, no embedding and no loss:
the stack's output is returned. It is the graph meta-pytorch/autoparallel benchmarks its
planner on (dim 4096, MLP 14336, 32 heads, batch 16 x sequence 1024), written here so that
autopar's planning benchmark plans the same shapes.

Its first block computes no input gradient when the input needs none, and its last block feeds
the output, so both differ from the blocks between them: the shape layer sharing must survive.
"""

from dataclasses import dataclass

import torch
from autopar.examples.llama import RMSNorm
from torch import nn
from torch.nn import functional as F


@dataclass(frozen=True, slots=True)
class StackConfig:
    """Sizes of a :class:`BlockStack`."""

    dim: int = 4096
    """Width of the residual stream."""
    hidden: int = 14336
    """Width of the SwiGLU MLP."""
    num_heads: int = 32
    """Attention heads."""
    num_layers: int = 32
    """Blocks."""


class Block(nn.Module):
    def __init__(self, cfg: StackConfig):
        super().__init__()
        self.num_heads = cfg.num_heads
        self.attention_norm, self.ffn_norm = RMSNorm(cfg.dim), RMSNorm(cfg.dim)
        self.wq, self.wk, self.wv, self.wo = (nn.Linear(cfg.dim, cfg.dim, bias=False) for _ in range(4))
        self.w1 = nn.Linear(cfg.dim, cfg.hidden, bias=False)
        self.w2 = nn.Linear(cfg.hidden, cfg.dim, bias=False)
        self.w3 = nn.Linear(cfg.dim, cfg.hidden, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        batch, seq, dim = x.shape
        h = self.attention_norm(x)
        q, k, v = (w(h).view(batch, seq, self.num_heads, -1).transpose(1, 2) for w in (self.wq, self.wk, self.wv))
        scores = (q @ k.transpose(-2, -1)) / q.shape[-1] ** 0.5
        attended = (scores.softmax(-1) @ v).transpose(1, 2).reshape(batch, seq, dim)
        x = x + self.wo(attended)
        h = self.ffn_norm(x)
        return x + self.w2(F.silu(self.w1(h)) * self.w3(h))


class BlockStack(nn.Module):
    """``num_layers`` :class:`Block` s applied in turn; returns the last one's output."""

    def __init__(self, cfg: StackConfig):
        super().__init__()
        self.layers = nn.ModuleList(Block(cfg) for _ in range(cfg.num_layers))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = layer(x)
        return x
