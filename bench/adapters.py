"""Adapter training cost by placement: step time and memory, decoder-half vs all-linear vs encoder-half.

    .venv/bin/python bench/adapters.py                     # both reference models, batch 16 x 128 tokens
    .venv/bin/python bench/adapters.py --models ced --steps 6 --seq-len 64 --epochs 2 --examples 32   # smoke run

For each reference model (the causal encoder-decoder and the Llama) and each placement at equal rank
(16), with and without activation checkpointing, one training step = forward, backward, AdamW step on a
fixed random batch. The configurations are interleaved step by step (step i of each, in a rotating order,
before step i + 1 of any) so a noisy machine hits all alike; the median step time after ``--warmup``
steps is reported with its ratio to all-linear's. The decoder half is also timed through the frozen-prefix
cache (``kvgraft.train.frozen_prefix``): "cached" reads the batch's encoder-half outputs from the cache
(every epoch after the first), "cache miss" empties the cache before each step (the first epoch: the
whole forward plus storing the rows); its loss is checked equal to the uncached decoder half's. Memory is measured exactly rather than from the
process's RSS (which one process cannot attribute per configuration): the bytes of activations autograd
keeps for backward (``torch.autograd.graph.saved_tensors_hooks``) and the adapter's parameters +
gradients + AdamW state. Prints a markdown table; JSON to ``--out``.

Then a multi-epoch run per placement (``--epochs`` over ``--examples`` random examples in the training
loop's data order, ``kvgraft.train.loop.batch_indices``), each in its own process, one after the other
(so each process's memory is its own): per epoch the median step time, the process's peak resident
memory within the epoch (VmHWM, reset at each epoch's start through /proc/self/clear_refs) and the bytes
the cache holds.
"""

from __future__ import annotations

import argparse
import json
import re
import statistics
import subprocess
import sys
import time
from pathlib import Path

import torch

from kvgraft.adapters.lora import AdapterConfig, add_adapter
from kvgraft.adapters.placement import Placement
from kvgraft.atomic import atomic_write_json
from kvgraft.hf import load_pretrained
from kvgraft.reference import resolve_model
from kvgraft.train.frozen_prefix import CachedLMLoss, FrozenPrefixCache
from kvgraft.train.loop import batch_indices, lm_loss

MODELS = {"ced": "kvgraft-ced-8m", "llama": "kvgraft-llama-8m"}
PLACEMENTS = {
    "all-linear": Placement("all", ("all-linear",)),
    "encoder-half": Placement("encoder-half", ("all-linear",)),
    "decoder-half": Placement("decoder-half", ("all-linear",), freeze_kv_writers=True),
}
CACHED = ("decoder-half cached", "decoder-half cache miss")  # the decoder half through the frozen-prefix cache
CACHE_BYTES = 8 << 30  # the bench's cache bound: every example fits (the bytes held are reported)


def build(name: str, placement: str, rank: int, checkpointing: bool):
    """(PEFT model, AdamW, trainable parameters, loss_fn, cache or None) for a placement of PLACEMENTS or CACHED."""
    model = load_pretrained(resolve_model(MODELS[name])).float()
    torch.manual_seed(0)
    pm = add_adapter(model, PLACEMENTS["decoder-half" if placement in CACHED else placement], AdapterConfig(rank=rank))
    model.gradient_checkpointing = checkpointing
    pm.train()
    params = [p for p in pm.parameters() if p.requires_grad]
    cache = FrozenPrefixCache(CACHE_BYTES) if placement in CACHED else None
    loss_fn = CachedLMLoss(pm, cache) if cache is not None else lm_loss
    return pm, torch.optim.AdamW(params, lr=1e-4), params, loss_fn, cache


def as_batch(x: torch.Tensor) -> dict[str, torch.Tensor]:
    return {"input_ids": x[:, :-1], "labels": x[:, 1:]}


def step(pm, opt, loss_fn, batch) -> float:
    loss, _ = loss_fn(pm, batch)
    loss.backward()
    opt.step()
    opt.zero_grad(set_to_none=True)
    return float(loss.detach())


def saved_bytes(pm, loss_fn, batch) -> int:
    total = 0

    def pack(t):
        nonlocal total
        total += t.numel() * t.element_size()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        loss, _ = loss_fn(pm, batch)
    loss.backward()
    pm.zero_grad(set_to_none=True)
    return total


def peak_rss_kib() -> int:
    """This process's peak resident memory (VmHWM) since the last :func:`reset_peak_rss`."""
    return int(re.search(r"VmHWM:\s+(\d+)", Path("/proc/self/status").read_text()).group(1))


def reset_peak_rss() -> None:
    Path("/proc/self/clear_refs").write_text("5")  # Linux: "5" resets VmHWM to the current RSS


def clock(args):
    return time.process_time if args.clock == "cpu" else time.perf_counter


def epoch_run(args) -> dict:
    """One placement's multi-epoch run (in its own process): per-epoch step time, peak RSS, cache bytes."""
    torch.set_num_threads(args.threads)
    pm, opt, _, loss_fn, cache = build(args.epoch_model, args.epoch_run, args.rank, False)
    vocab = pm.get_base_model().model.config.vocab_size
    g = torch.Generator().manual_seed(1)
    data = torch.randint(0, vocab, (args.examples, args.seq_len + 1), generator=g)
    per_epoch = args.examples // args.batch
    epochs = []
    for e in range(args.epochs):
        reset_peak_rss()
        times, losses = [], []
        for i in range(e * per_epoch, (e + 1) * per_epoch):
            idx = batch_indices(args.examples, 0, i, args.batch)
            now = clock(args)
            t0 = now()
            losses.append(step(pm, opt, loss_fn, as_batch(data[idx])))
            times.append(now() - t0)
        epochs.append(
            {
                "epoch": e + 1,
                "step_s": statistics.median(times),
                "peak_rss_mib": peak_rss_kib() / 1024,
                "cache_mib": cache.stats.bytes / 2**20 if cache is not None else 0.0,
                "losses": losses,
            }
        )
    return {"placement": args.epoch_run, "model": args.epoch_model, "epochs": epochs}


def epoch_table(args) -> list[dict]:
    """Each placement's multi-epoch run in a fresh process, one after the other."""
    runs = []
    for placement in ("all-linear", "decoder-half", "decoder-half cached"):
        cmd = [sys.executable, __file__, "--epoch-run", placement, "--epoch-model", args.models[0]]
        for name in ("batch", "seq_len", "rank", "threads", "epochs", "examples", "clock"):
            cmd += [f"--{name.replace('_', '-')}", str(getattr(args, name))]
        out = subprocess.run(cmd, check=True, capture_output=True, text=True).stdout
        runs.append(json.loads(out.strip().splitlines()[-1]))
    plain, cached = runs[1]["epochs"], runs[2]["epochs"]
    if [e["losses"] for e in plain] != [e["losses"] for e in cached]:
        raise AssertionError("the decoder half's losses differ with the frozen-prefix cache")
    return runs


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--models", nargs="+", default=list(MODELS), choices=list(MODELS))
    p.add_argument("--batch", type=int, default=16)
    p.add_argument("--seq-len", type=int, default=128)
    p.add_argument("--rank", type=int, default=16)
    p.add_argument("--steps", type=int, default=12)
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument(
        "--clock",
        choices=["wall", "cpu"],
        default="wall",
        help="time steps by the wall clock, or by this process's CPU time (time.process_time: on a loaded "
        "machine, with --threads 1, the work a step does rather than how long it waited for a core)",
    )
    p.add_argument("--epochs", type=int, default=4, help="epochs of the multi-epoch run (0: skip it)")
    p.add_argument("--examples", type=int, default=64, help="examples in the multi-epoch run's data set")
    p.add_argument("--epoch-run", default=None, help=argparse.SUPPRESS)  # internal: one placement's epochs
    p.add_argument("--epoch-model", default="ced", choices=list(MODELS), help=argparse.SUPPRESS)
    p.add_argument("--out", default="runs/bench/adapters.json")
    args = p.parse_args()
    if args.epoch_run is not None:
        print(json.dumps(epoch_run(args)))
        return
    for name in ("batch", "seq_len", "rank", "steps", "threads"):
        if getattr(args, name) < 1:
            p.error(f"--{name.replace('_', '-')} must be >= 1")
    if not 0 <= args.warmup < args.steps:
        p.error(f"--warmup ({args.warmup}) must be in [0, --steps)")
    if args.epochs < 0 or args.examples < args.batch or args.examples % args.batch:
        p.error(f"--epochs ({args.epochs}) must be >= 0 and --examples ({args.examples}) a multiple of --batch ({args.batch})")
    torch.set_num_threads(args.threads)
    results = {"config": vars(args), "rows": []}
    for model_name in args.models:
        keys = [(pl, ck) for pl in PLACEMENTS for ck in (False, True)]
        keys += [(CACHED[0], False), (CACHED[0], True), (CACHED[1], False)]
        configs = {(pl, ck): build(model_name, pl, args.rank, ck) for pl, ck in keys}
        vocab = next(iter(configs.values()))[0].get_base_model().model.config.vocab_size
        x = torch.randint(0, vocab, (args.batch, args.seq_len + 1), generator=torch.Generator().manual_seed(0))
        batch = as_batch(x)
        times: dict = {k: [] for k in configs}
        losses: dict = {k: [] for k in configs}
        for i in range(args.steps):
            order = keys[i % len(keys) :] + keys[: i % len(keys)]
            for k in order:
                pm, opt, _, loss_fn, cache = configs[k]
                if k[0] == CACHED[1]:
                    cache.clear()  # every step a miss: the first epoch's cost
                now = clock(args)
                t0 = now()
                losses[k].append(step(pm, opt, loss_fn, batch))
                if i >= args.warmup:
                    times[k].append(now() - t0)
        for ck in (False, True):  # the same training, to the last bit, through the cache
            if losses[(CACHED[0], ck)] != losses[("decoder-half", ck)]:
                raise AssertionError(f"{model_name}: the cached decoder half's losses differ (checkpointing {ck})")
        if losses[(CACHED[1], False)] != losses[("decoder-half", False)]:
            raise AssertionError(f"{model_name}: the decoder half's losses differ on cache misses")
        for (pl, ck), (pm, opt, params, loss_fn, cache) in configs.items():
            trainable = sum(q.numel() for q in params)
            results["rows"].append(
                {
                    "model": model_name,
                    "placement": pl,
                    "checkpointing": ck,
                    "trainable": trainable,
                    "step_s": statistics.median(times[(pl, ck)]),
                    "saved_activation_bytes": saved_bytes(pm, loss_fn, batch),
                    "adapter_state_bytes": trainable * 4 * 4,  # fp32 parameter, gradient, AdamW m and v
                    "prefix_cache_bytes": cache.stats.bytes if cache is not None else 0,
                }
            )
        print(f"{model_name}: done", flush=True)
    print(
        f"\nbatch {args.batch} x {args.seq_len} tokens, rank {args.rank}, fp32, {args.threads} threads, median of "
        f"{args.steps - args.warmup} interleaved steps ({args.clock} clock); decoder-half with the pivot's KV writers frozen\n"
    )
    print(
        "| model | placement | checkpointing | trainable | step (s) | vs all-linear | activations kept (MB) "
        "| vs all-linear | adapter + grad + AdamW (MB) | prefix cache (MB) |"
    )
    print("|---|---|---|---|---|---|---|---|---|---|")
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
            f"{r['activations_vs_all_linear']:.2f}x | {r['adapter_state_bytes'] / 2**20:.1f} | "
            f"{r['prefix_cache_bytes'] / 2**20:.1f} |"
        )
    if args.epochs:
        results["epoch_runs"] = epoch_table(args)
        print(
            f"\nmulti-epoch run ({args.models[0]}): {args.examples} examples, {args.epochs} epochs of "
            f"{args.examples // args.batch} steps, each placement in its own process, one after the other\n"
        )
        print("| placement | epoch | step (s), median | vs all-linear | peak RSS in the epoch (MiB) | prefix cache (MiB) |")
        print("|---|---|---|---|---|---|")
        base = results["epoch_runs"][0]["epochs"]
        for run in results["epoch_runs"]:
            for e, b in zip(run["epochs"], base):
                print(
                    f"| {run['placement']} | {e['epoch']} | {e['step_s']:.3f} | {e['step_s'] / b['step_s']:.2f}x | "
                    f"{e['peak_rss_mib']:,.0f} | {e['cache_mib']:.1f} |"
                )
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    atomic_write_json(out, results, indent=2)
    print(f"\nJSON: {out}")


if __name__ == "__main__":
    main()
