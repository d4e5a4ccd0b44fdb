"""``kvgraft prepare-data`` and ``kvgraft tasks``."""

from __future__ import annotations

import argparse
import sys

from kvgraft.data import prepare_data as build_data
from kvgraft.data.tasks import SIZED_TASKS, SPLITS, TASK_SUMMARIES, TASKS, load_sizing, read_task_info, write_task
from kvgraft.data.tokenizer import load_tokenizer
from kvgraft.errors import ConfigError, KvgraftError
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
        raise ConfigError(f"give a task name ({', '.join(TASKS)}) and --out DIR, or --list")
    if args.name not in TASKS:
        raise ConfigError(f"unknown task {args.name!r} (known: {', '.join(TASKS)})")
    sized = args.window is not None or args.max_tokens is not None or args.prompt_format is not None
    if sized:
        return _sized_task(args)
    if args.tokenizer is not None and args.name in SIZED_TASKS:
        print(
            f"kvgraft: note: {args.name} is sized for the reference models (their tokenizer, plain format, "
            "500 tokens, window 64); --tokenizer only counts its tokens here. Add --window (recall), "
            f"--max-tokens or --prompt-format to size it with {args.tokenizer}'s tokenizer",
            file=sys.stderr,
        )
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


def _sized_task(args: argparse.Namespace) -> int:
    """``kvgraft tasks NAME --window/--max-tokens/--prompt-format``: sized for a model's tokenizer."""
    if args.name not in SIZED_TASKS:
        raise ConfigError(
            f"--window, --max-tokens and --prompt-format size the tasks {', '.join(SIZED_TASKS)}; "
            f"{args.name} has no token budget or distance (drop them)"
        )
    sizing = load_sizing(
        args.tokenizer, window=args.window, max_tokens=args.max_tokens, prompt_format=args.prompt_format or "auto"
    )
    out = write_task(args.name, args.out, seed=args.seed, overwrite=args.overwrite, sizing=sizing)
    info = read_task_info(out)
    tokens = info["tokens"]
    s = info["sizing"]
    window = f", window {s['window']}" if s.get("window") is not None else ""
    print(
        f"{args.name} (seed {args.seed}, generator v{info['generator_version']}) -> {out}\n"
        f"sized for {s['tokenizer']}: {s['prompt_format']} format, at most {s['max_tokens']} tokens{window}"
    )
    for split in SPLITS:
        t = tokens["splits"][split]
        print(
            f"{split:>10}: {info['sizes'][split]:>5} examples, {t['mean']:.1f} tokens per example (min {t['min']}, max {t['max']})"
        )
    print(f"{'all':>10}: {tokens['all']['mean']:.1f} tokens per example ({tokens['counted']})")
    distance = info.get("distance")
    if distance and distance.get("measured"):
        m = distance["measured"]
        print(
            f"  distance: the queried line ends {m['min']}-{m['max']} tokens (median {m['median']}) before the "
            f"answer, at least {distance['min_tokens']} (window {distance['window']} + 32)"
        )
    return 0
