"""Perplexity over a token stream: non-overlapping next-token windows, token-weighted, fp32 loss.

The stream is cut exactly like :class:`kvgraft.data.PackedDataset`: window ``i`` reads
``tokens[i*seq_len : i*seq_len + seq_len + 1]`` (inputs are its first ``seq_len`` tokens, labels its
last ``seq_len``), so ``(n - 1) // seq_len`` windows score ``seq_len`` tokens each and the tail that
does not fill a window is ignored. Every window starts with an empty context (position 0).
"""

from __future__ import annotations

import math
import warnings
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F
from tqdm.auto import tqdm

from kvgraft.checks import check_int
from kvgraft.data.corpus import DOC_SEPARATOR, iter_documents
from kvgraft.data.packing import load_tokens
from kvgraft.data.tokenizer import EOS_TOKEN
from kvgraft.errors import ConfigError


@dataclass(frozen=True)
class PerplexityResult:
    loss: float  # mean next-token cross-entropy, nats per token
    ppl: float  # exp(loss)
    tokens_scored: int  # num_windows * seq_len
    seq_len: int
    num_windows: int

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def _as_stream(tokens: np.ndarray | str | Path) -> np.ndarray:
    if isinstance(tokens, (str, Path)):
        return load_tokens(tokens)
    if isinstance(tokens, torch.Tensor):
        tokens = tokens.detach().cpu().numpy()
    stream = np.asarray(tokens)
    if stream.ndim != 1:
        raise ConfigError(f"tokens must be a 1-D token stream, got shape {stream.shape}")
    if not np.issubdtype(stream.dtype, np.integer):
        raise ConfigError(f"tokens must hold integer ids, got dtype {stream.dtype}")
    return stream


def _model_device(model: torch.nn.Module) -> torch.device:
    return next(model.parameters()).device


def perplexity(
    model: torch.nn.Module,
    tokens: np.ndarray | str | Path,
    seq_len: int | None = None,
    batch_size: int = 8,
    max_tokens: int | None = None,
    progress: bool = True,
) -> PerplexityResult:
    """Token-weighted perplexity of ``model`` on a 1-D token stream (array or ``.npy`` path).

    ``seq_len`` defaults to ``model.config.max_position_embeddings``. ``max_tokens`` caps the tokens
    scored: only the first ``max_tokens // seq_len`` windows are used. Logits are cast to fp32 before
    the cross-entropy; per-token losses are summed in fp64. Raises ``ValueError`` when the stream is
    shorter than ``seq_len + 1`` tokens, or for a non-positive ``seq_len``/``batch_size``/``max_tokens``.
    """
    config: Any = model.config  # a kvgraft or a transformers model: both have these fields
    if seq_len is None:
        seq_len = config.max_position_embeddings
    check_int("seq_len", seq_len, low=1)
    check_int("batch_size", batch_size, low=1)
    stream = _as_stream(tokens)
    if stream.size < seq_len + 1:
        raise ConfigError(
            f"token stream has {stream.size} tokens, fewer than seq_len + 1 = {seq_len + 1}; "
            "pass a longer stream or a smaller seq_len"
        )
    num_windows = (stream.size - 1) // seq_len
    if max_tokens is not None:
        if max_tokens < seq_len:
            raise ConfigError(f"max_tokens ({max_tokens}) must be >= seq_len ({seq_len}) to score one window")
        num_windows = min(num_windows, max_tokens // seq_len)
    if seq_len > config.max_position_embeddings:
        warnings.warn(
            f"seq_len {seq_len} exceeds the model's max_position_embeddings "
            f"({config.max_position_embeddings}); perplexity beyond the trained context is not comparable",
            stacklevel=2,
        )

    device = _model_device(model)
    vocab = config.vocab_size
    total = 0.0
    was_training = model.training
    model.eval()
    try:
        with torch.inference_mode(), tqdm(total=num_windows, desc="perplexity", unit="win", disable=not progress) as bar:
            for first in range(0, num_windows, batch_size):
                n = min(batch_size, num_windows - first)
                # windows first..first+n-1 share their boundary tokens: one contiguous slice, unfolded
                chunk = np.asarray(stream[first * seq_len : (first + n) * seq_len + 1], dtype=np.int64)
                lo, hi = int(chunk.min()), int(chunk.max())
                if lo < 0 or hi >= vocab:
                    raise ConfigError(
                        f"token ids must lie in [0, {vocab}) (the model's vocab_size); "
                        f"windows {first}..{first + n - 1} hold ids in [{lo}, {hi}]"
                    )
                windows = torch.from_numpy(chunk).unfold(0, seq_len + 1, seq_len).to(device)  # (n, L+1)
                logits = model(windows[:, :-1])  # (n, L, V)
                losses = F.cross_entropy(
                    logits.float().reshape(-1, logits.shape[-1]), windows[:, 1:].reshape(-1), reduction="none"
                )
                total += float(losses.double().sum())
                bar.update(n)
    finally:
        model.train(was_training)

    scored = num_windows * seq_len
    loss = total / scored
    ppl = math.exp(loss) if loss < 709.0 else math.inf
    return PerplexityResult(loss=loss, ppl=ppl, tokens_scored=scored, seq_len=seq_len, num_windows=num_windows)


# ----------------------------------------------------------------------------------- text input


def _has_doc_separators(path: Path) -> bool:
    with path.open("r", encoding="utf-8", newline="") as handle:
        return any(line in (DOC_SEPARATOR + "\n", DOC_SEPARATOR) for line in handle)


def _backend(tokenizer: Any) -> Any:
    """The ``tokenizers.Tokenizer`` behind a transformers fast tokenizer, or the object itself."""
    if hasattr(tokenizer, "encode_batch"):
        return tokenizer
    backend = getattr(tokenizer, "backend_tokenizer", None)
    return backend if backend is not None and hasattr(backend, "encode_batch") else None


def _eos_id(tokenizer: Any) -> int | None:
    eos = getattr(tokenizer, "eos_token_id", None)
    if isinstance(eos, int):
        return eos
    if hasattr(tokenizer, "token_to_id"):
        return tokenizer.token_to_id(EOS_TOKEN)
    return None


def _encode(tokenizer: Any, texts: list[str]) -> list[list[int]]:
    backend = _backend(tokenizer)
    if backend is not None:  # no special tokens, no max-length warnings on long texts
        return [enc.ids for enc in backend.encode_batch(texts, add_special_tokens=False)]
    return [list(tokenizer.encode(text, add_special_tokens=False)) for text in texts]


def text_to_tokens(text_file: str | Path, tokenizer: Any, eos_token_id: int | None = None, batch_size: int = 64) -> np.ndarray:
    """Tokenize a text file into a 1-D token stream for :func:`perplexity`.

    ``tokenizer`` is a ``tokenizers.Tokenizer`` or a transformers tokenizer. A corpus split file
    (documents separated by lines holding only ``"\\x1e"``, see :func:`kvgraft.data.iter_documents`)
    is tokenized per document with EOS after every document, exactly like
    :func:`kvgraft.data.tokenize_split`; any other file is tokenized whole, without EOS. The EOS id is
    ``eos_token_id`` or the tokenizer's own (``eos_token_id`` attribute or ``<|endoftext|>``).
    Returns uint16 ids when they fit, else uint32; no special tokens are added.
    """
    path = Path(text_file)
    if not path.is_file():
        raise FileNotFoundError(f"text file not found: {path}")
    try:
        return _text_to_tokens(path, tokenizer, eos_token_id, batch_size)
    except UnicodeDecodeError as exc:
        raise ConfigError(
            f"{path} is not UTF-8 text (byte {exc.object[exc.start : exc.start + 1]!r} at offset "
            f"{exc.start}: {exc.reason}); convert it to UTF-8 first"
        ) from exc


def _text_to_tokens(path: Path, tokenizer: Any, eos_token_id: int | None, batch_size: int) -> np.ndarray:
    chunks: list[list[int]] = []
    if _has_doc_separators(path):
        eos = eos_token_id if eos_token_id is not None else _eos_id(tokenizer)
        if eos is None:
            raise ConfigError(f"{path} holds several documents but the tokenizer has no EOS token; pass eos_token_id")
        batch: list[str] = []
        for doc in iter_documents(path):
            batch.append(doc)
            if len(batch) == batch_size:
                chunks.extend(ids + [eos] for ids in _encode(tokenizer, batch))
                batch = []
        if batch:
            chunks.extend(ids + [eos] for ids in _encode(tokenizer, batch))
    else:
        chunks.extend(_encode(tokenizer, [path.read_text(encoding="utf-8")]))
    ids = np.concatenate([np.asarray(c, dtype=np.int64) for c in chunks]) if chunks else np.zeros(0, np.int64)
    dtype = np.uint16 if ids.size == 0 or int(ids.max()) < 2**16 else np.uint32
    return ids.astype(dtype)
