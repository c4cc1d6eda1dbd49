"""Inception-v3 (Szegedy et al. 2016), the usual definition without the
auxiliary head: stem, 3x InceptionA, InceptionB, 4x InceptionC, InceptionD,
2x InceptionE, global average pool, dropout, fc. 94 convolutions.

Every channel count of the standard network passes through `w()`, so the
small size has the same graph with channels divided by `width_div`."""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn as nn
import torch.nn.functional as F

from ._common import images, indices, scaled


@dataclass(frozen=True)
class InceptionV3Config:
    image_size: int = 299  # square input side (3 channels); at least 75
    width_div: int = 1  # every channel count is divided by this (min 4 channels)
    num_classes: int = 1000  # output classes
    dropout: float = 0.5  # dropout before the classifier


def inception_v3_config(size: str) -> InceptionV3Config:
    if size == "paper":
        return InceptionV3Config()
    # 139x139 leaves a 3x3 map before the global pool (299 leaves 8x8).
    return InceptionV3Config(image_size=139, width_div=16, num_classes=10)


class BasicConv2d(nn.Module):
    """conv (no bias) + BatchNorm(eps=0.001) + relu."""

    def __init__(self, cin: int, cout: int, **kw):
        super().__init__()
        self.conv = nn.Conv2d(cin, cout, bias=False, **kw)
        self.bn = nn.BatchNorm2d(cout, eps=0.001)

    def forward(self, x):
        return F.relu(self.bn(self.conv(x)))


class InceptionA(nn.Module):
    def __init__(self, cin: int, pool_features: int, w):
        super().__init__()
        self.branch1x1 = BasicConv2d(cin, w(64), kernel_size=1)
        self.branch5x5_1 = BasicConv2d(cin, w(48), kernel_size=1)
        self.branch5x5_2 = BasicConv2d(w(48), w(64), kernel_size=5, padding=2)
        self.branch3x3dbl_1 = BasicConv2d(cin, w(64), kernel_size=1)
        self.branch3x3dbl_2 = BasicConv2d(w(64), w(96), kernel_size=3, padding=1)
        self.branch3x3dbl_3 = BasicConv2d(w(96), w(96), kernel_size=3, padding=1)
        self.branch_pool = BasicConv2d(cin, w(pool_features), kernel_size=1)
        self.out_channels = w(64) + w(64) + w(96) + w(pool_features)

    def forward(self, x):
        b1 = self.branch1x1(x)
        b5 = self.branch5x5_2(self.branch5x5_1(x))
        b3 = self.branch3x3dbl_3(self.branch3x3dbl_2(self.branch3x3dbl_1(x)))
        bp = self.branch_pool(F.avg_pool2d(x, kernel_size=3, stride=1, padding=1))
        return torch.cat([b1, b5, b3, bp], 1)


class InceptionB(nn.Module):
    def __init__(self, cin: int, w):
        super().__init__()
        self.branch3x3 = BasicConv2d(cin, w(384), kernel_size=3, stride=2)
        self.branch3x3dbl_1 = BasicConv2d(cin, w(64), kernel_size=1)
        self.branch3x3dbl_2 = BasicConv2d(w(64), w(96), kernel_size=3, padding=1)
        self.branch3x3dbl_3 = BasicConv2d(w(96), w(96), kernel_size=3, stride=2)
        self.out_channels = w(384) + w(96) + cin

    def forward(self, x):
        b3 = self.branch3x3(x)
        bd = self.branch3x3dbl_3(self.branch3x3dbl_2(self.branch3x3dbl_1(x)))
        bp = F.max_pool2d(x, kernel_size=3, stride=2)
        return torch.cat([b3, bd, bp], 1)


class InceptionC(nn.Module):
    def __init__(self, cin: int, channels_7x7: int, w):
        super().__init__()
        c7 = w(channels_7x7)
        self.branch1x1 = BasicConv2d(cin, w(192), kernel_size=1)
        self.branch7x7_1 = BasicConv2d(cin, c7, kernel_size=1)
        self.branch7x7_2 = BasicConv2d(c7, c7, kernel_size=(1, 7), padding=(0, 3))
        self.branch7x7_3 = BasicConv2d(c7, w(192), kernel_size=(7, 1), padding=(3, 0))
        self.branch7x7dbl_1 = BasicConv2d(cin, c7, kernel_size=1)
        self.branch7x7dbl_2 = BasicConv2d(c7, c7, kernel_size=(7, 1), padding=(3, 0))
        self.branch7x7dbl_3 = BasicConv2d(c7, c7, kernel_size=(1, 7), padding=(0, 3))
        self.branch7x7dbl_4 = BasicConv2d(c7, c7, kernel_size=(7, 1), padding=(3, 0))
        self.branch7x7dbl_5 = BasicConv2d(c7, w(192), kernel_size=(1, 7), padding=(0, 3))
        self.branch_pool = BasicConv2d(cin, w(192), kernel_size=1)
        self.out_channels = 4 * w(192)

    def forward(self, x):
        b1 = self.branch1x1(x)
        b7 = self.branch7x7_3(self.branch7x7_2(self.branch7x7_1(x)))
        bd = self.branch7x7dbl_1(x)
        bd = self.branch7x7dbl_3(self.branch7x7dbl_2(bd))
        bd = self.branch7x7dbl_5(self.branch7x7dbl_4(bd))
        bp = self.branch_pool(F.avg_pool2d(x, kernel_size=3, stride=1, padding=1))
        return torch.cat([b1, b7, bd, bp], 1)


class InceptionD(nn.Module):
    def __init__(self, cin: int, w):
        super().__init__()
        self.branch3x3_1 = BasicConv2d(cin, w(192), kernel_size=1)
        self.branch3x3_2 = BasicConv2d(w(192), w(320), kernel_size=3, stride=2)
        self.branch7x7x3_1 = BasicConv2d(cin, w(192), kernel_size=1)
        self.branch7x7x3_2 = BasicConv2d(w(192), w(192), kernel_size=(1, 7), padding=(0, 3))
        self.branch7x7x3_3 = BasicConv2d(w(192), w(192), kernel_size=(7, 1), padding=(3, 0))
        self.branch7x7x3_4 = BasicConv2d(w(192), w(192), kernel_size=3, stride=2)
        self.out_channels = w(320) + w(192) + cin

    def forward(self, x):
        b3 = self.branch3x3_2(self.branch3x3_1(x))
        b7 = self.branch7x7x3_2(self.branch7x7x3_1(x))
        b7 = self.branch7x7x3_4(self.branch7x7x3_3(b7))
        bp = F.max_pool2d(x, kernel_size=3, stride=2)
        return torch.cat([b3, b7, bp], 1)


class InceptionE(nn.Module):
    def __init__(self, cin: int, w):
        super().__init__()
        self.branch1x1 = BasicConv2d(cin, w(320), kernel_size=1)
        self.branch3x3_1 = BasicConv2d(cin, w(384), kernel_size=1)
        self.branch3x3_2a = BasicConv2d(w(384), w(384), kernel_size=(1, 3), padding=(0, 1))
        self.branch3x3_2b = BasicConv2d(w(384), w(384), kernel_size=(3, 1), padding=(1, 0))
        self.branch3x3dbl_1 = BasicConv2d(cin, w(448), kernel_size=1)
        self.branch3x3dbl_2 = BasicConv2d(w(448), w(384), kernel_size=3, padding=1)
        self.branch3x3dbl_3a = BasicConv2d(w(384), w(384), kernel_size=(1, 3), padding=(0, 1))
        self.branch3x3dbl_3b = BasicConv2d(w(384), w(384), kernel_size=(3, 1), padding=(1, 0))
        self.branch_pool = BasicConv2d(cin, w(192), kernel_size=1)
        self.out_channels = w(320) + 4 * w(384) + w(192)

    def forward(self, x):
        b1 = self.branch1x1(x)
        b3 = self.branch3x3_1(x)
        b3 = torch.cat([self.branch3x3_2a(b3), self.branch3x3_2b(b3)], 1)
        bd = self.branch3x3dbl_2(self.branch3x3dbl_1(x))
        bd = torch.cat([self.branch3x3dbl_3a(bd), self.branch3x3dbl_3b(bd)], 1)
        bp = self.branch_pool(F.avg_pool2d(x, kernel_size=3, stride=1, padding=1))
        return torch.cat([b1, b3, bd, bp], 1)


class InceptionV3(nn.Module):
    def __init__(self, cfg: InceptionV3Config):
        super().__init__()
        if cfg.image_size < 75:
            raise ValueError(f"inception_v3 needs images of at least 75x75, got {cfg.image_size}")
        self.config = cfg

        def w(c: int) -> int:
            return scaled(c, cfg.width_div)

        self.Conv2d_1a_3x3 = BasicConv2d(3, w(32), kernel_size=3, stride=2)
        self.Conv2d_2a_3x3 = BasicConv2d(w(32), w(32), kernel_size=3)
        self.Conv2d_2b_3x3 = BasicConv2d(w(32), w(64), kernel_size=3, padding=1)
        self.Conv2d_3b_1x1 = BasicConv2d(w(64), w(80), kernel_size=1)
        self.Conv2d_4a_3x3 = BasicConv2d(w(80), w(192), kernel_size=3)
        self.Mixed_5b = InceptionA(w(192), 32, w)
        self.Mixed_5c = InceptionA(self.Mixed_5b.out_channels, 64, w)
        self.Mixed_5d = InceptionA(self.Mixed_5c.out_channels, 64, w)
        self.Mixed_6a = InceptionB(self.Mixed_5d.out_channels, w)
        self.Mixed_6b = InceptionC(self.Mixed_6a.out_channels, 128, w)
        self.Mixed_6c = InceptionC(self.Mixed_6b.out_channels, 160, w)
        self.Mixed_6d = InceptionC(self.Mixed_6c.out_channels, 160, w)
        self.Mixed_6e = InceptionC(self.Mixed_6d.out_channels, 192, w)
        self.Mixed_7a = InceptionD(self.Mixed_6e.out_channels, w)
        self.Mixed_7b = InceptionE(self.Mixed_7a.out_channels, w)
        self.Mixed_7c = InceptionE(self.Mixed_7b.out_channels, w)
        self.avgpool = nn.AdaptiveAvgPool2d((1, 1))
        self.dropout = nn.Dropout(cfg.dropout)
        self.fc = nn.Linear(self.Mixed_7c.out_channels, cfg.num_classes)

    def forward(self, x, labels):
        x = self.Conv2d_1a_3x3(x)
        x = self.Conv2d_2a_3x3(x)
        x = self.Conv2d_2b_3x3(x)
        x = F.max_pool2d(x, kernel_size=3, stride=2)
        x = self.Conv2d_3b_1x1(x)
        x = self.Conv2d_4a_3x3(x)
        x = F.max_pool2d(x, kernel_size=3, stride=2)
        x = self.Mixed_5b(x)
        x = self.Mixed_5c(x)
        x = self.Mixed_5d(x)
        x = self.Mixed_6a(x)
        x = self.Mixed_6b(x)
        x = self.Mixed_6c(x)
        x = self.Mixed_6d(x)
        x = self.Mixed_6e(x)
        x = self.Mixed_7a(x)
        x = self.Mixed_7b(x)
        x = self.Mixed_7c(x)
        x = self.avgpool(x)
        x = torch.flatten(self.dropout(x), 1)
        return F.cross_entropy(self.fc(x), labels)

    def input_specs(self, batch: int):
        c = self.config
        return [images(batch, 3, c.image_size), indices((batch,), c.num_classes)]
