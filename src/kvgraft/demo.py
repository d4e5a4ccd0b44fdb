"""``make demo``: the shipped reference model's perplexity, KV bytes per token, decode speed and a sample."""

from __future__ import annotations

import json
from pathlib import Path

import torch

from kvgraft.atomic import atomic_write_text
from kvgraft.reference import resolve_model

PROMPTS = ("In the beginning", "The for statement in Python")


def demo(model: str | None = None, out_dir: str | Path = "runs/demo", max_new_tokens: int = 40, seed: int = 0) -> dict:
    """Evaluate the reference model (or ``model``) and generate from two prompts; write ``report.json``."""
    from kvgraft.eval import evaluate, format_report
    from kvgraft.hf import load_pretrained, load_tokenizer_dir
    from kvgraft.model import generate

    path = resolve_model(model)
    net = load_pretrained(path)
    tok = load_tokenizer_dir(path)
    print(f"model: {path}")
    ctx = net.config.max_position_embeddings
    report = evaluate(model_path=path, model=net, contexts=(ctx // 4, ctx - 16), batch_sizes=(1, 8),
                      new_tokens=16, repeats=2)
    print(format_report(report))
    samples = []
    if tok is not None:
        print("\nsamples (temperature 0.8, top-p 0.95, seed %d):" % seed)
        for prompt in PROMPTS:
            ids = torch.tensor([tok.encode(prompt)])
            out = generate(net, ids, max_new_tokens, temperature=0.8, top_p=0.95, seed=seed,
                           eos_token_id=net.config.eos_token_id)
            text = tok.decode(out[0].tolist(), skip_special_tokens=True)
            samples.append({"prompt": prompt, "text": text})
            print(f"--- {prompt!r}\n{text}\n")
    report["samples"] = samples
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    atomic_write_text(out / "report.json", json.dumps(report, indent=2) + "\n")
    print(f"report written to {out / 'report.json'}")
    return report
