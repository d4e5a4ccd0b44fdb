"""``kvgraft doctor``: its arguments (run by :mod:`kvgraft.cli.cmd.doctor`)."""

from __future__ import annotations

from kvgraft.cli.args.common import MODEL_HELP, Subparsers
from kvgraft.cli.exit_codes import EXIT_BLOCKED, EXIT_ERROR


def add_doctor(sub: Subparsers) -> None:
    p = sub.add_parser(
        "doctor",
        help="check-up before an MLA graft: architecture, KV bytes now and after, blockers",
        epilog=f"exit status: 0 when nothing blocks the conversion, {EXIT_BLOCKED} when the report "
        f"lists a blocker (the report and --json are written either way), {EXIT_ERROR} for "
        "bad arguments or an unreadable model",
    )
    p.add_argument("model", nargs="?", default=None, help=MODEL_HELP)
    p.add_argument(
        "--compression",
        type=float,
        default=None,
        help="per-layer KV reduction factor that sets the budget d_c + d_rope (default 4), as in convert",
    )
    p.add_argument("--kv-lora-rank", type=int, default=None, help="latent width d_c (default: convert's rule, docs/ranks.md)")
    p.add_argument(
        "--rope-dim", type=int, default=None, help="shared RoPE key width d_rope (default: convert's rule, docs/ranks.md)"
    )
    p.add_argument(
        "--format",
        choices=["kvgraft", "deepseek_v3", "both"],
        default="kvgraft",
        help="the format convert would write (deepseek_v3/both: stock-exportable default ranks)",
    )
    p.add_argument("--json", default=None, help="also write the report as JSON here")
    p.add_argument(
        "--after", default=None, help="a converted or healed model: run the seed's troubleshooting checklist on it instead"
    )
    p.add_argument("--original", default=None, help="with --after: the model before conversion")
    p.set_defaults(func="doctor:doctor")
