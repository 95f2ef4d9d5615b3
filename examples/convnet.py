"""A small convolutional classifier: convolutions with batch norm and ReLU, max pooling, global
average pooling, a linear head and a cross-entropy loss."""

import itertools
from dataclasses import dataclass

import torch
from torch import nn
from torch.nn import functional as F


@dataclass(frozen=True, slots=True)
class ConvNetConfig:
    """Sizes of a :class:`ConvNet`."""

    in_channels: int = 3
    """Channels of the input images."""
    channels: tuple[int, ...] = (8, 16)
    """Output channels of each convolution block; every block but the last halves the image."""
    num_classes: int = 10
    """Classes the head scores."""


class ConvBlock(nn.Module):
    """3x3 convolution, batch norm (training statistics, running statistics kept) and ReLU."""

    def __init__(self, in_channels: int, out_channels: int):
        super().__init__()
        # no bias: the batch norm subtracts the batch mean, so a bias would get a zero gradient
        # up to rounding, which Adam amplifies into noise
        self.conv = nn.Conv2d(in_channels, out_channels, 3, padding=1, bias=False)
        self.bn = nn.BatchNorm2d(out_channels)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.relu(self.bn(self.conv(x)))


class ConvNet(nn.Module):
    """``forward(images, labels)`` returns the mean cross-entropy of the class scores."""

    def __init__(self, cfg: ConvNetConfig = ConvNetConfig()):
        super().__init__()
        widths = (cfg.in_channels, *cfg.channels)
        self.blocks = nn.ModuleList(ConvBlock(a, b) for a, b in itertools.pairwise(widths))
        self.head = nn.Linear(widths[-1], cfg.num_classes)

    def forward(self, images: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        x = images
        for i, block in enumerate(self.blocks):
            x = block(x)
            if i < len(self.blocks) - 1:
                x = F.max_pool2d(x, 2)
        x = F.adaptive_avg_pool2d(x, 1).flatten(1)
        return F.cross_entropy(self.head(x), labels)
