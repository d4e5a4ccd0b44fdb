"""Typed errors for user mistakes. The CLI turns each into one line and exit status 2 (``ExportError``: 4);
any other exception is a bug, printed with its traceback."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any


class KvgraftError(Exception):
    """Base of every error kvgraft raises for bad user input."""


class ConfigError(KvgraftError, ValueError):
    """An argument or config value outside what is accepted; the message names the argument, the value and
    what is accepted (:func:`kvgraft.checks.check_int`, :func:`kvgraft.checks.check_number`)."""


class CheckpointError(KvgraftError, ValueError):
    """A checkpoint directory or file is missing, corrupt, or does not match its config."""


class UnsupportedModelError(CheckpointError):
    """The checkpoint's architecture or one of its options is not supported."""


class Interrupted(KvgraftError):
    """A long job stopped by a signal (SIGTERM, SIGINT) after writing its checkpoint: rerunning the same
    command continues it. The CLI prints one line and exits with status 130."""


class ExportError(KvgraftError):
    """A stock DeepSeek-V3 export measured further from the model it was converted from than the stated
    tolerance (``kvgraft convert --export-tolerance`` / ``--export-kl-tolerance``); nothing was written.
    ``check``: the measured figures and the tolerances (``conversion.json``'s ``deepseek_v3.error_check``)."""

    def __init__(self, message: str, check: dict[str, Any] | None = None) -> None:
        super().__init__(message)
        self.check = dict(check or {})


@contextmanager
def refusals_as_config_errors() -> Iterator[None]:
    """Re-raise a plain ``ValueError`` from the block as a :class:`ConfigError` (same message): for calls
    whose argument checks raise plain ``ValueError`` (the runtime's engine, sampling and KV budget), made
    with values a user gave."""
    try:
        yield
    except ValueError as exc:
        if isinstance(exc, KvgraftError):
            raise
        raise ConfigError(str(exc)) from exc
