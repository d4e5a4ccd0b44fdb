"""Decode speed of the original GQA model vs its MLA graft (absorbed and expanded), side by side.

    .venv/bin/python bench/mla_decode.py [--model models/kvgraft-llama-8m] [--contexts 256 1024 4096]

Everything is measured in one process, interleaved per (context, batch), and reported as ratios to
the original measured in the same run. Part 1 uses kvgraft's runtime (preallocated caches); part 2
runs stock transformers: LlamaForCausalLM on the original weights vs DeepseekV3ForCausalLM on the
stock export of the graft (both with transformers' own dynamic caches).
Contexts past the model's trained length measure speed only (RoPE extrapolates; quality is moot).
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
import warnings
from pathlib import Path

import torch

from kvgraft.atomic import atomic_write_json
from kvgraft.eval.speed import decode_speed
from kvgraft.graft.convert import ranks_for_compression
from kvgraft.graft.mla import GraftConfig, graft_mla
from kvgraft.hf import load_pretrained
from kvgraft.reference import resolve_model


def set_absorb(model, mode: str) -> None:
    for layer in model.layers:
        if hasattr(layer.self_attn, "absorb"):
            layer.self_attn.absorb = mode


def hf_decode(model, context: int, batch: int, new_tokens: int, repeats: int, vocab: int) -> float:
    """Median ms per decode step of a transformers model (prefill, then one token at a time)."""
    g = torch.Generator().manual_seed(0)
    prompt = torch.randint(0, vocab, (batch, context), generator=g)
    medians = []
    with torch.inference_mode():
        for _ in range(repeats):
            out = model(prompt, use_cache=True)
            cache, nxt = out.past_key_values, out.logits[:, -1:].argmax(-1)
            steps = []
            for step in range(new_tokens):
                t0 = time.perf_counter()
                out = model(nxt, past_key_values=cache, use_cache=True)
                steps.append(time.perf_counter() - t0)
                cache, nxt = out.past_key_values, out.logits[:, -1:].argmax(-1)
            medians.append(statistics.median(steps[4:]))
    return statistics.median(medians) * 1e3


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default=None)
    ap.add_argument("--compression", type=float, default=4.0)
    ap.add_argument("--rope-dim", type=int, default=None)
    ap.add_argument("--contexts", type=int, nargs="+", default=[256, 1024, 4096])
    ap.add_argument("--batch-sizes", type=int, nargs="+", default=[1, 8])
    ap.add_argument("--new-tokens", type=int, default=24)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    ap.add_argument("--skip-hf", action="store_true")
    ap.add_argument("--device", default="cpu", help="cpu or cuda")
    ap.add_argument(
        "--random-1b", action="store_true", help="measure a randomly initialised 1B-shape Llama (16 layers, 32q/8kv x 64) instead"
    )
    ap.add_argument("--out", default="runs/bench/mla_decode")
    args = ap.parse_args()
    dtype = getattr(torch, args.dtype)
    warnings.filterwarnings("ignore", message="decode_speed: contexts")

    if args.random_1b:
        from bench_shapes import random_model

        path = Path("random-1b")
        original = random_model(args.device)
        args.skip_hf = True
    else:
        path = resolve_model(args.model)
        original = load_pretrained(path, dtype=torch.float32, device=args.device)
    cfg = original.config
    d_rope = args.rope_dim or cfg.head_dim
    d_c = ranks_for_compression(cfg, args.compression, d_rope)
    mla = graft_mla(
        original,
        GraftConfig(kv_lora_rank=d_c, qk_rope_head_dim=d_rope, objective="weights", rope_expectation=False),
        progress=False,
    )
    original, mla = original.to(dtype), mla.to(dtype)
    nbytes = torch.finfo(dtype).bits // 8
    print(
        f"model {path}: GQA {cfg.num_heads}q/{cfg.num_kv_heads}kv x {cfg.head_dim}; MLA d_c={d_c} d_rope={d_rope}; "
        f"KV bytes/token {cfg.kv_bytes_per_token(nbytes):,} -> {mla.config.kv_bytes_per_token(nbytes):,} ({args.dtype}); "
        f"torch threads {torch.get_num_threads()}"
    )
    rows = []
    print("\nkvgraft runtime: ms per decode step (tokens/s), ratio = original time / this time (>1 is faster)")
    print(f"{'context':>7} {'batch':>5} | {'GQA original':>20} | {'MLA absorbed':>26} | {'MLA expanded':>26}")
    for context in args.contexts:
        for batch in args.batch_sizes:
            kw = dict(contexts=(context,), batch_sizes=(batch,), new_tokens=args.new_tokens, repeats=args.repeats)
            base = decode_speed(original, **kw)[0]
            set_absorb(mla, "always")
            absorbed = decode_speed(mla, **kw)[0]
            set_absorb(mla, "never")
            expanded = decode_speed(mla, **kw)[0]
            set_absorb(mla, "auto")
            row = {
                "context": context,
                "batch": batch,
                "gqa_ms": base.ms_per_token_median,
                "mla_absorbed_ms": absorbed.ms_per_token_median,
                "mla_expanded_ms": expanded.ms_per_token_median,
                "kv_bytes_per_seq_gqa": cfg.kv_bytes_per_token(nbytes) * context,
                "kv_bytes_per_seq_mla": mla.config.kv_bytes_per_token(nbytes) * context,
            }
            rows.append(row)

            def cell(ms: float, batch: int = batch, base_ms: float = base.ms_per_token_median) -> str:
                return f"{ms:7.2f} ms ({batch / ms * 1e3:7.0f}/s) {base_ms / ms:4.2f}x"

            print(
                f"{context:>7} {batch:>5} | {base.ms_per_token_median:7.2f} ms ({batch / base.ms_per_token_median * 1e3:7.0f}/s) "
                f"| {cell(absorbed.ms_per_token_median)} | {cell(expanded.ms_per_token_median)}",
                flush=True,
            )

    hf_rows = []
    if not args.skip_hf:
        hf_rows = hf_part(original, mla, path, args, dtype)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    atomic_write_json(
        out / "results.json",
        {"model": str(path), "dtype": args.dtype, "kv_lora_rank": d_c, "rope_dim": d_rope, "kvgraft": rows, "hf": hf_rows},
    )
    print(f"\nwrote {out / 'results.json'}")


def hf_part(original, mla, path: Path, args, dtype) -> list[dict]:
    from transformers import AutoModelForCausalLM

    try:
        from kvgraft.hf.deepseek import ExportOptions, export_deepseek_v3
    except ImportError:
        print("\n(stock DeepSeek-V3 export not available: skipping the transformers comparison)")
        return []
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        export_deepseek_v3(mla.float(), Path(tmp) / "ds", ExportOptions(latent_norm="scale"))
        hf_llama = AutoModelForCausalLM.from_pretrained(path, dtype=dtype).eval()
        hf_ds = AutoModelForCausalLM.from_pretrained(Path(tmp) / "ds", dtype=dtype).eval()
        print("\nstock transformers: ms per decode step, ratio = Llama time / DeepseekV3 time")
        print(f"{'context':>7} {'batch':>5} | {'LlamaForCausalLM':>16} | {'DeepseekV3ForCausalLM':>22}")
        vocab = original.config.vocab_size
        for context in args.contexts:
            for batch in args.batch_sizes:
                a = hf_decode(hf_llama, context, batch, args.new_tokens, args.repeats, vocab)
                b = hf_decode(hf_ds, context, batch, args.new_tokens, args.repeats, vocab)
                rows.append({"context": context, "batch": batch, "hf_llama_ms": a, "hf_deepseek_v3_ms": b})
                print(f"{context:>7} {batch:>5} | {a:13.2f} ms | {b:13.2f} ms {a / b:5.2f}x", flush=True)
    return rows


if __name__ == "__main__":
    main()
