"""Llama/MLA bases: requests for adapters that leave the lower layers' KV untouched share those layers'
blocks with the base's kept prompt (per-layer block tables in one id space); the layers from the first
changed one are rebuilt into the request's own blocks by a replay; tokens equal each request alone."""

import copy

import pytest
import torch
from factories import sharp_model

from kvgraft.adapters.lora import (
    AdapterConfig,
    add_adapter,
    randomize_adapter,
    save_adapter,
)
from kvgraft.adapters.placement import Placement
from kvgraft.model.batch import BatchContext
from kvgraft.model.cache import PagedKVCache
from kvgraft.model.presets import get_preset
from kvgraft.runtime.engine import Engine
from kvgraft.runtime.options import EngineOptions
from kvgraft.runtime.sampling import SamplingParams

LLAMA = get_preset("llama-tiny").replace(num_layers=4, max_position_embeddings=256)
MLA = LLAMA.replace(
    attention_kinds=("mla",) * 4, kv_lora_rank=6, qk_rope_head_dim=8, qk_nope_head_dim=8, v_head_dim=16, mla_latent_norm=True
)
ADAPTERS = {
    "top": Placement((3,), ("all-linear",)),  # changes the KV of layer 3 only
    "mid": Placement("from:2", ("attention", "mlp")),  # changes the KV of layers 2 and 3
    "out": Placement((3,), ("mlp",)),  # changes no layer's KV: reuses everything as it is
}


build = sharp_model  # tests/factories.py


@pytest.fixture(scope="module", params=[LLAMA, MLA], ids=["llama", "mla"])
def setup(request, tmp_path_factory):
    cfg = request.param
    base = build(cfg)
    root = tmp_path_factory.mktemp("layer-sharing")
    dirs = {}
    for i, (name, placement) in enumerate(ADAPTERS.items()):
        pm = add_adapter(copy.deepcopy(base), placement, AdapterConfig(rank=4))
        randomize_adapter(pm, 0.15, seed=30 + i)
        dirs[name] = save_adapter(pm, root / name)
    return base, dirs


def engine(base, dirs, names=ADAPTERS, **kw) -> Engine:
    e = Engine(base, EngineOptions(max_seqs=kw.pop("max_seqs", 8), max_batch_tokens=kw.pop("max_batch_tokens", 48), **kw))
    for n in names:
        e.load_adapter(n, dirs[n])
    return e


def alone(base, dirs, prompt, adapter, n) -> list[int]:
    e = engine(base, dirs, [adapter] if adapter else [], max_seqs=1)
    return e.generate([prompt], SamplingParams(max_new_tokens=n), adapter)[0]


def rand_prompt(cfg, n, seed) -> list[int]:
    return torch.randint(0, cfg.vocab_size, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def test_adapters_share_the_layers_below_their_first_changed_kv(setup):
    base, dirs = setup
    cfg = base.config
    prompt = rand_prompt(cfg, 50, 5)
    e = engine(base, dirs, prefix_cache=True)
    assert [e.adapters.get(n).certificate["first_adapted_layer"] for n in ADAPTERS] == [3, 2, 3]
    e.generate([prompt], SamplingParams(max_new_tokens=1))  # the base keeps the prompt
    (entry,) = e.prefix._entries.values()
    c = e.cache
    jobs = ["top", "mid", "out", None]
    ids = [e.add_request(prompt, SamplingParams(max_new_tokens=6), a) for a in jobs]
    e.step()  # restores, replays, and every request's last prompt token
    seqs = {a: e.requests[i].seq for a, i in zip(jobs, ids)}
    spans = dict(entry.snap.spans)
    full = len(entry.tokens) // c.block_size  # blocks the step did not write (the last may be copied)
    for a, below in (("top", 3), ("mid", 2)):
        s = seqs[a]
        assert [u for u, _ in c.spans(s)] == [0, below]  # layers below ``below`` share, the rest are its own
        assert c.block_table(s, 0)[:full] == list(spans[0][:full])
        own = set(c.block_table(s, below))
        assert not own & set(spans[0])  # ids of its own layers differ from the kept prompt's there
        for u in range(below, len(c.units)):  # held by the request and its own kept entry, no one else
            others = {b for x in seqs.values() if x != s for b in c.block_table(x, u)}
            assert not set(c.block_table(s, u)) & others
            assert all(c.refcount(b, u) <= 2 for b in c.block_table(s, u))
    assert len(e.prefix) == 3  # the base's entry, and one per replayed adapter (its lower layers: the base's blocks)
    for a in ("out", None):  # no KV changed: one span, the kept blocks as they are
        assert [u for u, _ in c.spans(seqs[a])] == [0]
        assert c.block_table(seqs[a], 3)[:full] == list(spans[0][:full])
    b0 = spans[0][0]
    assert c.refcount(b0, 0) == 1 + len(jobs) + 2  # layer 0's first block: every entry and request
    assert c.refcount(b0, 3) == 1 + 2  # layer 3's: the entry, "out" and the base only
    while e.has_unfinished():
        e.step()
    got = [e.pop_finished(i).output for i in ids]
    assert got == [alone(base, dirs, prompt, a, 6) for a in jobs]
    s = e.cache_stats()
    assert s["prefix_hits"] == 4 and s["replays"] == 2
    e.prefix.clear()
    assert c.used_bytes == 0 and c.free_blocks == c.num_blocks


def test_shared_layers_hold_less_than_private_caches(setup):
    """Three adapters over one kept prompt hold fewer bytes than the same requests without the prefix
    cache, by the lower layers' blocks they reference instead of copying."""
    base, dirs = setup
    prompt = rand_prompt(base.config, 64, 9)
    held = {}
    for mode in (True, False):
        e = engine(base, dirs, prefix_cache=mode)
        if mode:
            e.generate([prompt], SamplingParams(max_new_tokens=1))
        ids = [e.add_request(prompt, SamplingParams(max_new_tokens=20), a) for a in ("top", "mid", "top")]
        while any(not e.requests[i].output for i in ids):
            e.step()
        assert all(e.requests[i].seq is not None for i in ids)
        if mode:
            e.prefix.clear()  # count what the requests hold, not the kept entry
        held[mode] = e.cache.used_bytes
    # 64 tokens = 4 blocks per layer and request, 48 in all without sharing; shared: the 3 full blocks of
    # layers 0-1 once for all three requests and of layer 2 once for the two "top" requests (-15 blocks)
    assert held[True] <= held[False] * (48 - 15 + 1) / 48


def test_a_replay_refuses_shared_blocks_and_a_split_of_window_rings():
    cfg = LLAMA
    base = build(cfg)
    c = PagedKVCache(cfg, num_blocks=8, block_size=16, max_seqs=2, max_seq_len=64)
    a = c.add_sequence()
    with torch.inference_mode():
        base(torch.arange(20)[None] % cfg.vocab_size, ctx=BatchContext(c, [a], [20]))
    snap = c.snapshot(a)
    with pytest.raises(ValueError, match="share"):
        BatchContext(c, [a], [20], replay=True, write_from=2)  # a's blocks are shared with the snapshot
    r = c.restore(snap, recompute_from=2)
    BatchContext(c, [r], [20], replay=True, write_from=2)  # its own layers 2-3: fine
    with pytest.raises(ValueError, match="write_from"):
        BatchContext(c, [r], [20], replay=True, write_from=9)
    with pytest.raises(ValueError, match="needs write_from"):
        with torch.inference_mode():
            base.replay(base.embed_tokens(torch.arange(20))[None], BatchContext(c, [r], [20], replay=True), 0)
    mistral = cfg.replace(sliding_window=8)
    m = PagedKVCache(mistral, num_blocks=8, block_size=4, max_seqs=2, max_seq_len=32)
    s = m.snapshot(m.add_sequence())
    with pytest.raises(ValueError, match="ring"):
        m.restore(s, recompute_from=2)


def test_a_chunked_full_replay_equals_one_replay(setup):
    """The engine replays a long prompt in chunks of max_batch_tokens (replay_at): the rebuilt layers
    hold the same KV as a replay in one piece, and as the adapter's own prefill."""
    base, dirs = setup
    prompt = rand_prompt(base.config, 70, 21)
    out = {}
    for chunk in (16, 4096):
        e = engine(base, dirs, ["mid"], prefix_cache=True, max_batch_tokens=chunk, max_seqs=2)
        e.generate([prompt], SamplingParams(max_new_tokens=1))
        rid = e.add_request(prompt, SamplingParams(max_new_tokens=2), "mid")
        e.step()
        seq, c = e.requests[rid].seq, e.cache
        out[chunk] = {
            u: c.paged[c.units[u][1]][..., c.block_table(seq, u), :, :].clone()
            if c.units[u][1] in c.head_major
            else c.paged[c.units[u][1]][c.block_table(seq, u)].clone()
            for u in range(2, len(c.units))
        }
        assert e.cache_stats()["replays"] == 1
    for u in out[16]:
        torch.testing.assert_close(out[16][u], out[4096][u], rtol=1e-4, atol=1e-5)
    with pytest.raises(ValueError, match="replay_at"):
        BatchContext(e.cache, [seq], [4], replay=True, replay_at=[0])
