"""``kvgraft adapt`` and the placement study with the frozen-prefix cache (kvgraft.train.frozen_prefix) on the
shipped encoder-decoder: the same run with the cache and without it (losses, validation, adapter weights),
the cache on by default where the placement allows it, refused where asked for and impossible."""

from __future__ import annotations

import json

import pytest
from factories import BF16
from safetensors.torch import load_file

from kvgraft.cli import main
from kvgraft.cli.parser import build_parser
from kvgraft.data.tasks import write_task
from kvgraft.train.adapt import AdaptConfig, adapt
from kvgraft.train.experiment import CurveOptions, StudyOptions, placement_curve, placement_study
from kvgraft.train.frozen_prefix import DEFAULT_MAX_MB, shared_cache

# 3 epochs of a 16-example training split (micro-batches of 8, 6 steps), so later epochs read the cache
FAST = dict(steps=6, micro_batch_size=8, warmup_steps=1, val_examples=8, test_examples=8, accuracy_examples=0, progress=False)


@pytest.fixture(scope="module")
def small_task(tmp_path_factory):
    """Geometry with 16 training problems: 6 steps of 8 are 3 epochs, so epochs 2 and 3 read the cache."""
    return write_task("geometry", tmp_path_factory.mktemp("task") / "geometry", sizes={"train": 16, "validation": 8, "test": 8})


@pytest.mark.parametrize("precision", ["fp32", BF16])
def test_adapt_with_the_cache_is_the_same_run_as_without(tmp_path, small_task, precision):
    """Default placement on kvgraft-ced-8m (decoder half, the pivot's writers frozen: boundary 4), fp32 and
    bf16 autocast: every logged loss, every validation loss, the test loss and the adapter's weights equal,
    bit for bit (each cached row was computed in a batch of the same shape; no operation mixes rows)."""
    shared_cache(DEFAULT_MAX_MB << 20).clear()  # the process's cache: no entry from another test's runs
    runs = {}
    for mode in ("off", "auto"):
        cfg = AdaptConfig(**FAST, precision=precision, frozen_cache=mode)
        runs[mode] = adapt("kvgraft-ced-8m", small_task, tmp_path / f"{precision}-{mode}", cfg)
    off, on = runs["off"], runs["auto"]
    assert off["frozen_prefix"] is None
    fp = on["frozen_prefix"]
    # training: 16 rows computed in epoch 1, 32 read in epochs 2-3; validation (8 rows, 5 evaluations
    # at steps 1, 2, 3, 4, 6) computed once; the test loss is scored outside the cache
    assert fp["boundary"] == 4 and (fp["misses"], fp["hits"]) == (16 + 8, 32 + 4 * 8)
    assert fp["entries"] >= 24 and 0 < fp["bytes"] <= fp["max_bytes"]
    assert fp["max_bytes"] == DEFAULT_MAX_MB << 20
    assert on["train_curve"] == off["train_curve"] and len(set(loss for _, loss in on["train_curve"])) > 1
    assert on["val_loss"] == off["val_loss"] and on["test_loss"] == off["test_loss"]
    assert on["config"] == off["config"]  # the cache is no part of the run's configuration
    wa = load_file(tmp_path / f"{precision}-off" / "adapter" / "adapter_model.safetensors")
    wb = load_file(tmp_path / f"{precision}-auto" / "adapter" / "adapter_model.safetensors")
    assert wa.keys() == wb.keys() and all(wa[k].equal(wb[k]) for k in wa)


def test_the_cache_falls_back_with_a_note_or_is_refused_when_layer_0_trains(tmp_path, capsys):
    notes: list[str] = []
    r = adapt(
        "kvgraft-ced-8m",
        "geometry",
        tmp_path / "all",
        AdaptConfig(**{**FAST, "steps": 2}, preset="all-linear-r16"),
        log=notes.append,
    )
    assert r["frozen_prefix"] is None
    assert [n for n in notes if "frozen-prefix" in n] == [
        "note: no frozen-prefix cache (layer 0 has trainable parameters: no layer before the first trainable one "
        "to cache): every step runs the whole model"
    ]
    with pytest.raises(ValueError, match=r"frozen-prefix cache was required .* adapts layer 0 \(layers\.0\."):
        adapt(
            "kvgraft-ced-8m", "geometry", tmp_path / "on", AdaptConfig(preset="all-linear-r16", frozen_cache="on"), dry_run=True
        )
    argv = ["adapt", "kvgraft-ced-8m", "--task", "geometry", "--out", str(tmp_path / "cli")]
    assert main([*argv, "--preset", "encoder-half-r16", "--frozen-cache", "on"]) == 2
    assert "frozen-prefix cache was required" in capsys.readouterr().err and not (tmp_path / "cli").exists()
    assert main([*argv, "--frozen-cache-mb", "0"]) == 2
    assert "frozen_cache_mb (0) must be a positive integer (MiB)" in capsys.readouterr().err
    with pytest.raises(ValueError, match="frozen_cache 'yes' is not one of auto, on, off"):
        AdaptConfig(frozen_cache="yes")
    with pytest.raises(ValueError, match="frozen_cache 'sometimes'"):
        placement_curve("kvgraft-ced-8m", "geometry", tmp_path / "curve", CurveOptions(lr=1e-3, frozen_cache="sometimes"))
    for sub in (["adapt", "x", "--task", "t", "--out", "o"], ["experiment", "placement", "--task", "t", "--out", "o"]):
        args = build_parser().parse_args(sub)
        assert (args.frozen_cache, args.frozen_cache_mb) == ("auto", DEFAULT_MAX_MB)  # the parser's literal default


def test_cli_run_says_what_the_cache_did(tmp_path, capsys):
    argv = ["adapt", "kvgraft-ced-8m", "--task", "geometry", "--out", str(tmp_path / "run"), "--steps", "2"]
    argv += ["--micro-batch-size", "4", "--accuracy-examples", "0", "--val-examples", "4", "--test-examples", "4"]
    assert main(argv) == 0
    lines = capsys.readouterr().out.strip().splitlines()
    assert lines[-3].startswith("frozen-prefix cache: layers 0-3 run once per example (")
    assert json.loads(lines[-2])["steps"] == 2 and lines[-1].startswith("sharing certificate: ")


@pytest.mark.parametrize("precision", ["fp32", BF16])
def test_the_placement_study_with_the_cache_gives_the_same_table(tmp_path, small_task, precision):
    """The study (bf16 autocast is its default; fp32 too) with its runs through the cache and without: the same
    numbers; the cache used by the runs that leave layer 0 frozen, not by all-linear."""
    configs = ("decoder-half-r16+frozen-kv-writers", "all-linear-r16")
    kw = dict(seeds=1, steps=10, configs=configs, lr=2e-3, micro_batch_size=8, accuracy_examples=0, progress=False)
    kw["precision"] = precision
    studies = {
        mode: placement_study("kvgraft-ced-8m", small_task, tmp_path / mode, StudyOptions(frozen_cache=mode, **kw))
        for mode in ("off", "auto")
    }
    assert studies["off"]["table"] == {
        name: {**row, "step_time_s": studies["off"]["table"][name]["step_time_s"]}
        for name, row in studies["auto"]["table"].items()
    }
    runs = tmp_path / "auto" / "runs"
    used = {c: json.loads((runs / c / "seed0" / "result.json").read_text())["frozen_prefix"] for c in configs}
    assert used["all-linear-r16"] is None and used[configs[0]]["boundary"] == 4 and used[configs[0]]["hits"] > 0
