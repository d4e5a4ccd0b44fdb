"""Decode KV memory and speed by context: the Llama reference vs its MLA graft vs the causal encoder-decoder.

    OMP_NUM_THREADS=1 .venv/bin/python bench/ced_decode.py            # contexts 256 512 1024 2048 4096
    OMP_NUM_THREADS=1 .venv/bin/python bench/ced_decode.py --quick    # smoke run: contexts 256 1024, 8 steps, 1 rep
    OMP_NUM_THREADS=1 .venv/bin/python bench/ced_decode.py --contexts 256 1024 4096 --batch 1 8 --dtype bfloat16

Three models of the same size family, measured side by side in one process:
- "llama": the Llama reference (``--llama``, default models/kvgraft-llama-8m), GQA 8q/4kv x 32;
- "mla":   its MLA graft, weights-only SVD (``--compression`` 4x, d_rope = head_dim by default; decode
           uses the absorbed path, kvgraft's "auto"). Speed and memory do not depend on weight quality;
- "ced":   the causal encoder-decoder (``--ced``, default models/kvgraft-ced-8m; when that path does
           not exist, the "ced-8m" preset with random weights, ``init_weights(0)``).

For every context length and batch size it measures
1. KV cache bytes per sequence: ``cache.nbytes / batch`` of a live cache allocated for exactly
   ``context`` tokens (``model.new_cache``), asserted equal to ``config.kv_cache_bytes(context,
   itemsize)`` (both are printed);
2. decode tokens/s: per repeat, prefill the same ``context`` random tokens into a fresh cache per model
   (not timed in the table; the prefill times go to the JSON), then run ``--warmup`` untimed and
   ``--steps`` timed single-token decode steps, each timed alone with ``time.perf_counter``. The three
   models are interleaved step by step (step i of each, in a rotating order, before step i + 1 of any),
   so a slow spell of a noisy machine hits all three alike. Per repeat the median step latency is
   taken; the table reports the median over ``--repeats`` repeats and its ratio to the Llama's.
The models were trained for 512 positions; longer contexts measure speed and memory only (RoPE
extrapolates, all three accept the longer cache without changing ``max_position_embeddings``).

Prints a markdown table, writes JSON to ``--out`` (default runs/bench/ced_decode.json) and a two-panel
plot (KV MB per sequence vs context; tokens/s vs context) next to it (``--plot``, default: the JSON
path with .png).
"""

from __future__ import annotations

import argparse
import statistics
import time
from pathlib import Path

import torch

from kvgraft.atomic import atomic_savefig, atomic_write_json
from kvgraft.graft.convert import ranks_for_compression
from kvgraft.graft.mla import GraftConfig, graft_mla
from kvgraft.hf import load_pretrained
from kvgraft.model import Transformer
from kvgraft.model.presets import get_preset
from kvgraft.reference import resolve_model

MODELS = ("llama", "mla", "ced")


def build_models(args, dtype: torch.dtype) -> tuple[dict[str, Transformer], dict[str, str]]:
    """The three models (eval mode, ``dtype``, ``args.device``) and a line describing each."""
    llama_path = resolve_model(args.llama)
    llama = load_pretrained(llama_path, dtype=torch.float32)
    cfg = llama.config
    d_rope = args.rope_dim or cfg.head_dim
    d_c = ranks_for_compression(cfg, args.compression, d_rope)
    t0 = time.perf_counter()
    mla = graft_mla(
        llama, GraftConfig(kv_lora_rank=d_c, qk_rope_head_dim=d_rope, objective="weights", rope_expectation=False), progress=False
    )
    graft_s = time.perf_counter() - t0
    ced_path = Path(args.ced)
    if (ced_path / "config.json").is_file():
        ced = load_pretrained(ced_path, dtype=torch.float32)
        ced_desc = f"{ced_path} (trained)"
    else:
        ced = Transformer(get_preset("ced-8m"))
        ced.init_weights(0)
        ced_desc = f"preset ced-8m, random weights ({ced_path} not found)"
    c = ced.config
    descs = {
        "llama": f"{args.llama or llama_path.name}: GQA {cfg.num_heads}q/{cfg.num_kv_heads}kv x {cfg.head_dim}, {cfg.num_layers} layers",
        "mla": f"weights-only MLA graft of it ({graft_s:.1f} s): d_c {d_c}, d_rope {d_rope} ({args.compression:g}x)",
        "ced": f"{ced_desc}: {c.num_layers} layers, kv_source {c.kv_source_layers}, window {c.sliding_window}, "
        f"m {c.compress_rate}, d_c {c.kv_lora_rank}, d_rope {c.qk_rope_head_dim}",
    }
    models = {"llama": llama, "mla": mla, "ced": ced}
    for name, model in models.items():
        models[name] = model.to(device=args.device, dtype=dtype).eval()
    return models, descs


def kv_bytes_per_seq(model: Transformer, context: int, batch: int, dtype: torch.dtype) -> tuple[int, int]:
    """(measured from a live cache of ``context`` tokens, formula), per sequence; asserted equal."""
    cache = model.new_cache(batch, context, dtype)
    measured = cache.nbytes // batch
    assert cache.nbytes % batch == 0
    formula = model.config.kv_cache_bytes(context, torch.finfo(dtype).bits // 8)
    del cache
    assert measured == formula, f"KV bytes/seq at context {context}: measured {measured:,} != formula {formula:,}"
    return measured, int(formula)


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


@torch.inference_mode()
def interleaved_decode(
    models: dict[str, Transformer],
    context: int,
    batch: int,
    warmup: int,
    steps: int,
    repeats: int,
    dtype: torch.dtype,
    device: str,
    seed: int = 0,
) -> tuple[dict[str, list[float]], dict[str, list[float]]]:
    """Per model, the median decode-step latency (ms) of each repeat, and the prefill times (s).

    Every repeat prefills the same random ``context``-token prompt into a fresh cache per model (of
    ``context + warmup + steps`` tokens, its size checked against the formula), then runs the decode
    steps interleaved: step i of every model, in a rotating order, before step i + 1 of any, each step
    timed alone with ``time.perf_counter``. The first ``warmup`` steps are not counted.
    """
    dev = torch.device(device)
    itemsize = torch.finfo(dtype).bits // 8
    prompt = torch.randint(
        0, models["llama"].config.vocab_size, (batch, context), generator=torch.Generator().manual_seed(seed)
    ).to(dev)
    ms = {name: [] for name in models}
    prefill = {name: [] for name in models}
    names = list(models)
    for rep in range(repeats):
        caches, nxt, times = {}, {}, {name: [] for name in names}
        for name in names[rep % 3 :] + names[: rep % 3]:
            model = models[name]
            cache = model.new_cache(batch, context + warmup + steps, dtype)
            assert cache.nbytes == batch * model.config.kv_cache_bytes(context + warmup + steps, itemsize)
            _sync(dev)
            t0 = time.perf_counter()
            logits = model(prompt, cache=cache, last_only=True)
            _sync(dev)
            prefill[name].append(time.perf_counter() - t0)
            caches[name], nxt[name] = cache, logits[:, -1].argmax(dim=-1, keepdim=True)
        for step in range(warmup + steps):
            k = (rep + step) % 3
            for name in names[k:] + names[:k]:
                _sync(dev)
                t0 = time.perf_counter()
                logits = models[name](nxt[name], cache=caches[name])
                _sync(dev)
                if step >= warmup:
                    times[name].append(time.perf_counter() - t0)
                nxt[name] = logits[:, -1].argmax(dim=-1, keepdim=True)
        for name in names:
            ms[name].append(statistics.median(times[name]) * 1e3)
        del caches
    return ms, prefill


def plot(rows: list[dict], path: Path, dtype_name: str, device: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax_mem, ax_tps) = plt.subplots(1, 2, figsize=(11, 4.2))
    styles = {"llama": ("C0", "o"), "mla": ("C1", "s"), "ced": ("C2", "^")}
    batches = sorted({r["batch"] for r in rows})
    first = [r for r in rows if r["batch"] == batches[0]]
    ctx = [r["context"] for r in first]
    for name in MODELS:
        color, marker = styles[name]
        ax_mem.plot(ctx, [r[name]["kv_bytes_per_seq"] / 2**20 for r in first], marker=marker, color=color, label=name)
        for i, b in enumerate(batches):
            sel = [r for r in rows if r["batch"] == b]
            ax_tps.plot(
                [r["context"] for r in sel],
                [r[name]["tokens_per_s"] for r in sel],
                marker=marker,
                color=color,
                linestyle=("-", "--", ":", "-.")[i % 4],
                label=name if len(batches) == 1 else f"{name}, batch {b}",
            )
    ax_mem.set(
        xscale="log",
        yscale="log",
        xlabel="context (tokens)",
        ylabel="KV cache MiB per sequence",
        title=f"KV cache per sequence ({dtype_name})",
    )
    ax_tps.set(
        xscale="log", xlabel="context (tokens)", ylabel="decode tokens/s", title=f"decode speed ({device}, {dtype_name}, median)"
    )
    ax_tps.set_ylim(bottom=0)
    for ax in (ax_mem, ax_tps):
        ax.set_xticks(ctx, [str(c) for c in ctx])
        ax.minorticks_off()
        ax.grid(alpha=0.3)
        ax.legend()
    fig.tight_layout()
    atomic_savefig(fig, path, dpi=120)
    plt.close(fig)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--llama", default=None, help="Llama reference checkpoint (default: models/kvgraft-llama-8m)")
    ap.add_argument(
        "--ced", default="models/kvgraft-ced-8m", help="trained CED checkpoint; if absent, the ced-8m preset with random weights"
    )
    ap.add_argument("--compression", type=float, default=4.0, help="MLA graft KV compression (sets d_c)")
    ap.add_argument("--rope-dim", type=int, default=None, help="MLA graft d_rope (default: head_dim)")
    ap.add_argument("--contexts", type=int, nargs="+", default=[256, 512, 1024, 2048, 4096])
    ap.add_argument("--batch", type=int, nargs="+", default=[1], help="batch size(s)")
    ap.add_argument("--steps", type=int, default=32, help="timed decode steps per repeat")
    ap.add_argument("--warmup", type=int, default=4, help="untimed decode steps before the timed ones")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--threads", type=int, default=1, help="torch.set_num_threads")
    ap.add_argument("--quick", action="store_true", help="smoke run: contexts 256 1024, 8 steps, 1 repeat")
    ap.add_argument("--out", default="runs/bench/ced_decode.json")
    ap.add_argument("--plot", default=None, help="PNG path (default: --out with .png)")
    args = ap.parse_args()
    if args.quick:
        args.contexts, args.steps, args.repeats = [256, 1024], 8, 1
    torch.set_num_threads(args.threads)
    dtype = getattr(torch, args.dtype)

    models, descs = build_models(args, dtype)
    for name in MODELS:
        print(f"{name:>5}: {descs[name]}")
    print(
        f"{args.dtype}, {args.device}, torch threads {torch.get_num_threads()}, {args.warmup} warmup + "
        f"{args.steps} timed decode steps, {args.repeats} repeat(s), models interleaved step by step\n",
        flush=True,
    )

    rows: list[dict] = []
    t_start = time.perf_counter()
    for context in args.contexts:
        for batch in args.batch:
            row: dict = {"context": context, "batch": batch}
            mem = {name: kv_bytes_per_seq(models[name], context, batch, dtype) for name in MODELS}
            print(
                f"context {context}, batch {batch}: KV bytes/seq measured / formula: "
                + "; ".join(f"{n} {m:,} / {f:,}" for n, (m, f) in mem.items()),
                flush=True,
            )
            ms, prefill = interleaved_decode(
                models, context, batch, args.warmup, args.steps, args.repeats, dtype, args.device, seed=context * 1000 + batch
            )
            for name in MODELS:
                med = statistics.median(ms[name])
                row[name] = {
                    "kv_bytes_per_seq": mem[name][0],
                    "kv_bytes_per_seq_formula": mem[name][1],
                    "ms_per_step_median": med,
                    "ms_per_step_repeats": ms[name],
                    "tokens_per_s": batch / med * 1e3,
                    "prefill_s_median": statistics.median(prefill[name]),
                }
            for name in MODELS:
                row[name]["kv_vs_llama"] = row[name]["kv_bytes_per_seq"] / row["llama"]["kv_bytes_per_seq"]
                row[name]["speed_vs_llama"] = row[name]["tokens_per_s"] / row["llama"]["tokens_per_s"]
            rows.append(row)
            print(
                "  tokens/s: " + "; ".join(f"{n} {row[n]['tokens_per_s']:.1f} ({row[n]['speed_vs_llama']:.2f}x)" for n in MODELS),
                flush=True,
            )
    elapsed = time.perf_counter() - t_start

    print(f"\nKV bytes per sequence ({args.dtype}) and decode tokens/s (median of {args.repeats}); (x) = this model / Llama\n")
    print("| context | batch | Llama KV B/seq | MLA KV B/seq | CED KV B/seq | Llama tok/s | MLA tok/s | CED tok/s |")
    print("|---:|---:|---:|---:|---:|---:|---:|---:|")
    for r in rows:
        kv = [f"{r['llama']['kv_bytes_per_seq']:,}"] + [
            f"{r[n]['kv_bytes_per_seq']:,} ({r[n]['kv_vs_llama']:.3f}x)" for n in ("mla", "ced")
        ]
        tps = [f"{r['llama']['tokens_per_s']:.1f}"] + [
            f"{r[n]['tokens_per_s']:.1f} ({r[n]['speed_vs_llama']:.2f}x)" for n in ("mla", "ced")
        ]
        print(f"| {r['context']} | {r['batch']} | " + " | ".join(kv + tps) + " |")
    print(f"\n(measurement loop {elapsed:.0f} s)")

    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    record = {
        "what": "KV cache bytes per sequence and decode tokens/s, Llama reference vs MLA graft vs CED",
        "models": descs,
        "configs": {n: repr(m.config) for n, m in models.items()},
        "dtype": args.dtype,
        "device": args.device,
        "threads": torch.get_num_threads(),
        "steps": args.steps,
        "warmup": args.warmup,
        "repeats": args.repeats,
        "batch": args.batch,
        "contexts": args.contexts,
        "elapsed_s": elapsed,
        "rows": rows,
    }
    atomic_write_json(out, record, indent=2)
    png = Path(args.plot) if args.plot else out.with_suffix(".png")
    png.parent.mkdir(parents=True, exist_ok=True)
    plot(rows, png, args.dtype, args.device)
    print(f"wrote {out} and {png}")


if __name__ == "__main__":
    main()
