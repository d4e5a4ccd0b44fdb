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

from kvgraft.data.tasks.common import Example, TaskSpec, _first_line, _reference_counter, reference_token_budget

RECALL_WINDOW = 64
"""The sliding window (tokens, every layer) of the reference causal encoder-decoders."""
RECALL_MIN_DISTANCE = 96
"""Tokens from the end of the queried ledger line to the answer's first token, at least (window + 32)."""
RECALL_MAX_TOKENS = 500
"""Reference-tokenizer tokens of prompt + answer + EOS at most (the reference models have 512 positions)."""
RECALL_MAX_LINES = 60

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


def _question(key: str) -> str:
    return f"Question: what is the code of {key}?\nAnswer:"


def recall_example(r: random.Random, count: Callable[[str], int], example_cls: Callable[..., Any] = Example):
    """One example (``example_cls(prompt, answer, target, kind)``); ``count`` gives exact token counts
    (additive over lines, as the generators' counter is; the chosen example is counted again whole)."""
    while True:
        pairs = r.sample([(a, b) for a in ADJECTIVES for b in ANIMALS], RECALL_MAX_LINES)
        codes = [f"{c:04d}" for c in r.sample(range(10000), RECALL_MAX_LINES)]
        keys = [f"{a} {b}" for a, b in pairs]
        lines = [f"{k}: {c}\n" for k, c in zip(keys, codes)]
        cum = [count(HEADER)]  # cum[j]: tokens of the header and the first j lines
        for line in lines:
            cum.append(cum[-1] + count(line))
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
    "every layer's 64-token window (at most 500 tokens; kvgraft.data.recall)",
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
)
