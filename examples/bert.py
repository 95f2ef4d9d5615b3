"""A BERT-style encoder with a masked-language-model head: token, position and segment
embeddings, post-norm blocks of bidirectional attention and a GELU MLP, and a loss over the
masked positions only."""

from dataclasses import dataclass

import torch
from torch import nn
from torch.nn import functional as F


@dataclass(frozen=True, slots=True)
class BertConfig:
    """Sizes of a :class:`Bert`."""

    vocab_size: int = 256
    """Number of token ids."""
    max_seq: int = 32
    """Longest sequence the position embedding covers."""
    dim: int = 64
    """Width of the hidden states."""
    num_heads: int = 4
    """Attention heads; ``dim`` must be a multiple of it."""
    hidden: int = 256
    """Width of the MLP."""
    num_layers: int = 2
    """Encoder blocks."""


class EncoderBlock(nn.Module):
    def __init__(self, cfg: BertConfig):
        super().__init__()
        self.num_heads = cfg.num_heads
        self.query = nn.Linear(cfg.dim, cfg.dim)
        # no key bias: its gradient is zero by construction (softmax ignores a shift shared by
        # all keys), so Adam would amplify rounding noise in it
        self.key = nn.Linear(cfg.dim, cfg.dim, bias=False)
        self.value = nn.Linear(cfg.dim, cfg.dim)
        self.out = nn.Linear(cfg.dim, cfg.dim)
        self.ln1 = nn.LayerNorm(cfg.dim)
        self.fc1 = nn.Linear(cfg.dim, cfg.hidden)
        self.fc2 = nn.Linear(cfg.hidden, cfg.dim)
        self.ln2 = nn.LayerNorm(cfg.dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        batch, seq, dim = x.shape
        q, k, v = self.query(x), self.key(x), self.value(x)
        shape = (batch, seq, self.num_heads, dim // self.num_heads)
        q, k, v = (t.view(shape).transpose(1, 2) for t in (q, k, v))
        y = F.scaled_dot_product_attention(q, k, v)
        x = self.ln1(x + self.out(y.transpose(1, 2).reshape(batch, seq, dim)))
        return self.ln2(x + self.fc2(F.gelu(self.fc1(x))))


class Bert(nn.Module):
    """``forward(idx, segments, labels)`` returns the mean cross-entropy over positions whose
    label is not -100 (the masked tokens)."""

    def __init__(self, cfg: BertConfig = BertConfig()):
        super().__init__()
        self.tok = nn.Embedding(cfg.vocab_size, cfg.dim)
        self.pos = nn.Embedding(cfg.max_seq, cfg.dim)
        self.seg = nn.Embedding(2, cfg.dim)
        self.ln = nn.LayerNorm(cfg.dim)
        self.blocks = nn.ModuleList(EncoderBlock(cfg) for _ in range(cfg.num_layers))
        self.mlm_dense = nn.Linear(cfg.dim, cfg.dim)
        self.mlm_ln = nn.LayerNorm(cfg.dim)
        self.mlm_out = nn.Linear(cfg.dim, cfg.vocab_size)

    def forward(self, idx: torch.Tensor, segments: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        positions = torch.arange(idx.shape[1], device=idx.device)
        x = self.ln(self.tok(idx) + self.pos(positions) + self.seg(segments))
        for block in self.blocks:
            x = block(x)
        logits = self.mlm_out(self.mlm_ln(F.gelu(self.mlm_dense(x))))
        return F.cross_entropy(logits.flatten(0, 1), labels.flatten(), ignore_index=-100)


def masked_batch(cfg: BertConfig, batch: int, seq: int, generator: torch.Generator | None = None):
    """Random ``(idx, segments, labels)`` with 15% of positions masked for prediction."""
    idx = torch.randint(0, cfg.vocab_size, (batch, seq), generator=generator)
    segments = (torch.arange(seq) >= seq // 2).long().expand(batch, seq).clone()
    chosen = torch.rand((batch, seq), generator=generator) < 0.15
    chosen[:, 0] = True
    labels = torch.where(chosen, idx, torch.full_like(idx, -100))
    return idx, segments, labels
