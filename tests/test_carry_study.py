"""bench/carry_study.py: an unfinished study carried into a repository keeps exactly its finished runs, and a
carry that git would ignore fails instead of being lost with the machine."""

import json
import subprocess
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "bench"))

from carry_study import carry  # noqa: E402


def _study(root: Path) -> Path:
    study = root / "runs" / "placement-x"
    for run, finished, wall_s in [
        ("sweep/lr_0.001", True, 30.0),
        ("runs/all-linear-r16/seed0", True, 150.0),
        ("runs/all-linear-r16/seed1", False, None),  # interrupted: a checkpoint, no result.json
        ("runs/decoder-half-r16/seed0", True, 246.0),
    ]:
        d = study / run
        (d / "checkpoints").mkdir(parents=True)
        (d / "checkpoints" / "step_10.pt").write_bytes(b"x")
        (d / "log.jsonl").write_text("{}\n")
        if finished:
            (d / "result.json").write_text(json.dumps({"wall_s": wall_s}) + "\n")
    return study


def _repo(root: Path, gitignore: str) -> None:
    subprocess.run(["git", "init", "-q", str(root)], check=True)
    (root / ".gitignore").write_text(gitignore)


COMMAND = "kvgraft experiment placement --task recall --out runs/placement-x"


def test_carries_the_finished_runs_only(tmp_path, monkeypatch):
    _repo(tmp_path, "/runs/\n")
    monkeypatch.chdir(tmp_path)
    study = _study(tmp_path)
    dest = tmp_path / "training" / "placement-x"
    (dest / "stale").mkdir(parents=True)  # what DEST held before is replaced
    trained = carry(Path("runs/placement-x"), Path("training/placement-x"), COMMAND)
    assert [p.as_posix() for p in trained] == ["runs/all-linear-r16/seed0", "runs/decoder-half-r16/seed0"]
    files = sorted(p.relative_to(dest).as_posix() for p in dest.rglob("*") if p.is_file())
    assert files == [
        "README.md",
        "runs/all-linear-r16/seed0/log.jsonl",
        "runs/all-linear-r16/seed0/result.json",
        "runs/decoder-half-r16/seed0/log.jsonl",
        "runs/decoder-half-r16/seed0/result.json",
        "sweep/lr_0.001/log.jsonl",
        "sweep/lr_0.001/result.json",
    ]
    readme = (dest / "README.md").read_text()
    assert "2 finished runs" in readme and "all-linear-r16 1, decoder-half-r16 1" in readme
    assert f"-m {COMMAND}" in readme
    assert study.is_dir()  # the source is left as it was


def test_a_carry_git_would_ignore_fails(tmp_path, monkeypatch):
    _repo(tmp_path, "runs/\n")  # unanchored: also matches training/<study>/runs/
    monkeypatch.chdir(tmp_path)
    _study(tmp_path)
    with pytest.raises(SystemExit, match="git ignores 4 carried files"):
        carry(Path("runs/placement-x"), Path("training/placement-x"), COMMAND)


def test_bad_arguments_are_named(tmp_path, monkeypatch):
    _repo(tmp_path, "/runs/\n")
    monkeypatch.chdir(tmp_path)
    _study(tmp_path)
    with pytest.raises(SystemExit, match="--out runs/placement-x"):
        carry(Path("runs/placement-x"), Path("training/placement-x"), "kvgraft experiment placement --out runs/y")
    with pytest.raises(SystemExit, match="is not a study directory"):
        carry(Path("runs/nothing"), Path("training/nothing"), COMMAND)


def test_a_finished_study_keeps_its_table_and_needs_one(tmp_path, monkeypatch):
    _repo(tmp_path, "/runs/\n")
    monkeypatch.chdir(tmp_path)
    study = _study(tmp_path)
    with pytest.raises(SystemExit, match=r"study.json \(or curve.json\) does not exist"):
        carry(Path("runs/placement-x"), Path("bench/x-runs"), COMMAND, finished=True)
    (study / "study.json").write_text('{"table": {}}\n')
    (study / "study.md").write_text("| table |\n")
    carry(Path("runs/placement-x"), Path("bench/x-runs"), COMMAND, finished=True)
    dest = tmp_path / "bench" / "x-runs"
    assert (dest / "study.json").read_text() == '{"table": {}}\n' and (dest / "study.md").is_file()
    assert (dest / "runs/all-linear-r16/seed0/result.json").is_file()
    assert not (dest / "runs/all-linear-r16/seed1").exists()
    readme = (dest / "README.md").read_text()
    assert readme.startswith("# Finished study") and "placement_gaps.py bench/x-runs" in readme
    assert "2.5-4.1 min per run" in readme  # the trained runs' own wall_s; the sweep's is not a run's
