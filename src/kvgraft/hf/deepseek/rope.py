"""Stock DeepSeek-V3's RoPE: the kvgraft frequency layouts it holds, and their scaling re-expressed for it.

RoPE: stock rotates pair j at theta'^(-2j/d_rope) in every layer, each frequency once. Two kvgraft
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
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any, NoReturn

import torch

from kvgraft.errors import ConfigError, UnsupportedModelError
from kvgraft.model.config import ModelConfig, RopeConfig
from kvgraft.model.fields import known
from kvgraft.model.rope import rope_frequencies


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
    """ "stride" or "prefix" when every MLA layer of ``config`` has that RoPE frequency layout (both are stock
    DeepSeek-V3's pair j at theta'^(-2j/d_rope), for theta' = theta resp. theta^(d_rope/head_dim)); "stride" when
    they coincide (d_rope = head_dim); None otherwise (per-layer or repeated frequencies: kvgraft's own)."""
    mla = [i for i, k in enumerate(config.attention_kinds) if k == "mla"]
    if not mla:
        return None
    freq_index = known(config.rope_freq_index, "rope_freq_index")  # set on every config with an MLA layer
    layouts = {tuple(freq_index[i]) for i in mla}
    if len(layouts) != 1:
        return None
    (index,) = layouts
    if index == stride_rope_index(config):
        return "stride"
    if index == prefix_rope_index(config):
        return "prefix"
    return None


def _yarn_range_for_stock(
    rope: RopeConfig, d: int, dr: int, max_pos: int, stride: int | None = None, stock_theta: float | None = None
) -> tuple[float, float, bool] | None:
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


def stock_rope_parameters(config: ModelConfig, layout: str | None = None) -> tuple[dict, float, list[str]]:
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
    d, dr, max_pos = config.head_dim, known(config.qk_rope_head_dim, "qk_rope_head_dim"), config.max_position_embeddings
    kind = rope.rope_type
    if layout is None:
        layout = stock_rope_layout(config) or "stride"
    if layout not in STOCK_ROPE_LAYOUTS:
        raise ConfigError(f"layout {layout!r} is not one of {', '.join(STOCK_ROPE_LAYOUTS)}")
    if layout == "prefix" and dr == d:
        layout = "stride"  # the same frequencies, at the model's own theta
    if kind == "dynamic" and dr != d:
        raise UnsupportedModelError(
            f"rope_type 'dynamic' cannot be exported to stock DeepSeek-V3 with qk_rope_head_dim {dr} != head_dim "
            f"{d}: beyond max_position_embeddings it rescales the base as base * r^(dim/(dim-2)), and stock uses "
            f"dim = {dr} where kvgraft uses {d}, so the frequencies would differ (whatever the rope selection); "
            f"graft with --rope-dim {d} (qk_rope_head_dim = head_dim), or use --format kvgraft"
        )
    idx = list(known(stride_rope_index(config) if layout == "stride" else prefix_rope_index(config), f"{layout} RoPE layout"))
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
            solved = (
                None
                if torch.allclose(ours[idx].double(), same.double(), rtol=2e-6, atol=0)
                else _yarn_range_for_stock(rope, d, dr, max_pos, stride=1, stock_theta=stock_theta)
            )
        if solved is not None:
            beta_fast, beta_slow, truncate = solved
            stock_rope = dataclasses.replace(stock_rope, beta_fast=beta_fast, beta_slow=beta_slow, truncate=truncate)
    stock, stock_scale = rope_frequencies(stock_rope, dr, max_pos)
    if not torch.allclose(ours[idx].double(), stock.double(), rtol=2e-6, atol=0) or abs(our_scale - stock_scale) > 1e-9:
        _refuse_mismatch(kind, layout, d, dr, idx, ours, stock)
    params: dict = {"rope_type": kind, "rope_theta": stock_theta}
    if layout == "prefix":
        notes.append(
            f"prefix RoPE layout: rope_theta {rope.theta:g} -> {stock_theta:.9g} (= rope_theta^(d_rope/head_dim) "
            f"= rope_theta^({dr}/{d})), so stock's pair j rotates at kvgraft's frequency j: exact"
        )
    if kind in ("linear", "dynamic"):
        params["factor"] = float(known(rope.factor, "rope factor"))
    elif kind == "llama3":  # RopeConfig requires these for llama3
        params |= {
            "factor": float(known(rope.factor, "rope factor")),
            "low_freq_factor": float(known(rope.low_freq_factor, "rope low_freq_factor")),
            "high_freq_factor": float(known(rope.high_freq_factor, "rope high_freq_factor")),
            "original_max_position_embeddings": int(
                known(rope.original_max_position_embeddings, "rope original_max_position_embeddings")
            ),
        }
    elif kind == "yarn":
        yarn_params, yarn_notes = _yarn_parameters(rope, stock_rope, max_pos, solved is not None, d, dr)
        params |= yarn_params
        notes += yarn_notes
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


def _refuse_mismatch(
    kind: str, layout: str, d: int, dr: int, idx: list[int], ours: torch.Tensor, stock: torch.Tensor
) -> NoReturn:
    """UnsupportedModelError: no stock setting of ``kind`` gives kvgraft's frequencies at ``idx``; names the fix."""
    if layout == "stride":
        fix = (
            f"graft with --rope-selection prefix (rope_theta' = rope_theta^(d_rope/head_dim)) if it fits, "
            f"--rope-dim {d} (qk_rope_head_dim = head_dim), or use --format kvgraft"
        )
    else:
        fix = (
            f"graft with --rope-selection stride (an even --rope-dim dividing head_dim {d}), --rope-dim {d} "
            "(qk_rope_head_dim = head_dim), or use --format kvgraft"
        )
    raise UnsupportedModelError(
        f"rope_type {kind!r} with these parameters cannot be exported exactly to stock DeepSeek-V3 at "
        f"qk_rope_head_dim {dr} with the {layout} layout: stock computes its frequencies for dim = {dr}, kvgraft "
        f"for dim = head_dim = {d} at frequencies {tuple(idx)}, and no stock {kind} setting gives the same ones "
        f"(max relative difference {float(((ours[idx] - stock) / stock).abs().max()):.3g}; yarn's correction "
        f"range would need to reach past pair {dr - 1}); {fix}"
    )


def _yarn_parameters(
    rope: RopeConfig, stock_rope: RopeConfig, max_pos: int, solved: bool, d: int, dr: int
) -> tuple[dict[str, Any], list[str]]:
    """Stock's yarn rope_parameters (``stock_rope``'s betas, both mscales explicit) and the notes they need;
    ``solved``: the betas were re-expressed for dim = d_rope."""
    params: dict[str, Any] = {}
    notes: list[str] = []
    original = rope.original_max_position_embeddings or max_pos
    params["original_max_position_embeddings"] = int(original)
    params["factor"] = float(rope.factor if rope.factor is not None else max_pos / original)
    for name in ("beta_fast", "beta_slow"):
        if getattr(stock_rope, name):
            params[name] = float(getattr(stock_rope, name))
    if solved:
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
    return params, notes


__all__ = [
    "STOCK_ROPE_LAYOUTS",
    "prefix_rope_index",
    "stock_rope_layout",
    "stock_rope_parameters",
    "stride_rope_index",
]
