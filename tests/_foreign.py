"""Models the project does not own, built from small configs with random
weights (no downloads): Hugging Face transformers, timm, torchvision.

``build(name, batch)`` -> ``(module, args, kwargs)`` where
``module(*args, **kwargs)`` returns what the library returns (a ModelOutput
with ``.loss`` for transformers, logits for the vision models: the loss
of those is computed outside, as users do).  ``batch_for_step`` makes a
fresh batch of the same shapes.  Imports of the libraries are lazy so that
the module loads without them; ``FAMILIES`` says which library each needs.
"""
from __future__ import annotations

import os

import torch
import torch.nn as nn

os.environ.setdefault("HF_HUB_OFFLINE", "1")

VOCAB, SEQ = 96, 8
FAMILIES = {  # name -> library it needs
    "gpt2": "transformers", "llama": "transformers", "bert": "transformers", "t5": "transformers",
    "bart": "transformers",
    "vit": "timm", "convnext": "timm", "swin": "timm", "efficientnet": "timm", "mobilenetv3": "timm",
    "tv_resnet18": "torchvision", "tv_mobilenet_v3_small": "torchvision", "tv_convnext_tiny": "torchvision",
}
HF = [k for k, v in FAMILIES.items() if v == "transformers"]
VISION = [k for k, v in FAMILIES.items() if v != "transformers"]


def _hf(name):
    import transformers as T
    quiet = dict(tie_word_embeddings=True)
    if name == "gpt2":
        cfg = T.GPT2Config(n_layer=2, n_embd=32, n_head=4, vocab_size=VOCAB, n_positions=SEQ,
                           resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, bos_token_id=0, eos_token_id=0)
        return T.GPT2LMHeadModel(cfg), "causal"
    if name == "llama":  # grouped-query attention (4 query heads, 2 key/value heads), rotary embeddings
        cfg = T.LlamaConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                            num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=SEQ,
                            bos_token_id=0, eos_token_id=0, pad_token_id=0, **quiet)
        return T.LlamaForCausalLM(cfg), "causal"
    if name == "bert":
        cfg = T.BertConfig(vocab_size=VOCAB, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                           intermediate_size=64, max_position_embeddings=SEQ, num_labels=3,
                           hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0)
        return T.BertForSequenceClassification(cfg), "classify"
    if name == "t5":
        cfg = T.T5Config(vocab_size=VOCAB, d_model=32, d_kv=8, d_ff=64, num_layers=2, num_heads=4,
                         dropout_rate=0.0, decoder_start_token_id=0, pad_token_id=0, eos_token_id=1)
        return T.T5ForConditionalGeneration(cfg), "seq2seq"
    if name == "bart":
        cfg = T.BartConfig(vocab_size=VOCAB, d_model=32, encoder_layers=2, decoder_layers=2,
                           encoder_attention_heads=4, decoder_attention_heads=4, encoder_ffn_dim=64,
                           decoder_ffn_dim=64, max_position_embeddings=SEQ, dropout=0.0,
                           attention_dropout=0.0, activation_dropout=0.0, pad_token_id=1,
                           bos_token_id=0, eos_token_id=2, decoder_start_token_id=2)
        return T.BartForConditionalGeneration(cfg), "seq2seq"
    raise KeyError(name)


def _vision(name):
    if name.startswith("tv_"):
        import torchvision.models as tvm
        arch = name[3:]
        if arch == "convnext_tiny":  # the torchvision block structure, narrower
            from torchvision.models.convnext import CNBlockConfig, ConvNeXt
            return ConvNeXt([CNBlockConfig(8, 16, 1), CNBlockConfig(16, None, 1)], num_classes=5)
        if arch == "mobilenet_v3_small":
            return tvm.mobilenet_v3_small(num_classes=5, width_mult=0.25)
        return getattr(tvm, arch)(num_classes=5)
    import timm
    kw = dict(pretrained=False, num_classes=5)
    if name == "vit":
        return timm.create_model("vit_tiny_patch16_224", img_size=32, patch_size=8, embed_dim=32, depth=2,
                                 num_heads=4, **kw)
    if name == "convnext":
        return timm.create_model("convnext_atto", depths=(1, 1, 1, 1), dims=(8, 16, 24, 32), **kw)
    if name == "swin":
        return timm.create_model("swin_tiny_patch4_window7_224", img_size=32, patch_size=2, window_size=4,
                                 embed_dim=16, depths=(1, 1), num_heads=(2, 4), drop_path_rate=0.0, **kw)
    if name == "efficientnet":
        return timm.create_model("test_efficientnet", drop_rate=0.0, drop_path_rate=0.0, **kw)
    if name == "mobilenetv3":
        return timm.create_model("mobilenetv3_small_050", drop_rate=0.0, **kw)
    raise KeyError(name)


def batch_for_step(name: str, batch: int, step: int):
    """(args, kwargs) of a fresh batch (seeded by ``step``)."""
    g = torch.Generator().manual_seed(1000 + step)
    if FAMILIES[name] == "transformers":
        ids = torch.randint(3, VOCAB, (batch, SEQ), generator=g)
        kind = _KIND[name]
        if kind == "causal":
            return (), {"input_ids": ids, "labels": torch.randint(3, VOCAB, (batch, SEQ), generator=g)}
        if kind == "classify":
            mask = torch.ones(batch, SEQ, dtype=torch.long)
            mask[0, -2:] = 0  # one padded sequence
            return (), {"input_ids": ids, "attention_mask": mask,
                        "labels": torch.randint(0, 3, (batch,), generator=g)}
        return (), {"input_ids": ids, "labels": torch.randint(3, VOCAB, (batch, SEQ), generator=g)}
    size = 64 if name in _BN else 32  # BatchNorm models: 2x2 at the last stage, statistics well posed
    x = torch.randn(batch, 3, size, size, generator=g)
    return (x.double() if name in _BN else x,), {}


_BN = {"efficientnet", "mobilenetv3", "tv_resnet18", "tv_mobilenet_v3_small"}
_KIND = {"gpt2": "causal", "llama": "causal", "bert": "classify", "t5": "seq2seq", "bart": "seq2seq"}


def build(name: str, batch: int, seed: int = 0):
    """(module, args, kwargs), the same weights for the same seed on every process."""
    torch.manual_seed(seed)
    module = _hf(name)[0] if FAMILIES[name] == "transformers" else _vision(name)
    for m in module.modules():  # deterministic training: no dropout
        if isinstance(m, nn.Dropout):
            m.p = 0.0
    if name in _BN:
        # float64: train-mode BatchNorm over a few values per channel turns float32
        # rounding (summation order of split convolutions) into 1e-5 differences;
        # in float64 the partitioned run equals one process to ~1e-14
        module.double()
    args, kwargs = batch_for_step(name, batch, 0)
    return module, args, kwargs


def loss_of(name: str, out, args, kwargs, step: int = 0):
    """The training loss of one call: the model's own for transformers, a
    cross-entropy on the logits (computed outside the model) for vision."""
    if FAMILIES[name] == "transformers":
        return out.loss
    batch = args[0].shape[0]
    target = torch.randint(0, 5, (batch,), generator=torch.Generator().manual_seed(2000 + step))
    return nn.functional.cross_entropy(out, target)


# --------------------------------------------------------------------------- 2-process worker
LR = 0.05


def _rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.detach().double(), b.detach().double()
    return float((a - b).abs().max()) / max(float(b.abs().max()), 1e-3) if b.numel() else 0.0


def _train(model, name: str, batch: int, steps: int):
    # vision models: a smaller step (train-mode BatchNorm on a few values per channel
    # amplifies rounding differences once a large step makes training jumpy)
    opt = torch.optim.SGD(model.parameters(), lr=LR if FAMILIES[name] == "transformers" else LR / 5)
    losses = []
    for step in range(steps):
        opt.zero_grad()
        args, kwargs = batch_for_step(name, batch, step)
        loss = loss_of(name, model(*args, **kwargs), args, kwargs, step)
        loss.backward()
        opt.step()
        losses.append(float(loss.detach()))
    return losses


def _make_strategy(spec: str, graph, machine):
    import random

    import flexflow as ff
    kind, _, seed = spec.partition(":")
    s = ff.Strategy.random(graph, machine, int(seed))
    if kind == "bnchannel":
        rng = random.Random(int(seed))
        for members in graph.groups.values():
            op = graph.op(members[0])
            if op.rule == "batchnorm":
                ok = [c for c in ff.candidate_configs(op, machine) if set(c.degrees) <= {"c"}]
                s = s.replace(op.name, rng.choice(ok))
    return s


def train_equal(rank: int, names, specs, batch: int = 4, steps: int = 2):
    """Every rank trains each model ``steps`` SGD steps under each strategy spec;
    rank 0 also trains the plain module in one process and reports the largest
    relative errors of the losses and of every state_dict tensor.

    Specs: "searched" (parallelize searches), "random:SEED", "bnchannel:SEED"
    (random, but BatchNorm split along channels or whole: train-mode
    statistics stay exact); "@eval" trains in eval mode (BatchNorm on running
    statistics: a sample split is then exact too)."""
    import copy

    import torch.distributed as dist

    import flexflow as ff
    from flexflow.hardware.machine import Machine

    torch.set_num_threads(1)
    world = dist.get_world_size()
    machine = Machine.preset("cpu", devices=world)
    out = []
    for name, spec in ((n, s) for n in names for s in specs[n]):
        module, args, kwargs = build(name, batch)
        spec, _, mode = spec.partition("@")
        module.train(mode != "eval")
        ref_losses = ref_state = None
        if rank == 0:
            ref = copy.deepcopy(module)
            ref_losses = _train(ref, name, batch, steps)
            ref_state = ref.state_dict()
        graph = ff.trace(module, args, kwargs)
        strategy = None
        if spec != "searched":
            strategy = _make_strategy(spec, graph, machine).to_json()
        par = ff.parallelize(module, example_inputs=args, example_kwargs=kwargs, strategy=strategy,
                             machine=machine, budget=1.0)
        losses = _train(par, name, batch, steps)
        state = par.state_dict()
        rec = {"model": name, "spec": spec + ("@" + mode if mode else ""), "losses": losses,
               "strategy": par.strategy.to_json(), "exchanges": par.runtime.num_exchanges}
        if rank == 0:
            rec["loss_err"] = max(abs(a - b) / max(abs(b), 1e-6) for a, b in zip(losses, ref_losses))
            rec["param_err"], rec["worst"] = max((_rel_err(state[k], v), k) for k, v in ref_state.items())
            rec["keys_match"] = sorted(state) == sorted(ref_state)
        out.append(rec)
    return out
