"""Every bad input is answered before work starts: one line ``kvgraft: error: ...`` naming the value, exit
status 2, no output left behind, and none of the heavy steps (loading weights, grafting, training, building
a corpus) reached. One row per case; add a row for each new case found.

Each row: the argv (placeholders in braces are fixtures below), a substring the error line must contain,
and the heavy functions that must not run (replaced by tripwires). Outputs go under ``{outs}``, which must
still be empty afterwards.
"""

from __future__ import annotations

import errno
import importlib
import json
import pkgutil
import re
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

import kvgraft.cli.cmd
from kvgraft.cli import main

NO_LOAD = ("kvgraft.hf.load_pretrained",)
NO_GRAFT = ("kvgraft.hf.load_pretrained", "kvgraft.graft.convert.graft_mla")
NO_TRAIN = ("kvgraft.train.pretrain.train",)
NO_CORPUS = ("kvgraft.data.prepare.build_corpus",)
BAD_UTF8 = b"caf\xe9 \xff".decode("utf-8", "surrogateescape")  # what Python makes of non-UTF-8 argv bytes

CASES = [
    # -- convert: ranks (zero used to mean "the default")
    (["convert", "{tiny}", "--out", "{outs}/m", "--kv-lora-rank", "0"], "kv_lora_rank (0)", NO_GRAFT),
    (["convert", "{tiny}", "--out", "{outs}/m", "--compression", "0"], "compression (0.0)", NO_GRAFT),
    (["convert", "{tiny}", "--out", "{outs}/m", "--rope-dim", "0"], "qk_rope_head_dim (0)", NO_GRAFT),
    (["convert", "{tiny}", "--out", "{outs}/m", "--calibration-shrinkage", "1.5"], "calibration_shrinkage (1.5)", NO_GRAFT),
    (["convert", "{tiny}", "--out", "{outs}/m", "--calibration-shrinkage", "nan"], "calibration_shrinkage (nan)", NO_GRAFT),
    (["convert", "{tiny}", "--out", "{outs}/m", "--compression", "nan"], "compression (nan)", NO_GRAFT),
    (["convert", "{tiny}", "--out", "{outs}/m", "--compression", "inf"], "compression (inf)", NO_GRAFT),
    (["convert", "{tiny}", "--out", "{outs}/m", "--compression", "1"], "compression (1.0)", NO_GRAFT),
    (["convert", "{tiny}", "--out", "{outs}/m", "--compression", "-4"], "compression (-4.0)", NO_GRAFT),
    (["convert", "{tiny}", "--out", "{outs}/m", "--compression", "4", "--kv-lora-rank", "8"], "not both", NO_GRAFT),
    (["convert", "{tiny}", "--out", "{outs}/m", "--compression", "64"], "leaves 1 cached values per layer", NO_GRAFT),
    (["convert", "{tiny}", "--out", "{outs}/m", "--rope-dim", "7"], "qk_rope_head_dim (7)", NO_GRAFT),
    (["convert", "{tiny}", "--out", "{outs}/m", "--rope-dim", "16"], "not enough for qk_rope_head_dim (16)", NO_GRAFT),
    (["convert", "{tiny}", "--out", "{outs}/m", "--kv-lora-rank", "1000"], "kv_lora_rank (1000)", NO_GRAFT),
    (["convert", "{tiny}", "--out", "{outs}/m", "--kv-lora-rank", "-3"], "kv_lora_rank (-3)", NO_GRAFT),
    (["convert", "{tiny}", "--out", "{outs}/m", "--layers", "9"], "layers [9] out of range", NO_GRAFT),
    (
        ["convert", "{tiny}", "--out", "{outs}/m", "--format", "deepseek_v3", "--rope-selection", "stride", "--rope-dim", "6"],
        "rope selection 'stride' needs d_rope (6) to divide head_dim (16)",
        NO_GRAFT,
    ),
    (
        ["convert", "{tiny}", "--out", "{outs}/m", "--format", "deepseek_v3", "--rope-selection", "norm"],
        "rope selection 'norm' cannot be exported to stock DeepSeek-V3",
        NO_GRAFT,
    ),
    # -- convert --to ced: checked on the config the MLA step will produce, before it runs
    (["convert", "{tiny}", "--out", "{outs}/m", "--to", "ced", "--kv-source-layers", "9"], "kv_source_layers (9,)", NO_GRAFT),
    (["convert", "{tiny}", "--out", "{outs}/m", "--to", "ced", "--sliding-window", "0"], "sliding_window (0)", NO_GRAFT),
    (["convert", "{tiny}", "--out", "{outs}/m", "--to", "ced", "--compress-rate", "0"], "compress_rate (0)", NO_GRAFT),
    (
        ["convert", "{tiny}", "--out", "{outs}/m", "--to", "ced", "--sliding-window", "2", "--compress-rate", "4"],
        "sliding_window (2) must be >= compress_rate (4)",
        NO_GRAFT,
    ),
    (["convert", "{tiny}", "--out", "{outs}/m", "--to", "ced", "--format", "both"], "kvgraft's format only", NO_GRAFT),
    # -- convert: calibration
    (["convert", "{tiny}", "--out", "{outs}/m", "--calibration-tokens", "0"], "calibration_tokens (0)", NO_GRAFT),
    (
        ["convert", "{tiny}", "--out", "{outs}/m", "--calibration-tokens", "10"],
        "calibration_tokens (10) must be at least one calibration sequence (64 tokens)",
        NO_GRAFT,
    ),
    (["convert", "{tiny}", "--out", "{outs}/m", "--calibration", "{missing}"], "does not exist", NO_GRAFT),
    (["convert", "{tiny}", "--out", "{outs}/m", "--calibration", "{calib_bad}"], "outside the model's vocabulary", NO_GRAFT),
    (["convert", "{bare}", "--out", "{outs}/m"], "has no tokenizer to tokenize", NO_GRAFT),
    # -- convert: devices, outputs, weights, stock export
    (["convert", "{tiny}", "--out", "{outs}/m", "--device", "cuda"], "no CUDA GPU", NO_GRAFT),
    (["convert", "{tiny}", "--out", "{outs}/m", "--device", "banana"], "'banana' is not a device name", NO_GRAFT),
    (["convert", "{tiny}", "--out", "{file}/m"], "is a file, not a directory", NO_GRAFT),
    (["convert", "{tiny}", "--out", "/proc/kvgraft-test/m"], "cannot write output directory", NO_GRAFT),
    (["convert", "{tiny}", "--out", "{tiny}"], "already exists", NO_GRAFT),
    (
        ["convert", "{nan}", "--out", "{outs}/m"],
        "tensor model.layers.0.self_attn.k_proj.weight (32, 64) holds 1 NaN",
        ("kvgraft.graft.convert.graft_mla",),
    ),
    (
        ["convert", "{inf}", "--out", "{outs}/m"],
        "tensor model.norm.weight (64,) holds 0 NaN and 2 Inf",
        ("kvgraft.graft.convert.graft_mla",),
    ),
    (["convert", "/nonexistent/model", "--out", "{outs}/m"], "/nonexistent/model", NO_GRAFT),
    # -- doctor
    (["doctor", "{tiny}", "--kv-lora-rank", "0"], "kv_lora_rank (0)", ()),
    (["doctor", "{tiny}", "--compression", "0"], "compression (0.0)", ()),
    (["doctor", "{tiny}", "--rope-dim", "0"], "qk_rope_head_dim (0)", ()),
    (["doctor", "{tiny}", "--json", "/proc/kvgraft-test/r.json"], "cannot write --json file", ()),
    (["doctor", "{tiny}", "--json", "{file}/r.json"], "is a file, not a directory", ()),
    # -- generate (values are checked before the model loads)
    (["generate", "--prompt", BAD_UTF8], "--prompt is not valid UTF-8 text (bytes b'\\xe9'", NO_LOAD),
    (["generate", "--prompt", "hi", "--stop", BAD_UTF8], "--stop is not valid UTF-8", NO_LOAD),
    (["generate", "--prompt", "hi", "--max-new-tokens", "0"], "--max-new-tokens (0)", NO_LOAD),
    (["generate", "--prompt", "hi", "--max-new-tokens", "1000000000"], "exceeds the model's max_position_embeddings", NO_LOAD),
    (["generate", "--prompt", "hi", "--temperature", "-1"], "temperature", NO_LOAD),
    # -- eval: every value first, even on a model without a held-out slice
    (["eval", "{bare}", "--max-tokens", "0"], "max_tokens (0)", NO_LOAD),
    (["eval", "{bare}", "--seq-len", "0"], "seq_len (0)", NO_LOAD),
    (["eval", "{bare}", "--contexts", "0"], "contexts entry (0)", NO_LOAD),
    (["eval", "{bare}", "--batch-sizes", "0"], "batch_sizes entry (0)", NO_LOAD),
    (["eval", "{bare}", "--new-tokens", "0"], "new_tokens (0)", NO_LOAD),
    (["eval", "{bare}", "--seq-len", "32", "--max-tokens", "8"], "max_tokens (8) must be >= seq_len (32)", NO_LOAD),
    (["eval", "{tiny}", "--json", "/proc/kvgraft-test/e.json"], "cannot write --json file", NO_LOAD),
    (["eval", "{tiny}", "--json", "{file}/e.json"], "is a file, not a directory", NO_LOAD),
    (["eval", "{bare}"], "no evaluation tokens", NO_LOAD),
    (["eval", "--text", "{latin1}"], "is not UTF-8 text (byte b'\\xe9' at offset 3", NO_LOAD),
    # -- pretrain: the data's vocabulary against the model's, before training
    (
        ["pretrain", "--model", "llama-tiny", "--data", "{bigvocab}", "--out", "{outs}/r", "--max-steps", "2"],
        "uses a 1024-token vocabulary",
        NO_TRAIN,
    ),
    (
        ["pretrain", "--model", "llama-tiny", "--data", "{bigids}", "--out", "{outs}/r", "--max-steps", "2"],
        "holds token id 1023, outside the vocabulary of model preset 'llama-tiny' (vocab_size 512)",
        NO_TRAIN,
    ),
    (["pretrain", "--model", "llama-tiny", "--data", "{data}", "--out", "{outs}/r", "--seq-len", "0"], "seq_len (0)", NO_TRAIN),
    (
        ["pretrain", "--model", "llama-tiny", "--data", "{data}", "--out", "{outs}/r", "--seq-len", "100000"],
        "seq_len (100000) exceeds max_position_embeddings (128)",
        NO_TRAIN,
    ),
    (
        ["pretrain", "--model", "llama-tiny", "--data", "{data}", "--out", "{outs}/r", "--max-steps", "0"],
        "max_steps (0)",
        NO_TRAIN,
    ),
    (
        ["pretrain", "--model", "llama-tiny", "--data", "{data}", "--out", "/proc/kvgraft-test/r"],
        "cannot write run directory",
        NO_TRAIN,
    ),
    (["pretrain", "--model", "llama-tiny", "--data", "{outs}/none", "--out", "{outs}/r"], "is missing", NO_TRAIN),
    # -- prepare-data: nothing left behind
    (
        ["prepare-data", "--out", "{outs}/d", "--sources", "--files", "{doc}", "--vocab-size", "100"],
        "vocab_size=100 is too small",
        NO_CORPUS,
    ),
    (
        ["prepare-data", "--out", "/proc/kvgraft-test/d", "--sources", "--files", "{doc}"],
        "cannot write output directory",
        NO_CORPUS,
    ),
    (["prepare-data", "--out", "{outs}/d", "--sources", "--files", "{missing}"], "{missing}", ()),
    # -- heal
    (["heal", "{tiny}", "--out", "{outs}/h", "--data", "{data}", "--tokens", "0"], "tokens (0)", NO_LOAD),
    (["heal", "{tiny}", "--out", "{outs}/h", "--data", "{data}", "--fraction", "0"], "fraction_of_pretraining (0.0)", NO_LOAD),
    (["heal", "{tiny}", "--out", "{outs}/h", "--data", "{data}", "--copy-fraction", "1.5"], "copy_fraction (1.5)", NO_LOAD),
    (
        ["heal", "{tiny}", "--out", "{outs}/h", "--data", "{data}", "--copy-span", "64"],
        "copy_span (64) needs a copy_fraction",
        NO_LOAD,
    ),
    (
        [
            "heal",
            "{tiny}",
            "--out",
            "{outs}/h",
            "--data",
            "{data}",
            "--copy-fraction",
            "0.5",
            "--copy-span",
            "64",
            "--seq-len",
            "64",
        ],
        "copy_span (64) must be at most half the sequence length",
        NO_LOAD,
    ),
    # -- demo
    (["demo", "--out", "/proc/kvgraft-test/demo"], "cannot write demo output", NO_LOAD),
]


def _tiny(path: Path, *, eval_slices: bool = True, poison: dict | None = None, model_type: str | None = None, **config) -> Path:
    from kvgraft.hf import save_pretrained
    from kvgraft.model import ModelConfig, Transformer

    cfg = ModelConfig(
        **{
            **dict(
                vocab_size=96,
                hidden_size=64,
                intermediate_size=96,
                num_layers=2,
                num_heads=4,
                num_kv_heads=2,
                head_dim=16,
                max_position_embeddings=64,
                tie_word_embeddings=True,
            ),
            **config,
        }
    )
    model = Transformer(cfg)
    model.init_weights(0)
    with torch.no_grad():
        for name, values in (poison or {}).items():
            flat = dict(model.named_parameters())[name].view(-1)
            flat[: len(values)] = torch.tensor(values)
    save_pretrained(model, path, **({"model_type": model_type} if model_type else {}))
    if eval_slices:
        (path / "eval").mkdir()
        rng = np.random.default_rng(0)
        np.save(path / "eval" / "calibration.npy", rng.integers(0, 96, 4096).astype(np.uint16))
        np.save(path / "eval" / "heldout.npy", rng.integers(0, 96, 1024).astype(np.uint16))
    return path


def _data(root: Path, vocab: int, max_id: int) -> Path:
    from kvgraft.data.tokenizer import train_tokenizer

    rng = np.random.default_rng(0)
    text = root.with_suffix(".txt")
    letters = np.array(list("abcdefghijklmnopqrstuvwxyz"))
    words = ["".join(rng.choice(letters, 3)) for _ in range(20_000)]
    text.write_text(" ".join(words) + "\n", encoding="utf-8")
    train_tokenizer(text, vocab, out_dir=root / "tokenizer")
    (root / "tokens").mkdir()
    for split, n in (("train", 20_000), ("validation", 2_000)):
        ids = rng.integers(0, max_id + 1, n).astype(np.uint16)
        ids[0] = max_id
        np.save(root / "tokens" / f"{split}.npy", ids)
    return root


@pytest.fixture(scope="module")
def fixtures(tmp_path_factory) -> dict[str, str]:
    root = tmp_path_factory.mktemp("bad-inputs")
    (root / "file").write_text("a regular file where a directory is needed\n")
    (root / "doc.txt").write_text("one small document\n")
    (root / "latin1.txt").write_bytes("caf\xe9 au lait\n".encode("latin-1"))
    np.save(root / "calib_bad.npy", np.full(4096, 500, dtype=np.uint16))
    f = {
        "tiny": _tiny(root / "tiny"),
        "bare": _tiny(root / "bare", eval_slices=False),
        "nan": _tiny(root / "nan", poison={"layers.0.self_attn.k_proj.weight": [float("nan")]}),
        "inf": _tiny(root / "inf", poison={"norm.weight": [float("inf"), -float("inf")]}),
        "mistral": _tiny(root / "mistral", model_type="mistral", sliding_window=16),
        "data": _data(root / "data", 300, 299),
        "bigvocab": _data(root / "bigvocab", 1024, 1023),
        "bigids": _data(root / "bigids", 300, 1023),
        "file": root / "file",
        "doc": root / "doc.txt",
        "latin1": root / "latin1.txt",
        "calib_bad": root / "calib_bad.npy",
        "missing": root / "missing.txt",
    }
    return {k: str(v) for k, v in f.items()}


def _tripwire(target: str, monkeypatch) -> None:
    """Replace the function ``target`` by one that fails, under every name any kvgraft module holds it by (so
    the trip does not depend on how the caller imported it). Every command module is imported first."""
    module, _, attr = target.rpartition(".")
    real = getattr(importlib.import_module(module), attr)

    def heavy(*args, **kwargs):
        raise AssertionError(f"heavy work ran before the bad input was answered: {target}")

    for info in pkgutil.iter_modules(kvgraft.cli.cmd.__path__):
        importlib.import_module(f"kvgraft.cli.cmd.{info.name}")
    patched = 0
    for name, mod in list(sys.modules.items()):
        if name.startswith("kvgraft") and mod is not None:
            for key, value in list(vars(mod).items()):
                if value is real:
                    monkeypatch.setattr(mod, key, heavy)
                    patched += 1
    assert patched, target


def _ids(case) -> str:
    argv = case[0]
    return re.sub(r"[{}]", "", " ".join(argv[:1] + argv[2:]))[:60].encode("ascii", "replace").decode()


@pytest.mark.parametrize("argv, expected, heavy", CASES, ids=[_ids(c) for c in CASES])
def test_bad_input_is_one_line_exit_2_before_any_work(argv, expected, heavy, fixtures, tmp_path, monkeypatch, capsys):
    outs = tmp_path / "outs"
    outs.mkdir()
    values = {**fixtures, "outs": str(outs)}
    argv = [a.format(**values) if "{" in a else a for a in argv]
    expected = expected.format(**values) if "{" in expected else expected
    for target in heavy:
        _tripwire(target, monkeypatch)
    assert main(argv) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("kvgraft: error: "), err
    assert expected in err[0], err[0]
    assert list(outs.iterdir()) == [], list(outs.iterdir())  # nothing created, nothing left behind
    assert not Path("/proc/kvgraft-test").exists()


def test_read_only_file_system_is_one_line(fixtures, tmp_path, monkeypatch, capsys):
    """A real read-only mount needs privileges tests should not use: the probe's OSError stands in for it."""
    import kvgraft.checks

    def read_only(*args, **kwargs):
        raise OSError(errno.EROFS, "Read-only file system")

    monkeypatch.setattr(kvgraft.checks.tempfile, "mkdtemp", read_only)
    _tripwire("kvgraft.hf.load_pretrained", monkeypatch)
    for argv, what in (
        (["convert", fixtures["tiny"], "--out", str(tmp_path / "m")], "output directory"),
        (["doctor", fixtures["tiny"], "--json", str(tmp_path / "r.json")], "--json file"),
    ):
        assert main(argv) == 2
        err = capsys.readouterr().err.strip().splitlines()
        assert err == [f"kvgraft: error: cannot write {what} {argv[-1]}: Read-only file system ({tmp_path})"]
    assert list(tmp_path.iterdir()) == []


def test_prepare_data_failure_after_the_corpus_leaves_nothing(fixtures, tmp_path, monkeypatch, capsys):
    """One document leaves the validation split empty: found while the corpus is written, so OUT/corpus/
    exists by then; it must not be left behind."""
    import kvgraft.data.prepare as prepare

    seen = []
    original = prepare.build_corpus

    def build(out_dir, *args, **kwargs):
        try:
            return original(out_dir, *args, **kwargs)
        finally:
            seen.append(Path(out_dir).is_dir())

    monkeypatch.setattr(prepare, "build_corpus", build)
    out = tmp_path / "d"
    assert main(["prepare-data", "--out", str(out), "--sources", "--files", fixtures["doc"]]) == 2
    assert "ended up empty" in capsys.readouterr().err
    assert seen == [True] and not out.exists()
    existing = tmp_path / "kept"
    (existing / "notes").mkdir(parents=True)
    assert main(["prepare-data", "--out", str(existing), "--sources", "--files", fixtures["doc"]]) == 2
    assert sorted(p.name for p in existing.iterdir()) == ["notes"]  # only what this call created is removed


def test_every_case_names_its_value_once():
    assert len({json.dumps(c[:2]) for c in CASES}) == len(CASES)


@pytest.mark.parametrize(
    "argv",
    [
        ["generate", "--prompt", "hi", "--max-new-tokens", "1"],
        ["eval", "--new-tokens", "2", "--contexts", "8", "--batch-sizes", "1"],
    ],
)
def test_the_tripwires_trip_on_good_input(argv, monkeypatch):
    """The check above means something only if a tripwire fires when the command does reach the heavy step."""
    _tripwire("kvgraft.hf.load_pretrained", monkeypatch)
    with pytest.raises(AssertionError, match="heavy work ran"):
        main(argv)
