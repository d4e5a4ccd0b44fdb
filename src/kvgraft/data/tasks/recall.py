"""The ``recall`` task: a long ledger of codes, then a question about one line far above the question.

Built so that the answer lives **beyond every layer's sliding window**: the line that holds the answer ends
at least :data:`RECALL_MIN_DISTANCE` reference-tokenizer tokens before the answer's first token, more than
the reference encoder-decoders' window (:data:`RECALL_WINDOW` = 64 tokens, every layer), so a model of
that family can only answer through the shared compressed stream its kv_source layers write::

    prompt  "Ledger of codes:\\namber fox: 4821\\nbold owl: 0937\\n... (30-45 lines) ...\\n
             Question: what is the code of amber fox?\\nAnswer:"
    answer  " 4821"                                                        target "4821"

Keys are two common words (an adjective and an animal), unique within a ledger; codes are four digits,
unique within a ledger (so the answer's digits appear in the prompt once, in the queried line). A ledger
has as many lines as fit :data:`RECALL_MAX_TOKENS` (prompt + answer + EOS, counted exactly with the
shipped reference tokenizer, as ui-reply's budget is); the queried line is drawn uniformly among the lines
that end at least :data:`RECALL_MIN_DISTANCE` tokens before the answer. Token positions: the answer's first
token is predicted at the prompt's last position P - 1, whose window covers P - 64 .. P - 1; the queried
line's last token is at most P - 1 - RECALL_MIN_DISTANCE (96 with the default: 32 tokens of margin).

Scoring: the checkable answer of generated text is the first 4-digit number of its first line; it is correct
when it equals the target.
"""

from __future__ import annotations

import random
import re
from collections.abc import Callable
from typing import Any

from kvgraft.data.tasks.common import (
    Example,
    TaskError,
    TaskSpec,
    _encode,
    _first_line,
    _reference_counter,
    reference_token_budget,
)

RECALL_WINDOW = 64
"""The sliding window (tokens, every layer) of the reference causal encoder-decoders."""
RECALL_MIN_DISTANCE = 96
"""Tokens from the end of the queried ledger line to the answer's first token, at least (window + 32)."""
RECALL_MAX_TOKENS = 500
"""Reference-tokenizer tokens of prompt + answer + EOS at most (the reference models have 512 positions)."""
RECALL_MAX_LINES = 60
RECALL_MARGIN = RECALL_MIN_DISTANCE - RECALL_WINDOW
"""Tokens beyond the window the queried line ends at, at least (32), whatever the window."""

ADJECTIVES = (
    "amber",
    "bold",
    "brave",
    "calm",
    "clever",
    "crimson",
    "dark",
    "eager",
    "gentle",
    "golden",
    "green",
    "grey",
    "happy",
    "jolly",
    "kind",
    "little",
    "lucky",
    "mighty",
    "noble",
    "old",
    "proud",
    "quick",
    "quiet",
    "red",
    "royal",
    "silent",
    "silver",
    "swift",
    "tall",
    "white",
    "wild",
    "young",
)
ANIMALS = (
    "bear",
    "cat",
    "crow",
    "deer",
    "dog",
    "dove",
    "eagle",
    "fox",
    "frog",
    "goat",
    "hawk",
    "horse",
    "lamb",
    "lion",
    "mole",
    "mouse",
    "owl",
    "ox",
    "pig",
    "rabbit",
    "ram",
    "raven",
    "seal",
    "sheep",
    "snake",
    "swan",
    "tiger",
    "toad",
    "whale",
    "wolf",
)
HEADER = "Ledger of codes:\n"
_PAIRS = [(a, b) for a in ADJECTIVES for b in ANIMALS]


def _question(key: str) -> str:
    return f"Question: what is the code of {key}?\nAnswer:"


def _draw_ledger(
    r: random.Random, pairs: list[tuple[str, str]], n: int, count: Callable[[str], int]
) -> tuple[list[str], list[str], list[str], list[int]]:
    """``n`` distinct keys (from ``pairs``) and 4-digit codes drawn from ``r`` (in this order), the ledger's lines,
    and ``cum[j]``: tokens of the header and the first j lines."""
    drawn = r.sample(pairs, n)
    codes = [f"{c:04d}" for c in r.sample(range(10000), n)]
    keys = [f"{a} {b}" for a, b in drawn]
    lines = [f"{k}: {c}\n" for k, c in zip(keys, codes)]
    cum = [count(HEADER)]
    for line in lines:
        cum.append(cum[-1] + count(line))
    return keys, codes, lines, cum


def recall_example(r: random.Random, count: Callable[[str], int], example_cls: Callable[..., Any] = Example):
    """One example (``example_cls(prompt, answer, target, kind)``); ``count`` gives exact token counts
    (additive over lines, as the generators' counter is; the chosen example is counted again whole)."""
    while True:
        keys, codes, lines, cum = _draw_ledger(r, _PAIRS, RECALL_MAX_LINES, count)
        q_tokens = [count(_question(k)) for k in keys]
        a_tokens = [count(f" {c}") for c in codes]
        # the longest ledger that fits the budget whatever line is asked
        n = len(lines)
        while n > 1 and cum[n] + max(q_tokens[:n]) + max(a_tokens[:n]) + 1 > RECALL_MAX_TOKENS:
            n -= 1
        candidates = [i for i in range(n) if cum[n] + q_tokens[i] - cum[i + 1] >= RECALL_MIN_DISTANCE]
        if not candidates:
            continue
        i = r.choice(candidates)
        prompt = HEADER + "".join(lines[:n]) + _question(keys[i])
        total = count(prompt)
        if total + a_tokens[i] + 1 > RECALL_MAX_TOKENS or total - cum[i + 1] < RECALL_MIN_DISTANCE:
            continue  # (never seen: the counts are additive over lines)
        return example_cls(prompt=prompt, answer=f" {codes[i]}", target=codes[i], kind="recall")


def recall_distance(prompt: str, target: str, count: Callable[[str], int]) -> int:
    """Tokens from the end of the line holding ``target`` to the end of ``prompt`` (the answer's first
    token is predicted at the prompt's last position): the check the generator guarantees."""
    line_end = prompt.index(f": {target}\n") + len(f": {target}\n")
    return count(prompt) - count(prompt[:line_end])


# --------------------------------------------------------------------------- sized for another model


def sized_recall_example(r: random.Random, sizing: Any) -> Example:
    """One example sized by ``sizing`` (a :class:`~kvgraft.data.tasks.sizing.TaskSizing`): the queried line
    ends at least ``window + 32`` tokens before the answer's first token and the whole example (prompt +
    answer + end token) fits ``max_tokens``, both counted in the sizing's encoding (in the chat format the
    template's tokens count too), checked exactly with the tokenizer before the example is kept.

    With the reference tokenizer, the plain format, window 64 and 500 tokens it draws exactly what
    :func:`recall_example` draws (the same random calls and the same counts)."""
    window = sizing.window or RECALL_WINDOW
    budget = sizing.max_tokens or RECALL_MAX_TOKENS
    min_distance = window + RECALL_MARGIN
    # a larger budget needs longer ledgers (60 lines fill 500 tokens); 960 keys at most
    cap = min(len(_PAIRS), max(RECALL_MAX_LINES, -(-budget * RECALL_MAX_LINES // RECALL_MAX_TOKENS)))
    count = sizing.count
    pre, suf = sizing.prefix_tokens, sizing.suffix_tokens
    need = pre + count(HEADER) + count("amber fox: 0000\n") + min_distance + sizing.answer_tokens(" 0000")
    if need > budget:
        raise TaskError(_too_small(sizing, window, budget, min_distance, need))
    for _ in range(_draws()):
        keys, codes, lines, cum = _draw_ledger(r, _PAIRS, cap, count)
        q_tokens = [count(_question(k)) + suf for k in keys]  # the question, then the template's suffix
        a_tokens = [sizing.answer_tokens(f" {c}") for c in codes]  # the reply and its end token
        n = len(lines)
        while n > 1 and pre + cum[n] + max(q_tokens[:n]) + max(a_tokens[:n]) > budget:
            n -= 1
        candidates = [i for i in range(n) if cum[n] + q_tokens[i] - cum[i + 1] >= min_distance]
        if not candidates:
            continue
        i = r.choice(candidates)
        ex = Example(
            prompt=HEADER + "".join(lines[:n]) + _question(keys[i]), answer=f" {codes[i]}", target=codes[i], kind="recall"
        )
        if sizing.exact_length(ex) > budget or encoded_recall_distance(sizing.encoding, ex) < min_distance:
            continue  # the counter was not additive for this tokenizer here: draw again
        return ex
    raise TaskError(_too_small(sizing, window, budget, min_distance, need))


def _draws() -> int:
    from kvgraft.data.tasks.sizing import SIZED_DRAWS

    return SIZED_DRAWS


def _too_small(sizing: Any, window: int, budget: int, min_distance: int, need: int) -> str:
    return (
        f"recall: window {window} puts the queried line at least {min_distance} tokens (window + "
        f"{RECALL_MARGIN}) before the answer, and max_tokens {budget} leaves no room for that in the "
        f"{sizing.prompt_format} encoding of {sizing.tokenizer_name} (an example needs more than {need} tokens); "
        f"accepted: max_tokens of at least about {need + 64}, or a smaller window"
    )


def encoded_recall_distance(encoding: Any, ex: Example) -> int:
    """Tokens from the end of the queried line to the end of the prompt *as encoded* (``encoding``: a
    :class:`~kvgraft.data.tasks.formats.TaskEncoding`; in the chat format the template's tokens after the
    user's message count), by the tokenizer itself. -1 when the line's end is not a token boundary."""
    text = encoding.prompt_text(ex.prompt)
    marker = f": {ex.target}\n"
    line_end = text.index(ex.prompt) + ex.prompt.index(marker) + len(marker)
    full = _encode(encoding.tokenizer, text)
    head = _encode(encoding.tokenizer, text[:line_end])
    if full[: len(head)] != head:
        return -1
    return len(full) - len(head)


def _recall_sized_generator(sizing: Any) -> Callable[[random.Random], Example]:
    def make(r: random.Random) -> Example:
        return sized_recall_example(r, sizing)

    return make


def _recall_sized_info(sizing: Any, splits: Any) -> dict[str, Any]:
    window = sizing.window or RECALL_WINDOW
    distances = sorted(encoded_recall_distance(sizing.encoding, e) for exs in splits.values() for e in exs)
    measured = None
    if distances:
        measured = {"min": distances[0], "median": distances[len(distances) // 2], "max": distances[-1]}
    return {
        "token_budget": {
            "max_tokens": sizing.max_tokens or RECALL_MAX_TOKENS,
            "counted": sizing.encoding.describe()["counted"],
            "tokenizer": sizing.tokenizer_name,
            "tokenizer_sha256": sizing.tokenizer_sha256,
        },
        "distance": {
            "min_tokens": window + RECALL_MARGIN,
            "window": window,
            "counted": "from the end of the queried line to the end of the prompt as encoded"
            + (" (the chat template's tokens after the user's message included)" if sizing.prompt_format == "chat" else ""),
            "measured": measured,
        },
        "sizing": sizing.to_dict() | {"window": window, "max_tokens": sizing.max_tokens or RECALL_MAX_TOKENS},
    }


# --------------------------------------------------------------------------- scoring and registration

_CODE_RE = re.compile(r"(?<!\d)\d{4}(?!\d)")


def extract_recall(text: str) -> str | None:
    """The first 4-digit number of the first line of ``text``, or None."""
    found = _CODE_RE.search(_first_line(text))
    return found.group(0) if found else None


def _recall_generator() -> Callable[[random.Random], Example]:
    count = _reference_counter()

    def make(r: random.Random) -> Example:
        return recall_example(r, count, Example)

    return make


def _recall_info() -> dict[str, Any]:
    return {
        "token_budget": reference_token_budget(RECALL_MAX_TOKENS),
        "distance": {
            "min_tokens": RECALL_MIN_DISTANCE,
            "window": RECALL_WINDOW,
            "counted": "from the end of the queried line to the end of the prompt",
        },
    }


SPEC = TaskSpec(
    name="recall",
    summary="a ledger of codes and a question about a line at least 96 tokens above the answer, beyond "
    "every layer's 64-token window (at most 500 tokens; kvgraft.data.tasks.recall)",
    generator=_recall_generator,
    format={
        "fields": ["prompt", "answer", "target", "kind"],
        "prompt": "Ledger of codes:\\n<key>: <4 digits>\\n...Question: what is the code of <key>?\\nAnswer:",
        "answer": " <4 digits>",
        "target": "the 4 digits",
        "correct": "the first 4-digit number of the reply's first line equals the target",
    },
    extract=extract_recall,
    info=_recall_info,
    sized_generator=_recall_sized_generator,
    sized_info=_recall_sized_info,
)
