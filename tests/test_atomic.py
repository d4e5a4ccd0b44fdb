"""Atomic outputs: the whole new file or the old one, never half; nothing left behind on failure."""

from __future__ import annotations

import json

import pytest

from kvgraft.atomic import atomic_dir, atomic_savefig, atomic_write_json


def test_json_written_whole_and_a_failed_write_keeps_the_old_file(tmp_path):
    path = tmp_path / "sub" / "results.json"
    atomic_write_json(path, {"a": [1, 2]})
    assert json.loads(path.read_text()) == {"a": [1, 2]} and path.read_text().endswith("\n")
    with pytest.raises(TypeError):
        atomic_write_json(path, {"b": object()})  # not serialisable: fails before anything is replaced
    assert json.loads(path.read_text()) == {"a": [1, 2]}
    assert sorted(p.name for p in path.parent.iterdir()) == ["results.json"]  # no temporary file left


def test_figure_saved_atomically_in_the_suffix_format(tmp_path):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots()
    ax.plot([0, 1], [1, 0])
    atomic_savefig(fig, tmp_path / "curve.png", dpi=50)
    atomic_savefig(fig, tmp_path / "curve.svg")
    plt.close(fig)
    assert (tmp_path / "curve.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert b"<svg" in (tmp_path / "curve.svg").read_bytes()[:400]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["curve.png", "curve.svg"]


def test_directory_replaced_whole_or_untouched(tmp_path):
    out = tmp_path / "model"
    with atomic_dir(out) as tmp:
        (tmp / "a.txt").write_text("one")
    with pytest.raises(FileExistsError, match="overwrite"):
        with atomic_dir(out):
            pass
    with pytest.raises(RuntimeError):
        with atomic_dir(out, overwrite=True) as tmp:
            (tmp / "a.txt").write_text("two")
            raise RuntimeError("crash mid-write")
    assert (out / "a.txt").read_text() == "one"
    assert [p.name for p in tmp_path.iterdir()] == ["model"]
