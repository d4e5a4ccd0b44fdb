"""Which causal encoder-decoder layout to graft onto a real model: one-shot held-out perplexity by layout.

    .venv/bin/python bench/real_texts.py                        # once: runs/real-texts/{manual,glossary}.npy
    .venv/bin/python bench/real_ced_layouts.py [--mla 2 352+32] [--out runs/bench/real_ced_layouts]

SmolLM2-135M-Instruct is grafted to MLA once per ``--mla`` setting (a compression, or ranks ``D_C+D_ROPE``; what ``kvgraft convert --to ced`` does first: one
RoPE layout for all layers, ``shared`` selection, ``real`` rotation, kvgraft's calibration text), then the share
graft runs in memory for each layout (kv_source layers, window) on the same calibration. "every layer a
kv_source" is exactly the MLA step (the windows keep each layer's own keys, the shared path each layer's own
latent), so the rows separate what the MLA step costs from what sharing costs. Scored on the held-out texts of
``bench/real_texts.py`` (never calibrated on): non-overlapping 512-token windows, fp32, ratios against SmolLM2
scored in the same run. KV bytes per sequence (bf16) at 1K / 4K / 32K tokens from the paged cache's layout.
Rows are appended to ``results.json`` as they finish (a rerun skips the layouts already there).
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import numpy as np
import torch

from kvgraft.atomic import atomic_write_json
from kvgraft.eval.perplexity import perplexity
from kvgraft.graft.calibration import load_calibration
from kvgraft.graft.ced import CEDGraftConfig, graft_ced
from kvgraft.graft.convert import convert
from kvgraft.graft.options import ConvertOptions
from kvgraft.hf import load_pretrained
from kvgraft.hf.load import load_tokenizer_dir
from kvgraft.reference import resolve_model

TEXTS = ("manual", "glossary")
CONTEXTS = (1024, 4096, 32768)
# (kv_source layers, window): the seed's proportions scaled to 30 layers first (DeepSeek-V4.1-Flash: 40 layers,
# kv_source 2, 8, 14, 20, layers 0-1 window-only, 128-token windows), then alternatives
LAYOUTS: list[tuple[tuple[int, ...], int]] = [
    (tuple(range(30)), 128),  # every layer a kv_source: the MLA step alone
    ((2, 6, 10, 15), 128),  # the seed's proportions: 2 * 30/40 ~ 1.5 -> 2 (0-1 window-only), 6, 10.5 -> 10, 15
    ((15,), 128),  # the pivot alone: every encoder layer window-only
    ((4, 9, 14, 15), 128),  # convert's default sources
    ((2, 6, 10, 15), 64),  # the seed's sources, convert's default window
    ((2, 6, 10, 15, 20, 25), 128),  # more decoder sources (the pivot is no longer the last: a wider cache)
]


def score(model: torch.nn.Module, texts: Path) -> dict[str, float]:
    with torch.no_grad():
        return {n: perplexity(model, np.load(texts / f"{n}.npy"), seq_len=512).ppl for n in TEXTS}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="smollm2-135m-instruct")
    ap.add_argument("--mla", nargs="+", default=["2", "352+32"], help="compressions (2) or ranks (352+32) of the MLA step")
    ap.add_argument("--layouts", type=int, nargs="+", default=None, help="indices into LAYOUTS (default: all)")
    ap.add_argument("--rope-fit", action=argparse.BooleanOptionalAction, default=False, help="CEDGraftConfig.rope_fit")
    ap.add_argument("--texts", type=Path, default=Path("runs/real-texts"))
    ap.add_argument("--out", type=Path, default=Path("runs/bench/real_ced_layouts"))
    ap.add_argument("--threads", type=int, default=2)
    a = ap.parse_args()
    settings: list[tuple[str, dict]] = []
    for text in a.mla:
        try:
            if "+" in text:
                dc, dr = (int(v) for v in text.split("+"))
                settings.append((text, {"kv_lora_rank": dc, "qk_rope_head_dim": dr}))
            else:
                settings.append((text, {"compression": float(text)}))
        except ValueError:
            raise SystemExit(f"--mla {text!r} is neither a compression (2) nor ranks D_C+D_ROPE (352+32)") from None
    if not all((a.texts / f"{n}.npy").is_file() for n in TEXTS):
        raise SystemExit(f"{a.texts} lacks the held-out texts: run bench/real_texts.py first")
    torch.set_num_threads(a.threads)
    a.out.mkdir(parents=True, exist_ok=True)
    path = a.out / "results.json"
    results: dict = json.loads(path.read_text()) if path.is_file() else {"rows": []}
    done = {(str(r["mla"]), tuple(r["kv_source_layers"]), r["window"], r.get("rope_fit", False)) for r in results["rows"]}
    src = resolve_model(a.model)
    if "original" not in results:
        original = load_pretrained(src, dtype=torch.float32).eval()
        results["original"] = score(original, a.texts)
        results["original_kv_bytes"] = {str(t): original.config.kv_cache_bytes(t, 2) for t in CONTEXTS}
        del original
        atomic_write_json(path, results, indent=2)
    base = results["original"]
    print("original", base, flush=True)
    for c, ranks in settings:
        mla_dir = a.out / (f"mla-c{c}" if "+" not in c else f"mla-{c}")
        if not (mla_dir / "conversion.json").is_file():
            t0 = time.perf_counter()
            convert(src, mla_dir, ConvertOptions(**ranks, rope_selection="shared", rope_rotation="real", overwrite=True))
            print(f"MLA step {c}: {time.perf_counter() - t0:.0f} s", flush=True)
        mla = load_pretrained(mla_dir, dtype=torch.float32).eval()
        calib = load_calibration(src, None, 32768, 512, load_tokenizer_dir(src), mla.config.vocab_size)
        chosen = LAYOUTS if a.layouts is None else [LAYOUTS[i] for i in a.layouts]
        for sources, window in chosen:
            sources = tuple(s for s in sources if s < mla.config.num_layers)
            if (c, sources, window, a.rope_fit) in done:
                continue
            t0 = time.perf_counter()
            g = CEDGraftConfig(sources, sliding_window=window, rope_fit=a.rope_fit)
            ced, report = graft_ced(mla, g, calib, progress=False)
            graft_s = time.perf_counter() - t0
            ppl = score(ced.eval(), a.texts)
            row = {
                "mla": c,
                "rope_fit": a.rope_fit,
                "kv_source_layers": list(sources),
                "window": window,
                "d_c": mla.config.kv_lora_rank,
                "d_rope": mla.config.qk_rope_head_dim,
                "ppl": ppl,
                "ratio": {n: ppl[n] / base[n] for n in TEXTS},
                "kv_bytes": {str(t): ced.config.kv_cache_bytes(t, 2) for t in CONTEXTS},
                "reader_residuals": {str(k): round(v["relative_residual"], 4) for k, v in report["readers"].items()},
                "rope_residuals": {
                    str(k): round(v["rope_relative_residual"], 4)
                    for k, v in report["readers"].items()
                    if "rope_relative_residual" in v
                },
                "graft_s": graft_s,
            }
            results["rows"].append(row)
            atomic_write_json(path, results, indent=2)
            print(
                json.dumps({k: row[k] for k in ("mla", "rope_fit", "kv_source_layers", "window", "ratio", "kv_bytes")}),
                flush=True,
            )
            del ced
        del mla


if __name__ == "__main__":
    main()
