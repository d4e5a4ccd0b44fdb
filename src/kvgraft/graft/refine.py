"""Local refinement of one grafted attention: a few epochs of Adam against the original layer, nothing else.

The factorisation (``mla_math.convert_layer``) picks the best *linear* latent for a layer's keys and values
under a second-moment model of its inputs; what the model needs is the layer's *output* after the softmax.
``refine_attention`` trains the converted layer's attention weights (q, kv_a, kv_b, o, the latent norm when
there is one) so that the converted stack's residual stream after the attention matches the original
stack's, on the calibration text:

    minimise  mean_t || (x_new + MLA(ln(x_new)))_t - (x_orig + GQA(ln(x_orig)))_t ||^2 / || (x_orig + GQA(ln(x_orig)))_t ||^2

``x_orig`` / ``x_new``: the layer's inputs in the original / converted stacks, so the layer also makes up for
what the converted layers below it changed. Per-token relative error: the residual stream's first tokens
carry massive activations (attention sinks) that would otherwise own a plain squared error, while every next
layer reads the stream through an RMSNorm. Backward runs through one attention only (no MLP, no other
layer), so the cost is a few forward passes of the layer per epoch.

The last ``holdout`` sequences are not trained on: the error before and after is measured on them.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from kvgraft.checks import check_int, check_number
from kvgraft.errors import ConfigError
from kvgraft.model.batch import DenseContext
from kvgraft.model.transformer import Block


@dataclass(frozen=True)
class RefineConfig:
    """``epochs`` passes over the calibration sequences (0: no refinement), ``batch_sequences`` per step, Adam
    at ``lr`` with a cosine decay to 0 after ``warmup`` steps, global gradient norm clipped at 1."""

    epochs: int = 4
    lr: float = 1e-3
    batch_sequences: int = 1
    warmup: int = 4
    holdout: int = 8

    def __post_init__(self) -> None:
        for name in ("epochs", "batch_sequences", "warmup", "holdout"):
            value = getattr(self, name)
            check_int(f"refine {name}", value, low=1 if name == "batch_sequences" else 0)
        check_number("refine lr", self.lr, positive=True)


@dataclass(frozen=True)
class RefineResult:
    """Relative residual-stream error of the layer on the held-out calibration sequences, before and after;
    ``steps`` taken."""

    before: float
    after: float
    steps: int


def _attention_out(block: Block, u: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    positions = torch.arange(u.shape[1], device=u.device).expand(u.shape[0], -1)
    out: torch.Tensor = block.self_attn(u, cos, sin, DenseContext(positions, default_positions=True))
    return out


def _relative_error(pred: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    return ((pred - target).pow(2).sum(-1) / target.pow(2).sum(-1).clamp_min(1e-12)).mean()


@torch.no_grad()
def _targets(
    original: Block, x_orig: torch.Tensor, x_new: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, batch: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """(targets: the original stack's stream after the attention; inputs: the converted stack's normed stream)."""
    targets, inputs = [], []
    for s in range(0, x_orig.shape[0], batch):
        xo, xn = x_orig[s : s + batch], x_new[s : s + batch]
        c, si = cos[s : s + batch], sin[s : s + batch]
        targets.append(xo + _attention_out(original, original.input_layernorm(xo), c, si))
        inputs.append(original.input_layernorm(xn))
    return torch.cat(targets), torch.cat(inputs)


def _held_out_error(
    block: Block, u: torch.Tensor, x_new: torch.Tensor, target: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
) -> float:
    with torch.no_grad():
        errs = [
            _relative_error(
                x_new[i : i + 1] + _attention_out(block, u[i : i + 1], cos[i : i + 1], sin[i : i + 1]), target[i : i + 1]
            )
            for i in range(u.shape[0])
        ]
    return float(torch.stack(errs).mean())


def refine_attention(
    original: Block,
    converted: Block,
    x_orig: torch.Tensor,
    x_new: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    cfg: RefineConfig,
    seed: int = 0,
) -> RefineResult:
    """Train ``converted.self_attn`` in place (fp32) toward ``original``'s output (module docstring).

    ``x_orig``/``x_new``: (N, T, h) the layer's inputs in the original / converted stacks; ``cos``/``sin``
    (N, T, head_dim) the RoPE tables. The blocks share their norms and MLP; only the converted attention's
    parameters change."""
    if x_orig.shape != x_new.shape:
        raise ConfigError(f"x_orig {tuple(x_orig.shape)} and x_new {tuple(x_new.shape)} differ")
    n = x_orig.shape[0]
    hold = min(cfg.holdout, n - 1) if n > 1 else 0
    train_n = n - hold
    attn = converted.self_attn
    params = [p for p in attn.parameters()]
    dtype = params[0].dtype
    attn.float()
    target, u = _targets(original, x_orig.float(), x_new.float(), cos, sin, cfg.batch_sequences)
    xn = x_new.float()
    held = slice(train_n, n)
    before = _held_out_error(converted, u[held], xn[held], target[held], cos[held], sin[held]) if hold else float("nan")
    steps_per_epoch = math.ceil(train_n / cfg.batch_sequences)
    total = cfg.epochs * steps_per_epoch
    flags = [p.requires_grad for p in params]
    for p in params:
        p.requires_grad_(True)
    opt = torch.optim.Adam(params, lr=cfg.lr, betas=(0.9, 0.99))
    gen = torch.Generator().manual_seed(seed)
    step = 0
    with torch.enable_grad():
        for _ in range(cfg.epochs):
            order = torch.randperm(train_n, generator=gen)
            for s in range(0, train_n, cfg.batch_sequences):
                idx = order[s : s + cfg.batch_sequences].to(u.device)
                warm = min(1.0, (step + 1) / max(cfg.warmup, 1))
                for group in opt.param_groups:
                    group["lr"] = cfg.lr * warm * 0.5 * (1 + math.cos(math.pi * step / max(total, 1)))
                pred = xn[idx] + _attention_out(converted, u[idx], cos[idx], sin[idx])
                loss = _relative_error(pred, target[idx])
                opt.zero_grad(set_to_none=True)
                loss.backward()  # type: ignore[no-untyped-call]
                torch.nn.utils.clip_grad_norm_(params, 1.0)
                opt.step()
                step += 1
    for p, flag in zip(params, flags):
        p.requires_grad_(flag)
        p.grad = None
    after = _held_out_error(converted, u[held], xn[held], target[held], cos[held], sin[held]) if hold else float("nan")
    attn.to(dtype)
    return RefineResult(before=before, after=after, steps=step)
