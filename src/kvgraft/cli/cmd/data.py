"""``kvgraft prepare-data`` and ``kvgraft tasks``."""

from __future__ import annotations

import argparse
import sys

from kvgraft.data import prepare_data as build_data
from kvgraft.data.tasks import SPLITS, TASK_SUMMARIES, TASKS, read_task_info, write_task
from kvgraft.data.tokenizer import load_tokenizer
from kvgraft.errors import KvgraftError
from kvgraft.reference import resolve_model


def prepare_data(args: argparse.Namespace) -> int:
    summary = build_data(
        args.out, sources=args.sources, vocab_size=args.vocab_size, seed=args.seed, files=args.files, tokenizer=args.tokenizer
    )
    for split, s in summary["splits"].items():
        print(f"{split:>10}: {s['documents']:>6} documents, {s['tokens']:>9,} tokens")
    return 0


def tasks(args: argparse.Namespace) -> int:
    if args.list:
        for name in TASKS:
            print(f"{name:>10}: {TASK_SUMMARIES[name]}")
        return 0
    if args.name is None or args.out is None:
        raise ValueError(f"give a task name ({', '.join(TASKS)}) and --out DIR, or --list")
    if args.name not in TASKS:
        raise ValueError(f"unknown task {args.name!r} (known: {', '.join(TASKS)})")
    tokenizer, tokenizer_name = None, None
    try:  # token counts with the reference model's tokenizer, when there is one
        path = resolve_model(args.tokenizer)
        tokenizer, tokenizer_name = load_tokenizer(path), path.name
    except (KvgraftError, FileNotFoundError) as exc:
        if args.tokenizer is not None:
            raise
        print(f"kvgraft: note: no token counts ({exc})", file=sys.stderr)
    out = write_task(
        args.name, args.out, seed=args.seed, tokenizer=tokenizer, tokenizer_name=tokenizer_name, overwrite=args.overwrite
    )
    info = read_task_info(out)
    tokens = info.get("tokens", {}).get("splits", {})
    print(f"{args.name} (seed {args.seed}, generator v{info['generator_version']}) -> {out}")
    for split in SPLITS:
        line = f"{split:>10}: {info['sizes'][split]:>5} examples"
        if split in tokens:
            t = tokens[split]
            line += f", {t['mean']:.1f} tokens per example (min {t['min']}, max {t['max']})"
        print(line)
    if tokens:
        print(
            f"{'all':>10}: {info['tokens']['all']['mean']:.1f} tokens per example (prompt + answer, {tokenizer_name} tokenizer)"
        )
    return 0
