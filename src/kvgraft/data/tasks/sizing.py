"""Tasks sized for a given model: its tokenizer, its prompt format, its sliding window and a token budget.

The task families with a token budget (``ui-reply``, ``recall``) are sized by default for the shipped
reference models: the reference tokenizer, the plain format, a 64-token window and 500 tokens (512
positions); that output never changes. A :class:`TaskSizing` sizes them for another model instead, counting
every token in the encoding actually trained on (:class:`~kvgraft.data.tasks.formats.TaskEncoding`: in the
chat format the template's tokens too, and the end-of-turn token)::

    sizing = load_sizing(".cache/models/smollm2-135m-instruct", window=128)   # prompt format auto: chat
    splits = generate_task("recall", 0, sizing=sizing)     # queried line >= 128 + 32 tokens before the answer
    write_task("recall", "runs/tasks/recall-smollm2", sizing=sizing)   # task.json records the sizing

The generators search with a fast additive counter (:class:`~kvgraft.data.tasks.common._TokenCounter`) and
then check every example they keep in the exact encoding (length and, for recall, distance), drawing again
when the check fails, so the guarantees hold for any tokenizer.
"""

from __future__ import annotations

import hashlib
from functools import cached_property
from pathlib import Path
from typing import Any

from kvgraft.checks import is_int
from kvgraft.data.tasks.common import Example, TaskError, _encode, _TokenCounter
from kvgraft.data.tasks.formats import TaskEncoding, check_prompt_format
from kvgraft.errors import KvgraftError

SIZED_DRAWS = 2000
"""Draws a sized generator makes in a row without keeping an example before it gives up (TaskError)."""


def check_positive(value: object, what: str, accepted: str) -> int | None:
    """``value`` when it is None or an int >= 1; :class:`TaskError` naming it and what is accepted otherwise."""
    if value is None:
        return None
    if not is_int(value) or value < 1:
        raise TaskError(f"{what} {value!r} is not accepted: {accepted}")
    return value


def check_window(window: object) -> int | None:
    return check_positive(window, "window", "a positive number of tokens (the model's sliding window, e.g. 64 or 128)")


def check_max_tokens(max_tokens: object) -> int | None:
    return check_positive(
        max_tokens, "max_tokens", "a positive number of tokens per example (prompt + answer + end token), e.g. 500"
    )


class TaskSizing:
    """A tokenizer in a prompt format (a :class:`TaskEncoding`), a window (recall) and a token budget.

    ``window`` / ``max_tokens`` None: the task's defaults (64 and 500). ``tokenizer_name`` and
    ``tokenizer_sha256`` (of its ``tokenizer.json``) are what ``task.json`` records."""

    def __init__(
        self,
        encoding: TaskEncoding,
        tokenizer_name: str,
        *,
        tokenizer_sha256: str | None = None,
        window: int | None = None,
        max_tokens: int | None = None,
    ) -> None:
        self.encoding = encoding
        self.tokenizer_name = tokenizer_name
        self.tokenizer_sha256 = tokenizer_sha256
        self.window = check_window(window)
        self.max_tokens = check_max_tokens(max_tokens)

    @property
    def prompt_format(self) -> str:
        return self.encoding.format

    @cached_property
    def count(self) -> _TokenCounter:
        """Tokens of a piece of task text (additive over pre-token pieces; checked exactly afterwards)."""
        return _TokenCounter(self.encoding.tokenizer)

    @cached_property
    def prefix_tokens(self) -> int:
        """Tokens the chat template writes before the user's message (0 in the plain format)."""
        chat = self.encoding.chat
        return len(_encode(self.encoding.tokenizer, chat.prefix)) if chat is not None else 0

    @cached_property
    def suffix_tokens(self) -> int:
        """Tokens the chat template writes after the user's message, generation prompt included (0: plain)."""
        chat = self.encoding.chat
        return len(_encode(self.encoding.tokenizer, chat.suffix)) if chat is not None else 0

    @property
    def tail(self) -> int:
        """1 when the reply ends with a token (EOS or end-of-turn), else 0."""
        return 1 if self.encoding.end_id is not None else 0

    def answer_tokens(self, answer: str) -> int:
        return self.count(self.encoding.answer_text(answer)) + self.tail

    def example_tokens(self, prompt: str, answer: str) -> int:
        """The counter's tokens of a whole example in this encoding (the generators' search)."""
        return self.prefix_tokens + self.count(prompt) + self.suffix_tokens + self.answer_tokens(answer)

    def exact_length(self, ex: Example) -> int:
        """The example's tokens in this encoding, counted by the tokenizer itself."""
        return len(self.encoding.encode(ex, 10**9)[0])

    def to_dict(self) -> dict[str, Any]:
        d = {
            "tokenizer": self.tokenizer_name,
            "tokenizer_sha256": self.tokenizer_sha256,
            **self.encoding.describe(),
            "window": self.window,
            "max_tokens": self.max_tokens,
        }
        return d


def tokenizer_dir(value: str | Path | None) -> Path:
    """The model directory whose ``tokenizer.json`` a task is sized with: a path, a reference or fetched
    model's name, or None for the default reference model; :class:`TaskError` naming the value otherwise."""
    from kvgraft.reference import reference_model_dir, resolve_model

    try:
        path = reference_model_dir() if value is None else resolve_model(value)
    except KvgraftError as exc:
        raise TaskError(f"tokenizer {str(value)!r}: {exc}") from None
    if not path.is_dir():
        raise TaskError(
            f"tokenizer {str(value)!r}: no such directory (accepted: a model directory holding tokenizer.json, "
            "e.g. .cache/models/smollm2-135m-instruct, or a shipped or fetched model's name, e.g. kvgraft-ced-8m)"
        )
    if not (path / "tokenizer.json").is_file():
        raise TaskError(f"tokenizer {str(value)!r}: {path} holds no tokenizer.json (accepted: a model directory with one)")
    return path


def load_sizing(
    tokenizer: str | Path | None = None,
    *,
    window: int | None = None,
    max_tokens: int | None = None,
    prompt_format: str = "auto",
) -> TaskSizing:
    """The sizing for a model directory's tokenizer (None: the default reference model's). Every argument is
    checked before the tokenizer is loaded; :class:`TaskError` naming the bad value and what is accepted."""
    check_window(window)
    check_max_tokens(max_tokens)
    check_prompt_format(prompt_format)
    path = tokenizer_dir(tokenizer)
    from kvgraft.hf import load_tokenizer_dir  # lazy: transformers

    tok = load_tokenizer_dir(path)
    encoding = TaskEncoding(tok, prompt_format, where=str(tokenizer) if tokenizer is not None else path.name)
    sha = hashlib.sha256((path / "tokenizer.json").read_bytes()).hexdigest()
    return TaskSizing(encoding, path.name, tokenizer_sha256=sha, window=window, max_tokens=max_tokens)


__all__ = ["SIZED_DRAWS", "TaskSizing", "check_max_tokens", "check_window", "load_sizing", "tokenizer_dir"]
