"""``convert`` as plan + execute: one declaration of the options (convert(), the plan, the CLI), a plan built
from config.json alone, validated and serialisable, and ``execute(plan)`` writing what ``convert`` writes."""

from __future__ import annotations

import dataclasses
import inspect
import json

import numpy as np
import pytest

from kvgraft.cli import build_parser
from kvgraft.graft.convert import convert, execute
from kvgraft.graft.options import ConvertOptions, cli_options, options_from_cli
from kvgraft.graft.plan import ConvertPlan, plan_conversion


@pytest.fixture()
def tiny_dir(tmp_path):
    from kvgraft.hf import save_pretrained
    from kvgraft.model import ModelConfig, Transformer

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
    np.save(path / "eval" / "calibration.npy", np.random.default_rng(0).integers(0, 96, 4096).astype(np.uint16))
    return path


def test_convert_and_the_plan_take_the_options_declaration():
    for entry in (convert, plan_conversion):
        params = inspect.signature(entry).parameters
        assert list(params) == ["model", "out", "options"]
        assert params["options"].annotation == "ConvertOptions | None" and params["options"].default is None


def test_cli_options_and_defaults_come_from_the_declaration(capsys):
    parser = build_parser()
    args = parser.parse_args(["convert", "m", "--out", "o"])
    assert options_from_cli(args) == {f.name: f.default for f, _ in cli_options()}
    with pytest.raises(SystemExit):
        parser.parse_args(["convert", "--help"])
    shown = capsys.readouterr().out
    assert all(cli.flag in shown for _, cli in cli_options())
    args = parser.parse_args(
        [
            "convert",
            "m",
            "--out",
            "o",
            "--rope-dim",
            "8",
            "--format",
            "both",
            "--layers",
            "0",
            "1",
            "--no-layerwise",
            "--overwrite",
        ]
    )
    got = options_from_cli(args)
    assert (got["qk_rope_head_dim"], got["output_format"], got["layers"], got["layerwise"], got["overwrite"]) == (
        8,
        "both",
        (0, 1),
        False,
        True,
    )


def test_options_refuse_what_no_model_can_take():
    with pytest.raises(ValueError, match="kvgraft's format only"):
        ConvertOptions(to="ced", output_format="both")
    with pytest.raises(TypeError):
        ConvertOptions(no_such_option=1)  # type: ignore[call-arg]


def test_plan_reads_no_weights_and_is_validated_and_serialisable(tiny_dir, tmp_path, monkeypatch):
    import kvgraft.hf as hf

    def tripwire(*a, **k):
        raise AssertionError("the plan loaded weights")

    monkeypatch.setattr(hf, "load_pretrained", tripwire)
    plan = plan_conversion(
        tiny_dir,
        tmp_path / "out",
        ConvertOptions(calibration_tokens=1024, output_format="both", calibration=tiny_dir / "eval" / "calibration.npy"),
    )  # a Path, as JSON a string
    assert isinstance(plan, ConvertPlan) and not (tmp_path / "out").exists()
    assert (plan.kv_lora_rank, plan.qk_rope_head_dim, plan.output_format) == (8, 8, "both")  # docs/ranks.md
    assert plan.mla is not None and plan.mla.rope_selection == "prefix" and plan.rank_notes
    assert plan.calibration is not None and plan.calibration.sequences == 16
    json.dumps(plan.to_dict())
    with pytest.raises(ValueError, match="ranks"):
        dataclasses.replace(plan, kv_lora_rank=plan.kv_lora_rank + 1)
    with pytest.raises(ValueError, match="share graft"):
        dataclasses.replace(
            plan,
            options=dataclasses.replace(plan.options, to="ced", output_format=None, rope_selection="auto"),
            output_format="kvgraft",
        )


def test_execute_writes_what_convert_writes(tiny_dir, tmp_path):
    options = dict(kv_lora_rank=16, qk_rope_head_dim=16, calibration_tokens=1024, progress=False)
    record = convert(tiny_dir, tmp_path / "a", ConvertOptions(**options)).to_dict()
    plan = plan_conversion(tiny_dir, tmp_path / "b", ConvertOptions(**options))
    again = execute(plan).to_dict()
    assert again["plan"] == plan.to_dict()
    strip = {"seconds", "convert_seconds_per_million_params", "plan"}
    assert {k: v for k, v in record.items() if k not in strip} == {k: v for k, v in again.items() if k not in strip}
    assert (tmp_path / "a" / "model.safetensors").read_bytes() == (tmp_path / "b" / "model.safetensors").read_bytes()
    written = json.loads((tmp_path / "b" / "conversion.json").read_text())
    assert written["plan"]["ranks"] == {"kv_lora_rank": 16, "qk_rope_head_dim": 16, "how": []}
