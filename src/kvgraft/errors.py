"""Typed errors for user mistakes. The CLI turns each into one line and exit status 2 (``ExportError``: 4)."""

from __future__ import annotations

from typing import Any


class KvgraftError(Exception):
    """Base of every error kvgraft raises for bad user input."""


class CheckpointError(KvgraftError, ValueError):
    """A checkpoint directory or file is missing, corrupt, or does not match its config."""


class UnsupportedModelError(CheckpointError):
    """The checkpoint's architecture or one of its options is not supported."""


class ExportError(KvgraftError):
    """A stock DeepSeek-V3 export measured further from the model it was converted from than the stated
    tolerance (``kvgraft convert --export-tolerance`` / ``--export-kl-tolerance``); nothing was written.
    ``check``: the measured figures and the tolerances (``conversion.json``'s ``deepseek_v3.error_check``)."""

    def __init__(self, message: str, check: dict[str, Any] | None = None) -> None:
        super().__init__(message)
        self.check = dict(check or {})
