"""Measuring an export: load it with stock transformers and compare it with the kvgraft model.

``load_stock`` loads the checkpoint (checked to load cleanly); ``measure_export`` gives the max |logit
diff|, the mean KL(ours || exported) and both perplexities, in fp32.
"""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any, cast

import torch
from transformers import AutoModelForCausalLM

from kvgraft.errors import CheckpointError
from kvgraft.model.transformer import Transformer


@torch.no_grad()
def load_stock(export_dir: str | Path, dtype: torch.dtype = torch.float32):
    """The exported checkpoint in stock transformers (AutoModelForCausalLM), checked to load cleanly."""

    # with output_loading_info transformers returns (model, info); its stubs only know the model
    stock, info = cast(Any, AutoModelForCausalLM.from_pretrained(str(export_dir), dtype=dtype, output_loading_info=True))
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


def perplexity(logits: torch.Tensor, ids: torch.Tensor) -> float:
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
    out = {
        "max_abs_logit_diff": float((a - b).abs().max()),
        "mean_kl": _kl(a, b),
        "perplexity": {"kvgraft": perplexity(a, ids), "deepseek_v3": perplexity(b, ids)},
    }
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
    "load_stock",
    "measure_export",
    "measure_export_error",
    "perplexity",
]
