"""What every task shares: :class:`Example`, :class:`TaskError`, the splits, the argument checks, the
exact token counter of the reference tokenizer, encoding for training and the task directory's files.

Standard library only (the reference tokenizer is loaded on first use). The task modules
(:mod:`~kvgraft.data.tasks.geometry`, :mod:`~kvgraft.data.tasks.ui_reply`, :mod:`~kvgraft.data.tasks.recall`)
build on this module and nothing else of the package; :mod:`~kvgraft.data.tasks.registry` sits above them.
"""

from __future__ import annotations

import hashlib
import json
import random
import re
from collections.abc import Callable, Mapping, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from types import MappingProxyType
from typing import Any

from kvgraft.atomic import atomic_dir
from kvgraft.checks import check_int, is_int
from kvgraft.data.tokenizer import load_tokenizer
from kvgraft.errors import ConfigError, KvgraftError
from kvgraft.reference import reference_model_dir

SPLITS: tuple[str, ...] = ("train", "validation", "test")
SPLIT_SIZES: Mapping[str, int] = MappingProxyType({"train": 1472, "validation": 224, "test": 601})
"""Examples per split, for both tasks (Geometry3K's split)."""
GENERATOR_VERSION = 1
"""Bumped whenever a generator's output for a given seed changes."""
TASK_INFO_FILE = "task.json"
IGNORE_INDEX = -100
EOS_TOKEN = "<|endoftext|>"


class TaskError(KvgraftError, ValueError):
    """A task cannot be generated or loaded: unknown name, missing file, malformed line."""


@dataclass(frozen=True)
class Example:
    """One fine-tuning example: the model sees ``prompt`` and learns to write ``answer``.

    ``target`` is the checkable part of the answer (geometry: the final number as text; ui-reply:
    the canonical JSON), ``kind`` the template that made it (e.g. ``"hypotenuse"``, ``"signup-form"``),
    for per-kind accuracy.
    """

    prompt: str
    answer: str
    target: str
    kind: str = ""

    def to_dict(self) -> dict[str, str]:
        return asdict(self)


def _exact_match(got: str, target: str) -> bool:
    return got == target


@dataclass(frozen=True)
class TaskSpec:
    """One task family as the registry (:mod:`kvgraft.data.tasks.registry`) knows it.

    ``generator`` is called once per :func:`~kvgraft.data.tasks.generate_task` call and returns the
    function that draws one example from the task's ``random.Random`` (a factory, so a task that measures
    its examples with the reference tokenizer loads it only when it generates). ``extract`` finds the
    checkable answer in generated text (None when there is none); ``correct(got, target)`` compares it
    with an example's target. ``format`` is written to ``task.json``; ``info``, when set, returns more
    ``task.json`` entries (a token budget, say). ``sized_generator(sizing)`` and ``sized_info(sizing, splits)``,
    when set, do the same for a task sized for another model (:mod:`kvgraft.data.tasks.sizing`); a task
    without them cannot be sized.
    """

    name: str
    summary: str
    generator: Callable[[], Callable[[random.Random], Example]]
    format: Mapping[str, Any]
    extract: Callable[[str], str | None]
    correct: Callable[[str, str], bool] = field(default=_exact_match)
    info: Callable[[], dict[str, Any]] | None = None
    sized_generator: Callable[[Any], Callable[[random.Random], Example]] | None = None
    sized_info: Callable[[Any, Mapping[str, Sequence[Example]]], dict[str, Any]] | None = None


# --------------------------------------------------------------------------- arguments


def _check_seed(seed: object) -> int:
    if not is_int(seed):
        raise TypeError(f"seed must be an int, not {type(seed).__name__} ({seed!r})")
    if seed < 0:
        raise ConfigError(f"seed must be >= 0, got {seed}")
    return seed


def _check_sizes(sizes: Mapping[str, int] | None) -> dict[str, int]:
    if sizes is None:
        return dict(SPLIT_SIZES)
    if not isinstance(sizes, Mapping) or set(sizes) != set(SPLITS):
        raise ConfigError(f"sizes must map exactly {', '.join(SPLITS)} to counts, got {sizes!r}")
    for split, n in sizes.items():
        check_int(f"sizes[{split!r}]", n, low=0)
    return {s: sizes[s] for s in SPLITS}


def _first_line(text: str) -> str:
    """The first line of generated text, before any EOS, stripped (where the short answers are read)."""
    return text.split(EOS_TOKEN, 1)[0].strip().split("\n", 1)[0]


# --------------------------------------------------------------------------- tokens


def _encode(tokenizer: Any, text: str) -> list[int]:
    """Token ids of ``text`` without special tokens, for a ``tokenizers.Tokenizer`` or a transformers one."""
    enc = tokenizer.encode(text, add_special_tokens=False)
    ids = getattr(enc, "ids", enc)
    return [int(i) for i in ids]


def _encode_many(tokenizer: Any, texts: list[str]) -> list[list[int]]:
    if hasattr(tokenizer, "encode_batch"):  # tokenizers.Tokenizer: parallel, fast
        return [list(e.ids) for e in tokenizer.encode_batch(texts, add_special_tokens=False)]
    return [_encode(tokenizer, t) for t in texts]


def tokenizer_eos_id(tokenizer: Any) -> int | None:
    """The tokenizer's EOS id (transformers ``eos_token_id``, else the id of ``<|endoftext|>``), or None."""
    eos = getattr(tokenizer, "eos_token_id", None)
    if isinstance(eos, int):
        return eos
    to_id = getattr(tokenizer, "token_to_id", None) or getattr(tokenizer, "convert_tokens_to_ids", None)
    if to_id is not None:
        eos = to_id(EOS_TOKEN)
        if isinstance(eos, int) and eos >= 0:
            return eos
    return None


def encode_example(tokenizer: Any, ex: Example, max_len: int, *, eos: bool | int = True) -> tuple[list[int], list[int]]:
    """``(input_ids, labels)`` of one example for supervised fine-tuning.

    ``input_ids = enc(prompt) + enc(answer) [+ eos]``; ``labels`` equals ``input_ids`` with
    :data:`IGNORE_INDEX` (-100) on the prompt tokens, so the loss covers the answer and the EOS only.
    Labels are aligned with the inputs (Hugging Face convention, the model shifts them); for a loss
    on pre-shifted targets use ``input_ids[:-1]`` and ``labels[1:]``. ``eos``: True appends the
    tokenizer's EOS when it has one (the reference models: id 0), False appends nothing, an int
    appends that id. ``tokenizer`` is a ``tokenizers.Tokenizer`` or a transformers tokenizer.
    ValueError when the result is longer than ``max_len`` or the answer encodes to nothing.
    """
    check_int("max_len", max_len, low=1)
    prompt_ids = _encode(tokenizer, ex.prompt)
    answer_ids = _encode(tokenizer, ex.answer)
    if not answer_ids:
        raise ConfigError("the example's answer encodes to no tokens")
    eos_id = tokenizer_eos_id(tokenizer) if eos is True else None if eos is False else int(eos)
    tail = [eos_id] if eos_id is not None else []
    ids = prompt_ids + answer_ids + tail
    if len(ids) > max_len:
        raise ConfigError(
            f"example is {len(ids)} tokens ({len(prompt_ids)} prompt + {len(answer_ids)} answer"
            f"{' + eos' if tail else ''}), longer than max_len={max_len}"
        )
    labels = [IGNORE_INDEX] * len(prompt_ids) + answer_ids + tail
    return ids, labels


def token_counts(tokenizer: Any, examples: Sequence[Example]) -> list[int]:
    """Tokens of prompt + answer per example (no EOS), prompt and answer encoded separately as in training."""
    prompts = _encode_many(tokenizer, [e.prompt for e in examples])
    answers = _encode_many(tokenizer, [e.answer for e in examples])
    return [len(p) + len(a) for p, a in zip(prompts, answers)]


def token_stats(tokenizer: Any, splits: Mapping[str, Sequence[Example]]) -> dict[str, Any]:
    """Mean / min / max tokens per example (prompt + answer, no EOS), per split and over all splits."""
    per: dict[str, Any] = {}
    every: list[int] = []
    for split, examples in splits.items():
        counts = token_counts(tokenizer, examples)
        every += counts
        per[split] = _summary(counts)
    return {"splits": per, "all": _summary(every)}


def _summary(counts: Sequence[int]) -> dict[str, float | int]:
    if not counts:
        return {"examples": 0, "mean": 0.0, "min": 0, "max": 0}
    return {"examples": len(counts), "mean": round(sum(counts) / len(counts), 2), "min": min(counts), "max": max(counts)}


# --------------------------------------------------------------------------- the reference tokenizer's ruler


_PIECE = re.compile(r"""'s|'t|'re|'ve|'m|'ll|'d| ?[A-Za-z]+| ?[0-9]+| ?[^\sA-Za-z0-9]+|\s+(?!\S)|\s+""")
"""The byte-level BPE pre-tokenizer's split (GPT-2's pattern) restricted to ASCII text: BPE never merges
across these pieces, so a text's token count is the sum of its pieces' counts."""


_LINE = re.compile(r"(?<=\S\n)(?=\S)|(?<=\S\n )(?= \S)")
"""Line starts that are piece boundaries too: a lone newline between non-spaces is a piece of its own,
and a newline and two spaces before a non-space split into the newline and a space, then " " + the rest."""


class _TokenCounter:
    """Exact token counts of a tokenizer, fast on the small closed vocabulary of the generators:
    counts are additive over pre-token pieces, so each distinct line and piece is encoded once."""

    def __init__(self, tokenizer: Any) -> None:
        self._tokenizer = tokenizer
        self._lines: dict[str, int] = {}
        self._pieces: dict[str, int] = {}

    def _count_pieces(self, text: str) -> int:
        total = 0
        cache = self._pieces
        for piece in _PIECE.findall(text):
            n = cache.get(piece)
            if n is None:
                n = cache[piece] = len(_encode(self._tokenizer, piece))
            total += n
        return total

    def __call__(self, text: str) -> int:
        if not text.isascii():
            return len(_encode(self._tokenizer, text))
        total = 0
        lines = self._lines
        for line in _LINE.split(text):
            n = lines.get(line)
            if n is None:
                n = self._count_pieces(line)
                if len(lines) < 200_000:
                    lines[line] = n
            total += n
        return total


_REFERENCE_COUNTER: _TokenCounter | None = None


def reference_tokenizer_file() -> Path:
    """The shipped reference models' ``tokenizer.json``, the ruler of the ui-reply token budget."""

    try:
        return reference_model_dir() / "tokenizer.json"
    except KvgraftError as exc:
        raise TaskError(f"ui-reply sizes its examples with the reference tokenizer: {exc}") from None


def _reference_counter() -> _TokenCounter:
    global _REFERENCE_COUNTER
    if _REFERENCE_COUNTER is None:
        path = reference_tokenizer_file()
        if not path.is_file():
            raise TaskError(f"ui-reply sizes its examples with the reference tokenizer, and {path} is missing")
        _REFERENCE_COUNTER = _TokenCounter(load_tokenizer(path))
    return _REFERENCE_COUNTER


def reference_token_budget(max_tokens: int) -> dict[str, Any]:
    """The ``task.json`` entry of a task sized with the reference tokenizer: the budget and the ruler's hash."""

    ruler = reference_tokenizer_file()
    return {
        "max_tokens": max_tokens,
        "counted": "prompt + answer + EOS",
        "tokenizer_sha256": hashlib.sha256(ruler.read_bytes()).hexdigest(),
    }


# --------------------------------------------------------------------------- files


def _parse_line(line: str, where: str) -> Example:
    try:
        obj = json.loads(line)
    except json.JSONDecodeError as exc:
        raise TaskError(f"{where}: not JSON ({exc.msg})") from None
    if not isinstance(obj, dict):
        raise TaskError(f"{where}: expected a JSON object, got {type(obj).__name__}")
    missing = [k for k in ("prompt", "answer", "target") if k not in obj]
    if missing:
        raise TaskError(f"{where}: missing field(s) {', '.join(missing)}")
    bad = [k for k in ("prompt", "answer", "target", "kind") if k in obj and not isinstance(obj[k], str)]
    if bad:
        raise TaskError(f"{where}: field(s) {', '.join(bad)} must be strings")
    return Example(obj["prompt"], obj["answer"], obj["target"], obj.get("kind", ""))


def load_task(directory: str | Path) -> dict[str, list[Example]]:
    """The splits of a task directory written by :func:`~kvgraft.data.tasks.write_task` (or by hand, same
    format).

    ``FileNotFoundError`` for a missing directory or split file; :class:`TaskError` naming the
    file and line for a line that is not a JSON object with string ``prompt``, ``answer`` and
    ``target`` (blank lines are skipped).
    """
    root = Path(directory)
    if not root.is_dir():
        raise FileNotFoundError(f"task directory not found: {root} (write one with `kvgraft tasks NAME --out DIR`)")
    missing = [f"{s}.jsonl" for s in SPLITS if not (root / f"{s}.jsonl").is_file()]
    if missing:
        expected = ", ".join(f"{s}.jsonl" for s in SPLITS)
        raise FileNotFoundError(f"{root} lacks {', '.join(missing)} (a task directory holds {expected})")
    out: dict[str, list[Example]] = {}
    for split in SPLITS:
        path = root / f"{split}.jsonl"
        with open(path, encoding="utf-8") as fh:
            out[split] = [_parse_line(line, f"{path}:{n}") for n, line in enumerate(fh, 1) if line.strip()]
    return out


def read_task_info(directory: str | Path) -> dict[str, Any]:
    """The ``task.json`` of a task directory (name, seed, sizes, generator version, token statistics)."""
    path = Path(directory) / TASK_INFO_FILE
    if not path.is_file():
        raise FileNotFoundError(f"{path} not found")
    try:
        info = json.loads(path.read_text(encoding="utf-8"))
    except json.JSONDecodeError as exc:
        raise TaskError(f"{path}: not JSON ({exc.msg})") from None
    if not isinstance(info, dict):
        raise TaskError(f"{path}: expected a JSON object")
    return info


def _write_splits(out: Path, splits: Mapping[str, Sequence[Example]], info: Mapping[str, Any], *, overwrite: bool) -> None:
    """Write the split files and ``task.json`` into ``out``, which appears complete or not at all."""

    with atomic_dir(out, overwrite=overwrite) as tmp:
        for split in SPLITS:
            with open(tmp / f"{split}.jsonl", "w", encoding="utf-8", newline="\n") as fh:
                for ex in splits[split]:
                    fh.write(json.dumps(ex.to_dict(), ensure_ascii=False) + "\n")
        (tmp / TASK_INFO_FILE).write_text(json.dumps(info, indent=2) + "\n", encoding="utf-8")
