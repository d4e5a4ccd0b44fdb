"""Healing curves: LM loss vs KL distillation vs attention-only LM, from one 4x MLA graft.

    .venv/bin/python bench/heal.py --data runs/data [--model models/kvgraft-llama-8m] [--fraction 0.03]

Converts the reference model at 4x (one shot), then heals three copies on the same data order with
the seed's recipe (peak LR 1/10 of the original's) for the same token budget, evaluating validation
perplexity every few steps. Prints, for each, the tokens needed to come within 2% of the original's
validation perplexity (as a fraction of the original's pretraining tokens) and whether it ends
below the original; writes JSON and one PNG with the original as a horizontal line.
"""

from __future__ import annotations

import argparse
import json
import math
import time
from pathlib import Path

import torch

from kvgraft.atomic import atomic_savefig, atomic_write_json
from kvgraft.data import PackedDataset
from kvgraft.graft.convert import convert
from kvgraft.graft.options import ConvertOptions
from kvgraft.hf import load_pretrained
from kvgraft.reference import resolve_model
from kvgraft.train.heal import HealConfig, HealOptions, heal, original_training
from kvgraft.train.loop import evaluate, lm_loss

VARIANTS = {
    "lm": HealConfig(loss="lm"),
    "kl": HealConfig(loss="kl"),
    "lm-attention-only": HealConfig(loss="lm", attention_only=True),
    # control: the unconverted original trained the same way on the same tokens, so that
    # "below the original" can be told apart from "the original was still improving"
    "control-original-lm": HealConfig(loss="lm"),
}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default=None)
    ap.add_argument("--data", required=True, help="the `kvgraft prepare-data` directory the model was trained on")
    ap.add_argument("--fraction", type=float, default=0.03, help="budget as a fraction of pretraining tokens")
    ap.add_argument("--micro-batch-size", type=int, default=8)
    ap.add_argument("--eval-every", type=int, default=5)
    ap.add_argument("--eval-batches", type=int, default=8)
    ap.add_argument("--variants", nargs="+", default=list(VARIANTS), choices=list(VARIANTS))
    ap.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's)")
    ap.add_argument("--out", default="runs/bench/heal")
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    src = resolve_model(args.model)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    record = original_training(src)
    pre_tokens = record["tokens_seen"]
    converted = out / "mla-4x"
    convert_record = None
    if not converted.exists():
        t0 = time.perf_counter()
        convert_record = convert(
            src, converted, ConvertOptions(compression=4.0, progress=False)
        ).to_dict()  # the convert defaults
        print(
            f"converted at the defaults in {time.perf_counter() - t0:.1f} s wall "
            f"(graft {convert_record['seconds']['convert']:.1f} s; ranks d_c "
            f"{convert_record['graft']['kv_lora_rank']}, d_rope {convert_record['graft']['qk_rope_head_dim']}, "
            f"rope selection {convert_record['graft']['rope_selection']})",
            flush=True,
        )
    original = load_pretrained(src, dtype=torch.float32)
    seq = original.config.max_position_embeddings
    val = PackedDataset(Path(args.data) / "tokens" / "validation.npy", seq)
    base_loss = evaluate(original, val, lm_loss, args.micro_batch_size, args.eval_batches)
    one_shot = evaluate(load_pretrained(converted, dtype=torch.float32), val, lm_loss, args.micro_batch_size, args.eval_batches)
    print(f"original validation ppl {math.exp(base_loss):.3f}; 4x graft one-shot {math.exp(one_shot):.3f}")
    overrides = dict(
        micro_batch_size=args.micro_batch_size,
        eval_every=args.eval_every,
        eval_batches=args.eval_batches,
        save_every=10_000,
        progress=False,
    )
    curves = {}
    for name in args.variants:
        run = out / name
        start = src if name.startswith("control") else converted
        heal(
            start,
            run,
            args.data,
            HealOptions(
                teacher=src,
                heal_config=HealConfig(**{**VARIANTS[name].__dict__, "fraction_of_pretraining": args.fraction}),
                train_overrides=overrides,
                original_lr=record["train_config"]["lr"],
                pretraining_tokens=pre_tokens,
            ),
        )
        rows = [json.loads(line) for line in (run / "log.jsonl").read_text().splitlines()]
        first = math.exp(base_loss) if name.startswith("control") else math.exp(one_shot)
        curves[name] = [(0, first)] + [(r["tokens"], math.exp(r["val_loss"])) for r in rows if "val_loss" in r]
    target = 1.02 * math.exp(base_loss)
    summary = {
        "original_val_ppl": math.exp(base_loss),
        "one_shot_val_ppl": math.exp(one_shot),
        "pretraining_tokens": pre_tokens,
        "fraction_budget": args.fraction,
        "graft": json.loads((converted / "conversion.json").read_text()).get("graft"),
        "variants": {},
    }
    print(f"\n{'variant':<20} {'final ppl':>10} {'vs original':>12} {'tokens to within 2%':>24}")
    print("(ppl of the original before healing; the control shows what the same tokens do to it)")
    for name, pts in curves.items():
        reach = next((t for t, p in pts if p <= target), None)
        final = pts[-1][1]
        summary["variants"][name] = {
            "curve": pts,
            "final_ppl": final,
            "tokens_to_2pct": reach,
            "fraction_to_2pct": reach / pre_tokens if reach is not None else None,
            "ends_below_original": final < math.exp(base_loss),
        }
        reach_s = "not reached" if reach is None else f"{reach:,} ({reach / pre_tokens:.2%})"
        print(f"{name:<20} {final:10.3f} {final / math.exp(base_loss):11.3f}x {reach_s:>24}")
    atomic_write_json((out / "results.json"), summary, indent=2)
    plot(curves, math.exp(base_loss), out / "heal.png", pre_tokens)
    print(f"\nwrote {out / 'results.json'} and {out / 'heal.png'}")


def plot(curves: dict, base_ppl: float, png: Path, pre_tokens: int) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4.2))
    for name, pts in curves.items():
        ax.plot([t / pre_tokens * 100 for t, _ in pts], [p for _, p in pts], "o-", ms=3, label=name)
    ax.axhline(base_ppl, color="k", ls="--", lw=1, label="original")
    ax.axhline(1.02 * base_ppl, color="gray", ls=":", lw=1, label="original + 2%")
    ax.set_xlabel("healing tokens (% of the original's pretraining tokens)")
    ax.set_ylabel("validation perplexity")
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    atomic_savefig(fig, png, dpi=110)
    plt.close(fig)


if __name__ == "__main__":
    main()
