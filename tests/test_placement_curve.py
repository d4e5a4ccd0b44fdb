"""The placement curve (``kvgraft experiment placement --sweep-first-layer``) on a chosen set of first adapted
layers: the runs it makes, what it reports per k, and the values it refuses before any work."""

from __future__ import annotations

import json

import pytest
from factories import FAST_PRECISION

from kvgraft.cli import main
from kvgraft.data.tasks import write_task
from kvgraft.train.experiment import CurveOptions, placement_curve


@pytest.fixture(scope="module")
def small_task(tmp_path_factory):
    return write_task("geometry", tmp_path_factory.mktemp("task") / "geometry", sizes={"train": 16, "validation": 8, "test": 8})


def test_curve_on_chosen_first_layers(tmp_path, small_task):
    kw = dict(seeds=1, steps=10, lr=2e-3, micro_batch_size=8, val_examples=4, test_examples=4, progress=False)
    kw["precision"] = FAST_PRECISION  # (the curve's subject is not the precision: fp32 where bf16 is emulated)
    curve = placement_curve("kvgraft-ced-8m", small_task, tmp_path / "c", CurveOptions(first_layers=(7, 5), **kw))
    assert [r["first_layer"] for r in curve["rows"]] == [5, 7]  # sorted
    assert sorted(p.name for p in (tmp_path / "c" / "runs").iterdir()) == ["from5", "from7"]
    # adapters on layers 5..7 hold more parameters than on layer 7 alone (same rank, all linear projections)
    assert curve["rows"][0]["trainable_parameters"] > curve["rows"][1]["trainable_parameters"] > 0
    # both lie past the pivot (4) with its KV writers frozen: they leave the shared cache untouched
    assert all(r["shares_cache"] for r in curve["rows"]) and curve["pivot"] == 4
    result = json.loads((tmp_path / "c" / "runs" / "from5" / "seed0" / "result.json").read_text())
    assert result["steps"] == 10 and (result["config"]["val_examples"], result["config"]["test_examples"]) == (4, 4)
    assert json.loads((tmp_path / "c" / "curve.json").read_text())["rows"] == curve["rows"]


@pytest.mark.parametrize("first_layers", [(8,), (-1,), (2, 2), ()])
def test_curve_refuses_bad_first_layers(tmp_path, first_layers):
    with pytest.raises(ValueError, match=r"first_layers .* distinct layer index in 0\.\.7 \(the model has 8 layers\)"):
        placement_curve("kvgraft-ced-8m", "geometry", tmp_path / "c", CurveOptions(lr=1e-3, first_layers=first_layers))
    assert not (tmp_path / "c").exists()


def test_cli_first_layers_needs_the_curve(tmp_path, capsys):
    argv = ["experiment", "placement", "--task", "geometry", "--out", str(tmp_path / "s"), "--first-layers", "4"]
    assert main(argv) == 2
    assert "--first-layers needs --sweep-first-layer" in capsys.readouterr().err
    assert not (tmp_path / "s").exists()
