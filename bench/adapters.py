"""Adapter training cost by placement: step time and memory, decoder-half vs all-linear vs encoder-half.

    .venv/bin/python bench/adapters.py                     # both reference models, batch 16 x 128 tokens
    .venv/bin/python bench/adapters.py --models ced --steps 6 --seq-len 64    # smoke run

For each reference model (the causal encoder-decoder and the Llama) and each placement at equal rank
(16), with and without activation checkpointing, one training step = forward, backward, AdamW step on a
fixed random batch. The configurations are interleaved step by step (step i of each, in a rotating order,
before step i + 1 of any) so a noisy machine hits all alike; the median step time after ``--warmup``
steps is reported with its ratio to all-linear's. Memory is measured exactly rather than from the
process's RSS (which one process cannot attribute per configuration): the bytes of activations autograd
keeps for backward (``torch.autograd.graph.saved_tensors_hooks``) and the adapter's parameters +
gradients + AdamW state. Prints a markdown table; JSON to ``--out``.
"""

from __future__ import annotations

import argparse
import statistics
import time
from pathlib import Path

import torch
import torch.nn.functional as F

from kvgraft.adapters.lora import AdapterConfig, add_adapter
from kvgraft.adapters.placement import Placement
from kvgraft.atomic import atomic_write_json
from kvgraft.hf import load_pretrained
from kvgraft.reference import resolve_model

MODELS = {"ced": "kvgraft-ced-8m", "llama": "kvgraft-llama-8m"}
PLACEMENTS = {
    "all-linear": Placement("all", ("all-linear",)),
    "encoder-half": Placement("encoder-half", ("all-linear",)),
    "decoder-half": Placement("decoder-half", ("all-linear",), freeze_kv_writers=True),
}


def build(name: str, placement: Placement, rank: int, checkpointing: bool):
    model = load_pretrained(resolve_model(MODELS[name])).float()
    torch.manual_seed(0)
    pm = add_adapter(model, placement, AdapterConfig(rank=rank))
    model.gradient_checkpointing = checkpointing
    pm.train()
    params = [p for p in pm.parameters() if p.requires_grad]
    return pm, torch.optim.AdamW(params, lr=1e-4), params


def step(pm, opt, x) -> None:
    loss = F.cross_entropy(pm(x[:, :-1]).flatten(0, 1).float(), x[:, 1:].flatten())
    loss.backward()
    opt.step()
    opt.zero_grad(set_to_none=True)


def saved_bytes(pm, x) -> int:
    total = 0

    def pack(t):
        nonlocal total
        total += t.numel() * t.element_size()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        loss = F.cross_entropy(pm(x[:, :-1]).flatten(0, 1).float(), x[:, 1:].flatten())
    loss.backward()
    pm.zero_grad(set_to_none=True)
    return total


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--models", nargs="+", default=list(MODELS), choices=list(MODELS))
    p.add_argument("--batch", type=int, default=16)
    p.add_argument("--seq-len", type=int, default=128)
    p.add_argument("--rank", type=int, default=16)
    p.add_argument("--steps", type=int, default=12)
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--out", default="runs/bench/adapters.json")
    args = p.parse_args()
    for name in ("batch", "seq_len", "rank", "steps", "threads"):
        if getattr(args, name) < 1:
            p.error(f"--{name.replace('_', '-')} must be >= 1")
    if not 0 <= args.warmup < args.steps:
        p.error(f"--warmup ({args.warmup}) must be in [0, --steps)")
    torch.set_num_threads(args.threads)
    results = {"config": vars(args), "rows": []}
    for model_name in args.models:
        configs = {
            (pl, ck): build(model_name, placement, args.rank, ck) for pl, placement in PLACEMENTS.items() for ck in (False, True)
        }
        vocab = next(iter(configs.values()))[0].get_base_model().model.config.vocab_size
        x = torch.randint(0, vocab, (args.batch, args.seq_len + 1), generator=torch.Generator().manual_seed(0))
        times: dict = {k: [] for k in configs}
        keys = list(configs)
        for i in range(args.steps):
            order = keys[i % len(keys) :] + keys[: i % len(keys)]
            for k in order:
                pm, opt, _ = configs[k]
                t0 = time.perf_counter()
                step(pm, opt, x)
                if i >= args.warmup:
                    times[k].append(time.perf_counter() - t0)
        for (pl, ck), (pm, opt, params) in configs.items():
            trainable = sum(q.numel() for q in params)
            results["rows"].append(
                {
                    "model": model_name,
                    "placement": pl,
                    "checkpointing": ck,
                    "trainable": trainable,
                    "step_s": statistics.median(times[(pl, ck)]),
                    "saved_activation_bytes": saved_bytes(pm, x),
                    "adapter_state_bytes": trainable * 4 * 4,  # fp32 parameter, gradient, AdamW m and v
                }
            )
        print(f"{model_name}: done", flush=True)
    print(
        f"\nbatch {args.batch} x {args.seq_len} tokens, rank {args.rank}, fp32, {args.threads} threads, median of "
        f"{args.steps - args.warmup} interleaved steps; decoder-half with the pivot's KV writers frozen\n"
    )
    print(
        "| model | placement | checkpointing | trainable | step (s) | vs all-linear | activations kept (MB) "
        "| vs all-linear | adapter + grad + AdamW (MB) |"
    )
    print("|---|---|---|---|---|---|---|---|---|")
    for r in results["rows"]:
        base = next(
            b
            for b in results["rows"]
            if b["model"] == r["model"] and b["placement"] == "all-linear" and b["checkpointing"] == r["checkpointing"]
        )
        r["step_vs_all_linear"] = r["step_s"] / base["step_s"]
        r["activations_vs_all_linear"] = r["saved_activation_bytes"] / base["saved_activation_bytes"]
        print(
            f"| {r['model']} | {r['placement']} | {'on' if r['checkpointing'] else 'off'} | {r['trainable']:,} | "
            f"{r['step_s']:.3f} | {r['step_vs_all_linear']:.2f}x | {r['saved_activation_bytes'] / 2**20:.1f} | "
            f"{r['activations_vs_all_linear']:.2f}x | {r['adapter_state_bytes'] / 2**20:.1f} |"
        )
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    atomic_write_json(out, results, indent=2)
    print(f"\nJSON: {out}")


if __name__ == "__main__":
    main()
