"""Models that ship with autopar, each with the example inputs the demo and ``autopar plan`` use."""

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

    cfg = MoEConfig(vocab_size=256, block_size=32, dim=64, num_heads=4, num_layers=2, num_experts=8,
                    expert_hidden=128, group_size=32)
    shape = (8, cfg.block_size)
    return MoEGPT(cfg), (torch.randint(0, cfg.vocab_size, shape), torch.randint(0, cfg.vocab_size, shape))


EXAMPLES = {"bert": _bert, "convnet": _convnet, "gpt": _gpt, "llama": _llama, "mlp": _mlp, "moe": _moe}
"""Name → function returning ``(model, example_inputs)``; the inputs are a global batch."""


def make_example(name: str):
    """``(model, example_inputs)`` of a built-in example."""
    try:
        return EXAMPLES[name]()
    except KeyError:
        raise ValueError(f"unknown example model {name!r}; choose one of {sorted(EXAMPLES)}") from None
