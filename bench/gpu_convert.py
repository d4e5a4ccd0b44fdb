"""Convert a random checkpoint of a real model's shape and print time and peak memory: the device check of
issue 26 ("Conversion at the scale users have"), ready for a machine with a GPU.

    python bench/gpu_convert.py --shape llama-8b --device cuda --work runs/gpu-convert
    python bench/gpu_convert.py --shape llama-mid-4l --device cpu --calibration-tokens 2048   # a dry run here

Builds the checkpoint with ``bench/random_checkpoint.py`` (bf16, tensor by tensor) unless it is there, writes
random calibration ids, runs ``kvgraft.graft.convert.convert`` in this process (defaults: MLA at 4x, the
kvgraft format) and prints one JSON line: parameters, seconds (load, convert, per layer), the peak resident
memory of this process, and on CUDA the peak GPU memory allocated (``torch.cuda.max_memory_allocated``).
"""

from __future__ import annotations

import argparse
import json
import resource
import sys
import time
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

from random_checkpoint import SHAPES, write_random_checkpoint  # noqa: E402

from kvgraft.atomic import atomic_write_json  # noqa: E402
from kvgraft.graft.convert import convert  # noqa: E402
from kvgraft.graft.options import ConvertOptions
from kvgraft.model.config import ModelConfig  # noqa: E402


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--shape", default="llama-8b", choices=sorted(SHAPES))
    p.add_argument("--device", default="cuda", help="cuda or cpu")
    p.add_argument("--work", type=Path, default=Path("runs/gpu-convert"), help="checkpoint, calibration and output")
    p.add_argument("--calibration-tokens", type=int, default=32768)
    p.add_argument("--compression", type=float, default=4.0)
    args = p.parse_args(argv)
    if args.device.startswith("cuda") and not torch.cuda.is_available():
        p.error("--device cuda: no CUDA GPU here (use --device cpu for a dry run)")
    if args.calibration_tokens < 512:
        p.error(f"--calibration-tokens ({args.calibration_tokens}) must be >= 512 (one calibration sequence)")
    config = ModelConfig(**SHAPES[args.shape])
    source = args.work / f"{args.shape}-bf16"
    t0 = time.perf_counter()
    if not (source / "config.json").is_file():
        write_random_checkpoint(config, source)
    build_s = time.perf_counter() - t0
    calibration = args.work / f"calibration-{args.calibration_tokens}.npy"
    if not calibration.is_file():
        ids = np.random.default_rng(0).integers(0, config.vocab_size, args.calibration_tokens)
        np.save(calibration, ids.astype(np.int64))
    if args.device.startswith("cuda"):
        torch.cuda.reset_peak_memory_stats()
    record = convert(
        source,
        args.work / f"{args.shape}-mla",
        ConvertOptions(
            compression=args.compression,
            calibration=calibration,
            calibration_tokens=args.calibration_tokens,
            device=args.device,
            overwrite=True,
        ),
    ).to_dict()
    seconds = record["seconds"]
    result = {
        "shape": args.shape,
        "device": args.device,
        "gpu": torch.cuda.get_device_name() if args.device.startswith("cuda") else None,
        "parameters": record["parameters"]["original"],
        "layers": config.num_layers,
        "calibration_tokens": args.calibration_tokens,
        "checkpoint_build_s": round(build_s, 1),
        "load_s": round(seconds["load"], 1),
        "convert_s": round(seconds["convert"], 1),
        "convert_s_per_layer": round(seconds["convert"] / config.num_layers, 2),
        "peak_rss_gib": round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20, 2),
        "peak_gpu_gib": round(torch.cuda.max_memory_allocated() / 2**30, 2) if args.device.startswith("cuda") else None,
        "kv_bytes_per_token_bf16": record["kv_bytes_per_token_bf16"],
        "compression": record["compression"],
        "calibration_tail": record["calibration_tail"],
    }
    atomic_write_json(args.work / f"{args.shape}-{args.device}.json", result)
    print(json.dumps(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
