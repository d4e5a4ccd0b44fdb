"""The continuous-batching engine vs one request at a time vs static batching, on the reference models.

    .venv/bin/python bench/engine.py                      # 32 requests, prompts 16-400, 64 new tokens
    .venv/bin/python bench/engine.py --requests 8 --new-tokens 16 --models llama   # smoke run

For each model (the shipped Llama and causal encoder-decoder), the same requests (prompt lengths uniform
in [16, 400], random token ids, ``--new-tokens`` greedy tokens each) are generated three ways, in one
process, interleaved over ``--repeats`` rounds (the fastest round of each counts: the first pays the
CPU kernels' one-time initialisation for every new shape):
1. one at a time: an engine holding one sequence, each request run to the end before the next;
2. static batching: batches of ``--static-batch`` requests admitted together; the next batch starts when
   the whole batch has finished (no admission while a batch runs: what a fixed-batch generate does);
3. the engine: every request queued at once, ``--max-seqs`` running together, ``--max-batch-tokens``
   new tokens per step (decode rows and prefill chunks mixed).
All three must produce the same tokens (asserted). Reported: wall time, generated tokens/s and the ratio
to one-at-a-time and to static batching; and, for the engine, peak cache bytes held by sequences (paged
blocks) next to the bytes their tokens need at that step, and next to a contiguous cache reserving
``prompt + new tokens`` per running sequence.
Prints a markdown table and writes JSON to ``--out``.
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

import torch

from kvgraft.atomic import atomic_write_json
from kvgraft.hf import load_pretrained
from kvgraft.reference import resolve_model
from kvgraft.runtime.engine import Engine
from kvgraft.runtime.options import EngineOptions
from kvgraft.runtime.sampling import SamplingParams

MODELS = {"llama": "kvgraft-llama-8m", "ced": "kvgraft-ced-8m"}


def one_at_a_time(model, prompts, params, max_seq_len: int | None = None) -> tuple[list[list[int]], float]:
    t0 = time.perf_counter()
    outs = [
        Engine(model, EngineOptions(max_seqs=1, max_batch_tokens=512, max_seq_len=max_seq_len)).generate([p], params)[0]
        for p in prompts
    ]
    return outs, time.perf_counter() - t0


def static_batches(model, prompts, params, batch: int, max_seq_len: int | None = None) -> tuple[list[list[int]], float]:
    t0 = time.perf_counter()
    engine = Engine(model, EngineOptions(max_seqs=batch, max_batch_tokens=100_000, max_seq_len=max_seq_len))
    outs = []
    for i in range(0, len(prompts), batch):
        outs += engine.generate(prompts[i : i + batch], params)
    return outs, time.perf_counter() - t0


def continuous(model, prompts, params, max_seqs: int, max_batch_tokens: int) -> tuple[list[list[int]], float, dict]:
    engine = Engine(model, EngineOptions(max_seqs=max_seqs, max_batch_tokens=max_batch_tokens))
    t0 = time.perf_counter()
    ids = [engine.add_request(p, params) for p in prompts]
    peak = {"used": 0, "needed": 0, "contiguous": 0}
    while engine.has_unfinished():
        engine.step()
        used = engine.cache.used_bytes
        if used > peak["used"]:
            per_token = engine.cache.block_bytes // engine.cache.block_size
            slots = engine.cache.slot_bytes * len(engine.running)
            reserved = sum(len(r.prompt) + r.sampling.max_new_tokens for r in engine.running)
            peak = {"used": used, "needed": engine.cache.needed_bytes(), "contiguous": reserved * per_token + slots}
    wall = time.perf_counter() - t0
    outs = [engine.requests[i].output for i in ids]
    return outs, wall, {**peak, "steps": engine.stats["steps"], "pool_bytes": engine.cache.nbytes}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--models", nargs="+", default=list(MODELS), choices=list(MODELS))
    p.add_argument("--requests", type=int, default=32)
    p.add_argument("--min-prompt", type=int, default=16)
    p.add_argument("--max-prompt", type=int, default=400)
    p.add_argument("--new-tokens", type=int, default=64)
    p.add_argument("--static-batch", type=int, default=8)
    p.add_argument("--max-seqs", type=int, default=32)
    p.add_argument("--max-batch-tokens", type=int, default=512)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--repeats", type=int, default=2)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", default="runs/bench/engine.json")
    args = p.parse_args()
    for name in (
        "requests",
        "min_prompt",
        "max_prompt",
        "new_tokens",
        "static_batch",
        "max_seqs",
        "max_batch_tokens",
        "threads",
        "repeats",
    ):
        if getattr(args, name) < 1:
            p.error(f"--{name.replace('_', '-')} must be >= 1, got {getattr(args, name)}")
    if args.min_prompt > args.max_prompt:
        p.error(f"--min-prompt ({args.min_prompt}) must be <= --max-prompt ({args.max_prompt})")
    torch.set_num_threads(args.threads)
    g = torch.Generator().manual_seed(args.seed)
    lengths = torch.randint(args.min_prompt, args.max_prompt + 1, (args.requests,), generator=g).tolist()
    params = SamplingParams(max_new_tokens=args.new_tokens)
    results = {"config": vars(args), "prompt_lengths": lengths, "models": {}}
    rows = []
    for name in args.models:
        model = load_pretrained(resolve_model(MODELS[name])).eval()
        prompts = [torch.randint(0, model.config.vocab_size, (n,), generator=g).tolist() for n in lengths]
        # every way runs --repeats times, interleaved; the fastest run counts (the first pays the CPU kernels'
        # one-time initialisation for each new shape)
        t_single = t_static = t_cont = float("inf")
        for _ in range(args.repeats):
            single, t = one_at_a_time(model, prompts, params)
            t_single = min(t_single, t)
            static, t = static_batches(model, prompts, params, args.static_batch)
            t_static = min(t_static, t)
            cont, t, mem = continuous(model, prompts, params, args.max_seqs, args.max_batch_tokens)
            t_cont = min(t_cont, t)
        assert static == single and cont == single, "batched generation must give the same tokens"
        generated = sum(len(o) for o in single)
        r = {
            "one_at_a_time_s": t_single,
            "static_s": t_static,
            "engine_s": t_cont,
            "generated_tokens": generated,
            "tokens_per_s": {"one_at_a_time": generated / t_single, "static": generated / t_static, "engine": generated / t_cont},
            "engine_vs_one_at_a_time": t_single / t_cont,
            "engine_vs_static": t_static / t_cont,
            "memory": mem,
            "used_over_needed": mem["used"] / mem["needed"],
        }
        results["models"][name] = r
        rows.append((name, r))
        print(f"{name}: done", flush=True)
    print(
        f"\n{args.requests} requests, prompts {args.min_prompt}-{args.max_prompt} tokens, {args.new_tokens} new "
        f"tokens each (greedy, fp32, {args.threads} threads); engine: {args.max_seqs} sequences, "
        f"{args.max_batch_tokens} tokens per step; static batches of {args.static_batch}\n"
    )
    print(
        "| model | one at a time tok/s | static tok/s | engine tok/s | engine / one at a time | engine / static "
        "| peak cache held (paged) | needed | contiguous reservation |"
    )
    print("|---|---|---|---|---|---|---|---|---|")
    for name, r in rows:
        t, m = r["tokens_per_s"], r["memory"]
        print(
            f"| {name} | {t['one_at_a_time']:.1f} | {t['static']:.1f} | {t['engine']:.1f} | "
            f"{r['engine_vs_one_at_a_time']:.2f}x | {r['engine_vs_static']:.2f}x | {m['used'] / 2**20:.2f} MB "
            f"({r['used_over_needed']:.3f}x needed) | {m['needed'] / 2**20:.2f} MB | "
            f"{m['contiguous'] / 2**20:.2f} MB ({m['contiguous'] / m['needed']:.2f}x) |"
        )
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    atomic_write_json(out, results, indent=2)
    print(f"\nJSON: {out}")


if __name__ == "__main__":
    main()
