"""The ``kvgraft`` command: one subcommand per entry-point function, no logic of its own.

``build_parser`` (``kvgraft.cli.parser``) declares every subcommand with light imports only; each subcommand
names its function in ``kvgraft.cli.cmd`` as ``"module:function"``, and ``main`` imports that one module when
the command runs, so ``kvgraft --help`` and argument errors never load torch or transformers.

User errors (``KvgraftError`` and its subclasses: bad values, corrupt checkpoints; ``OSError``: missing or
unwritable paths; argparse's errors) print one line ``kvgraft: error: ...`` and exit with status 2. Any
other exception is a bug: ``main`` lets it propagate, and the program (:func:`run`, what ``kvgraft`` and
``python -m kvgraft`` call) prints its traceback with a note asking to report it, exit status 1.
``kvgraft doctor`` exits with status 3 (``EXIT_BLOCKED``) when its report has a blocker (the report, and
``--json``, are written first), so a script can tell a blocked conversion.
``kvgraft convert`` exits with status 4 (``EXIT_EXPORT_ERROR``) when its stock DeepSeek-V3 export measured
above the stated tolerance (``kvgraft.errors.ExportError``; nothing is written).
A long job stopped by a signal after its checkpoint (``kvgraft.errors.Interrupted``: a placement study) exits
with status 130 (``EXIT_INTERRUPTED``) after one line; rerunning the same command continues it.
"""

from __future__ import annotations

import importlib
import sys
import traceback
from collections.abc import Sequence

from kvgraft.cli.exit_codes import EXIT_BLOCKED, EXIT_BUG, EXIT_ERROR, EXIT_EXPORT_ERROR, EXIT_INTERRUPTED
from kvgraft.cli.parser import build_parser
from kvgraft.errors import ExportError, Interrupted, KvgraftError

__all__ = [
    "EXIT_BLOCKED",
    "EXIT_BUG",
    "EXIT_ERROR",
    "EXIT_EXPORT_ERROR",
    "EXIT_INTERRUPTED",
    "build_parser",
    "main",
    "run",
]

BUG_NOTE = (
    "kvgraft: internal error: this is a bug in kvgraft, not a mistake in the command. Please report it with "
    "the traceback above and the command line."
)


def main(argv: Sequence[str] | None = None) -> int:
    """Parse ``argv`` and run its subcommand: its exit status, or ``EXIT_ERROR`` / ``EXIT_EXPORT_ERROR`` after
    one line for a user error. Any other exception propagates (:func:`run` reports it as a bug)."""
    parser = build_parser()
    args = parser.parse_args(argv)
    module, _, name = args.func.partition(":")
    try:
        command = getattr(importlib.import_module(f"kvgraft.cli.cmd.{module}"), name)  # the heavy imports, now
        return int(command(args))
    except Interrupted as exc:  # stopped by a signal after its checkpoint: not an error in the command
        print(f"kvgraft: stopped: {exc}", file=sys.stderr)
        return EXIT_INTERRUPTED
    except ExportError as exc:  # measured, not refused: its own status, so a script can tell it from a bad argument
        print(f"kvgraft: error: {exc}", file=sys.stderr)
        return EXIT_EXPORT_ERROR
    except (KvgraftError, OSError) as exc:  # OSError: missing or unwritable paths, full disks, ...
        print(f"kvgraft: error: {exc}", file=sys.stderr)
        return EXIT_ERROR


def run(argv: Sequence[str] | None = None) -> int:
    """The ``kvgraft`` program: :func:`main`, with any exception it does not answer as a user error (a bug)
    printed as its traceback and a note asking to report it, exit status 1."""
    try:
        return main(argv)
    except Exception:  # not a user error: a bug
        traceback.print_exc()
        print(BUG_NOTE, file=sys.stderr)
        return EXIT_BUG
