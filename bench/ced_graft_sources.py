"""Where the share graft loses perplexity: one-shot validation perplexity by choice of kv_source layers.

    OMP_NUM_THREADS=1 .venv/bin/python bench/ced_graft_sources.py --data runs/data [--model models/kvgraft-llama-8m]

The reference model is grafted to MLA once (one RoPE layout for all layers, ``--rope-selection``
shared or stride; d_c 96, d_rope 32: what ``kvgraft convert --to ced`` does first); then the share graft runs for each set of kv_source layers.
With every layer a source the result is exactly the MLA graft (the windows keep each layer's own keys,
the shared path each layer's own latent), so the rows separate what the MLA step costs from what
sharing costs. Validation perplexity on the same first 12 x 16 validation sequences as bench/ced_graft.py.
"""

from __future__ import annotations

import argparse
import math
from pathlib import Path

import torch

from kvgraft.atomic import atomic_write_json
from kvgraft.data import PackedDataset
from kvgraft.graft.calibration import load_calibration
from kvgraft.graft.ced import CEDGraftConfig, graft_ced
from kvgraft.graft.convert import convert
from kvgraft.graft.options import ConvertOptions
from kvgraft.hf import load_pretrained
from kvgraft.reference import resolve_model
from kvgraft.train.loop import evaluate, lm_loss

SETS = {
    "all 8 layers (= the MLA graft)": (0, 1, 2, 3, 4, 5, 6, 7),
    "0, 1, 3, 4": (0, 1, 3, 4),
    "1, 3, 4 (default)": (1, 3, 4),
    "1, 4": (1, 4),
    "4 (pivot only)": (4,),
}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default=None)
    ap.add_argument("--data", required=True)
    ap.add_argument("--sliding-window", type=int, default=64)
    ap.add_argument(
        "--rope-selection", choices=["stride", "shared"], default="shared", help="the MLA step's RoPE layout (one for all layers)"
    )
    ap.add_argument("--out", default="runs/bench/ced_graft_sources")
    args = ap.parse_args()
    src = resolve_model(args.model)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    mla_dir = out / f"mla-{args.rope_selection}"
    if not mla_dir.exists():
        convert(src, mla_dir, ConvertOptions(compression=2.0, rope_selection=args.rope_selection))
    original, mla = load_pretrained(src), load_pretrained(mla_dir)
    val = PackedDataset(Path(args.data) / "tokens" / "validation.npy", original.config.max_position_embeddings)

    def ppl(model) -> float:
        return math.exp(evaluate(model, val, lm_loss, 16, 12))

    calib = load_calibration(src, None, 32768, original.config.max_position_embeddings)
    rows = {
        "original (Llama reference)": (ppl(original), None),
        f"MLA graft ({args.rope_selection} RoPE layout, d_c 96)": (ppl(mla), None),
    }
    for name, sources in SETS.items():
        if max(sources) >= mla.config.num_layers:
            continue
        ced, report = graft_ced(mla, CEDGraftConfig(sources, sliding_window=args.sliding_window), calib, progress=False)
        rows[f"share graft, kv_source {name}"] = (ppl(ced.eval()), ced.config.kv_cache_bytes(4096, 2))
    base = rows["original (Llama reference)"][0]
    print("| model | one-shot val ppl | vs original | KV bytes/seq at 4K (bf16) |")
    print("|---|---:|---:|---:|")
    for name, (p, kv) in rows.items():
        print(f"| {name} | {p:.3f} | {p / base:.3f}x | {'' if kv is None else f'{kv:,}'} |")
    atomic_write_json((out / "results.json"), rows, indent=2)


if __name__ == "__main__":
    with torch.no_grad():
        main()
