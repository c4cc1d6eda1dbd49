"""Unrolled recurrent models of the paper: RNNTC, RNNLM and NMT.

Each layer is one `nn.LSTMCell` called once per time step (the same module,
so the same weights, at every step): unrolling makes every step an op of its
own, which lets model parallelism across layers overlap time steps like a
pipeline. Loops run over fixed Python ints, so torch.fx traces them."""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn as nn
import torch.nn.functional as F

from ._common import indices


@dataclass(frozen=True)
class RNNConfig:
    vocab: int  # vocabulary size (source and target for NMT)
    layers: int  # stacked LSTM layers (for NMT: per encoder and per decoder)
    steps: int = 40  # unrolled time steps (for NMT: of source and of target)
    hidden: int = 1024  # LSTM hidden units
    embed: int = 1024  # embedding width
    num_classes: int = 2  # RNNTC output classes (unused by RNNLM and NMT)


_SMALL = dict(steps=4, hidden=16, embed=16)


def rnntc_config(size: str) -> RNNConfig:
    if size == "paper":
        return RNNConfig(vocab=20000, layers=4)
    return RNNConfig(vocab=50, layers=4, **_SMALL)


def rnnlm_config(size: str) -> RNNConfig:
    if size == "paper":
        return RNNConfig(vocab=10000, layers=2)
    return RNNConfig(vocab=50, layers=2, **_SMALL)


def nmt_config(size: str) -> RNNConfig:
    if size == "paper":
        return RNNConfig(vocab=32000, layers=2)
    return RNNConfig(vocab=50, layers=2, **_SMALL)


def _cells(cfg: RNNConfig) -> nn.ModuleList:
    return nn.ModuleList(
        nn.LSTMCell(cfg.embed if i == 0 else cfg.hidden, cfg.hidden) for i in range(cfg.layers)
    )


def _unroll(cells, emb, steps: int, hidden: int, state=None):
    """Run stacked `cells` over `steps` steps of `emb` (N, T, E).

    `state` is a list of per-layer (h, c) or None for zeros. Returns the top
    layer's hidden state at every step and the final per-layer state."""
    if state is None:
        N, dtype, device = emb.shape[0], emb.dtype, emb.device
        state = []
        for _ in cells:
            # The size as one tuple: torch.fx cannot trace torch.zeros(proxy, int).
            h = torch.zeros((N, hidden), dtype=dtype, device=device)
            c = torch.zeros((N, hidden), dtype=dtype, device=device)
            state.append((h, c))
    state = list(state)
    tops = []
    for t in range(steps):
        x = emb[:, t]
        for i, cell in enumerate(cells):
            h, c = cell(x, state[i])
            state[i] = (h, c)
            x = h
        tops.append(x)
    return tops, state


class RNNTC(nn.Module):
    """Text classification: embedding, stacked LSTM, last top state -> classes."""

    def __init__(self, cfg: RNNConfig):
        super().__init__()
        self.config = cfg
        self.steps = cfg.steps
        self.embedding = nn.Embedding(cfg.vocab, cfg.embed)
        self.cells = _cells(cfg)
        self.classifier = nn.Linear(cfg.hidden, cfg.num_classes)

    def forward(self, tokens, labels):
        emb = self.embedding(tokens)
        hs, _ = _unroll(self.cells, emb, self.steps, self.config.hidden)
        x = hs[-1]  # top layer, last step: (N, H)
        return F.cross_entropy(self.classifier(x), labels)

    def input_specs(self, batch: int):
        c = self.config
        return [indices((batch, c.steps), c.vocab), indices((batch,), c.num_classes)]


class RNNLM(nn.Module):
    """Language model: embedding, stacked LSTM, per-step softmax over the vocabulary."""

    def __init__(self, cfg: RNNConfig):
        super().__init__()
        self.config = cfg
        self.steps = cfg.steps
        self.embedding = nn.Embedding(cfg.vocab, cfg.embed)
        self.cells = _cells(cfg)
        self.decoder = nn.Linear(cfg.hidden, cfg.vocab)

    def forward(self, tokens, targets):
        emb = self.embedding(tokens)
        hs, _ = _unroll(self.cells, emb, self.steps, self.config.hidden)
        logits = self.decoder(torch.stack(hs, dim=1))  # (N, T, V)
        return F.cross_entropy(logits.transpose(1, 2), targets)

    def input_specs(self, batch: int):
        c = self.config
        return [indices((batch, c.steps), c.vocab), indices((batch, c.steps), c.vocab)]


class NMT(nn.Module):
    """Encoder-decoder with Luong attention after the decoder, teacher forcing.

    The decoder starts from the encoder's final per-layer state."""

    def __init__(self, cfg: RNNConfig):
        super().__init__()
        self.config = cfg
        self.steps = cfg.steps
        self.src_embedding = nn.Embedding(cfg.vocab, cfg.embed)
        self.encoder = _cells(cfg)
        self.tgt_embedding = nn.Embedding(cfg.vocab, cfg.embed)
        self.decoder = _cells(cfg)
        self.attn_combine = nn.Linear(2 * cfg.hidden, cfg.hidden)
        self.generator = nn.Linear(cfg.hidden, cfg.vocab)

    def forward(self, src_tokens, tgt_in, tgt_out):
        H = self.config.hidden
        enc_hs, state = _unroll(self.encoder, self.src_embedding(src_tokens), self.steps, H)
        dec_hs, _ = _unroll(self.decoder, self.tgt_embedding(tgt_in), self.steps, H, state)
        enc = torch.stack(enc_hs, dim=1)  # (N, S, H)
        dec = torch.stack(dec_hs, dim=1)  # (N, T, H)
        scores = torch.bmm(dec, enc.transpose(1, 2))  # (N, T, S)
        attn = F.softmax(scores, dim=-1)
        ctx = torch.bmm(attn, enc)  # (N, T, H)
        combined = torch.tanh(self.attn_combine(torch.cat([ctx, dec], dim=2)))
        logits = self.generator(combined)  # (N, T, V)
        return F.cross_entropy(logits.transpose(1, 2), tgt_out)

    def input_specs(self, batch: int):
        c = self.config
        shape = (batch, c.steps)
        return [indices(shape, c.vocab), indices(shape, c.vocab), indices(shape, c.vocab)]
