"""A step's attention in one kernel call over block tables against the group-by-group kernels it replaced.

    .venv/bin/python bench/paged_attention.py                    # SmolLM2's shapes: 30 layers, 9 heads, 3 key heads of 64
    .venv/bin/python bench/paged_attention.py --threads 1 --chunks 0

One engine step on SmolLM2's shapes, every layer once (its own pool, so the keys come from memory as a real step's
do): ``--rows`` decode rows at home (lengths uniform in [context/2, context]) and ``--chunks`` prompt chunks of
``--chunk`` tokens after ``--cached`` tokens, each in consecutive blocks. ``groups``: what the engine ran before,
one call a group: the decode kernel over the rows' home view with their mask, then the prefill kernel for each
chunk over its run of blocks with its causal mask (``cpu_kernels.decode_attention`` / ``prefill_attention``);
``one call``: ``cpu_kernels.paged_attention`` over every row through its block table. The mask building and
slicing are timed with the group calls (as the engine paid them); outputs are checked equal. Fastest of
``--repeats`` alternating rounds, and the ratio.
"""

from __future__ import annotations

import argparse
import time

import torch

from kvgraft.model import cpu_kernels


def positive(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"expected an integer >= 1, got {text}")
    return value


def at_least_zero(text: str) -> int:
    value = int(text)
    if value < 0:
        raise argparse.ArgumentTypeError(f"expected an integer >= 0, got {text}")
    return value


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--layers", type=positive, default=30)
    p.add_argument("--rows", type=positive, default=32, help="decode rows")
    p.add_argument("--context", type=positive, default=448, help="the longest decode row's keys")
    p.add_argument("--chunks", type=at_least_zero, default=3, help="prompt chunks beside the decode rows")
    p.add_argument("--chunk", type=positive, default=128, help="tokens of a chunk")
    p.add_argument("--cached", type=at_least_zero, default=128, help="tokens a chunk's row already holds")
    p.add_argument("--heads", type=positive, default=9)
    p.add_argument("--kv-heads", type=positive, default=3)
    p.add_argument("--head-dim", type=positive, default=64)
    p.add_argument("--threads", type=positive, default=2)
    p.add_argument("--repeats", type=positive, default=7)
    args = p.parse_args()
    if args.heads % args.kv_heads:
        p.error(f"--heads ({args.heads}) must be a multiple of --kv-heads ({args.kv_heads})")
    mod = cpu_kernels.kernel()
    if mod is None or not mod.paged_vectorized(args.head_dim):
        p.error(f"kvgraft's CPU kernels have no vector path for head width {args.head_dim} here (AVX-512, 32/64/128)")
    torch.set_num_threads(args.threads)
    H, K, d, bs = args.heads, args.kv_heads, args.head_dim, 16
    g = torch.Generator().manual_seed(0)
    home = -(-max(args.context, args.cached + args.chunk) // bs)  # blocks of a slot's home run
    n_slots = args.rows + args.chunks
    lengths = torch.randint(args.context // 2, args.context + 1, (args.rows,), generator=g)  # after the step
    pools = [torch.randn(2 * K, n_slots * home, bs, d, generator=g) for _ in range(args.layers)]
    # the step: decode rows first (row r at slot r), then the chunks (slot rows + c), packed on one token axis
    tokens = [1] * args.rows + [args.chunk] * args.chunks
    starts = (lengths - 1).tolist() + [args.cached] * args.chunks
    offsets = [sum(tokens[:i]) for i in range(len(tokens))]
    N = sum(tokens)
    rows = torch.tensor([[o, t, s] for o, t, s in zip(offsets, tokens, starts)])
    tables = torch.stack([torch.arange(home) + i * home for i in range(n_slots)])
    qkv = torch.randn(N, (H + 2 * K) * d, generator=g)
    q = qkv[:, : H * d].view(N, H, d)  # token-major, as the q/k/v matmul leaves it
    scale = d**-0.5
    no_index = torch.empty(0, dtype=torch.long)

    def groups(pool: torch.Tensor) -> torch.Tensor:
        out = torch.empty(N, H, d)
        view = pool.view(2 * K, n_slots, home * bs, d)
        S = int(lengths.max())
        qd = q[: args.rows].view(args.rows, 1, H, d).transpose(1, 2)  # (G, H, 1, d)
        mask = (torch.arange(S)[None] < lengths[:, None])[:, None]  # (G, 1, S)
        hv = view[:, : args.rows, :S]
        out[: args.rows] = mod.decode_attention(qd, hv[:K], hv[K:], mask, no_index, scale).transpose(1, 2)[:, 0]
        for c in range(args.chunks):
            o, end = offsets[args.rows + c], args.cached + args.chunk
            qc = q[o : o + args.chunk].transpose(0, 1)[None]  # (1, H, T, d)
            run = view[:, args.rows + c : args.rows + c + 1, :end]
            qpos = torch.arange(args.cached, end)[:, None]
            cmask = (torch.arange(end)[None] <= qpos)[None]  # (1, T, end)
            y = mod.prefill_attention(qc, run[:K], run[K:], cmask, no_index, scale)  # (1, H, T, d)
            out[o : o + args.chunk] = y[0].transpose(0, 1)
        return out

    def one_call(pool: torch.Tensor) -> torch.Tensor:
        return mod.paged_attention(q, pool, tables, rows, 0, scale)

    torch.testing.assert_close(one_call(pools[0]), groups(pools[0]), atol=2e-6, rtol=1e-5)
    best = {"groups": float("inf"), "one call": float("inf")}
    for r in range(args.repeats):
        for name in ("groups", "one call") if r % 2 == 0 else ("one call", "groups"):
            fn = groups if name == "groups" else one_call
            t = time.perf_counter()
            for pool in pools:
                fn(pool)
            best[name] = min(best[name], time.perf_counter() - t)
    print(
        f"{args.layers} layers, {args.rows} decode rows of {args.context // 2}-{args.context} keys, "
        f"{args.chunks} chunks of {args.chunk} after {args.cached}; H {H}, K {K}, d {d}; {args.threads} threads; "
        f"fastest of {args.repeats}"
    )
    for name, t in best.items():
        print(f"  {name:9s} {t * 1e3:8.2f} ms a step")
    print(f"  one call / groups: {best['groups'] / best['one call']:.2f}x faster")


if __name__ == "__main__":
    main()
