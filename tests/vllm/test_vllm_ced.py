"""kvgraft's causal encoder-decoder served by vLLM through the plugin (``kvgraft.vllm``, docs/vllm.md): the same
greedy tokens as kvgraft's own engine, CPU, fp32.

- ``models/kvgraft-ced-8m`` (W = 64, m = 2, kv_source layers 1, 3, 4): 10 prompts of held-out text, 1 to 400
  tokens (both sides of W, of m and of vLLM's block edges; 400 is 6 windows, so most of what a query reads
  comes through the pooled shared stream), 32 greedy tokens each, in one vLLM batch, and again with
  ``max_num_batched_tokens`` small enough that long prompts are prefilled in chunks that split blocks
  and pooling blocks (a chunk ending mid-block leaves a pending token for the next chunk); the one-batch run on
  both of the plugin's paths (batched, the default, and kvgraft's layer code per request);
- 32 requests of 1-400 tokens with 256-token steps: decode rows and prefill chunks in the same step;
- vLLM's compiled mode (no ``enforce_eager``), 61-token steps;
- the share graft: ``kvgraft convert models/kvgraft-llama-8m --to ced`` (m = 1 by default), same prompts.

The logprob check is kvgraft's cache-free forward teacher-forced on vLLM's own sequence (top-5, < 1e-4).
"""

from __future__ import annotations

import math
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from engines import VllmRunner, kvgraft_engine_greedy, kvgraft_parity, load_kvgraft

pytestmark = pytest.mark.vllm

ROOT = Path(__file__).resolve().parents[2]
CED = ROOT / "models" / "kvgraft-ced-8m"
LLAMA = ROOT / "models" / "kvgraft-llama-8m"
# (offset, length) slices of the held-out token stream
SLICES = [(0, 1), (500, 2), (1000, 7), (3000, 63), (5000, 64), (7000, 65), (9000, 130), (11000, 200), (13000, 257), (20000, 400)]
N_NEW = 32
MAX_LEN = 512


def _prompts(model_dir: Path) -> list[list[int]]:
    ids = np.load(model_dir / "eval" / "heldout.npy").astype(np.int64)
    return [ids[o : o + n].tolist() for o, n in SLICES]


def _check(report, what: str) -> None:
    print(f"\n{what}: vLLM (kvgraft.vllm plugin) vs kvgraft's engine, {N_NEW} greedy tokens:\n{report}")
    assert report.same_tokens, f"{what}: greedy tokens differ from kvgraft's engine:\n{report}"
    assert report.max_abs_diff < 1e-4, f"{what}: top-5 logprobs differ from kvgraft's forward:\n{report}"


@pytest.fixture(scope="module")
def ced():
    return load_kvgraft(CED)


@pytest.fixture
def steps(monkeypatch):
    """What the plugin saw (the engine runs in this process), on either path: per request of a step
    (start, T) in "groups", each step's query lengths in "steps", and per shared-stream read (source layer,
    entries read) in "reads". The batched path's metadata builders plan every step once per cache group, so
    "groups" and "steps" repeat each step once per group."""
    import kvgraft.vllm.cache as cache_mod
    import kvgraft.vllm.model as model_mod
    from kvgraft.vllm.context import VllmStepContext

    log: dict[str, list] = {"groups": [], "reads": [], "steps": []}
    init, segment = VllmStepContext.__init__, VllmStepContext.segment
    plan, attend = cache_mod.plan_tiles, model_mod.ced_attention

    def logged_init(self, *args, **kwargs):
        init(self, *args, **kwargs)
        log["groups"] += [(end - g.T, g.T) for g, end in zip(self.groups, self.ends)]
        log["steps"].append([g.T for g in self.groups])

    def logged_segment(self, source, gi):
        out = segment(self, source, gi)
        log["reads"].append((source, out[0].shape[1]))
        return out

    def logged_plan(query_start, seq_lens, *args, **kwargs):
        T = [int(b - a) for a, b in zip(query_start[:-1], query_start[1:])]
        log["groups"] += [(int(n) - t, t) for n, t in zip(seq_lens, T) if t > 0]
        log["steps"].append([t for t in T if t > 0])
        return plan(query_start, seq_lens, *args, **kwargs)

    def logged_attend(attn, *args):
        stream_ix = args[5]  # (q, entry, window, window_ix, stream, stream_ix, kv_b_delta)
        if stream_ix is not None and stream_ix.entry_at is not None:
            log["reads"].append((attn.source, stream_ix.entry_at[0].shape[1]))
        return attend(attn, *args)

    monkeypatch.setattr(VllmStepContext, "__init__", logged_init)
    monkeypatch.setattr(VllmStepContext, "segment", logged_segment)
    monkeypatch.setattr(cache_mod, "plan_tiles", logged_plan)
    monkeypatch.setattr(model_mod, "ced_attention", logged_attend)
    return log


@pytest.mark.parametrize("path", ["batched", "per-request"])
def test_ced_8m_matches_kvgraft_engine(ced, steps, path, monkeypatch):
    """Both paths of the plugin: the batched one (the default: each layer's window and stream read for the whole
    step, merged by log-sum-exp) and kvgraft's layer code per request (what steps with adapters run)."""
    monkeypatch.setenv("KVGRAFT_VLLM_CED_PATH", path)
    prompts = _prompts(CED)
    with VllmRunner(CED, max_model_len=MAX_LEN) as runner:
        report = kvgraft_parity(runner, ced, prompts, n_new=N_NEW)
    _check(report, f"kvgraft-ced-8m, {path}")
    # the shared stream was read, by every reading layer's source, up to the longest prompt's entries: all of
    # them per request (kvgraft's layer masks the invisible ones), the last query's visible ones when batched
    m, W = ced.config.compress_rate, ced.config.sliding_window
    last = 400 + N_NEW - 2  # position of the last decode step's query
    assert {src for src, _ in steps["reads"]} == set(ced.config.kv_source_layers)
    want = (last + 1) // m if path == "per-request" else (last - W) // m + 1
    assert max(n for _, n in steps["reads"]) == want
    assert (0, 400) in steps["groups"] and (last, 1) in steps["groups"]  # prefill, last decode


def test_ced_8m_compiled_matches_kvgraft_engine(ced, steps):
    """vLLM's default compiled mode (no ``enforce_eager``; on the CPU: Dynamo traced once, inductor): the model is
    compiled with each layer's attention as the opaque ``torch.ops.vllm.kvgraft_ced_attention``, and the tokens
    equal kvgraft's engine's, with 61-token steps so that compiled steps mix decode rows and prefill chunks."""
    prompts = _prompts(CED)
    with VllmRunner(
        CED, max_model_len=MAX_LEN, enforce_eager=False, max_num_batched_tokens=61, enable_chunked_prefill=True
    ) as runner:
        compiled = runner.apply_model(lambda model: not model.do_not_compile)
        report = kvgraft_parity(runner, ced, prompts, n_new=N_NEW)
    _check(report, "kvgraft-ced-8m, compiled, 61-token steps")
    assert compiled, "vLLM did not compile the model"
    assert steps["reads"], "the compiled model never ran the batched attention"
    assert any(1 in Ts and any(t > 1 for t in Ts) for Ts in steps["steps"]), "no compiled step mixed decode and prefill"


def test_ced_8m_32_mixed_requests_match_kvgraft_engine(ced, steps):
    """32 requests of 1-400 prompt tokens (held-out text, lengths drawn once with a fixed seed) in one vLLM
    batch, 32 greedy tokens each, with 256-token steps: vLLM mixes decode rows with prefill chunks in one step,
    and every request's tokens equal kvgraft's engine's (all prompts in one continuous batch there too). In
    vLLM's default compiled mode (the eager batched path is what the other tests here run)."""
    ids = np.load(CED / "eval" / "heldout.npy").astype(np.int64)
    rng = np.random.default_rng(36)
    lengths = [1, 2, 16, 64, 65, 400] + rng.integers(1, 401, size=26).tolist()
    offsets = rng.integers(0, len(ids) - 400, size=len(lengths))
    prompts = [ids[o : o + n].tolist() for o, n in zip(offsets, lengths)]
    with VllmRunner(
        CED,
        max_model_len=MAX_LEN,
        max_num_seqs=32,
        max_num_batched_tokens=256,
        enable_chunked_prefill=True,
        enforce_eager=False,
    ) as runner:
        assert runner.apply_model(lambda model: not model.do_not_compile), "vLLM did not compile the model"
        runs = runner.greedy(prompts, n_new=N_NEW, top_k=1)
    ours = kvgraft_engine_greedy(ced, prompts, N_NEW)
    differ = [(i, len(p)) for i, (p, r, o) in enumerate(zip(prompts, runs, ours)) if r.tokens != o]
    assert not differ, f"(request, prompt length) whose greedy tokens differ from kvgraft's engine: {differ}"
    mixed = [Ts for Ts in steps["steps"] if 1 in Ts and any(t > 1 for t in Ts)]
    assert mixed, "no step mixed decode rows with a prefill"
    assert max(len(Ts) for Ts in steps["steps"]) == 32


def test_ced_8m_chunked_prefill_matches_kvgraft_engine(ced, steps):
    # 61-token chunks: prefills stop mid-window, mid-block (16), mid-stream-block and mid-pooling-block (odd)
    prompts = [p for p in _prompts(CED) if len(p) >= 63]
    with VllmRunner(CED, max_model_len=MAX_LEN, max_num_batched_tokens=61, max_num_seqs=4, enable_chunked_prefill=True) as runner:
        report = kvgraft_parity(runner, ced, prompts, n_new=N_NEW)
    _check(report, "kvgraft-ced-8m, chunked prefill (61-token steps)")
    chunks = [(start, T) for start, T in steps["groups"] if T > 1 and start > 0]
    assert chunks and any(start % 2 for start, _ in chunks), f"no prefill continued mid-block: {steps['groups'][:20]}"


@pytest.fixture(scope="module")
def share_graft(tmp_path_factory):
    out = tmp_path_factory.mktemp("graft") / "llama-ced"
    cmd = [sys.executable, "-m", "kvgraft", "convert", str(LLAMA), "--to", "ced", "--out", str(out)]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=900)
    assert done.returncode == 0, done.stderr[-3000:]
    return out


def test_share_graft_matches_kvgraft_engine(share_graft):
    model = load_kvgraft(share_graft)
    assert model.config.is_ced
    with VllmRunner(share_graft, max_model_len=MAX_LEN) as runner:
        report = kvgraft_parity(runner, model, _prompts(LLAMA), n_new=N_NEW)
    _check(report, f"share graft of kvgraft-llama-8m (m = {model.config.compress_rate}, W = {model.config.sliding_window})")


def test_ced_8m_with_prefix_caching_matches_kvgraft_engine(ced, monkeypatch):
    """vLLM's prefix caching on (``vllm serve``'s default), 1,700-token prompts: one sent twice, one sharing its
    first 1,650 tokens. Hits land on vLLM's scheduler block, the lcm of the groups' block sizes (8, 8, 48:
    48 tokens; a repeat hits up to its last token), and every group must hit: the windows' last W - 1 tokens,
    the pending rows and the stream's entries, all kept in vLLM's blocks. The 8m was trained on 512 positions;
    beyond them it is still one deterministic function for both engines (``VLLM_ALLOW_LONG_MAX_MODEL_LEN``,
    kvgraft's ``max_seq_len``).

    vLLM 0.32 keeps a sliding-window group's blocks only at checkpoints (``prefix_cache_retention_interval``,
    default 0: the cached prompt's last whole scheduler block and detected shared-prefix junctions), so a
    prompt sharing only part of a cached one hits only where a checkpoint was kept: the test asks for one
    every scheduler block."""
    from vllm import SamplingParams

    monkeypatch.setenv("VLLM_ALLOW_LONG_MAX_MODEL_LEN", "1")
    ids = np.load(CED / "eval" / "heldout.npy").astype(np.int64)
    p = ids[30000:31700].tolist()
    prompts = [p, p, p[:1650] + ids[40000:40040].tolist()]
    sp = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True, detokenize=False)
    S = scheduler_block(ced.config)
    with VllmRunner(
        CED, max_model_len=2048, enable_prefix_caching=True, max_num_seqs=4, prefix_cache_retention_interval=S
    ) as runner:
        outs = [runner.llm.generate([{"prompt_token_ids": q}], sp, use_tqdm=False)[0] for q in prompts]
    ours = kvgraft_engine_greedy(ced, prompts, 16, max_seq_len=2048)
    cached = [o.num_cached_tokens for o in outs]
    print("\nprefix caching on: num_cached_tokens per request", cached)
    assert [list(o.outputs[0].token_ids) for o in outs] == ours
    assert cached == [0, 1699 // S * S, 1650 // S * S], cached  # whole scheduler blocks (48 tokens: 1,680 and 1,632)


def scheduler_block(config) -> int:
    """vLLM's scheduler block for the plugin's groups (the lcm of their block sizes, ``kvgraft.vllm.geometry``)."""
    from kvgraft.vllm.geometry import page_geometry

    g = page_geometry(config, 4)
    return math.lcm(g.window_block, g.stream_block, g.pending_block or 1)
