"""kvgraft's format in transformers' attention interface and continuous batching: ``attn_implementation="sdpa"``
loads, and ``model.generate_batch`` (transformers' continuous-batching manager, its paged path) decodes the causal
encoder-decoder and MLA grafts with exactly the greedy tokens of kvgraft's engine (prefix cache on, as ``kvgraft
serve`` runs it): rows prefilled in chunks next to decodes, requests admitted at different steps, a pool small
enough that transformers preempts and re-prefills requests, PEFT adapters, the shipped ``kvgraft-ced-8m``, and
``transformers serve --continuous-batching`` through kvgraft's launcher. On CPU, with a bounded
``ContinuousBatchingConfig`` (few blocks of 16 tokens, no switch to flash)."""

from __future__ import annotations

import copy
import json
import os
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from factories import sharp_model
from transformers import AutoModelForCausalLM, ContinuousBatchingConfig, GenerationConfig

from kvgraft.hf import continuous as cont
from kvgraft.hf import save_pretrained
from kvgraft.model.config import ModelConfig
from kvgraft.model.presets import get_preset
from kvgraft.runtime.engine import Engine
from kvgraft.runtime.options import EngineOptions
from kvgraft.runtime.sampling import SamplingParams

ROOT = Path(__file__).resolve().parents[1]
CED = get_preset("ced-tiny")  # window 8, kv_source layers 1 and 2, compress rate 2
MLA = ModelConfig(
    vocab_size=96,
    hidden_size=64,
    intermediate_size=96,
    num_layers=2,
    num_heads=4,
    num_kv_heads=2,
    attention_kinds=("mla", "gqa"),
    kv_lora_rank=16,
    qk_rope_head_dim=8,
    qk_nope_head_dim=16,
    v_head_dim=16,
    mla_latent_norm=True,
)
CONFIGS = {"ced": CED, "ced-m1": CED.replace(compress_rate=1, tie_word_embeddings=True), "mla": MLA}
LENGTHS = [1, 5, 20, 33, 9, 3, 14]
NEW = 12


build = sharp_model  # tests/factories.py


def prompts(vocab: int, lengths=LENGTHS, seed: int = 0) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(1, vocab, (n,), generator=g).tolist() for n in lengths]


def engine_tokens(model, ps, new=NEW, **kw) -> list[list[int]]:
    return Engine(model, EngineOptions(max_seqs=8, prefix_cache=True)).generate(ps, SamplingParams(max_new_tokens=new), **kw)


def cb_config(**kw) -> ContinuousBatchingConfig:
    return ContinuousBatchingConfig(
        **({"num_blocks": 32, "page_size": 16, "max_batch_tokens": 24, "auto_switch_to_flash": False} | kw)
    )


def generate_batch(hf, ps, new=NEW, cb=None, **gen) -> list[list[int]]:
    gc = GenerationConfig(max_new_tokens=new, do_sample=False, eos_token_id=-1, **gen)
    out = hf.generate_batch(ps, generation_config=gc, continuous_batching_config=cb or cb_config(), warmup=False)
    assert len(out) == len(ps)
    assert all(r.error is None for r in out.values()), [r.error for r in out.values()]
    return [r.generated_tokens for r in out.values()]


@pytest.fixture
def steps(monkeypatch):
    """Every continuous-batching step kvgraft ran: (request ids, first positions, new tokens) per row."""
    seen = []
    rows = cont.ContinuousRequests.rows

    def spy(self, tcache, write_index, ends, starts, lens):
        out = rows(self, tcache, write_index, ends, starts, lens)
        seen.append((self._owners(tcache, write_index, ends), list(starts), list(lens)))
        return out

    monkeypatch.setattr(cont.ContinuousRequests, "rows", spy)
    return seen


def saved(name: str, tmp_path, **kw):
    model = build(CONFIGS[name])
    save_pretrained(model, tmp_path / "ckpt", model_type="kvgraft")
    return model, AutoModelForCausalLM.from_pretrained(tmp_path / "ckpt", **kw).eval()


def test_sdpa_is_accepted_and_runs_kvgraft_attention(tmp_path):
    """Was refused: "KvgraftForCausalLM does not support an attention implementation through
    torch.nn.functional.scaled_dot_product_attention yet"."""
    model, sdpa = saved("ced", tmp_path, attn_implementation="sdpa")
    assert sdpa.config._attn_implementation == "sdpa"
    eager = AutoModelForCausalLM.from_pretrained(tmp_path / "ckpt", attn_implementation="eager").eval()
    ids = torch.tensor(prompts(CED.vocab_size, [21, 21]))
    with torch.no_grad():
        torch.testing.assert_close(sdpa(ids).logits, eager(ids).logits, atol=0, rtol=0)
        torch.testing.assert_close(sdpa(ids).logits, model(ids), atol=1e-5, rtol=0)
        assert (
            sdpa.generate(ids, max_new_tokens=6, do_sample=False).tolist()
            == eager.generate(ids, max_new_tokens=6, do_sample=False).tolist()
        )


@pytest.mark.parametrize("name,attn", [("ced", "eager"), ("ced", "sdpa"), ("ced-m1", "sdpa"), ("mla", "eager")])
def test_generate_batch_gives_the_engine_tokens(name, attn, tmp_path, steps):
    """Was: every request failed at forward with "attention_mask shape (1, 1, N, N) != input_ids shape (1, N)"."""
    model, hf = saved(name, tmp_path, attn_implementation=attn)
    ps = prompts(model.config.vocab_size)
    want = engine_tokens(model, ps)
    assert len({tuple(w) for w in want}) == len(want)
    assert generate_batch(hf, ps) == want
    assert hf.config._attn_implementation == attn  # put back after the run (eager runs as paged|eager)
    # transformers' scheduler really batched: several requests in one step, prompts prefilled in chunks (a row
    # starting past 0 with more than one token) and decodes next to prefills
    assert max(len(rids) for rids, _, _ in steps) >= 3
    assert any(s > 0 and n > 1 for _, starts, lens in steps for s, n in zip(starts, lens))
    assert any(1 in lens and max(lens) > 1 for _, _, lens in steps)


def test_requests_added_while_others_run(tmp_path, steps):
    """A persistent manager: requests added at different times, each gets the engine's tokens."""
    model, hf = saved("ced", tmp_path)
    ps = prompts(CED.vocab_size)
    want = engine_tokens(model, ps)
    gc = GenerationConfig(max_new_tokens=NEW, do_sample=False, eos_token_id=-1)
    manager = hf.init_continuous_batching(generation_config=gc, continuous_batching_config=cb_config())
    manager.start()
    try:
        ids = [manager.add_request(p, max_new_tokens=NEW) for p in ps[:3]]
        deadline = time.time() + 120
        while len(steps) < 3 and manager.is_running() and time.time() < deadline:  # the first ones are running
            time.sleep(0.01)
        ids += [manager.add_request(p, max_new_tokens=NEW) for p in ps[3:]]
        got = {}
        while len(got) < len(ids):
            r = manager.get_result(timeout=60)
            assert r is not None and r.error is None
            if r.is_finished():
                got[r.request_id] = r.generated_tokens
    finally:
        manager.stop(block=True, timeout=10)
    assert [got[i] for i in ids] == want


def test_a_pool_that_forces_preemption(tmp_path, steps):
    """Too few blocks for every request at once: transformers evicts requests and re-prefills them later (from
    position 0, its prompt and what it generated): kvgraft starts their state again, and the tokens are the same."""
    model, hf = saved("ced", tmp_path)
    ps = prompts(CED.vocab_size, [30, 25, 28, 31, 26, 29])
    want = engine_tokens(model, ps, new=40)
    got = generate_batch(hf, ps, new=40, cb=cb_config(num_blocks=6, max_batch_tokens=64))
    assert got == want
    first = {}
    restarted = False
    for rids, starts, _ in steps:
        for rid, s in zip(rids, starts):
            restarted |= s == 0 and rid in first
            first.setdefault(rid, s)
    assert restarted  # some request was prefilled twice


def test_peft_adapter_under_continuous_batching(tmp_path):
    from peft import PeftModel

    from kvgraft.adapters.lora import AdapterConfig, add_adapter, randomize_adapter, save_adapter
    from kvgraft.adapters.placement import Placement

    model, _ = saved("ced", tmp_path)
    pm = add_adapter(copy.deepcopy(model), Placement("all", ("all-linear",)), AdapterConfig(rank=4))
    randomize_adapter(pm, 0.15, seed=4)
    adapter = save_adapter(pm, tmp_path / "adapter")
    ps = prompts(CED.vocab_size)
    engine = Engine(model, EngineOptions(max_seqs=8, prefix_cache=True))
    engine.load_adapter("a", adapter)
    want = engine.generate(ps, SamplingParams(max_new_tokens=NEW), adapters="a")
    assert want != engine_tokens(model, ps)
    hf = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(tmp_path / "ckpt"), str(adapter)).eval()
    assert generate_batch(hf, ps) == want


def test_the_shipped_ced_8m(steps):
    path = ROOT / "models" / "kvgraft-ced-8m"
    if not (path / "model.safetensors").is_file():
        pytest.skip(f"{path} is not present")
    from kvgraft.hf import load_pretrained

    ps = prompts(8192, [10, 70, 130, 3])  # past the window of 64: the shared compressed stream is read
    want = engine_tokens(load_pretrained(path), ps, new=16)
    hf = AutoModelForCausalLM.from_pretrained(path, attn_implementation="sdpa").eval()
    assert generate_batch(hf, ps, new=16, cb=cb_config(num_blocks=48, max_batch_tokens=64)) == want


def test_the_settings_kvgraft_needs_and_refusals(tmp_path, caplog):
    _, hf = saved("ced", tmp_path)
    gc = GenerationConfig(max_new_tokens=4, do_sample=False)
    manager = hf.init_continuous_batching(
        generation_config=gc,
        continuous_batching_config=cb_config(allow_block_sharing=True, use_cuda_graph=True, cpu_offload_space=1.0),
    )
    cb = manager.continuous_batching_config
    assert not cb.allow_block_sharing and cb.use_cuda_graph == (False, False) and cb.cpu_offload_space == 0
    assert not cb.use_async_batching and cb.varlen_compile_config is None and cb.max_blocks_per_request == 0
    assert "use_cuda_graph=False" in caplog.text and "cpu_offload_space=0.0" in caplog.text
    with pytest.raises(ValueError, match=r"128 prompt tokens \+ 4 new tokens exceeds .*max_position_embeddings \(128\)"):
        manager.add_request(list(range(1, 129)))
    manager.stop(block=True, timeout=5)
    with pytest.raises(ValueError, match="num_return_sequences=1"):
        hf.init_continuous_batching(generation_config=GenerationConfig(num_return_sequences=2, do_sample=True))


def _fake_cache(tables: dict[str, list[int]], stride: int = 32):
    alloc = SimpleNamespace(index=0, block_table=tables, block_physical_stride=stride)
    return SimpleNamespace(cache_allocators={"full_attention": alloc})


def test_rows_are_matched_to_requests_and_followed():
    """The bookkeeping on its own (a stand-in for transformers' cache: its allocator's block tables)."""
    state = cont.ContinuousRequests(CED, torch.float32, torch.device("cpu"))
    tc = _fake_cache({"a": [3], "b": [5, 7]})
    # row a: tokens 0..3 written at block 3; row b: tokens 4..9 at block 7 (its last token)
    w = [torch.tensor([96, 97, 98, 99, 160, 161, 224, 225, 226, 227])]
    first = state.rows(tc, w, [4, 10], [0, 0], [4, 6])
    assert set(state.seqs) == {"a", "b"} and first == [state.seqs["a"], state.seqs["b"]]
    for (i, seq), n in zip(first, (4, 6)):  # as if the forward ran
        state.shards[i].extend(seq, n)
        state.shards[i].commit(seq, n)
    with pytest.raises(RuntimeError, match="continues at position 5 but kvgraft holds 4"):
        state.rows(tc, [torch.tensor([100])], [1], [5], [1])
    with pytest.raises(RuntimeError, match="no kvgraft state"):  # e.g. a prefix-cache hit or a fork
        state.rows(_fake_cache({"a": [3], "b": [5, 7], "c": [9]}), [torch.tensor([290])], [1], [2], [1])
    with pytest.raises(RuntimeError, match="could not match"):
        state.rows(tc, [torch.tensor([999])], [1], [0], [1])
    with pytest.raises(ValueError, match="max_position_embeddings"):
        state.rows(tc, [torch.tensor([100])], [1], [CED.max_position_embeddings], [1])
    # b finished (its blocks freed): its sequence goes; a re-prefilled from 0 gets a fresh one
    state.rows(_fake_cache({"a": [3]}), [torch.tensor([96, 97])], [2], [0], [2])
    assert set(state.seqs) == {"a"} and state.shards[0].length(state.seqs["a"][1]) == 0
    # more live requests than a shard's slots: another shard
    many = {f"r{k}": [k] for k in range(cont.MIN_SHARD + 3)}
    state.rows(
        _fake_cache(many),
        [torch.tensor([32 * k for k in range(len(many))])],
        list(range(1, len(many) + 1)),
        [0] * len(many),
        [1] * len(many),
    )
    assert len(state.shards) == 2 and len(state.seqs) == len(many)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.slow  # starts `transformers serve` in a subprocess: make test-slow, run by CI
def test_transformers_serve_continuous_batching_runs_the_ced(tmp_path):
    """``python -m kvgraft.hf.transformers_cli serve MODEL --continuous-batching``: transformers' own server (its
    continuous-batching manager) answers a completion with the engine's greedy tokens."""
    from transformers import AutoTokenizer

    from kvgraft.hf import load_pretrained

    path = ROOT / "models" / "kvgraft-ced-8m"
    if not (path / "model.safetensors").is_file():
        pytest.skip(f"{path} is not present")
    pytest.importorskip("uvicorn")
    port = _free_port()
    env = dict(os.environ, OMP_NUM_THREADS="1")
    log = open(tmp_path / "serve.log", "wb")
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "kvgraft.hf.transformers_cli",
            "serve",
            str(path),
            "--continuous-batching",
            "--device",
            "cpu",
            "--port",
            str(port),
            "--host",
            "127.0.0.1",
            "--cb-num-blocks",
            "16",
            "--cb-max-batch-tokens",
            "64",
        ],
        stdout=log,
        stderr=subprocess.STDOUT,
        env=env,
    )
    try:
        url = f"http://127.0.0.1:{port}/v1"
        deadline = time.time() + 240
        while True:
            try:
                urllib.request.urlopen(f"{url}/models", timeout=5)
                break
            except OSError:
                if proc.poll() is not None or time.time() > deadline:
                    raise AssertionError((tmp_path / "serve.log").read_text()[-3000:]) from None
                time.sleep(0.5)
        prompt = "Once upon a time"
        body = json.dumps({"model": str(path), "prompt": prompt, "max_tokens": 12, "temperature": 0}).encode()
        req = urllib.request.Request(f"{url}/completions", body, {"Content-Type": "application/json"})
        reply = json.loads(urllib.request.urlopen(req, timeout=120).read())
    finally:
        proc.kill()
        proc.wait(timeout=30)
        log.close()
    tok = AutoTokenizer.from_pretrained(path)
    ids = tok(prompt)["input_ids"]
    assert reply["usage"]["prompt_tokens"] == len(ids)
    want = Engine(load_pretrained(path), EngineOptions(max_seqs=2, prefix_cache=True)).generate(
        [ids], SamplingParams(max_new_tokens=12, stop_token_ids=(0,))
    )[0]
    assert reply["choices"][0]["text"] == tok.decode(want, skip_special_tokens=True)
