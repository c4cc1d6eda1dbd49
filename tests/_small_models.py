"""Small models several test files share."""
import torch
import torch.nn as nn


class MLP(nn.Module):
    """Square Linear+ReLU layers and an MSE loss: parameter-heavy, activation-light."""

    def __init__(self, width: int = 256, layers: int = 3):
        super().__init__()
        self.layers = nn.ModuleList(nn.Linear(width, width) for _ in range(layers))

    def forward(self, x, y):
        for layer in self.layers:
            x = torch.relu(layer(x))
        return nn.functional.mse_loss(x, y)
