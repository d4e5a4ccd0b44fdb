"""One-shot MLA grafts of a real checkpoint, as a user runs them: ``kvgraft convert`` with its defaults plus the
flags of each setting, scored on held-out text the graft never calibrated on.

    .venv/bin/python bench/real_texts.py                     # once: runs/real-texts/{manual,glossary}.npy
    .venv/bin/python bench/real_oneshot.py --settings 4:kvgraft:0 4:kvgraft:8 4:deepseek_v3:8 [--out runs/bench/real_oneshot]

A setting is ``COMPRESSION:FORMAT:REFINE_EPOCHS`` (FORMAT ``kvgraft``, ``deepseek_v3`` or ``both``: one
conversion, both outputs scored, as two rows). Each conversion runs
as its own ``python -m kvgraft convert`` process (wall time and peak RSS measured from outside it). The kvgraft
format is scored with kvgraft's forward, the stock DeepSeek-V3 export *through stock transformers*
(DeepseekV3ForCausalLM), both with ``kvgraft.eval.perplexity`` (non-overlapping windows of 512 tokens, fp32);
ratios are against the original scored in the same run. Results: ``results.json`` and ``results.md`` in
``--out`` (rewritten after every setting, atomically), converted models under ``--out``/models (removed after
scoring unless ``--keep``; one found there already converted is scored again, its wall time then being
convert's own ``seconds``, without the peak RSS).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import torch

from kvgraft.atomic import atomic_write_json
from kvgraft.eval.perplexity import perplexity
from kvgraft.hf import load_pretrained
from kvgraft.reference import resolve_model

TEXTS = ("manual", "glossary")


class _Stock(torch.nn.Module):
    """A transformers model behind kvgraft's ``model(ids) -> logits`` interface."""

    def __init__(self, hf: torch.nn.Module) -> None:
        super().__init__()
        self.hf = hf
        self.config = hf.config

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.hf(ids).logits


def score(model: torch.nn.Module, texts: Path) -> dict[str, float]:
    with torch.no_grad():
        return {name: perplexity(model, np.load(texts / f"{name}.npy"), seq_len=512).ppl for name in TEXTS}


def parse_setting(text: str) -> tuple[float, str, int]:
    parts = text.split(":")
    if len(parts) != 3 or parts[1] not in ("kvgraft", "deepseek_v3", "both"):
        raise SystemExit(f"setting {text!r} is not COMPRESSION:FORMAT:REFINE_EPOCHS with FORMAT kvgraft, deepseek_v3 or both")
    return float(parts[0]), parts[1], int(parts[2])


def convert(model: Path, out: Path, compression: float, fmt: str, epochs: int, extra: list[str]) -> dict[str, float]:
    cmd = [sys.executable, "-m", "kvgraft", "convert", str(model), "--out", str(out)]
    if "--kv-lora-rank" not in extra:  # explicit ranks (--convert-args) set the budget instead; COMPRESSION labels it
        cmd += ["--compression", f"{compression:g}"]
    cmd += ["--format", fmt, "--refine-epochs", str(epochs), "--overwrite", *extra]
    t0 = time.perf_counter()
    proc = subprocess.Popen(cmd)
    _, status, usage = os.wait4(proc.pid, 0)
    wall = time.perf_counter() - t0
    if os.waitstatus_to_exitcode(status) != 0:
        raise SystemExit(f"{' '.join(cmd)} exited with {os.waitstatus_to_exitcode(status)}")
    return {"wall_s": wall, "peak_rss_gib": usage.ru_maxrss / 2**20}


def table(results: dict) -> str:
    base = results["original"]
    lines = [
        f"Original: {', '.join(f'{t} {base[t]:.2f}' for t in TEXTS)} (perplexity, windows of 512 tokens).",
        "",
        "| compression | format | refine epochs | d_c + d_rope | "
        + " | ".join(f"{t} ppl (x original)" for t in TEXTS)
        + " | convert wall | peak RSS |",
        "|---|---|---|---|" + "---|" * len(TEXTS) + "---|---|",
    ]
    for r in results["runs"]:
        cells = " | ".join(f"{r['ppl'][t]:.2f} ({r['ppl'][t] / base[t]:.3f}x)" for t in TEXTS)
        lines.append(
            f"| {r['compression']:g}x | {r['format']} | {r['refine_epochs']} | {r['ranks']} | {cells} | "
            f"{r['wall_s'] / 60:.1f} min | {r['peak_rss_gib']:.2f} GiB |"
        )
    return "\n".join(lines) + "\n"


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="smollm2-135m-instruct")
    p.add_argument("--texts", type=Path, default=Path("runs/real-texts"))
    p.add_argument("--settings", nargs="+", default=["4:kvgraft:0", "4:kvgraft:8", "4:deepseek_v3:8"])
    p.add_argument("--out", type=Path, default=Path("runs/bench/real_oneshot"))
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--keep", action="store_true", help="keep the converted models")
    p.add_argument("--convert-args", nargs=argparse.REMAINDER, default=[], help="passed to every kvgraft convert")
    a = p.parse_args()
    settings = [parse_setting(s) for s in a.settings]
    torch.set_num_threads(a.threads)
    model = resolve_model(a.model)
    a.out.mkdir(parents=True, exist_ok=True)
    path = a.out / "results.json"
    results = json.loads(path.read_text()) if path.is_file() else {"model": a.model, "runs": []}
    if "original" not in results:
        results["original"] = score(load_pretrained(model, dtype=torch.float32), a.texts)
        atomic_write_json(path, results)
    done = {(r["compression"], r.get("setting_format", r["format"]), r["refine_epochs"]) for r in results["runs"]}
    for compression, fmt, epochs in settings:
        if (compression, fmt, epochs) in done:
            continue
        out = a.out / "models" / f"{compression:g}x-{fmt}-refine{epochs}"
        if (out / "conversion.json").is_file():  # converted by an earlier run that stopped before scoring
            record = json.loads((out / "conversion.json").read_text())
            figures = {"wall_s": sum(record["seconds"].values()), "peak_rss_gib": float("nan")}
        else:
            figures = convert(model, out, compression, fmt, epochs, a.convert_args)
            record = json.loads((out / "conversion.json").read_text())
        graft = record["graft"]
        for scored_fmt in ("kvgraft", "deepseek_v3") if fmt == "both" else (fmt,):
            if scored_fmt == "kvgraft":
                scored = load_pretrained(out, dtype=torch.float32)
            else:
                from transformers import AutoModelForCausalLM

                scored = _Stock(AutoModelForCausalLM.from_pretrained(str(out / "deepseek_v3"), dtype=torch.float32).eval())
            exported = record.get("deepseek_v3", {}).get("kv_lora_rank", 0) > graft["kv_lora_rank"]
            d_c = graft["kv_lora_rank"] + (1 if exported else 0)
            run = {
                "compression": compression,
                "format": scored_fmt if fmt != "both" else f"{scored_fmt} (of both)",
                "setting_format": fmt,
                "refine_epochs": epochs,
                "ranks": f"{d_c} + {graft['qk_rope_head_dim']}",
                "latent_norm": graft.get("latent_norm"),
                "rope_selection": graft["rope_selection"],
                "ppl": score(scored, a.texts),
                "calibration": record["calibration"],
                "calibration_tail": record["calibration_tail"],
                "export_error_check": record.get("deepseek_v3", {}).get("error_check"),
                **figures,
            }
            results["runs"].append(run)
        atomic_write_json(path, results)
        tmp = a.out / ".results.md"
        tmp.write_text(table(results))
        tmp.replace(a.out / "results.md")
        print(table(results), flush=True)
        if not a.keep and not out.is_symlink():
            shutil.rmtree(out)


if __name__ == "__main__":
    main()
