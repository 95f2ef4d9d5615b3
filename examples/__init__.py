"""Models that ship with autopar, each with the example inputs the demo and ``autopar plan`` use."""

import importlib.util

import torch


def _gpt():
    from autopar.examples.gpt import GPT, GPTConfig

    cfg = GPTConfig(vocab_size=256, block_size=32, dim=64, num_heads=4, num_layers=2)
    shape = (8, cfg.block_size)
    return GPT(cfg), (torch.randint(0, cfg.vocab_size, shape), torch.randint(0, cfg.vocab_size, shape))


def _llama():
    from autopar.examples.llama import Llama, LlamaConfig

    cfg = LlamaConfig(vocab_size=256, dim=64, num_heads=4, num_kv_heads=2, hidden=128, num_layers=2, max_seq=32)
    shape = (8, 32)
    return Llama(cfg), (torch.randint(0, cfg.vocab_size, shape), torch.randint(0, cfg.vocab_size, shape))


def _bert():
    from autopar.examples.bert import Bert, BertConfig, masked_batch

    cfg = BertConfig(vocab_size=256, max_seq=32, dim=64, num_heads=4, hidden=256, num_layers=2)
    return Bert(cfg), masked_batch(cfg, 8, 32, torch.Generator().manual_seed(0))


def _convnet():
    from autopar.examples.convnet import ConvNet, ConvNetConfig

    cfg = ConvNetConfig()
    images = torch.randn(8, cfg.in_channels, 16, 16)
    return ConvNet(cfg), (images, torch.randint(0, cfg.num_classes, (8,)))


def _mlp():
    from autopar.examples.mlp import MLP

    return MLP(256, 4096), (torch.randn(8, 256), torch.randn(8, 256))


def _moe():
    from autopar.examples.moe import MoEConfig, MoEGPT

    cfg = MoEConfig(
        vocab_size=256,
        block_size=32,
        dim=64,
        num_heads=4,
        num_layers=2,
        num_experts=8,
        expert_hidden=128,
        group_size=32,
    )
    shape = (8, cfg.block_size)
    return MoEGPT(cfg), (torch.randint(0, cfg.vocab_size, shape), torch.randint(0, cfg.vocab_size, shape))


def _hf(build):
    """A Hugging Face model (``autopar.examples.hf``) sized like the GPT example, with token ids
    as inputs and labels."""

    def make():
        from autopar.examples import hf

        model = getattr(hf, build)()
        shape = (8, 32)
        return model, (torch.randint(0, 256, shape), torch.randint(0, 256, shape))

    return make


EXAMPLES = {
    "bert": _bert,
    "convnet": _convnet,
    "gpt": _gpt,
    "llama": _llama,
    "mlp": _mlp,
    "moe": _moe,
    "hf-gpt2": _hf("gpt2"),
    "hf-llama": _hf("llama"),
}
"""Name → function returning ``(model, example_inputs)``; the inputs are a global batch."""

_NEEDS_TRANSFORMERS = {"hf-gpt2", "hf-llama"}


def check_example(name: str) -> None:
    """Raise if ``name`` is no built-in example (``ValueError``) or needs a package that is not
    installed (``ModuleNotFoundError``, saying what to install)."""
    if name not in EXAMPLES:
        raise ValueError(f"unknown example model {name!r}; choose one of {sorted(EXAMPLES)}")
    if name in _NEEDS_TRANSFORMERS and importlib.util.find_spec("transformers") is None:
        from autopar.examples.hf import TRANSFORMERS

        raise ModuleNotFoundError(
            f"the {name} example builds its model with Hugging Face transformers, which is "
            f"not installed: pip install '{TRANSFORMERS}'",
            name="transformers",
        )


def make_example(name: str):
    """``(model, example_inputs)`` of a built-in example."""
    check_example(name)
    return EXAMPLES[name]()
