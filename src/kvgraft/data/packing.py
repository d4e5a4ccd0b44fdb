"""Tokenize corpus splits into flat token streams and serve fixed-length windows.

A token stream is a 1-D ``.npy`` array: the concatenation of every document's tokens,
each followed by ``<|endoftext|>`` (id 0). dtype is ``uint16`` when every id fits
(vocabulary of at most 65536 entries), else ``uint32``.
"""

from __future__ import annotations

from collections.abc import Iterator
from itertools import islice
from pathlib import Path

import numpy as np
import torch
from torch.utils.data import Dataset
from tqdm.auto import tqdm

from kvgraft.atomic import atomic_open
from kvgraft.checks import check_int, check_number
from kvgraft.data.corpus import iter_documents
from kvgraft.data.tokenizer import eos_token_id, load_tokenizer
from kvgraft.errors import ConfigError


def token_dtype(vocab_size: int) -> np.dtype:
    """Smallest unsigned dtype holding ids ``0 .. vocab_size - 1`` (uint16 or uint32)."""
    return np.dtype(np.uint16) if vocab_size <= 2**16 else np.dtype(np.uint32)


def _batches(items: Iterator[str], size: int) -> Iterator[list[str]]:
    while batch := list(islice(items, size)):
        yield batch


def _save_npy(array: np.ndarray, out_file: str | Path) -> None:
    with atomic_open(out_file, "wb") as handle:
        np.save(handle, array, allow_pickle=False)


def tokenize_split(
    text_file: str | Path,
    tokenizer_path: str | Path,
    out_file: str | Path,
    append_eos: bool = True,
    batch_size: int = 64,
    progress: bool = True,
) -> int:
    """Tokenize every document of a corpus split file into one ``.npy`` stream.

    Documents are batch-encoded (no special tokens added by the tokenizer); with
    ``append_eos`` the EOS id follows each document. The file is written atomically.
    Returns the number of tokens written.
    """
    tok = load_tokenizer(tokenizer_path)
    eos = eos_token_id(tok)
    dtype = token_dtype(tok.get_vocab_size(with_added_tokens=True))
    chunks: list[np.ndarray] = []
    docs = iter_documents(text_file)
    with tqdm(desc=f"tokenize {Path(text_file).name}", unit="doc", disable=not progress) as bar:
        for batch in _batches(docs, batch_size):
            for enc in tok.encode_batch(batch, add_special_tokens=False):
                ids = enc.ids + [eos] if append_eos else enc.ids
                chunks.append(np.asarray(ids, dtype=dtype))
            bar.update(len(batch))
    stream = np.concatenate(chunks) if chunks else np.zeros(0, dtype=dtype)
    _save_npy(stream, out_file)
    return int(stream.size)


def load_tokens(path: str | Path) -> np.ndarray:
    """Memory-map a 1-D token ``.npy`` file (read-only)."""
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"token file not found: {path}")
    tokens = np.load(path, mmap_mode="r")
    if tokens.ndim != 1:
        raise ConfigError(f"token file {path} must hold a 1-D array, got shape {tokens.shape}")
    return tokens


def slice_tokens(npy_in: str | Path, n_tokens: int, npy_out: str | Path) -> int:
    """Write the first ``n_tokens`` tokens of ``npy_in`` to ``npy_out`` (same dtype).

    For small calibration/eval slices. Raises ValueError if ``n_tokens`` is not
    positive or exceeds the stream length. Returns ``n_tokens``.
    """
    tokens = load_tokens(npy_in)
    if n_tokens <= 0 or n_tokens > tokens.size:
        raise ConfigError(f"n_tokens={n_tokens} must be in [1, {tokens.size}] (length of {npy_in})")
    _save_npy(np.array(tokens[:n_tokens]), npy_out)
    return n_tokens


def spread_tokens(npy_in: str | Path, n_tokens: int, chunk: int, npy_out: str | Path) -> int:
    """Write ``n_tokens`` tokens taken as evenly spaced chunks of ``chunk`` tokens across ``npy_in``.

    A split's stream is its documents in corpus order (source by source), so its first tokens are one
    source only; evenly spaced chunks represent the whole split. ``n_tokens`` is rounded down to
    whole chunks. Returns the number of tokens written.
    """
    tokens = load_tokens(npy_in)
    n_chunks = n_tokens // chunk
    if n_chunks <= 0 or n_chunks * chunk > tokens.size:
        raise ConfigError(
            f"n_tokens={n_tokens} must hold at least one chunk of {chunk} and fit in {tokens.size} tokens ({npy_in})"
        )
    starts = np.linspace(0, tokens.size - chunk, n_chunks).astype(np.int64)
    _save_npy(np.concatenate([np.asarray(tokens[s : s + chunk]) for s in starts]), npy_out)
    return n_chunks * chunk


class PackedDataset(Dataset):
    """Non-overlapping next-token windows over a token stream.

    Item ``i`` reads ``tokens[i*seq_len : i*seq_len + seq_len + 1]`` (one token of
    overlap with the next window) and returns ``{"input_ids": x[:-1], "labels": x[1:]}``
    as int64 tensors of length ``seq_len``. ``len = (n_tokens - 1) // seq_len``.
    ``tokens`` is a ``.npy`` path (memory-mapped) or a 1-D array.
    """

    def __init__(self, tokens: str | Path | np.ndarray, seq_len: int) -> None:
        check_int("seq_len", seq_len, low=1)
        self.tokens = load_tokens(tokens) if isinstance(tokens, (str, Path)) else np.asarray(tokens)
        if self.tokens.ndim != 1:
            raise ConfigError(f"tokens must be 1-D, got shape {self.tokens.shape}")
        if self.tokens.size < seq_len + 1:
            raise ConfigError(f"token stream has {self.tokens.size} tokens, fewer than seq_len + 1 = {seq_len + 1}")
        self.seq_len = seq_len

    def __len__(self) -> int:
        return (self.tokens.size - 1) // self.seq_len

    def __getitem__(self, index: int) -> dict[str, torch.Tensor]:
        n = len(self)
        if index < 0:
            index += n
        if not 0 <= index < n:
            raise IndexError(f"index {index} out of range for {n} windows")
        start = index * self.seq_len
        window = torch.from_numpy(np.array(self.tokens[start : start + self.seq_len + 1], dtype=np.int64))
        return {"input_ids": window[:-1], "labels": window[1:]}


class CopyWindows(Dataset):
    """A :class:`PackedDataset` where a ``fraction`` of the windows repeat their own opening ``span`` tokens.

    A copy window reads ``A + A + C`` instead of the window's tokens: ``A`` its first ``span`` tokens, ``C``
    what followed ``A`` in the text (to fill ``seq_len + 1``). Every token of the second ``A`` is then
    predictable from ``span`` tokens back: distilled from a teacher that copies, a student learns to copy
    from that far (a causal encoder-decoder, through its shared stream when ``span`` exceeds its windows).
    Which windows copy is fixed (spread evenly: window ``i`` copies when ``floor((i + 1) f) > floor(i f)``),
    so a resumed run sees the same data."""

    def __init__(self, base: PackedDataset, fraction: float, span: int) -> None:
        check_number("copy fraction", fraction, low=0, high=1)
        check_int(
            "copy span", span, low=1, high=base.seq_len // 2, accepted=f"an integer in [1, seq_len // 2 = {base.seq_len // 2}]"
        )
        self.base, self.fraction, self.span = base, float(fraction), span
        self.seq_len = base.seq_len

    def __len__(self) -> int:
        return len(self.base)

    def is_copy(self, index: int) -> bool:
        return int((index + 1) * self.fraction) > int(index * self.fraction)

    def __getitem__(self, index: int) -> dict[str, torch.Tensor]:
        item = self.base[index]
        if not self.is_copy(index % len(self)):
            return item
        window = torch.cat([item["input_ids"], item["labels"][-1:]])  # the seq_len + 1 tokens
        a = window[: self.span]
        window = torch.cat([a, a, window[self.span : self.span + window.numel() - 2 * self.span]])
        return {"input_ids": window[:-1], "labels": window[1:]}
