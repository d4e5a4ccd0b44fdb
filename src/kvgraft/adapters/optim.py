"""Optimizer parameter groups for adapters: per-module learning-rate multipliers, LoRA+, frozen trees.

PEFT has LoRA+ (B's learning rate as a multiple of A's) but no per-module multipliers; Mind Lab's placement article's
gradient-energy analysis (``kvgraft probe``) suggests one factor per module group (1/sqrt(rho_c)).
Globs match kvgraft module names (``layers.4.self_attn.compressor.kv_a_proj``); when several match a
module, their factors multiply. The groups carry ``lr_scale``, which the one training loop applies.
"""

from __future__ import annotations

import fnmatch
from typing import Any

from torch import nn

from kvgraft.errors import ConfigError


def module_name(param_name: str) -> str:
    """PEFT parameter name -> kvgraft module name:
    ``base_model.model.model.layers.4.self_attn.q_proj.lora_A.default.weight`` -> ``layers.4.self_attn.q_proj``."""
    name = param_name.split(".lora_")[0]
    for prefix in ("base_model.model.model.", "base_model.model.", "model."):
        if name.startswith(prefix):
            return name[len(prefix) :]
    return name


def freeze(model: nn.Module, globs: tuple[str, ...]) -> list[str]:
    """Set requires_grad=False on every trainable parameter whose module matches a glob; the names frozen.
    A glob that matches nothing is an error (it would silently train what the user meant to freeze)."""
    frozen: list[str] = []
    for pattern in globs:
        hits = [n for n, p in model.named_parameters() if p.requires_grad and fnmatch.fnmatch(module_name(n), pattern)]
        if not hits:
            trainable = sorted({module_name(n) for n, p in model.named_parameters() if p.requires_grad})
            raise ConfigError(f"freeze glob {pattern!r} matches no trainable module; trainable: {', '.join(trainable)}")
        for n, p in model.named_parameters():
            if n in hits:
                p.requires_grad_(False)
        frozen += hits
    return frozen


def adapter_param_groups(
    model: nn.Module,
    weight_decay: float = 0.0,
    lr_multipliers: dict[str, float] | None = None,
    loraplus_ratio: float | None = None,
) -> list[dict[str, Any]]:
    """AdamW groups of the trainable parameters, one per distinct (lr_scale, decay)."""
    lr_multipliers = dict(lr_multipliers or {})
    for pattern, factor in lr_multipliers.items():
        if not factor > 0:
            raise ConfigError(f"lr multiplier for {pattern!r} ({factor!r}) must be > 0")
    if loraplus_ratio is not None and not loraplus_ratio > 0:
        raise ConfigError(f"loraplus_ratio ({loraplus_ratio!r}) must be > 0")
    names = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
    used = {pattern: False for pattern in lr_multipliers}
    buckets: dict[tuple[float, bool], list] = {}
    for n, p in names:
        scale = 1.0
        mod = module_name(n)
        for pattern, factor in lr_multipliers.items():
            if fnmatch.fnmatch(mod, pattern):
                scale *= factor
                used[pattern] = True
        if loraplus_ratio is not None and ".lora_B." in n:
            scale *= loraplus_ratio
        buckets.setdefault((scale, p.dim() >= 2), []).append(p)
    unused = [k for k, v in used.items() if not v]
    if unused:
        raise ConfigError(f"lr multiplier globs {unused} match no trainable module")
    return [
        {"params": ps, "lr_scale": scale, "weight_decay": weight_decay if decay else 0.0}
        for (scale, decay), ps in sorted(buckets.items(), key=lambda kv: (kv[0][0], kv[0][1]))
    ]
