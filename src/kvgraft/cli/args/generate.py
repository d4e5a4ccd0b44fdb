"""``kvgraft generate``: its arguments (run by :mod:`kvgraft.cli.cmd.generate`)."""

from __future__ import annotations

from kvgraft.cli.args.common import MODEL_HELP, Subparsers


def add_generate(sub: Subparsers) -> None:
    p = sub.add_parser(
        "generate", help="sample text from a model through the engine (greedy, temperature, top-p, stop strings), streamed"
    )
    p.add_argument("model", nargs="?", default=None, help=MODEL_HELP)
    p.add_argument("--prompt", required=True)
    p.add_argument("--max-new-tokens", type=int, default=64)
    p.add_argument("--temperature", type=float, default=0.8, help="0 = greedy")
    p.add_argument("--top-p", type=float, default=0.95)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--stop", action="append", help="stop when the output contains this text (repeatable)")
    p.set_defaults(func="generate:generate")
