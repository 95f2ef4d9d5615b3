"""Models from Hugging Face transformers, built from configurations: randomly initialised, nothing
downloaded. Each is wrapped in :class:`CausalLMLoss`, whose ``forward(input_ids, labels)``
returns the loss, as autopar's other examples do.

What capture needs from such a model, set in its configuration here: ``use_cache=False`` (a
key-value cache is for generation and is no tensor) and an attention kernel that
``torch.export`` traces (``attn_implementation="sdpa"`` or ``"eager"``). Dropout is off unless
asked for; on several ranks it draws the masks one device draws from the same seed.
"""

from torch import nn

TRANSFORMERS = "transformers>=5.23,<6"
"""The versions the examples and tests were written against."""


class CausalLMLoss(nn.Module):
    """A Hugging Face causal language model whose ``forward(input_ids, labels)`` returns the
    loss: autopar passes example inputs in order, and Hugging Face models take these two as
    keyword arguments."""

    def __init__(self, model: nn.Module):
        super().__init__()
        self.model = model

    def forward(self, input_ids, labels):
        return self.model(input_ids=input_ids, labels=labels).loss


_TRAINABLE = {"use_cache": False, "attn_implementation": "sdpa", "bos_token_id": 0, "eos_token_id": 0}
"""Configuration fields every example sets: no cache, traceable attention, and token ids inside
the small vocabularies (transformers warns about its defaults otherwise)."""


def gpt2(*, vocab_size: int = 256, seq: int = 32, dim: int = 64, num_heads: int = 4, num_layers: int = 2,
         dropout: float = 0.0) -> CausalLMLoss:
    """``GPT2LMHeadModel`` (learned positions, tied output head, GELU MLP), with ``dropout`` on
    the embeddings, the attention weights and the residual branches."""
    from transformers import GPT2Config, GPT2LMHeadModel

    cfg = GPT2Config(vocab_size=vocab_size, n_positions=seq, n_embd=dim, n_head=num_heads, n_layer=num_layers,
                     resid_pdrop=dropout, embd_pdrop=dropout, attn_pdrop=dropout, **_TRAINABLE)
    model = GPT2LMHeadModel(cfg)
    model.loss_type = "ForCausalLM"  # the class name does not name its loss; transformers warns and picks this one
    return CausalLMLoss(model)


def llama(*, vocab_size: int = 256, seq: int = 32, dim: int = 64, num_heads: int = 4, num_kv_heads: int = 2,
          hidden: int = 128, num_layers: int = 2) -> CausalLMLoss:
    """``LlamaForCausalLM`` (RMSNorm, rotary embeddings, grouped-query attention, SwiGLU)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(vocab_size=vocab_size, max_position_embeddings=seq, hidden_size=dim,
                      num_attention_heads=num_heads, num_key_value_heads=num_kv_heads, intermediate_size=hidden,
                      num_hidden_layers=num_layers, attention_dropout=0.0, pad_token_id=None, **_TRAINABLE)
    return CausalLMLoss(LlamaForCausalLM(cfg))
