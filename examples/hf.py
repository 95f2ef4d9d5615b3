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
    """A Hugging Face causal language model (or another head trained on ``input_ids`` and ``labels``,
    a sequence classifier) whose ``forward(input_ids, labels)`` returns the loss: autopar passes
    example inputs in order, and Hugging Face models take these two as keyword arguments."""

    def __init__(self, model: nn.Module):
        super().__init__()
        self.model = model

    def forward(self, input_ids, labels):
        return self.model(input_ids=input_ids, labels=labels).loss


_TRAINABLE = {"use_cache": False, "attn_implementation": "sdpa", "bos_token_id": 0, "eos_token_id": 0}
"""Configuration fields every example sets: no cache, traceable attention, and token ids inside
the small vocabularies (transformers warns about its defaults otherwise)."""


def gpt2(
    *,
    vocab_size: int = 256,
    seq: int = 32,
    dim: int = 64,
    num_heads: int = 4,
    num_layers: int = 2,
    dropout: float = 0.0,
) -> CausalLMLoss:
    """``GPT2LMHeadModel`` (learned positions, tied output head, GELU MLP), with ``dropout`` on
    the embeddings, the attention weights and the residual branches."""
    from transformers import GPT2Config, GPT2LMHeadModel

    cfg = GPT2Config(
        vocab_size=vocab_size,
        n_positions=seq,
        n_embd=dim,
        n_head=num_heads,
        n_layer=num_layers,
        resid_pdrop=dropout,
        embd_pdrop=dropout,
        attn_pdrop=dropout,
        **_TRAINABLE,
    )
    model = GPT2LMHeadModel(cfg)
    model.loss_type = "ForCausalLM"  # the class name does not name its loss; transformers warns and picks this one
    return CausalLMLoss(model)


def llama(
    *,
    vocab_size: int = 256,
    seq: int = 32,
    dim: int = 64,
    num_heads: int = 4,
    num_kv_heads: int = 2,
    hidden: int = 128,
    num_layers: int = 2,
) -> CausalLMLoss:
    """``LlamaForCausalLM`` (RMSNorm, rotary embeddings, grouped-query attention, SwiGLU)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(
        vocab_size=vocab_size,
        max_position_embeddings=seq,
        hidden_size=dim,
        num_attention_heads=num_heads,
        num_key_value_heads=num_kv_heads,
        intermediate_size=hidden,
        num_hidden_layers=num_layers,
        attention_dropout=0.0,
        pad_token_id=None,
        **_TRAINABLE,
    )
    return CausalLMLoss(LlamaForCausalLM(cfg))


class KeywordLoss(nn.Module):
    """A Hugging Face model called with its inputs by keyword, returning ``.loss``: the wrapper
    autopar needs for models whose ``forward`` takes keyword arguments (``input_ids=``,
    ``labels=``, ``pixel_values=``)."""

    def __init__(self, model: nn.Module, names: tuple[str, ...], **fixed):
        super().__init__()
        self.model, self.names, self.fixed = model, names, fixed

    def forward(self, *tensors):
        return self.model(**dict(zip(self.names, tensors)), **self.fixed).loss


_VOCAB, _HEADS = 256, 4
"""The zoo's vocabulary and attention heads."""


class _Sizes:
    """The sizes every model of the zoo is built at, and the settings its configurations share."""

    def __init__(self, batch: int, seq: int, dim: int, num_layers: int):
        self.batch, self.seq, self.dim, self.num_layers = batch, seq, dim, num_layers
        self.common = dict(
            vocab_size=_VOCAB,
            use_cache=False,
            attn_implementation="sdpa",
            pad_token_id=0,
            bos_token_id=0,
            eos_token_id=0,
        )
        self.decoder = dict(
            hidden_size=dim,
            num_hidden_layers=num_layers,
            num_attention_heads=_HEADS,
            intermediate_size=2 * dim,
            max_position_embeddings=seq,
            **self.common,
        )

    def tokens(self):
        import torch

        return torch.randint(0, _VOCAB, (self.batch, self.seq))


def _text(sizes: _Sizes, config_cls, model_cls, *, seq2seq: bool = False, **fields):
    """A builder of a text model trained on ``(input_ids, labels)``: a causal or masked language
    model from the decoder settings, or an encoder-decoder (``seq2seq``) from its own ``fields``."""

    def build():
        base = sizes.common if seq2seq else sizes.decoder
        model = model_cls(config_cls(**{**base, **fields}))
        return KeywordLoss(model, ("input_ids", "labels")), (sizes.tokens(), sizes.tokens())

    return build


_IMAGE, _CLASSES = 32, 10
"""The zoo's image side (3 colour channels) and classes."""


def _vision(sizes: _Sizes, config_cls, model_cls, **fields):
    """A builder of an image classifier trained on ``(pixel_values, labels)``: ``sizes.batch``
    images of 32x32 in 10 classes."""

    def build():
        import torch

        images = torch.randn(sizes.batch, 3, _IMAGE, _IMAGE)
        labels = torch.randint(0, _CLASSES, (sizes.batch,))
        model = model_cls(config_cls(num_labels=_CLASSES, **fields))
        return KeywordLoss(model, ("pixel_values", "labels")), (images, labels)

    return build


def _efficientnet(sizes: _Sizes):
    """A builder of EfficientNet-B0's first two stages and head, at ``dim / 256`` of its width."""

    def build():
        import transformers as tf
        from transformers.models.efficientnet.modeling_efficientnet import round_filters

        fields = dict(
            image_size=_IMAGE,
            width_coefficient=sizes.dim / 256,
            depth_coefficient=1.0,
            kernel_sizes=(3, 3),
            in_channels=(32, 16),
            out_channels=(16, 24),
            strides=(1, 2),
            num_block_repeats=(sizes.num_layers, sizes.num_layers),
            expand_ratios=(1, 6),
            dropout_rate=0.0,
            drop_connect_rate=0.0,
        )
        # the channels of the top convolution, which EfficientNet's last batch norm and classifier
        # take from hidden_dim instead of computing them
        fields["hidden_dim"] = round_filters(tf.EfficientNetConfig(**fields), 1280)
        return _vision(sizes, tf.EfficientNetConfig, tf.EfficientNetForImageClassification, **fields)()

    return build


def _bloom(sizes: _Sizes, **fields):
    """A builder of BLOOM, whose GeLU in training is a ``torch.autograd.Function`` with its
    derivative as its backward: declared so (:func:`autopar.differentiate_forward`)."""
    import transformers as tf
    from transformers.models.bloom.modeling_bloom import GeLUFunction

    import autopar

    autopar.differentiate_forward(GeLUFunction)
    return _text(sizes, tf.BloomConfig, tf.BloomForCausalLM, **fields)


def _clip(sizes: _Sizes):
    import torch
    import transformers as tf

    layers = dict(
        hidden_size=sizes.dim,
        num_hidden_layers=sizes.num_layers,
        num_attention_heads=_HEADS,
        intermediate_size=2 * sizes.dim,
    )
    text = dict(
        vocab_size=_VOCAB, max_position_embeddings=sizes.seq, pad_token_id=0, bos_token_id=0, eos_token_id=2, **layers
    )
    vision = dict(image_size=_IMAGE, patch_size=8, **layers)
    cfg = tf.CLIPConfig(text_config=text, vision_config=vision, projection_dim=sizes.dim, attn_implementation="sdpa")
    inputs = (sizes.tokens(), torch.randn(sizes.batch, 3, _IMAGE, _IMAGE))
    return KeywordLoss(tf.CLIPModel(cfg), ("input_ids", "pixel_values"), return_loss=True), inputs


def zoo(*, batch: int = 8, seq: int = 16, dim: int = 64, num_layers: int = 2) -> dict:
    """Widely used Hugging Face architectures, each built small from its configuration:
    name → a function returning ``(model, example inputs)``. Causal and masked language models,
    encoder-decoders, a vision transformer, convolutional image classifiers (ResNet, ConvNeXt,
    RegNet, MobileNetV2, EfficientNet), a CLIP-style dual encoder, ALBERT (one layer's weights
    shared by every layer), DeBERTa-v2 (relative attention), BLOOM (ALiBi), multi-query
    attention (GPTBigCode), a state-space model (Mamba) and mixture-of-experts models; every
    one trains (dropout and drop path off, so that runs compare exactly).

    The image classifiers see 32x32 images, with channels set by ``dim`` and two stages of
    ``num_layers`` blocks: ``dim`` and ``2 * dim`` channels (ResNet, ConvNeXt, RegNet, whose
    grouped convolutions take 8 channels a group), EfficientNet-B0's first two stages and head at
    ``dim / 256`` of its width. MobileNetV2's 16 blocks are fixed, at ``dim / 128`` of its width."""
    import transformers as tf

    sizes = _Sizes(batch, seq, dim, num_layers)
    experts = dict(num_local_experts=4, num_experts_per_tok=2)
    no_dropout = dict(hidden_dropout=0.0, attention_dropout=0.0)
    bert_dropout = dict(hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0)
    gpt2 = dict(n_embd=dim, n_layer=num_layers, n_head=_HEADS, n_positions=seq, resid_pdrop=0.0, embd_pdrop=0.0)
    stages = dict(hidden_sizes=[dim, 2 * dim], depths=[num_layers, num_layers])
    return {
        "gpt2": _text(sizes, tf.GPT2Config, tf.GPT2LMHeadModel, attn_pdrop=0.0, **gpt2),
        "llama": _text(sizes, tf.LlamaConfig, tf.LlamaForCausalLM, num_key_value_heads=2),
        "mistral": _text(sizes, tf.MistralConfig, tf.MistralForCausalLM, num_key_value_heads=2),
        "qwen2": _text(sizes, tf.Qwen2Config, tf.Qwen2ForCausalLM, num_key_value_heads=2),
        "qwen3": _text(sizes, tf.Qwen3Config, tf.Qwen3ForCausalLM, num_key_value_heads=2, head_dim=dim // _HEADS),
        "gemma2": _text(
            sizes,
            tf.Gemma2Config,
            tf.Gemma2ForCausalLM,
            num_key_value_heads=2,
            head_dim=dim // _HEADS,
            attn_implementation="eager",
        ),
        "phi3": _text(sizes, tf.Phi3Config, tf.Phi3ForCausalLM, num_key_value_heads=2),
        "falcon": _text(sizes, tf.FalconConfig, tf.FalconForCausalLM, **no_dropout),
        "gpt_neox": _text(sizes, tf.GPTNeoXConfig, tf.GPTNeoXForCausalLM, **no_dropout),
        "opt": _text(sizes, tf.OPTConfig, tf.OPTForCausalLM, ffn_dim=2 * dim, word_embed_proj_dim=dim, dropout=0.0),
        "bert": _text(sizes, tf.BertConfig, tf.BertForMaskedLM, **bert_dropout),
        "roberta": _text(
            sizes, tf.RobertaConfig, tf.RobertaForMaskedLM, max_position_embeddings=seq + 2, **bert_dropout
        ),
        "t5": _text(
            sizes,
            tf.T5Config,
            tf.T5ForConditionalGeneration,
            seq2seq=True,
            d_model=dim,
            d_kv=dim // _HEADS,
            d_ff=2 * dim,
            num_layers=num_layers,
            num_heads=_HEADS,
            dropout_rate=0.0,
            decoder_start_token_id=0,
        ),
        "bart": _text(
            sizes,
            tf.BartConfig,
            tf.BartForConditionalGeneration,
            seq2seq=True,
            d_model=dim,
            encoder_layers=num_layers,
            decoder_layers=num_layers,
            encoder_attention_heads=_HEADS,
            decoder_attention_heads=_HEADS,
            encoder_ffn_dim=2 * dim,
            decoder_ffn_dim=2 * dim,
            max_position_embeddings=seq,
            dropout=0.0,
            attention_dropout=0.0,
            decoder_start_token_id=0,
            forced_eos_token_id=None,
        ),
        "vit": _vision(
            sizes,
            tf.ViTConfig,
            tf.ViTForImageClassification,
            hidden_size=dim,
            num_hidden_layers=num_layers,
            num_attention_heads=_HEADS,
            intermediate_size=2 * dim,
            image_size=_IMAGE,
            patch_size=8,
            attn_implementation="sdpa",
        ),
        "resnet": _vision(sizes, tf.ResNetConfig, tf.ResNetForImageClassification, embedding_size=dim, **stages),
        "convnext": _vision(sizes, tf.ConvNextConfig, tf.ConvNextForImageClassification, num_stages=2, **stages),
        "regnet": _vision(
            sizes, tf.RegNetConfig, tf.RegNetForImageClassification, embedding_size=dim, groups_width=8, **stages
        ),
        "mobilenet_v2": _vision(
            sizes,
            tf.MobileNetV2Config,
            tf.MobileNetV2ForImageClassification,
            image_size=_IMAGE,
            depth_multiplier=dim / 128,
            finegrained_output=False,
            classifier_dropout_prob=0.0,
        ),
        "efficientnet": _efficientnet(sizes),
        "clip": lambda: _clip(sizes),
        "albert": _text(sizes, tf.AlbertConfig, tf.AlbertForMaskedLM, embedding_size=dim // 2, **bert_dropout),
        "deberta_v2": _text(
            sizes,
            tf.DebertaV2Config,
            tf.DebertaV2ForMaskedLM,
            relative_attention=True,
            position_buckets=seq // 2,
            pos_att_type=["p2c", "c2p"],
            attn_implementation="eager",
            **bert_dropout,
        ),
        "bloom": _bloom(sizes, attn_implementation="eager", **no_dropout),
        "gpt_bigcode": _text(
            sizes, tf.GPTBigCodeConfig, tf.GPTBigCodeForCausalLM, multi_query=True, attn_pdrop=0.0, **gpt2
        ),
        "mamba": _text(
            sizes,
            tf.MambaConfig,
            tf.MambaForCausalLM,
            state_size=dim // 4,
            expand=2,
            conv_kernel=4,
            use_mambapy=False,
            attn_implementation="eager",
        ),
        "mixtral": _text(sizes, tf.MixtralConfig, tf.MixtralForCausalLM, num_key_value_heads=2, **experts),
        "qwen2_moe": _text(
            sizes,
            tf.Qwen2MoeConfig,
            tf.Qwen2MoeForCausalLM,
            num_key_value_heads=2,
            num_experts=4,
            num_experts_per_tok=2,
            moe_intermediate_size=dim,
            shared_expert_intermediate_size=dim,
        ),
    }
