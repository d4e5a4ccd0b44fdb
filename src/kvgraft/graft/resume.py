"""``kvgraft convert --resume``: the layer-by-layer executor's staging directory and its per-layer checkpoint.

The layer-by-layer executor writes into a staging directory next to the output, ``.<out>.partial``
(:func:`staging_path`), which becomes the output in one rename when the conversion is complete (what
``kvgraft.atomic.atomic_dir`` does, with a name a later run can find). After each layer it records, in that
directory, what the walk up the layers needs to go on (:class:`Checkpoint`): the shards already written,
``state.json`` (the next layer, the writer's shards, the RoPE layouts chosen, the phase clocks, and the
:func:`fingerprint` of the source, options and calibration) and one ``state-<layer>.pt`` (the calibration
streams, the calibration tail's states, the output tensors not yet in a shard). The tensors file is written
first and ``state.json`` replaced after it, so a kill at any moment leaves the last complete checkpoint.

A conversion that fails or is interrupted after its first checkpoint keeps the staging directory (and says
so); one that fails before it leaves nothing. ``--resume`` continues from the last checkpoint when the
fingerprint matches and refuses, naming every difference, when it does not; without ``--resume`` an existing
staging directory is refused (``--overwrite`` discards it). A resumed conversion writes the same tensors,
config and ``conversion.json`` (apart from timings) as an uninterrupted one (``tests/test_convert_resume.py``).

Cost per layer: the streams (N x T x hidden fp32, twice without layer-wise calibration), the tail's
(2 x 8 x T x hidden) and at most one pending shard written with ``torch.save`` (no copy in memory).
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import numpy as np
import torch

from kvgraft import __version__
from kvgraft.atomic import atomic_write_json
from kvgraft.errors import KvgraftError
from kvgraft.graft.plan import ConvertPlan
from kvgraft.graft.staging import check_staging, staging_path
from kvgraft.hf.load import _shard_files

STATE = "state.json"
FORMAT = 1  # of state.json; a different one is not resumed
# plan fields and options that do not change what the walk writes: the export's tolerances are checked after
# it, so an interrupted conversion may be resumed with others (or with --accept-export-error)
NOT_COMPARED = ("out", "progress", "overwrite", "export_tolerance", "export_kl_tolerance", "accept_export_error")


class ResumeError(KvgraftError, ValueError):
    """A staging directory that cannot be continued (another source, other options, damaged state)."""


def fingerprint(plan: ConvertPlan, calib: torch.Tensor | None) -> dict[str, Any]:
    """What a checkpoint may only be continued with: the source (config.json's bytes, the weight files'
    names, sizes and modification times), the plan and options (except ``NOT_COMPARED`` and ``resume``),
    the calibration ids (their digest) and the kvgraft and torch versions (JSON-ready)."""
    src = plan.source
    files: dict[str, dict[str, Any]] = {}
    for path in [src / "config.json", *_shard_files(src)]:
        stat = path.stat()
        files[path.name] = {"bytes": stat.st_size, "mtime_ns": stat.st_mtime_ns}
    files["config.json"]["sha256"] = hashlib.sha256((src / "config.json").read_bytes()).hexdigest()
    planned = {k: v for k, v in plan.to_dict().items() if k not in NOT_COMPARED}
    planned["options"] = {k: v for k, v in planned["options"].items() if k not in NOT_COMPARED}
    digest = None
    if calib is not None:
        ids = np.ascontiguousarray(calib.cpu().numpy().astype(np.int64))
        digest = hashlib.sha256(ids.tobytes()).hexdigest() + f" {tuple(ids.shape)}"
    # through JSON: what is compared is what state.json holds (tuples as lists)
    out: dict[str, Any] = json.loads(
        json.dumps(
            {
                "source": str(src),
                "files": files,
                "plan": planned,
                "calibration_ids": digest,
                "versions": {"kvgraft": __version__, "torch": torch.__version__},
            },
            default=str,
        )
    )
    return out


def _differences(then: Any, now: Any, where: str = "") -> list[str]:
    if isinstance(then, dict) and isinstance(now, dict):
        out = []
        for key in sorted(set(then) | set(now), key=str):
            at = f"{where}.{key}" if where else str(key)
            if key not in then or key not in now:
                out.append(
                    f"{at}: {'absent' if key not in then else repr(then[key])} then, "
                    f"{'absent' if key not in now else repr(now[key])} now"
                )
            else:
                out += _differences(then[key], now[key], at)
        return out
    return [] if then == now else [f"{where}: {then!r} then, {now!r} now"]


class Checkpoint:
    """The per-layer checkpoint in the staging directory ``directory`` (see the module's docstring).
    ``state``: the last checkpoint's ``state.json`` (None until one is written or read)."""

    def __init__(self, directory: Path, fingerprint: dict[str, Any]) -> None:
        self.directory, self.fingerprint = directory, fingerprint
        self.state: dict[str, Any] | None = None

    def read(self) -> dict[str, Any] | None:
        """The checkpoint in ``directory`` (None when there is none); ResumeError when it was made from
        another source, with other options or calibration, or cannot be read."""
        path = self.directory / STATE
        if not path.is_file():
            return None
        try:
            state: dict[str, Any] = json.loads(path.read_text(encoding="utf-8"))
        except (OSError, ValueError) as exc:
            raise ResumeError(
                f"cannot resume {self.directory}: {path.name} is unreadable ({exc}); pass --overwrite to start over"
            ) from exc
        if state.get("format") != FORMAT:
            raise ResumeError(
                f"cannot resume {self.directory}: its checkpoint format {state.get('format')!r} is not this "
                f"kvgraft's ({FORMAT}); pass --overwrite to start over"
            )
        diff = _differences(state["fingerprint"], self.fingerprint)
        if diff:
            raise ResumeError(
                f"cannot resume {self.directory}: it was started from another source, with other options or "
                f"calibration: "
                + "; ".join(diff[:12])
                + (f"; and {len(diff) - 12} more" if len(diff) > 12 else "")
                + ". Rerun with the options it was started with, or pass --overwrite (without --resume) to "
                "discard its finished layers and start over"
            )
        if not (self.directory / state["tensors"]).is_file():
            raise ResumeError(
                f"cannot resume {self.directory}: its {state['tensors']} is missing; pass --overwrite to start over"
            )
        self.state = state
        return state

    def tensors(self) -> dict[str, torch.Tensor]:
        """The last checkpoint's tensors (streams, tail states, pending output tensors)."""
        assert self.state is not None
        loaded: dict[str, torch.Tensor] = torch.load(self.directory / self.state["tensors"], weights_only=True)
        return loaded

    def write(self, next_layer: int, tensors: dict[str, torch.Tensor], state: dict[str, Any]) -> None:
        """Record that the layers below ``next_layer`` are done: ``tensors`` first (a new file), then
        ``state.json`` (atomically), then the previous tensors file is removed."""
        name = f"state-{next_layer:05d}.pt"
        tmp = self.directory / f".{name}.tmp"
        with open(tmp, "wb") as handle:
            torch.save(tensors, handle)
            handle.flush()
            os.fsync(handle.fileno())
        os.replace(tmp, self.directory / name)
        full = {"format": FORMAT, "next_layer": next_layer, "tensors": name, "fingerprint": self.fingerprint, **state}
        atomic_write_json(self.directory / STATE, full)
        previous = None if self.state is None else self.state["tensors"]
        self.state = full
        if previous is not None and previous != name:
            (self.directory / previous).unlink(missing_ok=True)

    def discard(self) -> None:
        """Remove the checkpoint's files and forget it: an interruption from now on leaves nothing."""
        self.remove()
        self.state = None

    def remove(self) -> None:
        """Remove the checkpoint's own files (the output is complete)."""
        for path in self.directory.glob("state-*.pt"):
            path.unlink()
        (self.directory / STATE).unlink(missing_ok=True)


def _umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask


@contextmanager
def staging_dir(out: Path, overwrite: bool, resume: bool, fingerprint: dict[str, Any]) -> Iterator[Checkpoint]:
    """The staging directory of ``out`` with its checkpoint (read when ``resume``); on a clean exit it
    becomes ``out`` (an existing ``out`` replaced only with ``overwrite``), on an error it is kept when a
    checkpoint was written (a line on stderr says how to continue), else removed."""
    if out.exists() and not overwrite:
        raise FileExistsError(f"{out} already exists; pass overwrite to replace it")
    check_staging(out, resume, overwrite)
    staging = staging_path(out)
    checkpoint = Checkpoint(staging, fingerprint)
    if staging.exists():
        if resume:
            checkpoint.read()  # raises on another source / options
        if checkpoint.state is None:
            shutil.rmtree(staging)
    staging.mkdir(parents=True, exist_ok=True)
    try:
        yield checkpoint
        checkpoint.remove()
        os.chmod(staging, 0o777 & ~_umask())
        for f in staging.rglob("*"):  # safetensors and mkstemp create 0600 files
            if f.is_file() and not f.is_symlink():
                os.chmod(f, 0o666 & ~_umask())
        old = None
        if out.exists():
            old = out.with_name(f".{out.name}.old-{os.getpid()}")
            os.replace(out, old)
        os.replace(staging, out)
        if old is not None:
            shutil.rmtree(old)
    except BaseException:
        if checkpoint.state is not None and staging.is_dir():
            done = checkpoint.state["next_layer"]
            print(
                f"conversion interrupted: layers 0-{done - 1} are kept in {staging}; run the same command with "
                "--resume to continue from layer " + str(done),
                file=sys.stderr,
                flush=True,
            )
        else:
            shutil.rmtree(staging, ignore_errors=True)
        raise


__all__ = ["Checkpoint", "ResumeError", "check_staging", "fingerprint", "staging_dir", "staging_path"]
