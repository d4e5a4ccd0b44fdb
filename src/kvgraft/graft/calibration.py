"""Calibration tokens for ``kvgraft convert``: read once when the conversion is planned, handed to the executor.

``plan_calibration`` reads and checks the tokens (file present, long enough, ids inside the vocabulary) and
returns a :class:`CalibrationPlan`; ``calibration_ids`` returns the ids that plan describes. The ids
``plan_calibration`` read are kept (one set, in this process) until ``calibration_ids`` takes them, so a text
file is tokenized once per conversion; a plan executed later, twice or elsewhere reads the file again.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from kvgraft.checks import check_int
from kvgraft.errors import ConfigError
from kvgraft.hf.load import load_tokenizer_dir

CALIBRATION = Path("eval") / "calibration.npy"  # a model directory's shipped calibration slice
# what a checkpoint without a shipped slice calibrates on (src/kvgraft/data/calibration/README.md)
DEFAULT_TEXT = Path(__file__).resolve().parents[1] / "data" / "calibration" / "default.txt"
DEFAULT_TEXT_SOURCE = "kvgraft's default calibration text (Python documentation + World English Bible)"


def default_calibration(model_dir: Path) -> Path:
    """The calibration a conversion of ``model_dir`` reads when none is given: the model's shipped slice
    (``eval/calibration.npy``, kvgraft's reference models) or else kvgraft's default text."""
    return model_dir / CALIBRATION if (model_dir / CALIBRATION).is_file() else DEFAULT_TEXT


def load_calibration(
    model_dir: Path,
    calibration: str | Path | None,
    tokens: int,
    seq_len: int,
    tokenizer: Any = None,
    vocab_size: int | None = None,
) -> torch.Tensor:
    """(N, seq_len) calibration ids: from a .npy token file, a text file (tokenized with ``tokenizer``), or
    the model's shipped slice or kvgraft's default text (``calibration`` None: ``default_calibration``); the
    first N * seq_len <= ``tokens`` of them.

    Raises ValueError (no shipped slice, no tokenizer for text, fewer tokens than one window, ids outside
    ``[0, vocab_size)``) or FileNotFoundError (``calibration`` missing), naming the file."""
    if calibration is None:
        calibration = default_calibration(model_dir)
    path = Path(calibration)
    if not path.is_file():
        raise FileNotFoundError(f"calibration file {path} does not exist")
    stream: Any
    if path.suffix == ".npy":
        stream = np.load(path, mmap_mode="r")
    else:
        if tokenizer is None:
            raise ConfigError(f"{model_dir} has no tokenizer to tokenize {path}; pass a .npy of token ids")
        stream = np.asarray(tokenizer.encode(path.read_text(encoding="utf-8")), dtype=np.int64)
    n = min(tokens, len(stream)) // seq_len
    if n == 0:
        raise ConfigError(f"calibration {path} has {len(stream)} tokens, fewer than one window of {seq_len}")
    ids = torch.from_numpy(np.asarray(stream[: n * seq_len], dtype=np.int64)).view(n, seq_len)
    if vocab_size is not None and (int(ids.min()) < 0 or int(ids.max()) >= vocab_size):
        raise ConfigError(
            f"calibration {path} holds token ids in [{int(ids.min())}, {int(ids.max())}], outside the "
            f"model's vocabulary [0, {vocab_size}); was it tokenized for another model?"
        )
    return ids


@dataclass(frozen=True)
class CalibrationPlan:
    """The calibration a conversion reads: ``sequences`` windows of ``seq_len`` tokens from ``path`` (at most
    ``tokens`` tokens). ``source``: the file as the caller named it (what ``conversion.json`` records)."""

    path: Path
    source: str
    tokens: int
    seq_len: int
    sequences: int

    def __post_init__(self) -> None:
        for name in ("tokens", "seq_len", "sequences"):
            value = getattr(self, name)
            check_int(name, value, low=1)
        if self.sequences * self.seq_len > self.tokens:
            raise ConfigError(f"{self.sequences} sequences of {self.seq_len} tokens exceed the {self.tokens} tokens asked for")

    def to_dict(self) -> dict[str, Any]:
        return {
            "source": self.source,
            "path": str(self.path),
            "tokens": self.tokens,
            "seq_len": self.seq_len,
            "sequences": self.sequences,
        }


_READ: dict[tuple[Any, ...], torch.Tensor] = {}  # the ids plan_calibration read, until calibration_ids takes them


def _key(model_dir: Path, plan: CalibrationPlan, vocab_size: int) -> tuple[Any, ...]:
    stat = plan.path.stat()
    return (str(model_dir), plan, vocab_size, stat.st_size, stat.st_mtime_ns)


def plan_calibration(
    model_dir: Path, calibration: str | Path | None, tokens: int, seq_len: int, tokenizer: Any, vocab_size: int
) -> CalibrationPlan:
    """Read and check the calibration ``load_calibration`` would return (same errors) and describe it."""
    ids = load_calibration(model_dir, calibration, tokens, seq_len, tokenizer, vocab_size)
    path = Path(calibration) if calibration is not None else default_calibration(model_dir)
    source = str(calibration) if calibration is not None else DEFAULT_TEXT_SOURCE if path == DEFAULT_TEXT else str(path)
    plan = CalibrationPlan(path=path, source=source, tokens=tokens, seq_len=seq_len, sequences=int(ids.shape[0]))
    _READ.clear()
    _READ[_key(model_dir, plan, vocab_size)] = ids
    return plan


def calibration_ids(model_dir: Path, plan: CalibrationPlan, vocab_size: int) -> torch.Tensor:
    """The (sequences, seq_len) ids ``plan`` describes: the ones ``plan_calibration`` read when the file is
    unchanged since, else read again (text with ``model_dir``'s tokenizer). RuntimeError when the file no
    longer gives the planned number of sequences."""
    ids = _READ.pop(_key(model_dir, plan, vocab_size), None)
    if ids is None:
        tokenizer = None
        if plan.path.suffix != ".npy":
            tokenizer = load_tokenizer_dir(model_dir)
        ids = load_calibration(model_dir, plan.path, plan.tokens, plan.seq_len, tokenizer, vocab_size)
    if ids.shape != (plan.sequences, plan.seq_len):
        raise RuntimeError(
            f"calibration {plan.path} changed since the conversion was planned: it gives "
            f"{tuple(ids.shape)} token windows, the plan {(plan.sequences, plan.seq_len)}"
        )
    return ids


__all__ = ["CALIBRATION", "CalibrationPlan", "calibration_ids", "load_calibration", "plan_calibration"]
