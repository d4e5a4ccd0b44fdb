"""Text of a growing output, decoded in time proportional to what each step adds.

Decoding a request's whole output at every step costs time quadratic in its length. :class:`IncrementalText`
keeps the text of the ids it has already committed and decodes again only a short window: the last committed
token (context, for decoders whose output depends on the neighbour, like SentencePiece's leading space) and
what came after it. A step's new ids are committed when their text is complete: the window's text starts with
the context's and does not end in U+FFFD (the replacement character a byte-level decoder shows for a UTF-8
character whose last byte has not arrived yet); until then they stay in the window.

Contract: ``text(ids)`` equals ``decode(ids)`` for decoders that decode a concatenation of ids as the
concatenation of the texts at character boundaries (byte-level BPE, as every kvgraft and Llama-3/Qwen
tokenizer; checked against the whole decode in ``tests/test_stops.py``). Where a decoder revises text
across the window's start (the window's text does not start with its context's), the whole output is decoded
for that step, so the result is still the whole decode. ``ids`` must extend those of the previous call; a
shorter or different list starts over.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

REPLACEMENT = "\ufffd"


class IncrementalText:
    """The decoded text of one output as it grows (see the module docstring)."""

    def __init__(self, decode: Callable[[list[int]], str]) -> None:
        self.decode = decode
        self.decoded_tokens = 0  # how many ids were decoded in all (the cost; tests check it stays linear)
        self._reset()

    def _reset(self) -> None:
        self._ids: list[int] = []  # the ids seen so far
        self._text = ""  # the text of self._ids[:self._read]
        self._start = 0  # the window starts here (its first token is context)
        self._read = 0  # ids before this are committed

    def text(self, ids: Sequence[int]) -> str:
        """The text of ``ids`` (which extend the ids of the previous call)."""
        n = len(ids)
        if n < len(self._ids) or (self._ids and ids[len(self._ids) - 1] != self._ids[-1]):
            self._reset()  # not an extension (checked at its last id, to stay linear): start over
        self._ids.extend(ids[len(self._ids) :])
        context = self._decode(self._start, self._read)
        window = self._decode(self._start, n)
        if not window.startswith(context):  # the decoder revised the context: decode it all, commit nothing
            return self._decode(0, n)
        tail = window[len(context) :]
        if n > self._read and not tail.endswith(REPLACEMENT):
            self._text += tail
            self._start, self._read = n - 1, n  # the last committed token is the next window's context
            return self._text
        return self._text + tail

    def _decode(self, start: int, end: int) -> str:
        if end <= start:
            return ""
        self.decoded_tokens += end - start
        return self.decode(self._ids[start:end])


__all__ = ["IncrementalText"]
