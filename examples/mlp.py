"""A multi-layer perceptron that returns its own loss."""

import torch
from torch import nn


class MLP(nn.Module):
    """``num_layers`` Linear layers with ReLU between them and a mean-squared-error loss.

    ``forward(x, target)`` returns the scalar loss, so the captured graph holds the whole
    training step.
    """

    def __init__(self, dim: int, hidden: int, num_layers: int = 2):
        super().__init__()
        widths = [dim] + [hidden] * (num_layers - 1) + [dim]
        self.layers = nn.ModuleList(nn.Linear(a, b) for a, b in zip(widths[:-1], widths[1:]))

    def forward(self, x: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        for i, layer in enumerate(self.layers):
            x = layer(x)
            if i < len(self.layers) - 1:
                x = torch.relu(x)
        return nn.functional.mse_loss(x, target)
