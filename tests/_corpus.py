"""Models written the way their authors write them, not the way the zoo does: a loss
over flattened rows (nanoGPT, llm-foundry, Hugging Face's causal-LM loss), torch.nn's
sequence-first defaults, an MLP over ``x.view(B * T, C)``, a batch reshaped into
groups, the layers of torch.nn in their default layouts.  Each has ``input_specs(batch)``
(the shapes as the model takes them: a sequence-first model takes (T, B)) and returns
its scalar loss.  Used by tests/test_corpus.py (and its 2-process runs)."""
from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F

from flexflow.models._common import InputSpec

V, T = 48, 8


class NanoGPT(nn.Module):
    """nanoGPT's GPT: fused qkv split, heads by view + transpose, flash attention,
    a tied head and the loss over ``logits.view(-1, V)`` with ``ignore_index=-1``."""

    def __init__(self, d=24, heads=4, layers=2):
        super().__init__()
        self.wte, self.wpe, self.heads = nn.Embedding(V, d), nn.Embedding(T, d), heads
        self.h = nn.ModuleList()
        for _ in range(layers):
            b = nn.Module()
            b.ln_1, b.c_attn, b.c_proj = nn.LayerNorm(d), nn.Linear(d, 3 * d), nn.Linear(d, d)
            b.ln_2, b.c_fc, b.mlp_proj = nn.LayerNorm(d), nn.Linear(d, 4 * d), nn.Linear(4 * d, d)
            self.h.append(b)
        self.ln_f = nn.LayerNorm(d)
        self.lm_head = nn.Linear(d, V, bias=False)
        self.wte.weight = self.lm_head.weight

    def forward(self, idx, targets):
        B, L = idx.size()
        pos = torch.arange(0, L, dtype=torch.long, device=idx.device)
        x = self.wte(idx) + self.wpe(pos)
        for b in self.h:
            h = b.ln_1(x)
            C = h.size(-1)
            q, k, v = b.c_attn(h).split(C, dim=2)
            q = q.view(B, L, self.heads, C // self.heads).transpose(1, 2)
            k = k.view(B, L, self.heads, C // self.heads).transpose(1, 2)
            v = v.view(B, L, self.heads, C // self.heads).transpose(1, 2)
            y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
            x = x + b.c_proj(y.transpose(1, 2).contiguous().view(B, L, C))
            x = x + b.mlp_proj(F.gelu(b.c_fc(b.ln_2(x))))
        logits = self.lm_head(self.ln_f(x))
        return F.cross_entropy(logits.view(-1, logits.size(-1)), targets.view(-1), ignore_index=-1)

    def input_specs(self, batch):
        return [InputSpec((batch, T), "index", V), InputSpec((batch, T), "index", V)]


class ShiftedLM(nn.Module):
    """Hugging Face's causal-LM loss: labels shifted by one, then flattened."""

    def __init__(self, d=16):
        super().__init__()
        self.emb, self.mix, self.head = nn.Embedding(V, d), nn.Linear(d, d), nn.Linear(d, V)

    def forward(self, ids, labels):
        logits = self.head(torch.tanh(self.mix(self.emb(ids))))
        shift_logits = logits[..., :-1, :].contiguous()
        shift_labels = labels[..., 1:].contiguous()
        return nn.CrossEntropyLoss()(shift_logits.view(-1, V), shift_labels.view(-1))

    def input_specs(self, batch):
        return [InputSpec((batch, T), "index", V), InputSpec((batch, T), "index", V)]


class FlatMLP(nn.Module):
    """Megatron-era code: the MLP over ``x.view(B * T, C)``, viewed back after."""

    def __init__(self, d=16):
        super().__init__()
        self.fc1, self.fc2 = nn.Linear(d, 4 * d), nn.Linear(4 * d, d)

    def forward(self, x, y):
        B, L, C = x.shape
        h = self.fc2(F.gelu(self.fc1(x.view(B * L, C)))).view(B, L, C)
        return F.mse_loss(h + x, y)

    def input_specs(self, batch):
        return [InputSpec((batch, T, 16), "float"), InputSpec((batch, T, 16), "float")]


class GroupedBatch(nn.Module):
    """The batch reshaped into (groups, per group): each group centred on its own mean."""

    def __init__(self, d=12, groups=2):
        super().__init__()
        self.fc, self.out, self.groups = nn.Linear(d, d), nn.Linear(d, 3), groups

    def forward(self, x, y):
        B, C = x.shape
        h = self.fc(x).view(self.groups, B // self.groups, C)
        h = (h - h.mean(dim=1, keepdim=True)).reshape(B, C)
        return F.cross_entropy(self.out(torch.relu(h)), y)

    def input_specs(self, batch):
        return [InputSpec((batch, 12), "float"), InputSpec((batch,), "index", 3)]


class SeqFirstEncoder(nn.Module):
    """nn.TransformerEncoder in its default layout: (T, B, d), as PyTorch's tutorials."""

    def __init__(self, d=16):
        super().__init__()
        self.emb = nn.Embedding(V, d)
        layer = nn.TransformerEncoderLayer(d, 2, 32, dropout=0.0)
        self.enc = nn.TransformerEncoder(layer, 2, enable_nested_tensor=False)
        self.out = nn.Linear(d, V)

    def forward(self, src, tgt):  # (T, B)
        h = self.enc(self.emb(src))
        return F.cross_entropy(self.out(h).view(-1, V), tgt.view(-1))

    def input_specs(self, batch):
        return [InputSpec((T, batch), "index", V), InputSpec((T, batch), "index", V)]


class SeqFirstLayer(nn.Module):
    """One nn.TransformerEncoderLayer, seq-first, its loss over the batch-major rows."""

    def __init__(self, d=16):
        super().__init__()
        self.emb = nn.Embedding(V, d)
        self.layer = nn.TransformerEncoderLayer(d, 4, 32, dropout=0.0)
        self.out = nn.Linear(d, V)

    def forward(self, src, tgt):  # (T, B)
        h = self.layer(self.emb(src))
        return F.cross_entropy(self.out(h).permute(1, 2, 0), tgt.t())

    def input_specs(self, batch):
        return [InputSpec((T, batch), "index", V), InputSpec((T, batch), "index", V)]


class SeqFirstMHA(nn.Module):
    """nn.MultiheadAttention in its default layout, with its attention weights."""

    def __init__(self, d=16):
        super().__init__()
        self.emb, self.mha, self.out = nn.Embedding(V, d), nn.MultiheadAttention(d, 4), nn.Linear(d, V)

    def forward(self, src, tgt):
        h = self.emb(src)
        a, w = self.mha(h, h, h)
        return F.cross_entropy(self.out(h + a).permute(1, 2, 0), tgt.t()) + w.pow(2).mean()

    def input_specs(self, batch):
        return [InputSpec((T, batch), "index", V), InputSpec((T, batch), "index", V)]


class SeqFirstMHANoWeights(nn.Module):
    """nn.MultiheadAttention without its weights (it returns (out, None)), the loss over
    the batch-major logits made by two transposes."""

    def __init__(self, d=16):
        super().__init__()
        self.emb, self.mha, self.out = nn.Embedding(V, d), nn.MultiheadAttention(d, 4), nn.Linear(d, V)

    def forward(self, src, tgt):
        h = self.emb(src)
        a = self.mha(h, h, h, need_weights=False)[0]
        return F.cross_entropy(self.out(a).transpose(0, 1).transpose(1, 2), tgt.t())

    def input_specs(self, batch):
        return [InputSpec((T, batch), "index", V), InputSpec((T, batch), "index", V)]


class SeqFirstRNNs(nn.Module):
    """nn.LSTM, nn.GRU and nn.RNN without batch_first: (T, B, ·)."""

    def __init__(self, d=12):
        super().__init__()
        self.emb = nn.Embedding(V, d)
        self.lstm, self.gru, self.rnn = nn.LSTM(d, d), nn.GRU(d, d), nn.RNN(d, d)
        self.out = nn.Linear(d, V)

    def forward(self, src, tgt):
        h, _ = self.lstm(self.emb(src))
        h, _ = self.gru(h)
        h, hn = self.rnn(h)
        return F.cross_entropy(self.out(h).permute(1, 2, 0), tgt.t()) + hn.pow(2).mean()

    def input_specs(self, batch):
        return [InputSpec((T, batch), "index", V), InputSpec((T, batch), "index", V)]


class Layers(nn.Module):
    """torch.nn's layers in their default layouts: conv1d / conv2d (N, C, ...), norms,
    pools, dropout, flatten, and a few activations."""

    def __init__(self):
        super().__init__()
        self.c1, self.bn1, self.p1 = nn.Conv1d(3, 6, 3, padding=1), nn.BatchNorm1d(6), nn.MaxPool1d(2)
        self.c2, self.gn, self.p2 = nn.Conv2d(3, 8, 3, padding=1), nn.GroupNorm(2, 8), nn.AvgPool2d(2)
        self.ln, self.drop, self.flat = nn.LayerNorm(8 * 4 * 4), nn.Dropout(0.0), nn.Flatten()
        self.fc = nn.Linear(6 * 8 + 8 * 4 * 4, 5)
        self.act = nn.SiLU()

    def forward(self, seq, img, y):
        a = self.flat(self.p1(F.relu(self.bn1(self.c1(seq)))))
        b = self.ln(self.flat(self.p2(self.act(self.gn(self.c2(img))))))
        return F.cross_entropy(self.fc(self.drop(torch.cat([a, b], dim=1))), y)

    def input_specs(self, batch):
        return [InputSpec((batch, 3, 16), "float"), InputSpec((batch, 3, 8, 8), "float"),
                InputSpec((batch,), "index", 5)]


CORPUS = {"nanogpt": NanoGPT, "shifted_lm": ShiftedLM, "flat_mlp": FlatMLP, "grouped_batch": GroupedBatch,
          "seqfirst_encoder": SeqFirstEncoder, "seqfirst_layer": SeqFirstLayer, "seqfirst_mha": SeqFirstMHA,
          "seqfirst_mha_noweights": SeqFirstMHANoWeights,
          "seqfirst_rnns": SeqFirstRNNs, "layers": Layers}


class MoreLayers(nn.Module):
    """More of torch.nn in default layouts: transposed and 3-D convolutions, instance norm,
    PReLU, upsampling, pixel shuffle, a bilinear layer, an embedding bag, local response norm."""

    def __init__(self):
        super().__init__()
        self.up = nn.ConvTranspose2d(3, 4, 2, stride=2)
        self.inorm, self.prelu = nn.InstanceNorm2d(4, affine=True), nn.PReLU(4)
        self.shuffle, self.lrn = nn.PixelShuffle(2), nn.LocalResponseNorm(2)
        self.upsample = nn.Upsample(scale_factor=2, mode="nearest")
        self.c3 = nn.Conv3d(1, 2, 3, padding=1)
        self.bag = nn.EmbeddingBag(V, 6, mode="mean")
        self.bil = nn.Bilinear(6, 6, 4)
        self.fc = nn.Linear(1 * 16 * 16 + 2 * 4 * 4 * 4 + 4, 3)

    def forward(self, img, vol, ids, y):
        a = self.lrn(self.shuffle(self.prelu(self.inorm(self.up(img)))))  # (N, 1, 8, 8) -> (N, 1, 8, 8)
        a = self.upsample(a).flatten(1)  # (N, 256)
        b = self.c3(vol).flatten(1)  # (N, 128)
        e = self.bag(ids)
        c = self.bil(e, torch.tanh(e))
        return F.cross_entropy(self.fc(torch.cat([a, b, c], dim=1)), y)

    def input_specs(self, batch):
        return [InputSpec((batch, 3, 2, 2), "float"), InputSpec((batch, 1, 4, 4, 4), "float"),
                InputSpec((batch, 5), "index", V), InputSpec((batch,), "index", 3)]


CORPUS["more_layers"] = MoreLayers
