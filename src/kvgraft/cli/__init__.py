"""The ``kvgraft`` command: one subcommand per entry-point function, no logic of its own.

User errors (bad paths, bad values, corrupt checkpoints) print one line ``kvgraft: error: ...``
and exit with status 2. ``kvgraft doctor`` exits with status 3 (``EXIT_BLOCKED``) when its report has a
blocker (the report, and ``--json``, are written first), so a script can tell a blocked conversion.
"""

from __future__ import annotations

import sys
from collections.abc import Sequence

from kvgraft.cli.adapter_commands import _adapt_config, cmd_adapt, cmd_experiment, cmd_probe, cmd_serve
from kvgraft.cli.commands import (
    _train_config,
    cmd_convert,
    cmd_demo,
    cmd_doctor,
    cmd_eval,
    cmd_generate,
    cmd_heal,
    cmd_prepare_data,
    cmd_pretrain,
    cmd_ship,
    cmd_tasks,
)
from kvgraft.cli.exit_codes import EXIT_BLOCKED, EXIT_ERROR
from kvgraft.cli.parser import _add_train_args, _preset_name, build_parser
from kvgraft.errors import KvgraftError

__all__ = [
    "EXIT_BLOCKED",
    "EXIT_ERROR",
    "_adapt_config",
    "_add_train_args",
    "_preset_name",
    "_train_config",
    "build_parser",
    "cmd_adapt",
    "cmd_convert",
    "cmd_demo",
    "cmd_doctor",
    "cmd_eval",
    "cmd_experiment",
    "cmd_generate",
    "cmd_heal",
    "cmd_prepare_data",
    "cmd_pretrain",
    "cmd_probe",
    "cmd_serve",
    "cmd_ship",
    "cmd_tasks",
    "main",
]


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        return args.func(args)
    except (KvgraftError, ValueError, OSError) as exc:  # OSError: unwritable outputs, full disks, ...
        print(f"kvgraft: error: {exc}", file=sys.stderr)
        return EXIT_ERROR
