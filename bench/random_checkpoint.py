"""Write a random Llama-family checkpoint of a real model's shape, tensor by tensor, in bounded memory.

For the conversion-at-scale measurements (issue "Conversion at the scale users have"): an 8B-shape bf16
checkpoint is 16 GB on disk, more than a 24 GB machine can build as one state dict next to anything else.
Each tensor is drawn (N(0, 0.02), a per-tensor seed from its name, so the file is the same on every
machine) and handed to ``kvgraft.hf.shards.ShardWriter``, which holds at most one shard in memory; the
directory appears atomically when complete. The config.json is transformers' (written by kvgraft's
``hf_config_from_model``), so ``AutoModelForCausalLM`` and ``kvgraft convert`` read it as a real checkpoint.

    python bench/random_checkpoint.py --shape llama-1b --out runs/ckpt/llama-1b
    python bench/random_checkpoint.py --shape llama-8b --out runs/ckpt/llama-8b --max-shard-gb 2

Prints the peak resident memory (``resource.getrusage``) next to the bytes written.
"""

from __future__ import annotations

import argparse
import hashlib
import resource
import sys
import time
from pathlib import Path

import torch

from kvgraft.atomic import atomic_dir, atomic_write_json
from kvgraft.hf.config_map import hf_config_from_model
from kvgraft.hf.shards import ShardWriter
from kvgraft.model.config import ModelConfig
from kvgraft.model.shapes import parameter_shapes

# The shapes of public checkpoints (their config.json values), with the default RoPE and no tokenizer.
SHAPES = {
    # hidden 1024, 16 heads, 4 KV heads, vocabulary 8,192: the shapes whose conversion memory the issue measured
    "llama-mid-4l": dict(
        vocab_size=8192,
        hidden_size=1024,
        num_layers=4,
        num_heads=16,
        num_kv_heads=4,
        intermediate_size=2816,
        max_position_embeddings=4096,
    ),
    "llama-mid-16l": dict(
        vocab_size=8192,
        hidden_size=1024,
        num_layers=16,
        num_heads=16,
        num_kv_heads=4,
        intermediate_size=2816,
        max_position_embeddings=4096,
    ),
    # Llama-3.2-1B
    "llama-1b": dict(
        vocab_size=128256,
        hidden_size=2048,
        num_layers=16,
        num_heads=32,
        num_kv_heads=8,
        intermediate_size=8192,
        max_position_embeddings=8192,
        tie_word_embeddings=True,
        rms_norm_eps=1e-5,
    ),
    # Llama-3.1-8B
    "llama-8b": dict(
        vocab_size=128256,
        hidden_size=4096,
        num_layers=32,
        num_heads=32,
        num_kv_heads=8,
        intermediate_size=14336,
        max_position_embeddings=8192,
        rms_norm_eps=1e-5,
    ),
}


def _seed(name: str) -> int:
    return int.from_bytes(hashlib.sha256(name.encode()).digest()[:8], "little") & (2**63 - 1)


def random_tensor(name: str, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    """N(0, 0.02) for matrices, ones for norm weights: the same values for the same name on any machine."""
    if len(shape) == 1:
        return torch.ones(shape, dtype=dtype)
    g = torch.Generator().manual_seed(_seed(name))
    return (torch.randn(shape, generator=g, dtype=torch.float32) * 0.02).to(dtype)


def write_random_checkpoint(
    config: ModelConfig, out: Path, dtype: torch.dtype = torch.bfloat16, max_shard_bytes: int = 2 * 2**30, overwrite: bool = False
) -> dict[str, object]:
    """Write ``config``'s checkpoint to ``out`` one tensor at a time; returns bytes, shards and seconds."""
    shapes = parameter_shapes(config)
    hf_config = hf_config_from_model(config, "llama", dtype=str(dtype).removeprefix("torch."))
    t0 = time.perf_counter()
    with atomic_dir(out, overwrite=overwrite) as tmp:
        atomic_write_json(tmp / "config.json", hf_config)
        atomic_write_json(
            tmp / "generation_config.json", {"bos_token_id": config.bos_token_id, "eos_token_id": config.eos_token_id}
        )
        writer = ShardWriter(tmp, max_shard_bytes=max_shard_bytes)
        for key, shape in shapes.items():
            if key == "lm_head.weight" and config.tie_word_embeddings:
                continue
            hf_name = key if key == "lm_head.weight" else "model." + key
            writer.add(hf_name, random_tensor(hf_name, tuple(shape), dtype))
        weight_map = writer.close()
    return {
        "bytes": writer.total_bytes,
        "shards": len(set(weight_map.values())),
        "peak_pending_bytes": writer.peak_pending_bytes,
        "seconds": time.perf_counter() - t0,
    }


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--shape", required=True, choices=sorted(SHAPES))
    p.add_argument("--out", required=True, type=Path)
    p.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16", "float32"])
    p.add_argument("--max-shard-gb", type=float, default=2.0)
    p.add_argument("--overwrite", action="store_true")
    p.add_argument(
        "--num-layers",
        type=int,
        default=None,
        help="fewer (or more) layers than the shape's (per-layer profiles on a few layers)",
    )
    args = p.parse_args(argv)
    if not args.max_shard_gb > 0:
        p.error(f"--max-shard-gb ({args.max_shard_gb}) must be > 0")
    if args.num_layers is not None and args.num_layers < 1:
        p.error(f"--num-layers ({args.num_layers}) must be a positive integer")
    config = ModelConfig(**(SHAPES[args.shape] | ({} if args.num_layers is None else {"num_layers": args.num_layers})))
    result = write_random_checkpoint(config, args.out, getattr(torch, args.dtype), int(args.max_shard_gb * 2**30), args.overwrite)
    peak_rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    print(
        f"{args.shape}: {sum(int(torch.Size(s).numel()) for s in parameter_shapes(config).values()):,} parameters, "
        f"{result['bytes'] / 2**30:.2f} GiB in {result['shards']} shard(s) at {args.out}, "
        f"{result['seconds']:.0f} s, peak RSS {peak_rss / 2**30:.2f} GiB"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
