"""LLaMA 3 (Meta, 2024) at the sizes of its model cards: RMSNorm before attention and MLP,
rotary positions (the rotate-half form), grouped-query attention (keys and values of few
heads repeated to the query heads, as torchtitan's ``repeat_kv``), causal attention by
``F.scaled_dot_product_attention`` (fused: no s x s matrix is kept) and a SwiGLU MLP.

Sizes (layers / width / heads / key-value heads / MLP hidden; vocabulary 128,256, rotary
base 500,000, from the released configs): ``1b`` (Llama 3.2 1B, head tied to the
embedding) 16 / 2048 / 32 / 8 / 8192, ``8b`` (Llama 3.1 8B) 32 / 4096 / 32 / 8 / 14336,
``70b`` (Llama 3.1 70B) 80 / 8192 / 64 / 8 / 28672; ``small`` is the 8b graph at 2 layers
of width 64 for tests.  The sequence is 8,192 tokens (Llama 3's pretraining context)
unless ``seq_len`` says otherwise.  Llama 3.1's long-context rescaling of the rotary
frequencies changes values only, not the graph, and is left out."""
from __future__ import annotations

from dataclasses import dataclass, replace

import torch
import torch.nn.functional as F
from torch import nn

from ..graph.ops.fused_ce import fused_cross_entropy
from ._common import indices

__all__ = ["LLAMA_SIZES", "Llama", "LlamaConfig", "llama_config"]


@dataclass(frozen=True)
class LlamaConfig:
    layers: int = 32  # transformer blocks
    width: int = 4096  # residual stream width
    heads: int = 32  # query heads; width must be divisible by heads
    kv_heads: int = 8  # key / value heads (grouped-query attention); divides heads
    hidden: int = 14336  # SwiGLU hidden units
    vocab: int = 128256  # tokenizer vocabulary
    seq_len: int = 8192  # training sequence length of the example inputs
    rope_theta: float = 500000.0  # rotary base
    eps: float = 1e-5  # RMSNorm epsilon
    tie_embeddings: bool = False  # output head shares the token embedding
    # "transposed": cross_entropy(logits.transpose(1, 2), targets); "flat": over the
    # flattened rows, cross_entropy(logits.view(-1, V), targets.view(-1)), as nanoGPT,
    # llm-foundry and Hugging Face write it (the same value); "fused": the flattened rows
    # through flexflow.fused_cross_entropy (no float32 copy of the logits, as llm-foundry's
    # default fused_crossentropy and llm.c's fused classifier run it)
    loss: str = "transposed"


# size -> config fields
_SIZES = {
    "1b": {"layers": 16, "width": 2048, "heads": 32, "kv_heads": 8, "hidden": 8192, "tie_embeddings": True},
    "8b": {"layers": 32, "width": 4096, "heads": 32, "kv_heads": 8, "hidden": 14336},
    "70b": {"layers": 80, "width": 8192, "heads": 64, "kv_heads": 8, "hidden": 28672},
}
LLAMA_SIZES = ("paper", "small") + tuple(_SIZES)


def llama_config(size: str, seq_len: int | None = None) -> LlamaConfig:
    """The config of a size (``LLAMA_SIZES``; "paper" is 8b), at ``seq_len`` tokens when given."""
    if size == "small":
        cfg = LlamaConfig(layers=2, width=64, heads=4, kv_heads=2, hidden=128, vocab=128, seq_len=16)
    else:
        cfg = LlamaConfig(**_SIZES["8b" if size == "paper" else size])
    return cfg if seq_len is None else replace(cfg, seq_len=seq_len)


class RMSNorm(nn.Module):
    def __init__(self, width: int, eps: float):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(width))

    def forward(self, x):
        return F.rms_norm(x, (x.shape[-1],), self.weight, self.eps)


def rotate(x, cos, sin):
    """Rotary positions on (B, T, H, hd) with cos / sin of shape (T, 1, hd)."""
    half = x.shape[-1] // 2
    x1, x2 = x[..., :half], x[..., half:]
    return x * cos + torch.cat((-x2, x1), dim=-1) * sin


def repeat_kv(x, rep: int):
    """(B, T, Hkv, hd) -> (B, T, Hkv * rep, hd): each key / value head for its query heads."""
    if rep == 1:
        return x
    B, T, H, D = x.shape[0], x.shape[1], x.shape[2], x.shape[3]
    # a copy, as reshape makes of the expanded view (written out so that it counts as one)
    return x[:, :, :, None, :].expand(B, T, H, rep, D).contiguous().view(B, T, H * rep, D)


class Attention(nn.Module):
    def __init__(self, cfg: LlamaConfig):
        super().__init__()
        self.heads, self.kv_heads = cfg.heads, cfg.kv_heads
        hd = cfg.width // cfg.heads
        self.wq = nn.Linear(cfg.width, cfg.heads * hd, bias=False)
        self.wk = nn.Linear(cfg.width, cfg.kv_heads * hd, bias=False)
        self.wv = nn.Linear(cfg.width, cfg.kv_heads * hd, bias=False)
        self.wo = nn.Linear(cfg.heads * hd, cfg.width, bias=False)

    def forward(self, x, cos, sin):
        # heads counted from the projections' widths (-1), not from self.heads: under
        # torch's tensor parallelism (plan.parallelize_fn) a rank holds a slice of the heads
        B, T, D = x.shape[0], x.shape[1], x.shape[2]
        hd = D // self.heads
        q = rotate(self.wq(x).view(B, T, -1, hd), cos, sin)
        k = rotate(self.wk(x).view(B, T, -1, hd), cos, sin)
        v = self.wv(x).view(B, T, -1, hd)
        rep = self.heads // self.kv_heads
        k, v = repeat_kv(k, rep), repeat_kv(v, rep)
        y = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2),
                                           is_causal=True)  # (B, H, T, hd)
        return self.wo(y.transpose(1, 2).reshape(B, T, -1))


class FeedForward(nn.Module):
    """SwiGLU: w2(silu(w1 x) * w3 x)."""

    def __init__(self, cfg: LlamaConfig):
        super().__init__()
        self.w1 = nn.Linear(cfg.width, cfg.hidden, bias=False)
        self.w3 = nn.Linear(cfg.width, cfg.hidden, bias=False)
        self.w2 = nn.Linear(cfg.hidden, cfg.width, bias=False)

    def forward(self, x):
        return self.w2(F.silu(self.w1(x)) * self.w3(x))


class Block(nn.Module):
    def __init__(self, cfg: LlamaConfig):
        super().__init__()
        self.attention_norm = RMSNorm(cfg.width, cfg.eps)
        self.attention = Attention(cfg)
        self.ffn_norm = RMSNorm(cfg.width, cfg.eps)
        self.feed_forward = FeedForward(cfg)

    def forward(self, x, cos, sin):
        x = x + self.attention(self.attention_norm(x), cos, sin)
        return x + self.feed_forward(self.ffn_norm(x))


class Llama(nn.Module):
    """``forward(tokens, targets)``: token ids (B, T) and next-token targets (B, T) ->
    the mean cross-entropy (a 0-d tensor)."""

    def __init__(self, cfg: LlamaConfig):
        super().__init__()
        if cfg.width % cfg.heads or cfg.heads % cfg.kv_heads or (cfg.width // cfg.heads) % 2:
            raise ValueError(f"llama: width {cfg.width}, {cfg.heads} heads and {cfg.kv_heads} key-value heads "
                             "need heads | width, kv_heads | heads and an even head size")
        self.config = cfg
        self.tok_embeddings = nn.Embedding(cfg.vocab, cfg.width)
        self.layers = nn.ModuleList(Block(cfg) for _ in range(cfg.layers))
        self.norm = RMSNorm(cfg.width, cfg.eps)
        self.output = None if cfg.tie_embeddings else nn.Linear(cfg.width, cfg.vocab, bias=False)
        hd = cfg.width // cfg.heads
        inv_freq = 1.0 / cfg.rope_theta ** (torch.arange(0, hd, 2, dtype=torch.float32) / hd)
        angles = torch.outer(torch.arange(cfg.seq_len, dtype=torch.float32), inv_freq)
        angles = torch.cat((angles, angles), dim=-1)[:, None, :]  # (T, 1, hd)
        self.register_buffer("cos", angles.cos(), persistent=False)
        self.register_buffer("sin", angles.sin(), persistent=False)
        if not any(p.device.type == "meta" for p in self.parameters()):
            for m in self.modules():
                if isinstance(m, (nn.Linear, nn.Embedding)):
                    nn.init.normal_(m.weight, 0.0, 0.02)

    def forward(self, tokens, targets):
        T = tokens.shape[1]
        # self.cos[:T], written with narrow: fx cannot slice a buffer by a traced length
        cos, sin = self.cos.narrow(0, 0, T), self.sin.narrow(0, 0, T)
        x = self.tok_embeddings(tokens)  # (B, T, D)
        for layer in self.layers:
            x = layer(x, cos, sin)
        x = self.norm(x)
        logits = F.linear(x, self.tok_embeddings.weight) if self.output is None else self.output(x)
        if self.config.loss == "flat":
            return F.cross_entropy(logits.view(-1, logits.size(-1)), targets.view(-1))
        if self.config.loss == "fused":
            return fused_cross_entropy(logits.view(-1, logits.size(-1)), targets.view(-1))
        return F.cross_entropy(logits.transpose(1, 2), targets)  # logits (B, V, T)

    def input_specs(self, batch: int):
        c = self.config
        shape = (batch, c.seq_len)
        return [indices(shape, c.vocab), indices(shape, c.vocab)]
