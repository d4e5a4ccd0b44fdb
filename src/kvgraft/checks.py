"""Checks of arguments, run before any expensive work: integers and numbers in range (:func:`check_int`,
:func:`check_number`), outputs that cannot be written, devices that are not there, text that is not UTF-8.
Each raises a ``ValueError`` naming the argument, the value and what is accepted; the CLI prints a
``KvgraftError`` (``ConfigError``, ``OutputError``) as one line (exit status 2). Light imports only (torch
is imported when a device is checked)."""

from __future__ import annotations

import math
import os
import shutil
import tempfile
from pathlib import Path
from typing import TypeGuard

from kvgraft.errors import ConfigError, KvgraftError


class OutputError(KvgraftError, ValueError):
    """An output path cannot be written (read-only file system, no permission, a file in the way, ...)."""


def is_int(value: object) -> TypeGuard[int]:
    """``value`` is an ``int`` and not a ``bool`` (``True`` is an ``int`` to Python, never to an argument)."""
    return isinstance(value, int) and not isinstance(value, bool)


def is_number(value: object) -> TypeGuard[int | float]:
    """``value`` is an ``int`` or a ``float`` and not a ``bool``."""
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def _range_words(kind: str, low: float | None, high: float | None) -> str:
    if low is None and high is None:
        return f"an {kind}" if kind == "integer" else f"a {kind}"
    if high is None:
        if low == 0:
            return f"a non-negative {kind}"
        if low == 1 and kind == "integer":
            return "a positive integer"
        return f"an {kind} >= {low}" if kind == "integer" else f"a {kind} >= {low}"
    article = "an" if kind == "integer" else "a"
    return f"{article} {kind} in [{low}, {high}]" if low is not None else f"{article} {kind} <= {high}"


def check_int(
    name: str,
    value: object,
    *,
    low: int | None = None,
    high: int | None = None,
    optional: bool = False,
    accepted: str | None = None,
) -> None:
    """Raise ``ConfigError`` "NAME (VALUE) must be ACCEPTED" unless ``value`` is an integer (not a bool) in
    ``[low, high]`` (either bound may be None), or None when ``optional``. ``accepted`` replaces the words
    the bounds give ("a positive integer", "a non-negative integer", "an integer in [0, 7]", + " or None")."""
    if optional and value is None:
        return
    if is_int(value) and (low is None or value >= low) and (high is None or value <= high):
        return
    words = accepted or _range_words("integer", low, high) + (" or None" if optional else "")
    raise ConfigError(f"{name} ({value!r}) must be {words}")


def check_number(
    name: str,
    value: object,
    *,
    low: float | None = None,
    high: float | None = None,
    positive: bool = False,
    optional: bool = False,
    accepted: str | None = None,
) -> None:
    """Raise ``ConfigError`` "NAME (VALUE) must be ACCEPTED" unless ``value`` is a finite int or float (not a
    bool) in ``[low, high]`` (and > 0 when ``positive``), or None when ``optional``. ``accepted`` replaces
    the words the bounds give ("a positive finite number", "a number in [0, 1]", + " or None")."""
    if optional and value is None:
        return
    if is_number(value):
        v = float(value)
        if math.isfinite(v) and (low is None or v >= low) and (high is None or v <= high) and (not positive or v > 0):
            return
    words = accepted or ("a positive finite number" if positive else _range_words("number", low, high))
    raise ConfigError(f"{name} ({value!r}) must be {words}" + (" or None" if optional and not accepted else ""))


def check_writable(path: str | os.PathLike, *, what: str = "output") -> Path:
    """Raise ``OutputError`` unless ``path`` (a file or directory to be created or replaced) can be written.

    Probes the nearest existing ancestor by creating and removing a temporary directory in it, so that a
    read-only file system, a missing permission or a regular file in the way is reported before any work
    is done, and nothing is left behind (missing parent directories are not created here).
    """
    path = Path(path)
    ancestor = path.parent  # outputs are written next to their final place, then moved onto it
    while not ancestor.exists():
        if ancestor.parent == ancestor:
            break
        ancestor = ancestor.parent
    if ancestor.exists() and not ancestor.is_dir():
        raise OutputError(f"cannot write {what} {path}: {ancestor} is a file, not a directory")
    try:
        probe = tempfile.mkdtemp(prefix=".kvgraft-probe-", dir=ancestor)
    except OSError as exc:
        reason = exc.strerror or str(exc)
        raise OutputError(f"cannot write {what} {path}: {reason} ({ancestor})") from exc
    shutil.rmtree(probe, ignore_errors=True)
    return path


def check_text(name: str, text: str) -> str:
    """Raise ValueError when ``text`` (e.g. from argv, where undecodable bytes become surrogates) is not
    valid Unicode that can be written as UTF-8."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as exc:
        bad = text[exc.start : exc.end]
        raw = bad.encode("utf-8", "surrogateescape") if all(0xDC80 <= ord(c) <= 0xDCFF for c in bad) else None
        what = f"bytes {raw!r}" if raw is not None else f"{bad!r}"
        raise ConfigError(f"{name} is not valid UTF-8 text ({what} at character {exc.start}); pass UTF-8 text") from None
    return text


def check_device(device: str) -> str:
    """Raise ValueError unless ``device`` names a device torch can use here (``cuda`` needs a GPU)."""
    import torch  # lazy: kvgraft.checks runs on the CLI's start-up path, which stays free of torch

    try:
        dev = torch.device(device)
    except (RuntimeError, TypeError, ValueError) as exc:
        raise ConfigError(f"device {device!r} is not a device name (e.g. cpu, cuda, cuda:1): {exc}") from exc
    if dev.type == "cuda":
        if not torch.cuda.is_available():
            raise ConfigError(
                f"device {device!r}: no CUDA GPU is available here (torch.cuda.is_available() is False); use --device cpu"
            )
        if dev.index is not None and dev.index >= torch.cuda.device_count():
            raise ConfigError(f"device {device!r}: only {torch.cuda.device_count()} CUDA device(s) are visible")
    elif dev.type == "mps":
        if not (getattr(torch.backends, "mps", None) and torch.backends.mps.is_available()):
            raise ConfigError(f"device {device!r}: MPS is not available here; use --device cpu")
    elif dev.type not in ("cpu", "meta"):
        available = getattr(torch, dev.type, None)
        if available is None or not getattr(available, "is_available", lambda: False)():
            raise ConfigError(f"device {device!r} is not available here; use --device cpu")
    if dev.type == "meta":
        raise ConfigError(f"device {device!r} holds no data; use cpu or a GPU")
    return device


__all__ = ["OutputError", "check_device", "check_text", "check_writable"]
