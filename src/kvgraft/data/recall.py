"""The ``recall`` task, kept importable under its old name: it lives in :mod:`kvgraft.data.tasks.recall`."""

from kvgraft.data.tasks.recall import (
    ADJECTIVES,
    ANIMALS,
    HEADER,
    RECALL_MAX_LINES,
    RECALL_MAX_TOKENS,
    RECALL_MIN_DISTANCE,
    RECALL_WINDOW,
    recall_distance,
    recall_example,
)

__all__ = [
    "ADJECTIVES",
    "ANIMALS",
    "HEADER",
    "RECALL_MAX_LINES",
    "RECALL_MAX_TOKENS",
    "RECALL_MIN_DISTANCE",
    "RECALL_WINDOW",
    "recall_distance",
    "recall_example",
]
