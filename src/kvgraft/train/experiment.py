"""Placement studies over seeds (the protocol of Mind Lab's article "Adapting causal encoder-decoder
models with LoRA") and the placement curve.

``placement_study``: the same task, data order and learning rate for every configuration; 3 seeds; each
run's validation loss is the mean of its evaluations at steps 50, 70 and 100 (of 100); reported as the
mean and (min-max) over seeds, with the per-seed difference decoder-half minus encoder-half, test loss
and answer accuracy, trainable parameters, the sharing certificate and step time. The learning rate is
picked first by a short sweep judged by *plateau* (the mean training loss over the sweep's last third),
not by early loss, as that article did.

The LR sweep's short runs are fp32; the study's runs use ``precision`` (bf16 autocast with fp32 master
weights by default, the article's mixed precision, about 1.5x faster on the CPU).

``placement_curve``: adapters on layers k..L-1 for every k at equal rank (the pivot's KV writers frozen),
validation loss and step time against k, marking which k leave the shared cache untouched.

Every run is an ``adapt`` run in its own directory: a finished run is read back, an interrupted one
resumes from its checkpoint, so rerunning the same command continues the study.
"""

from __future__ import annotations

import dataclasses
import json
import statistics
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from tqdm.auto import tqdm

from kvgraft.adapters.placement import PRESETS, Placement
from kvgraft.atomic import atomic_write_text
from kvgraft.checks import is_int
from kvgraft.data.tasks.formats import resolve_prompt_format
from kvgraft.errors import ConfigError, Interrupted
from kvgraft.hf import load_config
from kvgraft.reference import resolve_model
from kvgraft.train.adapt import AdaptConfig, adapt
from kvgraft.train.frozen_prefix import DEFAULT_MAX_MB

FROZEN = "+frozen-kv-writers"
DEFAULT_CONFIGS = (
    "all-linear-r16",
    "encoder-half-r16",
    "decoder-half-r16",
    "all-linear-r8",
    "slim-attention-r16",
    "no-mlp-down-r16",
    "all-linear-r16" + FROZEN,
    "decoder-half-r16" + FROZEN,
    "all-linear-r8" + FROZEN,
)
SWEEP_LRS = (3e-4, 1e-3, 3e-3, 1e-2)


@dataclass(frozen=True)
class RunOptions:
    """What every adapter run of an LR sweep, a placement study or a placement curve shares (``AdaptConfig``'s
    fields of the same names; ``progress``: the study's own progress bar, the runs show none)."""

    micro_batch_size: int = 16
    val_examples: int | None = None  # validation problems scored per run (None: all)
    frozen_cache: str = "auto"
    frozen_cache_mb: int = DEFAULT_MAX_MB
    prompt_format: str = "auto"
    task_window: int | None = None
    task_max_tokens: int | None = None
    progress: bool = True


@dataclass(frozen=True)
class StudyOptions(RunOptions):
    """:func:`placement_study`'s options (``lr`` None: picked by an LR sweep over ``sweep_lrs``)."""

    seeds: int = 3
    steps: int = 100
    configs: tuple[str, ...] = DEFAULT_CONFIGS
    lr: float | None = None
    sweep_lrs: tuple[float, ...] = SWEEP_LRS
    sweep_steps: int = 30
    accuracy_examples: int = 100
    precision: str = "bf16"
    test_examples: int | None = None


@dataclass(frozen=True)
class CurveOptions(RunOptions):
    """:func:`placement_curve`'s options (``lr`` is required: the study's pick)."""

    seeds: int = 3
    steps: int = 100
    rank: int = 16
    lr: float | None = None
    precision: str = "bf16"
    first_layers: tuple[int, ...] | None = None
    test_examples: int | None = None


def _run(base, task, out: Path, cfg: AdaptConfig) -> dict[str, Any]:
    """One adapter run of a study, sweep or curve; a run stopped by a signal (checkpointed) stops them all:
    :class:`~kvgraft.errors.Interrupted`, naming the run (rerunning the same command resumes it)."""
    r = adapt(base, task, out, cfg)
    if r.get("stopped_early"):
        raise Interrupted(f"the run in {out} stopped at step {r['step']} (checkpointed); rerun the same command to continue")
    return r


def parse_config(name: str) -> tuple[str, bool]:
    preset, frozen = (name[: -len(FROZEN)], True) if name.endswith(FROZEN) else (name, False)
    if preset not in PRESETS:
        raise ConfigError(
            f"configuration {name!r}: unknown preset {preset!r}; known: {', '.join(PRESETS)} "
            f"(append {FROZEN!r} to freeze the pivot's KV writers)"
        )
    return preset, frozen


STUDY_CONFIG = "study_config.json"


def study_format(base, task, out_dir, prompt_format: str, task_window: int | None, task_max_tokens: int | None) -> str:
    """The study's prompt format (``auto`` resolved for the base's tokenizer), checked with the task sizing
    before any run and recorded in ``out_dir/study_config.json``; a study continued with another format or
    sizing than it started with is refused (naming both)."""
    from kvgraft.hf import load_tokenizer_dir  # lazy: transformers

    AdaptConfig(prompt_format=prompt_format, task_window=task_window, task_max_tokens=task_max_tokens)  # the values
    path = resolve_model(base)
    tokenizer = load_tokenizer_dir(path) if path.is_dir() else None
    if tokenizer is None:
        if prompt_format == "chat":
            raise ConfigError(f"prompt format 'chat' needs the base's chat template, and {path} has no tokenizer")
        fmt = "plain"
    else:
        fmt = resolve_prompt_format(prompt_format, tokenizer, where=str(path))
    record = {"task": str(task), "prompt_format": fmt, "task_window": task_window, "task_max_tokens": task_max_tokens}
    file = Path(out_dir) / STUDY_CONFIG
    if file.is_file():
        old = json.loads(file.read_text())
        diff = [f"{k} {old.get(k)!r} there, {v!r} here" for k, v in record.items() if k != "task" and old.get(k) != v]
        if diff:
            raise ConfigError(
                f"{out_dir} holds a study with another prompt format or task sizing ({'; '.join(diff)}); choose another --out"
            )
    else:
        Path(out_dir).mkdir(parents=True, exist_ok=True)
        atomic_write_text(file, json.dumps(record, indent=2) + "\n")
    return fmt


def _check_frozen_cache(mode: str, mb: int) -> None:
    """Refuse a bad frozen-prefix cache setting before any run (naming the value and what is accepted)."""
    AdaptConfig(frozen_cache=mode, frozen_cache_mb=mb)


def _progress(total: int, desc: str, enabled: bool):
    return tqdm(total=total, desc=desc, unit="run", disable=not enabled, dynamic_ncols=True)


def _summ(values: list[float]) -> dict[str, float] | None:
    values = [v for v in values if v is not None]
    if not values:
        return None
    return {"mean": statistics.fmean(values), "min": min(values), "max": max(values), "n": len(values)}


def lr_sweep(
    base,
    task,
    out_dir: Path,
    lrs=SWEEP_LRS,
    steps: int = 30,
    preset: str = "all-linear-r16",
    max_extensions: int = 2,
    runs: RunOptions | None = None,
) -> dict[str, Any]:
    """Short runs at each LR; the pick is the lowest plateau (mean training loss over the last third). The
    runs score ``val_examples`` validation problems (None: all) and one test problem (the pick never
    reads the test split). A pick at an edge of the grid is not an optimum: the grid is extended past that
    edge by its own outer ratio and swept again, at most ``max_extensions`` times per edge (the result's
    ``at_edge`` says whether the final pick is still at one). ``runs``: what every run shares (None: the
    defaults)."""
    o = runs or RunOptions()
    lrs = _check_lrs(lrs)
    if max_extensions < 0:
        raise ConfigError(f"max_extensions ({max_extensions}) must be >= 0")
    rows: list[dict[str, Any]] = []
    bar = _progress(len(lrs), "lr sweep", o.progress)
    extended = {"low": 0, "high": 0}
    pending = list(lrs)
    while pending:
        lr = pending.pop(0)
        r = _run(
            base,
            task,
            out_dir / f"lr_{lr:g}",
            AdaptConfig(
                preset=preset,
                steps=steps,
                lr=lr,
                warmup_steps=max(1, steps // 10),
                micro_batch_size=o.micro_batch_size,
                accuracy_examples=0,
                progress=False,
                val_examples=o.val_examples,
                test_examples=1,
                frozen_cache=o.frozen_cache,
                frozen_cache_mb=o.frozen_cache_mb,
                prompt_format=o.prompt_format,
                task_window=o.task_window,
                task_max_tokens=o.task_max_tokens,
            ),
        )
        losses = [loss for _, loss in r["train_curve"]]
        tail = losses[-max(1, len(losses) // 3) :]
        rows.append(
            {
                "lr": lr,
                "plateau": statistics.fmean(tail),
                "early": statistics.fmean(losses[: max(1, len(losses) // 5)]),
                "final_val": r["val_loss"].get(str(steps)),
            }
        )
        bar.update(1)
        if not pending:  # the grid is done: extend it past an edge that holds the pick
            grid = sorted(row["lr"] for row in rows)
            best_lr = min(rows, key=lambda row: row["plateau"])["lr"]
            if best_lr == grid[-1] and extended["high"] < max_extensions:
                extended["high"] += 1
                pending.append(_round_lr(grid[-1] * grid[-1] / grid[-2]))
            elif best_lr == grid[0] and extended["low"] < max_extensions:
                extended["low"] += 1
                pending.append(_round_lr(grid[0] * grid[0] / grid[1]))
            if pending:
                bar.total = (bar.total or 0) + 1
    bar.close()
    rows.sort(key=lambda row: row["lr"])
    best = min(rows, key=lambda row: row["plateau"])
    return {
        "rows": rows,
        "lr": best["lr"],
        "rule": "lowest plateau (mean training loss over the last third)",
        "at_edge": best["lr"] in (rows[0]["lr"], rows[-1]["lr"]),
        "extensions": extended,
        "steps": steps,
        "preset": preset,
    }


def _check_lrs(lrs) -> list[float]:
    grid = sorted(float(x) for x in lrs)
    if len(grid) < 2 or grid[0] <= 0 or len(set(grid)) != len(grid):
        raise ConfigError(f"lrs ({grid}) must be at least two distinct positive learning rates")
    return grid


def _round_lr(lr: float) -> float:
    """Three significant digits (3e-2, not 0.030000000000000006): the LR names its run directory."""
    return float(f"{lr:.3g}")


def placement_study(
    base: str | Path | None, task: str | Path, out_dir: str | Path, options: StudyOptions | None = None
) -> dict[str, Any]:
    """Run (or continue) the study; writes ``study.json``, ``study.md`` and ``curves.png`` to ``out_dir``.
    ``frozen_cache``/``frozen_cache_mb``: each run's frozen-prefix cache (``AdaptConfig``; 'auto' uses it
    for the configurations that leave layer 0 frozen; one cache for the process, so seeds share it).
    ``prompt_format`` (plain, chat, auto: chat when the base's tokenizer has a chat template) and
    ``task_window``/``task_max_tokens`` (a task generated by name, sized for the base): every run's, recorded
    in ``study_config.json``; a rerun with another format or sizing is refused before any work. ``options``:
    a :class:`StudyOptions` (None: the defaults)."""
    o = options or StudyOptions()
    configs, seeds, steps, lr = o.configs, o.seeds, o.steps, o.lr
    parsed = [parse_config(c) for c in configs]  # validate everything before any work
    _check_frozen_cache(o.frozen_cache, o.frozen_cache_mb)
    if seeds < 1 or steps < 10 or steps % 10:
        raise ConfigError(f"seeds ({seeds}) must be >= 1 and steps ({steps}) a multiple of 10 (evaluations every 10)")
    if lr is not None and not lr > 0:
        raise ConfigError(f"lr ({lr}) must be > 0")
    if lr is None:
        _check_lrs(o.sweep_lrs)
    fmt = study_format(base, task, out_dir, o.prompt_format, o.task_window, o.task_max_tokens)
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    sweep = None
    if lr is None:
        run_options = RunOptions(**{f.name: getattr(o, f.name) for f in dataclasses.fields(RunOptions)})
        sweep = lr_sweep(
            base, task, out / "sweep", o.sweep_lrs, o.sweep_steps, runs=dataclasses.replace(run_options, prompt_format=fmt)
        )
        lr = sweep["lr"]
    runs: dict[str, list[dict]] = {c: [] for c in configs}
    bar = _progress(len(configs) * seeds, "placement study", o.progress)
    for seed in range(seeds):
        for name, (preset, frozen) in zip(configs, parsed):
            r = _run(
                base,
                task,
                out / "runs" / name / f"seed{seed}",
                AdaptConfig(
                    preset=preset,
                    freeze_kv_writers=frozen,
                    steps=steps,
                    lr=lr,
                    seed=seed,
                    precision=o.precision,
                    micro_batch_size=o.micro_batch_size,
                    accuracy_examples=o.accuracy_examples,
                    val_examples=o.val_examples,
                    test_examples=o.test_examples,
                    progress=False,
                    frozen_cache=o.frozen_cache,
                    frozen_cache_mb=o.frozen_cache_mb,
                    prompt_format=fmt,
                    task_window=o.task_window,
                    task_max_tokens=o.task_max_tokens,
                ),
            )
            runs[name].append(r)
            bar.update(1)
            bar.set_postfix(config=name, seed=seed, val=f"{r['val_loss_protocol']:.3f}")
    bar.close()
    study = summarise(runs, lr, steps, seeds, sweep)
    atomic_write_text(out / "study.json", json.dumps(study, indent=2) + "\n")
    atomic_write_text(out / "study.md", study_markdown(study))
    plot_curves(runs, out / "curves.png")
    return study


def summarise(runs: dict[str, list[dict]], lr: float, steps: int, seeds: int, sweep: dict | None) -> dict[str, Any]:
    table = {}
    for name, rs in runs.items():
        table[name] = {
            "val_loss": _summ([r["val_loss_protocol"] for r in rs]),
            "test_loss": _summ([r["test_loss"] for r in rs]),
            "test_accuracy": _summ([r["test_accuracy"] for r in rs]),
            "trainable_parameters": rs[0]["trainable_parameters"],
            "shares_cache": rs[0]["certificate"]["shares_cache"],
            "step_time_s": statistics.median(r["step_time_s"] for r in rs),
        }
    diffs = None
    if "decoder-half-r16" in runs and "encoder-half-r16" in runs:
        diffs = [
            d["val_loss_protocol"] - e["val_loss_protocol"] for d, e in zip(runs["decoder-half-r16"], runs["encoder-half-r16"])
        ]
    first = next(iter(runs.values()))[0]
    task = first["task"]
    return {
        "task": task,
        "prompt_format": first.get("config", {}).get("prompt_format", "plain"),
        "task_sizing": first.get("task_sizing"),
        "lr": lr,
        "steps": steps,
        "seeds": seeds,
        "sweep": sweep,
        "table": table,
        "decoder_minus_encoder_per_seed": diffs,
        "protocol": "validation loss = mean of the evaluations at steps 50%, 70%, 100%; mean (min-max) over seeds",
    }


def study_markdown(study: dict[str, Any]) -> str:
    def fmt(s, nd=3):
        return "-" if s is None else f"{s['mean']:.{nd}f} ({s['min']:.{nd}f}-{s['max']:.{nd}f})"

    lines = [
        f"Task {study['task']} ({study.get('prompt_format', 'plain')} format), {study['steps']} steps, {study['seeds']} seeds, LR {study['lr']:g}. {study['protocol']}.",
        "",
        "| configuration | trainable | val loss | test loss | test accuracy | shares the cache | step time (s) |",
        "|---|---|---|---|---|---|---|",
    ]
    for name, row in study["table"].items():
        lines.append(
            f"| {name} | {row['trainable_parameters']:,} | {fmt(row['val_loss'])} | {fmt(row['test_loss'])} | "
            f"{fmt(row['test_accuracy'])} | {'yes' if row['shares_cache'] else 'no'} | "
            f"{row['step_time_s']:.3f} |"
        )
    if study["decoder_minus_encoder_per_seed"] is not None:
        lines += [
            "",
            "Decoder-half minus encoder-half, per seed: "
            + ", ".join(f"{d:+.3f}" for d in study["decoder_minus_encoder_per_seed"]),
        ]
    if study.get("sweep"):
        sw = study["sweep"]
        lines += [
            "",
            f"LR sweep ({sw['preset']}, {sw['steps']} steps, {sw['rule']}): "
            + ", ".join(f"{r['lr']:g}: plateau {r['plateau']:.3f} (early {r['early']:.3f})" for r in sw["rows"])
            + f" -> {sw['lr']:g}"
            + (" (still at the grid's edge after extending it)" if sw.get("at_edge") else ""),
        ]
    return "\n".join(lines) + "\n"


def plot_curves(runs: dict[str, list[dict]], path: Path) -> None:
    """Training and validation curves per configuration (mean over seeds)."""
    import matplotlib  # lazy: matplotlib is heavy and only plotting needs it

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt  # lazy: matplotlib is heavy and only plotting needs it

    fig, (ax_t, ax_v) = plt.subplots(1, 2, figsize=(12, 4.5))
    for name, rs in runs.items():
        steps = [s for s, _ in rs[0]["train_curve"]]
        train = [statistics.fmean(r["train_curve"][i][1] for r in rs) for i in range(len(steps))]
        ax_t.plot(steps, train, label=name, linewidth=1)
        vsteps = sorted(int(s) for s in rs[0]["val_loss"])
        ax_v.plot(
            vsteps,
            [statistics.fmean(r["val_loss"][str(s)] for r in rs) for s in vsteps],
            marker="o",
            markersize=3,
            label=name,
            linewidth=1,
        )
    ax_t.set(title="training loss (mean over seeds)", xlabel="step", ylabel="loss")
    ax_v.set(title="validation loss (mean over seeds)", xlabel="step", ylabel="loss")
    ax_v.legend(fontsize=7)
    _save(fig, path)


def _save(fig, path: Path) -> None:
    """Write a figure atomically (a reader never sees half a PNG)."""
    import matplotlib.pyplot as plt  # lazy: matplotlib is heavy and only plotting needs it

    fig.tight_layout()
    tmp = path.with_suffix(".tmp.png")
    fig.savefig(tmp, dpi=120)
    plt.close(fig)
    tmp.replace(path)


def placement_curve(
    base: str | Path | None, task: str | Path, out_dir: str | Path, options: CurveOptions | None = None
) -> dict[str, Any]:
    """Adapters on layers k..L-1 for every k (all linear projections, the pivot's KV writers frozen); the
    runs with k >= 1 use the frozen-prefix cache unless ``frozen_cache`` is 'off' ('on': k = 0 is refused).
    ``first_layers``: the k to run (default every layer, 0..L-1; a subset makes a deep model's curve
    affordable). ``val_examples``/``test_examples``: problems scored per run (default: all), as in the study.
    ``options``: a :class:`CurveOptions` (its ``lr`` is required)."""
    o = options or CurveOptions()
    seeds, steps, lr, frozen_cache, first_layers = o.seeds, o.steps, o.lr, o.frozen_cache, o.first_layers
    _check_frozen_cache(frozen_cache, o.frozen_cache_mb)
    config = load_config(resolve_model(base))
    if lr is None:
        sweep_file = Path(out_dir).parent / "study" / "study.json"
        raise ConfigError(f"give lr (e.g. the placement study's pick, in {sweep_file})")
    if seeds < 1 or steps < 10 or steps % 10:
        raise ConfigError(f"seeds ({seeds}) must be >= 1 and steps ({steps}) a multiple of 10 (evaluations every 10)")
    L = config.num_layers
    ks = tuple(range(L)) if first_layers is None else tuple(first_layers)
    bad = [k for k in ks if not is_int(k) or not 0 <= k < L]
    if bad or not ks or len(set(ks)) != len(ks):
        raise ConfigError(
            f"first_layers {list(ks)}: each must be a distinct layer index in 0..{L - 1} (the model has {L} layers)"
        )
    ks = tuple(sorted(ks))
    if frozen_cache == "on" and 0 in ks:
        raise ConfigError("frozen_cache 'on' refuses k = 0 (layer 0 adapted); drop 0 from first_layers or use 'auto'")
    fmt = study_format(base, task, out_dir, o.prompt_format, o.task_window, o.task_max_tokens)
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    rows = []
    bar = _progress(len(ks) * seeds, "placement curve", o.progress)
    for k in ks:
        rs = []
        for seed in range(seeds):
            rs.append(
                _run(
                    base,
                    task,
                    out / "runs" / f"from{k}" / f"seed{seed}",
                    AdaptConfig(
                        preset=None,
                        placement=Placement(f"from:{k}", ("all-linear",), freeze_kv_writers=True),
                        rank=o.rank,
                        steps=steps,
                        lr=lr,
                        seed=seed,
                        micro_batch_size=o.micro_batch_size,
                        precision=o.precision,
                        accuracy_examples=0,
                        val_examples=o.val_examples,
                        test_examples=o.test_examples,
                        progress=False,
                        frozen_cache=frozen_cache,
                        frozen_cache_mb=o.frozen_cache_mb,
                        prompt_format=fmt,
                        task_window=o.task_window,
                        task_max_tokens=o.task_max_tokens,
                    ),
                )
            )
            bar.update(1)
        rows.append(
            {
                "first_layer": k,
                "val_loss": _summ([r["val_loss_protocol"] for r in rs]),
                "step_time_s": statistics.median(r["step_time_s"] for r in rs),
                "trainable_parameters": rs[0]["trainable_parameters"],
                "shares_cache": rs[0]["certificate"]["shares_cache"],
            }
        )
    bar.close()
    curve = {
        "task": rs[0]["task"],
        "lr": lr,
        "steps": steps,
        "seeds": seeds,
        "rank": o.rank,
        "prompt_format": fmt,
        "pivot": config.pivot_layer if config.is_ced else None,
        "rows": rows,
    }
    atomic_write_text(out / "curve.json", json.dumps(curve, indent=2) + "\n")
    lines = ["| first adapted layer k | trainable | val loss | step time (s) | shares the cache |", "|---|---|---|---|---|"]
    for r in rows:
        v = r["val_loss"]
        lines.append(
            f"| {r['first_layer']} | {r['trainable_parameters']:,} | {v['mean']:.3f} ({v['min']:.3f}-"
            f"{v['max']:.3f}) | {r['step_time_s']:.3f} | {'yes' if r['shares_cache'] else 'no'} |"
        )
    atomic_write_text(out / "curve.md", "\n".join(lines) + "\n")
    _plot_curve(curve, out / "curve.png")
    return curve


def _plot_curve(curve: dict, path: Path) -> None:
    import matplotlib  # lazy: matplotlib is heavy and only plotting needs it

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt  # lazy: matplotlib is heavy and only plotting needs it

    rows = curve["rows"]
    k = [r["first_layer"] for r in rows]
    mean = [r["val_loss"]["mean"] for r in rows]
    err = [[m - r["val_loss"]["min"] for m, r in zip(mean, rows)], [r["val_loss"]["max"] - m for m, r in zip(mean, rows)]]
    fig, ax = plt.subplots(figsize=(7, 4.5))
    ax.errorbar(k, mean, yerr=err, marker="o", capsize=3, label="validation loss (mean, min-max over seeds)")
    shared = [x for x, r in zip(k, rows) if r["shares_cache"]]
    if shared:
        ax.axvspan(min(shared) - 0.5, max(shared) + 0.5, color="green", alpha=0.1, label="shares the base's cache (certified)")
    ax.set(
        xlabel="first adapted layer k (adapter on layers k..L-1)",
        ylabel="validation loss",
        title=f"placement curve: {curve['task']}, rank {curve['rank']}, {curve['steps']} steps",
    )
    ax2 = ax.twinx()
    ax2.plot(k, [r["step_time_s"] for r in rows], color="gray", linestyle="--", marker="s", label="step time (s)")
    ax2.set_ylabel("training step time (s)")
    lines, labels = ax.get_legend_handles_labels()
    l2, lb2 = ax2.get_legend_handles_labels()
    ax.legend(lines + l2, labels + lb2, fontsize=8, loc="upper left")
    _save(fig, path)
