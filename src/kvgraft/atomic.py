"""Atomic outputs: a reader sees the old file or directory or the complete new one, never half of one."""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import IO


def _umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask


@contextmanager
def atomic_open(path: str | Path, mode: str = "wb", **kwargs) -> Iterator[IO]:
    """Open a temporary file next to ``path``; on clean exit move it onto ``path``.

    The temporary file lives in the same directory (so ``os.replace`` is atomic on
    POSIX) and is removed if the body raises. Readers therefore see either the old
    file or the complete new one, never a partial write.
    """
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp_name = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    try:
        with os.fdopen(fd, mode, **kwargs) as handle:
            yield handle
            handle.flush()
            os.fsync(handle.fileno())
        os.chmod(tmp_name, 0o666 & ~_umask())  # mkstemp makes 0600; give the usual mode
        os.replace(tmp_name, path)
    except BaseException:
        if os.path.exists(tmp_name):
            os.unlink(tmp_name)
        raise


def atomic_write_text(path: str | Path, text: str) -> None:
    """Write ``text`` (UTF-8) to ``path`` atomically."""
    with atomic_open(path, "w", encoding="utf-8", newline="\n") as handle:
        handle.write(text)


def atomic_write_json(path: str | Path, obj: object, indent: int | None = 2, default: object = None) -> None:
    """Write ``obj`` as JSON (with a final newline) to ``path`` atomically; ``default`` as in ``json.dumps``."""

    atomic_write_text(path, json.dumps(obj, indent=indent, default=default) + "\n")  # type: ignore[arg-type]


def atomic_savefig(fig: object, path: str | Path, **kwargs: object) -> None:
    """``fig.savefig`` (a matplotlib Figure) to ``path`` atomically; the format comes from the suffix."""
    path = Path(path)
    with atomic_open(path, "wb") as handle:
        fig.savefig(handle, format=path.suffix.lstrip(".") or "png", **kwargs)  # type: ignore[attr-defined]


@contextmanager
def atomic_dir(path: str | Path, overwrite: bool = False) -> Iterator[Path]:
    """Yield a temporary directory next to ``path``; on clean exit it becomes ``path``.

    With ``overwrite`` an existing ``path`` is replaced (moved aside, then deleted after the swap);
    without it an existing ``path`` raises ``FileExistsError`` before any work is done. On error the
    temporary directory is removed and ``path`` is untouched.
    """
    path = Path(path)
    if path.exists() and not overwrite:
        raise FileExistsError(f"{path} already exists; pass overwrite to replace it")
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent))
    try:
        yield tmp
        os.chmod(tmp, 0o777 & ~_umask())
        for f in tmp.rglob("*"):  # some writers (mkstemp, safetensors) create 0600 files
            if f.is_file() and not f.is_symlink():
                os.chmod(f, 0o666 & ~_umask())
        old = None
        if path.exists():
            old = path.with_name(f".{path.name}.old-{os.getpid()}")
            os.replace(path, old)
        os.replace(tmp, path)
        if old is not None:
            shutil.rmtree(old)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
