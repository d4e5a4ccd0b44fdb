"""Where one engine step's time goes: the model's math vs the engine's bookkeeping, by running sequences and context.

    .venv/bin/python bench/engine_profile.py                          # both reference models, 1 and 2 threads
    .venv/bin/python bench/engine_profile.py --models llama --threads 1 --running 1 8 --contexts 128   # smoke
    .venv/bin/python bench/engine_profile.py --models smollm2 --running 32    # the real model (make real-model)
    .venv/bin/python bench/engine_profile.py --models smollm2 --home off --split-lengths on   # decode reads

Each step of :meth:`kvgraft.runtime.engine.Engine.step` is cut into sections, timed with ``perf_counter``
around the engine's own calls (wrapped for this process only; the engine runs unchanged and its tokens are
asserted equal to an unwrapped run's):

- ``schedule``: the scheduler (which rows run, chunked prefill, admission) and the cache's block reservations;
- ``context``: building the step's ``BatchContext`` (block tables, groups, positions, row views);
- ``views``: inside the forward, the step context's storage operations: writing new KV entries into the pools
  and rings, reading them back (gathers or views of the pools), the shared segments, and the masks;
- ``model``: the rest of the forward (projections, MLPs, attention's math, the LM head);
- ``sample``: sampling each row, stop checks, finishing requests (after the forward, detokenization excepted);
- ``detok``: the engine's incremental detokenization (each request carries a stop string that never occurs,
  so the engine decodes every token as it would for a real one; the shipped tokenizer).

Two workloads per model and thread count:
1. steady decode: ``R`` requests (``--running``) of ``C`` prompt tokens (``--contexts``, random ids) admitted and
   prefilled, then ``--decode-steps`` decode steps timed (all ``R`` rows decoding at context ~C);
2. the ``bench/engine.py`` workload (32 requests, prompts uniform in 16-400, 64 greedy new tokens, 32
   sequences, 512 tokens a step), every step timed, the sum reported; run once untimed on the same engine
   first, so the pools' pages are written before the timed round (as a server's are after its first requests).
``bookkeeping`` = everything but ``model``: the share of a step the engine spends outside the model's math.
``padding``: query-key pairs the step's reads attend over those its rows need (``StepPlan.keys_read /
keys_needed``; 1.00 = no row padded to a longer one). ``--home`` and ``--split-lengths`` choose the decode reads
(``kvgraft.model.plan.ReadPolicy``: rows at home read one strided view of each pool, padded to the longest; off,
they are gathered, and gathered rows are cut by length unless ``--split-lengths off``). The real model
(``--models smollm2``, SmolLM2-135M-Instruct, imported in bfloat16) runs in float32, as the 8M references do;
the workload's engines hold at most 1,024 tokens a sequence (``max_seq_len``), as issue 37's measurement did.
Prints markdown tables and writes JSON to ``--out`` (kvgraft.atomic).
"""

from __future__ import annotations

import argparse
import time
from collections import defaultdict
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

import kvgraft.runtime.engine as engine_module
from kvgraft.atomic import atomic_write_json
from kvgraft.hf import load_pretrained
from kvgraft.hf.load import load_tokenizer_dir
from kvgraft.model.batch import BatchContext
from kvgraft.reference import resolve_model
from kvgraft.runtime.engine import Engine
from kvgraft.runtime.options import EngineOptions
from kvgraft.runtime.sampling import SamplingParams

MODELS = {"llama": "kvgraft-llama-8m", "ced": "kvgraft-ced-8m", "smollm2": "smollm2-135m-instruct"}
WORKLOAD_MAX_LEN = 1024  # the workload's longest prompt + completion is 464; the 8M references hold 512
SECTIONS = ("schedule", "context", "views", "model", "sample", "detok")
NEVER = "\x00\x01never\x01\x00"  # a stop string no output of the shipped tokenizer holds


class StepTimer:
    """Accumulates seconds per section while ``active`` (wrappers add to ``acc``)."""

    def __init__(self) -> None:
        self.acc: dict[str, float] = defaultdict(float)
        self.active = False

    def wrap(self, name: str, fn: Callable[..., Any]) -> Callable[..., Any]:
        def timed(*args: Any, **kwargs: Any) -> Any:
            if not self.active:
                return fn(*args, **kwargs)
            t0 = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                self.acc[name] += time.perf_counter() - t0

        return timed


def instrument(engine: Engine, timer: StepTimer) -> None:
    """Wrap this engine's scheduler call and detokenizer (the model's forward is wrapped once, in main)."""
    engine.schedule = timer.wrap("schedule", engine.schedule)  # type: ignore[method-assign]
    if engine.detokenize is not None:
        engine.detokenize = timer.wrap("detok", engine.detokenize)


def timed_context_class(timer: StepTimer) -> Callable[..., Any]:
    base = engine_module.BatchContext

    def make(*args: Any, **kwargs: Any) -> Any:
        t0 = time.perf_counter()
        ctx = base(*args, **kwargs)
        if timer.active:
            timer.acc["context"] += time.perf_counter() - t0
        for name in ("kv", "segment", "window_mask"):
            setattr(ctx, name, timer.wrap("views", getattr(ctx, name)))
        return ctx

    return make


def timed_steps(engine: Engine, timer: StepTimer, steps: int | None) -> tuple[dict[str, float], int]:
    """Run ``steps`` steps (None: until done) with the timer on; per-section seconds and steps run."""
    timer.acc.clear()
    timer.active = True
    n, total = 0, 0.0
    try:
        while engine.has_unfinished() and (steps is None or n < steps):
            t0 = time.perf_counter()
            engine.step()
            total += time.perf_counter() - t0
            n += 1
    finally:
        timer.active = False
    acc = dict(timer.acc)
    forward = acc.pop("forward", 0.0)
    out = {s: acc.get(s, 0.0) for s in SECTIONS}
    out["model"] = forward - out["views"]
    out["sample"] = total - forward - out["schedule"] - out["context"] - out["detok"]
    out["step"] = total
    return out, n


def steady(model, tokenizer_decode, running: int, context: int, decode_steps: int, gen: torch.Generator, timer):
    engine = Engine(
        model,
        EngineOptions(max_seqs=max(running, 1), max_batch_tokens=512, max_seq_len=context + decode_steps + 2),
        detokenize=tokenizer_decode,
    )
    instrument(engine, timer)
    params = SamplingParams(max_new_tokens=decode_steps + 2, stop=(NEVER,))
    for _ in range(running):
        engine.add_request(torch.randint(0, model.config.vocab_size, (context,), generator=gen).tolist(), params)
    while any(r.computed < len(r.prompt) for r in engine.running) or engine.waiting:  # prefill (not timed)
        engine.step()
    engine.step()  # the first decode step of this shape (one-time kernel set-up)
    before = engine.stats["keys_read"], engine.stats["keys_needed"]
    out, n = timed_steps(engine, timer, decode_steps)
    sec = {k: v / n for k, v in out.items()}
    sec["padding"] = (engine.stats["keys_read"] - before[0]) / max(1, engine.stats["keys_needed"] - before[1])
    return sec, n


def workload(model, tokenizer_decode, prompts, new_tokens: int, timer) -> tuple[dict[str, float], int, list[list[int]]]:
    engine = Engine(
        model, EngineOptions(max_seqs=32, max_batch_tokens=512, max_seq_len=WORKLOAD_MAX_LEN), detokenize=tokenizer_decode
    )
    instrument(engine, timer)
    params = SamplingParams(max_new_tokens=new_tokens, stop=(NEVER,))
    engine.generate(prompts, params)  # untimed: writes the pool pages once (a first write is a page fault)
    before = engine.stats["keys_read"], engine.stats["keys_needed"]
    ids = [engine.add_request(p, params) for p in prompts]
    out, n = timed_steps(engine, timer, None)
    out["padding"] = (engine.stats["keys_read"] - before[0]) / max(1, engine.stats["keys_needed"] - before[1])
    return out, n, [engine.requests[i].output for i in ids]


def row(label: str, sec: dict[str, float], scale: float, unit: str) -> str:
    book = sec["step"] - sec["model"]
    cells = " | ".join(f"{sec[s] * scale:.2f}" for s in SECTIONS)
    return f"| {label} | {sec['step'] * scale:.2f} {unit} | {cells} | {100 * book / sec['step']:.0f}% | {sec['padding']:.2f} |"


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--models", nargs="+", default=list(MODELS), choices=list(MODELS))
    p.add_argument("--threads", nargs="+", type=int, default=[1, 2])
    p.add_argument("--running", nargs="+", type=int, default=[1, 8, 16, 32])
    p.add_argument("--contexts", nargs="+", type=int, default=[128, 448])
    p.add_argument("--decode-steps", type=int, default=12)
    p.add_argument("--requests", type=int, default=32)
    p.add_argument("--new-tokens", type=int, default=64)
    p.add_argument("--no-workload", action="store_true", help="only the steady-decode table")
    p.add_argument("--home", choices=["on", "off"], default="on", help="decode rows at home read one strided view")
    p.add_argument("--split-lengths", choices=["on", "off"], default="on", help="gathered rows cut by length")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", default="runs/bench/engine_profile.json")
    args = p.parse_args()
    for name in ("decode_steps", "requests", "new_tokens"):
        if getattr(args, name) < 1:
            p.error(f"--{name.replace('_', '-')} must be >= 1, got {getattr(args, name)}")
    for name in ("threads", "running", "contexts"):
        bad = [v for v in getattr(args, name) if v < 1]
        if bad:
            p.error(f"--{name} values must be >= 1, got {bad}")
    longest = 8192 if args.models == ["smollm2"] else 512
    if max(args.contexts) + args.decode_steps + 2 > longest:
        p.error(f"--contexts ({max(args.contexts)}) + --decode-steps ({args.decode_steps}) + 2 exceed {longest} positions")
    BatchContext.home, BatchContext.split_lengths = args.home == "on", args.split_lengths == "on"
    timer = StepTimer()
    engine_module.BatchContext = timed_context_class(timer)  # type: ignore[misc]
    results: dict[str, Any] = {"config": vars(args), "steady": [], "workload": []}
    header = "| " + " | ".join(SECTIONS) + " |"
    steady_rows, work_rows = [], []
    for name in args.models:
        path = resolve_model(MODELS[name])
        model = load_pretrained(path).eval().float()  # fp32 (the real model is imported in bfloat16)
        model.forward = timer.wrap("forward", model.forward)  # type: ignore[method-assign]
        tok = load_tokenizer_dir(path)
        if tok is None:
            raise SystemExit(f"{path} has no tokenizer.json")

        def decode(ids: list[int], tok=tok) -> str:
            return tok.decode(ids, skip_special_tokens=True)

        for threads in args.threads:
            torch.set_num_threads(threads)
            gen = torch.Generator().manual_seed(args.seed)
            for context in args.contexts:
                for running in args.running:
                    sec, n = steady(model, decode, running, context, args.decode_steps, gen, timer)
                    results["steady"].append(
                        {"model": name, "threads": threads, "running": running, "context": context, "steps": n, "seconds": sec}
                    )
                    steady_rows.append(row(f"{name} | {threads} | {running} | {context}", sec, 1e3, "ms"))
                    print(steady_rows[-1], flush=True)
            if args.no_workload:
                continue
            g = torch.Generator().manual_seed(args.seed)
            lengths = torch.randint(16, 401, (args.requests,), generator=g).tolist()
            prompts = [torch.randint(0, model.config.vocab_size, (k,), generator=g).tolist() for k in lengths]
            workload(model, decode, prompts, args.new_tokens, timer)  # warm-up round (one-time kernel set-up)
            sec, n, outs = workload(model, decode, prompts, args.new_tokens, timer)
            plain = Engine(model, EngineOptions(max_seqs=32, max_batch_tokens=512, max_seq_len=WORKLOAD_MAX_LEN)).generate(
                prompts, SamplingParams(max_new_tokens=args.new_tokens)
            )
            assert outs == plain, "the instrumented engine must give the same tokens as a plain one"
            results["workload"].append({"model": name, "threads": threads, "steps": n, "seconds": sec})
            work_rows.append(row(f"{name} | {threads} | {n} steps", sec, 1.0, "s"))
            print(work_rows[-1], flush=True)
    print("\nSteady decode, per step (ms): R running sequences at about C tokens of context each\n")
    print(f"(reads: home {args.home}, split lengths {args.split_lengths})\n")
    print("| model | threads | R | C | step " + header + " bookkeeping | padding |")
    print("|---|---|---|---|---|" + "---|" * len(SECTIONS) + "---|---|")
    print("\n".join(steady_rows))
    if work_rows:
        print(
            f"\nThe bench/engine.py workload ({args.requests} requests, prompts 16-400, {args.new_tokens} new tokens), seconds in all\n"
        )
        print("| model | threads | steps | total " + header + " bookkeeping | padding |")
        print("|---|---|---|---|" + "---|" * len(SECTIONS) + "---|---|")
        print("\n".join(work_rows))
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    atomic_write_json(out, results, indent=2)
    print(f"\nJSON: {out}")


if __name__ == "__main__":
    main()
