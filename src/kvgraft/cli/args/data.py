"""``kvgraft prepare-data`` and ``kvgraft tasks``: their arguments (run by :mod:`kvgraft.cli.cmd.data`)."""

from __future__ import annotations

from kvgraft.cli.args.common import Subparsers, add_sizing_args
from kvgraft.data.corpus import DEFAULT_SOURCES, SOURCES


def add_prepare_data(sub: Subparsers) -> None:
    p = sub.add_parser("prepare-data", help="build the corpus, train the BPE tokenizer, tokenize the splits")
    p.add_argument("--out", required=True, help="output directory (corpus/, tokenizer/, tokens/)")
    p.add_argument(
        "--sources",
        nargs="*",
        default=list(DEFAULT_SOURCES),
        choices=sorted(SOURCES),
        help="corpus sources (Debian packages, installed with apt-get when missing)",
    )
    p.add_argument("--files", nargs="*", default=[], help="extra text files, one document each")
    p.add_argument("--vocab-size", type=int, default=8192)
    p.add_argument(
        "--tokenizer",
        default=None,
        help="reuse this directory's tokenizer.json (e.g. a shipped model's) instead of training one: "
        "rebuilds that model's data with exactly its token ids",
    )
    p.add_argument("--seed", type=int, default=0)
    p.set_defaults(func="data:prepare_data")


def add_tasks(sub: Subparsers) -> None:
    p = sub.add_parser("tasks", help="write a synthetic fine-tuning task (geometry, ui-reply, recall) as JSONL splits")
    p.add_argument("name", nargs="?", default=None, help="task name (see --list)")
    p.add_argument("--out", default=None, help="output directory (refused if not empty, unless --overwrite)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--list", action="store_true", help="list the tasks and exit")
    p.add_argument(
        "--tokenizer",
        default=None,
        help="model directory or reference model name whose tokenizer counts tokens per example "
        "(default: the default reference model's, when available); with --window, --max-tokens or "
        "--prompt-format, the tokenizer the task is sized with",
    )
    add_sizing_args(p, "the task")
    p.add_argument("--overwrite", action="store_true")
    p.set_defaults(func="data:tasks")
