"""kvgraft's compiled CPU kernel: decode-step attention over paged keys and values read in place
(``decode_attention.cpp``), built on first use by torch's C++ extension loader and cached by it
(``TORCH_EXTENSIONS_DIR``). Where it cannot be built (no C++ compiler) or does not apply (not float32 on the
CPU, autograd, a head width without a vector path), attention runs torch's batched matmuls instead.

``KVGRAFT_CPU_KERNEL`` chooses: ``auto`` (default: build on first use; if the build fails, one warning and
torch's ops), ``off`` (torch's ops only), ``require`` (a failed build raises)."""

from __future__ import annotations

import functools
import hashlib
import logging
import os
from pathlib import Path
from typing import Any

import torch

from kvgraft.errors import ConfigError

ENV = "KVGRAFT_CPU_KERNEL"
MODES = ("auto", "off", "require")
SOURCE = Path(__file__).with_name("decode_attention.cpp")
log = logging.getLogger(__name__)

# Instruction sets the build targets, by torch's own reading of this CPU: named, not -march=native, so a
# cached build never runs on a CPU that lacks what it was compiled for (the flags are part of its name).
ISA_FLAGS = {
    "AVX512": ["-mavx512f", "-mavx512dq", "-mavx512bw", "-mavx512vl", "-mfma"],
    "AVX2": ["-mavx2", "-mfma"],
}


def mode() -> str:
    """The kernel mode from ``KVGRAFT_CPU_KERNEL`` (``auto`` when unset); any other value is refused."""
    value = os.environ.get(ENV, "auto")
    if value not in MODES:
        raise ConfigError(f"{ENV} ({value!r}) must be one of {', '.join(MODES)}")
    return value


def build_flags() -> list[str]:
    """The compiler flags of this machine's build: optimisation, OpenMP (at::parallel_for is OpenMP in the headers:
    without it a build runs on one thread) and the CPU's vector instruction set."""
    return ["-O3", "-fopenmp", *ISA_FLAGS.get(torch.backends.cpu.get_cpu_capability(), [])]


@functools.cache
def _module(required: bool) -> Any | None:
    from torch.utils.cpp_extension import load

    flags = build_flags()
    digest = hashlib.sha256(SOURCE.read_bytes() + " ".join([torch.__version__, *flags]).encode()).hexdigest()[:12]
    name = f"kvgraft_decode_attention_{digest}"
    log.info("loading kvgraft's CPU decode-attention kernel %s (built once per machine, ~30 s)", name)
    try:
        return load(name=name, sources=[str(SOURCE)], extra_cflags=flags, verbose=False)
    except Exception as err:  # no compiler, no headers: torch's ops do the same work, slower
        if required:
            raise RuntimeError(f"{ENV}=require, but the kernel could not be built: {err}") from err
        log.warning("kvgraft's CPU decode-attention kernel could not be built (%s); using torch's ops", err)
        return None


def kernel() -> Any | None:
    """The built kernel module, or None (``off``, or the build failed under ``auto``)."""
    chosen = mode()
    return None if chosen == "off" else _module(chosen == "require")


_NO_INDEX = torch.empty(0, dtype=torch.long)


def decode_attention(
    q: torch.Tensor,  # (G, H, T, d)
    k: torch.Tensor,  # (K, n, S, d): any strides but the last
    v: torch.Tensor,  # (K, n, S, dv)
    mask: torch.Tensor,  # (G, T, S) bool, True = attend
    index: torch.Tensor | None,  # (G,) the slot of each row among the n; None: row g is slot g
    scale: float,
) -> torch.Tensor | None:
    """Softmax attention of each row's queries over its slot's keys, (G, H, T, dv), reading only the keys
    between the first and last any query of the row sees; fp32 scores. None where the kernel does not
    apply (the caller runs torch's ops): not float32 on the CPU, autograd on, a width without a vector
    path, or no kernel."""
    if (
        q.device.type != "cpu"
        or not (q.dtype == k.dtype == v.dtype == torch.float32)
        or (torch.is_grad_enabled() and (q.requires_grad or k.requires_grad or v.requires_grad))
        or k.stride(-1) != 1
        or v.stride(-1) != 1
    ):
        return None
    mod = kernel()
    if mod is None or not mod.vectorized(q.shape[-1], v.shape[-1]):
        return None
    return mod.decode_attention(q, k, v, mask, _NO_INDEX if index is None else index, scale)  # type: ignore[no-any-return]
