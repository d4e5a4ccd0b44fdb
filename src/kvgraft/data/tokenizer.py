"""Byte-level BPE tokenizer training and loading.

Choices (contract for the rest of kvgraft):

* Byte-level BPE (GPT-2 style): ``ByteLevel(add_prefix_space=False)`` pre-tokenizer,
  ``ByteLevel`` decoder, all 256 byte symbols in the initial alphabet, no normalizer.
  Hence every string is encodable and ``decode(encode(x)) == x`` for any text.
* One special token, ``<|endoftext|>`` with id 0, used as EOS, BOS and PAD. It is
  *not* added automatically by ``encode``; :func:`kvgraft.data.packing.tokenize_split`
  appends it after every document. There is no UNK token (never needed).
* Files written to ``out_dir``: ``tokenizer.json`` (the ``tokenizers`` model),
  ``tokenizer_config.json`` and ``special_tokens_map.json`` so that
  ``transformers.AutoTokenizer.from_pretrained(out_dir)`` and
  ``PreTrainedTokenizerFast(tokenizer_file=out_dir / "tokenizer.json")`` load it
  offline.
"""

from __future__ import annotations

import json
from collections.abc import Iterator, Sequence
from pathlib import Path

from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

from kvgraft.atomic import atomic_write_text
from kvgraft.checks import is_int
from kvgraft.data.corpus import iter_documents
from kvgraft.errors import ConfigError

EOS_TOKEN = "<|endoftext|>"
SPECIAL_TOKENS: tuple[str, ...] = (EOS_TOKEN,)
TOKENIZER_FILE = "tokenizer.json"
TOKENIZER_CONFIG_FILE = "tokenizer_config.json"
MIN_VOCAB_SIZE = 256 + len(SPECIAL_TOKENS)


def _check_vocab_size(vocab_size: int) -> None:
    if not is_int(vocab_size) or vocab_size < MIN_VOCAB_SIZE:
        raise ConfigError(
            f"vocab_size={vocab_size!r} is too small: a byte-level BPE needs at least "
            f"{MIN_VOCAB_SIZE} (256 bytes + {len(SPECIAL_TOKENS)} special token(s))"
        )


def _documents(text_files: Sequence[str | Path]) -> Iterator[str]:
    for path in text_files:
        yield from iter_documents(path)


def new_tokenizer() -> Tokenizer:
    """An untrained byte-level BPE tokenizer with the pipeline described above."""
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.post_processor = processors.ByteLevel(trim_offsets=False)
    return tok


def train_tokenizer(
    text_files: str | Path | Sequence[str | Path],
    vocab_size: int = 8192,
    *,
    out_dir: str | Path,
    min_frequency: int = 2,
    model_max_length: int = 2048,
    show_progress: bool = False,
) -> Path:
    """Train a byte-level BPE on the documents of corpus split files; return ``out_dir``.

    ``text_files`` are split files written by :func:`kvgraft.data.corpus.build_corpus`
    (pass only the *train* split to keep validation/test unseen). The final vocabulary
    has exactly ``vocab_size`` entries unless the data has too few distinct merges.
    Raises ``ValueError`` for ``vocab_size < 257`` and ``FileNotFoundError`` for a
    missing input file.
    """
    _check_vocab_size(vocab_size)
    files = [Path(text_files)] if isinstance(text_files, (str, Path)) else [Path(p) for p in text_files]
    if not files:
        raise ConfigError("train_tokenizer needs at least one text file")
    for path in files:
        if not path.is_file():
            raise FileNotFoundError(f"tokenizer training file not found: {path}")

    tok = new_tokenizer()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        min_frequency=min_frequency,
        special_tokens=list(SPECIAL_TOKENS),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=show_progress,
    )
    tok.train_from_iterator(_documents(files), trainer=trainer)
    if tok.token_to_id(EOS_TOKEN) != 0:
        raise RuntimeError(f"{EOS_TOKEN} did not get id 0")  # tokenizers contract changed

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    atomic_write_text(out / TOKENIZER_FILE, tok.to_str(pretty=True))
    config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": EOS_TOKEN,
        "eos_token": EOS_TOKEN,
        "pad_token": EOS_TOKEN,
        "unk_token": None,
        "model_max_length": model_max_length,
        "add_prefix_space": False,
        "clean_up_tokenization_spaces": False,
        "padding_side": "right",
    }
    atomic_write_text(out / TOKENIZER_CONFIG_FILE, json.dumps(config, indent=2) + "\n")
    special = {"bos_token": EOS_TOKEN, "eos_token": EOS_TOKEN, "pad_token": EOS_TOKEN}
    atomic_write_text(out / "special_tokens_map.json", json.dumps(special, indent=2) + "\n")
    return out


def tokenizer_file(path_or_dir: str | Path) -> Path:
    """Resolve a tokenizer directory or ``tokenizer.json`` path to the json file."""
    path = Path(path_or_dir)
    file = path / TOKENIZER_FILE if path.is_dir() else path
    if not file.is_file():
        raise FileNotFoundError(
            f"tokenizer not found: {file} (expected a {TOKENIZER_FILE} or a directory holding one; "
            "train one with kvgraft.data.train_tokenizer)"
        )
    return file


def load_tokenizer(path_or_dir: str | Path) -> Tokenizer:
    """Load a ``tokenizers.Tokenizer`` from a directory or a ``tokenizer.json`` file."""
    return Tokenizer.from_file(str(tokenizer_file(path_or_dir)))


def eos_token_id(tokenizer: Tokenizer) -> int:
    """Id of ``<|endoftext|>`` in ``tokenizer``; ValueError if it has none."""
    token_id = tokenizer.token_to_id(EOS_TOKEN)
    if token_id is None:
        raise ConfigError(f"tokenizer has no {EOS_TOKEN} token")
    return token_id
