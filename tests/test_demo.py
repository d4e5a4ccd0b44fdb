"""`kvgraft demo` on a tiny model: the quick and the full setting, and arguments checked before any work."""

from __future__ import annotations

import json

import numpy as np
import pytest

from kvgraft.cli import main
from kvgraft.demo import QUICK, _spread_windows, demo
from kvgraft.hf import save_pretrained
from kvgraft.model import ModelConfig, Transformer


@pytest.fixture()
def tiny_dir(tmp_path):
    cfg = ModelConfig(
        vocab_size=96,
        hidden_size=64,
        intermediate_size=96,
        num_layers=2,
        num_heads=4,
        num_kv_heads=2,
        head_dim=16,
        max_position_embeddings=64,
        tie_word_embeddings=True,
    )
    model = Transformer(cfg)
    model.init_weights(0)
    path = save_pretrained(model, tmp_path / "tiny")
    (path / "eval").mkdir()
    rng = np.random.default_rng(0)
    np.save(path / "eval" / "calibration.npy", rng.integers(0, 96, 4096).astype(np.uint16))
    np.save(path / "eval" / "heldout.npy", rng.integers(0, 96, 4096).astype(np.uint16))
    return path


def test_spread_windows_cover_the_stream_and_keep_the_last_target():
    tokens = np.arange(128 * 512)
    out = _spread_windows(tokens, 32, 512)
    assert out.size == 32 * 512 + 1 and (out.size - 1) // 512 == 32
    assert out[0] == 0 and out[-1] == out[-2] + 1  # the token after the last chunk is its final target
    assert out[-2] > 120 * 512  # the last chunk comes from the end of the stream
    assert _spread_windows(np.arange(1000), 32, 512).size == 513  # fewer chunks than asked: all of them


@pytest.mark.parametrize("full", [False, True])
def test_demo_runs_the_setting_asked_for(tiny_dir, tmp_path, capsys, full):
    out = tmp_path / "demo"
    result = demo(str(tiny_dir), out_dir=out, full=full, compression=2.0)  # 4x leaves no latent here
    report = json.loads((out / "report.json").read_text())
    assert report["setting"]["name"] == ("full" if full else "quick") == result["setting"]["name"]
    scored = report["original"]["perplexity"]["tokens_scored"]
    assert scored == report["converted"]["perplexity"]["tokens_scored"]
    assert scored == ((4096 - 1) // 64 * 64 if full else QUICK.heldout_windows * 64)
    assert report["original"]["speed"]["new_tokens"] == (16 if full else QUICK.speed_new_tokens)
    lines = capsys.readouterr().out.strip().splitlines()
    assert lines[0].startswith(f"kvgraft demo, {'full' if full else 'quick'} setting")
    assert any(line.startswith(f"{'full' if full else 'quick'} setting") for line in lines[-3:])


@pytest.mark.parametrize(
    "kwargs, message",
    [
        ({"compression": 1.0}, "compression"),
        ({"compression": 64.0}, "leaves 1 cached values per layer"),
        ({"max_new_tokens": 0}, "max_new_tokens"),
    ],
)
def test_bad_arguments_fail_before_any_work(tiny_dir, tmp_path, kwargs, message):
    out = tmp_path / "demo"
    with pytest.raises(ValueError, match=message):
        demo(str(tiny_dir), out_dir=out, **kwargs)
    assert not out.exists()


def test_a_model_without_eval_slices_is_exit_2_before_any_work(tiny_dir, tmp_path, capsys):
    (tiny_dir / "eval" / "heldout.npy").unlink()
    out = tmp_path / "demo"
    assert main(["demo", "--model", str(tiny_dir), "--out", str(out)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "heldout.npy" in err[0]
    assert not out.exists()
