"""The latent RMSNorm stock DeepSeek-V3 always applies, and the low-rank query path that carries a query bias.

- The latent RMSNorm: stock DeepSeek-V3 always normalises the latent (``kv_a_layernorm``). A model built
  with ``mla_latent_norm=True`` exports exactly. Otherwise the default ("pad") is exact by the same
  construction: one extra latent coordinate holds a constant A0 (kv_a bias) that pins the norm's rms, the
  norm weight undoes it and kv_b gives that coordinate a zero column (d_c + 1 cached values; ``kvgraft
  convert --format deepseek_v3`` grafts d_c - 1 so the export stays within the budget). The older
  approximations remain: "scale" (a constant weight equal to the latent's typical rms) and "fit" (also an
  invertible change of latent basis making the rms as constant as possible over calibration tokens); they keep
  d_c (say, FlashMLA's 512) at a measured cost.
- A q_proj bias (Qwen2, Llama attention_bias): stock's q_proj has no bias, but its low-rank query path has
  one (q_a_proj) followed by an RMSNorm (q_a_layernorm) and q_b_proj. The query goes through it with
  q_lora_rank = min(hidden, H (d_nope + d_rope)) + 1: q_a x = [P x ; A0], A0 a constant (power of two) so large
  against a bound on |P x| over *every* input (the input RMSNorm bounds |x / g|^2 by hidden) that the norm's
  rms is constant to a relative 5e-11; the norm weight turns the result into [P x ; 1] and q_b = [W_q, b_q]
  (or [I, b_q]). Exact; costs about hidden^2 parameters per layer.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

import torch

from kvgraft.hf.deepseek.checks import mla_layers
from kvgraft.model.transformer import Transformer

LATENT_NORM_STRATEGIES = ("pad", "fit", "scale")
# rms of the exported latent for the fitted/scaled latent norms: transformers' kv_a_layernorm uses eps 1e-6,
# vLLM/SGLang use rms_norm_eps (often 1e-5); at ms(latent) = 256 the two differ by < 4e-8 relative
ENGINE_LATENT_RMS = 16.0
# transformers' DeepseekV3Attention builds kv_a_layernorm with the RMSNorm default eps, not rms_norm_eps
STOCK_LATENT_NORM_EPS = 1e-6


@dataclass
class Latent:
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
        bound = float(input_norm.double().abs().max()) * h**0.5
    else:
        bound = float(torch.linalg.matrix_norm(weight.double() * input_norm.double(), ord=2)) * h**0.5
    if bias is not None:
        bound += float(bias.double().norm())
    return _pow2_above(max(bound, 1e-6) / PIN_DELTA**0.5)


def pad_latent(attn, input_norm: torch.Tensor) -> Latent:
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
    return Latent(M=M, B=M.T.clone(), g=g, cv=0.0, offset=offset, bound=PIN_DELTA / 2)


@dataclass
class LowRankQuery:
    """A query with a bias through stock's q_a_proj (bias) -> q_a_layernorm -> q_b_proj (no bias).

    q_a x = [P x ; A0] with A0 pinning the norm's rms (as for "pad"), the norm weight turning it into
    [P x ; 1], and q_b = [Q, b]: Q P = W_q, so q = W_q x + b for every input (to within PIN_DELTA / 2).
    """

    a_weight: torch.Tensor  # (r, h)
    a_bias: torch.Tensor  # (r,)
    norm: torch.Tensor  # (r,)
    b_weight: torch.Tensor  # (H (dn + dr), r)


def low_rank_query(wq: torch.Tensor, bq: torch.Tensor, input_norm: torch.Tensor) -> LowRankQuery:
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
    return LowRankQuery(
        a_weight=torch.cat([P, torch.zeros(1, h, dtype=torch.float64)]),
        a_bias=a_bias,
        norm=norm,
        b_weight=torch.cat([Q, bq[:, None]], dim=1),
    )


@torch.no_grad()
def run_with_kv_a_hooks(
    model: Transformer, ids: torch.Tensor, on_kv_a: Callable[[int, torch.Tensor, torch.Tensor], None], batch_size: int = 8
) -> None:
    """Run ``model`` over the calibration ids (N, T) in batches with ``on_kv_a(layer, input, output)`` called at
    every layer's kv_a_proj (its input is the attention input x, its output the latent and RoPE key)."""
    hooks = [
        layer.attn.kv_a_proj.register_forward_hook(lambda _m, inp, out, i=i: on_kv_a(i, inp[0], out))
        for i, layer in enumerate(mla_layers(model))
    ]
    device = model.embed_tokens.weight.device
    try:
        for start in range(0, ids.shape[0], batch_size):
            model(ids[start : start + batch_size].to(device))
    finally:
        for h in hooks:
            h.remove()


@torch.no_grad()
def collect_latents(model: Transformer, ids: torch.Tensor, max_tokens: int, batch_size: int = 8) -> list[torch.Tensor]:
    """Per layer, the raw latents c = kv_a(x)[:d_c] (fp64, CPU) over (at most ``max_tokens``) calibration tokens."""
    dc = model.config.latent_dims()[0]
    store: list[list[torch.Tensor]] = [[] for _ in model.layers]

    def keep(i: int, _x: torch.Tensor, out: torch.Tensor) -> None:
        store[i].append(out[..., :dc].detach().reshape(-1, dc).to("cpu", torch.float64))

    run_with_kv_a_hooks(model, ids, keep, batch_size)
    return [subsample_latents(chunks, max_tokens) for chunks in store]


def subsample_latents(chunks: list[torch.Tensor], max_tokens: int) -> torch.Tensor:
    """One layer's raw latents (``collect_latents``): the batches' ``chunks`` (tokens, d_c) joined, at most
    ``max_tokens`` of them kept (a seeded random subset, in token order)."""
    c = torch.cat(chunks)
    if c.shape[0] > max_tokens:
        chosen = torch.randperm(c.shape[0], generator=torch.Generator().manual_seed(0))[:max_tokens]
        c = c[chosen.sort().values]
    return c


def fit_latent_metric(c: torch.Tensor, ridge: float | None = None, max_iter: int = 150, min_eig: float = 1e-3) -> torch.Tensor:
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
    v = eye / d**0.5
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


def approx_latent(attn, latents: torch.Tensor | None, strategy: str, input_norm: torch.Tensor) -> Latent:
    """Latent transform for a layer without its own latent norm (``strategy``: fit | scale)."""
    dc = attn.dc
    W_a = attn.kv_a_proj.weight.detach().to("cpu", torch.float64)[:dc]
    b_a = attn.kv_a_proj.bias
    b_c = None if b_a is None else b_a.detach().to("cpu", torch.float64)[:dc]
    W_b = attn.kv_b_proj.weight.detach().to("cpu", torch.float64)
    eye = torch.eye(dc, dtype=torch.float64)
    if latents is None:  # weights only: E[x x^T] ~ diag(w^2) for x = w * (unit-rms vector)
        ms = (
            (W_a * input_norm.to("cpu", torch.float64)).pow(2).sum() / W_a.shape[1]
            + (0.0 if b_c is None else float(b_c.pow(2).sum()))
        ) / dc
        rho = float(ms) ** 0.5
        rho = rho if rho > 0 else 1.0
        return Latent(M=eye / rho, B=eye, g=torch.full((dc,), rho, dtype=torch.float64), cv=float("nan"))
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
    return Latent(M=M, B=M_inv / rho, g=g, cv=cv, unit=_least_squares_unit(n))


def _least_squares_unit(x: torch.Tensor, ridge: float = 1e-6) -> torch.Tensor:
    """u minimising mean_t (u . x_t - 1)^2 (+ a tiny ridge): u = E[x x^T]^-1 E[x]; rows x_t of ``x`` (N, d)."""
    S = x.T @ x / x.shape[0]
    S = S + ridge * float(S.diagonal().mean().clamp_min(1e-300)) * torch.eye(x.shape[1], dtype=x.dtype)
    return torch.linalg.solve(S, x.mean(0))


def exact_latent(attn, eps: float) -> Latent:
    """The model's own latent RMSNorm; rescale the latent so stock's eps acts as ours: s^2 = eps_stock / eps."""
    dc = attn.dc
    s = (STOCK_LATENT_NORM_EPS / eps) ** 0.5
    eye = torch.eye(dc, dtype=torch.float64)
    return Latent(M=eye * s, B=eye, g=attn.kv_a_norm.weight.detach().to("cpu", torch.float64))


def latent_unit(lat: Latent, c: torch.Tensor) -> torch.Tensor:
    """``_least_squares_unit`` of the exported normalised latents of raw latents ``c`` (N, d_c)."""
    cp = c @ lat.M.T + (lat.offset if lat.offset is not None else 0.0)
    return _least_squares_unit(lat.g * cp / ((cp * cp).mean(1, keepdim=True) + STOCK_LATENT_NORM_EPS).sqrt())


__all__ = [
    "ENGINE_LATENT_RMS",
    "LATENT_NORM_STRATEGIES",
    "PIN_DELTA",
    "STOCK_LATENT_NORM_EPS",
    "Latent",
    "LowRankQuery",
    "approx_latent",
    "collect_latents",
    "exact_latent",
    "fit_latent_metric",
    "latent_unit",
    "low_rank_query",
    "pad_latent",
    "subsample_latents",
]
