"""ResNet-101 (He et al. 2016): bottleneck blocks [3, 4, 23, 3], 104 convolutions
(stem + 3 per block + 4 shortcut projections)."""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn as nn
import torch.nn.functional as F

from ._common import images, indices, scaled


@dataclass(frozen=True)
class ResNetConfig:
    image_size: int = 224  # square input side (3 channels)
    layers: tuple = (3, 4, 23, 3)  # bottleneck blocks per stage
    width_div: int = 1  # every channel count is divided by this (min 4 channels)
    num_classes: int = 1000  # output classes


def resnet101_config(size: str) -> ResNetConfig:
    if size == "paper":
        return ResNetConfig()
    # 64x64 leaves a 2x2 map before the global pool (224 leaves 7x7).
    return ResNetConfig(image_size=64, width_div=16, num_classes=10)


class Bottleneck(nn.Module):
    expansion = 4

    def __init__(self, cin: int, planes: int, stride: int, out: int):
        super().__init__()
        self.conv1 = nn.Conv2d(cin, planes, 1, bias=False)
        self.bn1 = nn.BatchNorm2d(planes)
        self.conv2 = nn.Conv2d(planes, planes, 3, stride=stride, padding=1, bias=False)
        self.bn2 = nn.BatchNorm2d(planes)
        self.conv3 = nn.Conv2d(planes, out, 1, bias=False)
        self.bn3 = nn.BatchNorm2d(out)
        self.downsample = None
        if stride != 1 or cin != out:
            self.downsample = nn.Sequential(
                nn.Conv2d(cin, out, 1, stride=stride, bias=False), nn.BatchNorm2d(out)
            )

    def forward(self, x):
        y = F.relu(self.bn1(self.conv1(x)))
        y = F.relu(self.bn2(self.conv2(y)))
        y = self.bn3(self.conv3(y))
        shortcut = x if self.downsample is None else self.downsample(x)
        return F.relu(y + shortcut)


class ResNet(nn.Module):
    def __init__(self, cfg: ResNetConfig):
        super().__init__()
        self.config = cfg

        def w(c: int) -> int:
            return scaled(c, cfg.width_div)

        self.conv1 = nn.Conv2d(3, w(64), 7, stride=2, padding=3, bias=False)
        self.bn1 = nn.BatchNorm2d(w(64))
        cin = w(64)
        stages = []
        for i, blocks in enumerate(cfg.layers):
            planes = w(64 * 2**i)
            out = w(64 * 2**i * Bottleneck.expansion)
            stage = []
            for b in range(blocks):
                stride = 2 if (b == 0 and i > 0) else 1
                stage.append(Bottleneck(cin, planes, stride, out))
                cin = out
            stages.append(nn.Sequential(*stage))
        self.layer1, self.layer2, self.layer3, self.layer4 = stages
        self.avgpool = nn.AdaptiveAvgPool2d((1, 1))
        self.fc = nn.Linear(cin, cfg.num_classes)

    def forward(self, x, labels):
        x = F.relu(self.bn1(self.conv1(x)))
        x = F.max_pool2d(x, kernel_size=3, stride=2, padding=1)
        x = self.layer1(x)
        x = self.layer2(x)
        x = self.layer3(x)
        x = self.layer4(x)
        x = torch.flatten(self.avgpool(x), 1)
        return F.cross_entropy(self.fc(x), labels)

    def input_specs(self, batch: int):
        c = self.config
        return [images(batch, 3, c.image_size), indices((batch,), c.num_classes)]
