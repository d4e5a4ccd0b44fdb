"""Tests for kvgraft.data: corpus splits, tokenizer, packing (fast; no Debian sources
except the one slow KJV test)."""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch

from kvgraft.data import (
    DOC_SEPARATOR,
    EOS_TOKEN,
    SOURCES,
    CorpusError,
    PackedDataset,
    build_corpus,
    iter_documents,
    load_manifest,
    load_tokenizer,
    read_document_index,
    slice_tokens,
    tokenize_split,
    train_tokenizer,
)
from kvgraft.data.corpus import parse_kjv, parse_web

WORDS = (
    "alpha beta gamma delta epsilon zeta eta theta iota kappa lambda mu nu xi omicron pi rho "
    "sigma tau upsilon phi chi psi omega river mountain lantern harbor copper meadow whisper"
).split()


def _doc_text(i: int) -> str:
    rng = np.random.default_rng(i)
    lines = [" ".join(rng.choice(WORDS, size=12)) + "." for _ in range(6)]
    return f"Document number {i}.\n" + "\n".join(lines) + "\n"


def _write_files(directory: Path, n: int, start: int = 0) -> list[Path]:
    directory.mkdir(parents=True, exist_ok=True)
    paths = []
    for i in range(start, start + n):
        path = directory / f"doc{i:03d}.txt"
        path.write_text(_doc_text(i), encoding="utf-8")
        paths.append(path)
    return paths


FRACTIONS = {"val_fraction": 0.15, "test_fraction": 0.15}


@pytest.fixture(scope="module")
def corpus(tmp_path_factory: pytest.TempPathFactory):
    root = tmp_path_factory.mktemp("corpus")
    files = _write_files(root / "src", 40)
    manifest = build_corpus(root / "out", sources=(), files=files, seed=0, **FRACTIONS)
    return root, files, manifest


@pytest.fixture(scope="module")
def tokenizer_dir(corpus, tmp_path_factory: pytest.TempPathFactory) -> Path:
    _root, _files, manifest = corpus
    return train_tokenizer(manifest.path("train"), 400, out_dir=tmp_path_factory.mktemp("tok"), min_frequency=1)


# ----------------------------------------------------------------------------- corpus


def test_corpus_files_and_manifest(corpus) -> None:
    _root, files, manifest = corpus
    out = Path(manifest.out_dir)
    for name in ("train.txt", "validation.txt", "test.txt", "corpus.json", "documents.tsv"):
        assert (out / name).is_file()
    assert not [p for p in out.iterdir() if p.name.endswith(".tmp")]
    loaded = load_manifest(out)
    assert loaded.splits["train"].sha256 == manifest.splits["train"].sha256
    assert sum(s.documents for s in manifest.splits.values()) == len(files)
    raw = json.loads((out / "corpus.json").read_text())
    assert raw["seed"] == 0 and raw["val_fraction"] == 0.15
    for split, stats in manifest.splits.items():
        assert stats.documents > 0, split
        assert stats.bytes == (out / stats.file).stat().st_size
        assert len(list(iter_documents(out / stats.file))) == stats.documents


def test_split_is_by_document_and_texts_round_trip(corpus) -> None:
    _root, files, manifest = corpus
    index = read_document_index(manifest.out_dir)
    assert set(index) == {f"file/{p.name}" for p in files}
    originals = {p.read_text(encoding="utf-8").strip() for p in files}
    seen: list[str] = []
    for split in ("train", "validation", "test"):
        docs = list(iter_documents(manifest.path(split)))
        assert len(docs) == sum(1 for s in index.values() if s == split)
        seen.extend(docs)
    assert len(seen) == len(set(seen)) == len(files)  # no document in two splits
    assert set(seen) == originals


def test_split_is_deterministic(corpus, tmp_path: Path) -> None:
    _root, files, manifest = corpus
    again = build_corpus(tmp_path / "again", sources=(), files=files, seed=0, **FRACTIONS)
    for split in manifest.splits:
        assert again.splits[split].sha256 == manifest.splits[split].sha256
    assert read_document_index(tmp_path / "again") == read_document_index(manifest.out_dir)
    other_seed = build_corpus(tmp_path / "seed1", sources=(), files=files, seed=1, **FRACTIONS)
    assert read_document_index(tmp_path / "seed1") != read_document_index(manifest.out_dir)
    assert other_seed.seed == 1


def test_adding_a_file_does_not_move_existing_documents(corpus, tmp_path: Path) -> None:
    _root, files, manifest = corpus
    extra = _write_files(tmp_path / "extra", 5, start=100)
    build_corpus(tmp_path / "bigger", sources=(), files=[*files, *extra], seed=0, **FRACTIONS)
    before = read_document_index(manifest.out_dir)
    after = read_document_index(tmp_path / "bigger")
    assert {k: after[k] for k in before} == before
    assert len(after) == len(before) + len(extra)


def test_iter_documents_contract(tmp_path: Path) -> None:
    a = tmp_path / "a.txt"
    b = tmp_path / "b.txt"
    c = tmp_path / "c.txt"
    a.write_bytes(b"line one\r\nline two\r\n\r\n")
    b.write_text(f"sep inside {DOC_SEPARATOR} here\n{DOC_SEPARATOR}\nnext line \u00e9\u00e8 \u65e5\u672c\n", encoding="utf-8")
    c.write_text("   \n\n", encoding="utf-8")  # empty after cleaning -> dropped
    manifest = build_corpus(tmp_path / "out", sources=(), files=[a, b, c], val_fraction=0.0, test_fraction=0.0)
    docs = list(iter_documents(manifest.path("train")))
    assert sorted(docs) == sorted(["line one\nline two", "sep inside  here\n\nnext line \u00e9\u00e8 \u65e5\u672c"])
    assert manifest.splits["validation"].documents == 0  # fraction 0: allowed to be empty
    assert list(iter_documents(manifest.path("validation"))) == []


def test_corpus_errors(tmp_path: Path) -> None:
    files = _write_files(tmp_path / "src", 3)
    with pytest.raises(CorpusError, match="unknown corpus source 'nope'.*kjv"):
        build_corpus(tmp_path / "o1", sources=("nope",), files=files)
    with pytest.raises(CorpusError, match="not found"):
        build_corpus(tmp_path / "o2", sources=(), files=[tmp_path / "missing.txt"])
    with pytest.raises(CorpusError, match="empty"):  # 1 document cannot fill 3 splits
        build_corpus(tmp_path / "o3", sources=(), files=files[:1], val_fraction=0.3, test_fraction=0.3)
    assert not (tmp_path / "o3" / "train.txt").exists()  # nothing half-written
    with pytest.raises(CorpusError, match="val_fraction"):
        build_corpus(tmp_path / "o4", sources=(), files=files, val_fraction=0.6, test_fraction=0.5)
    dup_dir = tmp_path / "dup"
    dup_dir.mkdir()
    shutil.copy(files[0], dup_dir / files[0].name)
    with pytest.raises(CorpusError, match="duplicate"):
        build_corpus(tmp_path / "o5", sources=(), files=[files[0], dup_dir / files[0].name])
    assert issubclass(CorpusError, ValueError)


def test_missing_package_error_names_package(monkeypatch: pytest.MonkeyPatch) -> None:
    from kvgraft.data import corpus as corpus_mod

    src = corpus_mod.Source("fake", "test", ("some-deb-package",), ("/nonexistent/kvgraft-test-tool",), lambda: iter(()))
    with pytest.raises(CorpusError, match="some-deb-package"):
        corpus_mod.ensure_source(src, install=False)
    monkeypatch.setattr(corpus_mod.shutil, "which", lambda name: None)
    with pytest.raises(CorpusError, match="apt-get is not available") as info:
        corpus_mod.ensure_source(src, install=True)
    assert "some-deb-package" in str(info.value)


def test_registry_knows_sources() -> None:
    assert {"kjv", "web", "python-docs", "devil", "fortunes"} <= set(SOURCES)
    assert SOURCES["kjv"].packages == ("bible-kjv", "bible-kjv-text")
    assert SOURCES["kjv"].split_key("kjv/1 Samuel/3") == SOURCES["web"].split_key("web/1 Samuel/3")


def test_kjv_parser() -> None:
    text = (
        "\nGenesis 1\n\n  1 In the beginning God created the heaven and the earth.\n"
        "  2 And the earth was without form,\nand void.\n\n1 Samuel 2\n\n  1 And Hannah prayed.\n"
    )
    docs = list(parse_kjv(text))
    assert docs == [
        ("kjv/Genesis/1", "In the beginning God created the heaven and the earth.\nAnd the earth was without form, and void."),
        ("kjv/1 Samuel/2", "And Hannah prayed."),
    ]


def test_web_parser() -> None:
    text = (
        "Genesis 1:1: In the beginning, Godcreated the heavens.\n"
        "Genesis 1:2: The earth was formless  and empty. \n"
        "A Psalm by David.\n"
        "  Psalms 3:1: Yahweh, how my adversaries have increased!\n"
        "Many are those who rise up against me. \n\n"
        "A Psalm by David.\n"
        "  Psalms 3:2: Many there are who say of my soul.\n"
        "I Samuel 1:1: Now there was a certain man.\n"
        "Tobit 1:1: The book of the words of Tobit.\n"
        "Revelation of John 22:21: The grace of the Lord Jesus Christ be with all the saints. Amen.\n\n"
        "   The following words used in the World English Bible (WEB) are not very common.\n"
        "(engWEB2015eb)\n"
    )
    docs = dict(parse_web(text))
    assert docs == {
        "web/Genesis/1": "In the beginning, God created the heavens.\nThe earth was formless and empty.",
        "web/Psalms/3": "Yahweh, how my adversaries have increased! Many are those who rise up against me.\n"
        "Many there are who say of my soul.",
        "web/1 Samuel/1": "Now there was a certain man.",
        "web/Revelation/22": "The grace of the Lord Jesus Christ be with all the saints. Amen.",
    }
    assert dict(parse_web(text, canon_only=False)) == {"web/Tobit/1": "The book of the words of Tobit."}


# -------------------------------------------------------------------------- tokenizer


@pytest.mark.parametrize(
    "text",
    [
        "Hello world, this is plain ASCII.\n\tIndented\nline  with  double spaces ",
        "Caf\u00e9 na\u00efve \u00fcber \u2014 \u65e5\u672c\u8a9e \U0001f600 \u201cquotes\u201d",
        " leading space and trailing newline\n",
    ],
)
def test_tokenizer_round_trips(tokenizer_dir: Path, text: str) -> None:
    tok = load_tokenizer(tokenizer_dir)
    assert tok.decode(tok.encode(text).ids) == text
    assert tok.get_vocab_size() == 400
    assert tok.token_to_id(EOS_TOKEN) == 0
    assert tok.encode(text).ids[0] != 0  # no automatic BOS


def test_tokenizer_loads_with_transformers(tokenizer_dir: Path) -> None:
    from transformers import AutoTokenizer, PreTrainedTokenizerFast

    auto = AutoTokenizer.from_pretrained(str(tokenizer_dir))
    fast = PreTrainedTokenizerFast(tokenizer_file=str(tokenizer_dir / "tokenizer.json"))
    assert auto.eos_token == auto.bos_token == auto.pad_token == EOS_TOKEN
    assert auto.eos_token_id == 0
    text = "gamma delta caf\u00e9  \u65e5\u672c\n"
    ids = auto(text)["input_ids"]
    assert ids == load_tokenizer(tokenizer_dir).encode(text).ids
    assert auto.decode(ids) == text
    assert fast.decode(fast(text)["input_ids"]) == text


def test_tokenizer_validation(tmp_path: Path, corpus) -> None:
    _root, _files, manifest = corpus
    with pytest.raises(ValueError, match="vocab_size=256"):
        train_tokenizer(manifest.path("train"), 256, out_dir=tmp_path / "t")
    with pytest.raises(FileNotFoundError, match="tokenizer not found"):
        load_tokenizer(tmp_path / "nowhere")
    with pytest.raises(FileNotFoundError):
        train_tokenizer(tmp_path / "missing.txt", 300, out_dir=tmp_path / "t")


# ---------------------------------------------------------------------------- packing


def test_tokenize_split_and_packing(corpus, tokenizer_dir: Path, tmp_path: Path) -> None:
    _root, _files, manifest = corpus
    out = tmp_path / "train.npy"
    n = tokenize_split(manifest.path("train"), tokenizer_dir, out, progress=False)
    tokens = np.load(out)
    assert tokens.dtype == np.uint16 and tokens.shape == (n,)
    tok = load_tokenizer(tokenizer_dir)
    docs = list(iter_documents(manifest.path("train")))
    expected = np.concatenate([np.array([*tok.encode(d).ids, 0]) for d in docs])
    np.testing.assert_array_equal(tokens, expected)
    assert int((tokens == 0).sum()) == len(docs) and tokens[-1] == 0

    seq_len = 16
    ds = PackedDataset(out, seq_len)
    assert len(ds) == (n - 1) // seq_len
    for i in (0, 1, len(ds) - 1):
        item = ds[i]
        assert item["input_ids"].shape == item["labels"].shape == (seq_len,)
        assert item["input_ids"].dtype == torch.int64
        assert torch.equal(item["labels"][:-1], item["input_ids"][1:])
        window = torch.from_numpy(tokens[i * seq_len : i * seq_len + seq_len + 1].astype(np.int64))
        assert torch.equal(item["input_ids"], window[:-1]) and torch.equal(item["labels"], window[1:])
    assert torch.equal(ds[1]["input_ids"][0], ds[0]["labels"][-1])
    with pytest.raises(IndexError):
        ds[len(ds)]
    batch = next(iter(torch.utils.data.DataLoader(ds, batch_size=4)))
    assert batch["input_ids"].shape == (4, seq_len)

    no_eos = tokenize_split(manifest.path("train"), tokenizer_dir, tmp_path / "noeos.npy", append_eos=False, progress=False)
    assert no_eos == n - len(docs)

    small = tmp_path / "slice.npy"
    assert slice_tokens(out, 50, small) == 50
    np.testing.assert_array_equal(np.load(small), tokens[:50])
    with pytest.raises(ValueError, match="n_tokens"):
        slice_tokens(out, n + 1, tmp_path / "too_big.npy")


def test_packed_dataset_rejects_short_streams(tmp_path: Path) -> None:
    arr = np.arange(8, dtype=np.uint16)
    with pytest.raises(ValueError, match=r"8 tokens.*seq_len \+ 1 = 9"):
        PackedDataset(arr, 8)
    ds = PackedDataset(arr, 7)
    assert len(ds) == 1
    assert ds[0]["labels"].tolist() == list(range(1, 8))
    with pytest.raises(ValueError, match="seq_len"):
        PackedDataset(arr, 0)
    with pytest.raises(FileNotFoundError):
        PackedDataset(tmp_path / "nope.npy", 4)


# ------------------------------------------------------------------------------- slow


@pytest.mark.slow
def test_real_kjv_source_has_1189_chapters(tmp_path: Path) -> None:
    src = SOURCES["kjv"]
    if src.missing() and (shutil.which("apt-get") is None or os.geteuid() != 0):
        pytest.skip(f"kjv source needs Debian packages {src.packages}")
    manifest = build_corpus(tmp_path / "kjv", sources=("kjv",))
    assert sum(s.documents for s in manifest.splits.values()) == 1189
    index = read_document_index(tmp_path / "kjv")
    assert "kjv/Genesis/1" in index and "kjv/Revelation/22" in index
    assert manifest.packages == ["bible-kjv", "bible-kjv-text"]


def test_spread_tokens_takes_even_chunks_across_the_stream(tmp_path):
    from kvgraft.data import spread_tokens

    np.save(tmp_path / "s.npy", np.arange(1000, dtype=np.uint16))
    n = spread_tokens(tmp_path / "s.npy", 250, 50, tmp_path / "o.npy")
    out = np.load(tmp_path / "o.npy")
    assert n == 250 and out.dtype == np.uint16
    starts = out[::50]
    assert starts[0] == 0 and starts[-1] == 950  # first and last chunk of the stream
    assert all(np.array_equal(out[i : i + 50], np.arange(out[i], out[i] + 50)) for i in range(0, 250, 50))
    with pytest.raises(ValueError, match="n_tokens=10"):
        spread_tokens(tmp_path / "s.npy", 10, 50, tmp_path / "o.npy")


def test_prepare_data_can_reuse_a_tokenizer_for_the_same_token_ids(corpus, tmp_path: Path) -> None:
    """prepare-data with --tokenizer copies that tokenizer instead of training one: the token streams are
    exactly what that tokenizer gives (a model's own ids); a vocabulary size that differs is refused
    before anything is written."""
    from kvgraft.data import prepare_data
    from kvgraft.data.corpus import CorpusError

    _root, files, _manifest = corpus
    # a tokenizer trained on other text: its ids differ from a fresh one's on this corpus
    other = _write_files(tmp_path / "other", 30, start=500)
    other_manifest = build_corpus(tmp_path / "other-corpus", sources=(), files=other, seed=1, **FRACTIONS)
    shipped = train_tokenizer(other_manifest.path("train"), 300, out_dir=tmp_path / "shipped", min_frequency=1)
    fresh = prepare_data(tmp_path / "fresh", sources=(), files=files, vocab_size=300, progress=False, **FRACTIONS)
    reused = prepare_data(
        tmp_path / "reused", sources=(), files=files, vocab_size=300, progress=False, **FRACTIONS, tokenizer=shipped
    )
    assert reused["tokenizer_from"] == str(shipped)
    assert (tmp_path / "reused" / "tokenizer" / "tokenizer.json").read_bytes() == (shipped / "tokenizer.json").read_bytes()
    for split in ("train", "validation", "test"):
        want = tmp_path / "want" / f"{split}.npy"
        tokenize_split(Path(reused["splits"][split]["text_file"]), shipped, want, progress=False)
        assert np.array_equal(np.load(reused["splits"][split]["token_file"]), np.load(want))
    assert not np.array_equal(np.load(fresh["splits"]["train"]["token_file"]), np.load(reused["splits"]["train"]["token_file"]))
    with pytest.raises(CorpusError, match="has 300 entries but --vocab-size is 512"):
        prepare_data(tmp_path / "bad", sources=(), files=files, vocab_size=512, progress=False, tokenizer=shipped)
    assert not (tmp_path / "bad").exists()
