"""Export an all-MLA kvgraft model as a stock DeepSeek-V3 checkpoint (``model_type: deepseek_v3``).

The directory (config.json, model.safetensors, generation_config.json, tokenizer files) loads with
unmodified ``transformers.AutoModelForCausalLM.from_pretrained`` (no remote code, no kvgraft) and uses
DeepSeek's own tensor names, so MLA serving stacks (vLLM, SGLang) read it as they read DeepSeek's
checkpoints: dense SwiGLU MLPs only (``first_k_dense_replace = num_hidden_layers``, no MoE layer, no MTP
layer), ``q_lora_rank: null`` (a plain ``q_proj``), ``num_key_value_heads = num_attention_heads``,
``rope_interleave: true``.

Two constructions (``target``): "engines" (the default) writes nothing vLLM or SGLang drop or overflow: no
attention bias tensor (their DeepSeek models build the projections bias=False and skip bias tensors), every
weight within fp16's range (checked), the latent norm fitted ("fit") and biases folded into the weights
(``_EngineFold``), its error measured; "transformers" writes the exact constructions below, which hold
constants in attention biases and only transformers computes as written (a warning says so).

What is exact and what is not in the "transformers" construction (``docs/export.md`` has the per-family table):
- q_proj, kv_a_proj_with_mqa, kv_b_proj, o_proj, norms, MLP, embeddings: exact. The RoPE rows are permuted
  from kvgraft's rotate-half layout to DeepSeek's interleaved one (q per head, and the shared RoPE key);
  a yarn ``mscale_all_dim`` softmax factor that stock applies and kvgraft does not is folded into q_proj;
  a kv_b_proj bias is folded exactly (its key half adds the same amount to every logit of a query, so
  softmax ignores it; its value half passes through attention, whose weights sum to one, into the o_proj
  bias); a kv_a_proj bias goes to kv_a_proj_with_mqa's (``attention_bias``).
- A q_proj bias (Qwen2, Llama attention_bias): stock's q_proj has no bias, but its low-rank query path has
  one (q_a_proj) followed by an RMSNorm (q_a_layernorm) and q_b_proj. The query goes through it with
  q_lora_rank = min(hidden, H (d_nope + d_rope)) + 1: q_a x = [P x ; A0], A0 a constant (power of two) so large
  against a bound on |P x| over *every* input (the input RMSNorm bounds |x / g|^2 by hidden) that the norm's
  rms is constant to a relative 5e-11; the norm weight turns the result into [P x ; 1] and q_b = [W_q, b_q]
  (or [I, b_q]). Exact; costs about hidden^2 parameters per layer.
- The latent RMSNorm: stock DeepSeek-V3 always normalises the latent (``kv_a_layernorm``). A model built
  with ``mla_latent_norm=True`` exports exactly. Otherwise the default ("pad") is exact by the same
  construction: one extra latent coordinate holds a constant A0 (kv_a bias) that pins the norm's rms, the
  norm weight undoes it and kv_b gives that coordinate a zero column (d_c + 1 cached values; ``kvgraft
  convert --format deepseek_v3`` grafts d_c - 1 so the export stays within the budget). The older
  approximations remain: "scale" (a constant weight equal to the latent's typical rms) and "fit" (also an
  invertible change of latent basis making the rms as constant as possible over calibration tokens); they keep
  d_c (say, FlashMLA's 512) at a measured cost.
- A sliding window (Mistral): stock DeepSeek-V3 has none, so the export is the closest stock model (full
  attention): exact for contexts up to the window, said in config.json (``kvgraft_export``), README.md and the
  report, and measured on both sides of the window.
- RoPE: stock rotates pair j at theta'^(-2j/d_rope) in every layer, each frequency once. Two kvgraft
  layouts are exactly that (``stock_rope_layout``): 'prefix' (the default of ``kvgraft convert --format
  deepseek_v3``: one rotated head at the d_rope/2 fastest frequencies, any even d_rope <= head_dim), written
  with rope_theta' = rope_theta^(d_rope/head_dim), since theta'^(-2j/d_rope) = theta^(-2j/head_dim); and
  'stride' (every (head_dim/d_rope)-th frequency) at the model's own rope_theta. Both are exact for
  default/linear/llama3 RoPE with the source's scaling parameters (functions of each base frequency alone:
  llama3's wavelength thresholds see the same wavelengths). Yarn: for 'stride' its ramp is re-expressed for
  dim = d_rope (beta_fast/beta_slow solved, truncate kept where the range allows); for 'prefix' the source's
  betas carry over (dim / ln theta, hence every correction dim, is unchanged), exact unless the source's ramp
  ends past pair d_rope - 1, where stock clamps it (refused: --rope-selection stride, or a wider --rope-dim).
  Dynamic NTK only at d_rope = head_dim (its base rescaling has exponent dim/(dim-2)), whatever the layout.
  The changed theta rounds differently in fp32 (relative ~5e-7 on the frequencies): the measured max |logit
  diff| stays at fp noise. The kept rotated head may be a real (orthogonal) or complex (unitary: per-head
  phases folded into the queries, ``GraftConfig.rope_rotation``) mix of the KV heads: either exports alike.
  With several KV heads the exact full-budget kvgraft layout (d_rope = num_kv_heads x head_dim, several
  rotated heads per frequency) cannot be expressed: the closest export keeps d_rope = head_dim and the
  graft's error against the original is measured.
- Refused, naming what would make it possible: GQA layers left (convert all layers), per-head q/k norms
  (graft with qk_norm='linearise', which convert does for this format), shared caches (--to ced), a RoPE
  layout other than prefix/stride (the 'norm' and 'shared' selections repeat or scatter frequencies per
  layer), non-zero MLP biases (nothing can carry them).
``ExportReport`` carries the measured logit error, KL and perplexities on the calibration tail.

transformers builds ``kv_a_layernorm`` with eps 1e-6 whatever ``rms_norm_eps`` says, while vLLM and SGLang
use ``rms_norm_eps``. The export is exact in transformers; when ``rms_norm_eps != 1e-6`` the serving stacks
see the latent norm with a slightly different eps (the report says so). Older vLLM releases refuse a
DeepSeek-V2/V3 model without any MoE layer ("No DeepseekV2MoE layer found in model.layers"); newer ones
log a warning and load it.
"""

from __future__ import annotations

import copy
import dataclasses
import math
import warnings
from dataclasses import dataclass, field
from pathlib import Path

import torch

from kvgraft.errors import CheckpointError, UnsupportedModelError
from kvgraft.hf.save import TOKENIZER_FILES, OutputExistsError, write_checkpoint_dir
from kvgraft.model.config import ModelConfig, RopeConfig
from kvgraft.model.rope import rope_frequencies
from kvgraft.model.transformer import Transformer


LATENT_NORM_STRATEGIES = ("pad", "fit", "scale")
# Who must compute the export's function. "engines" (the default): vLLM and SGLang as well as transformers.
# Their DeepSeek-V2/V3 models build every attention projection with bias=False and skip bias tensors they
# have no parameter for (vllm/model_executor/models/deepseek_v2.py, "Skip loading extra bias"; SGLang's
# deepseek_v2.py likewise), and serve in fp16/bf16: no bias tensor, every weight within fp16's range.
# "transformers": the exact constructions (a constant latent / query coordinate held by attention biases,
# constants up to ~1e7), which only transformers computes as written.
STOCK_TARGETS = ("engines", "transformers")
FP16_MAX = 65504.0
# rms of the exported latent for the fitted/scaled latent norms: transformers' kv_a_layernorm uses eps 1e-6,
# vLLM/SGLang use rms_norm_eps (often 1e-5); at ms(latent) = 256 the two differ by < 4e-8 relative
ENGINE_LATENT_RMS = 16.0
# transformers' DeepseekV3Attention builds kv_a_layernorm with the RMSNorm default eps, not rms_norm_eps
STOCK_LATENT_NORM_EPS = 1e-6
FLASH_MLA_KV_LORA_RANK = 512
FLASH_MLA_ROPE_HEAD_DIM = 64


@dataclass
class ExportReport:
    """What ``export_deepseek_v3`` wrote and how far the checkpoint is from the kvgraft model.

    ``latent_norm``: "exact" (the model has its own latent norm), "pad" (exact: a constant latent coordinate
    pins the stock norm's rms), "scale" or "fit" (approximations). ``exact``: the exported model computes the
    kvgraft model's function for every input (to fp rounding; the pinned constructions add at most
    ``PIN_DELTA`` / 2 relative error to a latent or query scale); False lists the reasons in
    ``approximations``. ``exact_up_to_tokens``: contexts up to this length are exact even when ``exact`` is
    False (a sliding window exported as full attention).
    ``max_abs_logit_diff`` / ``mean_kl`` (KL(ours || exported) per token, nats) / ``perplexity`` ({"kvgraft":,
    "deepseek_v3":}, next-token perplexity): measured in fp32 with stock transformers on ``measured_on`` ids (the
    calibration tail, or random ids); ``max_abs_logit_diff_within_window``: the same on the first
    ``exact_up_to_tokens`` positions. None when not measured.
    ``kv_lora_rank`` / ``q_lora_rank``: the exported ranks; ``extra_parameters``: parameters the export adds
    over the kvgraft model (pad coordinate, low-rank query path).
    ``latent_rms_cv``: per layer, std/mean of the exported latent's rms over calibration tokens ("fit"/"scale"
    only). ``warnings``: fast-path, serving-stack and fallback notes.
    """

    path: Path
    latent_norm: str
    max_abs_logit_diff: float | None = None
    mean_kl: float | None = None
    measured_on: str | None = None
    latent_rms_cv: tuple[float, ...] = ()
    warnings: list[str] = field(default_factory=list)
    exact: bool = True
    approximations: list[str] = field(default_factory=list)
    exact_up_to_tokens: int | None = None
    max_abs_logit_diff_within_window: float | None = None
    perplexity: dict | None = None
    kv_lora_rank: int | None = None
    q_lora_rank: int | None = None
    extra_parameters: int = 0
    folded: list[str] = field(default_factory=list)
    target: str = "engines"

    def to_dict(self) -> dict:
        out = dataclasses.asdict(self)
        out["path"] = str(self.path)
        out["latent_rms_cv"] = list(self.latent_rms_cv)
        return out

    def summary(self) -> list[str]:
        """The report as printed lines (what ``kvgraft convert --format deepseek_v3`` shows)."""
        if self.exact:
            what = "exact"
        elif self.exact_up_to_tokens is not None:
            what = f"exact up to {self.exact_up_to_tokens} tokens of context, approximate beyond"
        else:
            what = "approximate"
        lines = [(f"stock DeepSeek-V3 export -> {self.path}: {what} (for {self.target}; latent norm "
                  f"{self.latent_norm}; kv_lora_rank {self.kv_lora_rank}, q_lora_rank {self.q_lora_rank})")]
        lines += [f"  folded: {f}" for f in self.folded]
        lines += [f"  not exact: {a}" for a in self.approximations]
        if self.max_abs_logit_diff is not None:
            m = (f"  measured on {self.measured_on}: max |logit diff| vs the kvgraft model "
                 f"{self.max_abs_logit_diff:.3g}, mean KL {self.mean_kl:.3g} nats")
            if self.perplexity:
                m += (f", perplexity {self.perplexity['kvgraft']:.4g} (kvgraft) -> "
                      f"{self.perplexity['deepseek_v3']:.4g} (deepseek_v3)")
            lines.append(m)
        if self.max_abs_logit_diff_within_window is not None:
            lines.append(f"  within the first {self.exact_up_to_tokens} tokens: max |logit diff| "
                         f"{self.max_abs_logit_diff_within_window:.3g}")
        lines += [f"  note: {w}" for w in self.warnings]
        return lines


# ---- what stock DeepSeek-V3 can express ---------------------------------------------------------------


def stride_rope_index(config: ModelConfig) -> tuple[int, ...] | None:
    """The "stride" frequency layout (every (head_dim/d_rope)-th frequency: stock DeepSeek-V3 at the model's
    rope_theta), or None when d_rope does not divide head_dim."""
    d, dr = config.head_dim, config.qk_rope_head_dim
    if not dr or d % dr:
        return None
    return tuple(range(0, d // 2, d // dr))


def prefix_rope_index(config: ModelConfig) -> tuple[int, ...] | None:
    """The "prefix" frequency layout (the d_rope/2 fastest frequencies: stock DeepSeek-V3 with rope_theta' =
    rope_theta^(d_rope/head_dim)), or None when d_rope is not an even width <= head_dim."""
    d, dr = config.head_dim, config.qk_rope_head_dim
    if not dr or dr % 2 or dr > d:
        return None
    return tuple(range(dr // 2))


STOCK_ROPE_LAYOUTS = ("stride", "prefix")


def stock_rope_layout(config: ModelConfig) -> str | None:
    """"stride" or "prefix" when every MLA layer of ``config`` has that RoPE frequency layout (both are stock
    DeepSeek-V3's pair j at theta'^(-2j/d_rope), for theta' = theta resp. theta^(d_rope/head_dim)); "stride" when
    they coincide (d_rope = head_dim); None otherwise (per-layer or repeated frequencies: kvgraft's own)."""
    mla = [i for i, k in enumerate(config.attention_kinds) if k == "mla"]
    layouts = {tuple(config.rope_freq_index[i]) for i in mla}
    if len(layouts) != 1:
        return None
    (index,) = layouts
    if index == stride_rope_index(config):
        return "stride"
    if index == prefix_rope_index(config):
        return "prefix"
    return None


def _config_problems(config: ModelConfig) -> list[str]:
    """What stock DeepSeek-V3 cannot express in ``config``, each naming what would make the export possible."""
    problems = []
    gqa = [i for i, k in enumerate(config.attention_kinds) if k != "mla"]
    if gqa:
        problems.append(
            f"layers {gqa} use GQA attention ({len(gqa)} of {config.num_layers}); stock DeepSeek-V3 runs MLA in "
            "every layer, so convert all layers (drop --layers; GraftConfig(layers=None)) before exporting"
        )
    if config.qk_norm:
        problems.append(
            "qk_norm (per-head q/k RMSNorm, Qwen3) has no place in stock DeepSeek-V3's attention (its only query "
            "norm, q_a_layernorm, normalises all heads together); graft with GraftConfig(qk_norm='linearise'), "
            "which kvgraft convert --format deepseek_v3 does, to export the closest model (error measured)"
        )
    if config.kv_slots != tuple(range(config.num_layers)):
        problems.append(
            f"kv_slots {config.kv_slots} share caches across layers; stock DeepSeek-V3 has one cache per layer "
            "(convert with --to mla, not --to ced)"
        )
    if not gqa and stock_rope_layout(config) is None:
        stride, prefix = stride_rope_index(config), prefix_rope_index(config)
        layouts = {tuple(config.rope_freq_index[i]) for i in range(config.num_layers)}
        bad = [i for i in range(config.num_layers) if config.rope_freq_index[i] not in (stride, prefix)] or \
            list(range(1, config.num_layers))  # each layer is one of the two, but not all the same one
        fix = ("graft with --rope-selection stride or prefix (rope_selection='stride' / 'prefix')"
               if stride is not None else
               "graft with --rope-selection prefix, or --rope-selection stride with --rope-dim set to an even divisor "
               f"of head_dim {config.head_dim}")
        problems.append(
            f"the RoPE frequency layout of layers {bad} (rope_freq_index {config.rope_freq_index[bad[0]]}"
            f"{'; not the same in every layer' if len(layouts) > 1 else ''}) is not one stock DeepSeek-V3 can "
            f"hold: it rotates RoPE pair j at theta'^(-2j/d_rope) in every layer, each frequency once, which is "
            f"the stride layout {stride if stride is not None else '(0, s, 2s, ...)'} at theta' = rope_theta or "
            f"the prefix layout {prefix} at theta' = rope_theta^(d_rope/head_dim) (frequency indices of "
            f"head_dim/2, d_rope = {config.qk_rope_head_dim}); {fix}"
        )
    return problems


def _weight_problems(model: Transformer) -> list[str]:
    problems = []
    cfg = model.config
    if cfg.mlp_bias:
        nonzero = [i for i, b in enumerate(model.layers)
                   if any(_nonzero(getattr(b.mlp, n).bias) for n in ("gate_proj", "up_proj", "down_proj"))]
        if nonzero:
            problems.append(
                f"the MLP of layers {nonzero} has non-zero biases; stock DeepSeek-V3's MLP has none, and no flag "
                "can fold them (the MLP's input is RMS-normalised, with no constant component to carry a bias)")
    return problems


def _nonzero(t: torch.Tensor | None) -> bool:
    return t is not None and bool(t.detach().abs().max() > 0)


def _yarn_range_for_stock(rope: RopeConfig, d: int, dr: int, max_pos: int, stride: int | None = None,
                          stock_theta: float | None = None) -> tuple[float, float, bool] | None:
    """(beta_fast, beta_slow, truncate) making stock's yarn at dim = d_rope ramp exactly as kvgraft's at dim =
    head_dim over the stride frequencies, or None when no setting does. ``stride`` 1 and ``stock_theta`` =
    theta^(d_rope/head_dim): the same for the prefix layout (pair j = frequency j).

    kvgraft's ramp at frequency i = s*j (s = head_dim / d_rope) is clamp((s j - low) / (high - low)), with
    low/high its correction range in units of head_dim; stock's at pair j is clamp((j - low') / (high' - low'))
    in units of d_rope, so low' = low / s and high' = high / s. Stock's range comes from beta_fast/beta_slow
    (find_correction_dim(beta) = d_rope ln(L / (2 pi beta)) / (2 ln theta)), solved here for those targets:
    with truncate (floor/ceil, what vLLM's and SGLang's DeepSeek yarn always do) when they are integers,
    without it otherwise. None when stock would clamp high' at d_rope - 1 below the target.
    """
    original = rope.original_max_position_embeddings or max_pos
    s = d // dr if stride is None else stride
    theta_s = rope.theta if stock_theta is None else stock_theta

    def cdim(beta: float) -> float:
        return d * math.log(original / (beta * 2 * math.pi)) / (2 * math.log(rope.theta))

    low, high = cdim(rope.beta_fast or 32), cdim(rope.beta_slow or 1)
    if rope.truncate:
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, d - 1)
    tiny = low == high
    if tiny:
        high += 0.001
    lo_t, hi_t = low / s, high / s
    if hi_t > dr - 1:
        return None
    truncate = float(lo_t).is_integer() and float(hi_t).is_integer() and not tiny
    lo_raw, hi_raw = (lo_t + 0.5, hi_t - 0.5) if truncate else (lo_t, hi_t)
    if lo_t == 0:
        lo_raw = -0.5  # any value <= 0 clamps to 0

    def beta(target: float) -> float:
        return original / (2 * math.pi) * theta_s ** (-2 * target / dr)

    return beta(lo_raw), beta(hi_raw), truncate


def _stock_rope(config: ModelConfig, layout: str | None = None) -> tuple[dict, float, list[str]]:
    """(rope_parameters for config.json, factor to fold into q_proj, notes); raises when stock cannot match ours.

    ``layout``: "stride" or "prefix" (default: ``stock_rope_layout(config)``, else "stride"). Stock DeepSeek-V3
    computes its frequencies with dim = qk_rope_head_dim; ours come from dim = head_dim at the layout's indices.
    Stride (every s-th frequency, s = head_dim / d_rope): equal at the same rope_theta for default/linear/llama3
    (functions of each base frequency alone); yarn places its ramp in units of dim, so beta_fast/beta_slow (and
    truncate) are re-expressed for dim = d_rope (``_yarn_range_for_stock``). Prefix (the d_rope/2 fastest
    frequencies): stock's base frequencies theta'^(-2j/d_rope) equal ours theta^(-2j/head_dim) for theta' =
    theta^(d_rope/head_dim), so default/linear/llama3 are exact with rope_theta' and the same scaling parameters
    (llama3's wavelength thresholds see the same wavelengths); yarn's correction dims come out the same too
    (dim / ln theta is unchanged) except that stock clamps the ramp's end at d_rope - 1, so it is exact unless
    the source's ramp ends past pair d_rope - 1 (then refused: --rope-selection stride or a wider --rope-dim).
    Dynamic NTK rescales the base with an exponent dim/(dim-2): it matches only at d_rope = head_dim (any
    layout). Checked numerically (relative 2e-6: the changed theta rounds differently in fp32, ~5e-7).
    """
    rope: RopeConfig = config.rope
    d, dr, max_pos = config.head_dim, config.qk_rope_head_dim, config.max_position_embeddings
    kind = rope.rope_type
    if layout is None:
        layout = stock_rope_layout(config) or "stride"
    if layout not in STOCK_ROPE_LAYOUTS:
        raise ValueError(f"layout {layout!r} is not one of {', '.join(STOCK_ROPE_LAYOUTS)}")
    if layout == "prefix" and dr == d:
        layout = "stride"  # the same frequencies, at the model's own theta
    if kind == "dynamic" and dr != d:
        raise UnsupportedModelError(
            f"rope_type 'dynamic' cannot be exported to stock DeepSeek-V3 with qk_rope_head_dim {dr} != head_dim "
            f"{d}: beyond max_position_embeddings it rescales the base as base * r^(dim/(dim-2)), and stock uses "
            f"dim = {dr} where kvgraft uses {d}, so the frequencies would differ (whatever the rope selection); "
            f"graft with --rope-dim {d} (qk_rope_head_dim = head_dim), or use --format kvgraft"
        )
    idx = list(stride_rope_index(config) if layout == "stride" else prefix_rope_index(config))
    ours, our_scale = rope_frequencies(rope, d, max_pos)
    stock_theta = float(rope.theta) if layout == "stride" else float(rope.theta) ** (dr / d)
    stock_rope = dataclasses.replace(rope, theta=stock_theta)
    notes = []
    solved = None
    if kind == "yarn" and dr != d:
        if layout == "stride":
            solved = _yarn_range_for_stock(rope, d, dr, max_pos)
        else:  # the same betas give the same correction dims; re-solved only where fp32 rounding tips a floor/ceil
            same, _ = rope_frequencies(stock_rope, dr, max_pos)
            solved = None if torch.allclose(ours[idx].double(), same.double(), rtol=2e-6, atol=0) else \
                _yarn_range_for_stock(rope, d, dr, max_pos, stride=1, stock_theta=stock_theta)
        if solved is not None:
            beta_fast, beta_slow, truncate = solved
            stock_rope = dataclasses.replace(stock_rope, beta_fast=beta_fast, beta_slow=beta_slow, truncate=truncate)
    stock, stock_scale = rope_frequencies(stock_rope, dr, max_pos)
    if not torch.allclose(ours[idx].double(), stock.double(), rtol=2e-6, atol=0) or abs(our_scale - stock_scale) > 1e-9:
        if layout == "stride":
            fix = (f"graft with --rope-selection prefix (rope_theta' = rope_theta^(d_rope/head_dim)) if it fits, "
                   f"--rope-dim {d} (qk_rope_head_dim = head_dim), or use --format kvgraft")
        else:
            fix = (f"graft with --rope-selection stride (an even --rope-dim dividing head_dim {d}), --rope-dim {d} "
                   "(qk_rope_head_dim = head_dim), or use --format kvgraft")
        raise UnsupportedModelError(
            f"rope_type {kind!r} with these parameters cannot be exported exactly to stock DeepSeek-V3 at "
            f"qk_rope_head_dim {dr} with the {layout} layout: stock computes its frequencies for dim = {dr}, kvgraft "
            f"for dim = head_dim = {d} at frequencies {tuple(idx)}, and no stock {kind} setting gives the same ones "
            f"(max relative difference {float(((ours[idx] - stock) / stock).abs().max()):.3g}; yarn's correction "
            f"range would need to reach past pair {dr - 1}); {fix}"
        )
    params: dict = {"rope_type": kind, "rope_theta": stock_theta}
    if layout == "prefix":
        notes.append(f"prefix RoPE layout: rope_theta {rope.theta:g} -> {stock_theta:.9g} (= rope_theta^(d_rope/head_dim) "
                     f"= rope_theta^({dr}/{d})), so stock's pair j rotates at kvgraft's frequency j: exact")
    if kind in ("linear", "dynamic"):
        params["factor"] = float(rope.factor)
    elif kind == "llama3":
        params |= {"factor": float(rope.factor), "low_freq_factor": float(rope.low_freq_factor),
                   "high_freq_factor": float(rope.high_freq_factor),
                   "original_max_position_embeddings": int(rope.original_max_position_embeddings)}
    elif kind == "yarn":
        original = rope.original_max_position_embeddings or max_pos
        params["original_max_position_embeddings"] = int(original)
        params["factor"] = float(rope.factor if rope.factor is not None else max_pos / original)
        for name in ("beta_fast", "beta_slow"):
            if getattr(stock_rope, name):
                params[name] = float(getattr(stock_rope, name))
        if solved is not None:
            notes.append(
                f"yarn: beta_fast/beta_slow re-expressed for dim = qk_rope_head_dim = {dr} ({params['beta_fast']:.6g} / "
                f"{params['beta_slow']:.6g}, truncate {stock_rope.truncate}) so that stock's ramp falls on the same "
                f"frequencies as kvgraft's at head_dim {d}: exact"
            )
        # Both mscales explicit, so that transformers and DeepSeek's own yarn (vLLM/SGLang: attention factor
        # mscale(f, mscale) / mscale(f, mscale_all_dim), defaults 1 and 0) agree with kvgraft, which uses the
        # ratio only when both are set and mscale(f, 1) otherwise.
        if rope.mscale and rope.mscale_all_dim:
            params["mscale"], params["mscale_all_dim"] = float(rope.mscale), float(rope.mscale_all_dim)
        else:
            params["mscale"], params["mscale_all_dim"] = 1.0, 0.0
        if rope.attention_factor is not None:
            params["attention_factor"] = float(rope.attention_factor)
        if not stock_rope.truncate:
            params["truncate"] = False
        if rope.attention_factor is not None or not stock_rope.truncate:
            notes.append(
                "yarn attention_factor / truncate=false are honoured by transformers but not by DeepSeek's own yarn "
                "(vLLM/SGLang 'deepseek_yarn'), which derives the attention factor from mscale/mscale_all_dim and "
                "always truncates: serving stacks would run slightly different RoPE"
            )
    if kind not in ("default", "yarn"):
        notes.append(
            f"rope_type {kind!r} is exact in transformers, but vLLM's and SGLang's DeepSeek-V2/V3 code treat any "
            "rope scaling as DeepSeek's yarn ('deepseek_yarn'): they would run this checkpoint with wrong RoPE "
            "frequencies"
        )
    # stock multiplies the softmax scale by mscale(factor, mscale_all_dim)^2 (yarn_apply_mscale; vLLM and
    # SGLang do the same); kvgraft does not: fold the inverse into the queries
    fold = 1.0
    if kind != "default" and params.get("mscale_all_dim"):
        factor = params["factor"]
        m = 1.0 if factor <= 1 else 0.1 * params["mscale_all_dim"] * math.log(factor) + 1.0
        fold = 1.0 / (m * m)
    return params, fold, notes


def deepseek_v3_fast_path(config: ModelConfig, original_kv_width: int | None = None) -> list[str]:
    """Warnings about how the exported model will run on MLA serving kernels (empty: nothing to say).

    FlashMLA (vLLM's and SGLang's fast DeepSeek decode kernels) is built for d_c = 512 and d_rope = 64; other
    shapes fall back to slower generic MLA paths. ``original_kv_width`` is the per-layer cache width of the
    model before grafting, 2 * num_kv_heads * head_dim (default: from ``config``, which the graft keeps).
    """
    out = []
    dc, dr = config.kv_lora_rank, config.qk_rope_head_dim
    if dc != FLASH_MLA_KV_LORA_RANK:
        out.append(
            f"kv_lora_rank (d_c) is {dc}: FlashMLA kernels need d_c = {FLASH_MLA_KV_LORA_RANK} (with d_rope = "
            f"{FLASH_MLA_ROPE_HEAD_DIM}); serving stacks will use a slower generic MLA path"
        )
    if dr != FLASH_MLA_ROPE_HEAD_DIM:
        out.append(
            f"qk_rope_head_dim (d_rope) is {dr}: FlashMLA kernels need d_rope = {FLASH_MLA_ROPE_HEAD_DIM} (with "
            f"d_c = {FLASH_MLA_KV_LORA_RANK}); serving stacks will use a slower generic MLA path"
        )
    width = original_kv_width if original_kv_width is not None else config.kv_width
    if dc is not None and dr is not None and dc + dr > width:
        out.append(
            f"the latent cache entry d_c + d_rope = {dc + dr} values per token and layer is larger than the original "
            f"GQA cache (2 x num_kv_heads x head_dim = {width}): the export uses more KV-cache memory, not less"
        )
    return out


# ---- the latent norm ---------------------------------------------------------------------------------


@dataclass
class _Latent:
    """How one layer's latent maps to stock: c' = M c + offset (kv_a rows and bias), kv_b' = kv_b @ B, norm
    weight g. M is (d_c', d_c) and B (d_c, d_c'): d_c' = d_c + 1 for "pad"."""

    M: torch.Tensor  # (dc', dc)
    B: torch.Tensor  # (dc, dc')
    g: torch.Tensor  # (dc',)
    cv: float = 0.0
    offset: torch.Tensor | None = None  # (dc',): added to the kv_a bias (needs attention_bias)
    bound: float = 0.0  # "pad": bound on the relative error of the latent's scale (0: none)
    # (dc',) with unit . n_t ~ 1 for the exported normalised latents n_t (least squares on calibration): the
    # nearest thing to a constant input kv_b has, which carries a constant value (value / o_proj bias)
    unit: torch.Tensor | None = None


# The pinned-rms constructions ("pad" latent, low-rank query) keep |varying part|^2 / constant^2 below this
PIN_DELTA = 1e-10


def _pow2_above(x: float) -> float:
    return 2.0 ** math.ceil(math.log2(max(x, 1e-30)))


def _pinned_constant(weight: torch.Tensor | None, bias: torch.Tensor | None, input_norm: torch.Tensor) -> float:
    """A constant A0 (a power of two) with |W x + b|^2 <= PIN_DELTA A0^2 for every attention input x.

    x = g * h / sqrt(ms(h) + eps) (the input RMSNorm), so |x / g|^2 <= hidden and
    |W x + b| <= ||W diag(g)||_2 sqrt(hidden) + |b|: a bound from the weights alone, for any input.
    """
    h = input_norm.numel()
    if weight is None:  # the identity: ||diag(g)||_2 = max |g|
        bound = float(input_norm.double().abs().max()) * h ** 0.5
    else:
        bound = float(torch.linalg.matrix_norm(weight.double() * input_norm.double(), ord=2)) * h ** 0.5
    if bias is not None:
        bound += float(bias.double().norm())
    return _pow2_above(max(bound, 1e-6) / PIN_DELTA ** 0.5)


def _pad_latent(attn, input_norm: torch.Tensor) -> _Latent:
    """Exact latent for a model without its own latent norm: one extra latent coordinate holds a constant A0
    (from the kv_a bias) so large that the stock norm's rms is constant to within PIN_DELTA / 2 for every
    input; the norm weight R0 = that rms undoes it, and kv_b ignores the extra coordinate (a zero column)."""
    dc = attn.dc
    W_a = attn.kv_a_proj.weight.detach().to("cpu", torch.float64)[:dc]
    b_a = attn.kv_a_proj.bias
    b_c = None if b_a is None else b_a.detach().to("cpu", torch.float64)[:dc]
    A0 = _pinned_constant(W_a, b_c, input_norm.detach().to("cpu", torch.float64))
    R0 = (A0 * A0 / (dc + 1) + STOCK_LATENT_NORM_EPS) ** 0.5
    eye = torch.eye(dc, dtype=torch.float64)
    M = torch.cat([eye, torch.zeros(1, dc, dtype=torch.float64)])
    offset = torch.zeros(dc + 1, dtype=torch.float64)
    offset[dc] = A0
    g = torch.full((dc + 1,), R0, dtype=torch.float64)
    g[dc] = 1.0
    return _Latent(M=M, B=M.T.clone(), g=g, cv=0.0, offset=offset, bound=PIN_DELTA / 2)


@dataclass
class _LowRankQuery:
    """A query with a bias through stock's q_a_proj (bias) -> q_a_layernorm -> q_b_proj (no bias).

    q_a x = [P x ; A0] with A0 pinning the norm's rms (as for "pad"), the norm weight turning it into
    [P x ; 1], and q_b = [Q, b]: Q P = W_q, so q = W_q x + b for every input (to within PIN_DELTA / 2).
    """

    a_weight: torch.Tensor  # (r, h)
    a_bias: torch.Tensor  # (r,)
    norm: torch.Tensor  # (r,)
    b_weight: torch.Tensor  # (H (dn + dr), r)


def _low_rank_query(wq: torch.Tensor, bq: torch.Tensor, input_norm: torch.Tensor) -> _LowRankQuery:
    """``wq`` (Hq, h) and ``bq`` (Hq,): the stock-ordered query weight and bias (fp64)."""
    Hq, h = wq.shape
    P, Q = (torch.eye(h, dtype=torch.float64), wq) if h <= Hq else (wq, torch.eye(Hq, dtype=torch.float64))
    r = P.shape[0] + 1
    A0 = _pinned_constant(None if h <= Hq else P, None, input_norm.to("cpu", torch.float64))
    R0 = (A0 * A0 / r + STOCK_LATENT_NORM_EPS) ** 0.5
    a_bias = torch.zeros(r, dtype=torch.float64)
    a_bias[-1] = A0
    norm = torch.full((r,), R0, dtype=torch.float64)
    norm[-1] = R0 / A0
    return _LowRankQuery(a_weight=torch.cat([P, torch.zeros(1, h, dtype=torch.float64)]), a_bias=a_bias,
                         norm=norm, b_weight=torch.cat([Q, bq[:, None]], dim=1))


@torch.no_grad()
def _collect_latents(model: Transformer, ids: torch.Tensor, max_tokens: int, batch_size: int = 8) -> list[torch.Tensor]:
    """Per layer, the raw latents c = kv_a(x)[:d_c] (fp64, CPU) over (at most ``max_tokens``) calibration tokens."""
    dc = model.config.kv_lora_rank
    store: list[list[torch.Tensor]] = [[] for _ in model.layers]
    hooks = []
    for i, block in enumerate(model.layers):
        def hook(_mod, _inp, out, i=i):
            store[i].append(out[..., :dc].detach().reshape(-1, dc).to("cpu", torch.float64))
        hooks.append(block.self_attn.kv_a_proj.register_forward_hook(hook))
    device = model.embed_tokens.weight.device
    try:
        for start in range(0, ids.shape[0], batch_size):
            model(ids[start:start + batch_size].to(device))
    finally:
        for h in hooks:
            h.remove()
    out = []
    for chunks in store:
        c = torch.cat(chunks)
        if c.shape[0] > max_tokens:
            keep = torch.randperm(c.shape[0], generator=torch.Generator().manual_seed(0))[:max_tokens]
            c = c[keep.sort().values]
        out.append(c)
    return out


def fit_latent_metric(
    c: torch.Tensor, ridge: float | None = None, max_iter: int = 150, min_eig: float = 1e-3
) -> torch.Tensor:
    """PSD G (d x d) making c_t^T G c_t / d as close to 1 as possible over the rows c_t of ``c`` (N x d).

    Least squares over PSD G:  (1/N) sum_t (c_t^T G c_t / d - 1)^2 + (ridge / d) ||G - G0||_F^2, with G0 the
    constant-scale solution (the ridge keeps the problem well posed when N < d(d+1)/2 or the latents span few
    directions; default 4/N, clamped to [1e-4, 0.1], which held up best on held-out text). Convex: solved
    matrix-free (each step costs O(N d^2)) by accelerated projected gradient (FISTA), the projection onto the
    PSD cone clipping eigenvalues; the result's eigenvalues are finally
    clipped at ``min_eig`` x the largest, so M = G^1/2 stays well conditioned. Runs on ``c``'s device.
    """
    c = c.double()
    n, d = c.shape
    if ridge is None:
        ridge = min(max(4.0 / n, 1e-4), 0.1)
    rho2 = (c * c).mean()  # mean over tokens of ms(c)
    x = c / rho2.sqrt()  # normalised: mean ms(x) = 1, so G0 = I
    eye = torch.eye(d, dtype=torch.float64, device=c.device)

    def hess(G: torch.Tensor) -> torch.Tensor:  # the objective's (half) Hessian applied to G
        v = ((x @ G) * x).sum(1)  # x_t^T G x_t
        return (x.T * v) @ x / (n * d * d) + ridge / d * G

    rhs = x.T @ x / (n * d) + ridge / d * eye

    def psd(G: torch.Tensor) -> torch.Tensor:
        evals, evecs = torch.linalg.eigh((G + G.T) / 2)
        return (evecs * evals.clamp_min(0)) @ evecs.T

    # step 1/L, L the largest Hessian eigenvalue (power iteration from I, its dominant direction)
    v = eye / d ** 0.5
    for _ in range(10):
        w = hess(v)
        L = float((w * w).sum().sqrt())
        v = w / L
    step = 1.0 / (1.05 * L)
    G = Y = eye
    t = 1.0
    for _ in range(max_iter):
        G_next = psd(Y - step * (hess(Y) - rhs))
        t_next = (1 + (1 + 4 * t * t) ** 0.5) / 2
        Y = G_next + ((t - 1) / t_next) * (G_next - G)
        done = float((G_next - G).norm()) <= 1e-7 * float(G_next.norm())
        G, t = G_next, t_next
        if done:
            break
    evals, evecs = torch.linalg.eigh(G)
    evals = evals.clamp_min(min_eig * float(evals.max().clamp_min(1e-12)))
    return (evecs * evals) @ evecs.T / rho2


def _norm_scale(cp: torch.Tensor, energy: torch.Tensor, eps: float) -> tuple[float, float]:
    """(LS-optimal constant gamma with gamma / r_t ~ 1, cv of r_t), r_t the stock norm's rms of rows of cp.

    minimises sum_t a_t (1 - gamma / r_t)^2, a_t the up-projected energy |kv_b c_t|^2 of token t.
    """
    r = ((cp * cp).mean(1) + eps).sqrt()
    a = energy.clamp_min(1e-300)
    gamma = float((a / r).sum() / (a / (r * r)).sum())
    cv = float(r.std() / r.mean()) if r.numel() > 1 else 0.0
    return gamma, cv


def _approx_latent(attn, latents: torch.Tensor | None, strategy: str, input_norm: torch.Tensor) -> _Latent:
    """Latent transform for a layer without its own latent norm (``strategy``: fit | scale)."""
    dc = attn.dc
    W_a = attn.kv_a_proj.weight.detach().to("cpu", torch.float64)[:dc]
    b_a = attn.kv_a_proj.bias
    b_c = None if b_a is None else b_a.detach().to("cpu", torch.float64)[:dc]
    W_b = attn.kv_b_proj.weight.detach().to("cpu", torch.float64)
    eye = torch.eye(dc, dtype=torch.float64)
    if latents is None:  # weights only: E[x x^T] ~ diag(w^2) for x = w * (unit-rms vector)
        ms = ((W_a * input_norm.to("cpu", torch.float64)).pow(2).sum() / W_a.shape[1]
              + (0.0 if b_c is None else float(b_c.pow(2).sum()))) / dc
        rho = float(ms) ** 0.5
        rho = rho if rho > 0 else 1.0
        return _Latent(M=eye / rho, B=eye, g=torch.full((dc,), rho, dtype=torch.float64), cv=float("nan"))
    rho = float((latents * latents).mean().sqrt().clamp_min(1e-30))
    if strategy == "fit":
        device = attn.kv_a_proj.weight.device  # fit where the model lives (a GPU makes it fast)
        G = fit_latent_metric(latents.to(device)).cpu()  # c^T G c / dc ~ 1
        evals, evecs = torch.linalg.eigh(G)
        evals = evals.clamp_min(1e-30 * float(evals.max()))
        M = (evecs * evals.sqrt()) @ evecs.T  # symmetric square root: ms(M c) ~ 1
        M_inv = (evecs * evals.rsqrt()) @ evecs.T
    else:
        M, M_inv = eye / rho, eye * rho
    # stock: kv_b' (g * c'/r'), c' = M c; kv_b' = kv_b M^-1 / rho and g = gamma ~ rho r' keeps kv_b c
    cp = latents @ M.T
    gamma, cv = _norm_scale(cp, (latents @ W_b.T).pow(2).sum(1), STOCK_LATENT_NORM_EPS)
    g = torch.full((dc,), gamma * rho, dtype=torch.float64)
    n = g * cp / ((cp * cp).mean(1, keepdim=True) + STOCK_LATENT_NORM_EPS).sqrt()  # what kv_b' reads
    return _Latent(M=M, B=M_inv / rho, g=g, cv=cv, unit=_least_squares_unit(n))


def _least_squares_unit(x: torch.Tensor, ridge: float = 1e-6) -> torch.Tensor:
    """u minimising mean_t (u . x_t - 1)^2 (+ a tiny ridge): u = E[x x^T]^-1 E[x]; rows x_t of ``x`` (N, d)."""
    S = x.T @ x / x.shape[0]
    S = S + ridge * float(S.diagonal().mean().clamp_min(1e-300)) * torch.eye(x.shape[1], dtype=x.dtype)
    return torch.linalg.solve(S, x.mean(0))


def _exact_latent(attn, eps: float) -> _Latent:
    """The model's own latent RMSNorm; rescale the latent so stock's eps acts as ours: s^2 = eps_stock / eps."""
    dc = attn.dc
    s = (STOCK_LATENT_NORM_EPS / eps) ** 0.5
    eye = torch.eye(dc, dtype=torch.float64)
    return _Latent(M=eye * s, B=eye, g=attn.kv_a_norm.weight.detach().to("cpu", torch.float64))


@torch.no_grad()
def _collect_input_moments(model: Transformer, ids: torch.Tensor, batch_size: int = 8) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Per layer (E[x], E[x x^T]) of the attention input x (what q_proj and kv_a_proj read), fp64 CPU.

    Accumulated as running sums on the model's device (fp32 outer products), so memory is hidden^2 per layer
    whatever the number of calibration tokens."""
    h = model.config.hidden_size
    device = model.embed_tokens.weight.device
    sums = [[0, torch.zeros(h, dtype=torch.float64, device=device), torch.zeros(h, h, device=device)]
            for _ in model.layers]
    hooks = []
    for i, block in enumerate(model.layers):
        def hook(_mod, inp, _out, i=i):
            x = inp[0].detach().reshape(-1, h).float()
            sums[i][0] += x.shape[0]
            sums[i][1] += x.sum(0).double()
            sums[i][2] += x.T @ x
        hooks.append(block.self_attn.kv_a_proj.register_forward_hook(hook))
    try:
        for start in range(0, ids.shape[0], batch_size):
            model(ids[start:start + batch_size].to(device))
    finally:
        for hk in hooks:
            hk.remove()
    return [(s.cpu() / n, o.double().cpu() / n) for n, s, o in sums]


@dataclass
class _EngineFold:
    """How one layer's attention biases reach a bias-free stock checkpoint (``target="engines"``).

    A bias b after a linear map W of the attention input x becomes W' = W + b u^T, with u the least-squares
    direction u . x_t ~ 1 on calibration inputs (u = E[x x^T]^-1 E[x]): exact where u . x_t = 1, off by
    b (u . x_t - 1) elsewhere. A constant value v (the kv_b value bias, and the o_proj bias moved in front of
    o_proj: attention weights sum to one, so a constant value passes through unchanged) is added to kv_b' as
    v unit^T, unit . n_t ~ 1 on the exported normalised latents. The key half of a kv_b bias adds the same
    amount to every logit of a query: softmax ignores it, dropped exactly."""

    q_delta: torch.Tensor | None = None  # (H (dn + dr), h), kvgraft's row order
    a_delta: torch.Tensor | None = None  # (dc + dr, h)
    value: torch.Tensor | None = None  # (H dv,): a constant added to every value
    input_cv: float = 0.0  # std / mean of u . x_t on calibration
    o_residual: float = 0.0  # |o_proj v - o_bias| / |o_bias| (0 unless o_proj cannot reach the bias)


def _engine_folds(model: Transformer, moments: list[tuple[torch.Tensor, torch.Tensor]] | None) -> list[_EngineFold | None]:
    """Per layer, the bias folds of ``_EngineFold`` (None: the layer has no bias to fold)."""
    cfg = model.config
    H, dn, dv = cfg.num_heads, cfg.qk_nope_head_dim, cfg.v_head_dim
    out: list[_EngineFold | None] = []
    for i, block in enumerate(model.layers):
        attn = block.self_attn
        bq = attn.q_proj.bias if _nonzero(attn.q_proj.bias) else None
        ba = attn.kv_a_proj.bias if _nonzero(attn.kv_a_proj.bias) else None
        bb = attn.kv_b_proj.bias if _nonzero(attn.kv_b_proj.bias) else None
        bo = attn.o_proj.bias if _nonzero(attn.o_proj.bias) else None
        if bq is None and ba is None and bb is None and bo is None:
            out.append(None)
            continue
        fold = _EngineFold()
        if bq is not None or ba is not None:
            if moments is None:
                raise ValueError(
                    f"layer {i} has attention biases (q_proj / kv_a_proj): the engine-safe stock export folds them "
                    "into the weights through the attention input's mean direction, measured on calibration text; "
                    "pass calibration token ids, or export with target='transformers' (exact, transformers only)")
            mean, second = moments[i]
            S = second + 1e-6 * float(second.diagonal().mean().clamp_min(1e-300)) * torch.eye(
                second.shape[0], dtype=torch.float64)
            u = torch.linalg.solve(S, mean)
            ux_mean = float(u @ mean)
            ux_var = float(u @ second @ u) - ux_mean ** 2
            fold.input_cv = max(ux_var, 0.0) ** 0.5 / max(abs(ux_mean), 1e-300)
            if bq is not None:
                fold.q_delta = bq.detach().to("cpu", torch.float64)[:, None] * u[None, :]
            if ba is not None:
                fold.a_delta = ba.detach().to("cpu", torch.float64)[:, None] * u[None, :]
        value = torch.zeros(H * dv, dtype=torch.float64)
        if bb is not None:
            value += bb.detach().to("cpu", torch.float64).view(H, dn + dv)[:, dn:].reshape(-1)
        if bo is not None:
            W_o = attn.o_proj.weight.detach().to("cpu", torch.float64)  # (h, H dv)
            b_o = bo.detach().to("cpu", torch.float64)
            v = torch.linalg.lstsq(W_o, b_o[:, None]).solution[:, 0]
            fold.o_residual = float((W_o @ v - b_o).norm() / b_o.norm())
            value += v
        if bool(value.abs().max() > 0):
            if moments is None:
                raise ValueError(
                    f"layer {i} has a value or o_proj bias: the engine-safe stock export carries it as a constant "
                    "value through kv_b, fitted on calibration text; pass calibration token ids, or export with "
                    "target='transformers' (exact, transformers only)")
            fold.value = value
        out.append(fold)
    return out


def _latent_unit(lat: _Latent, c: torch.Tensor) -> torch.Tensor:
    """``_least_squares_unit`` of the exported normalised latents of raw latents ``c`` (N, d_c)."""
    cp = c @ lat.M.T + (lat.offset if lat.offset is not None else 0.0)
    return _least_squares_unit(lat.g * cp / ((cp * cp).mean(1, keepdim=True) + STOCK_LATENT_NORM_EPS).sqrt())


# ---- tensors and config ------------------------------------------------------------------------------


def _interleave_perm(dr: int) -> torch.Tensor:
    """Rows of a rotate-half RoPE block (pair j = rows j, j + dr/2) in DeepSeek's interleaved order (2j, 2j+1)."""
    n = dr // 2
    return torch.stack([torch.arange(n), torch.arange(n) + n], dim=1).reshape(-1)


def _stock_tensors(
    model: Transformer, latents: list[_Latent], q_fold: float, attention_bias: bool, low_rank_q: bool,
    folds: list[_EngineFold | None] | None = None,
) -> dict[str, torch.Tensor]:
    """fp64 CPU tensors under DeepSeek-V3's names (``low_rank_q``: queries through q_a/q_a_layernorm/q_b;
    ``folds``: the engine-safe bias folds, in which case no bias tensor is written)."""
    cfg = model.config
    H, h = cfg.num_heads, cfg.hidden_size
    dc, dr, dn, dv = cfg.kv_lora_rank, cfg.qk_rope_head_dim, cfg.qk_nope_head_dim, cfg.v_head_dim
    perm = _interleave_perm(dr)

    def t(x: torch.Tensor) -> torch.Tensor:
        return x.detach().to("cpu", torch.float64)

    def q_rows(x: torch.Tensor) -> torch.Tensor:  # (H (dn + dr), ...) rows in stock's order, yarn fold applied
        x = x.reshape(H, dn + dr, -1) * q_fold
        return torch.cat([x[:, :dn], x[:, dn:][:, perm]], dim=1).reshape(H * (dn + dr), -1)

    out: dict[str, torch.Tensor] = {"model.embed_tokens.weight": t(model.embed_tokens.weight),
                                    "model.norm.weight": t(model.norm.weight),
                                    "lm_head.weight": t(model.lm_head.weight).clone()}  # untied even if tied
    for i, block in enumerate(model.layers):
        p = f"model.layers.{i}."
        attn, lat = block.self_attn, latents[i]
        fold = folds[i] if folds is not None else None
        wq = t(attn.q_proj.weight)
        if fold is not None and fold.q_delta is not None:
            wq = wq + fold.q_delta
        q = q_rows(wq)
        if low_rank_q:
            bq = t(attn.q_proj.bias) if attn.q_proj.bias is not None else torch.zeros(q.shape[0], dtype=torch.float64)
            lr = _low_rank_query(q, q_rows(bq)[:, 0], t(block.input_layernorm.weight))
            out[p + "self_attn.q_a_proj.weight"] = lr.a_weight
            out[p + "self_attn.q_a_proj.bias"] = lr.a_bias
            out[p + "self_attn.q_a_layernorm.weight"] = lr.norm
            out[p + "self_attn.q_b_proj.weight"] = lr.b_weight
        else:
            out[p + "self_attn.q_proj.weight"] = q
        a = t(attn.kv_a_proj.weight)
        if fold is not None and fold.a_delta is not None:
            a = a + fold.a_delta
        kv_a = torch.cat([lat.M @ a[:dc], a[dc:][perm]])
        kv_b = t(attn.kv_b_proj.weight) @ lat.B
        if fold is not None and fold.value is not None:  # a constant value: v unit^T, unit . n_t ~ 1
            unit = lat.unit if lat.unit is not None else lat.M.new_zeros(lat.M.shape[0])
            kv_b = kv_b.view(H, dn + dv, -1).clone()
            kv_b[:, dn:] += fold.value.view(H, dv)[:, :, None] * unit[None, None, :]
            kv_b = kv_b.reshape(H * (dn + dv), -1)
        o = t(attn.o_proj.weight)
        o_bias = t(attn.o_proj.bias) if attn.o_proj.bias is not None else torch.zeros(h, dtype=torch.float64)
        if attn.kv_b_proj.bias is not None:  # key half: softmax-invariant; value half: through to o_proj
            b_v = t(attn.kv_b_proj.bias).view(H, dn + dv)[:, dn:].reshape(-1)
            o_bias = o_bias + o @ b_v
        out[p + "self_attn.kv_a_proj_with_mqa.weight"] = kv_a
        out[p + "self_attn.kv_a_layernorm.weight"] = lat.g.clone()
        out[p + "self_attn.kv_b_proj.weight"] = kv_b
        out[p + "self_attn.o_proj.weight"] = o
        if attention_bias:
            b = t(attn.kv_a_proj.bias) if attn.kv_a_proj.bias is not None else torch.zeros(dc + dr, dtype=torch.float64)
            b_lat = lat.M @ b[:dc] + (lat.offset if lat.offset is not None else 0.0)
            out[p + "self_attn.kv_a_proj_with_mqa.bias"] = torch.cat([b_lat, b[dc:][perm]])
            out[p + "self_attn.o_proj.bias"] = o_bias
        for name in ("gate_proj", "up_proj", "down_proj"):
            out[f"{p}mlp.{name}.weight"] = t(getattr(block.mlp, name).weight)
        out[p + "input_layernorm.weight"] = t(block.input_layernorm.weight)
        out[p + "post_attention_layernorm.weight"] = t(block.post_attention_layernorm.weight)
    return out


def _attention_bias_needed(model: Transformer, latents: list[_Latent], low_rank_q: bool) -> bool:
    cfg = model.config
    if cfg.o_bias or low_rank_q or any(lat.offset is not None for lat in latents):
        return True
    for block in model.layers:
        attn = block.self_attn
        if _nonzero(attn.kv_a_proj.bias) or _nonzero(attn.kv_b_proj.bias):
            return True
    return False


def _q_bias_layers(model: Transformer) -> list[int]:
    return [i for i, b in enumerate(model.layers) if _nonzero(b.self_attn.q_proj.bias)]


def deepseek_v3_config(
    config: ModelConfig, rope_parameters: dict, attention_bias: bool, dtype: str, *,
    kv_lora_rank: int | None = None, q_lora_rank: int | None = None, export_info: dict | None = None,
) -> dict:
    """config.json of the stock checkpoint (DeepSeek's field names; MoE fields present but unused).

    ``kv_lora_rank``/``q_lora_rank``: the exported ranks when they differ from the model's ("pad" latent, a
    query bias through the low-rank query path). ``export_info`` is written as ``kvgraft_export`` (what is
    exact and up to which context; transformers keeps unknown fields as attributes, vLLM ignores them).
    """
    L = config.num_layers
    rope_scaling = None
    if rope_parameters["rope_type"] != "default":  # older readers (transformers 4, vLLM) read rope_scaling
        rope_scaling = {k: v for k, v in rope_parameters.items() if k != "rope_theta"}
        rope_scaling["type"] = rope_parameters["rope_type"]
    return {
        "architectures": ["DeepseekV3ForCausalLM"],
        "model_type": "deepseek_v3",
        "vocab_size": config.vocab_size,
        "hidden_size": config.hidden_size,
        "intermediate_size": config.intermediate_size,
        "num_hidden_layers": L,
        "num_attention_heads": config.num_heads,
        "num_key_value_heads": config.num_heads,  # MLA expands keys/values per query head
        "q_lora_rank": q_lora_rank,
        "kv_lora_rank": config.kv_lora_rank if kv_lora_rank is None else kv_lora_rank,
        "qk_rope_head_dim": config.qk_rope_head_dim,
        "qk_nope_head_dim": config.qk_nope_head_dim,
        "v_head_dim": config.v_head_dim,
        "rope_interleave": True,
        # no MoE layer: every layer < first_k_dense_replace is dense; the expert fields only need to be valid
        "first_k_dense_replace": L,
        "moe_layer_freq": 1,
        "n_routed_experts": 1,
        "n_shared_experts": 1,
        "num_experts_per_tok": 1,
        "moe_intermediate_size": config.intermediate_size,
        "n_group": 1,
        "topk_group": 1,
        "norm_topk_prob": True,
        "routed_scaling_factor": 1.0,
        "num_nextn_predict_layers": 0,  # no multi-token-prediction layer is shipped
        "hidden_act": "silu",
        "max_position_embeddings": config.max_position_embeddings,
        "rms_norm_eps": config.rms_norm_eps,
        "rope_theta": rope_parameters["rope_theta"],
        "rope_parameters": rope_parameters,
        "rope_scaling": rope_scaling,
        "attention_bias": attention_bias,
        "attention_dropout": 0.0,
        "tie_word_embeddings": False,
        "initializer_range": config.initializer_range,
        "bos_token_id": config.bos_token_id,
        "eos_token_id": config.eos_token_id,
        "pad_token_id": config.pad_token_id,
        "use_cache": True,
        "dtype": dtype,
        "torch_dtype": dtype,
    } | ({"kvgraft_export": export_info} if export_info else {})


# ---- export ------------------------------------------------------------------------------------------


def export_deepseek_v3(
    model: Transformer,
    out_dir: str | Path,
    tokenizer_dir: str | Path | None = None,
    overwrite: bool = False,
    latent_norm: str | None = None,
    calibration: torch.Tensor | None = None,
    *,
    target: str = "engines",
    dtype: torch.dtype | None = None,
    measure: bool = True,
    max_fit_tokens: int = 8192,
    verbose: bool = False,
    tail_sequences: int = 8,
) -> ExportReport:
    """Write ``model`` (every layer MLA) as a stock DeepSeek-V3 checkpoint at ``out_dir``.

    ``target``: "engines" (default) writes what vLLM and SGLang load as transformers does: no attention bias
    tensors (``attention_bias: false``; those engines build the projections without biases and skip bias
    tensors), every weight within fp16's range (checked; they serve in fp16/bf16). The latent norm is then
    "fit" (or "scale"), and any attention bias of the model is folded into the weights through the attention
    input's least-squares mean direction (``_EngineFold``; needs ``calibration``), its error measured.
    "transformers": the exact constructions below ("pad", a query bias through the low-rank query path, an
    o_proj bias), which hold constants up to ~1e7 in attention biases: exact in transformers only; a warning
    says so.
    ``latent_norm`` (None: "fit" for engines, "pad" for transformers) applies only to models without their
    own latent norm (``mla_latent_norm=False``):
    "pad" (exact, target "transformers" only): the exported latent has one more coordinate (d_c + 1), a constant so large that
    stock's kv_a_layernorm divides every token by the same rms (to within ``PIN_DELTA`` / 2, from a bound on
    the weights, whatever the input); the norm weight undoes that constant and kv_b ignores the coordinate.
    It costs one cached value per token and layer (and moves d_c off FlashMLA's 512: graft d_c = 511 for
    that). "fit" (needs ``calibration`` token ids (N, T); falls back to "scale" with a warning) and "scale"
    keep d_c and approximate the norm: "scale" keeps the latent basis (normalised to unit mean rms) and sets
    the norm weight to the constant that best restores the latent's magnitude on calibration tokens (about
    its mean rms; without calibration, estimated from the weights for isotropic unit-rms attention inputs).
    "fit" also changes the latent basis, c' = M c and kv_b' = kv_b M^-1, with M^T M =
    ``fit_latent_metric(latents)``, so that rms(c') is as constant as possible.
    A query bias (Qwen2, attention_bias) goes through stock's low-rank query path, exactly by the same
    construction: q_lora_rank = min(hidden, H (d_nope + d_rope)) + 1. A sliding window is exported as full
    attention: exact for contexts up to the window, stated in config.json (``kvgraft_export``), README.md and
    the report, and measured on both sides of it.
    ``calibration``: the last ``tail_sequences`` rows serve the error measurement (max |logit diff|, KL,
    perplexity; random ids without it). ``dtype``: of the written tensors (default: the model's).
    ``measure``: load the result with stock transformers and measure it. ``verbose``: print the report.
    Raises UnsupportedModelError naming what stock DeepSeek-V3 cannot express and what would make it possible.
    """
    out_dir = Path(out_dir)
    if out_dir.exists() and not overwrite:
        raise OutputExistsError(f"{out_dir} already exists; pass overwrite=True to replace it")
    if target not in STOCK_TARGETS:
        raise ValueError(f"target {target!r} is not one of {', '.join(STOCK_TARGETS)} ('engines': vLLM, SGLang and "
                         "transformers; 'transformers': the exact bias constructions, transformers only)")
    if latent_norm is None:
        latent_norm = "fit" if target == "engines" else "pad"
    if latent_norm not in LATENT_NORM_STRATEGIES:
        raise ValueError(f"latent_norm {latent_norm!r} is not one of {', '.join(LATENT_NORM_STRATEGIES)}")
    if target == "engines" and latent_norm == "pad":
        raise ValueError("latent_norm 'pad' holds its constant coordinate in kv_a_proj_with_mqa's bias, which vLLM "
                         "and SGLang do not load (they would silently compute another model); use latent_norm 'fit' "
                         "or 'scale' for target 'engines', or target='transformers' for the exact, transformers-only "
                         "export")
    if isinstance(tail_sequences, bool) or not isinstance(tail_sequences, int) or tail_sequences < 1:
        raise ValueError(f"tail_sequences ({tail_sequences!r}) must be a positive integer")
    cfg = model.config
    problems = _config_problems(cfg) + _weight_problems(model)
    if problems:
        raise UnsupportedModelError("cannot export to stock DeepSeek-V3: " + "; ".join(problems))
    rope_parameters, q_fold, rope_notes = _stock_rope(cfg)
    if calibration is not None and (calibration.dim() != 2 or calibration.numel() == 0):
        raise ValueError(f"calibration must be token ids of shape (N, T), got shape {tuple(calibration.shape)}")
    tokenizer_files: list[Path] = []
    if tokenizer_dir is not None:
        tokenizer_files = [Path(tokenizer_dir) / n for n in TOKENIZER_FILES if (Path(tokenizer_dir) / n).is_file()]
        if not tokenizer_files:
            raise CheckpointError(f"tokenizer directory {tokenizer_dir} has none of {', '.join(TOKENIZER_FILES)}")

    if target == "engines" and calibration is None:
        biased = [i for i, b in enumerate(model.layers)
                  if any(_nonzero(getattr(b.self_attn, n).bias) for n in ("q_proj", "kv_a_proj", "o_proj"))
                  or (b.self_attn.kv_b_proj.bias is not None and _nonzero(
                      b.self_attn.kv_b_proj.bias.view(cfg.num_heads, -1)[:, cfg.qk_nope_head_dim:]))]
        if biased:
            raise ValueError(
                f"layers {biased} have attention biases: the engine-safe stock export folds them into bias-free weights "
                "through the attention input's mean direction, measured on calibration text; pass calibration token "
                "ids, or export with target='transformers' (exact, transformers only)")
    for note in rope_notes:
        if not note.endswith(": exact"):  # serving-stack caveats; an exact re-expression is only reported
            warnings.warn(note, stacklevel=2)
    notes = list(rope_notes)
    if target == "transformers":
        msg = ("target 'transformers': the exact constructions keep constants (up to ~1e7) in attention bias tensors; "
               "only transformers computes this checkpoint as written: vLLM and SGLang skip attention biases without "
               "an error and would serve a different model, and fp16 overflows; use target 'engines' for them")
        warnings.warn(msg, stacklevel=2)
        notes.append(msg)
    approximations: list[str] = []
    folded: list[str] = []
    window = None
    if "sliding_attention" in cfg.layer_types:
        window = cfg.sliding_window
        sliding = [i for i, t in enumerate(cfg.layer_types) if t == "sliding_attention"]
        approximations.append(
            f"layers {sliding} attend within a sliding window of {window} tokens; stock DeepSeek-V3 has no sliding "
            f"window, so they are exported with full attention (the closest stock model): exact for contexts up to "
            f"{window} tokens, different beyond"
        )
    was_training = model.training
    model.eval()
    try:
        if cfg.mla_latent_norm:
            strategy = "exact"
            latents = [_exact_latent(b.self_attn, cfg.rms_norm_eps) for b in model.layers]
            if cfg.rms_norm_eps != STOCK_LATENT_NORM_EPS:
                notes.append(
                    f"rms_norm_eps is {cfg.rms_norm_eps}: the latent is rescaled so transformers' kv_a_layernorm "
                    f"(eps {STOCK_LATENT_NORM_EPS}) matches exactly; vLLM/SGLang apply rms_norm_eps there, i.e. an "
                    f"effective latent-norm eps of {cfg.rms_norm_eps ** 2 / STOCK_LATENT_NORM_EPS:.3g}"
                )
        elif latent_norm == "pad":
            strategy = "pad"
            latents = [_pad_latent(b.self_attn, b.input_layernorm.weight) for b in model.layers]
            folded.append(
                f"latent RMSNorm: one constant latent coordinate (kv_lora_rank {cfg.kv_lora_rank} -> "
                f"{cfg.kv_lora_rank + 1}) pins stock's kv_a_layernorm to a constant rms (relative error <= "
                f"{PIN_DELTA / 2:.0e} for any input), undone by its weight; +1 cached value per token and layer"
            )
        else:
            strategy = latent_norm
            if strategy == "fit" and calibration is None:
                msg = ("latent_norm 'fit' needs calibration token ids; falling back to 'scale' with the latent rms "
                       "estimated from the weights alone")
                warnings.warn(msg, stacklevel=2)
                notes.append(msg)
                strategy = "scale"
            raw = _collect_latents(model, calibration, max_fit_tokens) if calibration is not None else None
            latents = [
                _approx_latent(b.self_attn, None if raw is None else raw[i], strategy,
                               b.input_layernorm.weight.detach())
                for i, b in enumerate(model.layers)
            ]
            for lat in latents:  # scale-free after the norm: only the engines' different eps sees this
                lat.M = lat.M * ENGINE_LATENT_RMS
            approximations.append(
                f"latent RMSNorm approximated ('{strategy}'): stock always normalises the latent and this model "
                "has no latent norm (target='transformers' with latent_norm='pad' makes it exact at one more cached "
                "value per token, in transformers only; a graft with its own latent norm, mla_latent_norm, exports "
                "exactly everywhere)"
            )
        folds = None
        if target == "engines":
            has_bias = any(_nonzero(getattr(b.self_attn, n).bias)
                           for b in model.layers for n in ("q_proj", "kv_a_proj", "kv_b_proj", "o_proj"))
            moments = _collect_input_moments(model, calibration) if has_bias and calibration is not None else None
            folds = _engine_folds(model, moments)
            if any(f is not None and f.value is not None for f in folds) and any(lat.unit is None for lat in latents):
                raw_c = _collect_latents(model, calibration, max_fit_tokens)
                for i, lat in enumerate(latents):
                    if lat.unit is None:
                        lat.unit = _latent_unit(lat, raw_c[i])
            biased = [i for i, f in enumerate(folds) if f is not None]
            if biased:
                kinds = sorted({k for f in folds if f is not None for k, v in (
                    ("query", f.q_delta), ("latent / RoPE key", f.a_delta), ("value / output", f.value)) if v is not None})
                cvs = [f.input_cv for f in folds if f is not None and (f.q_delta is not None or f.a_delta is not None)]
                approximations.append(
                    f"attention biases ({', '.join(kinds)}; layers {biased}) folded into the weights for engines that "
                    "load no bias: a bias b after W becomes W + b u^T with u . x ~ 1 on calibration inputs"
                    + (f" (u . x varies by {max(cvs):.3g} relative std)" if cvs else "")
                    + "; a constant value rides on kv_b through the normalised latent (target='transformers' keeps "
                    "them exact, transformers only)")
                if any(f is not None and f.o_residual > 1e-6 for f in folds):
                    worst = max(f.o_residual for f in folds if f is not None)
                    approximations.append(f"o_proj bias: o_proj cannot produce all of it from the values (relative "
                                          f"residual up to {worst:.3g}); the rest is dropped")
            if any(_nonzero(b.self_attn.kv_b_proj.bias) for b in model.layers):
                folded.append("key bias: adds the same amount to every logit of a query (softmax ignores it): dropped")
        q_bias_layers = _q_bias_layers(model) if cfg.qkv_bias and target == "transformers" else []
        low_rank_q = bool(q_bias_layers)
        H, h = cfg.num_heads, cfg.hidden_size
        Hq = H * (cfg.qk_nope_head_dim + cfg.qk_rope_head_dim)
        q_lora_rank = min(h, Hq) + 1 if low_rank_q else None
        dc_out = latents[0].M.shape[0]
        extra = 0
        if strategy == "pad":
            extra += cfg.num_layers * (h + 2 + H * (cfg.qk_nope_head_dim + cfg.v_head_dim))
        if low_rank_q:
            extra += cfg.num_layers * (q_lora_rank * h + 2 * q_lora_rank + Hq * q_lora_rank - Hq * h)
            folded.append(
                f"query bias (layers {q_bias_layers}): stock's q_proj has no bias, so the queries go through its "
                f"low-rank path q_a_proj (with bias) -> q_a_layernorm -> q_b_proj with q_lora_rank {q_lora_rank} "
                f"(min(hidden {h}, heads x qk_head_dim {Hq}) + 1): a constant coordinate pins the norm's rms "
                f"(relative error <= {PIN_DELTA / 2:.0e}) and carries the bias; "
                f"+{cfg.num_layers * (q_lora_rank * h + 2 * q_lora_rank + Hq * q_lora_rank - Hq * h):,} parameters"
            )
        if target == "transformers" and any(_nonzero(b.self_attn.kv_b_proj.bias) for b in model.layers):
            folded.append("key bias: adds the same amount to every logit of a query (softmax ignores it); value "
                          "bias: through attention (weights sum to one) into o_proj's bias")
        if target == "transformers" and any(_nonzero(b.self_attn.kv_a_proj.bias) for b in model.layers):
            folded.append("latent / RoPE-key bias: kv_a_proj_with_mqa's bias (attention_bias)")
        notes = deepseek_v3_fast_path(cfg.replace(kv_lora_rank=dc_out), cfg.kv_width) + notes
        attention_bias = target == "transformers" and _attention_bias_needed(model, latents, low_rank_q)
        dtype = dtype or model.embed_tokens.weight.dtype
        dtype_name = str(dtype).removeprefix("torch.")
        tensors = _stock_tensors(model, latents, q_fold, attention_bias, low_rank_q, folds)
        if target == "engines":
            big = {k: float(v.abs().max()) for k, v in tensors.items() if v.numel() and float(v.abs().max()) > FP16_MAX}
            if big:
                name = max(big, key=big.get)
                raise UnsupportedModelError(
                    f"{len(big)} exported tensors exceed fp16's range ({FP16_MAX:.0f}), e.g. {name} up to {big[name]:.4g}: "
                    "vLLM and SGLang serve in fp16/bf16; rescale the source model's weights, or export with "
                    "target='transformers' (transformers only)")
        tensors = {k: v.to(dtype).contiguous() for k, v in tensors.items()}
        bad = [k for k, v in tensors.items() if not bool(torch.isfinite(v).all())]
        if bad:
            raise UnsupportedModelError(
                f"the export overflows {dtype_name} in {bad[0]} ({len(bad)} tensors); export in bfloat16 or float32 "
                "(dtype=...), or use latent_norm='fit'")
        info = {"exact": not approximations, "latent_norm": strategy, "target": target}
        if window is not None:
            info |= {"exact_up_to_tokens": window, "sliding_window_of_the_source": window,
                     "note": (f"the source model attends within a sliding window of {window} tokens; this stock "
                              f"DeepSeek-V3 model uses full attention: identical for contexts up to {window} tokens, "
                              "different beyond")}
        config_json = deepseek_v3_config(cfg, rope_parameters, attention_bias, dtype_name, kv_lora_rank=dc_out,
                                         q_lora_rank=q_lora_rank, export_info=info)
        report = ExportReport(path=out_dir, latent_norm=strategy, warnings=notes,
                              latent_rms_cv=tuple(lat.cv for lat in latents), exact=not approximations,
                              approximations=approximations, exact_up_to_tokens=window, kv_lora_rank=dc_out,
                              q_lora_rank=q_lora_rank, extra_parameters=extra, folded=folded, target=target)
        write_checkpoint_dir(out_dir, config_json, tensors, cfg, tokenizer_files,
                             {"README.md": export_card(report)}, overwrite)
        if measure:
            if calibration is not None:
                ids = calibration[-tail_sequences:]
                report.measured_on = f"the calibration tail ({ids.shape[0]} x {ids.shape[1]} tokens)"
            else:
                t = min(64, cfg.max_position_embeddings)
                ids = torch.randint(0, cfg.vocab_size, (4, t), generator=torch.Generator().manual_seed(0))
                report.measured_on = f"random ids ({ids.shape[0]} x {ids.shape[1]} tokens)"
            m = measure_export(model, out_dir, ids, window=window)
            report.max_abs_logit_diff, report.mean_kl = m["max_abs_logit_diff"], m["mean_kl"]
            report.perplexity = m["perplexity"]
            report.max_abs_logit_diff_within_window = m.get("max_abs_logit_diff_within_window")
            (out_dir / "README.md").write_text(export_card(report), encoding="utf-8")
    finally:
        model.train(was_training)
    if verbose:
        print("\n".join(report.summary()), flush=True)
    return report


def export_card(report: ExportReport) -> str:
    """README.md of the export: what it is, what is exact, what is not, and the measured error."""
    lines = ["# Stock DeepSeek-V3 export (kvgraft)", "",
             ("Loads with unmodified `transformers.AutoModelForCausalLM` (`model_type: deepseek_v3`, no remote code). "
              "Converted from a grafted kvgraft model by `kvgraft convert --format deepseek_v3`."), "",
             "## Exactness", ""]
    if report.exact:
        lines.append("**Exact**: this model computes the same function as the kvgraft model it was exported from "
                     "(up to floating-point rounding).")
    elif report.exact_up_to_tokens is not None:
        lines.append(f"**Exact for contexts up to {report.exact_up_to_tokens} tokens**; approximate beyond.")
    else:
        lines.append("**Approximate**: the closest stock DeepSeek-V3 model; the measured cost is below.")
    lines.append("")
    lines += [f"- folded exactly: {f}" for f in report.folded]
    lines += [f"- not exact: {a}" for a in report.approximations]
    if report.max_abs_logit_diff is not None:
        lines += ["", "## Measured", "", f"On {report.measured_on}, fp32, against the kvgraft model:", "",
                  f"- max |logit difference|: {report.max_abs_logit_diff:.3g}",
                  f"- mean KL(kvgraft || export): {report.mean_kl:.3g} nats per token"]
        if report.perplexity:
            lines.append(f"- perplexity: {report.perplexity['kvgraft']:.4g} (kvgraft) vs "
                         f"{report.perplexity['deepseek_v3']:.4g} (this export)")
        if report.max_abs_logit_diff_within_window is not None:
            lines.append(f"- max |logit difference| within the first {report.exact_up_to_tokens} tokens: "
                         f"{report.max_abs_logit_diff_within_window:.3g}")
    lines += ["", "## Serving", ""]
    if report.target == "engines":
        lines += ["Written for engines (`--stock-construction engines`): no attention bias tensor and every weight "
                  "within fp16's range, so vLLM and SGLang (whose DeepSeek models load no attention bias) compute "
                  "what transformers computes.", "",
                  "vLLM on a CPU: run it in its default compiled mode, or with `--enforce-eager` add "
                  "`--compilation-config '{\"custom_ops\": [\"-rotary_embedding\"]}'`: vLLM 0.32's CPU rotary "
                  "kernel rotates the wrong rows of MLA's query/key views under eager mode (only position 0 comes "
                  "out right; kvgraft's docs/vllm.md). MLA backends on vLLM's CPUs need kv_lora_rank 512 and "
                  "qk_rope_head_dim 64 (`kvgraft convert --target vllm`)."]
    else:
        lines += ["**Transformers only** (`--stock-construction transformers`): the exact constructions hold "
                  "constants in attention bias tensors, which vLLM and SGLang skip without an error: they would "
                  "serve a different model. Export with the default `--stock-construction engines` for them."]
    if report.warnings:
        lines += ["", "## Notes", ""] + [f"- {w}" for w in report.warnings]
    return "\n".join(lines) + "\n"


@torch.no_grad()
def load_stock(export_dir: str | Path, dtype: torch.dtype = torch.float32):
    """The exported checkpoint in stock transformers (AutoModelForCausalLM), checked to load cleanly."""
    from transformers import AutoModelForCausalLM

    stock, info = AutoModelForCausalLM.from_pretrained(str(export_dir), dtype=dtype, output_loading_info=True)
    bad = {k: v for k, v in info.items() if k in ("missing_keys", "unexpected_keys", "mismatched_keys") and v}
    if bad:
        raise CheckpointError(f"{export_dir} does not load cleanly in transformers: {bad}")
    return stock.eval()


@torch.no_grad()
def _logits_pair(model: Transformer, stock, ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    ours = model if model.embed_tokens.weight.dtype == torch.float32 else copy.deepcopy(model).float()
    was_training = ours.training
    ours.eval()
    try:
        device = ours.embed_tokens.weight.device
        a = ours(ids.to(device)).double().cpu()
    finally:
        ours.train(was_training)
    return a, stock(ids.cpu()).logits.double()


def _kl(a: torch.Tensor, b: torch.Tensor) -> float:
    log_p, log_q = torch.log_softmax(a, -1), torch.log_softmax(b, -1)
    return float((log_p.exp() * (log_p - log_q)).sum(-1).mean())


def _perplexity(logits: torch.Tensor, ids: torch.Tensor) -> float:
    if ids.shape[1] < 2:
        return float("nan")
    nll = torch.nn.functional.cross_entropy(logits[:, :-1].reshape(-1, logits.shape[-1]), ids[:, 1:].reshape(-1))
    return float(torch.exp(nll))


@torch.no_grad()
def measure_export(model: Transformer, export_dir: str | Path, ids: torch.Tensor, window: int | None = None) -> dict:
    """max |logit diff|, mean KL(ours || exported) and both perplexities on ``ids`` (B, T), fp32; with ``window``
    also the max |logit diff| over the first ``window`` positions (where a windowed model is exactly exported)."""
    stock = load_stock(export_dir)
    a, b = _logits_pair(model, stock, ids)
    out = {"max_abs_logit_diff": float((a - b).abs().max()), "mean_kl": _kl(a, b),
           "perplexity": {"kvgraft": _perplexity(a, ids), "deepseek_v3": _perplexity(b, ids)}}
    if window is not None:
        w = min(window, ids.shape[1])
        a_w, b_w = _logits_pair(model, stock, ids[:, :w])
        out["max_abs_logit_diff_within_window"] = float((a_w - b_w).abs().max())
    return out


@torch.no_grad()
def measure_export_error(model: Transformer, export_dir: str | Path, ids: torch.Tensor) -> tuple[float, float]:
    """(max |logit difference|, mean KL(ours || exported) per token) on ``ids`` (B, T), both in fp32.

    The exported checkpoint is loaded with stock transformers (CPU); ``model`` runs on a float32 copy when
    it is not float32 already.
    """
    m = measure_export(model, export_dir, ids)
    return m["max_abs_logit_diff"], m["mean_kl"]


__all__ = [
    "PIN_DELTA",
    "ExportReport",
    "deepseek_v3_config",
    "deepseek_v3_fast_path",
    "export_card",
    "export_deepseek_v3",
    "fit_latent_metric",
    "load_stock",
    "measure_export",
    "measure_export_error",
    "stride_rope_index",
]
