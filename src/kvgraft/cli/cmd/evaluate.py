"""``kvgraft eval``: perplexity, KV memory and decode speed of one or more models, side by side."""

from __future__ import annotations

import argparse
from pathlib import Path

from kvgraft.checks import check_writable
from kvgraft.eval import EvalOptions, compare_table, evaluate, format_report
from kvgraft.eval.compare import write_compare_report
from kvgraft.eval.report import check_eval_args
from kvgraft.reference import resolve_model


def eval_models(args: argparse.Namespace) -> int:
    # every value is checked before any model or token file is read
    check_eval_args(args.seq_len, args.max_tokens, args.contexts, args.batch_sizes, args.new_tokens)
    if args.json:
        check_writable(args.json, what="--json file")
    if args.out:
        check_writable(Path(args.out) / "compare.md", what="--out directory")
    results = []
    models = args.model or [None]
    paths = [resolve_model(name) for name in models]
    tokens = None
    if args.text is None and len(paths) > 1:  # score every model on the same tokens
        tokens = next((p / "eval" / "heldout.npy" for p in paths if (p / "eval" / "heldout.npy").is_file()), None)
    for i, path in enumerate(paths):
        json_out = None
        if args.json:
            json_out = args.json if len(models) == 1 else Path(args.json).with_suffix(f".{i}.json")
        results.append(
            evaluate(
                model_path=path,
                text_file=args.text,
                tokens=tokens,
                json_out=json_out,
                options=EvalOptions(
                    seq_len=args.seq_len,
                    contexts=tuple(args.contexts),
                    batch_sizes=tuple(args.batch_sizes),
                    new_tokens=args.new_tokens,
                    max_tokens=args.max_tokens,
                ),
            )
        )
        print(format_report(results[-1]))
    if len(results) > 1:
        print(compare_table(results))
    if args.out:
        print(f"report: {write_compare_report(results, args.out) / 'compare.md'}")
    return 0
