"""(a) The control: the shipped stock Llama checkpoint (models/kvgraft-llama-8m, LlamaForCausalLM) served by
vLLM CPU gives transformers' greedy tokens and top-5 logprobs (fp32). If this fails, the harness is wrong,
not an export."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
from engines import VllmRunner, load_hf, parity

pytestmark = pytest.mark.vllm

MODEL = Path(__file__).resolve().parents[2] / "models" / "kvgraft-llama-8m"
# (offset, length) slices of the model's held-out token stream: 1, 7, 40 and 130 tokens
SLICES = [(0, 1), (1000, 7), (5000, 40), (20000, 130)]
N_NEW = 32


@pytest.fixture(scope="module")
def prompts():
    ids = np.load(MODEL / "eval" / "heldout.npy").astype(np.int64)
    return [ids[o : o + n].tolist() for o, n in SLICES]


@pytest.fixture(scope="module")
def runner():
    with VllmRunner(MODEL, max_model_len=256) as r:
        yield r


def test_llama_reference_greedy_and_logprobs_match_transformers(runner, prompts):
    report = parity(runner, load_hf(MODEL), prompts, n_new=N_NEW)
    print(
        f"\nkvgraft-llama-8m, vLLM {runner.kwargs.get('attention_backend', 'default backend')} vs "
        f"transformers, {N_NEW} greedy tokens:\n{report}"
    )
    assert report.same_tokens, f"greedy tokens differ:\n{report}"
    assert report.max_abs_diff < 1e-3, f"top-5 logprobs differ:\n{report}"
