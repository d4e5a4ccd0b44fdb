"""A decoder layer's work around its matmuls and attention, kvgraft's one-pass kernels against torch's ops.

    .venv/bin/python bench/layer_glue.py                       # SmolLM2's shapes, 32 and 512 tokens, 2 threads
    .venv/bin/python bench/layer_glue.py --threads 1 --tokens 32

Three pieces of an engine step per layer, each timed both ways on the same inputs (the fastest of ``--repeats``
rounds; the ways alternate within a round), at ``--tokens`` tokens a step (32: a decode step of 32 rows; 512: a
mixed step):

- ``mlp``: SwiGLU on packed weights (``kvgraft.model.packed``): one gate/up matmul, then torch's in-place
  ``silu_`` and ``mul_`` on its strided halves and ``down_proj`` (which first copies its strided operand), against
  the same matmuls with ``cpu_kernels.silu_mul`` (one pass, contiguous output). Outputs asserted equal bit for bit
  on AVX-512 builds (torch's formula and vector exponential), to rounding elsewhere;
- ``rope + entries``: RoPE on queries and keys out of place (``cpu_kernels.rope``, twice) and the keys and values
  concatenated into the step's new entries, against ``cpu_kernels.rope_`` on the q/k/v matmul's output in place,
  the entries a view of it;
- ``kv write``: the new entries written into a (2K, rows, d) pool by ``index_copy_`` against
  ``cpu_kernels.index_copy_rows_``.

Prints one markdown table (microseconds per layer and the ratio torch / kernel).
"""

from __future__ import annotations

import argparse
import time
from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn

from kvgraft.model import cpu_kernels
from kvgraft.model.packed import adjacent, linears, pack_linears


def positive(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"expected an integer >= 1, got {text}")
    return value


def best_of(fns: dict[str, Callable[[], object]], repeats: int, calls: int) -> dict[str, float]:
    """Microseconds per call of each function, the fastest of ``repeats`` rounds of ``calls`` calls."""
    best = dict.fromkeys(fns, float("inf"))
    for _ in range(repeats):
        for name, fn in fns.items():
            fn()
            t0 = time.perf_counter()
            for _ in range(calls):
                fn()
            best[name] = min(best[name], (time.perf_counter() - t0) / calls * 1e6)
    return best


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--tokens", type=positive, nargs="+", default=[32, 512])
    p.add_argument("--hidden", type=positive, default=576)
    p.add_argument("--intermediate", type=positive, default=1536)
    p.add_argument("--heads", type=positive, default=9)
    p.add_argument("--kv-heads", type=positive, default=3)
    p.add_argument("--head-dim", type=positive, default=64)
    p.add_argument("--pool-rows", type=positive, default=32768, help="rows of the KV pool written into")
    p.add_argument("--threads", type=positive, default=2)
    p.add_argument("--repeats", type=positive, default=5)
    args = p.parse_args()
    if args.heads % args.kv_heads:
        p.error(f"--kv-heads ({args.kv_heads}) must divide --heads ({args.heads})")
    if max(args.tokens) > args.pool_rows:
        p.error(f"--pool-rows ({args.pool_rows}) must be at least the largest --tokens ({max(args.tokens)})")
    torch.set_num_threads(args.threads)
    torch.set_grad_enabled(False)
    if cpu_kernels.kernel() is None:
        raise SystemExit(f"the kernels are not available ({cpu_kernels.ENV}={cpu_kernels.mode()}, or they could not be built)")
    h, f, H, K, d = args.hidden, args.intermediate, args.heads, args.kv_heads, args.head_dim
    gen = torch.Generator().manual_seed(0)
    gate, up, down = nn.Linear(h, f, bias=False), nn.Linear(h, f, bias=False), nn.Linear(f, h, bias=False)
    qkv_proj = nn.Linear(h, (H + 2 * K) * d, bias=False)
    pack_linears(nn.ModuleList([gate, up, down, qkv_proj]))
    bit_exact = torch.backends.cpu.get_cpu_capability() == "AVX512"

    def mlp_torch(x: torch.Tensor) -> torch.Tensor:
        a, b = linears(x, gate, up)
        return down(F.silu(a, inplace=True).mul_(b))

    def mlp_kernel(x: torch.Tensor) -> torch.Tensor:
        a, b = linears(x, gate, up)
        y = cpu_kernels.silu_mul(adjacent(a, b))  # type: ignore[arg-type]
        return down(y)

    rows = []
    for n in args.tokens:
        x = torch.randn(1, n, h, generator=gen)
        want, got = mlp_torch(x), mlp_kernel(x)
        if bit_exact:
            assert torch.equal(want, got), "silu_mul differs from torch's silu * up"
        else:
            torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
        calls = max(4, 20_000 // n)
        t = best_of({"torch": lambda x=x: mlp_torch(x), "kernel": lambda x=x: mlp_kernel(x)}, args.repeats, calls)
        rows.append(("mlp", n, t))

        qkv = qkv_proj(x)  # (1, n, (H + 2K) d)
        angles = torch.rand(1, n, d // 2, generator=gen) * 6.3
        cos, sin = torch.cat([angles.cos()] * 2, -1), torch.cat([angles.sin()] * 2, -1)  # rotations: repeated calls stay finite
        work = qkv.clone()

        def rope_torch(qkv: torch.Tensor = qkv, n: int = n, cos: torch.Tensor = cos, sin: torch.Tensor = sin) -> torch.Tensor:
            q, k, v = qkv.split([H * d, K * d, K * d], dim=-1)
            cpu_kernels.rope(q.view(1, n, H, d).transpose(1, 2), cos, sin)
            k = cpu_kernels.rope(k.view(1, n, K, d).transpose(1, 2), cos, sin).transpose(1, 2)  # type: ignore[union-attr]
            return torch.cat([k.reshape(1, n, K * d), v], dim=-1)

        def rope_kernel(n: int = n, work: torch.Tensor = work, cos: torch.Tensor = cos, sin: torch.Tensor = sin) -> torch.Tensor:
            qk = work[..., : (H + K) * d].view(1, n, H + K, d).transpose(1, 2)
            cpu_kernels.rope_(qk, cos, sin)  # rotates the same buffer again each call: the same work
            return work[..., H * d :]

        t = best_of({"torch": rope_torch, "kernel": rope_kernel}, args.repeats, max(4, 20_000 // n))
        rows.append(("rope + entries", n, t))

        pool = torch.zeros(2 * K, args.pool_rows, d)
        index = torch.randperm(args.pool_rows, generator=gen)[:n]
        src = qkv[0, :, H * d :].reshape(n, 2 * K, d).transpose(0, 1)  # (2K, n, d), strided as the engine's
        t = best_of(
            {
                "torch": lambda pool=pool, index=index, src=src: pool.index_copy_(1, index, src),
                "kernel": lambda pool=pool, index=index, src=src: cpu_kernels.index_copy_rows_(pool, index, src),
            },
            args.repeats,
            max(4, 40_000 // n),
        )
        rows.append(("kv write", n, t))

    print(
        f"A layer's glue at SmolLM2's shapes (hidden {h}, intermediate {f}, {H} query / {K} key heads of {d}), {args.threads} threads"
    )
    print("\n| piece | tokens | torch's ops (us) | kvgraft kernel (us) | torch / kernel |\n|---|---|---|---|---|")
    for name, n, t in rows:
        print(f"| {name} | {n} | {t['torch']:.1f} | {t['kernel']:.1f} | {t['torch'] / t['kernel']:.2f}x |")


if __name__ == "__main__":
    main()
