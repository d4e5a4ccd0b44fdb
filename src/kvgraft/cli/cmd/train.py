"""``kvgraft pretrain``, ``kvgraft heal`` and ``kvgraft ship``: the training loop's entry points."""

from __future__ import annotations

import argparse
import dataclasses
import json
from pathlib import Path

from accelerate import PartialState

from kvgraft.train.config import TrainConfig
from kvgraft.train.heal import HealConfig, HealOptions
from kvgraft.train.heal import heal as run_heal
from kvgraft.train.pretrain import pretrain as run_pretrain
from kvgraft.train.ship import ship_reference


def train_config(args: argparse.Namespace) -> TrainConfig:
    """The TrainConfig whose every field came from its ``--field-name`` option."""
    return TrainConfig(**{f.name: getattr(args, f.name) for f in dataclasses.fields(TrainConfig)})


def pretrain(args: argparse.Namespace) -> int:
    result = run_pretrain(args.data, args.out, model=args.model, train_config=train_config(args), seq_len=args.seq_len)
    if PartialState().is_main_process:  # one summary line under torchrun / accelerate launch too
        print(
            json.dumps(
                {
                    "step": result.step,
                    "tokens": result.tokens,
                    "train_loss": result.train_loss,
                    "val_loss": result.val_loss,
                    "stopped_early": result.stopped_early,
                }
            )
        )
    return 0


def ship(args: argparse.Namespace) -> int:
    command = args.command_line or "(not recorded)"
    out = ship_reference(args.run, args.data, args.out, command=command, overwrite=args.overwrite, compare_with=args.compare_with)
    print(f"shipped {out}")
    return 0


def heal(args: argparse.Namespace) -> int:
    hc = HealConfig(
        loss=args.loss,
        kl_weight=args.kl_weight,
        temperature=args.temperature,
        attention_only=args.attention_only,
        tokens=args.tokens,
        fraction_of_pretraining=args.fraction,
        copy_fraction=args.copy_fraction,
        copy_span=args.copy_span,
    )
    overrides = {f.name: getattr(args, f.name) for f in dataclasses.fields(TrainConfig) if getattr(args, f.name) is not None}
    result = run_heal(
        args.model,
        args.out,
        args.data,
        HealOptions(
            teacher=args.teacher,
            heal_config=hc,
            train_overrides=overrides,
            original_lr=args.original_lr,
            pretraining_tokens=args.pretraining_tokens,
            output_format=args.format,
            seq_len=args.seq_len,
        ),
    )
    print(
        json.dumps(
            {
                "step": result.step,
                "tokens": result.tokens,
                "train_loss": result.train_loss,
                "val_loss": result.val_loss,
                "final": str(Path(args.out) / "final"),
            }
        )
    )
    return 0
