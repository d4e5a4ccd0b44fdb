"""Per-layer cost of the graft's fp64 factorisation (``convert_layer``) at real shapes, random weights.

    .venv/bin/python bench/mla_factorisation_time.py [--shapes llama-3.2-1b llama-3-8b] [--threads 2]

The default conversion's time is (forward work over the calibration tokens: statistics + propagation,
which runs on ``--device``) + layers x this per-layer factorisation (fp64; on the CPU, or on the GPU when the
model is there, since ``graft_mla`` runs it on a CUDA model's device; independent
of the number of calibration tokens). This times one layer at the default settings (4x, ranks from
``default_ranks``, attention-aware objective, rope selection "norm", RoPE expectation) with a random
positive-definite C, so a checkpoint's factorisation time is about layers x the printed figure.
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

import torch

from kvgraft.atomic import atomic_write_json
from kvgraft.graft.mla_math import GQAWeights, LayerSpec, convert_layer
from kvgraft.graft.ranks import default_ranks
from kvgraft.model import ModelConfig

SHAPES = {  # hidden, query heads, KV heads, head_dim, layers
    "llama-3.2-1b": (2048, 32, 8, 64, 16),
    "llama-3-8b": (4096, 32, 8, 128, 32),
    "llama-2-7b": (4096, 32, 32, 128, 32),
}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--shapes", nargs="+", default=["llama-3.2-1b", "llama-3-8b"], choices=list(SHAPES))
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument("--out", default="runs/bench/mla_factorisation_time")
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    gen = torch.Generator().manual_seed(0)
    rows = []
    print(f"torch threads {torch.get_num_threads()}")
    for name in args.shapes:
        h, H, K, d, layers = SHAPES[name]
        cfg = ModelConfig(
            vocab_size=32000,
            hidden_size=h,
            intermediate_size=4 * h,
            num_layers=layers,
            num_heads=H,
            num_kv_heads=K,
            head_dim=d,
            max_position_embeddings=4096,
        )
        ranks = default_ranks(cfg, compression=4.0)
        w = GQAWeights(
            *(torch.randn(shape, generator=gen) * h**-0.5 for shape in ((H * d, h), (K * d, h), (K * d, h), (h, H * d)))
        )
        a = torch.randn(h, h, dtype=torch.float64, generator=gen)
        C = a @ a.T / h + torch.diag(torch.rand(h, dtype=torch.float64, generator=gen) * 10)  # anisotropic
        expectation = torch.stack([torch.rand(d // 2, generator=gen) * 0.9, torch.zeros(d // 2)], -1).double()
        spec = LayerSpec(
            num_heads=H,
            num_kv_heads=K,
            head_dim=d,
            kv_lora_rank=ranks.kv_lora_rank,
            d_rope=ranks.qk_rope_head_dim,
            objective="attention",
            rope_selection="norm",
        )
        t0 = time.perf_counter()
        convert_layer(w, spec, C, rope_expectation=expectation)
        seconds = time.perf_counter() - t0
        rows.append(
            {
                "shape": name,
                "hidden": h,
                "heads": H,
                "kv_heads": K,
                "head_dim": d,
                "layers": layers,
                "kv_lora_rank": ranks.kv_lora_rank,
                "rope_dim": ranks.qk_rope_head_dim,
                "seconds_per_layer": seconds,
                "seconds_all_layers": seconds * layers,
            }
        )
        print(
            f"{name:<14} h {h} {H}q/{K}kv x {d}  d_c {ranks.kv_lora_rank} d_rope {ranks.qk_rope_head_dim}: "
            f"{seconds:.1f} s per layer, {seconds * layers:.0f} s for {layers} layers",
            flush=True,
        )
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    atomic_write_json((out / "results.json"), rows, indent=2)


if __name__ == "__main__":
    main()
