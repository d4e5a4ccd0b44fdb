"""One-shot perplexity of MLA grafts vs the original, by KV compression and method, in one run.

    .venv/bin/python bench/mla_oneshot.py [--model models/kvgraft-llama-8m] [--out runs/bench/mla_oneshot]

For each compression (original KV bytes / converted KV bytes) and each initialisation method, the
reference model is converted (no training) and scored on its held-out slice next to the original.
Prints a table of perplexities and their ratio to the original; writes JSON and a PNG plot.
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

import torch

from kvgraft.atomic import atomic_savefig, atomic_write_json
from kvgraft.eval import perplexity
from kvgraft.graft.calibration import load_calibration
from kvgraft.graft.convert import ranks_for_compression
from kvgraft.graft.mla import GraftConfig, graft_mla
from kvgraft.hf import load_pretrained
from kvgraft.reference import resolve_model

METHODS = {
    # name: (objective, rope_selection, layerwise, rope_expectation)
    "weights-svd": ("weights", "stride", False, False),
    "activations": ("activations", "stride", False, False),
    "activations+layerwise": ("activations", "stride", True, False),
    "activations+layerwise+rope-expectation": ("activations", "stride", True, True),
    "attention+layerwise": ("attention", "stride", True, False),
    "attention+layerwise+norm-rope": ("attention", "norm", True, False),
    "activations+rope-expectation": ("activations", "stride", False, True),
    "attention+layerwise+rope-expectation": ("attention", "stride", True, True),
    "attention+layerwise+norm-rope+rope-expectation": ("attention", "norm", True, True),
}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default=None)
    ap.add_argument("--out", default="runs/bench/mla_oneshot")
    ap.add_argument("--compressions", type=float, nargs="+", default=[2.0, 4.0, 8.0])
    ap.add_argument("--rope-dims", type=int, nargs="+", default=None, help="shared RoPE key widths to try (default: head_dim/2)")
    ap.add_argument(
        "--methods",
        nargs="+",
        default=[
            "weights-svd",
            "activations",
            "attention+layerwise",
            "activations+rope-expectation",
            "attention+layerwise+rope-expectation",
            "attention+layerwise+norm-rope+rope-expectation",
        ],
        choices=list(METHODS),
    )
    ap.add_argument("--eval-tokens", type=int, default=32768)
    ap.add_argument("--calibration-tokens", type=int, default=32768)
    ap.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's)")
    ap.add_argument(
        "--shrinkage",
        type=float,
        default=None,
        help="GraftConfig.calibration_shrinkage (default: GraftConfig's, 0.5; the table in RESULTS.md before 2026-12-01 used 0)",
    )
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)

    path = resolve_model(args.model)
    model = load_pretrained(path, dtype=torch.float32)
    cfg = model.config
    heldout = path / "eval" / "heldout.npy"
    seq = cfg.max_position_embeddings
    calib = load_calibration(path, None, args.calibration_tokens, seq)
    base = perplexity(model, heldout, max_tokens=args.eval_tokens, progress=False)
    rows = [
        {
            "method": "original",
            "compression": 1.0,
            "kv_lora_rank": None,
            "rope_dim": None,
            "ppl": base.ppl,
            "ratio": 1.0,
            "seconds": 0.0,
        }
    ]
    print(f"original: ppl {base.ppl:.3f} on {base.tokens_scored:,} held-out tokens")
    rope_dims = args.rope_dims or [cfg.head_dim // 2]
    for compression in args.compressions:
        for d_rope in rope_dims:
            try:
                d_c = ranks_for_compression(cfg, compression, d_rope)
            except ValueError as exc:
                print(f"skip {compression}x, d_rope {d_rope}: {exc}")
                continue
            for name in args.methods:
                objective, selection, layerwise, expectation = METHODS[name]
                extra = {} if args.shrinkage is None else {"calibration_shrinkage": args.shrinkage}
                g = GraftConfig(
                    kv_lora_rank=d_c,
                    qk_rope_head_dim=d_rope,
                    objective=objective,
                    rope_selection=selection,
                    layerwise=layerwise,
                    rope_expectation=expectation,
                    **extra,
                )
                t0 = time.perf_counter()
                new = graft_mla(model, g, calib, progress=False)
                seconds = time.perf_counter() - t0
                res = perplexity(new, heldout, max_tokens=args.eval_tokens, progress=False)
                rows.append(
                    {
                        "method": name,
                        "compression": compression,
                        "kv_lora_rank": d_c,
                        "rope_dim": d_rope,
                        "ppl": res.ppl,
                        "ratio": res.ppl / base.ppl,
                        "seconds": seconds,
                    }
                )
                print(
                    f"{compression:>4.1f}x d_c={d_c:<4} d_rope={d_rope:<3} {name:<32} ppl {res.ppl:10.3f} "
                    f"({res.ppl / base.ppl:6.3f}x original)  convert {seconds:5.1f} s",
                    flush=True,
                )
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    atomic_write_json(out / "results.json", {"model": str(path), "eval_tokens": base.tokens_scored, "rows": rows})
    print("\n" + table(rows))
    plot(rows, out / "mla_oneshot.png", base.ppl)
    print(f"\nwrote {out / 'results.json'} and {out / 'mla_oneshot.png'}")


def table(rows: list[dict]) -> str:
    methods = [m for m in dict.fromkeys(r["method"] for r in rows) if m != "original"]
    keys = sorted({(r["compression"], r["rope_dim"]) for r in rows if r["method"] != "original"})
    head = "| method | " + " | ".join(f"{c:g}x (d_rope {d})" for c, d in keys) + " |"
    lines = [head, "|" + "---|" * (len(keys) + 1)]
    for m in methods:
        cells = []
        for c, d in keys:
            r = next((r for r in rows if r["method"] == m and r["compression"] == c and r["rope_dim"] == d), None)
            cells.append("-" if r is None else f"{r['ppl']:.2f} ({r['ratio']:.2f}x)")
        lines.append(f"| {m} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def plot(rows: list[dict], png: Path, base_ppl: float) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4.2))
    for m in dict.fromkeys(r["method"] for r in rows if r["method"] != "original"):
        pts = sorted((r["compression"], r["ppl"]) for r in rows if r["method"] == m)
        ax.plot(*zip(*pts), "o-", label=m)
    ax.axhline(base_ppl, color="k", ls="--", lw=1, label="original")
    ax.axhline(1.3 * base_ppl, color="r", ls=":", lw=1, label="1.3x original (acceptance bar)")
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.set_xlabel("KV cache compression (x)")
    ax.set_ylabel("held-out perplexity (one-shot, no healing)")
    ax.grid(alpha=0.3, which="both")
    ax.legend(fontsize=8)
    fig.tight_layout()
    atomic_savefig(fig, png, dpi=110)
    plt.close(fig)


if __name__ == "__main__":
    main()
