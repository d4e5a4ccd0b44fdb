"""One shared cache across adapters: the prefix cache, decoder replay and their exactness.

Tiny random causal encoder-decoder (6 layers, kv_source 1 and 3: pivot 3, window 8, m = 2) with random
non-zero adapters: two certified decoder-side ones (pivot's KV writers frozen), one that touches the
encoder (private cache). Every request, served over the shared cache (prefix hits across adapters,
decoder replays, mixed batches), must give exactly the tokens it gives alone with a private cache."""

from __future__ import annotations

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
from kvgraft.model.presets import get_preset
from kvgraft.model.transformer import Transformer
from kvgraft.runtime.engine import Engine
from kvgraft.runtime.options import EngineOptions
from kvgraft.runtime.prefix import replay_layer, replay_span
from kvgraft.runtime.sampling import SamplingParams

CED = get_preset("ced-tiny").replace(num_layers=6, kv_source_layers=(1, 3), qkv_bias=True, max_position_embeddings=256)
ADAPTERS = {
    "dec": (Placement("decoder-half", ("all-linear",), freeze_kv_writers=True), AdapterConfig(rank=4)),
    "late": (Placement("from:4", ("attention", "mlp")), AdapterConfig(rank=8, alpha=4.0)),
    "enc": (Placement("all", ("all-linear",)), AdapterConfig(rank=4)),  # touches the encoder: private cache
}


def build(seed=0) -> Transformer:
    return sharp_model(CED, seed)  # tests/factories.py


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    base = build()
    root = tmp_path_factory.mktemp("shared-adapters")
    dirs = {}
    for i, (name, (placement, acfg)) in enumerate(ADAPTERS.items()):
        pm = add_adapter(copy.deepcopy(base), placement, acfg)
        randomize_adapter(pm, 0.15, seed=20 + i)
        dirs[name] = save_adapter(pm, root / name)
    return base, dirs


def engine(base, dirs, names=ADAPTERS, **kw) -> Engine:
    e = Engine(base, EngineOptions(max_seqs=kw.pop("max_seqs", 8), max_batch_tokens=kw.pop("max_batch_tokens", 48), **kw))
    for n in names:
        e.load_adapter(n, dirs[n])
    return e


def alone(base, dirs, prompt, adapter, max_new) -> list[int]:
    e = engine(base, dirs, [adapter] if adapter else [], max_seqs=1)
    return e.generate([prompt], SamplingParams(max_new_tokens=max_new), adapter)[0]


def rand_prompt(n, seed) -> list[int]:
    return torch.randint(0, CED.vocab_size, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def test_certificates_decide_who_shares(setup):
    base, dirs = setup
    e = engine(base, dirs, prefix_cache=True)
    shares = {n: e.adapters.get(n).certificate["shares_cache"] for n in ADAPTERS}
    assert shares == {"dec": True, "late": True, "enc": False}
    assert replay_layer(CED) == 3 and replay_span(CED) == 8 + (6 - 1 - 3) * 7


@pytest.mark.parametrize("length", [20, 40, 95])
def test_requests_over_the_shared_cache_give_their_tokens_alone(setup, length):
    """A base request keeps the prompt; then every adapter (and the base) asks for that prompt and longer
    ones in one mixed batch: certified adapters reuse the base's blocks through a decoder replay, the
    uncertified one computes its own; the tokens equal each request alone with a private cache."""
    base, dirs = setup
    prompt = rand_prompt(length, length)
    longer = prompt + rand_prompt(9, length + 1)
    e = engine(base, dirs, prefix_cache=True)
    first = e.generate([prompt], SamplingParams(max_new_tokens=5))[0]
    assert first == alone(base, dirs, prompt, None, 5)
    assert e.cache_stats()["prefix_entries"] == 1
    jobs = [(prompt, "dec"), (prompt, "late"), (prompt, "enc"), (longer, "dec"), (longer, None), (prompt, None), (longer, "late")]
    ids = [e.add_request(p, SamplingParams(max_new_tokens=6), a) for p, a in jobs]
    shared_seen = 0
    while e.has_unfinished():
        e.step()
        shared_seen = max(shared_seen, e.cache_stats()["shared_bytes"])
    got = [e.pop_finished(i).output for i in ids]
    want = [alone(base, dirs, p, a, 6) for p, a in jobs]
    assert got == want
    s = e.cache_stats()
    assert s["prefix_hits"] >= 5  # every job but "enc" (and the longer "enc"-free ones) reuses a kept prefix
    assert s["replays"] >= 3  # dec, late and longer/late reuse the base's entry through a replay
    assert shared_seen > 0  # blocks were held by several sequences at once


def test_replay_rebuilds_the_windows_a_full_prefill_writes(setup):
    """The decoder replay over the derived span rebuilds every ring exactly as a full prefill with the
    adapter does (to float tolerance); one position fewer leaves the deepest ring wrong (the rule is tight)."""
    base, dirs = setup
    prompt = rand_prompt(60, 7)
    span, p = replay_span(CED), replay_layer(CED)
    rings = {}
    for mode in ("full", "replay", "short"):
        e = engine(base, dirs, ["dec"], max_seqs=2)
        c = e.cache
        seq = c.add_sequence()
        adapter = "dec" if mode == "full" else None
        ctx = BatchContext(c, [seq], [len(prompt)], adapter_ids=[adapter], capture_layer=p)
        with torch.inference_mode():
            base(torch.tensor(prompt)[None], ctx=ctx)
            if mode != "full":
                n = span if mode == "replay" else span - 1
                hidden = ctx.captured[0, -n:]
                rctx = BatchContext(c, [seq], [n], adapter_ids=["dec"], replay=True)
                base.replay(hidden, rctx, p)
        rings[mode] = {layer: c.ring(seq, layer) for layer in c.rings}
        assert c.length(seq) == len(prompt)
    for layer in range(CED.num_layers):
        torch.testing.assert_close(rings["replay"][layer], rings["full"][layer], rtol=1e-4, atol=1e-5)
    assert not torch.allclose(rings["short"][CED.num_layers - 1], rings["full"][CED.num_layers - 1], atol=1e-3)


def test_prefix_cache_switching_adapters_and_hot_reload(setup):
    """Adapter switches on a cached prefix, unloading and reloading under the same name (a new adapter:
    its old private entries are not reused), LRU eviction under a small block budget: tokens as alone."""
    base, dirs = setup
    prompt = rand_prompt(70, 3)
    e = engine(base, dirs, ["dec", "enc"], prefix_cache=True, prefix_entries=2)
    for a in ("dec", "enc", None, "dec"):
        assert e.generate([prompt], SamplingParams(max_new_tokens=4), a)[0] == alone(base, dirs, prompt, a, 4)
    e.unload_adapter("enc")
    e.load_adapter("enc", dirs["late"])  # another adapter under the old name
    got = e.generate([prompt], SamplingParams(max_new_tokens=4), "enc")[0]
    assert got == alone(base, dirs, prompt, "late", 4)
    # many different prompts through a 2-entry cache: entries are evicted, answers stay right
    prompts = [rand_prompt(40 + i, 100 + i) for i in range(4)]
    outs = e.generate(prompts, SamplingParams(max_new_tokens=3), ["dec", None, "enc", "dec"])
    assert outs == [
        alone_named(base, dirs, p, 3) if a == "enc" else alone(base, dirs, p, a, 3)
        for p, a in zip(prompts, ["dec", None, "enc", "dec"])
    ]
    assert len(e.prefix) <= 2


def alone_named(base, dirs, prompt, max_new):
    e = Engine(base, EngineOptions(max_seqs=1, max_batch_tokens=48))
    e.load_adapter("enc", dirs["late"])
    return e.generate([prompt], SamplingParams(max_new_tokens=max_new), "enc")[0]


def test_prefix_entries_give_way_before_requests_are_preempted(setup):
    """A pool just big enough for the running requests: kept prefixes are evicted, nobody is preempted."""
    base, dirs = setup
    prompts = [rand_prompt(30, 50 + i) for i in range(3)]
    e = engine(base, dirs, ["dec"], prefix_cache=True, num_blocks=3 * 3 + 1, max_seqs=3)
    outs = e.generate(prompts, SamplingParams(max_new_tokens=8), ["dec", None, "dec"])
    assert outs == [alone(base, dirs, p, a, 8) for p, a in zip(prompts, ["dec", None, "dec"])]
    assert e.stats["preemptions"] == 0


def test_llama_base_and_kv_neutral_adapters_share_entries_others_keep_their_own(tmp_path):
    """GQA base: an adapter on the last layer's output and MLP changes no layer's KV (certified): it and
    the base reuse each other's kept prompts as they are (no replay); an adapter on the second half's
    attention reuses the base's lower layers (replaying its own) once, then its own entry. Tokens equal each
    request alone."""
    cfg = get_preset("llama-tiny").replace(num_layers=3)
    torch.manual_seed(0)
    base = Transformer(cfg)
    base.init_weights(0)
    base.eval()
    specs = {"tail": Placement([2], ("attention-out", "mlp")), "half": Placement("decoder-half", ("attention",))}
    dirs = {}
    for i, (name, placement) in enumerate(specs.items()):
        pm = add_adapter(copy.deepcopy(base), placement, AdapterConfig(rank=4))
        randomize_adapter(pm, 0.3, seed=5 + i)
        dirs[name] = save_adapter(pm, tmp_path / name)
    e = engine(base, dirs, specs, prefix_cache=True)
    assert e.adapters.get("tail").certificate["shares_cache"]
    assert not e.adapters.get("half").certificate["shares_cache"]
    prompt = rand_prompt(40, 9)
    order = [None, "tail", "half", "half", None]
    got = [e.generate([prompt], SamplingParams(max_new_tokens=5), a)[0] for a in order]
    want = [alone(base, dirs, prompt, a, 5) for a in order]
    assert got == want
    s = e.cache_stats()
    # tail <- base as it is; the first half <- base's layers below its first adapted one, the rest replayed
    # (tests/test_layer_sharing.py); the second half <- its own entry as it is; base <- base
    assert (s["prefix_hits"], s["replays"]) == (4, 1)


def test_a_shared_system_prompt_is_kept_where_prompts_fork(tmp_path):
    """Prompts that share a 'system prompt' and differ after it: the second request keeps its cache where
    it forks from the first one's kept prompt, and later requests (other adapters) start there. A window
    longer than the short prompts (their rings are kept partly filled). Tokens equal each alone."""
    cfg = CED.replace(sliding_window=32)
    base = sharp_model(cfg, 1)
    dirs = {}
    for i, name in enumerate(("dec", "late")):
        placement, acfg = ADAPTERS[name]
        pm = add_adapter(copy.deepcopy(base), placement, acfg)
        randomize_adapter(pm, 0.15, seed=40 + i)
        dirs[name] = save_adapter(pm, tmp_path / name)
    system = rand_prompt(24, 77)
    users = [rand_prompt(n, 80 + n) for n in (5, 9, 3, 12)]
    route = [None, "dec", "late", "dec"]
    e = engine(base, dirs, dirs, prefix_cache=True)
    got = [e.generate([system + u], SamplingParams(max_new_tokens=5), a)[0] for u, a in zip(users, route)]
    want = [alone(base, dirs, system + u, a, 5) for u, a in zip(users, route)]
    assert got == want
    kept = sorted(len(x.tokens) for x in e.prefix._entries.values())
    assert 24 in kept  # the fork point
    s = e.cache_stats()
    assert s["prefix_hits"] == 2 and s["replays"] >= 1  # the third and fourth start from the system prompt


def test_the_prefix_cache_keeps_within_its_byte_budget(setup):
    """Kept state outside the pools (pivot inputs, pending tokens) stays under prefix_max_bytes: older
    entries are evicted, an entry larger than the whole budget is not kept (its blocks and ring blocks
    go); a bad budget is refused before any work."""
    base, dirs = setup
    e = engine(base, dirs, ["dec"], prefix_cache=True, prefix_max_bytes=15_000)
    for i in range(5):
        e.generate([rand_prompt(30 + i, 200 + i)], SamplingParams(max_new_tokens=2), "dec")
        assert 0 < e.cache_stats()["prefix_bytes"] <= 15_000
    one = e.prefix._entries[next(reversed(e.prefix._entries))].nbytes
    assert len(e.prefix) == 15_000 // one or len(e.prefix) == 15_000 // one - 1
    assert 1 < len(e.prefix) < 5
    tiny = engine(base, dirs, [], prefix_cache=True, prefix_max_bytes=1000)
    tiny.generate([rand_prompt(40, 3)], SamplingParams(max_new_tokens=2))
    assert len(tiny.prefix) == 0 and tiny.cache.free_blocks == tiny.cache.num_blocks
    assert tiny.cache.used_bytes == 0  # ring blocks too
    with pytest.raises(ValueError, match="prefix_max_bytes"):
        Engine(base, EngineOptions(prefix_cache=True, prefix_max_bytes=-1))


def test_rows_of_several_adapters_prefill_and_decode_in_one_group(setup, monkeypatch):
    """Prompts of one length for different adapters (and the base) run as one mixed group: the prefill
    (expanded latent path, kv_b per adapter) and the decode (absorbed, base kv_b plus per-row low-rank
    deltas) give each request its tokens alone."""
    import kvgraft.runtime.engine as engine_mod
    from kvgraft.model.plan import MIXED

    seen = []

    class Spy(BatchContext):
        def __init__(self, *a, **k):
            super().__init__(*a, **k)
            seen.append([(g.T, g.adapter is MIXED, g.G) for g in self.groups])

    base, dirs = setup
    route = ["dec", "late", None, "enc", "dec"]
    prompts = [rand_prompt(37, 300 + i) for i in range(len(route))]
    e = engine(base, dirs, max_batch_tokens=256)
    monkeypatch.setattr(engine_mod, "BatchContext", Spy)
    got = e.generate(prompts, SamplingParams(max_new_tokens=7), route)
    monkeypatch.undo()
    assert seen[0] == [(37, True, 5)] and seen[1] == [(1, True, 5)]
    assert got == [alone(base, dirs, p, a, 7) for p, a in zip(prompts, route)]


def test_shared_bytes_counts_blocks_held_more_than_once(setup):
    """The running count behind cache.shared_bytes equals a scan of the reference counts (token blocks
    and window-ring blocks) through forks, snapshots, copy on write and frees."""
    base, _ = setup
    e = Engine(base, EngineOptions(max_seqs=4, max_batch_tokens=64, block_size=4))  # rings of W = 8: two ring blocks of 4
    c = e.cache

    def scan():
        rings = sum(
            g.block_bytes for gi, g in enumerate(c.ring_groups) for b in range(g.num_blocks) if c.ring_refcount(gi, b) > 1
        )
        return sum(1 for b in range(c.num_blocks) if c.refcount(b) > 1) * c.block_bytes + rings

    a = c.add_sequence()
    c.extend(a, 42)
    c.commit(a, 42)
    assert c.shared_bytes == scan() == 0
    b = c.fork(a)
    snap = c.snapshot(a)
    assert len(c.ring_groups) == 2 and c.ring_blocks_per_seq == 2
    both = 11 * c.block_bytes + 2 * sum(g.block_bytes for g in c.ring_groups)
    assert c.shared_bytes == scan() == both
    c.extend(b, 1)  # copy on write of the last, partly filled block and of the ring block position 42 lands in
    assert c.shared_bytes == scan() == both  # still held by a and the snapshot
    for gi in range(2):  # ring slot 42 % 8 = 2 is in ring block 0: b's own copy; ring block 1 still shared
        assert c.ring_table(b, gi)[0] != c.ring_table(a, gi)[0] and c.ring_table(b, gi)[1] == c.ring_table(a, gi)[1]
    r = c.restore(snap)
    c.free(a)
    assert c.shared_bytes == scan()
    c.release(snap)
    c.free(r)
    assert c.shared_bytes == scan() == 0
    c.free(b)
    assert c.free_blocks == c.num_blocks


def test_adapters_over_one_prompt_share_the_encoder_windows(setup):
    """N requests over one kept prompt (the base and two certified adapters) reference the prompt's
    encoder window-ring blocks (one copy, reference counted, copied only where a step writes), while each
    certified adapter holds its own decoder rings (rebuilt by its replay); tokens equal each alone."""
    base, dirs = setup
    prompt = rand_prompt(45, 77)
    kw = {"block_size": 4, "max_batch_tokens": 64}  # W = 8: two ring blocks of 4 slots per ring
    e = engine(base, dirs, ["dec", "late"], prefix_cache=True, **kw)
    e.generate([prompt], SamplingParams(max_new_tokens=1))
    (entry,) = e.prefix._entries.values()
    c = e.cache
    assert len(c.ring_groups) == 2 and c.ring_groups[1].layers[0] == replay_layer(CED) and c.ring_blocks_per_seq == 2
    T = entry.length  # the kept prompt: all but its last token
    ids = [e.add_request(prompt, SamplingParams(max_new_tokens=5), a) for a in ("dec", "late", None)]
    e.step()  # restores (+ replays) and the last prompt token, which writes ring slot T % 8
    seqs = [e.requests[i].seq for i in ids]
    written = T % 8 // 4  # the ring block the step wrote; the other one is still the kept prompt's
    other = 1 - written
    enc = entry.snap.rings[0]
    for s in seqs:  # encoder: the kept block referenced by all, the written one copied per sequence
        assert c.ring_table(s, 0)[other] == enc[other]
        assert c.ring_table(s, 0)[written] != enc[written]
    assert c.ring_refcount(0, enc[other]) == 1 + len(seqs)
    dec_blocks = [set(c.ring_table(s, 1)) for s in seqs[:2]]  # certified adapters: their own decoder rings
    assert not dec_blocks[0] & dec_blocks[1] and not dec_blocks[0] & set(entry.snap.rings[1])
    assert c.ring_table(seqs[2], 1)[other] == entry.snap.rings[1][other]  # the base reuses the kept decoder rings
    while e.has_unfinished():
        e.step()
    got = [e.pop_finished(i).output for i in ids]
    for out, a in zip(got, ("dec", "late", None)):
        solo = engine(base, dirs, [a] if a else [], max_seqs=1, **kw)
        assert out == solo.generate([prompt], SamplingParams(max_new_tokens=5), a)[0]
    e.prefix.clear()
    assert c.used_bytes == 0 and all(len(g.free) == g.num_blocks for g in c.ring_groups)
