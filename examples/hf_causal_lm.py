"""Train a Hugging Face causal language model with a flexflow strategy.

The model comes as transformers ships it (``AutoModelForCausalLM`` from a
config: random weights, nothing is downloaded); flexflow captures it with
torch.export, searches a strategy on rank 0 and runs it.  The parallel
module takes the same keyword inputs (``input_ids=``, ``labels=``) and
returns the same ``ModelOutput`` as the original.

Local processes (gloo on CPU):

    python examples/hf_causal_lm.py --model gpt2 --nprocs 2 --steps 10

One process per GPU, several nodes included:

    torchrun --nproc-per-node 8 examples/hf_causal_lm.py --model llama --layers 12 --hidden 768

Needs ``pip install transformers`` (or ``pip install 'flexflow[ext]'``).
"""
from __future__ import annotations

import argparse
import os
import sys
import time

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import torch  # noqa: E402

import flexflow as ff  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from train import start  # noqa: E402  (torchrun or local processes, as examples/train.py runs)


def parse(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="gpt2", choices=("gpt2", "llama"))
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--hidden", type=int, default=64)
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--vocab", type=int, default=512)
    p.add_argument("--seq", type=int, default=32)
    p.add_argument("--batch", type=int, default=8, help="global batch")
    p.add_argument("--steps", type=int, default=10)
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--budget", type=float, default=5.0, help="search seconds")
    p.add_argument("--nprocs", type=int, default=2, help="local processes when not under torchrun")
    return p.parse_args(argv)


def build(args):
    """A causal LM from a config, with the same random weights on every rank."""
    from transformers import AutoModelForCausalLM, GPT2Config, LlamaConfig
    if args.model == "gpt2":
        cfg = GPT2Config(n_layer=args.layers, n_embd=args.hidden, n_head=args.heads, vocab_size=args.vocab,
                         n_positions=args.seq, resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0,
                         bos_token_id=0, eos_token_id=0)
    else:  # grouped-query attention: half as many key/value heads
        cfg = LlamaConfig(vocab_size=args.vocab, hidden_size=args.hidden, intermediate_size=4 * args.hidden,
                          num_hidden_layers=args.layers, num_attention_heads=args.heads,
                          num_key_value_heads=max(1, args.heads // 2), max_position_embeddings=args.seq,
                          bos_token_id=0, eos_token_id=0, pad_token_id=0)
    torch.manual_seed(0)
    return AutoModelForCausalLM.from_config(cfg)


def batch(args, step: int) -> dict:
    """Synthetic tokens, identical on every rank, new every step."""
    g = torch.Generator().manual_seed(step)
    ids = torch.randint(0, args.vocab, (args.batch, args.seq), generator=g)
    return {"input_ids": ids, "labels": ids.clone()}


def run(rank: int, args) -> list[float]:
    model = build(args)
    par = ff.parallelize(model, example_kwargs=batch(args, 0), budget=args.budget)
    if rank == 0:
        print(f"strategy {par.strategy.name}: {len(par.graph.compute_ops)} ops placed, "
              f"opaque: {[par.graph.op(n).kind for n in par.graph.opaque]}", flush=True)
    opt = torch.optim.AdamW(par.parameters(), lr=args.lr)
    losses, t0 = [], time.perf_counter()
    for step in range(args.steps):
        opt.zero_grad()
        out = par(**batch(args, step))  # the same CausalLMOutput as the plain model
        out.loss.backward()
        opt.step()
        losses.append(out.loss.item())
        if rank == 0:
            rate = args.batch * (step + 1) / (time.perf_counter() - t0)
            print(f"step {step + 1:>4}/{args.steps}  loss {losses[-1]:.4f}  {rate:,.0f} samples/s", flush=True)
    return losses


def main(argv=None) -> None:
    start(run, parse(argv))


if __name__ == "__main__":
    main()
