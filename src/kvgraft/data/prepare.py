"""End-to-end data preparation: corpus -> tokenizer -> token streams.

Usage::

    python -m kvgraft.data.prepare --out runs/data --vocab-size 8192

Layout under ``out``::

    corpus/{train,validation,test}.txt, corpus/corpus.json, corpus/documents.tsv
    tokenizer/tokenizer.json, tokenizer/tokenizer_config.json
    tokens/{train,validation,test}.npy
    prepare.json     the summary returned by :func:`prepare_data`
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
from collections.abc import Sequence
from pathlib import Path

from tokenizers import Tokenizer

from kvgraft.atomic import atomic_write_text
from kvgraft.checks import check_writable
from kvgraft.data.corpus import DEFAULT_SOURCES, SOURCES, SPLITS, CorpusError, build_corpus, iter_documents
from kvgraft.data.packing import tokenize_split
from kvgraft.data.tokenizer import _check_vocab_size, train_tokenizer


def prepare_data(
    out_dir: str | Path,
    sources: Sequence[str] = DEFAULT_SOURCES,
    vocab_size: int = 8192,
    seed: int = 0,
    *,
    files: Sequence[str | Path] = (),
    val_fraction: float = 0.02,
    test_fraction: float = 0.02,
    min_frequency: int = 2,
    progress: bool = True,
    tokenizer: str | Path | None = None,
) -> dict:
    """Build the corpus, train the tokenizer on its train split, tokenize all splits.

    ``tokenizer``: a directory holding a ``tokenizer.json`` (a model directory, or an earlier run's
    ``tokenizer/``) to reuse instead of training one: a model's own data rebuilt with it has exactly the
    model's token ids (a freshly trained BPE may break ties between equal-count merges differently).
    Its vocabulary size must equal ``vocab_size``.

    Returns (and writes to ``out_dir/prepare.json``) a summary with paths and, per
    split, documents, text bytes (UTF-8 of the documents, separators excluded), tokens
    (EOS included), and bytes per token (EOS excluded).

    Values are checked before anything is written; on failure, whatever this call created
    (``out_dir`` itself if it did not exist, else its ``corpus/``, ``tokenizer/``, ``tokens/``) is removed.
    """

    _check_vocab_size(vocab_size)
    tok_src = None
    if tokenizer is not None:
        tok_src = Path(tokenizer)
        if not (tok_src / "tokenizer.json").is_file():
            raise CorpusError(
                f"--tokenizer {tok_src}: no tokenizer.json there (give a model directory or a prepare-data tokenizer/ directory)"
            )

        size = Tokenizer.from_file(str(tok_src / "tokenizer.json")).get_vocab_size()
        if size != vocab_size:
            raise CorpusError(
                f"--tokenizer {tok_src} has {size} entries but --vocab-size is {vocab_size}; pass --vocab-size {size}"
            )
    out = Path(out_dir).resolve()
    if out.exists() and not out.is_dir():
        raise CorpusError(f"--out {out} exists and is not a directory")
    check_writable(out / "prepare.json", what="output directory")
    created = (
        [out] if not out.exists() else [out / name for name in ("corpus", "tokenizer", "tokens") if not (out / name).exists()]
    )
    try:
        return _prepare(out, sources, vocab_size, seed, files, val_fraction, test_fraction, min_frequency, progress, tok_src)
    except BaseException:
        for path in created:  # leave nothing behind (a rerun of a finished directory keeps its outputs)
            shutil.rmtree(path, ignore_errors=True)
        raise


def _prepare(
    out: Path, sources, vocab_size, seed, files, val_fraction, test_fraction, min_frequency, progress, tok_src: Path | None = None
) -> dict:
    manifest = build_corpus(
        out / "corpus",
        sources=sources,
        files=files,
        val_fraction=val_fraction,
        test_fraction=test_fraction,
        seed=seed,
    )
    if tok_src is None:
        tok_dir = train_tokenizer(
            manifest.path("train"),
            vocab_size,
            out_dir=out / "tokenizer",
            min_frequency=min_frequency,
            show_progress=progress,
        )
    else:  # reuse: copy the tokenizer files as they are
        tok_dir = out / "tokenizer"
        tok_dir.mkdir(parents=True, exist_ok=True)
        for name in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json"):
            if (tok_src / name).is_file():
                shutil.copyfile(tok_src / name, tok_dir / name)
    splits: dict[str, dict] = {}
    for split in SPLITS:
        text_file = manifest.path(split)
        token_file = out / "tokens" / f"{split}.npy"
        n_tokens = tokenize_split(text_file, tok_dir, token_file, progress=progress)
        docs = list(iter_documents(text_file))
        text_bytes = sum(len(doc.encode("utf-8")) for doc in docs)
        content_tokens = n_tokens - len(docs)
        splits[split] = {
            "documents": len(docs),
            "documents_by_source": manifest.splits[split].documents_by_source,
            "text_bytes": text_bytes,
            "file_bytes": manifest.splits[split].bytes,
            "tokens": n_tokens,
            "bytes_per_token": round(text_bytes / content_tokens, 4) if content_tokens else None,
            "text_file": str(text_file),
            "token_file": str(token_file),
        }
    summary = {
        "out_dir": str(out),
        "sources": manifest.sources,
        "packages": manifest.packages,
        "seed": seed,
        "val_fraction": val_fraction,
        "test_fraction": test_fraction,
        "vocab_size": vocab_size,
        "corpus_dir": str(out / "corpus"),
        "tokenizer_dir": str(tok_dir),
        "tokenizer_from": str(tok_src) if tok_src is not None else None,
        "splits": splits,
    }
    atomic_write_text(out / "prepare.json", json.dumps(summary, indent=2, ensure_ascii=False) + "\n")
    return summary


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m kvgraft.data.prepare", description=__doc__.split("\n")[0])
    parser.add_argument("--out", required=True, help="output directory (e.g. runs/data)")
    parser.add_argument(
        "--sources",
        nargs="*",
        default=list(DEFAULT_SOURCES),
        help=f"corpus sources (default: {' '.join(DEFAULT_SOURCES)}; known: {' '.join(sorted(SOURCES))})",
    )
    parser.add_argument("--files", nargs="*", default=[], help="extra user text files, one document each")
    parser.add_argument("--vocab-size", type=int, default=8192)
    parser.add_argument("--min-frequency", type=int, default=2)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--val-fraction", type=float, default=0.02)
    parser.add_argument("--test-fraction", type=float, default=0.02)
    parser.add_argument("--quiet", action="store_true", help="no progress bars")
    args = parser.parse_args(argv)
    try:
        summary = prepare_data(
            args.out,
            args.sources,
            args.vocab_size,
            args.seed,
            files=args.files,
            val_fraction=args.val_fraction,
            test_fraction=args.test_fraction,
            min_frequency=args.min_frequency,
            progress=not args.quiet,
        )
    except (CorpusError, FileNotFoundError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    print(json.dumps(summary, indent=2, ensure_ascii=False))
    return 0


if __name__ == "__main__":
    sys.exit(main())
