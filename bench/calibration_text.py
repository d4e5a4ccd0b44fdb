"""Rebuild kvgraft's shipped default calibration text (``src/kvgraft/data/calibration/default.txt``).

What ``kvgraft convert`` calibrates on when a checkpoint ships no ``eval/calibration.npy`` and no
``--calibration`` is given: about 200 KB (~48K tokens for a 49K-vocabulary BPE) of English prose and
technical writing, interleaved document by document so every 512-token window of it is one kind of text:

- the Python 3.11 documentation's tutorial and HOWTOs (package python3.11-doc; PSF licence), in paragraphs
  of up to ~2 KB;
- chapters of the World English Bible (package sword-text-web; public domain), evenly spaced over the canon.

Neither is a held-out text of bench/real_texts.py (the Debian Reference, The Devil's Dictionary).

    .venv/bin/python bench/calibration_text.py
"""

from __future__ import annotations

import re
from pathlib import Path

from kvgraft.data.corpus import get_source

OUT = Path(__file__).resolve().parents[1] / "src" / "kvgraft" / "data" / "calibration" / "default.txt"
TARGET_BYTES = 200_000


def python_pieces() -> list[str]:
    docs = dict(get_source("python-docs").documents())
    keys = sorted(k for k in docs if k.startswith(("python-docs/tutorial/", "python-docs/howto/")))
    pieces: list[str] = []
    for key in keys:
        text = re.sub(r"\n{3,}", "\n\n", docs[key].replace("\r\n", "\n")).strip()
        piece = ""
        for para in text.split("\n\n"):
            if len(piece) + len(para) > 2000 and piece:
                pieces.append(piece.strip())
                piece = ""
            piece += para + "\n\n"
        if piece.strip():
            pieces.append(piece.strip())
    return pieces


def bible_pieces() -> list[str]:
    return [text.strip() for _, text in get_source("web").documents()]


def evenly(items: list[str], n: int) -> list[str]:
    if n >= len(items):
        return items
    return [items[round(i * (len(items) - 1) / max(n - 1, 1))] for i in range(n)]


def main() -> None:
    py, bible = python_pieces(), bible_pieces()
    half = TARGET_BYTES // 2
    py_sel = evenly(py, max(1, half // max(1, sum(map(len, py)) // len(py))))
    bible_sel = evenly(bible, max(1, half // max(1, sum(map(len, bible)) // len(bible))))
    out: list[str] = []
    for i in range(max(len(py_sel), len(bible_sel))):
        if i < len(py_sel):
            out.append(py_sel[i])
        if i < len(bible_sel):
            out.append(bible_sel[i])
    text = "\n\n".join(out) + "\n"
    tmp = OUT.with_suffix(".tmp")
    tmp.write_text(text, encoding="utf-8")
    tmp.replace(OUT)
    print(f"{OUT}: {len(text.encode())} bytes, {len(py_sel)} Python documentation pieces, {len(bible_sel)} Bible chapters")


if __name__ == "__main__":
    main()
