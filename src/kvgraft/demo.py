"""``make demo``: the shipped reference model, its MLA graft at 4x, and the two side by side.

1. evaluate the reference model (held-out perplexity, KV bytes per token, decode speed) and sample;
2. ``doctor`` it; 3. ``convert`` it to MLA at 4x KV compression (one shot, no training);
4. evaluate the graft the same way and print both side by side; write everything to ``out_dir``.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import torch

from kvgraft.atomic import atomic_write_text
from kvgraft.reference import resolve_model

PROMPTS = ("In the beginning", "The for statement in Python")


def _samples(model, tok, max_new_tokens: int, seed: int) -> list[dict]:
    from kvgraft.model import generate

    out = []
    for prompt in PROMPTS:
        ids = torch.tensor([tok.encode(prompt)])
        gen = generate(model, ids, max_new_tokens, temperature=0.8, top_p=0.95, seed=seed,
                       eos_token_id=model.config.eos_token_id)
        text = tok.decode(gen[0].tolist(), skip_special_tokens=True)
        out.append({"prompt": prompt, "text": text})
        print(f"--- {prompt!r}\n{text}\n")
    return out


def demo(
    model: str | None = None, out_dir: str | Path = "runs/demo", compression: float = 4.0,
    max_new_tokens: int = 40, seed: int = 0,
) -> dict:
    """Run the demo and return (and write to ``out_dir/report.json``) everything it measured."""
    from kvgraft.eval import compare_table, evaluate, format_report
    from kvgraft.graft.convert import convert
    from kvgraft.graft.doctor import doctor
    from kvgraft.hf import load_pretrained, load_tokenizer_dir

    path = resolve_model(model)
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    net = load_pretrained(path)
    tok = load_tokenizer_dir(path)
    ctx = net.config.max_position_embeddings
    speed = dict(contexts=(ctx // 4, ctx - 16), batch_sizes=(1, 8), new_tokens=16, repeats=2)

    print(f"== 1. the reference model: {path}")
    original = evaluate(model_path=path, model=net, name="original", **speed)
    print(format_report(original))
    print("\nsamples (temperature 0.8, top-p 0.95, seed %d):" % seed)
    original["samples"] = _samples(net, tok, max_new_tokens, seed) if tok is not None else []

    print("== 2. doctor: can it take MLA?")
    report = doctor(path)
    print(report.format())

    converted_dir = out / f"mla-{compression:g}x"
    print(f"\n== 3. convert to MLA at {compression:g}x KV compression (one shot, no training) -> {converted_dir}")
    if converted_dir.exists():
        shutil.rmtree(converted_dir)
    record = convert(path, converted_dir, compression=compression)
    kv = record["kv_bytes_per_token_bf16"]
    print(f"KV bytes/token (bf16) {kv['original']:,} -> {kv['converted']:,}; "
          f"converted in {record['seconds']['convert']:.1f} s")

    print("\n== 4. the graft, measured the same way")
    mla = load_pretrained(converted_dir)
    grafted = evaluate(model_path=converted_dir, model=mla, name=f"MLA {compression:g}x (one-shot)", **speed)
    print(format_report(grafted))
    print("\nsamples from the graft:")
    grafted["samples"] = _samples(mla, tok, max_new_tokens, seed) if tok is not None else []
    print("== side by side")
    print(compare_table([original, grafted]))

    result = {"original": original, "doctor": report.to_dict(), "conversion": record, "converted": grafted}
    atomic_write_text(out / "report.json", json.dumps(result, indent=2, default=str) + "\n")
    print(f"\nreport written to {out / 'report.json'}; converted model in {converted_dir}")
    return result
