"""LeNet and AlexNet (one-tower, torchvision-style sizes)."""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn as nn
import torch.nn.functional as F

from ._common import images, indices, scaled


@dataclass(frozen=True)
class LeNetConfig:
    image_size: int = 28  # square input side (1 channel)
    conv1: int = 20  # channels of the first 5x5 convolution
    conv2: int = 50  # channels of the second 5x5 convolution
    hidden: int = 500  # width of the hidden fully connected layer
    num_classes: int = 10  # output classes


def lenet_config(size: str) -> LeNetConfig:
    if size == "paper":
        return LeNetConfig()
    d = 16
    return LeNetConfig(conv1=scaled(20, d), conv2=scaled(50, d), hidden=scaled(500, d))


class LeNet(nn.Module):
    def __init__(self, cfg: LeNetConfig):
        super().__init__()
        self.config = cfg
        self.conv1 = nn.Conv2d(1, cfg.conv1, 5)
        self.conv2 = nn.Conv2d(cfg.conv1, cfg.conv2, 5)
        side = ((cfg.image_size - 4) // 2 - 4) // 2
        self.fc1 = nn.Linear(cfg.conv2 * side * side, cfg.hidden)
        self.fc2 = nn.Linear(cfg.hidden, cfg.num_classes)

    def forward(self, x, labels):
        x = F.max_pool2d(self.conv1(x), 2)
        x = F.max_pool2d(self.conv2(x), 2)
        x = torch.flatten(x, 1)
        x = F.relu(self.fc1(x))
        return F.cross_entropy(self.fc2(x), labels)

    def input_specs(self, batch: int):
        c = self.config
        return [images(batch, 1, c.image_size), indices((batch,), c.num_classes)]


@dataclass(frozen=True)
class AlexNetConfig:
    image_size: int = 224  # square input side (3 channels)
    channels: tuple = (64, 192, 384, 256, 256)  # output channels of the 5 convolutions
    hidden: int = 4096  # width of the two hidden fully connected layers
    num_classes: int = 1000  # output classes
    dropout: float = 0.5  # dropout before each of the first two fc layers


def alexnet_config(size: str) -> AlexNetConfig:
    if size == "paper":
        return AlexNetConfig()
    d = 16
    # 128x128 keeps every kernel and stride of the paper network and leaves
    # a 3x3 map after the last pool (224 leaves 6x6).
    return AlexNetConfig(
        image_size=128,
        channels=tuple(scaled(c, d) for c in (64, 192, 384, 256, 256)),
        hidden=scaled(4096, d),
        num_classes=10,
    )


class AlexNet(nn.Module):
    def __init__(self, cfg: AlexNetConfig):
        super().__init__()
        self.config = cfg
        c1, c2, c3, c4, c5 = cfg.channels
        self.conv1 = nn.Conv2d(3, c1, 11, stride=4, padding=2)
        self.conv2 = nn.Conv2d(c1, c2, 5, padding=2)
        self.conv3 = nn.Conv2d(c2, c3, 3, padding=1)
        self.conv4 = nn.Conv2d(c3, c4, 3, padding=1)
        self.conv5 = nn.Conv2d(c4, c5, 3, padding=1)
        side = (cfg.image_size + 4 - 11) // 4 + 1  # conv1
        for _ in range(3):  # three 3x3/2 max pools
            side = (side - 3) // 2 + 1
        self.drop1 = nn.Dropout(cfg.dropout)
        self.fc1 = nn.Linear(c5 * side * side, cfg.hidden)
        self.drop2 = nn.Dropout(cfg.dropout)
        self.fc2 = nn.Linear(cfg.hidden, cfg.hidden)
        self.fc3 = nn.Linear(cfg.hidden, cfg.num_classes)

    def forward(self, x, labels):
        x = F.max_pool2d(F.relu(self.conv1(x)), 3, 2)
        x = F.max_pool2d(F.relu(self.conv2(x)), 3, 2)
        x = F.relu(self.conv3(x))
        x = F.relu(self.conv4(x))
        x = F.max_pool2d(F.relu(self.conv5(x)), 3, 2)
        x = torch.flatten(x, 1)
        x = F.relu(self.fc1(self.drop1(x)))
        x = F.relu(self.fc2(self.drop2(x)))
        return F.cross_entropy(self.fc3(x), labels)

    def input_specs(self, batch: int):
        c = self.config
        return [images(batch, 3, c.image_size), indices((batch,), c.num_classes)]
