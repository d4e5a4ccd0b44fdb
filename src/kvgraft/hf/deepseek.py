"""Export an all-MLA kvgraft model as a stock DeepSeek-V3 checkpoint (``model_type: deepseek_v3``).

The directory (config.json, model.safetensors, generation_config.json, tokenizer files) loads with
unmodified ``transformers.AutoModelForCausalLM.from_pretrained`` (no remote code, no kvgraft) and uses
DeepSeek's own tensor names, so MLA serving stacks (vLLM, SGLang) read it as they read DeepSeek's
checkpoints: dense SwiGLU MLPs only (``first_k_dense_replace = num_hidden_layers``, no MoE layer, no MTP
layer), ``q_lora_rank: null`` (a plain ``q_proj``), ``num_key_value_heads = num_attention_heads``,
``rope_interleave: true``.

What is exact and what is not:
- q_proj, kv_a_proj_with_mqa, kv_b_proj, o_proj, norms, MLP, embeddings: exact. The RoPE rows are permuted
  from kvgraft's rotate-half layout to DeepSeek's interleaved one (q per head, and the shared RoPE key);
  a yarn ``mscale_all_dim`` softmax factor that stock applies and kvgraft does not is folded into q_proj;
  a kv_b_proj bias is folded exactly (its key half adds the same amount to every logit of a query, so
  softmax ignores it; its value half passes through attention, whose weights sum to one, into the o_proj
  bias). A q_proj bias cannot be expressed and is refused unless zero.
- The latent RMSNorm: stock DeepSeek-V3 always normalises the latent (``kv_a_layernorm``). A model built
  with ``mla_latent_norm=True`` exports exactly. Otherwise the export is an approximation: the norm is
  made as close to a constant scale as possible ("scale": a constant weight equal to the latent's typical
  rms; "fit": also an invertible change of latent basis making the rms as constant as possible over
  calibration tokens). ``ExportReport`` carries the measured logit error.

transformers builds ``kv_a_layernorm`` with eps 1e-6 whatever ``rms_norm_eps`` says, while vLLM and SGLang
use ``rms_norm_eps``. The export is exact in transformers; when ``rms_norm_eps != 1e-6`` the serving stacks
see the latent norm with a slightly different eps (the report says so). Older vLLM releases refuse a
DeepSeek-V2/V3 model without any MoE layer ("No DeepseekV2MoE layer found in model.layers"); newer ones
log a warning and load it.
"""

from __future__ import annotations

import copy
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


LATENT_NORM_STRATEGIES = ("fit", "scale")
# transformers' DeepseekV3Attention builds kv_a_layernorm with the RMSNorm default eps, not rms_norm_eps
STOCK_LATENT_NORM_EPS = 1e-6
FLASH_MLA_KV_LORA_RANK = 512
FLASH_MLA_ROPE_HEAD_DIM = 64


@dataclass
class ExportReport:
    """What ``export_deepseek_v3`` wrote and how far the checkpoint is from the kvgraft model.

    ``latent_norm``: "exact" (the model has its own latent norm), "scale" or "fit".
    ``max_abs_logit_diff`` / ``mean_kl`` (KL(ours || exported) per token, nats): measured in fp32 with stock
    transformers on ``measured_on`` ("calibration" or "random") ids; None when not measured.
    ``latent_rms_cv``: per layer, std/mean of the exported latent's rms over calibration tokens (0 when the
    export is exact; what the norm approximation cannot absorb). ``warnings``: fast-path and fallback notes.
    """

    path: Path
    latent_norm: str
    max_abs_logit_diff: float | None = None
    mean_kl: float | None = None
    measured_on: str | None = None
    latent_rms_cv: tuple[float, ...] = ()
    warnings: list[str] = field(default_factory=list)


# ---- what stock DeepSeek-V3 can express ---------------------------------------------------------------


def stride_rope_index(config: ModelConfig) -> tuple[int, ...] | None:
    """The frequency layout stock DeepSeek-V3 uses (every (head_dim/d_rope)-th frequency), or None."""
    d, dr = config.head_dim, config.qk_rope_head_dim
    if not dr or d % dr:
        return None
    return tuple(range(0, d // 2, d // dr))


def _config_problems(config: ModelConfig) -> list[str]:
    problems = []
    gqa = [i for i, k in enumerate(config.attention_kinds) if k != "mla"]
    if gqa:
        problems.append(
            f"layers {gqa} use GQA attention ({len(gqa)} of {config.num_layers}); stock DeepSeek-V3 runs MLA in "
            "every layer, so convert all layers (graft_mla with GraftConfig(layers=None)) before exporting"
        )
    if "sliding_attention" in config.layer_types:
        sliding = [i for i, t in enumerate(config.layer_types) if t == "sliding_attention"]
        problems.append(
            f"layers {sliding} use a sliding window ({config.sliding_window}); stock DeepSeek-V3 has no sliding "
            "windows (every layer attends to the whole context)"
        )
    if config.qk_norm:
        problems.append("qk_norm (per-head q/k RMSNorm, Qwen3) has no place in stock DeepSeek-V3's attention")
    if config.kv_slots != tuple(range(config.num_layers)):
        problems.append(
            f"kv_slots {config.kv_slots} share caches across layers; stock DeepSeek-V3 has one cache per layer"
        )
    if not gqa:
        stride = stride_rope_index(config)
        bad = [i for i in range(config.num_layers) if config.rope_freq_index[i] != stride]
        if bad:
            problems.append(
                f"the RoPE frequency layout of layers {bad} (rope_freq_index {config.rope_freq_index[bad[0]]}) is "
                f"not stock DeepSeek-V3's, which rotates RoPE pair j at theta^(-2j/d_rope), i.e. frequency "
                f"indices {stride if stride is not None else '(0, s, 2s, ...)'} of head_dim/2; graft with "
                "rope_selection='stride' to export to stock DeepSeek-V3 (the 'norm' selection needs kvgraft's "
                "own format)"
            )
    return problems


def _weight_problems(model: Transformer) -> list[str]:
    problems = []
    cfg = model.config
    if cfg.qkv_bias:
        nonzero = [i for i, b in enumerate(model.layers) if _nonzero(b.self_attn.q_proj.bias)]
        if nonzero:
            problems.append(
                f"q_proj of layers {nonzero} has a non-zero bias (q/k/v biases, e.g. Qwen2); stock DeepSeek-V3's "
                "q_proj has no bias and a query bias cannot be folded exactly (kv_b_proj and kv_a_proj biases can)"
            )
    if cfg.mlp_bias:
        nonzero = [i for i, b in enumerate(model.layers)
                   if any(_nonzero(getattr(b.mlp, n).bias) for n in ("gate_proj", "up_proj", "down_proj"))]
        if nonzero:
            problems.append(f"the MLP of layers {nonzero} has non-zero biases; stock DeepSeek-V3's MLP has none")
    return problems


def _nonzero(t: torch.Tensor | None) -> bool:
    return t is not None and bool(t.detach().abs().max() > 0)


def _stock_rope(config: ModelConfig) -> tuple[dict, float, list[str]]:
    """(rope_parameters for config.json, factor to fold into q_proj, notes); raises when stock cannot match ours.

    Stock DeepSeek-V3 computes its frequencies with dim = qk_rope_head_dim; ours come from dim = head_dim at
    the stride indices. Equal for default/linear/llama3 (functions of each base frequency alone); dynamic NTK
    rescales the base with an exponent dim/(dim-2) and yarn places its ramp in units of dim, so those match
    only in special cases (always when d_rope == head_dim): checked numerically, refused otherwise.
    """
    rope: RopeConfig = config.rope
    d, dr, max_pos = config.head_dim, config.qk_rope_head_dim, config.max_position_embeddings
    kind = rope.rope_type
    if kind == "dynamic" and dr != d:
        raise UnsupportedModelError(
            f"rope_type 'dynamic' cannot be exported to stock DeepSeek-V3 with qk_rope_head_dim {dr} != head_dim "
            f"{d}: beyond max_position_embeddings it rescales the base as base * r^(dim/(dim-2)), and stock uses "
            f"dim = {dr} where kvgraft uses {d}, so the frequencies would differ (graft with qk_rope_head_dim = "
            "head_dim, or export kvgraft's own format)"
        )
    idx = list(stride_rope_index(config))
    ours, our_scale = rope_frequencies(rope, d, max_pos)
    stock, stock_scale = rope_frequencies(rope, dr, max_pos)
    if not torch.allclose(ours[idx].double(), stock.double(), rtol=1e-6, atol=0) or abs(our_scale - stock_scale) > 1e-9:
        raise UnsupportedModelError(
            f"rope_type {kind!r} with these parameters cannot be exported exactly to stock DeepSeek-V3: stock "
            f"computes its frequencies for dim = qk_rope_head_dim = {dr}, kvgraft for dim = head_dim = {d} at every "
            f"{d // dr}-th frequency, and for {kind} they differ (max relative difference "
            f"{float(((ours[idx] - stock) / stock).abs().max()):.3g}; yarn's correction range is truncated in "
            "units of dim). Graft with qk_rope_head_dim = head_dim to export it"
        )
    notes = []
    params: dict = {"rope_type": kind, "rope_theta": float(rope.theta)}
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
            if getattr(rope, name):
                params[name] = float(getattr(rope, name))
        # Both mscales explicit, so that transformers and DeepSeek's own yarn (vLLM/SGLang: attention factor
        # mscale(f, mscale) / mscale(f, mscale_all_dim), defaults 1 and 0) agree with kvgraft, which uses the
        # ratio only when both are set and mscale(f, 1) otherwise.
        if rope.mscale and rope.mscale_all_dim:
            params["mscale"], params["mscale_all_dim"] = float(rope.mscale), float(rope.mscale_all_dim)
        else:
            params["mscale"], params["mscale_all_dim"] = 1.0, 0.0
        if rope.attention_factor is not None:
            params["attention_factor"] = float(rope.attention_factor)
        if not rope.truncate:
            params["truncate"] = False
        if rope.attention_factor is not None or not rope.truncate:
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
    """How one layer's latent maps to stock: c' = M c (kv_a rows), kv_b' = kv_b @ B, norm weight g."""

    M: torch.Tensor  # (dc, dc)
    B: torch.Tensor  # (dc, dc)
    g: torch.Tensor  # (dc,)
    cv: float = 0.0


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
    gamma, cv = _norm_scale(latents @ M.T, (latents @ W_b.T).pow(2).sum(1), STOCK_LATENT_NORM_EPS)
    return _Latent(M=M, B=M_inv / rho, g=torch.full((dc,), gamma * rho, dtype=torch.float64), cv=cv)


def _exact_latent(attn, eps: float) -> _Latent:
    """The model's own latent RMSNorm; rescale the latent so stock's eps acts as ours: s^2 = eps_stock / eps."""
    dc = attn.dc
    s = (STOCK_LATENT_NORM_EPS / eps) ** 0.5
    eye = torch.eye(dc, dtype=torch.float64)
    return _Latent(M=eye * s, B=eye, g=attn.kv_a_norm.weight.detach().to("cpu", torch.float64))


# ---- tensors and config ------------------------------------------------------------------------------


def _interleave_perm(dr: int) -> torch.Tensor:
    """Rows of a rotate-half RoPE block (pair j = rows j, j + dr/2) in DeepSeek's interleaved order (2j, 2j+1)."""
    n = dr // 2
    return torch.stack([torch.arange(n), torch.arange(n) + n], dim=1).reshape(-1)


def _stock_tensors(
    model: Transformer, latents: list[_Latent], q_fold: float, attention_bias: bool
) -> dict[str, torch.Tensor]:
    """fp64 CPU tensors under DeepSeek-V3's names."""
    cfg = model.config
    H, h = cfg.num_heads, cfg.hidden_size
    dc, dr, dn, dv = cfg.kv_lora_rank, cfg.qk_rope_head_dim, cfg.qk_nope_head_dim, cfg.v_head_dim
    perm = _interleave_perm(dr)

    def t(x: torch.Tensor) -> torch.Tensor:
        return x.detach().to("cpu", torch.float64)

    out: dict[str, torch.Tensor] = {"model.embed_tokens.weight": t(model.embed_tokens.weight),
                                    "model.norm.weight": t(model.norm.weight),
                                    "lm_head.weight": t(model.lm_head.weight).clone()}  # untied even if tied
    for i, block in enumerate(model.layers):
        p = f"model.layers.{i}."
        attn, lat = block.self_attn, latents[i]
        q = t(attn.q_proj.weight).view(H, dn + dr, h) * q_fold
        q = torch.cat([q[:, :dn], q[:, dn:][:, perm]], dim=1).reshape(H * (dn + dr), h)
        a = t(attn.kv_a_proj.weight)
        kv_a = torch.cat([lat.M @ a[:dc], a[dc:][perm]])
        kv_b = t(attn.kv_b_proj.weight) @ lat.B
        o = t(attn.o_proj.weight)
        o_bias = t(attn.o_proj.bias) if attn.o_proj.bias is not None else torch.zeros(h, dtype=torch.float64)
        if attn.kv_b_proj.bias is not None:  # key half: softmax-invariant; value half: through to o_proj
            b_v = t(attn.kv_b_proj.bias).view(H, dn + dv)[:, dn:].reshape(-1)
            o_bias = o_bias + o @ b_v
        out[p + "self_attn.q_proj.weight"] = q
        out[p + "self_attn.kv_a_proj_with_mqa.weight"] = kv_a
        out[p + "self_attn.kv_a_layernorm.weight"] = lat.g.clone()
        out[p + "self_attn.kv_b_proj.weight"] = kv_b
        out[p + "self_attn.o_proj.weight"] = o
        if attention_bias:
            b = t(attn.kv_a_proj.bias) if attn.kv_a_proj.bias is not None else torch.zeros(dc + dr, dtype=torch.float64)
            out[p + "self_attn.kv_a_proj_with_mqa.bias"] = torch.cat([lat.M @ b[:dc], b[dc:][perm]])
            out[p + "self_attn.o_proj.bias"] = o_bias
        for name in ("gate_proj", "up_proj", "down_proj"):
            out[f"{p}mlp.{name}.weight"] = t(getattr(block.mlp, name).weight)
        out[p + "input_layernorm.weight"] = t(block.input_layernorm.weight)
        out[p + "post_attention_layernorm.weight"] = t(block.post_attention_layernorm.weight)
    return out


def _attention_bias_needed(model: Transformer) -> bool:
    cfg = model.config
    if cfg.o_bias:
        return True
    for block in model.layers:
        attn = block.self_attn
        if _nonzero(attn.kv_a_proj.bias) or _nonzero(attn.kv_b_proj.bias):
            return True
    return False


def deepseek_v3_config(config: ModelConfig, rope_parameters: dict, attention_bias: bool, dtype: str) -> dict:
    """config.json of the stock checkpoint (DeepSeek's field names; MoE fields present but unused)."""
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
        "q_lora_rank": None,
        "kv_lora_rank": config.kv_lora_rank,
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
    }


# ---- export ------------------------------------------------------------------------------------------


def export_deepseek_v3(
    model: Transformer,
    out_dir: str | Path,
    tokenizer_dir: str | Path | None = None,
    overwrite: bool = False,
    latent_norm: str = "fit",
    calibration: torch.Tensor | None = None,
    *,
    dtype: torch.dtype | None = None,
    measure: bool = True,
    max_fit_tokens: int = 8192,
) -> ExportReport:
    """Write ``model`` (every layer MLA) as a stock DeepSeek-V3 checkpoint at ``out_dir``.

    ``latent_norm`` applies only to models without their own latent norm (``mla_latent_norm=False``):
    "fit" (needs ``calibration`` token ids (N, T); falls back to "scale" with a warning) or "scale". "scale"
    keeps the latent basis (normalised to unit mean rms) and sets the norm weight to the constant that best
    restores the latent's magnitude on calibration tokens (about its mean rms; without calibration, estimated
    from the weights for isotropic unit-rms attention inputs). "fit" also changes the latent basis,
    c' = M c and kv_b' = kv_b M^-1, with M^T M = ``fit_latent_metric(latents)``, so that rms(c') is as
    constant as possible.
    ``calibration`` also serves the error measurement (random ids without it). ``dtype``: of the written
    tensors (default: the model's). ``measure``: load the result with stock transformers and measure it.
    Raises UnsupportedModelError naming what stock DeepSeek-V3 cannot express.
    """
    out_dir = Path(out_dir)
    if out_dir.exists() and not overwrite:
        raise OutputExistsError(f"{out_dir} already exists; pass overwrite=True to replace it")
    if latent_norm not in LATENT_NORM_STRATEGIES:
        raise ValueError(f"latent_norm {latent_norm!r} is not one of {', '.join(LATENT_NORM_STRATEGIES)}")
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

    notes = deepseek_v3_fast_path(cfg) + rope_notes
    for note in rope_notes:
        warnings.warn(note, stacklevel=2)
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
        attention_bias = _attention_bias_needed(model)
        dtype = dtype or model.embed_tokens.weight.dtype
        dtype_name = str(dtype).removeprefix("torch.")
        tensors = _stock_tensors(model, latents, q_fold, attention_bias)
        tensors = {k: v.to(dtype).contiguous() for k, v in tensors.items()}
        config_json = deepseek_v3_config(cfg, rope_parameters, attention_bias, dtype_name)
        write_checkpoint_dir(out_dir, config_json, tensors, cfg, tokenizer_files, {}, overwrite)
        report = ExportReport(path=out_dir, latent_norm=strategy, warnings=notes,
                              latent_rms_cv=tuple(lat.cv for lat in latents))
        if measure:
            if calibration is not None:
                ids, report.measured_on = calibration[:8], "calibration"
            else:
                t = min(64, cfg.max_position_embeddings)
                ids = torch.randint(0, cfg.vocab_size, (4, t), generator=torch.Generator().manual_seed(0))
                report.measured_on = "random"
            report.max_abs_logit_diff, report.mean_kl = measure_export_error(model, out_dir, ids)
    finally:
        model.train(was_training)
    return report


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
def measure_export_error(model: Transformer, export_dir: str | Path, ids: torch.Tensor) -> tuple[float, float]:
    """(max |logit difference|, mean KL(ours || exported) per token) on ``ids`` (B, T), both in fp32.

    The exported checkpoint is loaded with stock transformers (CPU); ``model`` runs on a float32 copy when
    it is not float32 already.
    """
    stock = load_stock(export_dir)
    ours = model if model.embed_tokens.weight.dtype == torch.float32 else copy.deepcopy(model).float()
    was_training = ours.training
    ours.eval()
    try:
        device = ours.embed_tokens.weight.device
        a = ours(ids.to(device)).double().cpu()
    finally:
        ours.train(was_training)
    b = stock(ids.cpu()).logits.double()
    log_p, log_q = torch.log_softmax(a, -1), torch.log_softmax(b, -1)
    kl = (log_p.exp() * (log_p - log_q)).sum(-1).mean()
    return float((a - b).abs().max()), float(kl)


__all__ = [
    "ExportReport",
    "deepseek_v3_config",
    "deepseek_v3_fast_path",
    "export_deepseek_v3",
    "fit_latent_metric",
    "load_stock",
    "measure_export_error",
    "stride_rope_index",
]
