"""The kvgraft command: subcommands exist, bad input exits 2 with one line, convert writes atomically."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch
import transformers

from kvgraft.cli import main
from kvgraft.hf import load_pretrained, save_pretrained
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
    np.save(path / "eval" / "heldout.npy", rng.integers(0, 96, 1024).astype(np.uint16))
    return path


def test_help_lists_every_subcommand(capsys):
    with pytest.raises(SystemExit) as exc:
        main(["--help"])
    assert exc.value.code == 0
    out = capsys.readouterr().out
    for name in ("prepare-data", "pretrain", "eval", "generate", "doctor", "convert", "demo", "ship"):
        assert name in out


@pytest.mark.parametrize(
    "argv",
    [
        ["eval", "/nonexistent/model"],
        ["doctor", "/nonexistent/model"],
        ["convert", "/nonexistent/model", "--out", "/tmp/kvgraft-never-written"],
        ["generate", "/nonexistent/model", "--prompt", "hi"],
    ],
)
def test_missing_model_is_one_line_exit_2(argv, capsys):
    assert main(argv) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("kvgraft: error:") and "/nonexistent/model" in err[0]


def test_corrupt_safetensors_is_exit_2(tiny_dir, capsys):
    weights = tiny_dir / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[:100])
    assert main(["eval", str(tiny_dir), "--contexts", "8", "--batch-sizes", "1"]) == 2
    assert "model.safetensors" in capsys.readouterr().err


def test_convert_writes_a_loadable_model_and_refuses_to_overwrite(tiny_dir, tmp_path, capsys):
    out = tmp_path / "mla"
    argv = [
        "convert",
        str(tiny_dir),
        "--out",
        str(out),
        "--kv-lora-rank",
        "16",
        "--rope-dim",
        "16",
        "--calibration-tokens",
        "1024",
    ]
    assert main(argv) == 0
    record = json.loads((out / "conversion.json").read_text())
    assert record["kv_bytes_per_token_bf16"] == {"original": 2 * 2 * 2 * 16 * 2, "converted": 2 * (16 + 16) * 2}
    model = load_pretrained(out)
    assert model.config.attention_kinds == ("mla", "mla")
    assert (out / "eval" / "heldout.npy").exists()
    capsys.readouterr()
    assert main(argv) == 2
    assert "already exists" in capsys.readouterr().err


def test_interrupted_convert_leaves_no_directory(tiny_dir, tmp_path, monkeypatch):
    import kvgraft.hf.save as save
    import kvgraft.hf.shards as shards

    def boom(*a, **k):
        raise KeyboardInterrupt

    monkeypatch.setattr(save, "save_file", boom)
    monkeypatch.setattr(shards, "write_safetensors", boom)  # the layer-by-layer executor writes through ShardWriter
    out = tmp_path / "mla"
    with pytest.raises(KeyboardInterrupt):
        main(
            [
                "convert",
                str(tiny_dir),
                "--out",
                str(out),
                "--kv-lora-rank",
                "16",
                "--rope-dim",
                "16",
                "--calibration-tokens",
                "1024",
            ]
        )
    assert not out.exists()
    # what is left is the staging directory with its finished layers, for --resume (kvgraft.graft.resume)
    assert [p.name for p in tmp_path.iterdir() if p.name.startswith(".mla")] == [".mla.partial"]
    assert (tmp_path / ".mla.partial" / "state.json").is_file()


def test_convert_bad_rank_names_the_value(tiny_dir, tmp_path, capsys):
    assert main(["convert", str(tiny_dir), "--out", str(tmp_path / "x"), "--kv-lora-rank", "1000"]) == 2
    assert "kv_lora_rank (1000)" in capsys.readouterr().err
    assert not (tmp_path / "x").exists()


def test_generate_is_reproducible_with_a_seed(tiny_dir, capsys):
    from kvgraft.runtime import generate

    model = load_pretrained(tiny_dir)
    ids = torch.tensor([[1, 2, 3]])
    a = generate(model, ids, 8, temperature=1.0, top_p=0.9, seed=3)
    b = generate(model, ids, 8, temperature=1.0, top_p=0.9, seed=3)
    assert torch.equal(a, b)
    greedy = generate(model, ids, 8)
    with torch.no_grad():  # greedy decode equals argmax of full forwards, step by step
        seq = ids
        for _ in range(8):
            seq = torch.cat([seq, model(seq)[:, -1:].argmax(-1)], dim=1)
    assert torch.equal(greedy, seq)


def test_convert_heal_checklist_and_compare_end_to_end(tiny_dir, tmp_path, capsys):
    """convert -> heal -> doctor --after -> eval --compare, all through the CLI, on a tiny model."""
    mla = tmp_path / "mla"
    assert (
        main(
            [
                "convert",
                str(tiny_dir),
                "--out",
                str(mla),
                "--kv-lora-rank",
                "16",
                "--rope-dim",
                "16",
                "--calibration-tokens",
                "1024",
                "--rope-selection",
                "stride",
            ]
        )
        == 0
    )  # stock-exportable
    data = tmp_path / "data" / "tokens"
    data.mkdir(parents=True)
    stream = (np.arange(8000) * 5 % 91).astype(np.uint16)
    np.save(data / "train.npy", stream)
    np.save(data / "validation.npy", stream[:1000])
    healed = tmp_path / "healed"
    assert (
        main(
            [
                "heal",
                str(mla),
                "--out",
                str(healed),
                "--data",
                str(tmp_path / "data"),
                "--teacher",
                str(tiny_dir),
                "--loss",
                "mix",
                "--original-lr",
                "1e-2",
                "--pretraining-tokens",
                "10000",
                "--tokens",
                "2048",
                "--seq-len",
                "32",
                "--micro-batch-size",
                "2",
                "--precision",
                "fp32",
                "--no-progress",
                "--eval-every",
                "0",
                "--format",
                "both",
            ]
        )
        == 0
    )
    assert "Healed MLA graft" in (healed / "final" / "README.md").read_text()
    stock = transformers.AutoModelForCausalLM.from_pretrained(healed / "final" / "deepseek_v3")
    assert type(stock).__name__ == "DeepseekV3ForCausalLM"
    record = json.loads((healed / "final" / "heal.json").read_text())
    assert record["train_config"]["lr"] == pytest.approx(1e-3)  # 1/10 of the original's
    assert record["train_config"]["max_steps"] == 32  # 2048 tokens / (2 x 32): --seq-len 32, not the context of 64
    assert record["fraction_of_pretraining"] == pytest.approx(2048 / 10000)
    capsys.readouterr()
    assert main(["doctor", "--after", str(healed / "final"), "--original", str(tiny_dir)]) == 0
    out = capsys.readouterr().out
    for name in ("RoPE injection", "initialisation", "mixed precision", "healing budget", "up-projection", "KV cache allocation"):
        assert name in out
    assert "[PASS] RoPE injection" in out and "[PASS] KV cache allocation" in out
    assert "[PASS] healing budget" in out and "[PASS] mixed precision" in out
    report = tmp_path / "report"
    assert (
        main(
            [
                "eval",
                "--compare",
                str(tiny_dir),
                str(mla),
                str(healed / "final"),
                "--contexts",
                "16",
                "--batch-sizes",
                "1",
                "--new-tokens",
                "6",
                "--out",
                str(report),
            ]
        )
        == 0
    )
    for name in ("compare.md", "compare.json", "compare.png", "decode.png"):
        assert (report / name).stat().st_size > 0
    assert len(json.loads((report / "compare.json").read_text())) == 3


def test_generate_streams_through_the_engine_and_stops_at_a_string(capsys):
    assert main(["generate", "--prompt", "In the beginning", "--max-new-tokens", "12", "--temperature", "0"]) == 0
    full = capsys.readouterr().out.rstrip("\n")
    assert full.startswith("In the beginning") and len(full) > len("In the beginning")
    word = full[len("In the beginning") :].split()[2]
    assert main(["generate", "--prompt", "In the beginning", "--max-new-tokens", "12", "--temperature", "0", "--stop", word]) == 0
    stopped = capsys.readouterr().out.rstrip("\n")
    assert full.startswith(stopped) and word not in stopped[len("In the beginning") :]
    # checked before the model loads; a huge --max-new-tokens is refused, not allocated
    for flags, message in (
        (["--top-p", "0"], "top_p (0.0)"),
        (["--max-new-tokens", "0"], "--max-new-tokens (0)"),
        (["--max-new-tokens", "1000000000"], "max_position_embeddings (512)"),
    ):
        assert main(["generate", "--prompt", "x", *flags]) == 2
        assert message in capsys.readouterr().err


def test_doctor_exits_3_on_a_blocker_and_writes_the_same_json(tiny_dir, tmp_path, capsys):
    """A blocked conversion is visible to scripts (exit 3, documented in --help), distinct from bad input (2);
    the report and its --json are written exactly as before."""
    from kvgraft.cli import EXIT_BLOCKED
    from kvgraft.graft.doctor import doctor

    assert EXIT_BLOCKED == 3
    out = tmp_path / "report.json"
    assert main(["doctor", str(tiny_dir), "--rope-dim", "7", "--json", str(out)]) == 3
    assert "BLOCKER: [invalid_ranks]" in capsys.readouterr().out
    assert json.loads(out.read_text()) == json.loads(json.dumps(doctor(tiny_dir, qk_rope_head_dim=7).to_dict()))
    assert main(["doctor", str(tiny_dir)]) == 0  # nothing blocks
    assert "BLOCKER" not in capsys.readouterr().out
    with pytest.raises(SystemExit):
        main(["doctor", "--help"])
    assert "3 when the report lists a blocker" in " ".join(capsys.readouterr().out.split())
