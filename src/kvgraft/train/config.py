"""Configuration of the one training loop (pretrain, heal and adapt are recipes over it)."""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from typing import Any

from kvgraft.errors import ConfigError

PRECISIONS = ("fp32", "bf16")


@dataclass(frozen=True)
class TrainConfig:
    """Everything that decides a run's numbers. Written next to every checkpoint as ``train_config.json``."""

    max_steps: int  # optimizer steps
    micro_batch_size: int = 16  # sequences per forward, per process
    grad_accum: int = 1  # micro-batches per optimizer step
    lr: float = 1e-3  # peak learning rate
    min_lr_ratio: float = 0.1  # cosine decays to lr * min_lr_ratio
    warmup_steps: int = 100
    weight_decay: float = 0.1
    beta1: float = 0.9
    beta2: float = 0.95
    eps: float = 1e-8
    grad_clip: float = 1.0  # global norm; 0 disables
    precision: str = "bf16"  # bf16 autocast with fp32 master weights and gradients, or plain fp32
    eval_every: int = 100  # steps; 0 disables periodic validation
    eval_batches: int = 8  # micro-batches of the validation set per evaluation (fixed, first ones)
    save_every: int = 100  # steps between checkpoints
    keep_checkpoints: int = 2
    log_every: int = 10
    seed: int = 0
    max_time_s: float | None = None  # stop cleanly (checkpoint + outputs) after this much wall time
    progress: bool = True
    # recompute each layer in backward instead of keeping its activations (same gradients, less memory;
    # a causal encoder-decoder's layers recompute with the shared KV they read)
    gradient_checkpointing: bool = False

    def __post_init__(self) -> None:
        for name in (
            "max_steps",
            "micro_batch_size",
            "grad_accum",
            "eval_batches",
            "save_every",
            "keep_checkpoints",
            "log_every",
        ):
            value = getattr(self, name)
            if not isinstance(value, int) or value <= 0:
                raise ConfigError(f"{name} ({value!r}) must be a positive integer")
        if self.warmup_steps < 0 or self.eval_every < 0:
            raise ConfigError(f"warmup_steps ({self.warmup_steps}) and eval_every ({self.eval_every}) must be >= 0")
        if self.lr <= 0:
            raise ConfigError(f"lr ({self.lr}) must be > 0")
        if not 0 <= self.min_lr_ratio <= 1:
            raise ConfigError(f"min_lr_ratio ({self.min_lr_ratio}) must be in [0, 1]")
        if self.precision not in PRECISIONS:
            raise ConfigError(f"precision {self.precision!r} is not one of {PRECISIONS}")
        if self.grad_clip < 0 or self.weight_decay < 0:
            raise ConfigError(f"grad_clip ({self.grad_clip}) and weight_decay ({self.weight_decay}) must be >= 0")

    def lr_at(self, step: int) -> float:
        """Linear warmup to ``lr`` over ``warmup_steps``, then cosine decay to ``lr * min_lr_ratio``.

        ``step`` counts optimizer steps already taken (0 for the first update).
        """

        if step < self.warmup_steps:
            return self.lr * (step + 1) / self.warmup_steps
        span = max(1, self.max_steps - self.warmup_steps)
        progress = min(1.0, (step - self.warmup_steps) / span)
        floor = self.lr * self.min_lr_ratio
        return floor + 0.5 * (self.lr - floor) * (1 + math.cos(math.pi * progress))

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> TrainConfig:
        return cls(**d)
