"""Per-seed decoder-half minus encoder-half, on validation (the protocol's mean of 50/70/100%) and on test loss,
for placement studies written by ``kvgraft experiment placement`` (issue 25), read from each run's
``result.json``; with, for ``recall``, the loss a model reaches by knowing the answer's format and nothing of
the ledger.

    python bench/placement_gaps.py runs/placement-recall-8 runs/placement-recall-deep runs/placement-ui-deep \
        [--json gaps.json] [--plot gaps.png]

``recall``'s answer is 4 labelled tokens (3 digit tokens of a 4-digit code, then EOS; kvgraft's reference
tokenizer); its codes are drawn uniformly, so a model that knows the format exactly but reads nothing from the
ledger scores ln(10^4) / 4 = 2.303 nats per token, and one that also knows the code is one of the ledger's
L lines (30-45) but not which, ln(L) / 4 (0.85-0.95). Below the first line is lookup; above it, format.
"""

from __future__ import annotations

import argparse
import json
import math
from pathlib import Path

from kvgraft.atomic import atomic_savefig, atomic_write_json

PAIR = ("encoder-half-r16", "decoder-half-r16")
RECALL_FORMAT_ONLY = math.log(10**4) / 4  # nats per labelled token: 4-digit code uniform, EOS certain


def _runs(study: Path, config: str) -> dict[int, dict]:
    out = {}
    for f in sorted((study / "runs" / config).glob("seed*/result.json")):
        out[int(f.parent.name.removeprefix("seed"))] = json.loads(f.read_text())
    return out


def gaps(study: Path) -> list[dict]:
    if not (study / "runs").is_dir():
        raise SystemExit(f"{study}: not a placement study directory (no runs/ in it)")
    enc, dec = (_runs(study, c) for c in PAIR)
    rows = []
    for seed in sorted(set(enc) & set(dec)):
        e, d = enc[seed], dec[seed]
        rows.append(
            {
                "study": str(study),
                "task": e["task"],
                "steps": e["steps"],
                "seed": seed,
                "encoder_val": e["val_loss_protocol"],
                "decoder_val": d["val_loss_protocol"],
                "gap_val": d["val_loss_protocol"] - e["val_loss_protocol"],
                "encoder_test": e["test_loss"],
                "decoder_test": d["test_loss"],
                "gap_test": d["test_loss"] - e["test_loss"],
                "accuracy": (e["test_accuracy"], d["test_accuracy"]),
            }
        )
    return rows


def plot(rows: list[dict], path: Path) -> None:
    """One row per study: each seed's decoder-half minus encoder-half, validation (open) and test (filled)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    studies = list(dict.fromkeys(r["study"] for r in rows))
    fig, ax = plt.subplots(figsize=(8, 0.6 * len(studies) + 1.8))
    for i, study in enumerate(studies):
        mine = [r for r in rows if r["study"] == study]
        for j, r in enumerate(mine):
            y = i + (j - (len(mine) - 1) / 2) * 0.12
            ax.plot([r["gap_val"]], [y], "o", mfc="none", color="C0", label="validation" if i == j == 0 else None)
            ax.plot([r["gap_test"]], [y], "o", color="C1", label="test" if i == j == 0 else None)
    ax.axvline(0.0, color="k", lw=0.8)
    ax.set_yticks(range(len(studies)))
    ax.set_yticklabels([f"{Path(s).name} ({next(r['steps'] for r in rows if r['study'] == s)} steps)" for s in studies])
    ax.invert_yaxis()
    ax.set_xlabel("decoder half - encoder half, loss (nats/token)\n> 0: the encoder half is ahead")
    ax.set_title("Per-seed placement gap (one dot per seed)")
    ax.legend(loc="lower right", fontsize=8)
    fig.tight_layout()
    atomic_savefig(fig, path, dpi=120)
    plt.close(fig)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("studies", nargs="+", type=Path)
    ap.add_argument("--json", type=Path, default=None, help="also write the rows as JSON")
    ap.add_argument("--plot", type=Path, default=None, help="also draw the per-seed gaps (PNG)")
    args = ap.parse_args()
    rows = [r for s in args.studies for r in gaps(s)]
    print(
        "| study | task | steps | seed | val: encoder / decoder half | decoder - encoder | test: encoder / decoder | decoder - encoder | accuracy enc / dec |"
    )
    print("|---|---|---:|---:|---|---:|---|---:|---|")
    for r in rows:
        acc = " / ".join("-" if a is None else f"{a:.2f}" for a in r["accuracy"])
        print(
            f"| {r['study']} | {r['task']} | {r['steps']} | {r['seed']} | {r['encoder_val']:.3f} / {r['decoder_val']:.3f} | "
            f"{r['gap_val']:+.3f} | {r['encoder_test']:.3f} / {r['decoder_test']:.3f} | {r['gap_test']:+.3f} | {acc} |"
        )
    if any(r["task"] == "recall" for r in rows):
        print(f"\nrecall, the format alone (4-digit code uniform, EOS certain): {RECALL_FORMAT_ONLY:.3f} nats per answer token")
    if args.json:
        atomic_write_json(args.json, rows)
    if args.plot:
        plot(rows, args.plot)


if __name__ == "__main__":
    main()
