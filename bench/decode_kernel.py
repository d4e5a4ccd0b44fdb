"""The CPU decode-attention kernel against torch's batched matmuls, on one decode step's reads.

    .venv/bin/python bench/decode_kernel.py                      # SmolLM2's shapes: 30 layers, 3 key heads of 64
    .venv/bin/python bench/decode_kernel.py --layers 8 --kv-heads 4 --heads 8 --head-dim 32 --context 400

One decode step of ``--rows`` rows at home: per layer a pool of (2K, rows, slot, d) floats (keys then values,
head-major, as kvgraft's paged cache stores them; each row's slot ``--slot`` positions long, so rows are strided
views), row lengths uniform in [context/2, context]. Timed per step (every layer once), the fastest of
``--repeats``: ``matmuls`` (``attention_ops.grouped_attention_strided``, the torch path: every row padded to the
longest), ``kernel`` (``kvgraft.model.cpu_kernels.decode_attention``: each row to its own length), and ``sum``
(the same views summed: the machine's read bandwidth over these bytes, a floor for any kernel). GB/s counts
the key and value bytes each read touches (the kernel: those the rows need; the others: padded). The pools (hundreds of MB) exceed the caches, as a real step's do.
"""

from __future__ import annotations

import argparse
import time

import torch

from kvgraft.model import cpu_kernels
from kvgraft.model.attention_ops import grouped_attention_strided


def positive(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"expected an integer >= 1, got {text}")
    return value


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--layers", type=positive, default=30)
    p.add_argument("--rows", type=positive, default=32)
    p.add_argument("--heads", type=positive, default=9)
    p.add_argument("--kv-heads", type=positive, default=3)
    p.add_argument("--head-dim", type=positive, default=64)
    p.add_argument("--context", type=positive, default=340)
    p.add_argument("--slot", type=positive, default=1024, help="positions a row's slot holds (its stride)")
    p.add_argument("--threads", type=positive, default=2)
    p.add_argument("--repeats", type=positive, default=5)
    args = p.parse_args()
    if args.heads % args.kv_heads:
        p.error(f"--kv-heads ({args.kv_heads}) must divide --heads ({args.heads})")
    if args.context > args.slot:
        p.error(f"--context ({args.context}) must be at most --slot ({args.slot})")
    torch.set_num_threads(args.threads)
    if cpu_kernels.kernel() is None:
        raise SystemExit(f"the kernel is not available ({cpu_kernels.ENV}={cpu_kernels.mode()}, or it could not be built)")
    K, G, S, d = args.kv_heads, args.rows, args.context, args.head_dim
    g = torch.Generator().manual_seed(0)
    pools = [torch.randn(2 * K, G, args.slot, d, generator=g) for _ in range(args.layers)]
    q = torch.randn(G, args.heads, 1, d, generator=g)
    lengths = torch.randint(S // 2, S + 1, (G,), generator=g)
    lengths[0] = S
    mask = (torch.arange(S)[None, None] < lengths[:, None, None]).expand(G, 1, S)
    scale = d**-0.5
    views = [pool[:, :, :S] for pool in pools]
    y0 = grouped_attention_strided(q, views[0][:K], views[0][K:], mask, scale)
    y1 = cpu_kernels.decode_attention(q, views[0][:K], views[0][K:], mask, None, scale)
    assert y1 is not None, "the kernel does not apply to these shapes"
    diff = float((y0 - y1).abs().max())

    def matmuls() -> None:
        for v in views:
            grouped_attention_strided(q, v[:K], v[K:], mask, scale)

    def kernel() -> None:
        for v in views:
            cpu_kernels.decode_attention(q, v[:K], v[K:], mask, None, scale)

    def sums() -> None:
        for v in views:
            v.sum()

    needed = args.layers * 2 * K * int(lengths.sum()) * d * 4 / 1e9
    print(
        f"{args.layers} layers, {G} rows of {S // 2}-{S} keys, {args.heads} query / {K} key heads of {d}, "
        f"{args.threads} threads; kernel vs matmuls max |diff| {diff:.2e}; needed bytes {needed:.3f} GB a step\n"
    )
    padded = args.layers * 2 * K * G * S * d * 4 / 1e9
    print("| read | ms a step | GB read | GB/s | vs matmuls |")
    print("|---|---|---|---|---|")
    best: dict[str, float] = {}
    for name, fn, gb in (
        ("matmuls (padded)", matmuls, padded),
        ("kernel", kernel, needed),
        ("sum of the padded views", sums, padded),
    ):
        fn()
        times = []
        for _ in range(args.repeats):
            t0 = time.perf_counter()
            fn()
            times.append(time.perf_counter() - t0)
        best[name] = min(times)
        ratio = best["matmuls (padded)"] / best[name]
        print(f"| {name} | {best[name] * 1e3:.1f} | {gb:.3f} | {gb / best[name]:.1f} | {ratio:.2f}x |")


if __name__ == "__main__":
    main()
