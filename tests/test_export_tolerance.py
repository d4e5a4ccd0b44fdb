"""The stock export's gate (``kvgraft convert --export-tolerance / --export-kl-tolerance / --accept-export-error``):
an export measured further from the kvgraft model than the tolerances fails the conversion with exit status 4
(``ExportError``) and leaves nothing (no output, no kvgraft part of ``--format both``, no staging directory),
in both executors and after ``--resume``; ``--accept-export-error`` writes it, marked in conversion.json, its
README.md and on stderr; exact and default exports pass the default tolerances; bad tolerances are refused
before any work.

The error forced over tolerance is a real one: without its own latent norm (``--no-latent-norm``; the default
grafts one for a stock export, which then exports exactly) the engine-safe export fits the latent norm (measured
on these tiny random checkpoints: relative perplexity difference ~1e-4-1e-3, mean KL ~1e-4 nats), held against
tolerances of 1e-12.
"""

from __future__ import annotations

import json
import math

import pytest
from test_convert_layerwise import _checkpoint  # tiny HF checkpoints (3 layers, calibration in eval/)
from test_convert_resume import Interrupt, _fail_at

from kvgraft.cli import EXIT_ERROR, EXIT_EXPORT_ERROR, main
from kvgraft.errors import ExportError
from kvgraft.graft.convert import execute
from kvgraft.graft.options import EXPORT_KL_TOLERANCE, EXPORT_TOLERANCE, ConvertOptions
from kvgraft.graft.plan import plan_conversion
from kvgraft.graft.resume import staging_path
from kvgraft.graft.stock import export_error_check
from kvgraft.hf.deepseek import ExportReport

OPTIONS = dict(progress=False, calibration_tokens=1024, calibration_seq_len=32)
# the stock export of a graft without its own latent norm (--no-latent-norm) approximates DeepSeek-V3's latent
# RMSNorm ('fit'): a real, small error, held against tolerances of 1e-12
TIGHT = dict(export_tolerance=1e-12, export_kl_tolerance=1e-12, latent_norm=False)
TIGHT_CLI = ["--export-tolerance", "1e-12", "--export-kl-tolerance", "1e-12", "--no-latent-norm"]


def _nothing_left(out) -> None:
    assert not out.exists(), f"{out} written"
    assert not staging_path(out).exists(), "staging directory left"
    assert not [p for p in out.parent.iterdir() if p.name.startswith(f".{out.name}")], "temporary directory left"


def _cli(path, out, *extra, calibration_tokens: int = 1024) -> list[str]:
    return ["convert", str(path), "--out", str(out), "--calibration-tokens", str(calibration_tokens), *extra]


@pytest.mark.parametrize("fmt", ["both", "deepseek_v3"])
def test_cli_fails_over_tolerance_with_its_exit_status_and_writes_nothing(tmp_path, capsys, fmt):
    """The layer-by-layer executor (the CLI's): status 4, the figures, tolerances and flag named, nothing left
    (with --format deepseek_v3 not the converted model's temporary shards either)."""
    path = _checkpoint(tmp_path, "llama")
    out = tmp_path / "out"
    assert main(_cli(path, out, "--format", fmt, *TIGHT_CLI)) == EXIT_EXPORT_ERROR
    err = capsys.readouterr().err
    assert "kvgraft: error: the stock DeepSeek-V3 export is further from the kvgraft model than the tolerance" in err
    assert "a relative difference of" in err and "> --export-tolerance 1e-12" in err
    assert "nats per token > --export-kl-tolerance 1e-12" in err and "perplexity" in err
    assert "--accept-export-error" in err and "latent RMSNorm approximated ('fit')" in err
    assert f"Nothing was written to {out}" in err
    _nothing_left(out)


def test_whole_model_executor_fails_over_tolerance_and_writes_nothing(tmp_path):
    path = _checkpoint(tmp_path, "qwen2")
    out = tmp_path / "out"
    plan = plan_conversion(path, out, ConvertOptions(output_format="both", **OPTIONS, **TIGHT))
    with pytest.raises(ExportError, match=r"neither the kvgraft model nor deepseek_v3/") as info:
        execute(plan, executor="whole")
    check = info.value.check
    assert check["within_tolerance"] is False and check["tolerance"] == {
        "relative_perplexity_difference": 1e-12,
        "mean_kl": 1e-12,
    }
    assert check["mean_kl"] > 1e-12 and check["relative_perplexity_difference"] > 1e-12 and len(check["above"]) == 2
    _nothing_left(out)


def test_an_existing_output_is_left_as_it_was(tmp_path):
    """--overwrite replaces the output only when the new one is complete: a failed export leaves the old one."""
    path = _checkpoint(tmp_path, "llama")
    out = tmp_path / "out"
    out.mkdir()
    (out / "old.txt").write_text("old")
    for executor in ("whole", "layerwise"):
        plan = plan_conversion(path, out, ConvertOptions(output_format="both", overwrite=True, **OPTIONS, **TIGHT))
        with pytest.raises(ExportError):
            execute(plan, executor=executor)
        assert [p.name for p in out.iterdir()] == ["old.txt"]
        assert not staging_path(out).exists()


@pytest.mark.parametrize("executor", ["whole", "layerwise"])
def test_accept_export_error_writes_it_marked_as_such(tmp_path, capsys, executor):
    path = _checkpoint(tmp_path, "llama")
    out = tmp_path / "out"
    plan = plan_conversion(path, out, ConvertOptions(output_format="both", accept_export_error=True, **OPTIONS, **TIGHT))
    record = execute(plan, executor=executor).to_dict()
    err = capsys.readouterr().err
    assert "kvgraft: WARNING: This stock DeepSeek-V3 export is further from the kvgraft model" in err
    assert "--accept-export-error" in err
    check = json.loads((out / "conversion.json").read_text())["deepseek_v3"]["error_check"]
    assert check == record["deepseek_v3"]["error_check"]
    assert check["accepted_above_tolerance"] is True and check["within_tolerance"] is False
    assert check["warning"] and check["warning"] in err
    assert json.loads((out / "conversion.json").read_text())["plan"]["options"]["accept_export_error"] is True
    card = (out / "deepseek_v3" / "README.md").read_text()
    assert card.splitlines()[2].startswith("> **WARNING: above kvgraft's tolerance, written with --accept-export-error.**")
    assert "## Measured" in card  # the rest of the card is kept
    assert (out / "config.json").is_file() and (out / "deepseek_v3" / "config.json").is_file()


def test_accept_export_error_through_the_cli(tmp_path, capsys):
    path = _checkpoint(tmp_path, "llama")
    out = tmp_path / "out"
    assert main(_cli(path, out, "--format", "deepseek_v3", "--accept-export-error", *TIGHT_CLI)) == 0
    assert "kvgraft: WARNING:" in capsys.readouterr().err
    assert json.loads((out / "conversion.json").read_text())["deepseek_v3"]["error_check"]["accepted_above_tolerance"]
    assert sorted(p.name for p in out.iterdir()) == ["conversion.json", "deepseek_v3", "eval"]


@pytest.mark.parametrize("construction", ["transformers", "engines"])
@pytest.mark.parametrize("latent_norm", [True, False])
def test_exact_and_default_exports_pass_the_default_tolerances(tmp_path, capsys, construction, latent_norm):
    """With the graft's own latent norm (the default for a stock export) both constructions export exactly
    (~1e-9 / ~1e-15 here); without it (--no-latent-norm) the engine-safe one fits the latent norm (~1e-3 /
    ~1e-4): both far inside the defaults (0.1 relative perplexity difference, 0.1 nats)."""
    path = _checkpoint(tmp_path, "llama")
    out = tmp_path / "out"
    flags = [] if latent_norm else ["--no-latent-norm"]
    assert main(_cli(path, out, "--format", "both", "--stock-construction", construction, *flags)) == 0
    assert "within tolerance: relative perplexity difference" in capsys.readouterr().out
    ds = json.loads((out / "conversion.json").read_text())["deepseek_v3"]
    check = ds["error_check"]
    assert check["within_tolerance"] and not check["accepted_above_tolerance"] and check["warning"] is None
    assert check["tolerance"] == {"relative_perplexity_difference": EXPORT_TOLERANCE, "mean_kl": EXPORT_KL_TOLERANCE}
    exact = latent_norm or construction == "transformers"
    bound = 1e-6 if exact else 1e-2
    assert ds["exact"] is exact
    assert check["relative_perplexity_difference"] < bound and check["mean_kl"] < bound
    assert "WARNING" not in (out / "deepseek_v3" / "README.md").read_text()


def test_resumed_conversion_over_tolerance_leaves_nothing(tmp_path, monkeypatch):
    """Interrupted after layer 0 (the staging directory kept), resumed with tolerances it was not started with
    (they are not part of the resume fingerprint): the export fails and neither the output nor the staging
    directory is left (the checkpoint is dropped once the walk is done)."""
    path = _checkpoint(tmp_path, "llama")
    out = tmp_path / "out"
    with monkeypatch.context() as m:
        _fail_at(m, 1)
        with pytest.raises(Interrupt):
            execute(plan_conversion(path, out, ConvertOptions(output_format="both", latent_norm=False, **OPTIONS)))
    assert staging_path(out).is_dir()
    read = _fail_at(monkeypatch, -1)  # counts only
    with pytest.raises(ExportError):
        execute(plan_conversion(path, out, ConvertOptions(output_format="both", resume=True, **OPTIONS, **TIGHT)))
    assert min(read) == 1, "the finished layer was read again: not resumed"
    _nothing_left(out)


@pytest.mark.parametrize("value", ["0", "-0.5", "nan", "inf", "-inf"])
@pytest.mark.parametrize("flag", ["--export-tolerance", "--export-kl-tolerance"])
def test_bad_tolerances_are_refused_before_any_work(tmp_path, capsys, flag, value):
    out = tmp_path / "out"
    # a source that does not exist: the options are checked first
    assert main(_cli(tmp_path / "missing", out, "--format", "both", f"{flag}={value}")) == EXIT_ERROR
    err = capsys.readouterr().err
    name = flag.lstrip("-").replace("-", "_")
    assert f"kvgraft: error: {name} ({float(value)!r}) must be a positive finite number" in err
    assert "missing" not in err
    _nothing_left(out)


def test_tolerance_options_are_validated_on_construction():
    for bad in (0, -1.0, math.nan, math.inf, True, "0.1", None):
        with pytest.raises(ValueError, match=r"export_tolerance .* must be a positive finite number \(a relative perplexity"):
            ConvertOptions(export_tolerance=bad)  # type: ignore[arg-type]
        with pytest.raises(ValueError, match=r"export_kl_tolerance .* must be a positive finite number \(a mean KL in nats"):
            ConvertOptions(export_kl_tolerance=bad)  # type: ignore[arg-type]
    assert ConvertOptions(export_tolerance=2, export_kl_tolerance=1e-9).export_tolerance == 2
    with pytest.raises(ValueError, match=r"accept_export_error applies to the stock DeepSeek-V3 export; format 'kvgraft'"):
        ConvertOptions(accept_export_error=True)
    ConvertOptions(accept_export_error=True, target="vllm")  # the target's default format is deepseek_v3


def test_the_check_counts_what_is_not_finite_or_not_measured_as_above():
    def report(kl, ppl):
        return ExportReport(path=None, latent_norm="fit", mean_kl=kl, perplexity=ppl)  # type: ignore[arg-type]

    ok = export_error_check(report(0.01, {"kvgraft": 10.0, "deepseek_v3": 10.5}), 0.1, 0.1)
    assert ok["within_tolerance"] and ok["relative_perplexity_difference"] == pytest.approx(0.05)
    lower = export_error_check(report(0.01, {"kvgraft": 10.0, "deepseek_v3": 8.0}), 0.1, 0.1)  # a difference either way
    assert not lower["within_tolerance"] and lower["relative_perplexity_difference"] == pytest.approx(0.2)
    for kl, ppl in [
        (math.nan, {"kvgraft": 10.0, "deepseek_v3": 10.0}),
        (math.inf, {"kvgraft": 10.0, "deepseek_v3": 10.0}),
        (0.0, {"kvgraft": 10.0, "deepseek_v3": math.inf}),
        (0.0, {"kvgraft": 10.0, "deepseek_v3": math.nan}),
        (None, {"kvgraft": 10.0, "deepseek_v3": 10.0}),
        (0.0, None),
    ]:
        assert not export_error_check(report(kl, ppl), 0.1, 0.1)["within_tolerance"], (kl, ppl)
    # no next-token targets (one-token sequences): perplexity is nan on both sides; the KL alone decides
    single = export_error_check(report(0.0, {"kvgraft": math.nan, "deepseek_v3": math.nan}), 0.1, 0.1)
    assert single["within_tolerance"] and single["relative_perplexity_difference"] is None
