"""Checks that run before any expensive work: outputs that cannot be written, devices that are not there,
text that is not UTF-8. Each raises a ``ValueError`` subclass naming the value, which the CLI prints as one
line (exit status 2). Light imports only (torch is imported when a device is checked)."""

from __future__ import annotations

import os
import shutil
import tempfile
from pathlib import Path

from kvgraft.errors import KvgraftError


class OutputError(KvgraftError, ValueError):
    """An output path cannot be written (read-only file system, no permission, a file in the way, ...)."""


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
        raise ValueError(f"{name} is not valid UTF-8 text ({what} at character {exc.start}); pass UTF-8 text") from None
    return text


def check_device(device: str) -> str:
    """Raise ValueError unless ``device`` names a device torch can use here (``cuda`` needs a GPU)."""
    import torch  # lazy: kvgraft.checks runs on the CLI's start-up path, which stays free of torch

    try:
        dev = torch.device(device)
    except (RuntimeError, TypeError, ValueError) as exc:
        raise ValueError(f"device {device!r} is not a device name (e.g. cpu, cuda, cuda:1): {exc}") from exc
    if dev.type == "cuda":
        if not torch.cuda.is_available():
            raise ValueError(
                f"device {device!r}: no CUDA GPU is available here (torch.cuda.is_available() is False); use --device cpu"
            )
        if dev.index is not None and dev.index >= torch.cuda.device_count():
            raise ValueError(f"device {device!r}: only {torch.cuda.device_count()} CUDA device(s) are visible")
    elif dev.type == "mps":
        if not (getattr(torch.backends, "mps", None) and torch.backends.mps.is_available()):
            raise ValueError(f"device {device!r}: MPS is not available here; use --device cpu")
    elif dev.type not in ("cpu", "meta"):
        available = getattr(torch, dev.type, None)
        if available is None or not getattr(available, "is_available", lambda: False)():
            raise ValueError(f"device {device!r} is not available here; use --device cpu")
    if dev.type == "meta":
        raise ValueError(f"device {device!r} holds no data; use cpu or a GPU")
    return device


__all__ = ["OutputError", "check_device", "check_text", "check_writable"]
