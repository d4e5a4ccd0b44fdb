"""An out-of-domain evaluation text: the Debian Reference manual (package ``debian-reference-en``).

The reference models trained on Bibles (KJV, WEB), the Python documentation, fortunes and The Devil's
Dictionary. The Debian Reference (Osamu Aoki, GPL-2+) is technical prose about system administration:
shell sessions, configuration files, package management, networking; none of it is in their training
data. It ships a plain-text rendering, ``/usr/share/debian-reference/debian-reference.en.txt.gz``
(about 0.9 MB), so no HTML has to be parsed.

``build_ood_eval(model_dir, out)`` tokenises it with the model's own tokenizer and writes ``out`` (a
uint16/uint32 ``.npy`` token stream) as evenly spaced chunks of ``chunk`` tokens over the whole manual,
the same layout as a shipped model's ``eval/heldout.npy``, so ``kvgraft.eval.perplexity`` reads both.
The package is fetched with ``apt-get download`` and unpacked with ``dpkg-deb -x`` into a cache
directory when it is not installed: nothing is installed on the system.

    .venv/bin/python bench/ood_text.py --model models/kvgraft-llama-8m --out runs/ood/debian-reference.npy
"""

from __future__ import annotations

import gzip
import re
import subprocess
import tempfile
from pathlib import Path

import numpy as np

from kvgraft.hf.load import load_tokenizer_dir

OOD_PACKAGE = "debian-reference-en"
OOD_TEXT = Path("/usr/share/debian-reference/debian-reference.en.txt.gz")
DEFAULT_CACHE = Path("runs/ood/pkg")


class OODError(RuntimeError):
    """The out-of-domain text cannot be obtained or is too short."""


def ood_text_path(cache: str | Path = DEFAULT_CACHE, fetch: bool = True) -> Path:
    """The manual's ``.txt.gz``: installed copy if present, else unpacked from the package into ``cache``."""
    if OOD_TEXT.is_file():
        return OOD_TEXT
    cache = Path(cache)
    local = cache / OOD_TEXT.relative_to("/")
    if local.is_file():
        return local
    if not fetch:
        raise OODError(f"{OOD_TEXT} is missing and fetching is off; apt-get install {OOD_PACKAGE}")
    cache.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=cache) as tmp:
        try:
            subprocess.run(["apt-get", "download", OOD_PACKAGE], cwd=tmp, check=True, capture_output=True, text=True)
            debs = sorted(Path(tmp).glob(f"{OOD_PACKAGE}_*.deb"))
            if not debs:
                raise OODError(f"apt-get download {OOD_PACKAGE} produced no .deb")
            subprocess.run(["dpkg-deb", "-x", str(debs[-1]), str(cache)], check=True, capture_output=True, text=True)
        except (OSError, subprocess.CalledProcessError) as exc:
            detail = getattr(exc, "stderr", "") or str(exc)
            raise OODError(f"cannot fetch {OOD_PACKAGE}: {detail.strip().splitlines()[-1] if detail.strip() else exc}") from None
    if not local.is_file():
        raise OODError(f"{OOD_PACKAGE} did not contain {OOD_TEXT}")
    return local


def clean_manual(raw: str) -> str:
    """The manual's text with the page furniture made plain: CRs normalised, the 4-space block indent
    removed, trailing spaces dropped and runs of blank lines collapsed to one."""
    lines = []
    for line in raw.replace("\r\n", "\n").replace("\r", "\n").split("\n"):
        line = line.rstrip()
        lines.append(line.removeprefix("    "))
    text = "\n".join(lines)
    return re.sub(r"\n{3,}", "\n\n", text).strip()


def ood_text(cache: str | Path = DEFAULT_CACHE, fetch: bool = True) -> str:
    """The cleaned manual text (see :func:`clean_manual`)."""
    with gzip.open(ood_text_path(cache, fetch), "rt", encoding="utf-8", errors="replace") as f:
        return clean_manual(f.read())


def spread_chunks(ids: np.ndarray, n_tokens: int, chunk: int) -> np.ndarray:
    """``n_tokens // chunk`` chunks of ``chunk`` tokens at evenly spaced starts over ``ids``."""
    n_chunks = n_tokens // chunk
    if n_chunks <= 0 or n_chunks * chunk > ids.size:
        raise OODError(f"{n_tokens} tokens must hold at least one chunk of {chunk} and fit in the text's {ids.size} tokens")
    starts = np.linspace(0, ids.size - chunk, n_chunks).astype(np.int64)
    return np.concatenate([ids[s : s + chunk] for s in starts])


def build_ood_eval(
    model_dir: str | Path,
    out: str | Path,
    tokens: int = 65536,
    chunk: int = 512,
    cache: str | Path = DEFAULT_CACHE,
    fetch: bool = True,
) -> dict:
    """Tokenise the manual with ``model_dir``'s tokenizer and write ``tokens`` of it to ``out`` (.npy).

    Returns a small record: package, text bytes, total tokens, tokens written, bytes per token.
    """

    tokenizer = load_tokenizer_dir(model_dir)
    if tokenizer is None:
        raise OODError(f"{model_dir} has no tokenizer.json")
    text = ood_text(cache, fetch)
    ids = np.asarray(tokenizer(text, add_special_tokens=False)["input_ids"], dtype=np.int64)
    eos = tokenizer.eos_token_id
    if eos is not None:
        ids = np.append(ids, eos)
    vocab = len(tokenizer)
    picked = spread_chunks(ids, tokens, chunk).astype(np.uint16 if vocab <= 65536 else np.uint32)
    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    np.save(out, picked)
    return {
        "package": OOD_PACKAGE,
        "text_bytes": len(text.encode()),
        "text_tokens": int(ids.size),
        "tokens_written": int(picked.size),
        "chunk": chunk,
        "bytes_per_token": len(text.encode()) / ids.size,
        "out": str(out),
    }


__all__ = ["OOD_PACKAGE", "OODError", "build_ood_eval", "clean_manual", "ood_text", "ood_text_path", "spread_chunks"]
