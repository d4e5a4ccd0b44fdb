"""Can a model copy from beyond its window? A held-out passage A of L tokens, then A again: the loss on the
second copy, against the first. A model that copies (an induction head) predicts the second copy almost
perfectly; a causal encoder-decoder whose shared stream does not carry what copying needs predicts it barely
better than the first when L exceeds its window (every copied token then lies L tokens back).

    .venv/bin/python bench/real_ced_copy.py --models smollm2-135m-instruct runs/real-ced/healed --lengths 100 300

Text: the held-out Debian Reference tokens of ``bench/real_texts.py`` (runs/real-texts/manual.npy), passages
starting every 400 tokens from token 1,000. Prints one row per model and length; ``--out`` writes them as JSON.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F

from kvgraft.hf import load_pretrained
from kvgraft.reference import resolve_model

ROOT = Path(__file__).resolve().parents[1]


def copy_losses(model, tokens: np.ndarray, length: int, passages: int) -> tuple[float, float]:
    """Mean next-token loss on the first and on the second copy of ``passages`` passages of ``length``."""
    first, second = [], []
    for k in range(passages):
        a = tokens[1000 + k * 400 : 1000 + k * 400 + length].tolist()
        x = torch.tensor([a + a])
        with torch.no_grad():
            logits = model(x)[0]
        nll = F.cross_entropy(logits[:-1].float(), x[0, 1:], reduction="none")
        first.append(nll[: length - 1].mean().item())
        second.append(nll[length:].mean().item())  # predicting tokens 1..L-1 of the second copy (+ its first)
    return float(np.mean(first)), float(np.mean(second))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--models", nargs="+", required=True, help="model names or directories")
    ap.add_argument("--lengths", nargs="+", type=int, default=[100, 300], help="passage lengths (tokens, >= 2)")
    ap.add_argument("--passages", type=int, default=6, help="passages per length (>= 1)")
    ap.add_argument("--texts", type=Path, default=ROOT / "runs" / "real-texts", help="bench/real_texts.py's output")
    ap.add_argument("--out", type=Path)
    args = ap.parse_args()
    if args.passages < 1 or any(n < 2 for n in args.lengths):
        raise SystemExit(f"--passages ({args.passages}) must be >= 1 and every --lengths ({args.lengths}) >= 2")
    path = args.texts / "manual.npy"
    if not path.is_file():
        raise SystemExit(f"{path} is missing: run `python bench/real_texts.py` first")
    tokens = np.load(path)
    need = 1000 + (args.passages - 1) * 400 + max(args.lengths)
    if tokens.size < need:
        raise SystemExit(
            f"{path} has {tokens.size} tokens; --passages {args.passages} at --lengths {max(args.lengths)} need {need}"
        )
    models = [resolve_model(m) for m in args.models]  # every model found before any work
    rows = []
    for name, path in zip(args.models, models):
        model = load_pretrained(path, dtype=torch.float32).eval()
        window = getattr(model.config, "sliding_window", None)
        for n in args.lengths:
            t0 = time.perf_counter()
            first, second = copy_losses(model, tokens, n, args.passages)
            row = {"model": name, "window": window, "length": n, "first_copy": first, "second_copy": second}
            rows.append(row)
            print(
                f"{name:34s} window {window!s:>5}  L {n:4d}: first copy {first:.3f}, second copy {second:.3f} nats "
                f"({time.perf_counter() - t0:.0f} s)",
                flush=True,
            )
    if args.out:
        args.out.write_text(json.dumps(rows, indent=2) + "\n")


if __name__ == "__main__":
    main()
