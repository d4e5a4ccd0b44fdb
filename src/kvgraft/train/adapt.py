"""The adapt recipe: train a placement-aware LoRA adapter on a task, on the one training loop.

``adapt(base, task, out_dir, AdaptConfig(...))`` loads the base (a shipped reference model or any
kvgraft-loadable checkpoint), encodes the task (``kvgraft.data.tasks``: loss masked to the answer),
attaches a PEFT LoRA adapter at the placement, trains with the shared loop (checkpoints hold only the
adapter; resumable), and writes:

The default placement is the one the mission is about: on a causal encoder-decoder (a base with
kv_source layers) ``decoder-half-r16`` with the pivot's KV writers frozen, whose adapter certifiably shares
the base's cache; on other bases ``decoder-half-r16`` (a shared cache does not apply there). A placement
chosen explicitly is trained as given: one that cannot share the cache is said so (``log``) before
training, and refused when ``require_sharing`` asks for sharing.

- ``out_dir/adapter/``: PEFT's ``adapter_config.json`` + ``adapter_model.safetensors`` and kvgraft's
  ``kvgraft_adapter.json`` (placement, modules, sharing certificate, the base by name or relative path with
  its fingerprint, training summary);
- ``out_dir/result.json`` (written last, atomically: its presence means the run is complete): the
  validation loss at every evaluation, Mind Lab's article's protocol value (mean of the evaluations at 50%, 70% and
  100% of the steps: steps 50, 70 and 100 of a 100-step run), test loss, test answer accuracy, step time.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import math
import shutil
import statistics
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch

from kvgraft.adapters.certificate import certify, sharing_obstacle, sharing_verdict
from kvgraft.adapters.fingerprint import base_reference
from kvgraft.adapters.lora import AdapterConfig, add_adapter, certificate_of, save_adapter, transformer_of
from kvgraft.adapters.lora import dry_run as placement_dry_run
from kvgraft.adapters.optim import adapter_param_groups, freeze
from kvgraft.adapters.placement import Placement, get_preset
from kvgraft.atomic import atomic_write_text
from kvgraft.checks import check_int
from kvgraft.data.tasks import TASKS, encode_example, generate_task, is_correct, load_task, read_task_info, tokenizer_eos_id
from kvgraft.data.tasks.formats import TaskEncoding, check_prompt_format, resolve_prompt_format
from kvgraft.data.tasks.recall import RECALL_MAX_TOKENS, RECALL_WINDOW
from kvgraft.data.tasks.registry import SIZED_TASKS
from kvgraft.data.tasks.sizing import TaskSizing, check_max_tokens, check_window
from kvgraft.data.tasks.ui_reply import UI_MAX_TOKENS
from kvgraft.errors import ConfigError
from kvgraft.hf import load_config, load_pretrained, load_tokenizer_dir
from kvgraft.model.config import ModelConfig
from kvgraft.reference import resolve_model
from kvgraft.runtime.engine import Engine
from kvgraft.runtime.options import EngineOptions
from kvgraft.runtime.sampling import SamplingParams
from kvgraft.train.checkpoint import find_latest
from kvgraft.train.config import TrainConfig
from kvgraft.train.frozen_prefix import DEFAULT_MAX_MB, MODES, CachedLMLoss, cache_obstacle, planned_boundary, shared_cache
from kvgraft.train.loop import TrainOptions, evaluate, lm_loss, train

RESULT_FILE = "result.json"
_DEFAULT_BUDGET = {"recall": RECALL_MAX_TOKENS, "ui-reply": UI_MAX_TOKENS}
DEFAULT_PRESET = "decoder-half-r16"


@dataclass(frozen=True)
class AdaptConfig:
    """One adapter run. ``preset`` gives placement and rank; ``placement``/``rank`` override it. Neither
    preset nor placement: the base's default (:meth:`for_base`: on a causal encoder-decoder
    ``decoder-half-r16`` with the pivot's KV writers frozen, the cache-sharing placement; elsewhere
    ``decoder-half-r16``). ``freeze_kv_writers`` None: frozen in that default on a causal encoder-decoder,
    not otherwise. ``require_sharing``: refuse, before training, an adapter that could not share the base's
    cache (or a base without a shared cache); a check, not part of the run's configuration.
    ``frozen_cache``: cache the frozen layers' outputs per example across epochs
    (``kvgraft.train.frozen_prefix``; the same losses, bit for bit): ``auto`` where the placement leaves
    layer 0 frozen (a note where not), ``on`` (refused where it cannot), ``off``; at most
    ``frozen_cache_mb`` MiB held. Not part of the run's configuration either (it does not change a number)."""

    preset: str | None = None
    placement: Placement | None = None
    rank: int | None = None
    alpha: float | None = None  # default 2 x rank
    dropout: float = 0.0
    freeze_kv_writers: bool | None = None
    freeze: tuple[str, ...] = ()  # module globs whose adapter stays frozen
    lr_multipliers: tuple[tuple[str, float], ...] = ()  # (module glob, factor)
    loraplus_ratio: float | None = None
    steps: int = 100
    lr: float = 2e-3
    warmup_steps: int = 10
    micro_batch_size: int = 16
    seed: int = 0  # adapter init and data order (the same data order for every placement at a seed)
    eval_every: int = 0  # validate every N steps as well (0: only at 10%, 30% and the protocol's steps)
    precision: str = "fp32"
    gradient_checkpointing: bool = False
    accuracy_examples: int = 200  # test problems answered by greedy generation (0: skip)
    val_examples: int | None = None  # validation examples scored (None: the whole split)
    test_examples: int | None = None  # test examples scored for the test loss (None: the whole split)
    max_time_s: float | None = None
    progress: bool = True
    require_sharing: bool = False
    frozen_cache: str = "auto"
    frozen_cache_mb: int = DEFAULT_MAX_MB
    prompt_format: str = "auto"  # plain, chat, auto (chat when the base's tokenizer has a chat template)
    task_window: int | None = None  # a task generated by name: the window it is sized for (recall)
    task_max_tokens: int | None = None  # a task generated by name: its token budget

    def __post_init__(self) -> None:
        check_prompt_format(self.prompt_format, "prompt_format")
        check_window(self.task_window)
        check_max_tokens(self.task_max_tokens)
        if self.frozen_cache not in MODES:
            raise ConfigError(f"frozen_cache {self.frozen_cache!r} is not one of {', '.join(MODES)}")
        check_int("frozen_cache_mb", self.frozen_cache_mb, low=1, accepted="a positive integer (MiB)")
        if self.preset is not None:
            get_preset(self.preset)  # raises with the known names
        check_int("eval_every", self.eval_every, low=0, accepted="an integer >= 0")
        for name in ("steps", "micro_batch_size"):
            check_int(name, getattr(self, name), low=1)
        if self.accuracy_examples < 0 or self.warmup_steps < 0:
            raise ConfigError(f"accuracy_examples ({self.accuracy_examples}) and warmup_steps ({self.warmup_steps}) must be >= 0")
        for name in ("val_examples", "test_examples"):
            check_int(name, getattr(self, name), low=1, optional=True)
        if not self.lr > 0 or not math.isfinite(self.lr):
            raise ConfigError(f"lr ({self.lr!r}) must be a positive number")
        object.__setattr__(self, "freeze", tuple(self.freeze))
        object.__setattr__(self, "lr_multipliers", tuple((str(g), float(f)) for g, f in self.lr_multipliers))
        self.adapter_config()  # validates rank/alpha/dropout

    @property
    def is_default_placement(self) -> bool:
        """No preset and no placement given: the base decides (:meth:`for_base`)."""
        return self.preset is None and self.placement is None

    def for_base(self, config) -> AdaptConfig:
        """This configuration with the base's defaults filled in (``config``: the base's ModelConfig): the
        default placement when none is given, ``freeze_kv_writers`` as a plain bool."""
        if self.is_default_placement:
            freeze = config.is_ced if self.freeze_kv_writers is None else self.freeze_kv_writers
            return dataclasses.replace(self, preset=DEFAULT_PRESET, freeze_kv_writers=bool(freeze))
        return dataclasses.replace(self, freeze_kv_writers=bool(self.freeze_kv_writers))

    def resolved_placement(self) -> Placement:
        if self.is_default_placement:
            raise ConfigError("the default placement depends on the base: resolve it with for_base(config) first")
        if self.placement is not None:
            p = self.placement
        else:
            assert self.preset is not None  # not the default placement: one of the two is given
            p = get_preset(self.preset).placement
        if self.freeze_kv_writers and not p.freeze_kv_writers:
            p = Placement(p.layers, p.modules, p.include, p.exclude, True)
        return p

    def adapter_config(self) -> AdapterConfig:
        rank = self.rank if self.rank is not None else get_preset(self.preset or DEFAULT_PRESET).rank
        return AdapterConfig(rank=rank, alpha=self.alpha, dropout=self.dropout)

    def eval_steps(self) -> tuple[int, ...]:
        """The protocol of Mind Lab's article on LoRA placement: evaluations at 50%, 70% and 100% of the steps (50, 70, 100 of 100)."""
        return tuple(sorted({max(1, round(self.steps * f)) for f in (0.5, 0.7, 1.0)}))

    def to_dict(self) -> dict[str, Any]:
        """The run's configuration (what a finished run is compared with); ``require_sharing`` is a check
        and the frozen-prefix cache a speed-up, neither part of it."""
        d = asdict(self)
        for name in ("require_sharing", "frozen_cache", "frozen_cache_mb"):
            del d[name]
        d["placement"] = None if self.is_default_placement else self.resolved_placement().to_dict()
        return d


_FORMAT_KEYS = {"prompt_format": "plain", "task_window": None, "task_max_tokens": None}
"""The configuration entries a run gained with the chat format, and what a run finished before meant by them."""


def _recorded(config: dict[str, Any]) -> dict[str, Any]:
    """A recorded run configuration with the entries older runs lack filled in (they ran in the plain format,
    on tasks sized for the reference models)."""
    return {**_FORMAT_KEYS, **config}


def _format_differences(recorded: dict[str, Any], now: dict[str, Any]) -> list[str]:
    old = _recorded(recorded)
    return [f"{k} {old[k]!r} there, {now[k]!r} here" for k in _FORMAT_KEYS if old[k] != now[k]]


def encode_split(
    tokenizer, examples, seq_len: int, pad_id: int, encoding: TaskEncoding | None = None
) -> list[dict[str, torch.Tensor]]:
    """Fixed-length items for the loop: ``input_ids`` (seq_len) and next-token ``labels`` (-100 on the
    prompt and the padding). ``encoding``: the prompt format (None: plain, :func:`encode_example`)."""

    items = []
    for ex in examples:
        if encoding is None:
            ids, labels = encode_example(tokenizer, ex, seq_len + 1)
        else:
            ids, labels = encoding.encode(ex, seq_len + 1)
        x, y = ids[:-1], labels[1:]
        pad = seq_len - len(x)
        items.append({"input_ids": torch.tensor(x + [pad_id] * pad), "labels": torch.tensor(y + [-100] * pad)})
    return items


def task_seq_len(tokenizer, splits, limit: int, encoding: TaskEncoding | None = None) -> int:
    if encoding is None:
        longest = max(len(encode_example(tokenizer, ex, 10**6)[0]) for exs in splits.values() for ex in exs) - 1
    else:
        longest = max(len(encoding.encode(ex, 10**9)[0]) for exs in splits.values() for ex in exs) - 1
    if longest > limit:
        raise ConfigError(f"the task's longest example is {longest + 1} tokens; the model takes {limit + 1}")
    return longest


def load_task_any(task: str | Path, seed: int = 0, sizing: TaskSizing | None = None) -> tuple[str, dict]:
    """A task directory (``kvgraft tasks NAME --out DIR``) or a task name (generated in memory, sized by
    ``sizing`` when given)."""

    if str(task) in TASKS:
        return str(task), generate_task(str(task), seed=seed, sizing=sizing)
    path = Path(task)
    if not path.is_dir():
        raise FileNotFoundError(f"task {task!r} is neither a task name ({', '.join(TASKS)}) nor a task directory")
    return read_task_info(path)["name"], load_task(path)


def _ids(tokenizer, text: str) -> list[int]:
    enc = tokenizer.encode(text)
    return list(enc.ids) if hasattr(enc, "ids") else list(enc)


def answer_accuracy(
    model, tokenizer, task_name: str, examples, max_new_tokens: int, encoding: TaskEncoding | None = None
) -> float:
    """Greedy answers (engine, batched) to ``examples``; the fraction ``is_correct`` accepts. ``encoding``:
    the prompt format (None: plain); in the chat format the prompts go through the chat template and an
    answer stops at the template's end-of-turn token (or EOS), which is cut before the answer is read."""

    if not examples:
        return float("nan")
    if encoding is None or encoding.chat is None:
        eos = tokenizer_eos_id(tokenizer)
        stops: tuple[int, ...] = () if eos is None else (eos,)
        prompts = [_ids(tokenizer, ex.prompt) for ex in examples]
    else:
        stops = encoding.stop_ids
        prompts = [encoding.prompt_ids(ex.prompt) for ex in examples]
    limit = model.config.max_position_embeddings
    if any(len(p) >= limit for p in prompts):
        raise ConfigError(f"a prompt is {max(len(p) for p in prompts)} tokens; the model takes {limit}")
    params = [SamplingParams(max_new_tokens=min(max_new_tokens, limit - len(p)), stop_token_ids=stops) for p in prompts]
    longest = max(len(p) + s.max_new_tokens for p, s in zip(prompts, params))
    engine = Engine(model, EngineOptions(max_seqs=min(64, len(prompts)), max_batch_tokens=2048, max_seq_len=longest))
    outs = engine.generate(prompts, params)
    if encoding is not None and encoding.chat is not None:
        outs = [encoding.cut_at_stop(o) for o in outs]
    texts = [tokenizer.decode(o) for o in outs]
    return sum(is_correct(task_name, ex, t) for ex, t in zip(examples, texts)) / len(examples)


def sharing(config, modules: list[str], base_name: str | None = None) -> dict[str, Any]:
    """Whether an adapter on ``modules`` shares the base's cache: ``applies`` (the base has a shared cache:
    a causal encoder-decoder), ``shares_cache`` (None where it does not apply), ``verdict`` (one line, with
    why) and ``why_not`` (what stops it, and what would share; None when it shares or does not apply)."""

    applies = bool(config.is_ced)
    return {
        "applies": applies,
        "shares_cache": certify(config, modules).shares_cache if applies else None,
        "verdict": sharing_verdict(config, modules, base_name),
        "why_not": sharing_obstacle(config, modules),
    }


def frozen_prefix_loss(peft_model, cfg: AdaptConfig, log: Callable[[str], None] | None) -> tuple[Any, CachedLMLoss | None]:
    """The loop's loss: through the frozen-prefix cache where ``cfg.frozen_cache`` and the model allow it
    (the process's one cache, :func:`kvgraft.train.frozen_prefix.shared_cache`), else ``lm_loss``;
    ``frozen_cache`` 'on' where it cannot apply is an error, 'auto' a note to ``log``."""
    if cfg.frozen_cache == "off":
        return lm_loss, None
    why = cache_obstacle(peft_model)
    if why is not None:
        if cfg.frozen_cache == "on":
            raise ConfigError(f"the frozen-prefix cache was required (frozen_cache 'on'), but it does not apply: {why}")
        if log is not None:
            log(f"note: no frozen-prefix cache ({why}): every step runs the whole model")
        return lm_loss, None
    prefix = CachedLMLoss(peft_model, shared_cache(cfg.frozen_cache_mb << 20), cfg.precision)
    return prefix, prefix


def adapt(
    base: str | Path | None,
    task: str | Path,
    out_dir: str | Path,
    cfg: AdaptConfig | None = None,
    dry_run: bool = False,
    log: Callable[[str], None] | None = None,
) -> dict[str, Any]:
    """Train one adapter (see the module docstring); returns the result (also ``out_dir/result.json``).
    ``dry_run``: only resolve the placement and return every matched module and the parameter count.
    ``log``: where a note goes before training when the adapter will not share the base's cache (None: not
    said). Both results carry ``sharing`` (see :func:`sharing`)."""

    path = resolve_model(base)
    model_config = load_config(path)
    cfg = (cfg or AdaptConfig()).for_base(model_config)
    placement, report, share = _placement_report(cfg, model_config, path)
    tokenizer = load_tokenizer_dir(path)
    cfg, task_plan = _resolve_format_and_sizing(cfg, task, tokenizer, path, model_config)
    report["prompt_format"] = cfg.prompt_format
    if dry_run:
        return report
    if share["why_not"] and log is not None:
        log(f"note: this adapter will not share {path.name}'s cache: {share['why_not']}")
    out = Path(out_dir)
    finished = _finished_run(out, cfg, share)
    if finished is not None:
        return finished
    if tokenizer is None:
        raise FileNotFoundError(f"{path} has no tokenizer; adapting on a text task needs one")
    encoding, task_name, splits, task_sizing = _load_task(task, cfg, tokenizer, path, task_plan, log)
    model = load_pretrained(path).float()
    plain = cfg.prompt_format == "plain"  # today's encoding, bit for bit
    seq_len, data = _encode_splits(tokenizer, splits, model.config, cfg, None if plain else encoding)

    torch.manual_seed(cfg.seed)  # the adapter's A matrices
    peft_model = add_adapter(model, placement, cfg.adapter_config())
    if cfg.freeze:
        freeze(peft_model, cfg.freeze)
    model.gradient_checkpointing = cfg.gradient_checkpointing
    loss_fn, prefix = frozen_prefix_loss(peft_model, cfg, log)
    groups = adapter_param_groups(peft_model, 0.0, dict(cfg.lr_multipliers), cfg.loraplus_ratio)
    val_batches = math.ceil(len(data["validation"]) / cfg.micro_batch_size)
    tcfg = _train_config(cfg, val_batches)
    t0 = time.perf_counter()
    eval_steps = sorted({max(1, round(cfg.steps * f)) for f in (0.1, 0.3)} | set(cfg.eval_steps()))
    extra = {"adapt_config": cfg.to_dict()}
    run = TrainOptions(
        loss_fn=loss_fn, param_groups=groups, extra_state=extra, checkpoint_trainable_only=True, eval_steps=eval_steps
    )
    result = train(peft_model, data["train"], tcfg, out, val_data=data["validation"], options=run)
    wall = time.perf_counter() - t0
    if result.stopped_early:
        return {"stopped_early": True, "step": result.step}
    history = result.history
    val = {h["step"]: h["val_loss"] for h in history if "val_loss" in h}
    train_curve = [(h["step"], h["loss"]) for h in history if "loss" in h]
    step_times = [h["step_s"] for h in history if "step_s" in h][1:]  # the first pays one-time set-up
    step_time = statistics.median(step_times) if step_times else wall / cfg.steps
    protocol = [val[s] for s in cfg.eval_steps() if s in val]
    test_loss = evaluate(
        peft_model,
        data["test"],
        lm_loss,
        cfg.micro_batch_size,
        math.ceil(len(data["test"]) / cfg.micro_batch_size),
        precision=cfg.precision,
    )
    accuracy = _accuracy(peft_model, tokenizer, task_name, splits["test"], cfg, None if plain else encoding)
    recorded = base_reference(path, out / "adapter")
    summary = {
        "task": task_name,
        "base": recorded["name"] if recorded.get("reference") else str(base),
        "config": cfg.to_dict(),
        "steps": result.step,
        "val_loss": {str(k): v for k, v in sorted(val.items())},
        "val_loss_protocol": statistics.fmean(protocol) if protocol else None,
        "protocol_steps": list(cfg.eval_steps()),
        "train_curve": train_curve,
        "test_loss": test_loss,
        "test_accuracy": accuracy,
        "accuracy_examples": cfg.accuracy_examples,
        "step_time_s": step_time,
        "wall_s": wall,
        "trainable_parameters": report["trainable_parameters"],
        "certificate": certificate_of(peft_model).to_dict(),
        "sharing": share,
        "seq_len": seq_len,
        "frozen_prefix": prefix.summary() if prefix is not None else None,
        "encoding": encoding.describe(),
        "task_sizing": task_sizing,
    }
    return _write_result(peft_model, path, out, cfg, summary)


def _encode_splits(
    tokenizer: Any, splits: dict[str, list[Any]], config: ModelConfig, cfg: AdaptConfig, encoding: TaskEncoding | None
) -> tuple[int, dict[str, list[Any]]]:
    """(the sequence length, each split encoded to it): validation and test cut to ``cfg``'s limits;
    ``encoding`` None: the plain encoding."""
    seq_len = task_seq_len(tokenizer, splits, config.max_position_embeddings - 1, encoding)
    pad = config.pad_token_id if config.pad_token_id is not None else (config.eos_token_id or 0)
    limits = {"train": None, "validation": cfg.val_examples, "test": cfg.test_examples}
    return seq_len, {s: encode_split(tokenizer, exs[: limits[s]], seq_len, pad, encoding) for s, exs in splits.items()}


def _placement_report(
    cfg: AdaptConfig, model_config: ModelConfig, path: Path
) -> tuple[Placement, dict[str, Any], dict[str, Any]]:
    """(the placement, its dry-run report, the sharing verdict), or ConfigError when the run asks for what the
    placement cannot give (a shared cache, a frozen layer 0 to cache)."""
    placement = cfg.resolved_placement()
    report = placement_dry_run(model_config, placement, cfg.adapter_config())  # validates before any work
    modules = [row["module"].removeprefix("model.") for row in report["modules"]]
    share = sharing(model_config, modules, path.name)
    if cfg.require_sharing and not share["applies"]:
        raise ConfigError(
            f"sharing the cache was required, but it does not apply: {path.name} has no shared cache "
            "(not a causal encoder-decoder: no kv_source layers)"
        )
    if cfg.require_sharing and not share["shares_cache"]:
        raise ConfigError(f"sharing the cache was required, but this placement cannot share it: {share['why_not']}")
    report["sharing"] = share
    first = planned_boundary(modules)  # the first adapted layer (a --freeze glob can only move it later)
    if cfg.frozen_cache == "on" and first == 0 and not cfg.freeze:
        raise ConfigError(
            "the frozen-prefix cache was required (frozen_cache 'on'), but this placement adapts layer 0 "
            f"({next(m for m in modules if m.startswith('layers.0.'))}, ...): no frozen layer before it to cache; "
            "adapt from a later layer (e.g. --layers decoder-half) or turn the cache off"
        )
    report["frozen_prefix_boundary"] = first
    return placement, report, share


def _finished_run(out: Path, cfg: AdaptConfig, share: dict[str, Any]) -> dict[str, Any] | None:
    """The result of a finished run in ``out`` with this configuration (None: none there); ConfigError for a
    finished or interrupted run with another one."""
    done = out / RESULT_FILE
    now = json.loads(json.dumps(cfg.to_dict()))
    if done.is_file():
        finished = json.loads(done.read_text())
        if _recorded(finished.get("config", {})) != now:
            why = _format_differences(finished.get("config", {}), now)
            raise ConfigError(
                f"{out} holds a finished run with another configuration{' (' + '; '.join(why) + ')' if why else ''}; "
                "choose another --out"
            )
        finished.setdefault("sharing", share)  # runs finished before the verdict was recorded
        return finished
    latest = find_latest(out)
    if latest is not None:  # an interrupted run: never resume it in another format or on another task sizing
        state = json.loads((latest / "state.json").read_text())
        why = _format_differences(state.get("adapt_config", {}), now)
        if why:
            raise ConfigError(
                f"{out} holds an interrupted run with another prompt format or task sizing ({'; '.join(why)}); choose another --out"
            )
    return None


def _load_task(
    task: str | Path, cfg: AdaptConfig, tokenizer: Any, path: Path, task_plan: dict[str, Any], log: Callable[[str], None] | None
) -> tuple[TaskEncoding, str, dict[str, list[Any]], dict[str, Any] | None]:
    """(the encoding, the task's name, its splits, what it was sized for): a task generated by name is sized
    with the base's tokenizer when ``task_plan`` says so."""
    encoding = TaskEncoding(tokenizer, cfg.prompt_format, where=str(path))
    sizing = None
    if task_plan["sized"]:
        sizing = TaskSizing(
            encoding,
            path.name,
            tokenizer_sha256=_tokenizer_sha(path),
            window=cfg.task_window,
            max_tokens=cfg.task_max_tokens,
        )
    task_name, splits = load_task_any(task, cfg.seed, sizing)
    task_sizing: dict[str, Any] | None
    if sizing is not None:  # what the task was sized for, defaults filled in
        task_sizing = sizing.to_dict() | {"max_tokens": cfg.task_max_tokens or _DEFAULT_BUDGET[task_name]}
    else:
        task_sizing = _check_task_dir(task, cfg.prompt_format, path, log)
    return encoding, task_name, splits, task_sizing


def _train_config(cfg: AdaptConfig, val_batches: int) -> TrainConfig:
    """The loop's configuration for an adapter run."""
    return TrainConfig(
        max_steps=cfg.steps,
        micro_batch_size=cfg.micro_batch_size,
        lr=cfg.lr,
        warmup_steps=cfg.warmup_steps,
        weight_decay=0.0,
        precision=cfg.precision,
        eval_every=cfg.eval_every,
        eval_batches=val_batches,
        save_every=max(1, cfg.steps // 2),
        keep_checkpoints=1,
        log_every=1,
        seed=cfg.seed,
        max_time_s=cfg.max_time_s,
        progress=cfg.progress,
        grad_clip=1.0,
        gradient_checkpointing=cfg.gradient_checkpointing,
    )


def _accuracy(
    peft_model: Any, tokenizer: Any, task_name: str, test: list[Any], cfg: AdaptConfig, encoding: TaskEncoding | None
) -> float | None:
    """Greedy answer accuracy on the first ``cfg.accuracy_examples`` test problems (None: 0 asked);
    ``encoding`` None: the plain encoding."""
    if not cfg.accuracy_examples:
        return None
    examples = test[: cfg.accuracy_examples]
    if encoding is None:
        answer_tokens = max(len(_ids(tokenizer, ex.answer)) for ex in examples)
    else:
        answer_tokens = max(len(encoding.answer_ids(ex.answer)) for ex in examples)
    return answer_accuracy(transformer_of(peft_model).eval(), tokenizer, task_name, examples, answer_tokens + 8, encoding)


def _write_result(peft_model: Any, path: Path, out: Path, cfg: AdaptConfig, summary: dict[str, Any]) -> dict[str, Any]:
    """Save the adapter and ``result.json`` (then drop the resume checkpoints); the summary as written."""
    done = out / RESULT_FILE
    save_adapter(
        peft_model,
        out / "adapter",
        base=path,
        extra={
            "training": {k: summary[k] for k in ("task", "steps", "val_loss_protocol", "test_loss", "test_accuracy")}
            | {"prompt_format": cfg.prompt_format}
        },
    )
    summary = json.loads(json.dumps(summary))  # what result.json holds (lists, not tuples)
    atomic_write_text(done, json.dumps(summary, indent=2) + "\n")
    ckpts = out / "checkpoints"
    if ckpts.is_dir():  # the adapter and the result are written; the resume state is no longer needed
        shutil.rmtree(ckpts)
    return summary


def _tokenizer_sha(path: Path) -> str | None:
    file = path / "tokenizer.json"
    return hashlib.sha256(file.read_bytes()).hexdigest() if file.is_file() else None


def _resolve_format_and_sizing(cfg: AdaptConfig, task, tokenizer, path: Path, model_config) -> tuple[AdaptConfig, dict[str, Any]]:
    """The run's prompt format (``auto`` resolved for the base's tokenizer) and how a task named here is
    sized, checked before any work. A task generated by name is sized for the base (its tokenizer, the run's
    format, ``task_window`` or the base's sliding window, ``task_max_tokens``) when the format is chat or a
    window or budget is given; otherwise as for the reference models (today's output). Returns the
    configuration with those values filled in (what the run records) and ``{"sized": bool}``."""
    if tokenizer is None:
        if cfg.prompt_format == "chat":
            raise ConfigError(f"prompt format 'chat' needs the base's chat template, and {path} has no tokenizer")
        fmt = "plain"
    else:
        fmt = resolve_prompt_format(cfg.prompt_format, tokenizer, where=str(path))
    knobs = cfg.task_window is not None or cfg.task_max_tokens is not None
    name = str(task)
    if name not in TASKS:
        if knobs:
            raise ConfigError(
                f"--window/--max-tokens size a task generated by name ({', '.join(SIZED_TASKS)}); the task "
                f"directory {name} was sized when it was written (its task.json): drop them, or write it again "
                "with kvgraft tasks NAME --window W --max-tokens N --tokenizer BASE"
            )
        return dataclasses.replace(cfg, prompt_format=fmt), {"sized": False}
    if name not in SIZED_TASKS:
        if knobs:
            raise ConfigError(
                f"{name} has no token budget or distance to size (accepted: --window/--max-tokens with {', '.join(SIZED_TASKS)})"
            )
        return dataclasses.replace(cfg, prompt_format=fmt), {"sized": False}
    if name != "recall" and cfg.task_window is not None:
        raise ConfigError(f"--window {cfg.task_window} applies to recall only ({name} has no distance); drop it")
    if not knobs and fmt == "plain":
        return dataclasses.replace(cfg, prompt_format=fmt), {"sized": False}
    window = cfg.task_window
    if name == "recall" and window is None:
        window = model_config.sliding_window or RECALL_WINDOW
    if tokenizer is None:
        raise FileNotFoundError(f"{path} has no tokenizer; sizing the task {name} for it needs one")
    return dataclasses.replace(cfg, prompt_format=fmt, task_window=window), {"sized": True}


def _check_task_dir(task, fmt: str, path: Path, log: Callable[[str], None] | None) -> dict[str, Any] | None:
    """A task directory's sizing (its task.json), refused when sized for another prompt format; a note when
    sized with another tokenizer, or (recall) for the reference models while the run is in the chat format."""
    if str(task) in TASKS:
        return None
    info = read_task_info(task)
    sizing = info.get("sizing")
    if sizing is None:
        if fmt == "chat" and info.get("name") == "recall" and log is not None:
            log(
                f"note: {task} was sized for the reference models (their tokenizer, plain format, window 64): "
                f"its distances are not checked in {path.name}'s chat encoding; write it with kvgraft tasks "
                f"recall --tokenizer {path} --window W"
            )
        return None
    if sizing.get("prompt_format") != fmt:
        raise ConfigError(
            f"the task {task} was sized in the {sizing.get('prompt_format')!r} prompt format (its task.json) and "
            f"this run uses {fmt!r}: run with --prompt-format {sizing.get('prompt_format')}, or write the task "
            f"again with --prompt-format {fmt}"
        )
    sha = _tokenizer_sha(path)
    if sizing.get("tokenizer_sha256") not in (None, sha) and log is not None:
        log(
            f"note: {task} was sized with {sizing.get('tokenizer')}'s tokenizer, not {path.name}'s: its token counts may differ here"
        )
    return sizing


__all__ = ["AdaptConfig", "DEFAULT_PRESET", "RESULT_FILE", "adapt", "answer_accuracy", "encode_split", "load_task_any", "sharing"]
