"""The placement study's LR sweep extends its grid past an edge that holds the pick.

The sweep's decision logic is tested over runs whose loss curves are a known function of the LR (the
runs themselves are ``adapt`` runs, tested in test_adapt.py and the placement tests)."""

from __future__ import annotations

import math

import pytest

from kvgraft.errors import Interrupted
from kvgraft.train import experiment
from kvgraft.train.experiment import RunOptions


def fake_adapt(optimum: float, calls: list[float]):
    def adapt(base, task, out_dir, cfg):
        calls.append(cfg.lr)
        plateau = (math.log(cfg.lr) - math.log(optimum)) ** 2
        return {"train_curve": [(s, plateau + 1.0 / (s + 1)) for s in range(cfg.steps)], "val_loss": {}}

    return adapt


def test_a_pick_at_the_top_edge_extends_the_grid_until_it_is_inside(monkeypatch, tmp_path):
    calls: list[float] = []
    monkeypatch.setattr(experiment, "adapt", fake_adapt(2e-2, calls))
    sweep = experiment.lr_sweep(None, "geometry", tmp_path, runs=RunOptions(progress=False))
    assert calls == [3e-4, 1e-3, 3e-3, 1e-2, 0.0333, 0.111]
    assert sweep["lr"] == 0.0333 and not sweep["at_edge"]
    assert sweep["extensions"] == {"low": 0, "high": 2}
    assert [r["lr"] for r in sweep["rows"]] == sorted(calls)


def test_a_pick_at_the_bottom_edge_extends_downwards(monkeypatch, tmp_path):
    calls: list[float] = []
    monkeypatch.setattr(experiment, "adapt", fake_adapt(1.5e-4, calls))
    sweep = experiment.lr_sweep(None, "geometry", tmp_path, runs=RunOptions(progress=False))
    assert calls[4:] == [9e-05, 2.7e-05]
    assert sweep["lr"] == 9e-05 and not sweep["at_edge"] and sweep["extensions"] == {"low": 2, "high": 0}


def test_an_interior_pick_runs_the_grid_only(monkeypatch, tmp_path):
    calls: list[float] = []
    monkeypatch.setattr(experiment, "adapt", fake_adapt(3e-3, calls))
    sweep = experiment.lr_sweep(None, "geometry", tmp_path, runs=RunOptions(progress=False))
    assert calls == list(experiment.SWEEP_LRS) and sweep["lr"] == 3e-3 and not sweep["at_edge"]


def test_without_extensions_the_result_says_the_pick_is_at_the_edge(monkeypatch, tmp_path):
    monkeypatch.setattr(experiment, "adapt", fake_adapt(1.0, []))
    sweep = experiment.lr_sweep(None, "geometry", tmp_path, max_extensions=0, runs=RunOptions(progress=False))
    assert sweep["lr"] == 1e-2 and sweep["at_edge"]
    assert "still at the grid's edge" in experiment.study_markdown(
        {
            "task": "t",
            "steps": 10,
            "seeds": 1,
            "lr": 1e-2,
            "protocol": "p",
            "table": {},
            "decoder_minus_encoder_per_seed": None,
            "sweep": sweep,
        }
    )


@pytest.mark.parametrize("lrs", [(1e-3,), (1e-3, 1e-3), (0.0, 1e-3), (-1e-3, 1e-3)])
def test_a_bad_grid_is_refused_before_any_run(monkeypatch, tmp_path, lrs):
    calls: list[float] = []
    monkeypatch.setattr(experiment, "adapt", fake_adapt(1e-3, calls))
    with pytest.raises(ValueError, match="at least two distinct positive"):
        experiment.lr_sweep(None, "geometry", tmp_path, lrs=lrs, runs=RunOptions(progress=False))
    assert calls == []


def test_a_run_stopped_by_a_signal_stops_the_sweep_with_a_line_to_rerun(monkeypatch, tmp_path):
    """``adapt`` returns ``stopped_early`` when SIGTERM/SIGINT stopped its loop after a checkpoint; the sweep
    (and the study, the curve) stops there with :class:`Interrupted` naming the run, not a KeyError."""
    calls: list[float] = []
    inner = fake_adapt(1e-3, calls)

    def adapt(base, task, out_dir, cfg):
        return {"stopped_early": True, "step": 7} if len(calls) == 1 else inner(base, task, out_dir, cfg)

    monkeypatch.setattr(experiment, "adapt", adapt)
    with pytest.raises(Interrupted, match=r"lr_0.001 stopped at step 7 .*rerun the same command"):
        experiment.lr_sweep(None, "geometry", tmp_path, runs=RunOptions(progress=False))
    assert calls == [3e-4]  # nothing after the stopped run


def test_the_cli_exits_130_after_one_line_when_a_study_is_stopped(monkeypatch, capsys):
    from kvgraft import cli
    from kvgraft.cli.cmd import adapters

    def stopped(args):
        raise Interrupted("the run in runs/x stopped at step 3 (checkpointed); rerun the same command to continue")

    monkeypatch.setattr(adapters, "experiment", stopped)
    assert cli.run(["experiment", "placement", "--task", "geometry", "--out", "unused"]) == cli.EXIT_INTERRUPTED == 130
    err = capsys.readouterr().err
    assert err.strip().splitlines() == [
        "kvgraft: stopped: the run in runs/x stopped at step 3 (checkpointed); rerun the same command to continue"
    ]
