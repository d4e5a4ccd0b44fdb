"""Default conversion of every supported family, kvgraft format and stock DeepSeek-V3 export, at full budget and 4x.

    .venv/bin/python bench/families.py [--out runs/bench/families] [--cases llama qwen2 ...]

For each family a tiny random checkpoint is built with stock transformers (2 layers, hidden 64, 4 query heads,
2 KV heads of 16 unless the case says otherwise, non-zero biases and norm weights, q/k weights scaled up so
that attention is not uniform; 4096 random calibration tokens in eval/calibration.npy), then converted with
the defaults twice per budget: ``kvgraft convert DIR --out OUT`` (kvgraft format) and ``--format deepseek_v3``
(stock export). Budgets: "full" (``--kv-lora-rank`` = the KV width, every other choice the default rule's) and
"4x" (no flags). Each result is compared with the original transformers model on 4 held-out random sequences
of 64 tokens (fp32): max |logit difference|. For the stock export the table also gives what the exporter
measured against the graft it came from, the calibration-tail perplexities (original -> export), and for a
sliding-window model the error within the window; a refused export gives its message.
Prints a markdown table (the one in bench/RESULTS.md) and writes results.json.
"""

from __future__ import annotations

import argparse
import contextlib
import io
import time
import warnings
from pathlib import Path

import numpy as np
import torch

from kvgraft.atomic import atomic_write_json

TINY = dict(
    vocab_size=96,
    hidden_size=64,
    intermediate_size=96,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=64,
    rms_norm_eps=1e-5,
    head_dim=16,
)
CASES = {
    # name: (model_type, extra config, what it exercises)
    "llama": ("llama", {}, "plain"),
    "llama-attention-bias": ("llama", {"attention_bias": True}, "q/k/v/o biases"),
    "qwen2": ("qwen2", {}, "q/k/v biases"),
    "qwen3": ("qwen3", {}, "per-head q/k norms"),
    "mistral": ("mistral", {"sliding_window": 12}, "sliding window 12"),
    "llama-yarn": (
        "llama",
        {"rope_scaling": {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 16}},
        "yarn x4",
    ),
    "llama-mqa": ("llama", {"num_key_value_heads": 1}, "1 KV head"),
    "llama-mha": ("llama", {"num_key_value_heads": 4}, "4 KV heads (MHA)"),
    "llama-dynamic": ("llama", {"rope_scaling": {"rope_type": "dynamic", "factor": 2.0}}, "dynamic NTK x2"),
    "llama-mlp-bias": ("llama", {"mlp_bias": True}, "MLP biases"),
}
# besides "full" and "4x": the exact kvgraft layout at full budget (every KV head's RoPE pairs kept)
EXACT_LAYOUT_CASES = ("llama",)
EVAL = torch.randint(0, 96, (4, 64), generator=torch.Generator().manual_seed(123))


def build(root: Path, name: str):
    import transformers

    family, extra, _ = CASES[name]
    cfg = transformers.AutoConfig.for_model(family, **(TINY | extra))
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(cfg).eval()
    with torch.no_grad():  # non-trivial biases and norm weights (transformers initialises them to 0 / 1)
        for pname, p in model.named_parameters():
            if pname.endswith("bias"):
                p.normal_(0, 0.3)
            elif "norm" in pname:
                p.uniform_(0.6, 1.4)
            elif "k_proj" in pname or "q_proj" in pname:
                p.mul_(4)
    path = root / name
    model.save_pretrained(path)
    (path / "eval").mkdir()
    np.save(path / "eval" / "calibration.npy", np.random.default_rng(0).integers(0, 96, 4096).astype(np.uint16))
    return model, path, cfg


def run_case(root: Path, name: str) -> list[dict]:
    import transformers

    from kvgraft.graft.convert import convert
    from kvgraft.graft.options import ConvertOptions
    from kvgraft.hf import load_pretrained

    hf, path, cfg = build(root, name)
    width = 2 * cfg.num_key_value_heads * cfg.head_dim
    window = getattr(cfg, "sliding_window", None) if name == "mistral" else None
    with torch.no_grad():
        want = hf(EVAL).logits
    rows = []
    budgets = [("full", {"kv_lora_rank": width}), ("4x", {})]
    if name in EXACT_LAYOUT_CASES:
        budgets.insert(
            1,
            (
                "full, --rope-dim KV heads x head_dim",
                {"kv_lora_rank": width, "qk_rope_head_dim": cfg.num_key_value_heads * cfg.head_dim},
            ),
        )
    for budget, kwargs in budgets:
        row = {"case": name, "what": CASES[name][2], "budget": budget, "kv_width": width}
        t0 = time.perf_counter()
        out = root / f"{name}-{budget}-kvgraft"
        ours = None
        try:
            convert(path, out, ConvertOptions(progress=False, **kwargs))
            ours = load_pretrained(out)
        except Exception as exc:  # the kvgraft format refuses too (e.g. a budget with no room for a latent)
            row["kvgraft_refusal"] = f"{type(exc).__name__}: {exc}"
        if ours is not None:
            with torch.no_grad():
                row["kvgraft_max_abs_logit_diff"] = float((ours(EVAL) - want).abs().max())
            row["kvgraft_ranks"] = f"{ours.config.kv_lora_rank} + {ours.config.qk_rope_head_dim}"
        out = root / f"{name}-{budget}-stock"
        printed = io.StringIO()
        try:
            with contextlib.redirect_stdout(printed):
                # written whatever it measures (the table reports the error; a windowed case is far off beyond W)
                record = convert(
                    path, out, ConvertOptions(output_format="deepseek_v3", progress=True, accept_export_error=True, **kwargs)
                ).to_dict()
        except Exception as exc:  # a refusal: its message is the result
            row["stock"] = "refused"
            row["stock_refusal"] = f"{type(exc).__name__}: {exc}"
        else:
            ds = record["deepseek_v3"]
            stock = transformers.AutoModelForCausalLM.from_pretrained(out / "deepseek_v3").eval()
            with torch.no_grad():
                got = stock(EVAL).logits
                row["stock_max_abs_logit_diff"] = float((got - want).abs().max())
                if window:
                    w = EVAL[:, :window]
                    row["stock_within_window_vs_original"] = float((stock(w).logits - hf(w).logits).abs().max())
            row["stock"] = (
                "exact"
                if ds["exact"]
                else (f"exact up to {ds['exact_up_to_tokens']} tokens" if ds["exact_up_to_tokens"] else "approximate")
            )
            if record.get("qk_norm_linearised_for_stock_export"):
                row["stock"] = "approximate: q/k norms linearised by the graft (the export itself exact)"
            row["stock_ranks"] = f"{ds['kv_lora_rank']} + {record['graft']['qk_rope_head_dim']}"
            row["export_vs_its_graft"] = ds["max_abs_logit_diff"]
            row["export_vs_its_graft_within_window"] = ds["max_abs_logit_diff_within_window"]
            row["tail_perplexity"] = {
                "original": record["calibration_tail"]["original_perplexity"],
                "graft": record["calibration_tail"]["converted_perplexity"],
                "export": ds["perplexity"]["deepseek_v3"],
            }
            row["q_lora_rank"] = ds["q_lora_rank"]
            row["exporter_report"] = printed.getvalue().strip().splitlines()
        row["seconds"] = time.perf_counter() - t0
        rows.append(row)
        print(f"{name} {budget}: done in {row['seconds']:.1f} s", flush=True)
    return rows


def table(rows: list[dict]) -> str:
    lines = [
        (
            "| family | budget | kvgraft format: d_c + d_rope | max \\|Δlogit\\| vs original | stock export | "
            "stock d_c + d_rope | max \\|Δlogit\\| vs original | export vs its graft (exporter) | "
            "calibration-tail ppl: original / graft / export |"
        ),
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        if r["stock"] == "refused":
            stock = f"refused: {r['stock_refusal']}", "-", "-", "-", "-"
        else:
            vs = f"{r['stock_max_abs_logit_diff']:.3g}"
            if "stock_within_window_vs_original" in r:
                vs += f" ({r['stock_within_window_vs_original']:.3g} within the window)"
            ranks = r["stock_ranks"] + (f", q_lora_rank {r['q_lora_rank']}" if r["q_lora_rank"] else "")
            p = r["tail_perplexity"]
            own = f"{r['export_vs_its_graft']:.2g}"
            if r.get("export_vs_its_graft_within_window") is not None:
                own += f" ({r['export_vs_its_graft_within_window']:.2g} within the window)"
            stock = (r["stock"], ranks, vs, own, f"{p['original']:.2f} / {p['graft']:.2f} / {p['export']:.2f}")
        values = r["kv_width"] // 4 if r["budget"] == "4x" else r["kv_width"]
        kv = (
            (r["kvgraft_ranks"], f"{r['kvgraft_max_abs_logit_diff']:.3g}")
            if "kvgraft_ranks" in r
            else (f"refused: {r['kvgraft_refusal']}", "-")
        )
        lines.append(
            f"| {r['case']} ({r['what']}) | {r['budget']} ({values} values) | "
            + " | ".join(kv)
            + " | "
            + " | ".join(stock)
            + " |"
        )
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default="runs/bench/families")
    ap.add_argument("--cases", nargs="+", default=list(CASES), choices=list(CASES))
    args = ap.parse_args()
    out = Path(args.out)
    if out.exists() and any(out.iterdir()):
        raise SystemExit(f"{out} exists and is not empty; pass another --out")
    out.mkdir(parents=True, exist_ok=True)
    warnings.filterwarnings("ignore")
    torch.manual_seed(0)
    rows = []
    for name in args.cases:
        rows += run_case(out / "models", name)
    atomic_write_json((out / "results.json"), rows, indent=2)
    print(table(rows))


if __name__ == "__main__":
    main()
