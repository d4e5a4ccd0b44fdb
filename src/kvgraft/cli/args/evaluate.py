"""``kvgraft eval``: its arguments (run by :mod:`kvgraft.cli.cmd.evaluate`)."""

from __future__ import annotations

from kvgraft.cli.args.common import MODEL_HELP, Subparsers


def add_eval(sub: Subparsers) -> None:
    p = sub.add_parser("eval", help="perplexity, KV bytes per token (formula and measured), decode speed")
    p.add_argument("model", nargs="*", help=MODEL_HELP + "; several are compared side by side")
    p.add_argument("--text", default=None, help="text file to score (default: the model's eval/heldout.npy)")
    p.add_argument("--seq-len", type=int, default=None, help="perplexity window (default: model context)")
    p.add_argument("--max-tokens", type=int, default=None, help="score at most this many tokens")
    p.add_argument("--contexts", type=int, nargs="+", default=[128, 512, 2048], help="decode context lengths")
    p.add_argument("--batch-sizes", type=int, nargs="+", default=[1, 8], help="decode batch sizes")
    p.add_argument("--new-tokens", type=int, default=32, help="decode steps timed per point")
    p.add_argument("--json", default=None, help="write the report as JSON here")
    p.add_argument(
        "--compare",
        action="store_true",
        help="side-by-side report of the models given (the first is the baseline); use with --out",
    )
    p.add_argument("--out", default=None, help="directory for compare.md, compare.json and PNG plots")
    p.set_defaults(func="evaluate:eval_models")
