"""``make demo``: the shipped reference model, its MLA graft at 4x, and the two side by side.

1. evaluate the reference model (held-out perplexity, KV bytes per token, decode speed) and sample;
2. ``doctor`` it; 3. ``convert`` it to MLA at 4x KV compression (one shot, no training);
4. evaluate the graft the same way and print both side by side; write everything to ``out_dir``.

Two settings. The default, quick one (about a minute on an idle 2-core CPU) scores perplexity on 32
windows (16,384 tokens) taken evenly across the model's held-out slice, calibrates the conversion on
16,384 tokens taken evenly across its calibration slice, and times fewer decode steps. ``full=True``
(``kvgraft demo --full``) is the long version behind the README's numbers: the whole held-out slice
(65K tokens for the reference model), the conversion's default calibration (the first 32,768 tokens of
the slice) and more decode steps per speed point.
"""

from __future__ import annotations

import json
import shutil
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from kvgraft.atomic import atomic_write_text
from kvgraft.checks import check_int, check_number, check_writable
from kvgraft.errors import ConfigError
from kvgraft.eval import EvalOptions, compare_table, evaluate, format_report
from kvgraft.graft.convert import convert
from kvgraft.graft.doctor import doctor
from kvgraft.graft.mla import GraftConfig
from kvgraft.graft.options import ConvertOptions
from kvgraft.graft.ranks import default_ranks
from kvgraft.hf import load_config, load_pretrained, load_tokenizer_dir
from kvgraft.reference import resolve_model
from kvgraft.runtime import generate

PROMPTS = ("In the beginning", "The for statement in Python")
HELDOUT = Path("eval") / "heldout.npy"
CALIBRATION = Path("eval") / "calibration.npy"


@dataclass(frozen=True)
class DemoSetting:
    """What one demo run measures on. ``None`` windows/tokens: everything there is / convert's default."""

    name: str
    heldout_windows: int | None  # perplexity windows (of the model's context) spread over the held-out slice
    calibration_tokens: int | None  # conversion calibration tokens spread over the calibration slice
    speed_new_tokens: int  # decode steps timed per (context, batch size) point
    speed_repeats: int

    def describe(self) -> str:
        ppl = (
            "the whole held-out slice"
            if self.heldout_windows is None
            else f"{self.heldout_windows} windows spread over the held-out slice"
        )
        cal = (
            "convert's default calibration (the first 32,768 tokens of eval/calibration.npy)"
            if self.calibration_tokens is None
            else f"{self.calibration_tokens:,} calibration tokens spread over eval/calibration.npy"
        )
        return (
            f"{self.name} setting: perplexity on {ppl}; {cal}; decode speed over {self.speed_new_tokens} "
            f"steps x {self.speed_repeats} repeat(s) per point"
        )


QUICK = DemoSetting("quick", heldout_windows=32, calibration_tokens=16384, speed_new_tokens=12, speed_repeats=1)
FULL = DemoSetting("full", heldout_windows=None, calibration_tokens=None, speed_new_tokens=16, speed_repeats=2)


def _spread_windows(tokens, n_windows: int, window: int):
    """``n_windows`` chunks of ``window`` tokens evenly spaced over ``tokens``, concatenated, plus the token
    after the last chunk (the last window's final target). The slices kvgraft ships are themselves evenly
    spaced chunks of the whole split (``kvgraft.data.spread_tokens``), so this keeps every source."""

    n_chunks = (tokens.size - 1) // window  # chunks followed by at least one token
    if n_chunks == 0:
        raise ConfigError(f"{tokens.size} tokens hold no window of {window} plus its last target")
    idx = np.unique(np.linspace(0, n_chunks - 1, min(n_windows, n_chunks)).round().astype(np.int64))
    parts = [np.asarray(tokens[i * window : (i + 1) * window]) for i in idx]
    end = (int(idx[-1]) + 1) * window
    parts.append(np.asarray(tokens[end : end + 1]))
    return np.concatenate(parts)


def _samples(model, tok, max_new_tokens: int, seed: int) -> list[dict]:
    out = []
    for prompt in PROMPTS:
        ids = torch.tensor([tok.encode(prompt)])
        gen = generate(model, ids, max_new_tokens, temperature=0.8, top_p=0.95, seed=seed, eos_token_id=model.config.eos_token_id)
        text = tok.decode(gen[0].tolist(), skip_special_tokens=True)
        out.append({"prompt": prompt, "text": text})
        print(f"--- {prompt!r}\n{text}\n")
    return out


def _check_arguments(path: Path, out: Path, compression: float, max_new_tokens: int, seed: int) -> None:
    """Everything that can be checked before the first minute of work (ValueError/CheckpointError)."""

    check_number("compression", compression, accepted="a number > 1")
    check_int("max_new_tokens", max_new_tokens, low=1)
    check_int("seed", seed)
    if out.exists() and not out.is_dir():
        raise ConfigError(f"out_dir {out} exists and is not a directory")
    config = load_config(path)  # missing directory or config.json: CheckpointError naming it
    for needed in (HELDOUT, CALIBRATION):
        if not (path / needed).is_file():
            raise ConfigError(
                f"{path} has no {needed}; the demo needs a model with the eval slices a shipped "
                "reference model carries (see `kvgraft ship`)"
            )
    ranks = default_ranks(config, compression=compression)  # convert's own rule
    GraftConfig(kv_lora_rank=ranks.kv_lora_rank, qk_rope_head_dim=ranks.qk_rope_head_dim).check_against(config)

    check_writable(out / "report.json", what="demo output")


def demo(
    model: str | None = None,
    out_dir: str | Path = "runs/demo",
    compression: float = 4.0,
    max_new_tokens: int = 40,
    seed: int = 0,
    full: bool = False,
) -> dict:
    """Run the demo and return (and write to ``out_dir/report.json``) everything it measured.

    ``full=False`` (the default) runs the quick setting, ``full=True`` the long one (see the module
    docstring); the report's ``setting`` says which ran. Arguments are checked before any work.
    """

    setting = FULL if full else QUICK
    path = resolve_model(model)
    out = Path(out_dir)
    _check_arguments(path, out, compression, max_new_tokens, seed)
    out.mkdir(parents=True, exist_ok=True)
    net = load_pretrained(path)
    tok = load_tokenizer_dir(path)
    ctx = net.config.max_position_embeddings
    speed = EvalOptions(
        contexts=(ctx // 4, ctx - 16), batch_sizes=(1, 8), new_tokens=setting.speed_new_tokens, repeats=setting.speed_repeats
    )
    heldout = path / HELDOUT
    if setting.heldout_windows is not None:
        heldout = _spread_windows(np.load(heldout, mmap_mode="r"), setting.heldout_windows, ctx)
    calibration = None  # convert's default: the first calibration_tokens of eval/calibration.npy
    if setting.calibration_tokens is not None:
        calibration = out / f"calibration-spread-{setting.calibration_tokens}.npy"
        window = min(512, ctx)  # convert's calibration sequence length
        np.save(
            calibration,
            _spread_windows(np.load(path / CALIBRATION, mmap_mode="r"), setting.calibration_tokens // window, window)[
                : setting.calibration_tokens
            ],
        )
    rerun = "" if full else " (`kvgraft demo --full` for the long version)"
    print(f"kvgraft demo, {setting.describe()}{rerun}\n")

    print(f"== 1. the reference model: {path}")
    original = evaluate(model_path=path, model=net, tokens=heldout, name="original", options=speed)
    print(format_report(original))
    print(f"\nsamples (temperature 0.8, top-p 0.95, seed {seed}):")
    original["samples"] = _samples(net, tok, max_new_tokens, seed) if tok is not None else []

    print("== 2. doctor: can it take MLA?")
    report = doctor(path)
    print(report.format())

    converted_dir = out / f"mla-{compression:g}x"
    print(f"\n== 3. convert to MLA at {compression:g}x KV compression (one shot, no training) -> {converted_dir}")
    if converted_dir.exists():
        shutil.rmtree(converted_dir)
    convert_args: dict[str, Any] = (
        {} if calibration is None else {"calibration": calibration, "calibration_tokens": setting.calibration_tokens}
    )
    record = convert(path, converted_dir, ConvertOptions(compression=compression, **convert_args))
    kv = record.kv_bytes_per_token_bf16
    print(f"KV bytes/token (bf16) {kv['original']:,} -> {kv['converted']:,}; converted in {record.seconds['convert']:.1f} s")

    print("\n== 4. the graft, measured the same way")
    mla = load_pretrained(converted_dir)
    grafted = evaluate(
        model_path=converted_dir, model=mla, tokens=heldout, name=f"MLA {compression:g}x (one-shot)", options=speed
    )
    print(format_report(grafted))
    print("\nsamples from the graft:")
    grafted["samples"] = _samples(mla, tok, max_new_tokens, seed) if tok is not None else []
    print("== side by side")
    print(compare_table([original, grafted]))

    result = {
        "setting": asdict(setting),
        "original": original,
        "doctor": report.to_dict(),
        "conversion": record.to_dict(),
        "converted": grafted,
    }
    atomic_write_text(out / "report.json", json.dumps(result, indent=2, default=str) + "\n")
    print(f"\n{setting.describe()}{rerun}")
    print(f"report written to {out / 'report.json'}; converted model in {converted_dir}")
    return result
