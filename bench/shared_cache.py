"""N adapters over one prompt: one shared cache vs one cache per adapter, and adapter switching.

On the reference causal encoder-decoder (``kvgraft-ced-8m``; ``--base kvgraft-llama-8m`` for the Llama)
with N = 1, 2, 4, 8 random certified decoder-side adapters (decoder-half, rank 16, the pivot's KV writers
frozen; random weights: cost does not depend on what an adapter learned; ``--adapters`` uses trained ones,
e.g. the placement study's), one shared prompt of ``--prompt`` random tokens (``--prompt-ids``: a given one;
``--task-prompt STUDY_DIR``: a placement study's first test prompt, chat template included):

- **shared**: kvgraft's engine with the prefix cache: the base computes the prompt once; every adapter's
  request reuses its blocks (segments and encoder windows; on the Llama, the KV of the layers below the
  first one the adapter changes) and rebuilds what depends on it by a replay (the decoder windows over
  the replay span; on the Llama, the upper layers' KV over the whole prompt), then all N decode in one
  mixed-adapter batch;
- **private**: one cache per adapter (what vLLM/SGLang do: blocks keyed by adapter): each request
  prefills the prompt itself.

Printed per N: the bytes the N requests' cache holds once all have their first token (blocks and ring
blocks, a shared one once, plus each request's pending tokens), its ratio to one request alone with its
own cache, what the prefix entries hold beyond that (blocks only they still reference, e.g. the base's
decoder windows, and the pivot inputs a replay starts from: per prompt, not per adapter, evictable), decode tokens/s of the N-row batch, and the mixed batch
(N adapters) vs a single-adapter batch of the same size (all rows on adapter 0), measured alternately.
Then the adapter switch on the cached prompt: a request for another adapter (decoder replay + its last
prompt token) vs the same request with a full prefill of the prompt (time to its first token).

The reference model was trained on 512-token windows; beyond 512 its text is not meaningful, which does
not change bytes or time (``--prompt 512`` keeps it in range).
"""

from __future__ import annotations

import argparse
import copy
import json
import statistics
import tempfile
import time
from pathlib import Path

import torch


def make_adapters(base, n: int, root: Path) -> dict[str, Path]:
    from kvgraft.adapters.lora import (
        AdapterConfig,
        add_adapter,
        randomize_adapter,
        save_adapter,
    )
    from kvgraft.adapters.placement import Placement

    out = {}
    for i in range(n):
        pm = add_adapter(
            copy.deepcopy(base), Placement("decoder-half", ("all-linear",), freeze_kv_writers=True), AdapterConfig(rank=16)
        )
        randomize_adapter(pm, 0.02, seed=i)
        out[f"a{i}"] = save_adapter(pm, root / f"a{i}")
    return out


def new_engine(base, adapters, args, prefix: bool):
    from kvgraft.runtime.engine import Engine
    from kvgraft.runtime.options import EngineOptions

    e = Engine(
        base,
        EngineOptions(
            max_seqs=max(8, args.max_n) + 1,
            max_batch_tokens=args.chunk,
            max_seq_len=args.prompt + args.new_tokens,
            prefix_cache=prefix,
        ),
    )
    for name, path in adapters.items():
        e.load_adapter(name, path)
    return e


def held_bytes(e) -> int:
    """Bytes the live requests' cache holds: blocks (a shared one once) and their per-sequence state."""
    return e.cache_stats()["used_bytes"]


def run_until_first_tokens(e, ids) -> None:
    while any(not e.requests[i].output for i in ids):
        e.step()


def step_times(e, steps: int) -> list[float]:
    times = []
    for _ in range(steps):
        t = time.perf_counter()
        e.step()
        times.append(time.perf_counter() - t)
    return times


def task_prompt(study: Path, base: str) -> list[int]:
    """The first seed-0 test prompt of the study under ``study`` (its ``study_config.json``: task, sizing, prompt
    format), token ids as the model reads it (the chat template applied in the chat format)."""
    from kvgraft.data.tasks import generate_task, load_sizing
    from kvgraft.reference import resolve_model

    config = study / "study_config.json"
    if not config.is_file():
        raise SystemExit(f"--task-prompt {study}: no study_config.json there (a kvgraft experiment placement --out)")
    cfg = json.loads(config.read_text())
    sizing = load_sizing(
        resolve_model(base), window=cfg["task_window"], max_tokens=cfg["task_max_tokens"], prompt_format=cfg["prompt_format"]
    )
    example = generate_task(cfg["task"], seed=0, sizing=sizing)["test"][0]
    return list(sizing.encoding.prompt_ids(example.prompt))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--base", default="kvgraft-ced-8m")
    ap.add_argument("--prompt", type=int, default=2048)
    ap.add_argument("--new-tokens", type=int, default=31)
    ap.add_argument("--ns", type=int, nargs="+", default=[1, 2, 4, 8])
    ap.add_argument("--chunk", type=int, default=512, help="max tokens per engine step (prefill chunk)")
    ap.add_argument("--repeats", type=int, default=3, help="adapter-switch timings")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument(
        "--adapters",
        type=Path,
        nargs="+",
        default=None,
        metavar="DIR",
        help="trained adapter directories (kvgraft adapt's OUT/adapter), at least max(--ns) of them, used in order "
        "instead of random ones",
    )
    ap.add_argument(
        "--prompt-ids",
        type=Path,
        default=None,
        help="a JSON list of token ids: the shared prompt (e.g. a task's) instead of --prompt random tokens",
    )
    ap.add_argument(
        "--task-prompt",
        type=Path,
        default=None,
        metavar="STUDY_DIR",
        help="a placement study's directory (kvgraft experiment placement --out): the shared prompt is its task's "
        "first seed-0 test prompt at the study's sizing, as the model reads it (chat template included)",
    )
    ap.add_argument("--out", type=Path, default=None, help="also write the figures here (JSON, atomically)")
    args = ap.parse_args()
    if args.task_prompt is not None and args.prompt_ids is not None:
        ap.error("--task-prompt and --prompt-ids both name the prompt: give one")
    for name in ("prompt", "new_tokens", "chunk", "repeats", "threads"):
        if getattr(args, name) < 1:
            ap.error(f"--{name.replace('_', '-')} ({getattr(args, name)}) must be >= 1")
    if args.new_tokens < 7:
        ap.error(f"--new-tokens ({args.new_tokens}) must be >= 7 (2 warm-up steps, then blocks of 4 timed steps)")
    if any(n < 1 for n in args.ns):
        ap.error(f"--ns {args.ns}: every N must be >= 1")
    args.max_n = max(args.ns)
    if args.adapters is not None:
        missing = [str(a) for a in args.adapters if not (a / "adapter_config.json").is_file()]
        if missing or len(args.adapters) < args.max_n:
            ap.error(f"--adapters: {len(args.adapters)} given, {args.max_n} needed, not adapter directories: {missing}")
    if args.prompt_ids is not None:
        ids = json.loads(args.prompt_ids.read_text())
        if not isinstance(ids, list) or not ids or not all(isinstance(i, int) and i >= 0 for i in ids):
            ap.error(f"--prompt-ids {args.prompt_ids}: not a non-empty JSON list of token ids")
        args.prompt = len(ids)
    if args.task_prompt is not None:
        args.prompt_list = task_prompt(args.task_prompt, args.base)
        args.prompt = len(args.prompt_list)
    torch.set_num_threads(args.threads)

    from kvgraft.hf import load_pretrained
    from kvgraft.reference import resolve_model
    from kvgraft.runtime.prefix import replay_span
    from kvgraft.runtime.sampling import SamplingParams

    base = load_pretrained(resolve_model(args.base)).eval()
    cfg = base.config
    prompt = torch.randint(0, cfg.vocab_size, (args.prompt,), generator=torch.Generator().manual_seed(0)).tolist()
    if args.prompt_ids is not None:
        prompt = json.loads(args.prompt_ids.read_text())
    if args.task_prompt is not None:
        prompt = args.prompt_list
    sp = SamplingParams(max_new_tokens=args.new_tokens)
    rounds = (args.new_tokens - 3) // 4
    shape = (
        f"window {cfg.sliding_window}, replay span {replay_span(cfg)}"
        if cfg.is_ced
        else f"{cfg.num_layers} full-attention layers"
    )
    print(f"{args.base}: prompt {args.prompt} tokens, {args.new_tokens} new, {shape}, {args.threads} threads, fp32")
    with tempfile.TemporaryDirectory() as tmp:
        if args.adapters is None:
            adapters = make_adapters(base, args.max_n, Path(tmp))
        else:
            adapters = {f"a{i}": path for i, path in enumerate(args.adapters[: args.max_n])}
        rows = []
        for n in args.ns:
            names = [f"a{i}" for i in range(n)]
            # shared: the base keeps the prompt, then N adapters reuse it
            e = new_engine(base, adapters, args, prefix=True)
            e.generate([prompt], SamplingParams(max_new_tokens=1))
            ids = [e.add_request(prompt, sp, a) for a in names]
            run_until_first_tokens(e, ids)
            hits, replays = e.cache_stats()["prefix_hits"], e.cache_stats()["replays"]
            with_entries = held_bytes(e)
            kept = e.cache_stats()["prefix_bytes"]  # kept state outside the pools (pivot inputs)
            e.prefix.clear()  # what the requests hold themselves; the rest was the kept entries' own blocks
            shared = held_bytes(e)
            kept += with_entries - shared
            # private: each adapter's request prefills the prompt into its own blocks
            p = new_engine(base, adapters, args, prefix=False)
            pids = [p.add_request(prompt, sp, a) for a in names]
            run_until_first_tokens(p, pids)
            private = held_bytes(p)
            del p
            # the same N rows, all on adapter 0 (a single-adapter batch), over the shared cache
            s = new_engine(base, adapters, args, prefix=True)
            s.generate([prompt], SamplingParams(max_new_tokens=1))
            sids = [s.add_request(prompt, sp, "a0") for _ in names]
            run_until_first_tokens(s, sids)
            step_times(e, 2), step_times(s, 2)  # warm-up
            mixed_t, single_t = [], []
            for _ in range(rounds):  # alternate blocks of decode steps (a noisy machine)
                mixed_t += step_times(e, 4)
                single_t += step_times(s, 4)
            mixed, single = n / statistics.median(mixed_t), n / statistics.median(single_t)
            rows.append((n, shared, kept, private, hits, replays, mixed, single))
        one = rows[0][3] / rows[0][0]  # one request alone with its own cache (private bytes / N)
        print()
        print(
            "| N adapters | shared cache: the requests hold | vs one request alone | + prefix entry kept | one cache per "
            "adapter: the requests hold | vs one request alone | shared / private | prefix hits, replays | mixed batch "
            "tok/s | single-adapter batch tok/s | mixed / single |"
        )
        print("|---|---|---|---|---|---|---|---|---|---|---|")
        for n, shared, kept, private, hits, replays, mixed, single in rows:
            print(
                f"| {n} | {shared / 1e6:.2f} MB | {shared / one:.2f}x | {kept / 1e6:.2f} MB | {private / 1e6:.2f} MB | "
                f"{private / one:.2f}x | {shared / private:.2f} | {hits}, {replays} | {mixed:.1f} | {single:.1f} | "
                f"{mixed / single:.2f}x |"
            )

        # where the bytes go (from the cache layout): what N requests over one prompt share and do not
        from kvgraft.model.config import cache_layout

        lay = cache_layout(cfg)
        item = 4
        print()
        if cfg.is_ced:
            p = max(cfg.kv_source_layers)  # the pivot: windows below it are shared, from it on per request
            W = min(lay.window, args.prompt + args.new_tokens)
            seg = sum(lay.segments.values()) * item / lay.compress_rate  # bytes per prompt token, shared
            enc = sum(w for x, w in lay.rings.items() if x < p) * W * item  # shared per prompt
            slot = (
                sum(w for x, w in lay.rings.items() if x >= p) * W + sum(lay.pending.values()) * (lay.compress_rate - 1)
            ) * item  # per request
            # 8 requests <= 1.25x of one: seg T + enc + 8 slot <= 1.25 (seg T + enc + slot)
            need = (6.75 * slot - 0.25 * enc) / (0.25 * seg)
            print(
                f"shared per prompt: {seg:.0f} B of compressed segments per token and {enc / 1e3:.0f} kB of encoder "
                f"windows (layers 0-{p - 1}); per request, private: {slot / 1e3:.0f} kB of decoder windows (layers "
                f"{p}-{cfg.num_layers - 1} x {lay.window} tokens) and pending tokens (a decode step also copies the "
                f"one encoder ring block it writes). 8 requests hold <= 1.25x of one from a prompt of "
                f">= {max(0.0, need):,.0f} tokens."
            )
        else:
            per_layer = {x: w * item for x, w in lay.paged.items()}  # bytes per token and layer
            print(
                f"per token: {sum(per_layer.values()):,} B over {len(per_layer)} layers; adapters that leave layers "
                f"below b untouched share those layers' blocks, so 8 requests hold (b + 8 (L - b)) / L of one "
                f"layer-for-layer (L = {cfg.num_layers})"
            )

        # adapter switch on the cached prompt: replay vs full prefill (time to the first token)
        replay_t, full_t = [], []
        for r in range(args.repeats):
            e = new_engine(base, adapters, args, prefix=True)
            e.generate([prompt], SamplingParams(max_new_tokens=1), "a0")  # a0 keeps the prompt
            t = time.perf_counter()
            e.generate([prompt], SamplingParams(max_new_tokens=1), "a1")  # switch: replay + last token
            replay_t.append(time.perf_counter() - t)
            assert e.cache_stats()["replays"] == 1
            f = new_engine(base, adapters, args, prefix=False)
            t = time.perf_counter()
            f.generate([prompt], SamplingParams(max_new_tokens=1), "a1")
            full_t.append(time.perf_counter() - t)
        rt, ft = statistics.median(replay_t), statistics.median(full_t)
        print()
        print(
            f"adapter switch on a cached {args.prompt}-token prompt (time to first token, median of {args.repeats}): "
            f"decoder replay {rt * 1e3:.1f} ms vs full prefill {ft * 1e3:.1f} ms: {ft / rt:.1f}x faster"
        )
    if args.out is not None:
        from kvgraft.atomic import atomic_write_json

        keys = ("n", "shared_bytes", "prefix_entry_bytes", "private_bytes", "prefix_hits", "replays", "mixed_tok_s")
        root = Path(__file__).resolve().parent.parent
        record = {
            "base": args.base,
            "prompt_tokens": args.prompt,
            "new_tokens": args.new_tokens,
            "threads": args.threads,
            "adapters": [
                str(Path(a).resolve().relative_to(root)) if Path(a).resolve().is_relative_to(root) else str(a)
                for a in (args.adapters or [])[: args.max_n]
            ]
            or "random",
            "one_request_bytes": one,
            "rows": [dict(zip((*keys, "single_tok_s"), row)) for row in rows],
            "switch_ms": {"replay": rt * 1e3, "prefill": ft * 1e3, "repeats": args.repeats},
        }
        atomic_write_json(args.out, record)
        print(f"-> {args.out}")


if __name__ == "__main__":
    main()
