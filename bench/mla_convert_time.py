"""Conversion time per million parameters: the reference model and a random model of 1B-parameter shape.

    .venv/bin/python bench/mla_convert_time.py [--big-layers 16]
    .venv/bin/python bench/mla_convert_time.py --objectives default --calibration-tokens 32768  # convert's defaults

Objective "default" is what ``kvgraft convert`` runs with no flags (attention-aware, layer-wise, RoPE
expectation, rope selection "norm", 4x, ranks from ``default_ranks``); the others use the older fixed
ranks (d_rope = head_dim/2). Each row splits the time into the graft's phases (``graft_mla(timings=)``):
statistics and propagation scale with calibration tokens x parameters (forward work), factorisation
with layers x the per-layer fp64 matrix sizes only.
The 1B shape is Llama-3.2-1B-like (hidden 2048, 32 query / 8 KV heads of 64, SwiGLU 8192, vocab 32000)
with random weights: conversion cost depends on shapes, not on what the weights learned. Each
objective is timed on both models in one run; calibration is the same number of tokens for both.
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

import torch
from bench_shapes import random_model

from kvgraft.atomic import atomic_write_json
from kvgraft.graft.mla import GraftConfig, graft_mla
from kvgraft.graft.ranks import default_ranks
from kvgraft.hf import load_pretrained
from kvgraft.model import Transformer
from kvgraft.reference import resolve_model


def time_conversions(
    model: Transformer, calib: torch.Tensor, objectives: list[str], label: str, progress: bool = False
) -> list[dict]:
    cfg = model.config
    params = sum(p.numel() for p in model.parameters())
    d_rope = cfg.head_dim // 2
    d_c = cfg.kv_width // 4 - d_rope  # 4x compression
    rows = []
    for objective in objectives:
        if objective == "default":
            ranks = default_ranks(cfg, compression=4.0)
            g = GraftConfig(
                kv_lora_rank=ranks.kv_lora_rank,
                qk_rope_head_dim=ranks.qk_rope_head_dim,
                objective="attention",
                rope_selection="norm",
                layerwise=True,
                rope_expectation=True,
            )
        else:
            g = GraftConfig(kv_lora_rank=d_c, qk_rope_head_dim=d_rope, objective=objective, layerwise=objective != "weights")
        timings: dict = {}
        t0 = time.perf_counter()
        graft_mla(model, g, None if objective == "weights" else calib, progress=progress, timings=timings)
        seconds = time.perf_counter() - t0
        timings["other"] = seconds - sum(timings.values())  # building the new model, copying weights
        rows.append(
            {
                "model": label,
                "params": params,
                "objective": objective,
                "seconds": seconds,
                "seconds_per_million_params": seconds / (params / 1e6),
                "phases": timings,
                "kv_lora_rank": g.kv_lora_rank,
                "rope_dim": g.qk_rope_head_dim,
                "calibration_tokens": 0 if objective == "weights" else calib.numel(),
            }
        )
        print(
            f"{label:<24} {params / 1e6:8.1f}M params  {objective:<12} {seconds:8.1f} s  "
            f"{seconds / (params / 1e6) * 1e3:8.2f} ms per M params  ("
            + ", ".join(f"{k} {v:.1f} s" for k, v in timings.items())
            + ")",
            flush=True,
        )
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default=None)
    ap.add_argument("--big-layers", type=int, default=16, help="layers of the 1B-shape model (16 -> 1.1B)")
    ap.add_argument("--calibration-tokens", type=int, default=1024)
    ap.add_argument(
        "--objectives",
        nargs="+",
        default=["weights", "activations", "attention"],
        choices=["weights", "activations", "attention", "default"],
    )
    ap.add_argument("--seq-len", type=int, default=256, help="calibration sequence length (convert uses 512)")
    ap.add_argument("--out", default="runs/bench/mla_convert_time")
    ap.add_argument("--only", choices=["reference", "big"], default=None, help="time just one of the two models")
    ap.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's)")
    ap.add_argument(
        "--progress", action="store_true", help="graft's per-layer progress bar with the phase times so far (on stderr)"
    )
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    rows = []
    seq = args.seq_len
    n = max(1, args.calibration_tokens // seq)
    print(f"torch threads {torch.get_num_threads()}; calibration {n * seq} tokens")
    if args.only != "big":
        ref = load_pretrained(resolve_model(args.model), dtype=torch.float32)
        calib = torch.randint(0, ref.config.vocab_size, (n, seq))
        rows += time_conversions(ref, calib, args.objectives, "reference", args.progress)
        del ref
    if args.only != "reference":
        big = random_model("cpu", layers=args.big_layers)
        calib = torch.randint(0, big.config.vocab_size, (n, seq))
        rows += time_conversions(big, calib, args.objectives, f"random 1B-shape ({args.big_layers} layers)", args.progress)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    atomic_write_json((out / "results.json"), rows, indent=2)
    print(f"wrote {out / 'results.json'}")


if __name__ == "__main__":
    main()
