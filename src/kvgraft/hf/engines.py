"""Which serving engines and attention backends will run a stock DeepSeek-V3 export of a given shape.

The constraints are read from the engines' source (vLLM 0.32.0, the release ``make vllm-env`` pins; SGLang's
``python/sglang/srt/models/deepseek_v2.py``), not guessed; ``tested`` says which were run here and how.
An MLA backend's "head size" is the cached row, d_c + d_rope (``kv_lora_rank + qk_rope_head_dim``).

- vLLM builds every DeepSeek-V2/V3 attention projection with ``bias=False`` and skips bias tensors it has no
  parameter for (``vllm/model_executor/models/deepseek_v2.py``, "Skip loading extra bias"); SGLang's model
  does the same. Only the "engines" export (``kvgraft.hf.deepseek.STOCK_TARGETS``) is computed as written.
- ``get_supported_head_sizes``: CPU_MLA ``[576]`` (``v1/attention/backends/mla/cpu_mla.py``), AMX_MLA
  ``[576]`` (``amx_mla.py``, chosen on CPUs with AMX), FLASH_ATTN_MLA ``[576]`` (``flashattn_mla.py``, sm90),
  TRITON_MLA ``[]`` = any (``triton_mla.py``), and the common MLA backend's ``[320, 512, 576]``
  (``model_executor/layers/attention/mla_attention.py``), inherited by FLASHMLA (Hopper, sm90),
  CUTLASS_MLA (sm100) and FLASHINFER_MLA (sm100, which also needs ``qk_nope_head_dim`` in {64, 128, 192}).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

from kvgraft.checks import check_int

VLLM_VERSION = "0.32.0"
VLLM_PREFERRED = (512, 64)  # d_c, d_rope: the only shape vLLM's CPU backends and FlashMLA-class kernels share


@dataclass(frozen=True)
class _Backend:
    engine: str
    backend: str
    device: str
    head_sizes: tuple[int, ...] | None  # None: any
    nope_dims: tuple[int, ...] | None = None  # None: any
    source: str = ""
    tested: str = "not run here (source-read)"


BACKENDS: tuple[_Backend, ...] = (
    _Backend(
        "transformers",
        "DeepseekV3ForCausalLM (eager / sdpa)",
        "any",
        None,
        source="transformers/models/deepseek_v3/modeling_deepseek_v3.py",
        tested="yes: every export is loaded and measured against the kvgraft model (tests/test_deepseek_export.py)",
    ),
    _Backend(
        "vLLM",
        "CPU_MLA",
        "x86 CPU",
        (576,),
        source="vllm/v1/attention/backends/mla/cpu_mla.py",
        tested="yes: make test-vllm (fp32, greedy tokens and top-5 logprobs against transformers)",
    ),
    _Backend("vLLM", "AMX_MLA", "x86 CPU with AMX", (576,), source="vllm/v1/attention/backends/mla/amx_mla.py"),
    _Backend("vLLM", "TRITON_MLA", "GPU (any)", None, source="vllm/v1/attention/backends/mla/triton_mla.py"),
    _Backend(
        "vLLM",
        "FLASHMLA",
        "GPU sm90 (Hopper)",
        (320, 512, 576),
        source="vllm/v1/attention/backends/mla/flashmla.py (head sizes of MLACommonBackend)",
    ),
    _Backend("vLLM", "FLASH_ATTN_MLA", "GPU sm90 (Hopper)", (576,), source="vllm/v1/attention/backends/mla/flashattn_mla.py"),
    _Backend(
        "vLLM",
        "CUTLASS_MLA",
        "GPU sm100 (Blackwell)",
        (320, 512, 576),
        source="vllm/v1/attention/backends/mla/cutlass_mla.py (head sizes of MLACommonBackend)",
    ),
    _Backend(
        "vLLM",
        "FLASHINFER_MLA",
        "GPU sm100 (Blackwell)",
        (320, 512, 576),
        nope_dims=(64, 128, 192),
        source="vllm/v1/attention/backends/mla/flashinfer_mla.py",
    ),
    _Backend(
        "SGLang",
        "FlashMLA",
        "GPU sm90 (Hopper)",
        (576,),
        source="sglang python/sglang/srt/models/deepseek_v2.py (projections bias=False); FlashMLA's kernels "
        "are built for DeepSeek's 512 + 64",
    ),
)


@dataclass(frozen=True)
class EngineSupport:
    """One engine/backend's verdict for an export shape: ``runs`` and why not."""

    engine: str
    backend: str
    device: str
    runs: bool
    why: str
    source: str
    tested: str

    def to_dict(self) -> dict:
        return asdict(self)


def engine_support(kv_lora_rank: int, qk_rope_head_dim: int, qk_nope_head_dim: int) -> list[EngineSupport]:
    """Per engine and MLA backend, whether a stock DeepSeek-V3 export with these ranks will run.

    Only the shape is judged here; the export must also be kvgraft's engine-safe one (no attention bias
    tensors), which ``kvgraft convert --format deepseek_v3`` writes by default."""
    for name, value in (
        ("kv_lora_rank", kv_lora_rank),
        ("qk_rope_head_dim", qk_rope_head_dim),
        ("qk_nope_head_dim", qk_nope_head_dim),
    ):
        check_int(name, value, low=0)
    head = kv_lora_rank + qk_rope_head_dim
    out = []
    for b in BACKENDS:
        why = []
        if b.head_sizes is not None and head not in b.head_sizes:
            want = " or ".join(str(h) for h in b.head_sizes)
            why.append(
                f"caches rows of d_c + d_rope = {want} only; this export's is {kv_lora_rank} + {qk_rope_head_dim} = {head}"
            )
        if b.nope_dims is not None and qk_nope_head_dim not in b.nope_dims:
            why.append(f"needs qk_nope_head_dim in {{{', '.join(map(str, b.nope_dims))}}}, not {qk_nope_head_dim}")
        out.append(EngineSupport(b.engine, b.backend, b.device, not why, "; ".join(why) or "shape accepted", b.source, b.tested))
    return out


def vllm_shape_problem(kv_width: int, head_dim: int) -> str | None:
    """Why a model cannot be grafted to vLLM's 512 + 64 (None: it can): the graft must shrink the cache
    (KV width > 576) and keep one rotated head of 64 (head_dim >= 64, the stock export's prefix layout)."""
    d_c, d_rope = VLLM_PREFERRED
    problems = []
    if kv_width <= d_c + d_rope:
        problems.append(
            f"its KV cache holds {kv_width} values per token and layer (2 x num_kv_heads x head_dim), so "
            f"{d_c} + {d_rope} = {d_c + d_rope} would not shrink it"
        )
    if head_dim < d_rope:
        problems.append(
            f"head_dim is {head_dim}: the stock export's one shared RoPE key can keep at most one head's "
            f"{head_dim} rotated dims, not {d_rope}"
        )
    if not problems:
        return None
    return (
        "vLLM's CPU backends (CPU_MLA, AMX_MLA) and FlashMLA-class kernels need d_c + d_rope = 512 + 64, which "
        "this model cannot take: " + "; ".join(problems) + ". Without --target vllm the export still runs on "
        "vLLM's TRITON_MLA backend (GPU, any shape) and in transformers"
    )


def vllm_rope_problem(rope_type: str) -> str | None:
    """Why vLLM's DeepSeek-V2/V3 model would compute another RoPE than the export's (None: it would not).

    vLLM reads any ``rope_type`` other than "default" as DeepSeek's yarn (``deepseek_v2.py``, where
    ``rope_parameters["rope_type"]`` is rewritten to "deepseek_yarn"); measured here (docs/vllm.md): llama3
    0.41-0.98 off in logprobs, linear refused at engine start."""
    if rope_type in ("default", "yarn"):
        return None
    return (
        f"the model's RoPE scaling is {rope_type!r}: vLLM's DeepSeek-V2/V3 code reads every rope scaling as "
        "DeepSeek's yarn ('deepseek_yarn'), so it would serve other RoPE frequencies than transformers "
        "(docs/vllm.md: llama3 measured 0.41-0.98 off in logprobs, linear refused at engine start)"
    )


def format_engine_table(rows: list[EngineSupport], indent: str = "") -> str:
    width = max(len(f"{r.engine} {r.backend}") for r in rows)
    lines = []
    for r in rows:
        name = f"{r.engine} {r.backend}"
        verdict = "runs" if r.runs else "NO  "
        lines.append(f"{indent}{name:<{width}}  {r.device:<22} {verdict}  {'' if r.runs else r.why}".rstrip())
    return "\n".join(lines)


__all__ = [
    "BACKENDS",
    "EngineSupport",
    "VLLM_PREFERRED",
    "VLLM_VERSION",
    "engine_support",
    "format_engine_table",
    "vllm_rope_problem",
    "vllm_shape_problem",
]
