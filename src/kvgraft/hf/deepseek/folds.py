"""The engine-safe bias folds (``target="engines"``): attention biases carried by bias-free weights.

vLLM and SGLang build their DeepSeek attention projections without biases and skip bias tensors, so the
"engines" export folds each layer's biases into the weights through directions fitted on calibration
inputs (``EngineFold``); the export measures the error.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from kvgraft.errors import ConfigError
from kvgraft.hf.deepseek.checks import has_nonzero, mla_layers
from kvgraft.hf.deepseek.latent import run_with_kv_a_hooks
from kvgraft.model.config import ModelConfig
from kvgraft.model.mla import MLAttention
from kvgraft.model.transformer import Transformer


class InputMoments:
    """Running (E[x], E[x x^T]) of one layer's attention input: sums on ``device`` (the first moment fp64,
    the second fp32 outer products), hidden^2 values whatever the number of tokens."""

    def __init__(self, hidden: int, device: str | torch.device) -> None:
        self.hidden, self.count = hidden, 0
        self.first = torch.zeros(hidden, dtype=torch.float64, device=device)
        self.second = torch.zeros(hidden, hidden, device=device)

    def add(self, x: torch.Tensor) -> None:
        x = x.detach().reshape(-1, self.hidden).float()
        self.count += x.shape[0]
        self.first += x.sum(0).double()
        self.second += x.T @ x

    def result(self) -> tuple[torch.Tensor, torch.Tensor]:
        """(E[x], E[x x^T]), fp64 CPU."""
        return self.first.cpu() / self.count, self.second.double().cpu() / self.count


@torch.no_grad()
def collect_input_moments(model: Transformer, ids: torch.Tensor, batch_size: int = 8) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Per layer (E[x], E[x x^T]) of the attention input x (what q_proj and kv_a_proj read), fp64 CPU.

    Accumulated as running sums on the model's device (fp32 outer products, ``InputMoments``), so memory is
    hidden^2 per layer whatever the number of calibration tokens."""
    device = model.embed_tokens.weight.device
    moments = [InputMoments(model.config.hidden_size, device) for _ in model.layers]
    run_with_kv_a_hooks(model, ids, lambda i, x, _out: moments[i].add(x), batch_size)
    return [m.result() for m in moments]


@dataclass
class EngineFold:
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


def engine_folds(model: Transformer, moments: list[tuple[torch.Tensor, torch.Tensor]] | None) -> list[EngineFold | None]:
    """Per layer, the bias folds of ``EngineFold`` (None: the layer has no bias to fold)."""
    return [
        engine_fold(model.config, i, attn, None if moments is None else moments[i])
        for i, (_, attn, _) in enumerate(mla_layers(model))
    ]


def engine_fold(
    cfg: ModelConfig, i: int, attn: MLAttention, moments: tuple[torch.Tensor, torch.Tensor] | None
) -> EngineFold | None:
    """Layer ``i``'s ``EngineFold`` (None: no bias to fold); ``moments``: its attention input's (E[x], E[x x^T])
    (None without calibration: refused when a bias needs them)."""
    H = cfg.num_heads
    _, _, dn, dv = cfg.latent_dims()
    bq = attn.q_proj.bias if has_nonzero(attn.q_proj.bias) else None
    ba = attn.kv_a_proj.bias if has_nonzero(attn.kv_a_proj.bias) else None
    bb = attn.kv_b_proj.bias if has_nonzero(attn.kv_b_proj.bias) else None
    bo = attn.o_proj.bias if has_nonzero(attn.o_proj.bias) else None
    if bq is None and ba is None and bb is None and bo is None:
        return None
    fold = EngineFold()
    if bq is not None or ba is not None:
        if moments is None:
            raise ConfigError(
                f"layer {i} has attention biases (q_proj / kv_a_proj): the engine-safe stock export folds them "
                "into the weights through the attention input's mean direction, measured on calibration text; "
                "pass calibration token ids, or export with target='transformers' (exact, transformers only)"
            )
        mean, second = moments
        S = second + 1e-6 * float(second.diagonal().mean().clamp_min(1e-300)) * torch.eye(second.shape[0], dtype=torch.float64)
        u = torch.linalg.solve(S, mean)
        ux_mean = float(u @ mean)
        ux_var = float(u @ second @ u) - ux_mean**2
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
            raise ConfigError(
                f"layer {i} has a value or o_proj bias: the engine-safe stock export carries it as a constant "
                "value through kv_b, fitted on calibration text; pass calibration token ids, or export with "
                "target='transformers' (exact, transformers only)"
            )
        fold.value = value
    return fold


__all__ = [
    "EngineFold",
    "InputMoments",
    "collect_input_moments",
    "engine_fold",
    "engine_folds",
]
