"""Where `kvgraft convert`'s minutes go, by layer and by step (the layer-by-layer executor, default options).

Runs the conversion of a checkpoint (e.g. a few layers of a real shape from ``bench/random_checkpoint.py
--num-layers``) with timers around each step of the walk up the layers; the steps' code is not changed,
only wrapped. Per layer:

- read: the source block read from the memory-mapped checkpoint (bf16 -> fp32);
- statistics: the calibration second moment (``layer_stats.second_moment``: the fp64 Gram matrix of the attention
  input), the attention-distance profile (``layer_stats.distance_profile``: q/k projections and the softmax over
  T x T per head), Qwen3's norm fits (``layer_stats.linearised``);
- factorisation: ``convert_layer`` (fp64; of it: the KV head rotations, the RoPE pair scores, the
  attention-aware metric's square roots; the rest is the products with C, the eigendecomposition and the
  assembly);
- propagation: the converted layer run over the calibration stream (of it: attention, MLP);
- tail: the calibration tail's 8 sequences through the original and the converted layer (for the
  perplexities in conversion.json);
- write, checkpoint: output shards and the ``--resume`` checkpoint.

    python bench/random_checkpoint.py --shape llama-1b --num-layers 3 --out runs/ckpt/llama-1b-3l
    python bench/convert_profile.py runs/ckpt/llama-1b-3l --calibration-tokens 4096 --threads 1

Statistics, propagation and the tail grow linearly with the calibration tokens (the distance profile's
softmax with tokens x sequence length), the factorisation not at all; the last converted layer has no
propagation (its output is never read). Prints a table and writes ``--json``.
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import resource
import sys
import tempfile
import time
from collections import defaultdict
from pathlib import Path
from typing import Any

import numpy as np
import torch

import kvgraft.graft.layer_stats as layer_stats
import kvgraft.graft.layerwise as lw
import kvgraft.graft.mla as mla
import kvgraft.graft.mla_math as mla_math
import kvgraft.graft.resume as resume
import kvgraft.hf.load as hf_load
import kvgraft.hf.shards as shards
import kvgraft.model.mla as model_mla
import kvgraft.model.transformer as model_tf
from kvgraft.atomic import atomic_write_json
from kvgraft.graft.convert import execute
from kvgraft.graft.options import ConvertOptions
from kvgraft.graft.plan import plan_conversion
from kvgraft.hf.load import load_config


class Profile:
    """Seconds by (layer, step); ``layer`` is the block being read last ("pre" before the first)."""

    def __init__(self) -> None:
        self.layer: int | str = "pre"
        self.stack: list[str] = []
        self.seconds: dict[Any, dict[str, float]] = defaultdict(lambda: defaultdict(float))
        self.layer_start: dict[Any, float] = {}

    def wrap(self, owner: Any, name: str, step: str, nested: bool = False) -> None:
        """Time ``owner.name`` as ``step`` (``nested``: as ``outer/step`` inside another timed step, e.g. the
        attention inside propagation; not timed when nothing is outside it)."""
        fn = getattr(owner, name)

        @functools.wraps(fn)
        def timed(*args: Any, **kwargs: Any) -> Any:
            if nested and not self.stack:
                return fn(*args, **kwargs)
            key = f"{self.stack[-1].split('/')[0]}/{step}" if nested else step
            self.stack.append(key)
            t0 = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                self.seconds[self.layer][key] += time.perf_counter() - t0
                self.stack.pop()

        setattr(owner, name, timed)

    def wrap_block_read(self) -> None:
        fn = lw.SourceLayers.block

        def block(src: Any, layer: int) -> Any:
            if not self.stack:  # the walk's own read (not the shared layout's first pass)
                self.layer = layer
                self.layer_start.setdefault(layer, time.perf_counter())
            t0 = time.perf_counter()
            out = fn(src, layer)
            self.seconds[self.layer]["read"] += time.perf_counter() - t0
            return out

        lw.SourceLayers.block = block  # type: ignore[method-assign]


def install() -> None:
    """Wrap every timed step once; the wrappers record into the current ``PROFILE[0]``."""
    p = Proxy()
    p.wrap_block_read()
    p.wrap(layer_stats, "second_moment", "statistics: second moment")
    p.wrap(layer_stats, "distance_profile", "statistics: distance profile")
    p.wrap(layer_stats, "linearised", "statistics: q/k norm fit")
    p.wrap(mla, "convert_layer", "factorisation")
    p.wrap(mla_math, "head_rotations", "head rotations", nested=True)
    p.wrap(mla_math, "pair_scores", "pair scores", nested=True)
    p.wrap(mla_math, "_sqrtm_psd", "metric square roots", nested=True)
    p.wrap(layer_stats, "run_block", "propagation")  # LayerGraft.advance calls it through the module
    p.wrap(lw, "run_block", "tail")  # the layer-by-layer executor's own binding: the calibration tail
    p.wrap(model_mla.MLAttention, "forward", "attention", nested=True)
    p.wrap(model_tf.GQAttention, "forward", "attention", nested=True)
    p.wrap(model_tf.MLP, "forward", "MLP", nested=True)
    p.wrap(shards.ShardWriter, "_flush", "write")
    p.wrap(resume.Checkpoint, "write", "checkpoint")
    p.wrap(lw.TailFigures, "add", "tail: head and figures")


class Proxy:
    """``Profile``'s wrappers bound to whichever profile is current (one per run)."""

    def wrap(self, *args: Any, **kwargs: Any) -> None:
        Profile.wrap(_Current(), *args, **kwargs)  # type: ignore[arg-type]

    def wrap_block_read(self) -> None:
        Profile.wrap_block_read(_Current())  # type: ignore[arg-type]


class _Current:
    """Attribute access forwarded to ``PROFILE[0]`` at call time."""

    def __getattr__(self, name: str) -> Any:
        return getattr(PROFILE[0], name)

    def __setattr__(self, name: str, value: Any) -> None:
        setattr(PROFILE[0], name, value)


VARIANTS = ("current", "before")


def set_variant(variant: str) -> None:
    """ "current": the code as it is; "before": this issue's speed-ups undone (the calibration tail run again
    for both stacks, the stream all in batches, the source's finiteness check by ``torch.isfinite``)."""
    current = variant == "current"
    lw.REUSE_TAIL = current
    mla.TAIL_ROWS = 8 if current else 0
    hf_load.all_finite = ALL_FINITE if current else (lambda t: bool(torch.isfinite(t).all()))


def run_once(args: argparse.Namespace, config: Any, variant: str) -> dict[str, Any]:
    set_variant(variant)
    profile = PROFILE[0] = Profile()
    with tempfile.TemporaryDirectory(dir=args.out.parent if args.out else None) as tmp:
        calib = Path(tmp) / "calibration.npy"
        np.save(calib, np.random.default_rng(0).integers(0, config.vocab_size, args.calibration_tokens))
        out = args.out or Path(tmp) / "out"
        t0 = time.perf_counter()
        plan = plan_conversion(
            args.checkpoint,
            out,
            ConvertOptions(
                calibration=calib,
                calibration_tokens=args.calibration_tokens,
                calibration_seq_len=args.seq_len,
                progress=False,
                overwrite=True,
            ),
        )
        record = execute(plan).to_dict()
        wall = time.perf_counter() - t0
    layers = [k for k in profile.seconds if isinstance(k, int)]
    starts = [profile.layer_start[k] for k in layers] + [t0 + wall]
    table = {}
    for i, layer in enumerate(layers):
        row = dict(profile.seconds[layer])
        row["layer (wall)"] = starts[i + 1] - starts[i]  # the last: up to the end (head, figures, writing)
        table[str(layer)] = row
    steps = sorted({s for row in table.values() for s in row}, key=lambda s: (s != "layer (wall)", s))
    print(
        f"[{variant}] {args.checkpoint} ({config.num_layers} layers, hidden {config.hidden_size}), "
        f"{args.calibration_tokens} calibration tokens, {args.threads} thread(s): {wall:.1f} s in all; load "
        f"{record['seconds']['load']:.1f} s; load average {os.getloadavg()[0]:.1f}",
        flush=True,
    )
    print("| step | " + " | ".join(f"layer {k}" for k in table) + " |")
    print("|---|" + "---|" * len(table))
    for s in steps:
        print(f"| {s} | " + " | ".join(f"{table[k].get(s, 0.0):.2f}" for k in table) + " |", flush=True)
    return {
        "variant": variant,
        "wall_seconds": wall,
        "record_seconds": record["seconds"],
        "calibration_tail": record["calibration_tail"],
        "before_first_layer": dict(profile.seconds["pre"]),
        "layers": table,
        "load_average": os.getloadavg(),
    }


PROFILE: list[Profile] = []
ALL_FINITE = hf_load.all_finite


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("checkpoint", type=Path)
    ap.add_argument("--calibration-tokens", type=int, default=4096)
    ap.add_argument("--seq-len", type=int, default=512)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument(
        "--variants", nargs="+", default=["current"], choices=VARIANTS, help="run each in turn (e.g. current before current)"
    )
    ap.add_argument("--json", type=Path, default=None)
    ap.add_argument("--out", type=Path, default=None, help="where the converted model goes (default: a temporary directory)")
    args = ap.parse_args(argv)
    for name in ("calibration_tokens", "seq_len", "threads"):
        if getattr(args, name) < 1:
            ap.error(f"--{name.replace('_', '-')} ({getattr(args, name)}) must be a positive integer")
    torch.set_num_threads(args.threads)
    config = load_config(args.checkpoint)
    PROFILE.append(Profile())
    install()
    runs = [run_once(args, config, v) for v in args.variants]
    walls: dict[str, list[float]] = defaultdict(list)
    for r in runs:
        walls[r["variant"]].append(r["wall_seconds"])
    if len(walls) == 2:
        best = {v: min(w) for v, w in walls.items()}
        print(
            f"before / current (best of each): {best['before']:.1f} s / {best['current']:.1f} s = {best['before'] / best['current']:.2f}x"
        )
        tails = {json.dumps(r["calibration_tail"], sort_keys=True) for r in runs}
        print(f"calibration-tail figures identical across runs: {len(tails) == 1}")
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    print(f"peak RSS of this process (all runs): {peak / 2**30:.2f} GiB")
    if args.json:
        atomic_write_json(
            args.json,
            {
                "checkpoint": str(args.checkpoint),
                "num_layers": config.num_layers,
                "hidden_size": config.hidden_size,
                "calibration_tokens": args.calibration_tokens,
                "seq_len": args.seq_len,
                "threads": args.threads,
                "runs": runs,
                "peak_rss_bytes": peak,
            },
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
