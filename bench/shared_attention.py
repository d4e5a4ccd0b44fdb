"""How much of the answer's attention a causal encoder-decoder puts on its shared stream, by task.

    .venv/bin/python bench/shared_attention.py [--model kvgraft-ced-8m] [--adapter DIR] [--tasks recall ui-reply geometry]
                                               [--examples 32] [--out runs/bench/shared_attention.json]

For each task, the first ``--examples`` test examples (seed 0) run through the model (batch 1, no cache); at
the positions that predict the answer tokens, ``kvgraft.eval.attention_mass.shared_attention_share`` takes the
softmax mass each layer puts on the shared entries (vs its own sliding window), averaged over heads, positions
and examples. Prints a table (one row per task, one column per layer) and writes JSON.
"""

from __future__ import annotations

import argparse
from pathlib import Path

import torch

from kvgraft.atomic import atomic_write_json


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="kvgraft-ced-8m")
    ap.add_argument("--adapter", default=None, help="a kvgraft adapter directory to apply (PEFT format)")
    ap.add_argument("--tasks", nargs="+", default=["recall", "ui-reply", "geometry"])
    ap.add_argument("--examples", type=int, default=32)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--out", default="runs/bench/shared_attention.json")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    from kvgraft.data.tasks import generate_task
    from kvgraft.data.tokenizer import load_tokenizer
    from kvgraft.eval.attention_mass import shared_attention_share, task_sequences
    from kvgraft.hf import load_pretrained
    from kvgraft.reference import resolve_model

    path = resolve_model(args.model)
    model = load_pretrained(path, dtype=torch.float32).eval()
    if args.adapter:
        from kvgraft.adapters.lora import load_adapter

        load_adapter(model, args.adapter)  # wraps the projections in place; attention modules stay the same
    tok = load_tokenizer(path)
    rows = {}
    for task in args.tasks:
        examples = generate_task(task, 0)["test"][: args.examples]
        share = shared_attention_share(model, task_sequences(tok, examples, model.config.max_position_embeddings))
        rows[task] = share.to_dict()
        cells = " ".join("   -  " if v is None else f"{v:6.3f}" for v in share.per_layer)
        print(
            f"{task:<10} mean {share.mean:.3f} | per layer {cells} ({share.examples} examples, "
            f"{share.positions} answer positions)",
            flush=True,
        )
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    atomic_write_json(out, {"model": str(path), "adapter": args.adapter, "tasks": rows}, indent=2)
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
