"""Package a finished pretraining run as a shipped reference model with its card.

The result is a plain Hugging Face model directory (config.json, model.safetensors, tokenizer files,
generation_config.json) that ``transformers.AutoModelForCausalLM.from_pretrained`` loads (without
kvgraft for a Llama-architecture model; after ``import kvgraft.hf`` for kvgraft's own format), plus ``eval/calibration.npy`` (a slice of the train split, for calibrating conversions),
``eval/heldout.npy`` (a slice of the test split, never trained on), ``loss.png``, ``training.json``
and ``README.md`` (the card).
"""

from __future__ import annotations

import json
import math
import shutil
from pathlib import Path

from kvgraft.atomic import atomic_dir
from kvgraft.data import spread_tokens
from kvgraft.eval import perplexity
from kvgraft.hf import load_pretrained
from kvgraft.hf.config_map import model_config_from_hf
from kvgraft.model.shapes import num_parameters


def ship_reference(
    run_dir: str | Path,
    data_dir: str | Path,
    out_dir: str | Path,
    command: str,
    calibration_tokens: int = 65536,
    heldout_tokens: int = 65536,
    overwrite: bool = False,
    compare_with: str | Path | None = None,
) -> Path:
    """Copy ``run_dir/final`` to ``out_dir`` with eval slices, the loss curve, the training log and a model
    card. ``compare_with``: another shipped reference model (e.g. the Llama one) to compare with in the card:
    held-out perplexity on this model's held-out slice and KV bytes per sequence at 512 and 4K tokens."""
    run_dir, data_dir, out_dir = Path(run_dir), Path(data_dir), Path(out_dir)
    final = run_dir / "final"
    if not (final / "config.json").is_file():
        raise FileNotFoundError(f"{final} has no exported model; finish the run with `kvgraft pretrain` first")

    log = [json.loads(line) for line in (run_dir / "log.jsonl").read_text().splitlines() if line.strip()]
    summary = json.loads((final / "training_summary.json").read_text())
    train_cfg = json.loads((run_dir / "train_config.json").read_text())
    prepare = json.loads((data_dir / "prepare.json").read_text())
    with atomic_dir(out_dir, overwrite=overwrite) as tmp:
        for f in final.iterdir():
            if f.is_file():
                shutil.copy2(f, tmp / f.name)
        (tmp / "eval").mkdir()
        chunk = summary["seq_len"]
        n_cal = spread_tokens(data_dir / "tokens" / "train.npy", calibration_tokens, chunk, tmp / "eval" / "calibration.npy")
        n_held = spread_tokens(data_dir / "tokens" / "test.npy", heldout_tokens, chunk, tmp / "eval" / "heldout.npy")
        if (run_dir / "loss.png").exists():
            shutil.copy2(run_dir / "loss.png", tmp / "loss.png")
        shutil.copy2(run_dir / "log.jsonl", tmp / "training_log.jsonl")
        model = load_pretrained(tmp)
        held = perplexity(model, tmp / "eval" / "heldout.npy", seq_len=summary["seq_len"], progress=False)
        val_rows = [r for r in log if "val_loss" in r]
        train_rows = [r for r in log if "loss" in r]
        tail = train_rows[-10:]
        record = {
            "command": command,
            "steps": summary["steps"],
            "tokens_seen": summary["tokens"],
            "seq_len": summary["seq_len"],
            "final_train_loss_mean_last_10_logged": sum(r["loss"] for r in tail) / max(len(tail), 1),
            "final_val_loss": val_rows[-1]["val_loss"] if val_rows else None,
            "final_val_ppl": math.exp(val_rows[-1]["val_loss"]) if val_rows else None,
            "heldout_loss": held.loss,
            "heldout_ppl": held.ppl,
            "heldout_tokens_scored": held.tokens_scored,
            "calibration_tokens": n_cal,
            "heldout_tokens": n_held,
            "train_config": train_cfg,
            "data": {k: prepare[k] for k in ("sources", "packages", "seed", "val_fraction", "test_fraction", "vocab_size")},
            "splits": {
                s: {k: v[k] for k in ("documents", "documents_by_source", "tokens", "bytes_per_token")}
                for s, v in prepare["splits"].items()
            },
            "wall_time_s": train_rows[-1]["elapsed_s"] if train_rows else None,
            "kv_cache_bytes_bf16": {str(n): model.config.kv_cache_bytes(n, 2) for n in (512, 4096)},
            "parameters": num_parameters(model.config),
            "run_dir_name": run_dir.name,
        }
        if compare_with is not None:
            record["compared_with"] = _comparison(Path(compare_with), tmp / "eval" / "heldout.npy", summary["seq_len"], val_rows)
        (tmp / "training.json").write_text(json.dumps(record, indent=2) + "\n")
        config = json.loads((tmp / "config.json").read_text())
        (tmp / "README.md").write_text(model_card(out_dir.name, config, record))
    return out_dir


def _comparison(other_dir: Path, heldout, seq_len: int, val_rows: list[dict]) -> dict:
    """The other reference model on this model's held-out slice, its card's figures, both caches' sizes."""

    other = load_pretrained(other_dir)
    held = perplexity(other, heldout, seq_len=seq_len, progress=False)
    card = json.loads((other_dir / "training.json").read_text())
    return {
        "name": other_dir.name,
        "parameters": num_parameters(other.config),
        "tokens_seen": card["tokens_seen"],
        "final_val_ppl": card["final_val_ppl"],
        "heldout_ppl": held.ppl,
        "kv_cache_bytes_bf16": {str(n): other.config.kv_cache_bytes(n, 2) for n in (512, 4096)},
    }


def _attention_rows(config: dict) -> str:
    if config.get("model_type") != "kvgraft":
        H, K = config["num_attention_heads"], config["num_key_value_heads"]
        return f"| attention | {H} query heads x {config.get('head_dim')} dims, {K} KV heads (GQA {H // K}:1) |"
    c = config["kvgraft"]
    if c.get("kv_source_layers") is None:
        return f"| attention | {', '.join(sorted(set(c['attention_kinds'])))} (kvgraft format) |"
    src = c["kv_source_layers"]
    return "\n".join(
        [
            f"| attention | causal encoder-decoder: kv_source layers {', '.join(map(str, src))} (pivot {src[-1]}); "
            f"layers before {src[0]} read only their window |",
            f"| shared KV | per kv_source layer one entry per {c['compress_rate']} tokens (gated pooling): latent "
            f"d_c {c['kv_lora_rank']}{' (RMS-normalised)' if c['mla_latent_norm'] else ''} + RoPE key d_rope "
            f"{c['qk_rope_head_dim']}; each layer reads it through its own up-projection |",
            f"| window | last {c['sliding_window']} tokens per layer, {c['num_kv_heads']} K/V heads, keys "
            f"{c['qk_nope_head_dim']} + {c['qk_rope_head_dim']} (RoPE) dims, values {c['v_head_dim']} |",
            f"| queries | {c['num_heads']} heads x {c['qk_nope_head_dim']} + {c['qk_rope_head_dim']} dims, one softmax "
            "over window and shared entries |",
        ]
    )


def _comparison_section(r: dict) -> str:
    o = r.get("compared_with")
    if not o:
        return ""
    kv, okv = r["kv_cache_bytes_bf16"], o["kv_cache_bytes_bf16"]
    return f"""
## Compared with {o["name"]}
Same data, tokenizer and width; held-out perplexity on this card's `eval/heldout.npy`; KV cache bytes per
sequence in bf16 (measured equal to the formula by the tests and `bench/ced_decode.py`).

| | this model | {o["name"]} | ratio |
|---|---:|---:|---:|
| parameters | {r["parameters"]:,} | {o["parameters"]:,} | {r["parameters"] / o["parameters"]:.3f} |
| training tokens | {r["tokens_seen"]:,} | {o["tokens_seen"]:,} | {r["tokens_seen"] / o["tokens_seen"]:.3f} |
| validation perplexity | {_f(r["final_val_ppl"], ".2f")} | {_f(o["final_val_ppl"], ".2f")} | {r["final_val_ppl"] / o["final_val_ppl"]:.3f} |
| held-out perplexity | {r["heldout_ppl"]:.2f} | {o["heldout_ppl"]:.2f} | {r["heldout_ppl"] / o["heldout_ppl"]:.3f} |
| KV bytes / sequence at 512 tokens | {kv["512"]:,} | {okv["512"]:,} | {kv["512"] / okv["512"]:.3f} |
| KV bytes / sequence at 4,096 tokens | {kv["4096"]:,} | {okv["4096"]:,} | {kv["4096"] / okv["4096"]:.3f} |
| KV bytes / token at 512 / 4,096 | {kv["512"] / 512:,.0f} / {kv["4096"] / 4096:,.0f} | {okv["512"] / 512:,.0f} / {okv["4096"] / 4096:,.0f} | |
"""


def model_card(name: str, config: dict, r: dict) -> str:
    tc = r["train_config"]
    splits = "\n".join(
        f"| {s} | {v['documents']:,} | {v['tokens']:,} | {v['bytes_per_token']:.2f} | "
        + ", ".join(f"{k} {n}" for k, n in v["documents_by_source"].items())
        + " |"
        for s, v in r["splits"].items()
    )
    params = r.get("parameters") or _count_params(config)
    if config.get("model_type") == "kvgraft":  # the fields the card shows, from the ModelConfig inside
        c = config["kvgraft"]
        config = {
            **config,
            "intermediate_size": c["intermediate_size"],
            "rms_norm_eps": c["rms_norm_eps"],
            "rope_theta": c["rope"]["theta"],
            "head_dim": c["head_dim"],
            "num_key_value_heads": c["num_kv_heads"],
        }
    arch = f"{config['model_type']}-architecture"
    if config.get("kvgraft", {}).get("kv_source_layers"):
        arch = "causal encoder-decoder (kvgraft's cross-layer shared compressed KV + sliding windows)"
    loads = (
        "It loads with plain `transformers.AutoModelForCausalLM.from_pretrained` (no kvgraft import needed)."
        if config["model_type"] != "kvgraft"
        else "It is in kvgraft's own format: `transformers.AutoModelForCausalLM.from_pretrained` loads it after "
        "`import kvgraft.hf`, and `kvgraft.hf.load_pretrained` loads it as kvgraft's model."
    )
    return f"""# {name}

A small {arch} causal LM trained from scratch by kvgraft on public-domain and
freely licensed text, shipped with kvgraft as a reference model. {loads}

## Config
| field | value |
|---|---|
| parameters | {params:,} (tied input/output embeddings) |
| layers | {config["num_hidden_layers"]} |
| hidden size | {config["hidden_size"]} |
{_attention_rows(config)}
| MLP | SwiGLU, intermediate {config["intermediate_size"]} |
| vocabulary | {config["vocab_size"]} (byte-level BPE, `tokenizer.json`) |
| context | {config["max_position_embeddings"]} tokens, RoPE theta {config.get("rope_theta", (config.get("rope_parameters") or {}).get("rope_theta"))} |
| norm | RMSNorm, eps {config["rms_norm_eps"]} |
| weights | fp32 safetensors |

## Data
Debian packages, extracted by `kvgraft prepare-data` (split by document with a seeded hash; the KJV and
WEB versions of one Bible chapter always fall in the same split): sources {", ".join(r["data"]["sources"])}
(packages {", ".join(r["data"]["packages"])}). Bibles (KJV, World English Bible) and The Devil's
Dictionary are public domain; the Python documentation is under the PSF licence; the fortunes are from
the BSD-licensed `fortunes` package.

| split | documents | tokens | bytes/token | documents by source |
|---|---|---|---|---|
{splits}

Tokenizer: byte-level BPE, {r["data"]["vocab_size"]} entries, trained on the train split only;
`<|endoftext|>` (id 0) ends every document and serves as BOS/EOS/pad.

## Training
| | |
|---|---|
| optimizer | AdamW (beta {tc["beta1"]}, {tc["beta2"]}), weight decay {tc["weight_decay"]}, clip {tc["grad_clip"]} |
| learning rate | peak {tc["lr"]}, {tc["warmup_steps"]} warmup steps, cosine to {tc["min_lr_ratio"]}x over {tc["max_steps"]} steps |
| batch | {tc["micro_batch_size"]} x {r["seq_len"]} tokens x {tc["grad_accum"]} accumulation |
| precision | {tc["precision"]} autocast, fp32 master weights |
| steps taken | {r["steps"]:,} |
| tokens seen | {r["tokens_seen"]:,} |
| wall time | {(r["wall_time_s"] or 0) / 3600:.2f} h on a 2-core CPU |

## Results
| measure | value |
|---|---|
| final train loss (mean of last 10 logged steps) | {_f(r["final_train_loss_mean_last_10_logged"])} |
| final validation loss / perplexity | {_f(r["final_val_loss"])} / {_f(r["final_val_ppl"], ".2f")} |
| held-out (test split) loss / perplexity, `eval/heldout.npy` | {r["heldout_loss"]:.4f} / {r["heldout_ppl"]:.2f} ({r["heldout_tokens_scored"]:,} tokens, windows of {r["seq_len"]}) |

![loss curve](loss.png)
{_comparison_section(r)}
## Files
- `config.json`, `model.safetensors`, `generation_config.json`, `tokenizer.json`, `tokenizer_config.json`
- `eval/calibration.npy`: {r["calibration_tokens"]:,} tokens of the train split (uint16) in {r["seq_len"]}-token chunks spread evenly over it, for calibrating conversions
- `eval/heldout.npy`: {r["heldout_tokens"]:,} tokens of the test split (uint16) in {r["seq_len"]}-token chunks spread evenly over it, never trained on
- `training.json`: everything in this card, machine-readable; `training_log.jsonl`: the run's log

## Reproduce
```
make install
.venv/bin/python -m kvgraft prepare-data --out runs/data --sources {" ".join(r["data"]["sources"])}
{r["command"]}
.venv/bin/python -m kvgraft ship runs/{r.get("run_dir_name", "pretrain-llama-8m")} --data runs/data --out models/{name}{" --compare-with models/" + r["compared_with"]["name"] if r.get("compared_with") else ""}
```
Training is deterministic for a given machine and thread count; a rerun on other hardware gives close,
not bit-identical, losses.
"""


def _f(value: float | None, fmt: str = ".4f") -> str:
    return "n/a" if value is None else format(value, fmt)


def _count_params(config: dict) -> int:
    """Parameters of the model a config.json describes (any format kvgraft loads; for older training.json
    records without a "parameters" entry)."""

    return num_parameters(model_config_from_hf(config, "config.json"))
