"""GPT-2 (Radford et al. 2019) at the sizes of its model cards: pre-LayerNorm blocks, one
fused QKV projection, causal attention by ``F.scaled_dot_product_attention`` (fused: no
s x s matrix is kept), a 4x tanh-GELU MLP, learned positions and an LM head tied to the
token embedding.

Sizes (layers / width / heads; vocabulary 50,257, 1,024 positions, from the released
configs): ``124m`` 12 / 768 / 12, ``350m`` 24 / 1024 / 16, ``774m`` 36 / 1280 / 20,
``1.5b`` 48 / 1600 / 25; ``small`` is the same graph at 2 layers of width 32 for tests.
Dropout is 0 by default, as pretraining runs today set it (llm.c, nanoGPT)."""
from __future__ import annotations

from dataclasses import dataclass, replace

import torch
import torch.nn.functional as F
from torch import nn

from ..graph.ops.fused_ce import fused_cross_entropy
from ._common import indices

__all__ = ["GPT2", "GPT2_SIZES", "GPT2Config", "gpt2_config"]


@dataclass(frozen=True)
class GPT2Config:
    layers: int = 12  # transformer blocks
    width: int = 768  # residual stream (embedding) width
    heads: int = 12  # attention heads; width must be divisible by heads
    vocab: int = 50257  # BPE vocabulary
    seq_len: int = 1024  # training sequence length of the example inputs
    positions: int = 1024  # rows of the learned position table (at least seq_len)
    dropout: float = 0.0  # dropout on embeddings, attention and residual branches
    eps: float = 1e-5  # LayerNorm epsilon
    # "transposed": cross_entropy(logits.transpose(1, 2), targets); "flat": over the
    # flattened rows, cross_entropy(logits.view(-1, V), targets.view(-1)), as nanoGPT,
    # llm-foundry and Hugging Face write it (the same value); "fused": the flattened rows
    # through flexflow.fused_cross_entropy (no float32 copy of the logits, as llm-foundry's
    # default fused_crossentropy and llm.c's fused classifier run it)
    loss: str = "transposed"
    # the LM head shares the token embedding (GPT-2); False gives it its own weight, as a
    # pipeline that holds the embedding on its first stage and the head on its last keeps
    # a copy of it (Megatron-LM)
    tie_embeddings: bool = True
    # how the fused projection lays out q, k and v: "blocks" = [q | k | v] (GPT-2's, Hugging
    # Face's); "heads" = each head's q, k and v side by side (Megatron-LM's), so that a
    # column-parallel split of the projection by whole heads hands each rank its own heads'
    # q, k and v (the same model up to a permutation of the weight's rows)
    qkv: str = "blocks"


# size -> (layers, width, heads); "paper" is the 124M model
_SIZES = {"124m": (12, 768, 12), "350m": (24, 1024, 16), "774m": (36, 1280, 20), "1.5b": (48, 1600, 25)}
GPT2_SIZES = ("paper", "small") + tuple(_SIZES)


def gpt2_config(size: str, seq_len: int | None = None) -> GPT2Config:
    """The config of a size (``GPT2_SIZES``), at ``seq_len`` tokens when given."""
    if size == "small":
        cfg = GPT2Config(layers=2, width=32, heads=4, vocab=64, seq_len=16, positions=16)
    else:
        layers, width, heads = _SIZES["124m" if size == "paper" else size]
        cfg = GPT2Config(layers=layers, width=width, heads=heads)
    if seq_len is not None:
        cfg = replace(cfg, seq_len=seq_len, positions=max(cfg.positions, seq_len))
    return cfg


class CausalSelfAttention(nn.Module):
    def __init__(self, cfg: GPT2Config):
        super().__init__()
        if cfg.qkv not in ("blocks", "heads"):
            raise ValueError(f"gpt2: qkv must be 'blocks' or 'heads', got {cfg.qkv!r}")
        self.heads, self.width, self.dropout, self.qkv = cfg.heads, cfg.width, cfg.dropout, cfg.qkv
        self.c_attn = nn.Linear(cfg.width, 3 * cfg.width)  # q, k, v in one product
        self.c_proj = nn.Linear(cfg.width, cfg.width)
        self.resid_drop = nn.Dropout(cfg.dropout) if cfg.dropout else None

    def forward(self, x):
        B, T, D = x.shape[0], x.shape[1], x.shape[2]
        H = self.heads
        if self.qkv == "heads":  # (B, T, H, 3 hd): per head q, k, v
            q, k, v = self.c_attn(x).view(B, T, H, 3 * (D // H)).split(D // H, dim=3)
            q, k, v = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)  # (B, H, T, hd)
        else:
            q, k, v = self.c_attn(x).split(D, dim=2)  # 3 x (B, T, D)
            q = q.view(B, T, H, D // H).transpose(1, 2)  # (B, H, T, hd)
            k = k.view(B, T, H, D // H).transpose(1, 2)
            v = v.view(B, T, H, D // H).transpose(1, 2)
        p = self.dropout if self.training else 0.0
        y = F.scaled_dot_product_attention(q, k, v, dropout_p=p, is_causal=True)  # (B, H, T, hd)
        y = self.c_proj(y.transpose(1, 2).reshape(B, T, D))
        return self.resid_drop(y) if self.resid_drop is not None else y


class MLP(nn.Module):
    def __init__(self, cfg: GPT2Config):
        super().__init__()
        self.c_fc = nn.Linear(cfg.width, 4 * cfg.width)
        self.c_proj = nn.Linear(4 * cfg.width, cfg.width)
        self.drop = nn.Dropout(cfg.dropout) if cfg.dropout else None

    def forward(self, x):
        y = self.c_proj(F.gelu(self.c_fc(x), approximate="tanh"))
        return self.drop(y) if self.drop is not None else y


class Block(nn.Module):
    def __init__(self, cfg: GPT2Config):
        super().__init__()
        self.ln_1 = nn.LayerNorm(cfg.width, eps=cfg.eps)
        self.attn = CausalSelfAttention(cfg)
        self.ln_2 = nn.LayerNorm(cfg.width, eps=cfg.eps)
        self.mlp = MLP(cfg)

    def forward(self, x):
        x = x + self.attn(self.ln_1(x))
        return x + self.mlp(self.ln_2(x))


class GPT2(nn.Module):
    """``forward(tokens, targets)``: token ids (B, T) and next-token targets (B, T) ->
    the mean cross-entropy (a 0-d tensor)."""

    def __init__(self, cfg: GPT2Config):
        super().__init__()
        if cfg.width % cfg.heads:
            raise ValueError(f"gpt2 width {cfg.width} is not divisible by {cfg.heads} heads")
        if cfg.seq_len > cfg.positions:
            raise ValueError(f"gpt2 seq_len {cfg.seq_len} exceeds its {cfg.positions} positions")
        self.config = cfg
        self.wte = nn.Embedding(cfg.vocab, cfg.width)
        self.wpe = nn.Embedding(cfg.positions, cfg.width)
        self.drop = nn.Dropout(cfg.dropout) if cfg.dropout else None
        self.blocks = nn.ModuleList(Block(cfg) for _ in range(cfg.layers))
        self.ln_f = nn.LayerNorm(cfg.width, eps=cfg.eps)
        self.lm_head = None if cfg.tie_embeddings else nn.Linear(cfg.width, cfg.vocab, bias=False)
        if not any(p.device.type == "meta" for p in self.parameters()):
            self._init_weights()

    def _init_weights(self):
        """GPT-2's: normal(0, 0.02), residual projections scaled by 1/sqrt(2 layers)."""
        resid_std = 0.02 / (2 * self.config.layers) ** 0.5
        for name, m in self.named_modules():
            if isinstance(m, (nn.Linear, nn.Embedding)):
                nn.init.normal_(m.weight, 0.0, resid_std if name.endswith("c_proj") else 0.02)
            if isinstance(m, nn.Linear) and m.bias is not None:
                nn.init.zeros_(m.bias)

    def forward(self, tokens, targets):
        T = tokens.shape[1]
        positions = torch.arange(T, device=tokens.device)
        x = self.wte(tokens) + self.wpe(positions)  # (B, T, D)
        if self.drop is not None:
            x = self.drop(x)
        for block in self.blocks:
            x = block(x)
        head = self.wte.weight if self.lm_head is None else self.lm_head.weight
        logits = F.linear(self.ln_f(x), head)  # (B, T, V), tied head unless told otherwise
        if self.config.loss == "flat":
            return F.cross_entropy(logits.view(-1, logits.size(-1)), targets.view(-1))
        if self.config.loss == "fused":
            return fused_cross_entropy(logits.view(-1, logits.size(-1)), targets.view(-1))
        return F.cross_entropy(logits.transpose(1, 2), targets)

    def input_specs(self, batch: int):
        c = self.config
        shape = (batch, c.seq_len)
        return [indices(shape, c.vocab), indices(shape, c.vocab)]
