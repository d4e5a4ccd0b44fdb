"""The one training loop, shared by pretrain, heal and adapt.

Built on Accelerate, so the same code runs on one CPU or under ``accelerate launch`` on many GPUs
(DDP/FSDP/DeepSpeed). Deliberately explicit: no trainer, no callbacks.

Exact resume: the data order and the learning rate are pure functions of (seed, step), and a
checkpoint holds the model, the optimizer state and the step. A run killed at any moment (SIGKILL
included) and restarted with the same arguments reproduces the uninterrupted run's losses.
"""

from __future__ import annotations

import json
import math
import os
import signal
import time
import warnings
from collections.abc import Callable, Sequence
from contextlib import nullcontext
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from accelerate import Accelerator
from torch import nn
from tqdm.auto import tqdm

from kvgraft.atomic import atomic_write_text
from kvgraft.errors import ConfigError
from kvgraft.model.packed import packed_dtypes
from kvgraft.train.checkpoint import find_latest, load_checkpoint, save_checkpoint
from kvgraft.train.config import TrainConfig
from kvgraft.train.logging import RunLog

Batch = dict[str, torch.Tensor]
LossFn = Callable[[nn.Module, Batch], tuple[torch.Tensor, dict[str, float]]]


def lm_loss(model: nn.Module, batch: Batch) -> tuple[torch.Tensor, dict[str, float]]:
    """Mean next-token cross-entropy. ``labels`` are the inputs shifted by one; -100 is ignored."""
    logits = model(batch["input_ids"])  # (B, T, V)
    loss = F.cross_entropy(logits.flatten(0, 1).float(), batch["labels"].flatten(), ignore_index=-100)
    return loss, {}


def autocast(precision: str, device: torch.device | str):
    """bf16 autocast (weights and gradients stay fp32) or nothing for fp32."""
    if precision == "fp32":
        return nullcontext()
    return torch.autocast(device_type=torch.device(device).type, dtype=torch.bfloat16)


def bf16_emulated(device: torch.device | str) -> bool:
    """Whether bf16 autocast would run emulated on ``device``: a CPU without the instructions oneDNN's bfloat16
    path needs (AVX-512 BW/VL/DQ, AVX-NE-CONVERT or AMX), where torch runs bf16 matmuls without it (measured:
    a (2048 x 256) @ (256 x 688) linear's forward and backward took 0.73 s in bf16 against 0.02 s in fp32 on an
    AVX2-only AMD EPYC at 2 threads; bench/RESULTS.md, session 30)."""
    return torch.device(device).type == "cpu" and torch.bfloat16 not in packed_dtypes()


def warn_if_bf16_emulated(precision: str, device: torch.device | str) -> None:
    """One warning (Python's ``warnings``, once per call site) when ``precision`` 'bf16' would run emulated here."""
    if precision == "bf16" and bf16_emulated(device):
        warnings.warn(
            "precision 'bf16' on a CPU without bfloat16 matrix instructions (oneDNN's bf16 path needs AVX-512 "
            "BW/VL/DQ, AVX-NE-CONVERT or AMX): bf16 autocast runs emulated here, far slower than fp32 (a linear "
            "layer's forward and backward ~35x on an AVX2-only CPU); "
            "pass precision 'fp32' (--precision fp32) unless this run must match a bf16 run made elsewhere",
            UserWarning,
            stacklevel=3,
        )


def make_accelerator() -> Accelerator:
    """The Accelerator for this launch. Under torchrun or ``accelerate launch`` (WORLD_SIZE > 1) on a machine
    without CUDA it needs ``cpu=True``: without it each process sees no distributed setup and trains alone
    (world 1, the same data); with it they form one gloo group (``DistributedType.MULTI_CPU``)."""

    world = int(os.environ.get("WORLD_SIZE", "1") or 1)
    return Accelerator(cpu=world > 1 and not torch.cuda.is_available())


def _sum_over_processes(accelerator: Accelerator, values: list[float]) -> list[float]:
    """Element-wise sum of ``values`` over every process (one all-reduce)."""
    t = torch.tensor(values, dtype=torch.float64, device=accelerator.device)
    return accelerator.reduce(t, reduction="sum").tolist()


def default_param_groups(model: nn.Module, weight_decay: float) -> list[dict[str, Any]]:
    """AdamW groups: decay on matrices (dim >= 2), none on norms and biases; frozen params skipped."""
    decay: list[nn.Parameter] = []
    no_decay: list[nn.Parameter] = []
    for p in model.parameters():
        if p.requires_grad:
            (decay if p.dim() >= 2 else no_decay).append(p)
    groups = [{"params": decay, "weight_decay": weight_decay}, {"params": no_decay, "weight_decay": 0.0}]
    return [g for g in groups if g["params"]]


@dataclass
class TrainResult:
    step: int
    tokens: int
    train_loss: float | None
    val_loss: float | None
    stopped_early: bool
    history: list[dict[str, Any]] = field(default_factory=list)


@dataclass
class TrainOptions:
    """What ``train`` is given beside its data and ``TrainConfig`` (the JSON-able recipe a resume checks):
    the Python objects of the run. ``loss_fn`` (default ``lm_loss``); ``val_loss_fn`` scores validation
    (default ``loss_fn``; distillation validates with ``lm_loss``); ``param_groups`` override the default
    AdamW groups (each group may carry ``lr_scale``); ``extra_state`` (JSON-able) is stored in every
    checkpoint, e.g. the model config; ``accelerator`` (default ``make_accelerator()``);
    ``checkpoint_trainable_only``: checkpoints hold only trainable parameters (adapters over a frozen base);
    ``eval_steps``: validate after these steps too (besides every ``cfg.eval_every``)."""

    loss_fn: LossFn = lm_loss
    val_loss_fn: LossFn | None = None
    param_groups: list[dict[str, Any]] | None = None
    extra_state: dict[str, Any] | None = None
    accelerator: Accelerator | None = None
    checkpoint_trainable_only: bool = False
    eval_steps: Sequence[int] = ()


class _StopRequested:
    """SIGTERM/SIGINT set a flag; the loop checkpoints at the end of the current step and exits."""

    def __init__(self) -> None:
        self.flag = False
        self._old: dict[int, Any] = {}

    def __enter__(self) -> _StopRequested:
        for sig in (signal.SIGTERM, signal.SIGINT):
            try:
                self._old[sig] = signal.signal(sig, self._handler)
            except ValueError:  # not in the main thread
                pass
        return self

    def _handler(self, signum, frame) -> None:
        if self.flag:  # second signal: give up immediately
            raise KeyboardInterrupt
        self.flag = True

    def __exit__(self, *exc) -> None:
        for sig, old in self._old.items():
            signal.signal(sig, old)


def batch_indices(n_items: int, seed: int, micro_index: int, batch_size: int) -> list[int]:
    """Indices of global micro-batch ``micro_index``: epochs are seeded permutations, drawn in order."""
    out: list[int] = []
    start = micro_index * batch_size
    while len(out) < batch_size:
        epoch, offset = divmod(start + len(out), n_items)
        perm = _permutation(n_items, seed, epoch)
        take = min(batch_size - len(out), n_items - offset)
        out.extend(perm[offset : offset + take])
    return out


_PERM_CACHE: dict[tuple[int, int, int], list[int]] = {}


def _permutation(n: int, seed: int, epoch: int) -> list[int]:
    key = (n, seed, epoch)
    if key not in _PERM_CACHE:
        _PERM_CACHE.clear()
        g = torch.Generator().manual_seed(seed * 1_000_003 + epoch)
        _PERM_CACHE[key] = torch.randperm(n, generator=g).tolist()
    return _PERM_CACHE[key]


def collate(dataset: Sequence[Batch], indices: list[int]) -> Batch:
    items = [dataset[i] for i in indices]
    return {k: torch.stack([it[k] for it in items]) for k in items[0]}


@torch.no_grad()
def evaluate(
    model: nn.Module,
    dataset: Sequence[Batch],
    loss_fn: LossFn,
    batch_size: int,
    max_batches: int,
    device: torch.device | str | None = None,
    precision: str = "fp32",
    accelerator: Accelerator | None = None,
) -> float:
    """Token-weighted mean loss over the first ``max_batches`` micro-batches (fixed, in order).

    With an ``accelerator`` of several processes, each micro-batch is per process: the first
    ``max_batches * num_processes`` micro-batches are shared out in rank order and the sums reduced, so
    the result is the loss over the same sequences as one process with ``batch_size * num_processes``."""
    was_training = model.training
    model.eval()
    total, count = 0.0, 0.0
    world = accelerator.num_processes if accelerator is not None else 1
    rank = accelerator.process_index if accelerator is not None else 0
    n = min(len(dataset), batch_size * max_batches * world)
    device = device or next(model.parameters()).device
    for start in range(rank * batch_size, n, batch_size * world):
        batch = collate(dataset, list(range(start, min(n, start + batch_size))))
        batch = {k: v.to(device) for k, v in batch.items()}
        with autocast(precision, device):
            loss, _ = loss_fn(model, batch)
        tokens = int((batch["labels"] != -100).sum())
        total += float(loss) * tokens
        count += tokens
    model.train(was_training)
    if world > 1:
        total, count = _sum_over_processes(accelerator, [total, count])
    return total / max(count, 1)


def train(
    model: nn.Module,
    train_data: Sequence[Batch],
    cfg: TrainConfig,
    out_dir: str | Path,
    val_data: Sequence[Batch] | None = None,
    options: TrainOptions | None = None,
) -> TrainResult:
    """Train ``model`` in place; checkpoints, ``log.jsonl`` and ``loss.png`` go to ``out_dir``.

    Resumes from the newest checkpoint in ``out_dir/checkpoints`` when one exists (the run's
    ``train_config.json`` must then match ``cfg`` except for ``max_time_s`` and ``progress``).
    ``options``: the loss functions, parameter groups, checkpoint extras and accelerator
    (:class:`TrainOptions`; None: its defaults).
    """
    o = options or TrainOptions()
    loss_fn, val_loss_fn, eval_steps = o.loss_fn, o.val_loss_fn, o.eval_steps
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    if len(train_data) == 0:
        raise ConfigError("train_data is empty")
    # Mixed precision is ours (torch.autocast), not Accelerate's: its process-wide state cannot change
    # between runs in one process (pretrain then heal, tests), and the fp32-master rule is explicit here.
    accelerator = o.accelerator or make_accelerator()
    warn_if_bf16_emulated(cfg.precision, accelerator.device)
    optimizer = _optimizer(model, cfg, o.param_groups)
    step, tokens, elapsed_before, changed, latest = _resume(out_dir, cfg, model, optimizer, accelerator)
    if hasattr(model, "gradient_checkpointing"):
        model.gradient_checkpointing = cfg.gradient_checkpointing  # type: ignore[assignment]  # any module with the switch
    elif cfg.gradient_checkpointing:
        raise ConfigError(f"gradient_checkpointing: {type(model).__name__} has no gradient_checkpointing switch")
    model, optimizer = accelerator.prepare(model, optimizer)
    log = RunLog(out_dir, enabled=accelerator.is_main_process)
    log.truncate_after(step)
    if changed and latest is not None:
        log.write({"step": step, "tokens": tokens, "resumed_with": changed})

    world = accelerator.num_processes
    model.train()
    t_start = time.perf_counter()
    last_loss: float | None = None
    val_loss: float | None = None
    stopped_early = False
    progress = None
    if cfg.progress and accelerator.is_local_main_process:
        progress = tqdm(total=cfg.max_steps, initial=step, desc="train", unit="step", dynamic_ncols=True)

    checkpoints = _Checkpoints(out_dir, cfg.keep_checkpoints, o.extra_state, o.checkpoint_trainable_only, log)
    with _StopRequested() as stop:
        t_window, tok_window = time.perf_counter(), 0
        while step < cfg.max_steps:
            lr = cfg.lr_at(step)
            t_step = time.perf_counter()
            step_loss, step_metrics, n_tok, grad_norm = _update(model, optimizer, train_data, cfg, loss_fn, accelerator, step, lr)
            tokens += n_tok
            tok_window += n_tok
            step_s = time.perf_counter() - t_step  # this step's compute alone (no evaluation, no checkpoint)
            step += 1
            if world > 1:  # each process saw 1/world of the global batch: log (and check) the global mean
                step_loss, step_metrics = _global_mean(accelerator, step_loss, step_metrics)
            if not math.isfinite(step_loss):
                raise FloatingPointError(f"loss is {step_loss} at step {step}; lower the learning rate")
            last_loss = step_loss
            if step % cfg.log_every == 0 or step == cfg.max_steps:
                now = time.perf_counter()
                rate = tok_window / max(now - t_window, 1e-9)
                t_window, tok_window = now, 0
                record = {"step": step, "loss": step_loss, "lr": lr, "tokens": tokens, "grad_norm": grad_norm}
                log.write(
                    record | {"tokens_per_s": rate, "step_s": step_s, "elapsed_s": elapsed_before + now - t_start, **step_metrics}
                )
                if progress is not None:
                    progress.set_postfix(loss=f"{step_loss:.3f}", tok_s=f"{rate:,.0f}", lr=f"{lr:.2e}")
            if progress is not None:
                progress.update(1)
            due = (cfg.eval_every and (step % cfg.eval_every == 0 or step == cfg.max_steps)) or step in eval_steps
            if val_data is not None and due:
                val_loss = _validate(model, val_data, val_loss_fn or loss_fn, cfg, accelerator)
                log.write({"step": step, "val_loss": val_loss, "val_ppl": math.exp(min(val_loss, 50)), "tokens": tokens})
                if progress is not None:
                    progress.write(f"step {step}: val loss {val_loss:.4f} (ppl {math.exp(min(val_loss, 50)):.2f})")
            out_of_time = cfg.max_time_s is not None and time.perf_counter() - t_start >= cfg.max_time_s
            stop_now, out_of_time = _stop_together(accelerator, stop.flag, out_of_time)
            if step % cfg.save_every == 0 or step == cfg.max_steps or stop_now or out_of_time:
                checkpoints.save(accelerator, model, optimizer, step, tokens, elapsed_before + time.perf_counter() - t_start)
            if stop_now or out_of_time:
                stopped_early = step < cfg.max_steps
                break
    if progress is not None:
        progress.close()
    return TrainResult(
        step=step, tokens=tokens, train_loss=last_loss, val_loss=val_loss, stopped_early=stopped_early, history=log.read()
    )


def _optimizer(model: nn.Module, cfg: TrainConfig, param_groups: list[dict[str, Any]] | None) -> torch.optim.AdamW:
    """AdamW over ``param_groups`` (default: :func:`default_param_groups`), each group with an ``lr_scale``;
    ConfigError when nothing is trainable."""
    groups = param_groups if param_groups is not None else default_param_groups(model, cfg.weight_decay)
    for g in groups:
        g.setdefault("lr_scale", 1.0)
    if not any(p.requires_grad for g in groups for p in g["params"]):
        raise ConfigError("no trainable parameters: every parameter has requires_grad=False")
    return torch.optim.AdamW(groups, lr=cfg.lr, betas=(cfg.beta1, cfg.beta2), eps=cfg.eps)


def _resume(
    out_dir: Path, cfg: TrainConfig, model: nn.Module, optimizer: torch.optim.Optimizer, accelerator: Accelerator
) -> tuple[int, int, float, dict[str, Any], Path | None]:
    """(step, tokens, elapsed seconds, what changed since the run started, the checkpoint) of the newest
    checkpoint in ``out_dir``, loaded into ``model`` and ``optimizer`` (a fresh run: zeros and None)."""
    step, tokens, elapsed_before = 0, 0, 0.0
    latest = find_latest(out_dir)
    changed = _check_config(out_dir, cfg, write=accelerator.is_main_process)
    if latest is not None:
        state = load_checkpoint(latest, model, optimizer)
        step, tokens, elapsed_before = state["step"], state["tokens"], state.get("elapsed_s", 0.0)
        if state.get("optimizer_reset") and not (latest / "optimizer.pt").is_file():
            changed["optimizer"] = state["optimizer_reset"]
    return step, tokens, elapsed_before, changed, latest


def _accumulate(
    model: nn.Module, train_data: Sequence[Batch], cfg: TrainConfig, loss_fn: LossFn, accelerator: Accelerator, step: int
) -> tuple[float, dict[str, float], int]:
    """One optimizer step's gradients, accumulated over ``cfg.grad_accum`` micro-batches: (this process's mean
    loss, its mean metrics, the tokens all processes saw)."""
    world, rank = accelerator.num_processes, accelerator.process_index
    step_loss, step_metrics, tokens = 0.0, dict[str, float](), 0
    for micro in range(cfg.grad_accum):
        micro_index = (step * cfg.grad_accum + micro) * world + rank
        idx = batch_indices(len(train_data), cfg.seed, micro_index, cfg.micro_batch_size)
        batch = {k: v.to(accelerator.device) for k, v in collate(train_data, idx).items()}
        sync = micro == cfg.grad_accum - 1
        with nullcontext() if sync else accelerator.no_sync(model), autocast(cfg.precision, accelerator.device):
            loss, metrics = loss_fn(model, batch)
            aux = getattr(accelerator.unwrap_model(model), "aux_loss", None)
            if aux is not None:  # e.g. a causal encoder-decoder's indexers (their own loss)
                metrics = {**metrics, "aux_loss": float(aux.detach())}
                loss = loss + aux
            accelerator.backward(loss / cfg.grad_accum)
        step_loss += float(loss.detach()) / cfg.grad_accum
        for k, v in metrics.items():
            step_metrics[k] = step_metrics.get(k, 0.0) + v / cfg.grad_accum
        tokens += batch["input_ids"].numel() * world
    return step_loss, step_metrics, tokens


@dataclass
class _Checkpoints:
    """Where and how the loop checkpoints: every process waits, the main one writes (and plots the loss)."""

    out_dir: Path
    keep: int
    extra: dict[str, Any] | None
    trainable_only: bool
    log: RunLog

    def save(
        self,
        accelerator: Accelerator,
        model: nn.Module,
        optimizer: torch.optim.Optimizer,
        step: int,
        tokens: int,
        elapsed_s: float,
    ) -> None:
        accelerator.wait_for_everyone()
        if accelerator.is_main_process:
            save_checkpoint(
                self.out_dir,
                accelerator.unwrap_model(model),
                optimizer,
                step=step,
                tokens=tokens,
                elapsed_s=elapsed_s,
                keep=self.keep,
                extra=self.extra,
                trainable_only=self.trainable_only,
            )
            self.log.plot()


def _update(
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    train_data: Sequence[Batch],
    cfg: TrainConfig,
    loss_fn: LossFn,
    accelerator: Accelerator,
    step: int,
    lr: float,
) -> tuple[float, dict[str, float], int, float | None]:
    """One optimizer step at ``lr`` (times each group's ``lr_scale``): :func:`_accumulate`'s loss, metrics and
    tokens, and the gradient norm before clipping (None without ``cfg.grad_clip``)."""
    for g in optimizer.param_groups:
        g["lr"] = lr * g["lr_scale"]
    step_loss, step_metrics, n_tok = _accumulate(model, train_data, cfg, loss_fn, accelerator, step)
    grad_norm = None
    if cfg.grad_clip > 0:
        trainable = [p for g in optimizer.param_groups for p in g["params"]]
        grad_norm = float(accelerator.clip_grad_norm_(trainable, cfg.grad_clip))
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    return step_loss, step_metrics, n_tok, grad_norm


def _global_mean(accelerator: Accelerator, loss: float, metrics: dict[str, float]) -> tuple[float, dict[str, float]]:
    """The loss and metrics averaged over every process."""
    world, keys = accelerator.num_processes, sorted(metrics)
    total = _sum_over_processes(accelerator, [loss] + [metrics[k] for k in keys])
    return total[0] / world, {k: v / world for k, v in zip(keys, total[1:])}


def _stop_together(accelerator: Accelerator, stop: bool, out_of_time: bool) -> tuple[bool, bool]:
    """(stop now, out of time), true for every process when true for one: a process that stopped alone would
    leave the others waiting."""
    if accelerator.num_processes == 1:
        return stop, out_of_time
    stop_now, late = (v > 0 for v in _sum_over_processes(accelerator, [stop, out_of_time]))
    return stop_now, late


def _validate(model: nn.Module, val_data: Sequence[Batch], loss_fn: LossFn, cfg: TrainConfig, accelerator: Accelerator) -> float:
    """The validation loss over ``cfg.eval_batches`` batches (every process's share)."""
    return evaluate(
        model,
        val_data,
        loss_fn,
        cfg.micro_batch_size,
        cfg.eval_batches,
        accelerator.device,
        cfg.precision,
        accelerator=accelerator,
    )


# May change when a run resumes: what does not touch the arithmetic (how often to save, log, keep, validate), and
# ``precision``: the weights and AdamW moments are fp32 either way, and bf16
# autocast is fast only where the CPU has bf16 instructions (one core without them: 196 s a step of
# ced-8m-deep in bf16 against 31 s in fp32), so a run that moves machines may have to switch. A change is
# recorded in log.jsonl as {"step", "resumed_with"} so the curve says where it happened.
_RESUME_FREE_FIELDS = (
    "max_time_s",
    "progress",
    "gradient_checkpointing",
    "precision",
    "save_every",
    "eval_every",
    "keep_checkpoints",
    "log_every",
)


def _check_config(out_dir: Path, cfg: TrainConfig, write: bool = True) -> dict[str, Any]:
    """First run: write train_config.json (``write``: the main process only). Later runs: refuse to resume
    under a different config, except for ``_RESUME_FREE_FIELDS``; returns those that changed (old, new)."""

    path = out_dir / "train_config.json"
    mine = cfg.to_dict()
    changed: dict[str, Any] = {}
    if path.exists():
        theirs = json.loads(path.read_text())
        diff = {k: (theirs.get(k), v) for k, v in mine.items() if k not in _RESUME_FREE_FIELDS and theirs.get(k) != v}
        if diff and find_latest(out_dir) is not None:
            details = ", ".join(f"{k}: {a!r} -> {b!r}" for k, (a, b) in diff.items())
            raise ConfigError(
                f"{out_dir} holds a run with a different training config ({details}); "
                "resume with the same settings or choose another output directory"
            )
        changed = {
            k: [theirs.get(k), mine[k]] for k in ("precision", "gradient_checkpointing") if k in theirs and theirs[k] != mine[k]
        }
    if write:
        atomic_write_text(path, json.dumps(mine, indent=2) + "\n")
    return changed
