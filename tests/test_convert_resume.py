"""``kvgraft convert --resume``: a layer-by-layer conversion that fails after layer k keeps its finished layers
in the staging directory (``.<out>.partial``), and a resumed run writes bit for bit what an uninterrupted one
writes (tensors, config.json, conversion.json apart from timings) without redoing those layers; another
source, other options or other calibration are refused, naming the difference."""

from __future__ import annotations

import json

import pytest
import torch
from test_convert_layerwise import _assert_same, _checkpoint  # tiny HF checkpoints, the executors' comparison

import kvgraft.graft.layerwise as lw
from kvgraft.cli import build_parser
from kvgraft.graft.convert import execute
from kvgraft.graft.options import ConvertOptions, options_from_cli
from kvgraft.graft.plan import plan_conversion
from kvgraft.graft.resume import STATE, ResumeError, staging_path

OPTIONS = dict(progress=False, calibration_tokens=1024, calibration_seq_len=32)


class Interrupt(Exception):
    pass


def _fail_at(monkeypatch, layer: int, occurrence: int = 1) -> list[int]:
    """Make the ``occurrence``-th read of source layer ``layer`` raise; the layers read are appended to the
    returned list."""
    read: list[int] = []
    original = lw.SourceLayers.block

    def block(self, i):
        read.append(i)
        if i == layer and read.count(i) == occurrence:
            raise Interrupt(f"interrupted at layer {i}")
        return original(self, i)

    monkeypatch.setattr(lw.SourceLayers, "block", block)
    return read


def _interrupted_then_resumed(tmp_path, monkeypatch, path, k: int, **options):
    """(uninterrupted record, resumed record, uninterrupted dir, resumed dir); the run fails after layer k."""
    options = OPTIONS | options
    reference = execute(plan_conversion(path, tmp_path / "reference", ConvertOptions(**options))).to_dict()
    out = tmp_path / "out"
    with monkeypatch.context() as m:
        _fail_at(m, k + 1, 2 if options.get("rope_selection") == "shared" else 1)  # after the shared layout's pass
        with pytest.raises(Interrupt):
            execute(plan_conversion(path, out, ConvertOptions(**options)))
    staging = staging_path(out)
    assert not out.exists() and staging.is_dir()
    assert json.loads((staging / STATE).read_text())["next_layer"] == k + 1
    read = _fail_at(monkeypatch, -1)  # counts only
    resumed = execute(plan_conversion(path, out, ConvertOptions(resume=True, **options))).to_dict()
    assert min(read) == k + 1, "a finished layer was read again"
    assert not staging.exists() and not list(out.glob("state*")), "the checkpoint's files left in the output"
    return reference, resumed, tmp_path / "reference", out


@pytest.mark.parametrize("k", [0, 1])
@pytest.mark.parametrize("family", ["llama", "qwen3"])
def test_resumed_conversion_is_bit_identical_to_an_uninterrupted_one(tmp_path, monkeypatch, family, k):
    path = _checkpoint(tmp_path, family)
    reference, resumed, a, b = _interrupted_then_resumed(tmp_path, monkeypatch, path, k)
    _assert_same(reference, resumed, a, b)
    assert resumed["seconds"]["convert"] > 0 and resumed["calibration_tail"] is not None


@pytest.mark.parametrize(
    "options",
    [dict(rope_selection="shared"), dict(layerwise=False, layers=(0, 1)), dict(objective="weights")],
    ids=["shared", "not-layerwise-progressive", "weights"],
)
def test_resume_restores_every_walk(tmp_path, monkeypatch, options):
    """The shared layout's first pass, the original stream of a non-layer-wise graft, a progressive graft's
    copied top layer, and no calibration at all."""
    reference, resumed, a, b = _interrupted_then_resumed(tmp_path, monkeypatch, _checkpoint(tmp_path, "qwen2"), 0, **options)
    _assert_same(reference, resumed, a, b)


def test_resume_of_a_stock_export(tmp_path, monkeypatch):
    """--format deepseek_v3: the graft's finished layers kept (in the staging directory's .kvgraft/), the
    export made once the walk is done: the same files as an uninterrupted conversion."""
    from test_convert_layerwise import _assert_same_files, _stock_stripped

    reference, resumed, a, b = _interrupted_then_resumed(
        tmp_path, monkeypatch, _checkpoint(tmp_path, "qwen3"), 1, output_format="deepseek_v3"
    )
    _assert_same_files(a, b)
    assert _stock_stripped(reference) == _stock_stripped(resumed)


def test_resume_continues_a_sharded_output(tmp_path, monkeypatch):
    """Output shards of about one layer: some written before the interruption, some tensors pending."""
    monkeypatch.setattr(lw, "SHARD_FLOOR", 1)
    path = _checkpoint(tmp_path, "mistral", tie_word_embeddings=True)
    reference, resumed, a, b = _interrupted_then_resumed(tmp_path, monkeypatch, path, 1)
    assert (b / "model.safetensors.index.json").is_file()
    assert (a / "model.safetensors.index.json").read_text() == (b / "model.safetensors.index.json").read_text()
    for f in a.glob("model-*.safetensors"):
        assert f.read_bytes() == (b / f.name).read_bytes(), f.name
    _assert_same(reference, resumed, a, b)


def test_resume_with_other_options_or_source_is_refused(tmp_path, monkeypatch):
    path = _checkpoint(tmp_path, "llama")
    out = tmp_path / "out"
    with monkeypatch.context() as m:
        _fail_at(m, 2)
        with pytest.raises(Interrupt):
            execute(plan_conversion(path, out, ConvertOptions(**OPTIONS)))
    staging = staging_path(out)
    kept = sorted(p.name for p in staging.iterdir())
    with pytest.raises(ResumeError, match=r"calibration_shrinkage: 0\.5 then, 0\.25 now") as info:
        execute(plan_conversion(path, out, ConvertOptions(resume=True, calibration_shrinkage=0.25, **OPTIONS)))
    assert "--overwrite" in str(info.value)
    with pytest.raises(ResumeError, match="calibration_ids"):
        execute(plan_conversion(path, out, ConvertOptions(resume=True, **OPTIONS | dict(calibration_tokens=2048))))
    state = json.loads((path / "config.json").read_text())
    state["rms_norm_eps"] = 1e-6
    (path / "config.json").write_text(json.dumps(state))
    with pytest.raises(ResumeError, match="config.json"):
        execute(plan_conversion(path, out, ConvertOptions(resume=True, **OPTIONS)))
    assert sorted(p.name for p in staging.iterdir()) == kept and not out.exists()  # refused: nothing touched


def test_staging_left_behind_is_refused_without_resume_and_discarded_with_overwrite(tmp_path, monkeypatch):
    path = _checkpoint(tmp_path, "llama")
    out = tmp_path / "out"
    with monkeypatch.context() as m:
        _fail_at(m, 1)
        with pytest.raises(Interrupt):
            execute(plan_conversion(path, out, ConvertOptions(**OPTIONS)))
    with pytest.raises(FileExistsError, match="--resume to continue it"):
        plan_conversion(path, out, ConvertOptions(**OPTIONS))
    read = _fail_at(monkeypatch, -1)
    execute(plan_conversion(path, out, ConvertOptions(overwrite=True, **OPTIONS)))  # started over
    assert read[0] == 0 and not staging_path(out).exists()
    reference = execute(plan_conversion(path, tmp_path / "reference", ConvertOptions(overwrite=True, **OPTIONS))).to_dict()
    _assert_same(reference, json.loads((out / "conversion.json").read_text()), tmp_path / "reference", out)


def test_resume_without_a_checkpoint_converts_from_the_start(tmp_path):
    path = _checkpoint(tmp_path, "llama")
    record = execute(plan_conversion(path, tmp_path / "out", ConvertOptions(resume=True, **OPTIONS))).to_dict()
    assert "resume" not in record["plan"]["options"]  # how it ran, not what it wrote
    assert (tmp_path / "out" / "model.safetensors").is_file()


def test_failure_before_the_first_layer_leaves_nothing(tmp_path, monkeypatch):
    path = _checkpoint(tmp_path, "llama")
    with monkeypatch.context() as m:
        _fail_at(m, 0)
        with pytest.raises(Interrupt):
            execute(plan_conversion(path, tmp_path / "out", ConvertOptions(**OPTIONS)))
    assert sorted(p.name for p in tmp_path.iterdir()) == ["llama-src"]


def test_resume_is_an_option_of_every_target_and_format():
    assert ConvertOptions(resume=True, to="ced").resume  # tests/test_ced_layerwise.py resumes it
    assert ConvertOptions(resume=True, output_format="deepseek_v3").resume  # the stock export's graft is layer by layer
    args = build_parser().parse_args(["convert", "m", "--out", "o", "--resume"])
    assert options_from_cli(args)["resume"] is True


def test_checkpoint_survives_a_kill_between_its_files(tmp_path, monkeypatch):
    """A crash after a tensors file is written but before state.json names it resumes from the checkpoint
    before (state.json is replaced last, atomically)."""
    path = _checkpoint(tmp_path, "llama")
    out = tmp_path / "out"
    calls = []
    original = lw.Checkpoint.write

    def write(self, next_layer, tensors, state):
        calls.append(next_layer)
        if next_layer == 2:  # dies between torch.save and the state file
            torch.save(tensors, self.directory / f"state-{next_layer:05d}.pt")
            raise Interrupt("killed")
        return original(self, next_layer, tensors, state)

    with monkeypatch.context() as m:
        m.setattr(lw.Checkpoint, "write", write)
        with pytest.raises(Interrupt):
            execute(plan_conversion(path, out, ConvertOptions(**OPTIONS)))
    assert json.loads((staging_path(out) / STATE).read_text())["next_layer"] == 1
    resumed = execute(plan_conversion(path, out, ConvertOptions(resume=True, **OPTIONS))).to_dict()
    reference = execute(plan_conversion(path, tmp_path / "reference", ConvertOptions(**OPTIONS))).to_dict()
    _assert_same(reference, resumed, tmp_path / "reference", out)
