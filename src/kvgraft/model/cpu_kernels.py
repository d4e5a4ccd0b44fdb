"""kvgraft's compiled CPU kernels, for float32 inference: decode-step and prefill attention over paged keys and
values read in place (``decode_attention.cpp``, ``prefill_attention.cpp``), a whole step's rows over a paged pool
through their block tables (``paged_attention.cpp``), a causal encoder-decoder layer's decode rows over their window
rings and shared latents (``ced_attention.cpp``), a whole Llama-family decoder layer of a step in one call
(``decoder_layer.cpp``), and one-pass RMSNorm (a residual add with it), rotary embedding (also in place), SwiGLU's
silu * up, the KV rows' write and the rows' argmax (``elementwise.cpp``). Built on first use by torch's C++
extension loader into its cache (``TORCH_EXTENSIONS_DIR``). Each function returns None where its kernel cannot be
built (no C++ compiler) or does not apply (not float32 on the CPU, autograd, a head width without a vector path);
the caller then runs torch's ops.

``KVGRAFT_CPU_KERNELS`` chooses: ``auto`` (default: build on first use; if the build fails, one warning and
torch's ops), ``off`` (torch's ops only), ``require`` (a failed build raises)."""

from __future__ import annotations

import functools
import hashlib
import logging
import os
import time
from pathlib import Path
from typing import Any

import torch

from kvgraft.errors import ConfigError

ENV = "KVGRAFT_CPU_KERNELS"
MODES = ("auto", "off", "require")
SOURCES = tuple(
    Path(__file__).with_name(n)
    for n in (
        "decode_attention.cpp",
        "prefill_attention.cpp",
        "paged_attention.cpp",
        "ced_attention.cpp",
        "elementwise.cpp",
        "decoder_layer.cpp",
        "bindings.cpp",
    )
)
HEADERS = tuple(
    Path(__file__).with_name(n) for n in ("attention_args.h", "flash_blocks.h", "vec_blocks.h")
)  # included by the sources
log = logging.getLogger(__name__)

# Instruction sets the build targets, by torch's own reading of this CPU: named, not -march=native, so a
# cached build never runs on a CPU that lacks what it was compiled for (the flags are part of its name).
ISA_FLAGS = {
    "AVX512": ["-mavx512f", "-mavx512dq", "-mavx512bw", "-mavx512vl", "-mfma"],
    "AVX2": ["-mavx2", "-mfma"],
}


def mode() -> str:
    """The kernel mode from ``KVGRAFT_CPU_KERNELS`` (``auto`` when unset); any other value is refused."""
    value = os.environ.get(ENV, "auto")
    if value not in MODES:
        raise ConfigError(f"{ENV} ({value!r}) must be one of {', '.join(MODES)}")
    return value


def build_flags() -> list[str]:
    """The compiler flags of this machine's build: optimisation, OpenMP (at::parallel_for is OpenMP in the headers:
    without it a build runs on one thread), no contraction of a product and a sum into one rounding (rope is
    bit-identical to torch's ops) and the CPU's vector instruction set."""
    return ["-O3", "-fopenmp", "-ffp-contract=off", *ISA_FLAGS.get(torch.backends.cpu.get_cpu_capability(), [])]


# a build takes 1-5 minutes on 2 cores: a lock file this old was left by a build that was killed
STALE_LOCK_S = 20 * 60


def clear_stale_lock(build_dir: Path, now: float | None = None) -> bool:
    """Remove ``build_dir``'s ``lock`` if it is older than :data:`STALE_LOCK_S` (torch's loader waits on it forever:
    a build interrupted by Ctrl-C or a kill leaves it behind); True when one was removed."""
    lock = build_dir / "lock"
    try:
        age = (time.time() if now is None else now) - lock.stat().st_mtime
    except FileNotFoundError:
        return False
    if age <= STALE_LOCK_S:
        return False  # another process may be building right now
    log.warning("removing %s, left %.0f minutes ago by an interrupted build of kvgraft's CPU kernels", lock, age / 60)
    lock.unlink(missing_ok=True)
    return True


@functools.cache
def _module(required: bool) -> Any | None:
    from torch.utils.cpp_extension import load

    flags = build_flags()
    text = b"".join(p.read_bytes() for p in SOURCES + HEADERS) + " ".join([torch.__version__, *flags]).encode()
    name = f"kvgraft_cpu_kernels_{hashlib.sha256(text).hexdigest()[:12]}"
    log.info("loading kvgraft's CPU kernels %s (built once per machine, 1-5 minutes on 2 cores)", name)
    try:  # (torch's own helper for the folder it builds in; private, so a torch without it just skips the check)
        from torch.utils.cpp_extension import _get_build_directory

        clear_stale_lock(Path(_get_build_directory(name, False)))
    except (ImportError, OSError):
        pass
    try:
        return load(name=name, sources=[str(p) for p in SOURCES], extra_cflags=flags, verbose=False)
    except Exception as err:  # no compiler, no headers: torch's ops do the same work, slower
        if required:
            raise RuntimeError(f"{ENV}=require, but the kernels could not be built: {err}") from err
        log.warning("kvgraft's CPU kernels could not be built (%s); using torch's ops", err)
        return None


def kernel() -> Any | None:
    """The built kernels' module, or None (``off``, or the build failed under ``auto``)."""
    chosen = mode()
    return None if chosen == "off" else _module(chosen == "require")


_NO_INDEX = torch.empty(0, dtype=torch.long)
_NO_FLOAT = torch.empty(0)


def _inference_cpu_float(*tensors: torch.Tensor) -> bool:
    """Every tensor float32 on the CPU, and no gradient to track through them."""
    grad = torch.is_grad_enabled()
    for t in tensors:  # a loop, not any(): called a dozen times a layer on every engine step
        if t.dtype != torch.float32 or not t.is_cpu or (grad and t.requires_grad):
            return False
    return True


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor | None:
    """``weight * (x * rsqrt(mean(x^2, -1) + eps))`` in one pass (float32; the sum of squares accumulated in
    another order than torch's), or None where it does not apply."""
    if not _inference_cpu_float(x, weight):
        return None
    mod = kernel()
    if mod is None:
        return None
    y: torch.Tensor = mod.rms_norm(x, weight, eps)
    return y


def add_rms_norm(x: torch.Tensor, a: torch.Tensor, weight: torch.Tensor, eps: float) -> tuple[torch.Tensor, torch.Tensor] | None:
    """``(s, rms_norm(s))`` with ``s = x + a`` (a residual add and the next RMSNorm) in one pass, or None where
    it does not apply; ``s`` exactly torch's sum, the norm as :func:`rms_norm`'s."""
    if not _inference_cpu_float(x, a, weight) or x.shape != a.shape:
        return None
    mod = kernel()
    if mod is None:
        return None
    s, y = mod.add_rms_norm(x, a, weight, eps)
    return s, y


def rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor | None:
    """``kvgraft.model.rope.apply_rope`` (x (B, nh, T, d), cos/sin (B, T, d)) in one pass, bit-identical, or
    None where it does not apply."""
    if not _inference_cpu_float(x, cos, sin) or x.dim() != 4 or x.stride(-1) != 1 or x.shape[-1] % 2:
        return None
    mod = kernel()
    if mod is None:
        return None
    y: torch.Tensor = mod.rope(x, cos, sin)
    return y


def rope_(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> bool:
    """:func:`rope` in place (x rotated where it lies, any strides but the last); False where it does not apply
    (x untouched)."""
    if not _inference_cpu_float(x, cos, sin) or x.dim() != 4 or x.stride(-1) != 1 or x.shape[-1] % 2 or x.shape[-1] > 1024:
        return False
    mod = kernel()
    if mod is None:
        return False
    mod.rope_(x, cos, sin)
    return True


def silu_mul(gu: torch.Tensor) -> torch.Tensor | None:
    """``silu(gate) * up`` over ``gu = [gate | up]`` (one matmul's output, (..., 2 f)) in one pass, contiguous
    (..., f); torch's formula and vector exp (bit-identical on the AVX-512 path); None where it does not apply."""
    if not _inference_cpu_float(gu) or gu.dim() < 1 or gu.shape[-1] % 2 or gu.stride(-1) != 1:
        return None
    mod = kernel()
    if mod is None:
        return None
    y: torch.Tensor = mod.silu_mul(gu)
    return y


def index_copy_rows_(pool: torch.Tensor, index: torch.Tensor, src: torch.Tensor) -> None:
    """``pool.index_copy_(1, index, src)``: pool (P, R, d), index (n,) int64, src (P, n, d) (a step's new KV
    entries into the pools' rows); kvgraft's kernel where it applies (float32 CPU inference, unit-stride rows),
    else torch's op. Every index is checked as torch's op checks it."""
    if (
        _inference_cpu_float(pool, src)
        and pool.dim() == 3
        and pool.stride(-1) == 1
        and src.stride(-1) == 1
        and index.dtype == torch.long
        and index.is_cpu
    ):
        mod = kernel()
        if mod is not None:
            mod.index_copy_rows_(pool, index, src)
            return
    pool.index_copy_(1, index, src)


def paged_attention(
    q: torch.Tensor,  # (N, H, d): the step's queries, token-major, any strides but the last
    pool: torch.Tensor,  # (2K, blocks, block_size, d): a GQA layer's paged keys then values, contiguous
    tables: torch.Tensor,  # (rows, nb) int64 block ids of each row
    rows: torch.Tensor,  # (rows, 3) int64 per row: first token on the packed axis, new tokens T, keys before the step
    window: int | None,
    scale: float,
) -> torch.Tensor | None:
    """Every row of a step (decode tokens and prompt chunks of any lengths) attending its keys in ``pool`` through
    its block table, in one call: (N, H, d) token-major, the causal (and window) visibility from positions, fp32
    scores. None where the kernel does not apply (not float32 on the CPU, autograd, a width other than 32/64/128,
    a build without AVX-512, no kernel); the caller then attends group by group."""
    mod = kernel() if paged_attention_applies(q, pool) else None
    if mod is None:
        return None
    y: torch.Tensor = mod.paged_attention(q, pool, tables, rows, window or 0, scale)
    return y


def paged_attention_applies(q: torch.Tensor, pool: torch.Tensor) -> bool:
    """Whether :func:`paged_attention` runs these queries (N, H, d) over this pool (and builds the kernel if needed)."""
    if not _inference_cpu_float(q, pool) or q.stride(-1) != 1 or not pool.is_contiguous():
        return False
    mod = kernel()
    return mod is not None and bool(mod.paged_vectorized(q.shape[-1]))


def ced_decode(
    qw: torch.Tensor,  # (G, H, dk) pre-scaled queries for the window keys, any strides but the last
    ql: torch.Tensor | None,  # (G, H, d_c + d_rope) pre-scaled queries for the shared entries; None: the layer reads none
    bias: torch.Tensor | None,  # (G, H) added to every shared-entry score of a head, or None
    ring: torch.Tensor,  # (ring blocks, rb, K dk + K dv) the layer's window ring pool, contiguous
    ring_tables: torch.Tensor,  # (G, ring blocks a row) int64
    seg: torch.Tensor | None,  # (blocks, entries a block, >= d_c + d_rope) the source layer's shared entries
    seg_tables: torch.Tensor | None,  # (G, blocks a row) int64
    counts: torch.Tensor,  # (G, 2) int64: ring slots [0, nw) and shared entries [0, nl) each row's query sees
    num_kv_heads: int,
    dc: int,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None:
    """A causal encoder-decoder layer's decode rows (one new token each) over their window ring and shared latents,
    read in place through their tables under one softmax (``ced_attention.cpp``): (window values (G, H, dv), latent
    values (G, H, d_c), the weights' mass on the shared entries (G, H)), the absorbed form's inputs to W_UV. None
    where the kernel does not apply (not float32 on the CPU, autograd, or no kernel)."""
    widths = (qw.shape[-1], ql.shape[-1] if ql is not None else None, dc)
    if not ced_decode_applies(ring, seg, num_kv_heads, *widths) or any(
        t is not None and not _inference_cpu_float(t) for t in (qw, ql, bias)
    ):
        return None
    mod = kernel()
    assert mod is not None  # (ced_decode_applies built it)
    none = _NO_FLOAT
    yw, yl, mass = mod.ced_decode(
        qw,
        none if ql is None else ql,
        none if bias is None else bias,
        ring,
        ring_tables,
        none if seg is None else seg,
        _NO_INDEX if seg_tables is None else seg_tables,
        counts,
        num_kv_heads,
        dc,
    )
    return yw, yl, mass


def ced_decode_applies(ring: torch.Tensor, seg: torch.Tensor | None, num_kv_heads: int, dk: int, dl: int | None, dc: int) -> bool:
    """Whether :func:`ced_decode` runs over this ring pool (and shared segment, None: the layer reads none) with
    query width ``dk``, latent query width ``dl`` (d_c + d_rope; None without a segment) and ``dc`` (builds the
    kernel if needed)."""
    pools = (ring,) if seg is None else (ring, seg)
    if not _inference_cpu_float(*pools) or not all(t.is_contiguous() for t in pools):
        return False
    mod = kernel()
    if mod is None:
        return False
    K, E = num_kv_heads, ring.shape[-1]
    dv = (E - K * dk) // K
    return bool(mod.ced_supported(dk, dv, 16 if dl is None else dl, 16 if dl is None else dc))


def gqa_layer(
    x: torch.Tensor,  # (1, N, h) the residual stream entering the layer
    weights: list[torch.Tensor],  # [qkv, its bias, o, its bias, gate/up, its bias, down, its bias] packed (oneDNN)
    norms: list[torch.Tensor],  # [input norm weight, post-attention norm weight]
    eps: float,
    step: list[torch.Tensor],  # [cos, sin, pool, slots, tables, rows] (BatchContext.layer_step)
    heads: tuple[int, int],  # (H, K)
    window: int | None,
    write: bool,
) -> torch.Tensor | None:
    """A Llama-family decoder layer of an engine step (RMSNorm, the q/k/v matmul, RoPE in place, the new entries
    written, :func:`paged_attention` over every row, o_proj, the residual add and RMSNorm, gate/up, silu * up,
    down, the residual add) in one call: the kernels and oneDNN matmuls ``Block.forward`` runs, in its order, so
    the output is bit-identical to it; None where it does not apply (as :func:`paged_attention`, and x float32)."""
    pool = step[2]
    if not _inference_cpu_float(x, pool) or not pool.is_contiguous():
        return None
    mod = kernel()
    if mod is None or not mod.paged_vectorized(pool.shape[-1]):
        return None
    y: torch.Tensor = mod.gqa_layer(x, weights, norms, eps, step, heads[0], heads[1], window or 0, write)
    return y


def argmax(x: torch.Tensor) -> torch.Tensor:
    """``x.argmax(dim=-1)`` of a (rows, vocab) matrix (the greedy tokens of a step's logits): kvgraft's kernel where
    it applies (float32 on the CPU, rows contiguous; the same indices: the first maximum, a NaN first), else
    torch's (which reads 32 x 49,152 logits at ~2.5 GB/s on 2 cores)."""
    if x.dim() == 2 and x.shape[1] and x.stride(1) == 1 and not x.requires_grad and _inference_cpu_float(x):
        mod = kernel()
        if mod is not None:
            y: torch.Tensor = mod.argmax_rows(x)
            return y
    return x.argmax(dim=-1)


def decode_attention(
    q: torch.Tensor,  # (G, H, T, d): any strides but the last
    k: torch.Tensor,  # (K, n, S, d): any strides but the last
    v: torch.Tensor,  # (K, n, S, dv)
    mask: torch.Tensor,  # (G, T, S) bool, True = attend
    index: torch.Tensor | None,  # (G,) the slot of each row among the n; None: row g is slot g
    scale: float,
) -> torch.Tensor | None:
    """Softmax attention of each row's queries over its slot's keys, (G, H, T, dv) (a view of a token-major
    tensor), reading only the keys between the first and last any query of the row sees; fp32 scores. None
    where the kernel does not apply (the caller runs torch's ops): not float32 on the CPU, autograd on, a
    width without a vector path, or no kernel."""
    return _attention("decode_attention", "vectorized", q, k, v, mask, index, scale)


def prefill_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    mask: torch.Tensor,
    index: torch.Tensor | None,
    scale: float,
) -> torch.Tensor | None:
    """:func:`decode_attention`'s result (the same arguments) for many new tokens a row (a prompt's chunk),
    flash-style: blocks of queries against blocks of keys, an online softmax, fp32 scores (torch's CPU SDPA
    ran SmolLM2's prompt chunks 2-3x slower: bench/prefill_kernel.py). None where the kernel does not apply:
    not float32 on the CPU, autograd on, widths other than 32/64/128, a build without AVX-512, or no kernel."""
    return _attention("prefill_attention", "prefill_vectorized", q, k, v, mask, index, scale)


def _attention(
    name: str,
    supported: str,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    mask: torch.Tensor,
    index: torch.Tensor | None,
    scale: float,
) -> torch.Tensor | None:
    """The kernel ``name`` of the built module where it applies (``supported(d, dv)`` and float32 CPU
    inference with unit-stride keys and values), else None."""
    if not _inference_cpu_float(q, k, v) or k.stride(-1) != 1 or v.stride(-1) != 1:
        return None
    mod = kernel()
    if mod is None or not getattr(mod, supported)(q.shape[-1], v.shape[-1]):
        return None
    y: torch.Tensor = getattr(mod, name)(q, k, v, mask, _NO_INDEX if index is None else index, scale)
    return y
