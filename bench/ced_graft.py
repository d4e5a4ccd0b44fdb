"""The share graft benchmark: Llama reference -> causal encoder-decoder (one shot), healed, against the
original and against the from-scratch reference causal encoder-decoder at equal training tokens.

    OMP_NUM_THREADS=1 .venv/bin/python bench/ced_graft.py --data runs/data \
        [--model models/kvgraft-llama-8m] [--scratch-log runs/pretrain-ced-8m/log.jsonl] [--tokens 819200]

Steps: ``kvgraft convert MODEL --to ced`` (defaults: kv_source layers 1, 3, pivot 4, window 64, m = 1),
then ``kvgraft heal`` (KL distillation from the original, the seed's recipe) for ``--tokens`` tokens.
Validation perplexity is measured on the same first ``eval_batches x micro_batch`` validation sequences
the reference pretraining run evaluated on (16 x 12 x 512 tokens), so the from-scratch model's logged
curve is comparable: its validation perplexity at the same number of training tokens is read from its
log (``--scratch-log``; the shipped model's ``models/kvgraft-ced-8m/training_log.jsonl`` by default).
Prints one table, writes JSON and a PNG (healing curve with the from-scratch curve and the original).
"""

from __future__ import annotations

import argparse
import json
import math
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


def scratch_curve(log: Path) -> list[tuple[int, float]]:
    rows = [json.loads(line) for line in log.read_text().splitlines() if line.strip()]
    return [(r["tokens"], math.exp(r["val_loss"])) for r in rows if "val_loss" in r]


def at_tokens(curve: list[tuple[int, float]], tokens: int) -> tuple[int, float] | None:
    """The logged point with the most tokens not above ``tokens`` (None if the curve starts later)."""
    before = [pt for pt in curve if pt[0] <= tokens]
    return before[-1] if before else None


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default=None, help="the original (default: the shipped Llama reference)")
    ap.add_argument("--data", required=True, help="the `kvgraft prepare-data` directory")
    ap.add_argument("--scratch-log", default=None, help="log.jsonl of the from-scratch CED pretraining")
    ap.add_argument("--tokens", type=int, default=819_200, help="healing budget (default: 100 steps of 16 x 512)")
    ap.add_argument("--loss", choices=["lm", "kl", "mix"], default="kl")
    ap.add_argument("--lr", type=float, default=None, help="peak LR (default: the recipe's, original's / 10)")
    ap.add_argument("--kv-source-layers", type=int, nargs="+", default=None)
    ap.add_argument("--sliding-window", type=int, default=64)
    ap.add_argument("--compress-rate", type=int, default=1)
    ap.add_argument("--micro-batch-size", type=int, default=16)
    ap.add_argument("--eval-batches", type=int, default=12)
    ap.add_argument("--eval-every", type=int, default=20)
    ap.add_argument("--out", default="runs/bench/ced_graft")
    args = ap.parse_args()
    src = resolve_model(args.model)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    converted = out / "ced-graft"
    if not converted.exists():
        convert(
            src,
            converted,
            ConvertOptions(
                to="ced",
                sliding_window=args.sliding_window,
                compress_rate=args.compress_rate,
                kv_source_layers=tuple(args.kv_source_layers) if args.kv_source_layers else None,
            ),
        )
    record = json.loads((converted / "conversion.json").read_text())
    original = load_pretrained(src, dtype=torch.float32)
    seq = original.config.max_position_embeddings
    val = PackedDataset(Path(args.data) / "tokens" / "validation.npy", seq)

    def val_ppl(model) -> float:
        return math.exp(evaluate(model, val, lm_loss, args.micro_batch_size, args.eval_batches))

    base = val_ppl(original)
    one_shot = val_ppl(load_pretrained(converted, dtype=torch.float32))
    print(f"original validation ppl {base:.3f}; share graft one-shot {one_shot:.3f} ({one_shot / base:.3f}x)")
    run = out / f"heal-{args.loss}"
    overrides = dict(
        micro_batch_size=args.micro_batch_size,
        eval_every=args.eval_every,
        eval_batches=args.eval_batches,
        save_every=20,
        progress=False,
    )
    if args.lr:
        overrides["lr"] = args.lr
    orig_record = original_training(src)
    heal(
        converted,
        run,
        args.data,
        HealOptions(
            teacher=src,
            heal_config=HealConfig(loss=args.loss, tokens=args.tokens),
            train_overrides=overrides,
            original_lr=orig_record["train_config"]["lr"],
        ),
    )
    rows = [json.loads(line) for line in (run / "log.jsonl").read_text().splitlines()]
    healed_curve = [(0, one_shot)] + [(r["tokens"], math.exp(r["val_loss"])) for r in rows if "val_loss" in r]
    healed_tokens, healed = healed_curve[-1]

    scratch_log = Path(args.scratch_log) if args.scratch_log else Path("models/kvgraft-ced-8m/training_log.jsonl")
    scratch = scratch_curve(scratch_log) if scratch_log.is_file() else []
    same = at_tokens(scratch, healed_tokens)
    kv = record["kv_cache_bytes_bf16"]
    summary = {
        "original_val_ppl": base,
        "one_shot_val_ppl": one_shot,
        "healed_val_ppl": healed,
        "healed_tokens": healed_tokens,
        "heal_loss": args.loss,
        "healed_curve": healed_curve,
        "scratch_log": str(scratch_log),
        "scratch_curve": scratch,
        "scratch_at_equal_tokens": same,
        "kv_cache_bytes_bf16": kv,
        "share_graft": record["share_graft"],
    }
    print("\n| model | training tokens | val ppl | vs original |")
    print("|---|---:|---:|---:|")
    print(f"| original (Llama reference) | {orig_record['tokens_seen']:,} | {base:.3f} | 1.000x |")
    print(f"| share graft, one shot | 0 | {one_shot:.3f} | {one_shot / base:.3f}x |")
    print(f"| share graft + heal ({args.loss}) | {healed_tokens:,} | {healed:.3f} | {healed / base:.3f}x |")
    if same is not None:
        print(f"| from-scratch CED at equal tokens | {same[0]:,} | {same[1]:.3f} | {same[1] / base:.3f}x |")
    if scratch:
        print(f"| from-scratch CED, final | {scratch[-1][0]:,} | {scratch[-1][1]:.3f} | {scratch[-1][1] / base:.3f}x |")
    else:
        print(f"(no from-scratch log at {scratch_log})")
    for n, b in kv.items():
        print(
            f"KV bytes/sequence at {n} tokens (bf16): original {b['original']:,}, share graft {b['converted']:,} "
            f"({b['original'] / b['converted']:.2f}x smaller)"
        )
    atomic_write_json((out / "results.json"), summary, indent=2)
    plot(healed_curve, scratch, base, out / "ced_graft.png")
    print(f"\nwrote {out / 'results.json'} and {out / 'ced_graft.png'}")


def plot(healed: list, scratch: list, base: float, png: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4.2))
    ax.plot([t / 1e6 for t, _ in healed], [p for _, p in healed], "o-", ms=3, label="share graft + heal")
    if scratch:
        ax.plot([t / 1e6 for t, _ in scratch], [p for _, p in scratch], "s-", ms=3, label="CED from scratch")
    ax.axhline(base, color="k", ls="--", lw=1, label="original Llama reference")
    ax.set_yscale("log")
    ax.set_xlabel("training tokens (millions)")
    ax.set_ylabel("validation perplexity")
    ax.grid(alpha=0.3, which="both")
    ax.legend()
    fig.tight_layout()
    atomic_savefig(fig, png, dpi=110)
    plt.close(fig)


if __name__ == "__main__":
    main()
