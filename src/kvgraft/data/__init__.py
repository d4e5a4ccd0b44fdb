"""Data pipeline: public-domain corpora from Debian packages, BPE tokenizer, packing.

Typical use::

    from kvgraft.data import build_corpus, train_tokenizer, tokenize_split, PackedDataset
    manifest = build_corpus("runs/data/corpus", sources=("kjv", "web", "python-docs"))
    tok_dir = train_tokenizer(manifest.path("train"), 8192, out_dir="runs/data/tokenizer")
    tokenize_split(manifest.path("train"), tok_dir, "runs/data/tokens/train.npy")
    ds = PackedDataset("runs/data/tokens/train.npy", seq_len=512)

or ``python -m kvgraft.data.prepare --out runs/data --vocab-size 8192``.
"""

from kvgraft.data.corpus import (
    DEFAULT_SOURCES,
    DOC_SEPARATOR,
    SOURCES,
    SPLITS,
    CorpusError,
    CorpusManifest,
    Source,
    build_corpus,
    iter_documents,
    load_manifest,
    read_document_index,
    split_for,
)
from kvgraft.data.packing import PackedDataset, load_tokens, slice_tokens, spread_tokens, token_dtype, tokenize_split
from kvgraft.data.tokenizer import EOS_TOKEN, eos_token_id, load_tokenizer, train_tokenizer

__all__ = [
    "DEFAULT_SOURCES",
    "DOC_SEPARATOR",
    "EOS_TOKEN",
    "SOURCES",
    "SPLITS",
    "CorpusError",
    "CorpusManifest",
    "PackedDataset",
    "Source",
    "build_corpus",
    "eos_token_id",
    "iter_documents",
    "load_manifest",
    "load_tokenizer",
    "load_tokens",
    "prepare_data",
    "read_document_index",
    "slice_tokens",
    "spread_tokens",
    "split_for",
    "token_dtype",
    "tokenize_split",
    "train_tokenizer",
]


def __getattr__(name: str):
    # Imported lazily so that ``python -m kvgraft.data.prepare`` does not import the
    # module twice (runpy warns when the package already imported it).
    if name == "prepare_data":
        from kvgraft.data.prepare import prepare_data

        return prepare_data
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
