"""The CPU prefill-attention kernel against torch's SDPA, on the prompt chunks of one engine step.

    .venv/bin/python bench/prefill_kernel.py                    # SmolLM2's shapes: 30 layers, 9 query / 3 key heads of 64
    .venv/bin/python bench/prefill_kernel.py --chunks 400:0 250:200 --threads 1

One engine step's prompt chunks (``--chunks NEW:CACHED ...``: a chunk of NEW tokens after CACHED tokens
already in the cache; default: the chunks of a 512-token step of bench/peers.py's workload), each against
its row's keys and values as kvgraft's paged cache stores them (head-major (2K, 1, S, d) views of one pool
per layer). Timed per step (every layer and chunk once), the fastest of ``--repeats``: ``sdpa``
(``F.scaled_dot_product_attention`` with the chunk's causal mask and ``enable_gqa``, what the engine ran
before) and ``kernel`` (``kvgraft.model.cpu_kernels.prefill_attention``). GFLOPS counts the multiply-adds of
the visible query-key pairs (QK and PV, 4 d flops a pair). Prints a markdown table.
"""

from __future__ import annotations

import argparse
import time

import torch
import torch.nn.functional as F

from kvgraft.model import cpu_kernels


def positive(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"expected an integer >= 1, got {text}")
    return value


def chunk(text: str) -> tuple[int, int]:
    new, _, cached = text.partition(":")
    try:
        pair = int(new), int(cached or 0)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected NEW:CACHED token counts, got {text!r}") from None
    if pair[0] < 1 or pair[1] < 0:
        raise argparse.ArgumentTypeError(f"expected NEW >= 1 and CACHED >= 0, got {text!r}")
    return pair


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--chunks", type=chunk, nargs="+", default=[(170, 0), (203, 0), (139, 261)])
    p.add_argument("--layers", type=positive, default=30)
    p.add_argument("--heads", type=positive, default=9)
    p.add_argument("--kv-heads", type=positive, default=3)
    p.add_argument("--head-dim", type=positive, default=64)
    p.add_argument("--threads", type=positive, default=2)
    p.add_argument("--repeats", type=positive, default=5)
    args = p.parse_args()
    if args.heads % args.kv_heads:
        p.error(f"--kv-heads ({args.kv_heads}) must divide --heads ({args.heads})")
    torch.set_num_threads(args.threads)
    if cpu_kernels.kernel() is None:
        raise SystemExit(f"the kernel is not available ({cpu_kernels.ENV}={cpu_kernels.mode()}, or it could not be built)")
    K, H, d = args.kv_heads, args.heads, args.head_dim
    g = torch.Generator().manual_seed(0)
    work = []  # per layer and chunk: q, key view, value view, mask
    flops = 0.0
    for new, cached in args.chunks:
        S = cached + new
        pos = torch.arange(S)
        mask = (pos[None, :] <= (cached + torch.arange(new))[:, None])[None]  # (1, new, S)
        flops += args.layers * 4 * d * H * float(mask.sum())
        for _ in range(args.layers):
            pool = torch.randn(2 * K, 1, S + 7, d, generator=g)  # a row's slot, longer than its keys
            work.append((torch.randn(1, H, new, d, generator=g), pool[:K, :, :S], pool[K:, :, :S], mask))
    scale = d**-0.5

    def sdpa() -> None:
        for q, k, v, m in work:
            F.scaled_dot_product_attention(q, k.transpose(0, 1), v.transpose(0, 1), attn_mask=m[:, None], enable_gqa=K != H)

    def kernel() -> None:
        for q, k, v, m in work:
            cpu_kernels.prefill_attention(q, k, v, m, None, scale)

    q, k, v, m = work[-1]
    want = F.scaled_dot_product_attention(q, k.transpose(0, 1), v.transpose(0, 1), attn_mask=m[:, None], enable_gqa=K != H)
    got = cpu_kernels.prefill_attention(q, k, v, m, None, scale)
    if got is None:
        raise SystemExit("the kernel does not apply to these shapes (head width 32, 64 or 128 on an AVX-512 build)")
    diff = float((want - got).abs().max())
    chunks = ", ".join(f"{n} new after {c}" for n, c in args.chunks)
    print(
        f"{args.layers} layers, chunks: {chunks}; {H} query / {K} key heads of {d}, {args.threads} threads; max |diff| {diff:.2e}\n"
    )
    print("| attention | ms a step | GFLOPS | vs sdpa |")
    print("|---|---|---|---|")
    best: dict[str, float] = {}
    for name, fn in (("sdpa", sdpa), ("kernel", kernel)):
        fn()
        times = []
        for _ in range(args.repeats):
            t0 = time.perf_counter()
            fn()
            times.append(time.perf_counter() - t0)
        best[name] = min(times)
        print(f"| {name} | {best[name] * 1e3:.1f} | {flops / best[name] / 1e9:.0f} | {best['sdpa'] / best[name]:.2f}x |")


if __name__ == "__main__":
    main()
