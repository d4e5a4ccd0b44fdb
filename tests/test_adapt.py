"""The adapt recipe and its commands end to end on the shipped encoder-decoder (a few steps): PEFT files,
the certificate in the metadata, a resumable run, the study table, the probe table, and clean errors."""

from __future__ import annotations

import json

import pytest

from kvgraft.cli import main
from kvgraft.train.adapt import AdaptConfig, adapt

FAST = dict(steps=4, micro_batch_size=4, warmup_steps=1, val_examples=8, test_examples=8, accuracy_examples=4, progress=False)


def test_adapt_writes_a_peft_adapter_with_its_certificate_and_reads_a_finished_run_back(tmp_path):
    """With defaults, on the causal encoder-decoder, the adapter shares the base's cache (decoder half, the
    pivot's KV writers frozen: issue 23); an explicit placement that cannot share is said so before training."""
    r = adapt("kvgraft-ced-8m", "geometry", tmp_path / "run", AdaptConfig(**FAST))  # the default placement
    adapter = tmp_path / "run" / "adapter"
    assert {p.name for p in adapter.iterdir()} >= {"adapter_config.json", "adapter_model.safetensors", "kvgraft_adapter.json"}
    meta = json.loads((adapter / "kvgraft_adapter.json").read_text())
    assert meta["certificate"]["shares_cache"] and meta["placement"]["freeze_kv_writers"]
    assert meta["placement"]["layers"] == "decoder-half"
    assert r["sharing"]["shares_cache"] and r["sharing"]["verdict"].startswith("shares the cache: yes: ")
    assert r["protocol_steps"] == [2, 3, 4] and r["val_loss_protocol"] > 0 and 0 <= r["test_accuracy"] <= 1
    assert not (tmp_path / "run" / "checkpoints").exists()  # the resume state is dropped once finished
    again = AdaptConfig(preset="decoder-half-r16", freeze_kv_writers=True, **FAST)  # the default, spelled out
    assert adapt("kvgraft-ced-8m", "geometry", tmp_path / "run", again) == r  # a finished run is read back
    notes = []
    with pytest.raises(ValueError, match="another configuration"):  # the writers adapted: another run
        adapt("kvgraft-ced-8m", "geometry", tmp_path / "run", AdaptConfig(preset="decoder-half-r16", **FAST), log=notes.append)
    assert len(notes) == 1 and "will not share kvgraft-ced-8m's cache" in notes[0]
    assert "layers.4.self_attn.compressor.kv_a_proj" in notes[0] and "--freeze-kv-writers" in notes[0]


def test_the_default_placement_depends_on_the_base_and_explicit_ones_stay_as_given():
    from kvgraft.hf import load_config
    from kvgraft.reference import resolve_model

    ced, llama = (load_config(resolve_model(n)) for n in ("kvgraft-ced-8m", "kvgraft-llama-8m"))
    assert AdaptConfig().for_base(ced).resolved_placement().freeze_kv_writers
    assert (
        AdaptConfig().for_base(ced).to_dict()
        == AdaptConfig(preset="decoder-half-r16", freeze_kv_writers=True).for_base(ced).to_dict()
    )
    assert not AdaptConfig().for_base(llama).resolved_placement().freeze_kv_writers  # the Llama default as before
    assert not AdaptConfig(freeze_kv_writers=False).for_base(ced).resolved_placement().freeze_kv_writers
    # the placement study's explicit configurations (experiment.py) are trained as given, with the same record
    explicit = AdaptConfig(preset="decoder-half-r16").for_base(ced)
    assert not explicit.resolved_placement().freeze_kv_writers
    d = explicit.to_dict()
    assert d["preset"] == "decoder-half-r16" and d["freeze_kv_writers"] is False and "require_sharing" not in d


@pytest.mark.slow  # a subprocess killed and restarted (or torchrun): make test-slow, run by CI
def test_adapt_resumes_an_interrupted_run_to_the_same_adapter(tmp_path):
    whole = adapt("kvgraft-ced-8m", "geometry", tmp_path / "whole", AdaptConfig(**FAST))
    cfg = AdaptConfig(**FAST)
    part = adapt(
        "kvgraft-ced-8m", "geometry", tmp_path / "part", AdaptConfig(**{**FAST, "max_time_s": 0.0})
    )  # stops (with a checkpoint) after one step
    assert part == {"stopped_early": True, "step": 1}
    assert (tmp_path / "part" / "checkpoints").is_dir()
    resumed = adapt("kvgraft-ced-8m", "geometry", tmp_path / "part", cfg)
    assert resumed["val_loss"] == whole["val_loss"] and resumed["test_loss"] == whole["test_loss"]


def test_cli_dry_run_and_errors(tmp_path, capsys):
    assert (
        main(
            [
                "adapt",
                "kvgraft-ced-8m",
                "--task",
                "geometry",
                "--out",
                str(tmp_path / "x"),
                "--preset",
                "decoder-half-r16",
                "--freeze-kv-writers",
                "--dry-run",
            ]
        )
        == 0
    )
    out = capsys.readouterr().out
    assert "model.layers.7.mlp.down_proj" in out and "model.layers.4.self_attn.compressor" not in out
    assert "shares the cache: yes" in out and not (tmp_path / "x").exists()
    assert main(["adapt", "kvgraft-ced-8m", "--task", "geometry", "--out", str(tmp_path / "x"), "--dry-run"]) == 0
    assert capsys.readouterr().out == out  # the default is that placement
    assert (
        main(
            [
                "adapt",
                "kvgraft-ced-8m",
                "--task",
                "geometry",
                "--out",
                str(tmp_path / "x"),
                "--preset",
                "encoder-half-r16",
                "--dry-run",
            ]
        )
        == 0
    )
    assert "shares the cache: no: it adapts layers 0-3, before the pivot (layer 4)" in capsys.readouterr().out
    # sharing asked for explicitly: refused before any work
    assert (
        main(
            [
                "adapt",
                "kvgraft-ced-8m",
                "--task",
                "geometry",
                "--out",
                str(tmp_path / "x"),
                "--preset",
                "decoder-half-r16",
                "--share-cache",
            ]
        )
        == 2
    )
    err = capsys.readouterr().err
    assert "cannot share it: it adapts the pivot's KV writers" in err and not (tmp_path / "x").exists()
    assert main(["adapt", "kvgraft-llama-8m", "--task", "geometry", "--out", str(tmp_path / "x"), "--dry-run"]) == 0
    assert "shares the cache: does not apply: kvgraft-llama-8m has no shared cache" in capsys.readouterr().out
    assert main(["adapt", "kvgraft-llama-8m", "--task", "geometry", "--out", str(tmp_path / "x"), "--share-cache"]) == 2
    assert "does not apply" in capsys.readouterr().err and not (tmp_path / "x").exists()
    assert (
        main(
            [
                "adapt",
                "kvgraft-ced-8m",
                "--task",
                "geometry",
                "--out",
                str(tmp_path / "x"),
                "--layers",
                "9",
                "--rank",
                "4",
                "--dry-run",
            ]
        )
        == 2
    )
    assert "layers [9] do not exist" in capsys.readouterr().err
    assert main(["adapt", "--task", "nope", "--out", str(tmp_path / "y"), "--preset", "huge"]) == 2
    assert "unknown adapter preset 'huge'" in capsys.readouterr().err


def test_cli_run_ends_with_the_sharing_verdict(tmp_path, capsys):
    assert (
        main(
            [
                "adapt",
                "kvgraft-ced-8m",
                "--task",
                "geometry",
                "--out",
                str(tmp_path / "run"),
                "--steps",
                "2",
                "--micro-batch-size",
                "4",
                "--accuracy-examples",
                "0",
                "--val-examples",
                "4",
                "--test-examples",
                "4",
            ]
        )
        == 0
    )
    lines = capsys.readouterr().out.strip().splitlines()
    assert json.loads(lines[-2])["adapter"] == str(tmp_path / "run" / "adapter")
    assert lines[-1].startswith("sharing certificate: shares the cache: yes: every shared segment is the base")
    assert not [line for line in lines if line.startswith("note:")]  # nothing to say before training


@pytest.mark.slow
def test_study_table_and_probe_table(tmp_path):
    from kvgraft.train.experiment import StudyOptions, placement_study

    study = placement_study(
        "kvgraft-ced-8m",
        "geometry",
        tmp_path / "study",
        StudyOptions(
            seeds=2,
            steps=10,
            configs=("encoder-half-r16", "decoder-half-r16"),
            lr=2e-3,
            micro_batch_size=4,
            accuracy_examples=2,
            progress=False,
            val_examples=8,
            test_examples=8,
        ),
    )
    assert len(study["decoder_minus_encoder_per_seed"]) == 2
    text = (tmp_path / "study" / "study.md").read_text()
    assert "| decoder-half-r16 |" in text and (tmp_path / "study" / "curves.png").stat().st_size > 1000
    adapter = tmp_path / "study" / "runs" / "decoder-half-r16" / "seed0" / "adapter"
    assert (
        main(
            [
                "probe",
                str(adapter),
                "--task",
                "geometry",
                "--steps",
                "2",
                "--micro-batch-size",
                "4",
                "--val-examples",
                "8",
                "--out",
                str(tmp_path / "probe"),
            ]
        )
        == 0
    )
    table = (tmp_path / "probe" / "probe.md").read_text()
    assert "| o_proj |" in table and "| mlp.down_proj |" in table
    rows = json.loads((tmp_path / "probe" / "probe.json").read_text())["rows"]
    assert sum(r["param_share"] for r in rows) == pytest.approx(1.0)
    assert sum(r["grad_energy_share"] for r in rows) == pytest.approx(1.0)
