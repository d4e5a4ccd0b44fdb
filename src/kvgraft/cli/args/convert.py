"""``kvgraft convert``: its arguments, ``ConvertOptions``' fields (run by :mod:`kvgraft.cli.cmd.convert`)."""

from __future__ import annotations

from kvgraft.cli.args.common import MODEL_HELP, Subparsers
from kvgraft.cli.exit_codes import EXIT_ERROR, EXIT_EXPORT_ERROR
from kvgraft.graft.options import add_cli_options


def add_convert(sub: Subparsers) -> None:
    p = sub.add_parser(
        "convert",
        help="graft multi-head latent attention (MLA) onto a Llama-family model, or make it a causal encoder-decoder (--to ced)",
        epilog=f"exit status: 0 when the output is written, {EXIT_EXPORT_ERROR} when the stock DeepSeek-V3 export "
        "(--format deepseek_v3/both) measured above --export-tolerance or --export-kl-tolerance (nothing is "
        f"written; --accept-export-error writes it anyway), {EXIT_ERROR} for bad arguments, an unreadable model or "
        "a refusal",
    )
    p.add_argument("model", nargs="?", default=None, help=MODEL_HELP)
    p.add_argument("--out", required=True, help="output directory (refused if it exists, unless --overwrite)")
    add_cli_options(p)  # every other option, declared once with convert()'s (kvgraft.graft.options)
    p.set_defaults(func="convert:convert")
