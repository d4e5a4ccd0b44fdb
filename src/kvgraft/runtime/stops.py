"""Stop strings, in one place: where generated text ends, and how much of it may be shown yet.

One :class:`StopStrings` per request (or per stream) is fed the whole decoded text of the output so far, one
later version after another; it is used by the engine (a request finishes once its text holds a stop string),
by the server's streamed and whole answers (the text is cut before the first stop string, and a stream never
shows a part of one) and by ``kvgraft generate``.

Contracts:

- :meth:`StopStrings.find` is the index of the earliest occurrence of any stop string in the text (None: none).
  It scans only the part of the text that can hold an occurrence it has not seen: the text is compared with
  the previous version, and the search starts ``longest stop - 1`` characters before the first character that
  is new or changed, so feeding a growing text costs time linear in what was added (plus the comparison, a
  memory compare). A text that changed anywhere is handled exactly: the search starts before the change.
- :meth:`StopStrings.visible` is what may be shown of the text: cut before the first stop string; otherwise,
  unless the output has finished, without the longest tail that could still begin a stop string (a proper
  prefix of one; only that, nothing more) and without trailing U+FFFD (an incomplete UTF-8 character the
  decoder shows as a replacement character until its last byte arrives; stripped before the tail is
  measured, as the character it becomes may continue a stop string).
"""

from __future__ import annotations

from collections.abc import Iterable

REPLACEMENT = "\ufffd"


class StopStrings:
    """The stop strings of one output, matched incrementally (see the module docstring)."""

    def __init__(self, stops: Iterable[str]) -> None:
        self.stops: tuple[str, ...] = tuple(stops)
        if any(not isinstance(s, str) or not s for s in self.stops):
            raise ValueError(f"stop strings must be non-empty strings, got {self.stops!r}")
        self.longest = max((len(s) for s in self.stops), default=0)
        self._text = ""  # the last text fed to find
        self._found: int | None = None  # the earliest occurrence in it
        self._found_end = 0  # where that occurrence ends

    def __bool__(self) -> bool:
        return bool(self.stops)

    def find(self, text: str) -> int | None:
        """The index in ``text`` where the earliest stop string starts, or None."""
        if not self.stops:
            return None
        same = _common_prefix(self._text, text)
        self._text = text
        if self._found is not None:
            if self._found_end <= same:  # the occurrence is still there, and nothing before it changed
                return self._found
            start = 0  # rare (the decoder revised the text): search it all again
        else:  # every occurrence inside the unchanged part was seen (there was none): a new one ends after it
            start = max(0, same - self.longest + 1)
        found: int | None = None
        end = 0
        for s in self.stops:
            i = text.find(s, start, len(text) if found is None else found + len(s))
            if i >= 0 and (found is None or i < found):
                found, end = i, i + len(s)
        self._found, self._found_end = found, end
        return found

    def held(self, text: str) -> int:
        """How many characters at the end of ``text`` could begin a stop string (the longest such tail)."""
        most = 0
        for s in self.stops:
            for k in range(min(len(s) - 1, len(text)), most, -1):
                if text.endswith(s[:k]):
                    most = k
                    break
        return most

    def visible(self, text: str, finished: bool) -> str:
        """What may be shown of ``text``: see the module docstring."""
        cut = self.find(text)
        if cut is not None:
            return text[:cut]
        if not finished:  # an incomplete character may continue a stop string's prefix: strip it first
            text = text.rstrip(REPLACEMENT)
            held = self.held(text)
            if held:
                text = text[: len(text) - held].rstrip(REPLACEMENT)
        return text


def _common_prefix(a: str, b: str) -> int:
    """The length of the longest common prefix of ``a`` and ``b`` (fast when one starts with the other)."""
    if b.startswith(a):
        return len(a)
    if a.startswith(b):
        return len(b)
    lo, hi = 0, min(len(a), len(b))  # a[:lo] == b[:lo], a[:hi + 1] != b[:hi + 1]: bisect with C-speed compares
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if a[:mid] == b[:mid]:
            lo = mid
        else:
            hi = mid - 1
    return lo
