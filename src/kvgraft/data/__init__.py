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

# Imported on first use (PEP 562): the corpus module is standard library only, packing needs torch and
# the tokenizer module the tokenizers library; ``kvgraft --help`` reads the corpus sources and nothing more.
_LAZY = {
    "PackedDataset": "kvgraft.data.packing",
    "CopyWindows": "kvgraft.data.packing",
    "load_tokens": "kvgraft.data.packing",
    "slice_tokens": "kvgraft.data.packing",
    "spread_tokens": "kvgraft.data.packing",
    "token_dtype": "kvgraft.data.packing",
    "tokenize_split": "kvgraft.data.packing",
    "EOS_TOKEN": "kvgraft.data.tokenizer",
    "eos_token_id": "kvgraft.data.tokenizer",
    "load_tokenizer": "kvgraft.data.tokenizer",
    "train_tokenizer": "kvgraft.data.tokenizer",
    # imported lazily also so that ``python -m kvgraft.data.prepare`` does not import the
    # module twice (runpy warns when the package already imported it)
    "prepare_data": "kvgraft.data.prepare",
}

__all__ = [
    "DEFAULT_SOURCES",
    "DOC_SEPARATOR",
    "EOS_TOKEN",
    "SOURCES",
    "SPLITS",
    "CorpusError",
    "CorpusManifest",
    "PackedDataset",
    "CopyWindows",
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
    if name in _LAZY:
        import importlib  # lazy: names are imported on first use, so `import kvgraft.data` stays light

        value = getattr(importlib.import_module(_LAZY[name]), name)
        globals()[name] = value
        return value
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_LAZY))
