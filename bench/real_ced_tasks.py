"""Zero-shot: how well SmolLM2-135M-Instruct and its causal encoder-decoder answer the placement study's
tasks before any adapter, in the chat format and at the study's sizing (recall: the queried line beyond the
CED's 128-token window). Prints, per model and task, greedy accuracy on test problems and the mean loss per
answer token (the answer's digits/words and the end-of-turn token), beside the loss that knowing only the
answer's format gives (recall: four uniform digits, the end token free).

    .venv/bin/python bench/real_ced_tasks.py --models smollm2-135m-instruct runs/real-ced/healed --n 64

Writes ``--out`` (JSON) when given.
"""

from __future__ import annotations

import argparse
import json
import math
import time
from pathlib import Path

import torch
import torch.nn.functional as F

from kvgraft.data.tasks.registry import generate_task
from kvgraft.data.tasks.sizing import load_sizing
from kvgraft.hf import load_pretrained, load_tokenizer_dir
from kvgraft.reference import resolve_model
from kvgraft.train.adapt import answer_accuracy, encode_split, task_seq_len


def answer_loss(model, items: list[dict], batch: int) -> float:
    """Mean cross-entropy over the labelled (answer) tokens of ``items``."""
    total, count = 0.0, 0
    with torch.no_grad():
        for i in range(0, len(items), batch):
            chunk = items[i : i + batch]
            ids = torch.stack([c["input_ids"] for c in chunk])
            labels = torch.stack([c["labels"] for c in chunk])
            logits = model(ids)
            total += F.cross_entropy(logits.flatten(0, 1).float(), labels.flatten(), ignore_index=-100, reduction="sum").item()
            count += int((labels != -100).sum())
    return total / count


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--models", nargs="+", required=True, help="model names or directories")
    ap.add_argument("--tasks", nargs="+", default=["recall", "ui-reply"], choices=["recall", "ui-reply"])
    ap.add_argument("--n", type=int, default=64, help="test problems per task (>= 1)")
    ap.add_argument("--window", type=int, default=128, help="recall's window (the CED's)")
    ap.add_argument("--max-tokens", type=int, default=500)
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--out", type=Path)
    args = ap.parse_args()
    if args.n < 1 or args.batch < 1:
        raise SystemExit(f"--n ({args.n}) and --batch ({args.batch}) must be >= 1")
    paths = [resolve_model(m) for m in args.models]  # every model found before any work
    sizing_tok = paths[0]
    rows = []
    for task in args.tasks:
        sizing = load_sizing(
            sizing_tok, window=args.window if task == "recall" else None, max_tokens=args.max_tokens, prompt_format="chat"
        )
        splits = generate_task(task, seed=0, sizing=sizing)
        test = splits["test"][: args.n]
        enc = sizing.encoding
        for path in paths:
            t0 = time.perf_counter()
            model = load_pretrained(path).float().eval()
            tok = load_tokenizer_dir(path)
            seq_len = task_seq_len(tok, {"test": test}, model.config.max_position_embeddings - 1, enc)
            pad = model.config.pad_token_id if model.config.pad_token_id is not None else (model.config.eos_token_id or 0)
            items = encode_split(tok, test, seq_len, pad, enc)
            loss = answer_loss(model, items, args.batch)
            longest = max(int((c["labels"] != -100).sum()) for c in items)  # the longest answer, its end token included
            acc = answer_accuracy(model, tok, task, test, longest + 8, enc)
            per = sum(int((c["labels"] != -100).sum()) for c in items) / len(items)
            row = {
                "model": path.name,
                "task": task,
                "n": len(test),
                "accuracy": acc,
                "answer_loss": loss,
                "answer_tokens": per,
                "seconds": time.perf_counter() - t0,
            }
            if task == "recall":  # four uniform digits carry all the uncertainty; the rest is format
                row["format_only_loss"] = 4 * math.log(10) / per
            rows.append(row)
            print(json.dumps(row), flush=True)
    if args.out:
        args.out.write_text(json.dumps(rows, indent=2) + "\n")


if __name__ == "__main__":
    main()
