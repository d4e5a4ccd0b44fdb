"""In-domain vs out-of-domain one-shot perplexity of MLA grafts, kvgraft format vs stock DeepSeek-V3 export.

    .venv/bin/python bench/ood_text.py        # once: runs/ood/debian-reference.npy
    .venv/bin/python bench/mla_ood.py [--compressions 4] [--shrinkages 0 0.25 0.5] [--out runs/bench/mla_ood]

For each compression and each calibration shrinkage (GraftConfig.calibration_shrinkage), the reference
model is grafted with the ``kvgraft convert`` defaults (attention-aware, layer-wise, RoPE expectation,
complex head rotation, ranks from ``kvgraft.graft.ranks.default_ranks``) twice: as ``--format kvgraft`` does
(rope selection "norm") and as ``--format deepseek_v3`` does (rope selection "prefix" with the stock rule's
d_rope, d_c - 1 so that the exported latent RMSNorm's constant coordinate keeps the budget). The stock graft
is exported with ``export_deepseek_v3`` and scored *through stock transformers* (DeepseekV3ForCausalLM).
``--rope-rotation real`` / ``--stock-selection stride`` give the older defaults. Every model is
scored on the model's in-domain held-out slice (``eval/heldout.npy``) and the out-of-domain text
(the Debian Reference manual, ``kvgraft.data.ood``); ratios are against the original on the same text.
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time
from pathlib import Path

import torch

from kvgraft.atomic import atomic_write_json
from kvgraft.eval import perplexity
from kvgraft.graft.calibration import load_calibration
from kvgraft.graft.mla import GraftConfig, graft_mla
from kvgraft.graft.ranks import STOCK_ROPE_SELECTION, default_ranks
from kvgraft.hf import load_pretrained
from kvgraft.reference import resolve_model


class _Stock(torch.nn.Module):
    """A stock transformers model behind kvgraft's ``model(ids) -> logits`` interface (for ``perplexity``)."""

    def __init__(self, hf, config):
        super().__init__()
        self.hf = hf
        self.config = config

    def forward(self, ids):
        return self.hf(ids).logits


def graft(
    model,
    compression: float,
    stock: bool,
    shrinkage: float,
    calib,
    rotation: str = "complex",
    stock_selection: str = STOCK_ROPE_SELECTION,
    construction: str = "engines",
    **overrides,
) -> tuple:
    cfg = model.config
    ranks = default_ranks(cfg, compression=compression, stock=stock, stock_layout=stock_selection)
    d_c, d_rope = ranks.kv_lora_rank, ranks.qk_rope_head_dim
    if stock and construction == "transformers" and d_c > 1:
        d_c -= 1  # as convert does: the exact export's constant latent coordinate takes one value of the budget
    kw = {
        "kv_lora_rank": d_c,
        "qk_rope_head_dim": d_rope,
        "objective": "attention",
        "rope_selection": stock_selection if stock else "norm",
        "layerwise": True,
        "rope_expectation": True,
        "calibration_shrinkage": shrinkage,
        "rope_rotation": rotation,
    }
    kw.update(overrides)
    g = GraftConfig(**kw)
    t0 = time.perf_counter()
    new = graft_mla(model, g, calib, progress=False)
    return new, g, time.perf_counter() - t0


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default=None)
    ap.add_argument("--ood", default="runs/ood/debian-reference.npy", help="bench/ood_text.py's output")
    ap.add_argument("--compressions", type=float, nargs="+", default=[4.0])
    ap.add_argument("--shrinkages", type=float, nargs="+", default=[0.0])
    ap.add_argument("--formats", nargs="+", default=["kvgraft", "deepseek_v3"], choices=["kvgraft", "deepseek_v3"])
    ap.add_argument(
        "--extra",
        nargs="*",
        default=[],
        metavar="SELECTION:D_ROPE:SHRINKAGE[:ROTATION]",
        help="more grafts scored in kvgraft format at the stock export's budget (d_c = budget - d_rope - 1, "
        "the constant latent coordinate's value left free), e.g. prefix:16:0 (candidate stock layouts); "
        "with --extra-stock, stride/prefix ones are exported and scored through stock transformers",
    )
    ap.add_argument("--extra-stock", action="store_true")
    ap.add_argument("--rope-rotation", choices=["real", "complex"], default="complex")
    ap.add_argument("--stock-selection", choices=["prefix", "stride"], default=STOCK_ROPE_SELECTION)
    ap.add_argument(
        "--stock-constructions",
        nargs="+",
        choices=["engines", "transformers"],
        default=["engines"],
        help="stock export constructions to score (convert's --stock-construction): engines = no "
        "attention biases, latent norm fitted (the default); transformers = the exact "
        "constructions held in attention biases",
    )
    ap.add_argument("--eval-tokens", type=int, default=65536)
    ap.add_argument("--calibration-tokens", type=int, default=32768)
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument("--out", default="runs/bench/mla_ood")
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    path = resolve_model(args.model)
    model = load_pretrained(path, dtype=torch.float32)
    cfg = model.config
    texts = {"in-domain": path / "eval" / "heldout.npy", "out-of-domain": Path(args.ood)}
    calib = load_calibration(path, None, args.calibration_tokens, cfg.max_position_embeddings)

    def score(m) -> dict:
        return {k: perplexity(m, v, max_tokens=args.eval_tokens, progress=False).ppl for k, v in texts.items()}

    def stock_score(new, construction: str = "engines") -> tuple[dict, dict]:
        import warnings

        from kvgraft.hf.deepseek import ExportOptions, export_deepseek_v3, load_stock

        with tempfile.TemporaryDirectory() as tmp, warnings.catch_warnings():
            warnings.simplefilter("ignore")  # the transformers construction warns that it is transformers-only
            report = export_deepseek_v3(
                new, Path(tmp) / "ds", ExportOptions(tail_sequences=4, verbose=False, target=construction), calibration=calib
            )
            params = json.loads((Path(tmp) / "ds" / "config.json").read_text())["rope_parameters"]
            extra = {
                "exported_kv_lora_rank": report.kv_lora_rank,
                "latent_norm": report.latent_norm,
                "stock_construction": construction,
                "export_max_abs_logit_diff": report.max_abs_logit_diff,
                "rope_parameters": params,
            }
            print(
                f"  export: max |logit diff| vs kvgraft {report.max_abs_logit_diff:.3g}, kv_lora_rank "
                f"{report.kv_lora_rank}, rope {params}",
                flush=True,
            )
            return score(_Stock(load_stock(Path(tmp) / "ds"), cfg)), extra

    base = score(model)
    print("original: " + ", ".join(f"{k} {v:.3f}" for k, v in base.items()), flush=True)
    rows = [{"compression": 1.0, "format": "original", "shrinkage": None, "ppl": base}]
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    for compression in args.compressions:
        for shrinkage in args.shrinkages:
            variants = [(fmt, c) for fmt in args.formats for c in (args.stock_constructions if fmt == "deepseek_v3" else [None])]
            for fmt, construction in variants:
                stock = fmt == "deepseek_v3"
                try:
                    new, g, seconds = graft(
                        model,
                        compression,
                        stock,
                        shrinkage,
                        calib,
                        args.rope_rotation,
                        args.stock_selection,
                        construction=construction or "engines",
                    )
                except ValueError as exc:
                    print(f"skip {compression}x {fmt}: {exc}")
                    continue
                extra = {}
                if stock:
                    scored, extra = stock_score(new, construction)
                    fmt = f"deepseek_v3 ({construction})"
                else:
                    scored = score(new)
                row = {
                    "compression": compression,
                    "format": fmt,
                    "shrinkage": shrinkage,
                    "rope_selection": g.rope_selection,
                    "rope_rotation": g.rope_rotation,
                    "kv_lora_rank": g.kv_lora_rank,
                    "rope_dim": g.qk_rope_head_dim,
                    "graft_seconds": seconds,
                    "ppl": scored,
                    "ratio": {k: scored[k] / base[k] for k in base},
                    **extra,
                }
                rows.append(row)
                print(
                    f"{compression:g}x {fmt + ' ' + g.rope_selection + ' ' + g.rope_rotation:<24} shrink {shrinkage:<5g} d_c {g.kv_lora_rank:<3} d_rope "
                    f"{g.qk_rope_head_dim:<3} "
                    + "  ".join(f"{k} {scored[k]:.3f} ({scored[k] / base[k]:.3f}x)" for k in base)
                    + f"  graft {seconds:.0f} s",
                    flush=True,
                )
                atomic_write_json(
                    out / "results.json", {"model": str(path), "texts": {k: str(v) for k, v in texts.items()}, "rows": rows}
                )
        for spec in args.extra:
            selection, d_rope, shrinkage, *rest = spec.split(":")
            d_rope, shrinkage = int(d_rope), float(shrinkage)
            rotation = rest[0] if rest else args.rope_rotation
            budget = int(cfg.kv_width / compression)
            try:
                new, g, seconds = graft(
                    model,
                    compression,
                    False,
                    shrinkage,
                    calib,
                    rotation,
                    rope_selection=selection,
                    qk_rope_head_dim=d_rope,
                    kv_lora_rank=budget - d_rope - 1,
                )
            except ValueError as exc:
                print(f"skip {spec}: {exc}")
                continue
            extra, how = {}, "kvgraft"
            if args.extra_stock and selection in ("stride", "prefix"):
                scored, extra = stock_score(new)
                how = "deepseek_v3"
            else:
                scored = score(new)
            rows.append(
                {
                    "compression": compression,
                    "format": f"{how} ({selection}, stock budget)",
                    "rope_selection": selection,
                    "rope_rotation": rotation,
                    "shrinkage": shrinkage,
                    "kv_lora_rank": g.kv_lora_rank,
                    "rope_dim": d_rope,
                    "graft_seconds": seconds,
                    "ppl": scored,
                    "ratio": {k: scored[k] / base[k] for k in base},
                    **extra,
                }
            )
            print(
                f"{compression:g}x {how + ' ' + selection + ' ' + rotation:<24} shrink {shrinkage:<5g} d_c {g.kv_lora_rank:<3} "
                f"d_rope {d_rope:<3} "
                + "  ".join(f"{k} {scored[k]:.3f} ({scored[k] / base[k]:.3f}x)" for k in base)
                + f"  graft {seconds:.0f} s",
                flush=True,
            )
            atomic_write_json(
                out / "results.json", {"model": str(path), "texts": {k: str(v) for k, v in texts.items()}, "rows": rows}
            )
    print(f"wrote {out / 'results.json'}")


if __name__ == "__main__":
    main()
