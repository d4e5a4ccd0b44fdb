"""``kvgraft adapt``, ``kvgraft experiment`` and ``kvgraft probe``: LoRA adapters placed by meaning."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from kvgraft.adapters.placement import Placement
from kvgraft.atomic import atomic_write_text
from kvgraft.errors import ConfigError
from kvgraft.train.adapt import DEFAULT_PRESET, AdaptConfig
from kvgraft.train.adapt import adapt as run_adapt
from kvgraft.train.experiment import DEFAULT_CONFIGS, SWEEP_LRS, CurveOptions, StudyOptions, placement_curve, placement_study
from kvgraft.train.probe import probe as run_probe
from kvgraft.train.probe import probe_markdown


def adapt_config(args: argparse.Namespace) -> AdaptConfig:
    """The AdaptConfig of ``kvgraft adapt``'s options (``--lr-mult`` and ``--layers`` parsed and checked)."""
    mults = []
    for item in args.lr_mult or ():
        glob, sep, factor = item.rpartition("=")
        if not sep or not glob:
            raise ConfigError(f"--lr-mult {item!r} must look like GLOB=FACTOR, e.g. '*.compressor.*=0.1'")
        try:
            mults.append((glob, float(factor)))
        except ValueError:
            raise ConfigError(f"--lr-mult {item!r}: {factor!r} is not a number") from None
    placement = None
    if args.layers is not None or args.modules is not None or args.include or args.exclude:
        layers = args.layers or "all"
        if layers not in ("all", "encoder-half", "decoder-half") and not layers.startswith("from:"):
            try:
                layers = tuple(int(x) for x in layers.split(","))
            except ValueError:
                raise ConfigError(
                    f"--layers {args.layers!r}: all, encoder-half, decoder-half, from:K or a list like 4,5,6"
                ) from None
        placement = Placement(
            layers, tuple(args.modules or ("all-linear",)), tuple(args.include or ()), tuple(args.exclude or ())
        )
    preset = args.preset
    if placement is not None:  # the placement given; the rank from --rank, else from --preset or the default
        preset = None if args.rank is not None else (preset or DEFAULT_PRESET)
    return AdaptConfig(
        preset=preset,
        placement=placement,
        rank=args.rank,
        alpha=args.alpha,
        dropout=args.dropout,
        freeze_kv_writers=args.freeze_kv_writers,
        freeze=tuple(args.freeze or ()),
        lr_multipliers=tuple(mults),
        loraplus_ratio=args.loraplus_ratio,
        steps=args.steps,
        lr=args.lr,
        micro_batch_size=args.micro_batch_size,
        seed=args.seed,
        gradient_checkpointing=args.gradient_checkpointing,
        accuracy_examples=args.accuracy_examples,
        val_examples=args.val_examples,
        test_examples=args.test_examples,
        require_sharing=args.share_cache,
        frozen_cache=args.frozen_cache,
        frozen_cache_mb=args.frozen_cache_mb,
        prompt_format=args.prompt_format or "auto",
        task_window=args.window,
        task_max_tokens=args.max_tokens,
    )


def adapt(args: argparse.Namespace) -> int:
    cfg = adapt_config(args)
    result = run_adapt(
        args.base, args.task, args.out, cfg, dry_run=args.dry_run, log=lambda line: print(line, flush=True)
    )  # the note before training, when it will not share
    share = result.get("sharing")  # absent when the run stopped early (no adapter yet)
    if args.dry_run:
        assert share is not None  # a dry run always certifies the placement
        for row in result["modules"]:
            print(f"{row['module']:<48} {row['in']:>6} -> {row['out']:<6} {row['lora_params']:>10,}")
        cert = result["certificate"]
        print(
            f"{len(result['modules'])} modules, {result['trainable_parameters']:,} trainable parameters "
            f"({100 * result['trainable_parameters'] / result['base_parameters']:.2f}% of the base's "
            f"{result['base_parameters']:,})"
        )
        print(f"prompt format: {result['prompt_format']}")
        print(f"sharing certificate: {share['verdict']}")
        print(f"  untouched cache groups: {', '.join(cert['untouched']) or '-'}")
        print(f"  touched cache groups:   {', '.join(cert['touched']) or '-'}")
        return 0
    keys = ("task", "steps", "val_loss_protocol", "test_loss", "test_accuracy", "step_time_s", "trainable_parameters")
    fp = result.get("frozen_prefix")
    if fp:
        print(
            f"frozen-prefix cache: layers 0-{fp['boundary'] - 1} run once per example ({fp['hits']:,} rows "
            f"from the cache, {fp['misses']:,} computed; {fp['bytes'] / 2**20:.1f} MiB held, bound {fp['max_bytes'] / 2**20:.0f})"
        )
    fmt = {"prompt_format": result.get("config", {}).get("prompt_format")}
    print(json.dumps({k: result.get(k) for k in keys} | fmt | {"adapter": str(Path(args.out) / "adapter")}))
    if share is not None:
        print(f"sharing certificate: {share['verdict']}")  # the run's last line
    return 0


def experiment(args: argparse.Namespace) -> int:
    if args.first_layers and not args.sweep_first_layer:
        raise ConfigError("--first-layers needs --sweep-first-layer (it chooses the placement curve's k)")
    if args.sweep_first_layer:
        curve = placement_curve(
            args.base,
            args.task,
            args.out,
            CurveOptions(
                seeds=args.seeds,
                steps=args.steps,
                rank=args.rank,
                lr=args.lr,
                micro_batch_size=args.micro_batch_size,
                precision=args.precision,
                frozen_cache=args.frozen_cache,
                frozen_cache_mb=args.frozen_cache_mb,
                first_layers=tuple(args.first_layers) if args.first_layers else None,
                val_examples=args.val_examples,
                test_examples=args.test_examples,
                prompt_format=args.prompt_format or "auto",
                task_window=args.window,
                task_max_tokens=args.max_tokens,
            ),
        )
        print((Path(args.out) / "curve.md").read_text())
        print(f"plot: {Path(args.out) / 'curve.png'}; pivot layer {curve['pivot']}")
        return 0
    placement_study(
        args.base,
        args.task,
        args.out,
        StudyOptions(
            seeds=args.seeds,
            steps=args.steps,
            configs=tuple(args.configs or DEFAULT_CONFIGS),
            lr=args.lr,
            micro_batch_size=args.micro_batch_size,
            accuracy_examples=args.accuracy_examples,
            precision=args.precision,
            val_examples=args.val_examples,
            test_examples=args.test_examples,
            frozen_cache=args.frozen_cache,
            frozen_cache_mb=args.frozen_cache_mb,
            sweep_lrs=tuple(args.sweep_lrs) if args.sweep_lrs else SWEEP_LRS,
            prompt_format=args.prompt_format or "auto",
            task_window=args.window,
            task_max_tokens=args.max_tokens,
        ),
    )
    print((Path(args.out) / "study.md").read_text())
    print(f"curves: {Path(args.out) / 'curves.png'}")
    return 0


def probe(args: argparse.Namespace) -> int:
    result = run_probe(
        args.adapter,
        args.task,
        base=args.base,
        steps=args.steps,
        micro_batch_size=args.micro_batch_size,
        val_examples=args.val_examples,
    )
    text = probe_markdown(result)
    print(text)
    if args.out:
        out = Path(args.out)
        out.mkdir(parents=True, exist_ok=True)
        atomic_write_text(out / "probe.md", text)
        atomic_write_text(out / "probe.json", json.dumps(result, indent=2) + "\n")
    return 0
