"""Healing recipe: continued pretraining of a grafted model on the shared loop, optionally distilled.

The TransMLA article's recipe is the default (MISSION.md, Part A step 7): AdamW, weight decay 0.1, peak LR 1/10 of
the original model's, warmup then cosine decay, gradient clipping at global norm 1.0, bf16 autocast
with fp32 master weights, and the new latent down-projections (``kv_a_proj``) kept in fp32 even when
the rest of the model is held in bf16 (their bf16 gradients underflow). Options: freeze everything
outside attention; a KL-distillation loss from the original model (alone or mixed with the LM loss).
"""

from __future__ import annotations

import json
import math
import shutil
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from accelerate import PartialState
from torch import nn

from kvgraft.atomic import atomic_dir
from kvgraft.checks import check_int, check_number
from kvgraft.data import CopyWindows, PackedDataset
from kvgraft.errors import ConfigError
from kvgraft.graft.calibration import load_calibration
from kvgraft.hf import load_pretrained, save_pretrained
from kvgraft.hf.deepseek import export_deepseek_v3
from kvgraft.model.transformer import Transformer
from kvgraft.reference import resolve_model
from kvgraft.train.checkpoint import find_latest, load_checkpoint
from kvgraft.train.config import TrainConfig
from kvgraft.train.loop import TrainOptions, TrainResult, lm_loss, train

LOSSES = ("lm", "kl", "mix")
FP32_MODULES = ("self_attn.kv_a_proj", "compressor.kv_a_proj")  # module-name suffixes: latent down-projections


@dataclass(frozen=True)
class HealConfig:
    """What the heal recipe adds to the loop's TrainConfig."""

    loss: str = "lm"  # lm | kl | mix
    kl_weight: float = 0.5  # weight of the KL term with loss="mix" (LM gets 1 - kl_weight)
    temperature: float = 1.0  # distillation temperature
    attention_only: bool = False  # freeze embeddings, MLPs and norms
    tokens: int | None = None  # token budget (sets max_steps); or
    fraction_of_pretraining: float | None = None  # a fraction of the original model's pretraining tokens
    copy_fraction: float = 0.0  # training windows that repeat their opening copy_span tokens (data.CopyWindows)
    copy_span: int | None = None  # tokens copied (and how far back); None: half the sequence length

    def __post_init__(self) -> None:
        if self.loss not in LOSSES:
            raise ConfigError(f"loss {self.loss!r} is not one of {', '.join(LOSSES)}")
        if not 0 <= self.kl_weight <= 1:
            raise ConfigError(f"kl_weight ({self.kl_weight}) must be in [0, 1]")
        if self.temperature <= 0:
            raise ConfigError(f"temperature ({self.temperature}) must be > 0")
        if self.tokens is not None and self.fraction_of_pretraining is not None:
            raise ConfigError("give a token budget as tokens or as fraction_of_pretraining, not both")
        check_int("tokens", self.tokens, low=1, optional=True, accepted="a positive integer")
        if self.fraction_of_pretraining is not None and not 0 < self.fraction_of_pretraining:
            raise ConfigError(f"fraction_of_pretraining ({self.fraction_of_pretraining}) must be > 0")
        check_number("copy_fraction", self.copy_fraction, low=0, high=1)
        check_int(
            "copy_span", self.copy_span, low=1, optional=True, accepted="a positive integer (at most half the sequence length)"
        )
        if self.copy_span is not None and self.copy_fraction == 0:
            raise ConfigError(f"copy_span ({self.copy_span}) needs a copy_fraction above 0 (no window copies at 0)")


@dataclass(frozen=True)
class HealOptions:
    """How ``heal`` runs: the recipe (``heal_config``; None: ``HealConfig()``), the loop (``train_config``
    replaces the recipe's loop settings, ``train_overrides`` changes some of them, e.g. from the CLI),
    ``teacher`` (the original model, for loss "kl" and "mix"), the original's facts when its training record
    does not hold them (``original_lr``, ``pretraining_tokens``), ``seq_len`` (None: the model's
    max_position_embeddings), the student's ``dtype`` and the ``output_format`` ("kvgraft", "deepseek_v3" or
    "both")."""

    teacher: str | Path | None = None
    heal_config: HealConfig | None = None
    train_config: TrainConfig | None = None
    train_overrides: dict[str, Any] | None = None
    original_lr: float | None = None
    pretraining_tokens: int | None = None
    seq_len: int | None = None
    dtype: torch.dtype = torch.float32
    output_format: str = "kvgraft"


def keep_fp32(model: nn.Module, suffixes: tuple[str, ...] = FP32_MODULES) -> list[str]:
    """Cast the modules whose names end with ``suffixes`` to fp32 in place; return their parameter names."""
    names = []
    for name, module in model.named_modules():
        if name.endswith(suffixes):
            module.float()
            names += [f"{name}.{n}" for n, _ in module.named_parameters()]
    return names


def freeze_outside_attention(model: nn.Module) -> int:
    """requires_grad=False on everything but ``self_attn`` parameters; return the trainable count."""
    trainable = 0
    for name, p in model.named_parameters():
        p.requires_grad = ".self_attn." in name
        trainable += p.numel() if p.requires_grad else 0
    return trainable


def distillation_loss(teacher: nn.Module, cfg: HealConfig):
    """LossFn: KL(teacher || student) on next-token distributions, optionally mixed with the LM loss."""
    teacher.eval().requires_grad_(False)
    tau = cfg.temperature

    def loss_fn(model: nn.Module, batch: dict[str, torch.Tensor]) -> tuple[torch.Tensor, dict[str, float]]:
        logits = model(batch["input_ids"]).float()
        with torch.no_grad():
            t_logits = teacher(batch["input_ids"]).float()
        mask = (batch["labels"] != -100).unsqueeze(-1)
        log_p = F.log_softmax(logits / tau, dim=-1)
        log_q = F.log_softmax(t_logits / tau, dim=-1)
        kl_tok = (log_q.exp() * (log_q - log_p)).sum(-1, keepdim=True)  # per token
        kl = (kl_tok * mask).sum() / mask.sum().clamp_min(1) * tau**2
        ce = F.cross_entropy(logits.flatten(0, 1), batch["labels"].flatten(), ignore_index=-100)
        if cfg.loss == "kl":
            return kl, {"kl": float(kl.detach()), "ce": float(ce.detach())}
        loss = cfg.kl_weight * kl + (1 - cfg.kl_weight) * ce
        return loss, {"kl": float(kl.detach()), "ce": float(ce.detach())}

    return loss_fn


def original_training(model_dir: Path) -> dict[str, Any] | None:
    """The original model's training record (``training.json`` of a shipped card), if present."""
    for candidate in (model_dir / "training.json", model_dir.parent / "training.json"):
        if candidate.is_file():
            return json.loads(candidate.read_text())
    return None


def heal(
    model: str | Path,
    out: str | Path,
    data: str | Path,
    options: HealOptions | None = None,
) -> TrainResult:
    """Heal a converted model (``kvgraft convert`` output) by continued pretraining on ``data``, as
    ``options`` (a :class:`HealOptions`; None: its defaults) say.

    ``data`` is a ``kvgraft prepare-data`` directory. ``teacher`` (the original model) is needed for
    loss "kl" and "mix". The peak LR defaults to 1/10 of the original's (``original_lr``, else the
    teacher's or the model's training record). The budget is ``heal_config.tokens``, or a fraction of
    ``pretraining_tokens`` (else the record's tokens_seen), else ``train_config.max_steps``.
    Rerunning the same command resumes. The healed model is written to ``out/final`` in kvgraft's
    format and/or (``output_format`` "deepseek_v3" or "both") as stock DeepSeek-V3 in
    ``out/final/deepseek_v3``, with a card (README.md) and ``heal.json``.
    """

    o = options or HealOptions()
    teacher, seq_len, dtype, output_format = o.teacher, o.seq_len, o.dtype, o.output_format
    hc = o.heal_config or HealConfig()
    _check_heal_args(hc, output_format, seq_len)
    src = resolve_model(model)
    out, data = Path(out), Path(data)
    student = load_pretrained(src, dtype=dtype)
    fp32 = keep_fp32(student)
    teacher_model = None
    if hc.loss in ("kl", "mix"):
        if teacher is None:
            raise ConfigError(f"loss {hc.loss!r} needs a teacher model (the original, before conversion)")
        teacher_model = load_pretrained(resolve_model(teacher), dtype=dtype)
    original_lr, pretraining_tokens = _original_facts(src, teacher, o.original_lr, o.pretraining_tokens)
    if seq_len is None:
        seq_len = student.config.max_position_embeddings
    base = _loop_config(o.train_config, o.train_overrides, original_lr, hc, pretraining_tokens, seq_len)
    if hc.attention_only:
        freeze_outside_attention(student)
    train_ds, val_ds = _datasets(data, seq_len, hc)
    if hc.loss == "lm":
        loss_fn = lm_loss
    else:
        assert teacher_model is not None  # loaded above for "kl" and "mix"
        loss_fn = distillation_loss(teacher_model, hc)
    extra = {
        "heal": asdict(hc),
        "source": str(src),
        "fp32_params": fp32,
        "original_lr": original_lr,
        "pretraining_tokens": pretraining_tokens,
    }
    # validation is always next-token perplexity; attention-only checkpoints hold what trains
    loop_options = TrainOptions(
        loss_fn=loss_fn, extra_state=extra, val_loss_fn=lm_loss, checkpoint_trainable_only=hc.attention_only
    )
    result = train(student, train_ds, base, out, val_data=val_ds, options=loop_options)
    latest = find_latest(out)
    if latest is not None:
        load_checkpoint(latest, student)
    summary = {
        **extra,
        "train_config": asdict(base),
        "steps": result.step,
        "tokens": result.tokens,
        "val_loss": result.val_loss,
        "fraction_of_pretraining": (result.tokens / pretraining_tokens) if pretraining_tokens else None,
    }

    if not PartialState().is_main_process:  # under a multi-process launch one process writes the result
        PartialState().wait_for_everyone()
        return result
    _write_final(student, src, out, summary, output_format)
    PartialState().wait_for_everyone()
    return result


def _check_heal_args(hc: HealConfig, output_format: str, seq_len: int | None) -> None:
    """ConfigError for an output format, a sequence length or a copy span heal cannot take."""
    if output_format not in ("kvgraft", "deepseek_v3", "both"):
        raise ConfigError(f"format {output_format!r} is not one of kvgraft, deepseek_v3, both")
    check_int("seq_len", seq_len, low=1, optional=True, accepted="a positive integer")
    if hc.copy_span is not None and seq_len is not None and hc.copy_span > seq_len // 2:
        raise ConfigError(
            f"copy_span ({hc.copy_span}) must be at most half the sequence length ({seq_len} // 2 = {seq_len // 2})"
        )


def _original_facts(
    src: Path, teacher: str | Path | None, original_lr: float | None, pretraining_tokens: int | None
) -> tuple[float | None, int | None]:
    """(the original's peak LR, its pretraining tokens): as given, else from the training record of the
    teacher, or of the model the converted ``src`` came from (``conversion.json``), or of ``src`` itself."""
    record = original_training(resolve_model(teacher)) if teacher is not None else None
    record = record or original_training(
        Path(json.loads((src / "conversion.json").read_text())["source"]) if (src / "conversion.json").is_file() else src
    )
    if original_lr is None and record is not None:
        original_lr = record["train_config"]["lr"]
    if pretraining_tokens is None and record is not None:
        pretraining_tokens = record["tokens_seen"]
    return original_lr, pretraining_tokens


def _loop_config(
    train_config: TrainConfig | None,
    train_overrides: dict[str, Any] | None,
    original_lr: float | None,
    hc: HealConfig,
    pretraining_tokens: int | None,
    seq_len: int,
) -> TrainConfig:
    """The loop's settings: ``train_config``, else the recipe's with ``train_overrides`` and a peak LR of 1/10
    of the original's; ``max_steps`` from the token budget when there is one."""
    if train_config is None:
        lr = (train_overrides or {}).get("lr")
        if lr is None:  # an explicit lr (even a bad one, which TrainConfig names) is never replaced
            lr = original_lr / 10 if original_lr else None
        if lr is None:
            raise ConfigError("no learning rate: give one, or the original's (original_lr), or use a model whose card records it")
        recipe = dict(max_steps=100, lr=lr, weight_decay=0.1, grad_clip=1.0, precision="bf16", warmup_steps=10)
        train_config = TrainConfig(**{**recipe, **(train_overrides or {}), "lr": lr})
    base = train_config
    budget = hc.tokens
    if budget is None and hc.fraction_of_pretraining is not None:
        if pretraining_tokens is None:
            raise ConfigError("fraction_of_pretraining needs the original's pretraining tokens (pass pretraining_tokens)")
        budget = int(hc.fraction_of_pretraining * pretraining_tokens)
    if budget is not None:
        per_step = base.micro_batch_size * base.grad_accum * seq_len
        steps = max(1, math.ceil(budget / per_step))
        base = TrainConfig(**{**asdict(base), "max_steps": steps, "warmup_steps": min(base.warmup_steps, steps // 10)})
    return base


def _datasets(data: Path, seq_len: int, hc: HealConfig) -> tuple[PackedDataset | CopyWindows, PackedDataset]:
    """(the training windows, copy windows among them when ``hc.copy_fraction``; the validation windows)."""
    for name in ("tokens/train.npy", "tokens/validation.npy"):
        if not (data / name).exists():
            raise FileNotFoundError(f"{data / name} is missing; run `kvgraft prepare-data --out {data}` first")
    train_ds: PackedDataset | CopyWindows = PackedDataset(data / "tokens" / "train.npy", seq_len)
    if hc.copy_fraction > 0:
        train_ds = CopyWindows(train_ds, hc.copy_fraction, hc.copy_span if hc.copy_span is not None else seq_len // 2)
    val_ds = PackedDataset(data / "tokens" / "validation.npy", seq_len)
    return train_ds, val_ds


def _write_final(student: Transformer, src: Path, out: Path, summary: dict[str, Any], output_format: str) -> None:
    """``out/final``, written whole or not at all: the healed model in kvgraft's format and/or as stock
    DeepSeek-V3, its card, ``heal.json`` and the source's eval slices."""
    tok_dir = src if (src / "tokenizer.json").is_file() else None
    healed = student.float()
    what = "causal encoder-decoder (share graft)" if student.config.is_ced else "MLA graft"
    files = {"heal.json": json.dumps(summary, indent=2) + "\n", "README.md": heal_card(summary, src, what)}
    with atomic_dir(out / "final", overwrite=True) as tmp:  # the healed model, complete or not at all
        if output_format in ("kvgraft", "both"):
            save_pretrained(healed, tmp, tokenizer_dir=tok_dir, model_type="kvgraft", overwrite=True, extra_files=files)
        else:
            for name, text in files.items():
                (tmp / name).write_text(text)
        if output_format in ("deepseek_v3", "both"):
            calib = None
            if (src / "eval" / "calibration.npy").is_file():
                calib = load_calibration(src, None, 8192, min(512, healed.config.max_position_embeddings))
            export_deepseek_v3(healed, tmp / "deepseek_v3", tokenizer_dir=tok_dir, calibration=calib)
        if (src / "eval").is_dir():
            shutil.copytree(src / "eval", tmp / "eval")


def _copy_row(hc: dict[str, Any]) -> str:
    fraction = hc.get("copy_fraction", 0.0)
    if not fraction:
        return "none"
    span = hc.get("copy_span")
    return f"{fraction:g} of the windows repeat their first {span if span is not None else 'half'} tokens (data.CopyWindows)"


def heal_card(summary: dict[str, Any], source: Path, what: str = "MLA graft") -> str:
    tc, hc = summary["train_config"], summary["heal"]
    frac = summary.get("fraction_of_pretraining")
    loss = {
        "lm": "next-token cross-entropy",
        "kl": "KL divergence from the original (teacher)",
        "mix": f"{hc['kl_weight']:g} x KL from the original + {1 - hc['kl_weight']:g} x cross-entropy",
    }[hc["loss"]]
    val = summary.get("val_loss")
    return f"""# Healed {what}

Continued pretraining of `{source}` with kvgraft's heal recipe.

| | |
|---|---|
| loss | {loss}{" (temperature " + format(hc["temperature"], "g") + ")" if hc["loss"] != "lm" else ""} |
| trained parameters | {"attention only (embeddings, MLPs, norms frozen)" if hc["attention_only"] else "all"} |
| copy windows | {_copy_row(hc)} |
| optimizer | AdamW (beta {tc["beta1"]}, {tc["beta2"]}), weight decay {tc["weight_decay"]}, clip {tc["grad_clip"]} |
| learning rate | peak {tc["lr"]:g} (original's {summary.get("original_lr")} / 10 unless set), {tc["warmup_steps"]} warmup steps, cosine to {tc["min_lr_ratio"]}x |
| precision | {tc["precision"]} autocast; fp32 latent down-projections ({len(summary["fp32_params"])} tensors) |
| steps / tokens | {summary["steps"]:,} / {summary["tokens"]:,}{f" ({frac:.2%} of the original pretraining tokens)" if frac else ""} |
| final validation loss | {"n/a" if val is None else f"{val:.4f} (perplexity {math.exp(val):.2f})"} |

`heal.json` holds all of it, machine-readable.
"""
