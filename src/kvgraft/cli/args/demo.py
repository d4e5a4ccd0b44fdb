"""``kvgraft demo``: its arguments (run by :mod:`kvgraft.cli.cmd.demo`)."""

from __future__ import annotations

from kvgraft.cli.args.common import MODEL_HELP, Subparsers


def add_demo(sub: Subparsers) -> None:
    p = sub.add_parser("demo", help="the `make demo` job: the reference model, its 4x MLA graft, and the two side by side")
    p.add_argument("--model", default=None, help=MODEL_HELP)
    p.add_argument("--out", default="runs/demo", help="where report.json goes")
    p.add_argument(
        "--full",
        action="store_true",
        help="the long version (minutes): perplexity on the whole held-out slice, the conversion's "
        "default 32K calibration tokens, more decode steps; default: a quick setting (16K held-out "
        "and 16K calibration tokens spread over the slices, fewer decode steps)",
    )
    p.set_defaults(func="demo:demo")
