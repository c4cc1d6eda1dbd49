"""GPT-2-small-style decoder-only transformer (not in the paper): pre-LayerNorm
blocks, causal self-attention, 4x GELU MLP, LM head tied to the token
embedding."""
from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn as nn
import torch.nn.functional as F

from ._common import indices


@dataclass(frozen=True)
class TransformerConfig:
    layers: int = 12  # transformer blocks
    width: int = 768  # model width (embedding and residual stream)
    heads: int = 12  # attention heads; width must be divisible by heads
    vocab: int = 50257  # vocabulary size
    seq_len: int = 1024  # sequence length (also the size of the position table)
    dropout: float = 0.1  # dropout after attention and MLP output projections


def transformer_config(size: str) -> TransformerConfig:
    if size == "paper":
        return TransformerConfig()
    return TransformerConfig(layers=2, width=32, heads=4, vocab=64, seq_len=16)


class CausalSelfAttention(nn.Module):
    def __init__(self, cfg: TransformerConfig):
        super().__init__()
        D = cfg.width
        self.heads = cfg.heads
        self.head_dim = D // cfg.heads
        self.scale = 1.0 / math.sqrt(self.head_dim)
        self.q = nn.Linear(D, D)
        self.k = nn.Linear(D, D)
        self.v = nn.Linear(D, D)
        self.proj = nn.Linear(D, D)
        self.dropout = nn.Dropout(cfg.dropout)
        mask = torch.tril(torch.ones(cfg.seq_len, cfg.seq_len, dtype=torch.bool))
        self.register_buffer("mask", mask, persistent=False)

    def forward(self, x):
        N, T, D = x.shape[0], x.shape[1], x.shape[2]
        q = self.q(x).view(N, T, self.heads, self.head_dim).transpose(1, 2)
        k = self.k(x).view(N, T, self.heads, self.head_dim).transpose(1, 2)
        v = self.v(x).view(N, T, self.heads, self.head_dim).transpose(1, 2)
        scores = q @ k.transpose(-2, -1) * self.scale  # (N, heads, T, T)
        # self.mask[:T, :T], written with narrow: torch.fx cannot slice a
        # buffer (a plain tensor while tracing) by a traced length.
        mask = self.mask.narrow(0, 0, T).narrow(1, 0, T)
        scores = scores.masked_fill(mask == 0, float("-inf"))
        y = F.softmax(scores, dim=-1) @ v  # (N, heads, T, hd)
        y = y.transpose(1, 2).contiguous().view(N, T, D)
        return self.dropout(self.proj(y))


class MLP(nn.Module):
    def __init__(self, cfg: TransformerConfig):
        super().__init__()
        self.fc = nn.Linear(cfg.width, 4 * cfg.width)
        self.proj = nn.Linear(4 * cfg.width, cfg.width)
        self.dropout = nn.Dropout(cfg.dropout)

    def forward(self, x):
        return self.dropout(self.proj(F.gelu(self.fc(x))))


class Block(nn.Module):
    def __init__(self, cfg: TransformerConfig):
        super().__init__()
        self.ln_1 = nn.LayerNorm(cfg.width)
        self.attn = CausalSelfAttention(cfg)
        self.ln_2 = nn.LayerNorm(cfg.width)
        self.mlp = MLP(cfg)

    def forward(self, x):
        x = x + self.attn(self.ln_1(x))
        x = x + self.mlp(self.ln_2(x))
        return x


class Transformer(nn.Module):
    def __init__(self, cfg: TransformerConfig):
        super().__init__()
        if cfg.width % cfg.heads:
            raise ValueError(f"transformer width {cfg.width} is not divisible by {cfg.heads} heads")
        self.config = cfg
        self.wte = nn.Embedding(cfg.vocab, cfg.width)
        self.wpe = nn.Embedding(cfg.seq_len, cfg.width)
        self.blocks = nn.ModuleList(Block(cfg) for _ in range(cfg.layers))
        self.ln_f = nn.LayerNorm(cfg.width)
        for m in self.modules():  # GPT-2 initialisation
            if isinstance(m, (nn.Linear, nn.Embedding)):
                nn.init.normal_(m.weight, mean=0.0, std=0.02)
            if isinstance(m, nn.Linear):
                nn.init.zeros_(m.bias)

    def forward(self, tokens, targets):
        T = tokens.shape[1]
        positions = torch.arange(T, device=tokens.device)
        x = self.wte(tokens) + self.wpe(positions)  # (N, T, D)
        for block in self.blocks:
            x = block(x)
        logits = F.linear(self.ln_f(x), self.wte.weight)  # (N, T, V), tied head
        return F.cross_entropy(logits.transpose(1, 2), targets)

    def input_specs(self, batch: int):
        c = self.config
        shape = (batch, c.seq_len)
        return [indices(shape, c.vocab), indices(shape, c.vocab)]
