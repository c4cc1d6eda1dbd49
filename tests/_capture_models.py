"""Small models written the way library models are (keyword inputs, dict and
dataclass outputs, in-place writes, fused attention, Conv1D-style addmm),
for the export front end's tests; at module level so that spawn pickles the
worker."""
from __future__ import annotations

import copy
from dataclasses import dataclass

import torch
import torch.nn as nn
import torch.nn.functional as F

VOCAB, SEQ, DIM, HEADS = 13, 6, 8, 2


class RMSNorm(nn.Module):
    def __init__(self, dim):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim) + 0.1 * torch.randn(dim))

    def forward(self, x):
        return self.weight * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6))


class Conv1D(nn.Module):
    """GPT-2's layer: weight stored (in, out), addmm on the flattened rows."""

    def __init__(self, nin, nout):
        super().__init__()
        self.weight = nn.Parameter(torch.randn(nin, nout) * 0.2)
        self.bias = nn.Parameter(torch.randn(nout) * 0.1)

    def forward(self, x):
        shape = x.shape[:-1] + (self.weight.shape[1],)
        return torch.addmm(self.bias, x.view(-1, x.shape[-1]), self.weight).view(shape)


class KwLM(nn.Module):
    """forward(input_ids, attention_mask=None, labels=None) -> {"loss", "logits"}."""

    def __init__(self):
        super().__init__()
        self.emb = nn.Embedding(VOCAB, DIM)
        self.register_buffer("pos", torch.arange(SEQ), persistent=False)
        self.pemb = nn.Embedding(SEQ, DIM)
        self.norm = RMSNorm(DIM)
        self.qkv = Conv1D(DIM, 3 * DIM)
        self.out = nn.Linear(DIM, DIM)
        self.head = nn.Linear(DIM, VOCAB, bias=False)

    def forward(self, input_ids, attention_mask=None, labels=None):
        B, L = input_ids.shape
        h = self.emb(input_ids) + self.pemb(self.pos[:L])
        q, k, v = self.qkv(self.norm(h)).split(DIM, dim=-1)
        q, k, v = (t.view(B, L, HEADS, DIM // HEADS).transpose(1, 2) for t in (q, k, v))
        mask = torch.ones(L, L, dtype=torch.bool).tril()
        if attention_mask is not None:
            mask = mask & attention_mask[:, None, None, :].bool()
        a = F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
        h = h + self.out(a.transpose(1, 2).reshape(B, L, DIM))
        h += h  # an in-place write into an intermediate
        logits = self.head(h)
        out = {"logits": logits}
        if labels is not None:
            shifted = labels.new_full(labels.shape, -100)
            shifted[:, :-1] = labels[:, 1:]  # an in-place write through a view
            out["loss"] = F.cross_entropy(logits.reshape(-1, VOCAB), shifted.reshape(-1))
        return out


@dataclass
class Output:
    loss: torch.Tensor
    scores: torch.Tensor


class DataDependent(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(4, 4)

    def forward(self, x):
        y = self.fc(x)
        if y.sum() > 0:  # control flow on a tensor's value
            y = -y
        return y


def batch(b: int = 4, step: int = 0):
    g = torch.Generator().manual_seed(100 + step)
    ids = torch.randint(0, VOCAB, (b, SEQ), generator=g)
    mask = torch.ones(b, SEQ, dtype=torch.long)
    mask[0, -2:] = 0
    return {"input_ids": ids, "attention_mask": mask, "labels": torch.randint(0, VOCAB, (b, SEQ), generator=g)}


def train_kwlm(rank: int, steps: int = 2):
    """2 SGD steps of KwLM under a random strategy; rank 0 also in one process."""
    import flexflow as ff
    from flexflow.hardware.machine import Machine

    torch.set_num_threads(1)
    torch.manual_seed(0)
    model = KwLM()
    ref = copy.deepcopy(model)
    machine = Machine.preset("cpu", devices=2)
    graph = ff.trace(model, (), batch())
    par = ff.parallelize(model, example_kwargs=batch(), machine=machine,
                         strategy=ff.Strategy.random(graph, machine, 3).to_json())
    out = {"keys": None, "losses": [], "ref": []}
    for net, key in ((par, "losses"), (ref, "ref")):
        opt = torch.optim.SGD(net.parameters(), lr=0.1)
        for step in range(steps):
            opt.zero_grad()
            res = net(**batch(step=step))
            res["loss"].backward()
            opt.step()
            out[key].append(float(res["loss"]))
            out["keys"] = sorted(res)
    state, ref_state = par.state_dict(), ref.state_dict()
    out["param_err"] = max(float((state[k] - v).abs().max()) for k, v in ref_state.items())
    out["exchanges"] = par.runtime.num_exchanges
    return out
