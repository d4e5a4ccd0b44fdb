"""Decode over views of the paged pools: sequences that say how long they will get receive consecutive
blocks (a claimed run they grow into; a preference, never a reservation), and decode rows whose blocks
are consecutive attend over views of the pools instead of a gathered copy, with the same logits."""

from __future__ import annotations

import pytest
import torch

from kvgraft.model.batch import BatchContext
from kvgraft.model.blocks import CacheFullError
from kvgraft.model.cache import PagedKVCache, static_cache
from kvgraft.model.presets import get_preset
from kvgraft.model.transformer import Transformer


@pytest.fixture(autouse=True)
def by_group(monkeypatch):
    """These tests compare the group reads (views, pieces, home, gather); the CPU kernel's one call over every
    row's block table would serve both sides of each comparison (tests/test_paged_attention.py tests it)."""
    monkeypatch.setattr(BatchContext, "paged", False)


def consecutive(table: list[int]) -> bool:
    return table == list(range(table[0], table[0] + len(table)))


def test_sequences_that_expect_their_length_grow_in_consecutive_blocks():
    cfg = get_preset("llama-tiny")
    cache = PagedKVCache(cfg, num_blocks=40, block_size=4, max_seqs=4, max_seq_len=40)
    seqs = [cache.add_sequence(expect_tokens=n) for n in (30, 17, 40)]
    loose = cache.add_sequence()  # says nothing: takes unclaimed ids first
    for s, n in zip(seqs, (5, 3, 1)):
        cache.extend(s, n)
        cache.commit(s, n)
    for _ in range(16):  # interleaved decode-like growth, one token per step
        for s in (*seqs, loose):
            cache.extend(s, 1)
            cache.commit(s, 1)
    for s in seqs:
        assert consecutive(cache.block_table(s)), cache.block_table(s)
    claimed = {
        b for s, n in zip(seqs, (30, 17, 40)) for b in range(cache.block_table(s)[0], cache.block_table(s)[0] + -(-n // 4))
    }
    assert not claimed & set(cache.block_table(loose))


def test_claims_are_preferences_not_reservations():
    cfg = get_preset("llama-tiny")
    cache = PagedKVCache(cfg, num_blocks=6, block_size=4, max_seqs=2, max_seq_len=24)
    a = cache.add_sequence(expect_tokens=24)  # claims all 6 blocks at its first
    cache.extend(a, 4)
    cache.commit(a, 4)
    b = cache.add_sequence()
    cache.extend(b, 20)  # the 5 ids a claimed are all that is free: b takes them
    assert cache.free_blocks == 0
    with pytest.raises(CacheFullError):
        cache.extend(a, 4)
    cache.free(b)
    cache.extend(a, 20)  # a grows back into its run
    assert consecutive(cache.block_table(a))
    cache.free(a)
    assert cache.free_blocks == 6
    with pytest.raises(ValueError, match="expect_tokens"):
        cache.add_sequence(expect_tokens=-1)


MLA = dict(attention_kinds=("mla", "mla"), kv_lora_rank=12, qk_rope_head_dim=8, qk_nope_head_dim=8, v_head_dim=16)


@pytest.mark.parametrize(
    "changes",
    [
        {},
        dict(qk_norm=True, head_dim=16),
        dict(kv_slots=(0, 0)),
        MLA,
        dict(MLA, kv_lora_rank=4),
        dict(MLA, attention_kinds=("gqa", "mla")),
    ],
    ids=["llama", "qwen3", "shared-slot", "mla", "mla-folded", "gqa-then-mla"],
)
def test_decode_over_views_equals_the_gathered_batch(changes, monkeypatch):
    import kvgraft.model.batch as batch

    monkeypatch.setattr(batch, "ROW_VIEW_MIN_BYTES", 0)  # tiny rows: take the view path whatever their size
    cfg = get_preset("llama-tiny").replace(**changes)
    torch.manual_seed(0)
    model = Transformer(cfg)
    model.init_weights(0)
    model.eval()
    lengths = (3, 9, 22)
    g = torch.Generator().manual_seed(1)
    prompts = [torch.randint(0, cfg.vocab_size, (n,), generator=g) for n in lengths]
    steps = torch.randint(0, cfg.vocab_size, (6, len(lengths)), generator=g)

    def run(views: bool, grad: bool = False) -> tuple[torch.Tensor, list]:
        old = BatchContext.views
        BatchContext.views = views
        try:
            cache, seqs = static_cache(cfg, len(lengths), 32, torch.float32, "cpu", block_size=4)
            logits, runs = [], []
            with torch.no_grad():
                for s, p in zip(seqs, prompts):
                    model(p, ctx=BatchContext(cache, [s], [len(p)]))
                for t in steps:
                    ctx = BatchContext(cache, seqs, [1] * len(seqs))
                    with torch.set_grad_enabled(grad):  # with grad, MLA takes its expanded path over the views
                        logits.append(model(t, ctx=ctx)[0].detach())
                    # a static cache's rows sit in their slots' home runs: GQA layers read one strided view of
                    # each pool (home), other paged layers per-row pieces
                    runs.append((ctx.groups[0].home is not None, ctx.groups[0].row_pieces is not None))
            return torch.stack(logits), runs
        finally:
            BatchContext.views = old

    viewed, runs = run(True)
    gathered, none = run(False)
    expect = ("gqa" in cfg.attention_kinds, "mla" in cfg.attention_kinds)
    assert all(r == expect for r in runs) and all(r == (False, False) for r in none)  # both paths really ran
    torch.testing.assert_close(viewed, gathered, atol=1e-5, rtol=0)
    torch.testing.assert_close(run(True, grad=True)[0], gathered, atol=1e-5, rtol=0)


def test_short_rows_are_gathered_long_ones_viewed():
    """Per-row views pay only once a row's keys outweigh a few small ops per row: below ROW_VIEW_MIN_BYTES
    per row and layer the batch is gathered."""
    from kvgraft.model.plan import ROW_VIEW_MIN_BYTES

    cfg = get_preset("llama-tiny")
    per_token = 2 * cfg.num_kv_heads * cfg.head_dim * 4
    long = -(-ROW_VIEW_MIN_BYTES // per_token)
    per_seq = -(-(long + 8) // 16)
    # four slots but blocks for two sequences: no slot has a home run long enough (home views need one),
    # so the sequences get consecutive runs elsewhere and decode chooses between per-row pieces and a gather
    cache = PagedKVCache(cfg, num_blocks=2 * per_seq + 2, block_size=16, max_seqs=4, max_seq_len=long + 8)
    seqs = [cache.add_sequence(expect_tokens=long + 8) for _ in range(2)]
    runs = {}
    for n in (8, long):
        for s in seqs:
            cache.extend(s, n - cache.length(s))
            cache.commit(s, n - cache.length(s))
        runs[n] = BatchContext(cache, seqs, [1, 1]).groups[0].row_pieces
    assert runs[8] is None and runs[long] is not None


def test_block_tables_cut_into_pieces():
    from kvgraft.model.plan import _pieces

    assert _pieces([4, 5, 6], 10, 4) == [(4, 3, 10)]
    assert _pieces([4, 5, 9, 2, 3], 19, 4) == [(4, 2, 8), (9, 1, 4), (2, 2, 7)]
    assert _pieces([], 0, 4) == []


@pytest.mark.parametrize("changes", [{}, MLA, dict(MLA, kv_lora_rank=4)], ids=["llama", "mla", "mla-folded"])
def test_decode_over_pieces_of_interleaved_blocks_equals_the_gather(changes, monkeypatch):
    """Sequences that never said how long they get grow in interleaved blocks (as a row restored from the
    prefix cache does after the kept prompt's blocks): each row is read as a few pieces, attended with one
    softmax over all of them, and gives the gather's logits."""
    import kvgraft.model.batch as batch

    monkeypatch.setattr(batch, "ROW_VIEW_MIN_BYTES", 0)
    cfg = get_preset("llama-tiny").replace(**changes)
    torch.manual_seed(0)
    model = Transformer(cfg)
    model.init_weights(0)
    model.eval()
    g = torch.Generator().manual_seed(2)
    prompts = [torch.randint(0, cfg.vocab_size, (n,), generator=g) for n in (5, 10, 3)]
    steps = torch.randint(0, cfg.vocab_size, (9, 3), generator=g)

    def run(views: bool):
        monkeypatch.setattr(BatchContext, "views", views)
        cache = PagedKVCache(cfg, num_blocks=40, block_size=4, max_seqs=3, max_seq_len=40)
        seqs = [cache.add_sequence() for _ in prompts]
        logits, pieces = [], []
        with torch.no_grad():
            for s, p in zip(seqs, prompts):
                model(p, ctx=BatchContext(cache, [s], [len(p)]))
            for t in steps:
                ctx = BatchContext(cache, seqs, [1, 1, 1])
                logits.append(model(t, ctx=ctx)[0])
                pieces.append(ctx.groups[0].row_pieces)
        return torch.stack(logits), pieces

    viewed, pieces = run(True)
    gathered, _ = run(False)
    assert max(len(p) for step in pieces for p in step) >= 3  # the rows really were in several pieces
    torch.testing.assert_close(viewed, gathered, atol=1e-5, rtol=0)


def test_sequences_that_expect_their_length_start_at_their_slots_home():
    """Each state slot has a home run of num_blocks // max_seqs blocks; a sequence that expects to fit
    there starts there and grows in it, else it takes the first free run; a batch with a row away from
    home is gathered."""
    cfg = get_preset("llama-tiny")
    cache = PagedKVCache(cfg, num_blocks=24, block_size=4, max_seqs=3, max_seq_len=32)
    assert cache.home_stride == 8
    seqs = [cache.add_sequence(expect_tokens=n) for n in (32, 9, 20)]
    for _ in range(14):
        for s in seqs:
            if cache.length(s) < 9:
                cache.extend(s, 1)
                cache.commit(s, 1)
    assert [cache.block_table(s) for s in seqs] == [[0, 1, 2], [8, 9, 10], [16, 17, 18]]
    assert BatchContext(cache, seqs, [1, 1, 1]).groups[0].home == (0, 3, None)

    cache = PagedKVCache(cfg, num_blocks=8, block_size=4, max_seqs=2, max_seq_len=16)
    x = cache.add_sequence(expect_tokens=4)  # slot 0, home block 0, claims nothing more
    cache.extend(x, 4)
    loose = cache.add_sequence()  # says nothing: the oldest free unclaimed ids, 1 and 2 (slot 0's home run)
    cache.extend(loose, 8)
    cache.commit(loose, 8)
    assert cache.block_table(loose) == [1, 2]
    cache.free(x)
    y = cache.add_sequence(expect_tokens=16)  # slot 0 again; its home run is not free: the first free run
    cache.extend(y, 5)
    cache.commit(y, 5)
    assert cache.slot(y) == 0 and cache.block_table(y) == [3, 4]
    assert BatchContext(cache, [y, loose], [1, 1]).groups[0].home is None


@pytest.mark.parametrize(
    "slots, order, expect",
    [
        (8, "in-order", ((0, 3), None)),  # fewer than half the slots: the rows' range, one matmul per key head
        (8, "permuted-with-a-gap", ((0, 4), [3, 0, 2])),  # slot 1 in the range is idle: attended and dropped
        (4, "permuted-with-a-gap", ((0, 4), [3, 0, 2])),  # half the slots or more: all of them, one matmul
    ],
)
def test_rows_at_home_read_one_strided_view_with_the_gather_logits(slots, order, expect):
    """Decode rows whose blocks are their slots' home runs attend over one strided view of each GQA pool
    (a range of slots; a slot of the range outside the group is attended and dropped): the same logits as
    the gathered batch."""
    cfg = get_preset("llama-tiny")
    torch.manual_seed(0)
    model = Transformer(cfg)
    model.init_weights(0)
    model.eval()
    g = torch.Generator().manual_seed(3)
    lengths = (7, 30, 2, 19)
    prompts = [torch.randint(0, cfg.vocab_size, (n,), generator=g) for n in lengths]
    steps = torch.randint(0, cfg.vocab_size, (5, 3), generator=g)

    def run(views: bool):
        old = BatchContext.views
        BatchContext.views = views
        try:
            cache = PagedKVCache(cfg, num_blocks=slots * 10, block_size=4, max_seqs=slots, max_seq_len=40)
            seqs = [cache.add_sequence(expect_tokens=40) for _ in prompts]
            with torch.no_grad():
                for s, p in zip(seqs, prompts):
                    model(p, ctx=BatchContext(cache, [s], [len(p)]))
                rows = seqs[:3] if order == "in-order" else [seqs[3], seqs[0], seqs[2]]
                logits, homes = [], []
                for t in steps:
                    ctx = BatchContext(cache, rows, [1, 1, 1])
                    logits.append(model(t, ctx=ctx)[0])
                    homes.append(ctx.groups[0].home)
            return torch.stack(logits), homes
        finally:
            BatchContext.views = old

    viewed, homes = run(True)
    gathered, none = run(False)
    assert all(h is not None for h in homes) and all(h is None for h in none)
    for h in homes:
        assert h[:2] == expect[0] and (h[2] is None if expect[1] is None else h[2].tolist() == expect[1])
    torch.testing.assert_close(viewed, gathered, atol=1e-5, rtol=0)


def test_prefix_cache_keeps_decode_rows_at_home_with_the_same_tokens(monkeypatch):
    """With the prefix cache on, a kept prompt's partial last block is the entry's own copy (the request
    writes on at home), and a new request's home run is cleared of kept prompts (relocated, else dropped):
    decode rows stay at home; a prompt kept, relocated and hit again gives the tokens it gives alone."""
    import kvgraft.runtime.engine as engine_module
    from kvgraft.runtime.engine import Engine
    from kvgraft.runtime.options import EngineOptions
    from kvgraft.runtime.sampling import SamplingParams

    cfg = get_preset("llama-tiny")
    torch.manual_seed(0)
    model = Transformer(cfg)
    model.init_weights(0)
    model.eval()
    g = torch.Generator().manual_seed(5)
    prompts = [torch.randint(0, cfg.vocab_size, (n,), generator=g).tolist() for n in (21, 7, 30, 13, 26, 9)]
    prompts.append(list(prompts[0]))  # kept in the first wave, relocated in the second, hit in the third
    params = SamplingParams(max_new_tokens=6)
    alone = [Engine(model, EngineOptions(max_seqs=1)).generate([p], params)[0] for p in prompts]

    contexts: list[BatchContext] = []

    def recording(*args, **kwargs):
        contexts.append(BatchContext(*args, **kwargs))
        return contexts[-1]

    monkeypatch.setattr(engine_module, "BatchContext", recording)
    engine = Engine(model, EngineOptions(max_seqs=3, max_seq_len=64, prefix_cache=True))
    outs = [engine.generate(prompts[i : i + 3], params) for i in (0, 3, 6)]
    assert [o for wave in outs for o in wave] == alone
    assert engine.prefix_stats["hits"] >= 1
    decode = [gr for c in contexts for gr in c.groups if gr.T == 1 and gr.G > 1]
    assert decode and all(gr.home is not None for gr in decode)
