"""GPU decode where the cache dominates: GQA vs absorbed MLA vs the causal encoder-decoder, bf16, long contexts.

    python bench/gpu_decode.py                       # one GPU: shapes 1b and 7b, contexts 4K-32K, batch 1-64
    python bench/gpu_decode.py --shapes 1b --contexts 8192 32768 --batches 16 64
    .venv/bin/python bench/gpu_decode.py --smoke     # CPU, tiny sizes: checks the script end to end

Prepared for a session that has the GPU machine (one H200 runs the default grid in a few minutes; the
script prints its own wall time). Self-contained apart from the repository itself (``src/`` on the path).

For each shape, ``--layers`` layers with random weights per attention kind (bench/decode_cost.py's
configs: ``1b`` = Llama-3.2-1B-like, 32 q / 8 KV heads of 64; ``7b`` = Llama-3-8B-like, 32 q / 8 KV heads of
128, hidden 4096; MLA at 4x compression by the default rank rule; CED with the same latent widths, window
``--window``, pooling ``--compress-rate``). Per (context, batch): one paged cache per kind, filled on the
device with random values to ``context`` tokens (no prefill is run), then ``--warmup`` untimed and
``--steps`` timed single-token steps for all rows, the kinds interleaved step by step in a rotating order;
each step is timed with CUDA events (wall clock on the CPU) and the median is reported. Columns: ms per
step, the ratio to GQA (GQA time / this time, >1 is faster), and the bandwidth achieved, ideal bytes per
step (weights once + the cache the attention reads, ``decode_cost.step_cost``) / time, also as a fraction
of ``--peak-bw`` (H200: 4.8 TB/s). The runtime's gather of each row's blocks (kvgraft.model.batch) moves
about twice the cache bytes again on top of the ideal bytes; the JSON has ``runtime_bytes`` too.

Goal (issue 12): absorbed MLA at least 2x the GQA original at 8K+ context. The analytic bytes ratio is
printed next to the measured one, so a shortfall can be told apart: runtime overhead vs the bytes model.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT / "bench"), str(ROOT / "src")]

from decode_cost import KINDS, ced_of, configs, mla_of, step_cost  # noqa: E402

from kvgraft.atomic import atomic_write_json  # noqa: E402
from kvgraft.model import ModelConfig, Transformer  # noqa: E402


def shape_configs(shape: str, layers: int, window: int, compress_rate: int) -> dict[str, ModelConfig]:
    if shape == "7b":
        base = ModelConfig(
            vocab_size=128256,
            hidden_size=4096,
            num_layers=layers,
            num_heads=32,
            num_kv_heads=8,
            head_dim=128,
            intermediate_size=14336,
            max_position_embeddings=131072,
            rms_norm_eps=1e-5,
            rope={"theta": 500000.0},
            tie_word_embeddings=False,
        )
        mla = mla_of(base)
        return {"gqa": base, "mla": mla, "ced": ced_of(base, mla, window, compress_rate)}
    if shape == "tiny":  # the smoke run: the 8M reference widths
        return configs("8m", layers, window, compress_rate)
    return configs(shape, layers, window, compress_rate)


def build(cfg: ModelConfig, device: str, dtype: torch.dtype) -> Transformer:
    with torch.device("meta"):
        model = Transformer(cfg)
    model = model.to_empty(device=device)
    if cfg.tie_word_embeddings:  # to_empty unties shared parameters
        model.lm_head.weight = model.embed_tokens.weight
    model.rotary = type(model.rotary)(model.config).to(device)
    with torch.no_grad():  # random weights on the device (speed does not depend on them)
        gen = torch.Generator(device=device).manual_seed(0)
        for name, p in model.named_parameters():
            if p.dim() >= 2:
                p.normal_(0.0, cfg.initializer_range, generator=gen)
            elif "norm" in name:
                p.fill_(1.0)
            else:
                p.zero_()
    return model.to(dtype).eval()


def prefilled_cache(model: Transformer, batch: int, context: int, max_len: int, dtype: torch.dtype):
    cache = model.new_cache(batch, max_len, dtype)
    for s in cache.sequences:
        cache.extend(s, context)
        cache.commit(s, context)
    for pools in (cache.paged, cache.segments, cache.rings, cache.pending):
        for t in pools.values():
            t.uniform_(-1, 1)
    return cache


def sync(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize()


@torch.inference_mode()
def measure(
    models: dict[str, Transformer], context: int, batch: int, steps: int, warmup: int, device: str, dtype: torch.dtype
) -> dict[str, float]:
    names = list(models)
    max_len = context + warmup + steps + 1
    caches = {n: prefilled_cache(models[n], batch, context, max_len, dtype) for n in names}
    ids = torch.zeros(batch, 1, dtype=torch.long, device=device)
    cuda = device.startswith("cuda")
    times: dict[str, list[float]] = {n: [] for n in names}
    for step in range(warmup + steps):
        k = step % len(names)
        for n in names[k:] + names[:k]:
            if cuda:
                start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                start.record()
                models[n](ids, cache=caches[n], last_only=True)
                end.record()
                end.synchronize()
                dt = start.elapsed_time(end)
            else:
                t0 = time.perf_counter()
                models[n](ids, cache=caches[n], last_only=True)
                dt = (time.perf_counter() - t0) * 1e3
            if step >= warmup:
                times[n].append(dt)
    del caches
    if cuda:
        torch.cuda.empty_cache()
    return {n: statistics.median(t) for n, t in times.items()}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--shapes", nargs="+", default=["1b", "7b"], choices=["1b", "7b", "tiny"])
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--contexts", type=int, nargs="+", default=[4096, 8192, 16384, 32768])
    ap.add_argument("--batches", type=int, nargs="+", default=[1, 4, 16, 64])
    ap.add_argument("--kinds", nargs="+", default=list(KINDS), choices=KINDS)
    ap.add_argument("--window", type=int, default=128)
    ap.add_argument("--compress-rate", type=int, default=2)
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16", "float32"])
    ap.add_argument("--device", default=None, help="default: cuda (cpu with --smoke)")
    ap.add_argument("--peak-bw", type=float, default=4.8e12, help="bytes/s for the percent column (H200: 4.8e12)")
    ap.add_argument(
        "--max-cache-gb",
        type=float,
        default=90.0,
        help="skip a point whose caches (all kinds, with the runtime's gather copy) exceed this",
    )
    ap.add_argument("--smoke", action="store_true", help="CPU, tiny shape, 2 contexts x 2 batches, 2 steps")
    ap.add_argument("--out", default="runs/bench/gpu_decode.json")
    args = ap.parse_args()
    if args.smoke:
        args.shapes, args.layers, args.contexts, args.batches = ["tiny"], 2, [64, 160], [1, 2]
        args.steps, args.warmup, args.device = 2, 1, args.device or "cpu"
    device = args.device or "cuda"
    if device.startswith("cuda") and not torch.cuda.is_available():
        sys.exit("no CUDA device: run on the GPU machine, or pass --smoke for the CPU check")
    dtype = getattr(torch, args.dtype)
    itemsize = torch.finfo(dtype).bits // 8
    name = torch.cuda.get_device_name() if device.startswith("cuda") else "cpu"
    print(f"device {name}, {args.dtype}, torch {torch.__version__}, {args.layers} layers per model\n")
    t_start = time.perf_counter()
    rows = []
    for shape in args.shapes:
        cfgs = {k: v for k, v in shape_configs(shape, args.layers, args.window, args.compress_rate).items() if k in args.kinds}
        g = next(iter(cfgs.values()))
        m = cfgs.get("mla")
        print(
            f"## shape {shape}: hidden {g.hidden_size}, {g.num_heads}q/{g.num_kv_heads}kv x {g.head_dim}"
            + (f"; MLA d_c {m.kv_lora_rank} + d_rope {m.qk_rope_head_dim}" if m else "")
            + "\n"
        )
        models = {k: build(c, device, dtype) for k, c in cfgs.items()}
        hdr = "| context | batch | " + " | ".join(f"{k.upper()} ms | {k.upper()} GB/s (% peak)" for k in cfgs)
        others = [k for k in cfgs if k != "gqa"] if "gqa" in cfgs else []
        hdr += "".join(f" | {k.upper()} vs GQA (bytes ratio)" for k in others) + " |"
        print(hdr)
        print("|" + "---:|" * (hdr.count("|") - 1), flush=True)
        for S in args.contexts:
            for B in args.batches:
                max_len = S + args.warmup + args.steps + 1
                costs = {k: step_cost(c, S, B, itemsize, max_len) for k, c in cfgs.items()}
                need = sum(3 * c.cache_stored * B * itemsize for c in costs.values()) / 1e9
                if need > args.max_cache_gb:
                    print(f"| {S} | {B} | skipped: caches need ~{need:.0f} GB > --max-cache-gb |", flush=True)
                    continue
                ms = measure(models, S, B, args.steps, args.warmup, device, dtype)
                cells, row = [], {"shape": shape, "context": S, "batch": B}
                for k in cfgs:
                    gbs = costs[k].bytes / (ms[k] / 1e3) / 1e9
                    cells.append(f"{ms[k]:.2f} | {gbs:,.1f} ({100 * gbs * 1e9 / args.peak_bw:.1f}%)")
                    row[k] = {
                        "ms": ms[k],
                        "bytes": costs[k].bytes,
                        "runtime_bytes": costs[k].runtime_bytes,
                        "flops": costs[k].flops,
                        "achieved_bytes_per_s": gbs * 1e9,
                    }
                for k in others:
                    cells.append(f"{ms['gqa'] / ms[k]:.2f}x ({costs['gqa'].bytes / costs[k].bytes:.2f}x)")
                print(f"| {S} | {B} | " + " | ".join(cells) + " |", flush=True)
                rows.append(row)
        del models
        if device.startswith("cuda"):
            torch.cuda.empty_cache()
        print()
    if "mla" in args.kinds and "gqa" in args.kinds:
        for shape in args.shapes:
            sel = [r for r in rows if r["shape"] == shape and r["context"] >= 8192]
            if sel:
                ratios = [r["gqa"]["ms"] / r["mla"]["ms"] for r in sel]
                print(
                    f"{shape}: absorbed MLA vs GQA at 8K+ context: {min(ratios):.2f}x - {max(ratios):.2f}x "
                    f"(goal >= 2x; met at {sum(x >= 2 for x in ratios)} of {len(ratios)} points)"
                )
    print(f"\nwall time {time.perf_counter() - t_start:.0f} s")
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    atomic_write_json(out, {"device": name, "args": vars(args), "rows": rows}, indent=1)
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
