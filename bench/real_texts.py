"""Held-out texts for the real-model figures, and the calibration they are kept apart from.

Two held-out texts, neither ever used to calibrate or heal a graft (token streams of evenly spaced chunks,
the layout ``kvgraft eval --text`` and ``kvgraft.eval.perplexity`` read):

- ``manual``: the Debian Reference manual (package debian-reference-en; technical prose, shell sessions);
- ``glossary``: Ambrose Bierce's The Devil's Dictionary (package dict-devil; 19th-century satirical glossary).

Calibration (``kvgraft convert`` with no ``--calibration`` on a real checkpoint) is kvgraft's shipped default
text (``kvgraft.data.calibration_text``): Python documentation and the World English Bible, neither of which is
either held-out text.

    .venv/bin/python bench/real_texts.py --model smollm2-135m-instruct --out runs/real-texts
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import numpy as np

from kvgraft.data.corpus import get_source
from kvgraft.data.ood import ood_text, spread_chunks
from kvgraft.hf.load import load_tokenizer_dir
from kvgraft.reference import resolve_model

HELD_OUT = ("manual", "glossary")


def held_out_text(name: str) -> str:
    """The raw text of one held-out set."""
    if name == "manual":
        return ood_text()
    if name == "glossary":
        return "\n\n".join(text.strip() for _, text in get_source("devil").documents())
    raise ValueError(f"held-out text {name!r} is not one of {', '.join(HELD_OUT)}")


def build(model: str, out: Path, tokens: int, chunk: int) -> dict[str, dict[str, int]]:
    tokenizer = load_tokenizer_dir(resolve_model(model))
    if tokenizer is None:
        raise SystemExit(f"{model} has no tokenizer")
    out.mkdir(parents=True, exist_ok=True)
    record: dict[str, dict[str, int]] = {}
    for name in HELD_OUT:
        ids = np.asarray(tokenizer(held_out_text(name), add_special_tokens=False)["input_ids"], dtype=np.int64)
        picked = spread_chunks(ids, tokens, chunk).astype(np.uint16 if len(tokenizer) <= 65536 else np.uint32)
        tmp = out / f".{name}.npy"
        np.save(tmp, picked)
        tmp.replace(out / f"{name}.npy")
        record[name] = {"text_tokens": int(ids.size), "tokens": int(picked.size), "chunk": chunk}
    (out / "texts.json").write_text(json.dumps(record, indent=1) + "\n")
    return record


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="smollm2-135m-instruct")
    p.add_argument("--out", type=Path, default=Path("runs/real-texts"))
    p.add_argument("--tokens", type=int, default=8192)
    p.add_argument("--chunk", type=int, default=512)
    a = p.parse_args()
    print(json.dumps(build(a.model, a.out, a.tokens, a.chunk), indent=1))


if __name__ == "__main__":
    main()
