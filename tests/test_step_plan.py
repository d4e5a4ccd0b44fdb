"""The cache plans the step (kvgraft.model.plan): the plan is immutable, each group carries one tagged read
strategy, and the per-slot arrays it is built from stay equal to the sequences' own tables through every
allocation (extend, copy on write, fork, snapshot/restore with split spans, free)."""

from __future__ import annotations

import dataclasses
import random

import numpy as np
import pytest
import torch

from kvgraft.model.batch import BatchContext
from kvgraft.model.blocks import CacheFullError
from kvgraft.model.cache import PagedKVCache, static_cache
from kvgraft.model.plan import GATHER, Gather, Home, Pieces, ReadPolicy, Run, StepPlan, plan_step
from kvgraft.model.presets import get_preset


def mirror_matches(cache: PagedKVCache) -> None:
    """Every live sequence's slot arrays equal its own tables and length."""
    for seq in cache.sequences:
        slot, table = cache.slot(seq), cache.block_table(seq)
        row = cache.slot_tables[slot]
        assert row[: len(table)].tolist() == table and (row[len(table) :] == -1).all()
        assert cache.slot_nblocks[slot] == len(table) and cache.slot_lengths[slot] == cache.length(seq)
        assert cache.slot_split[slot] == (len(cache.span_starts(seq)) > 1)
        for gi in range(len(cache.ring_groups)):
            assert cache.slot_rings[gi][slot].tolist() == cache.ring_table(seq, gi)


def reserved_matches(cache: PagedKVCache) -> None:
    """``reserved`` (array ops) says a row needs nothing exactly when ``extend`` would allocate, copy and raise
    nothing for it (token blocks, and with window rings the ring block its token writes), for one new token on a
    sequence in one span; more tokens, or a split sequence, may answer False, never a wrong True."""
    for seq in cache.sequences:
        slot = np.array([cache.slot(seq)])
        for n in (1, 2, 9):
            fits = cache.length(seq) + n <= cache.max_seq_len
            idle = fits and cache.blocks_needed(seq, n) == 0
            idle = idle and not any(cache.ring_blocks_needed(seq, cache.length(seq), n).values())
            got = bool(cache.reserved(slot, np.array([n]))[0])
            assert not got or idle, (seq, n)  # never a wrong True
            if n == 1 and not cache.slot_split[slot[0]]:
                assert got == idle, (seq, n)


@pytest.mark.parametrize("preset", ["llama-tiny", "ced-tiny"])
def test_slot_arrays_follow_every_allocation(preset):
    cfg = get_preset(preset)
    cache = PagedKVCache(cfg, num_blocks=48, block_size=8, max_seqs=6, max_seq_len=96)
    rng = random.Random(0)
    snaps = []
    for _ in range(300):
        live = cache.sequences
        op = rng.choice(["add", "extend", "extend", "extend", "fork", "snap", "restore", "free"])
        try:
            if op == "add" or not live:
                cache.add_sequence(expect_tokens=rng.choice([None, 20, 90]))
            elif op == "extend":
                seq = rng.choice(live)
                n = rng.randint(1, 20)
                if cache.can_extend(seq, n):
                    cache.extend(seq, n)
                    cache.commit(seq, n)
            elif op == "fork":
                cache.fork(rng.choice(live))
            elif op == "snap":
                snaps.append(cache.snapshot(rng.choice(live)))
            elif op == "restore" and snaps:
                snap = rng.choice(snaps)
                if not snap.released:
                    cache.restore(snap, recompute_from=rng.choice([None, cache.ring_split if cfg.is_ced else 1]))
            elif op == "free":
                cache.free(rng.choice(live))
        except CacheFullError:
            for s in snaps:
                cache.release(s)
            snaps.clear()
        mirror_matches(cache)
        reserved_matches(cache)
    assert any(cache.slot_split) or preset == "ced-tiny"  # split spans were exercised on the full-attention model


def test_reserved_rows_are_those_extend_leaves_alone():
    cfg = get_preset("llama-tiny")
    cache = PagedKVCache(cfg, num_blocks=40, block_size=4, max_seqs=4, max_seq_len=40)
    a = cache.add_sequence()
    cache.extend(a, 6)
    cache.commit(a, 5)  # 6 reserved, 5 written: one more token is reserved, two are not
    slot = np.array([cache.slot(a)])
    assert cache.reserved(slot, np.array([1])).tolist() == [True]
    assert cache.reserved(slot, np.array([4])).tolist() == [False]  # needs a block
    b = cache.fork(a)  # the partial block is shared now: writing it copies it first
    assert cache.reserved(np.array([cache.slot(a), cache.slot(b)]), np.array([1, 1])).tolist() == [False, False]
    assert cache.reserved(slot, np.array([36])).tolist() == [False]  # past max_seq_len: extend raises


def test_the_plan_is_immutable_and_reads_one_tagged_field():
    cfg = get_preset("llama-tiny")
    cache, seqs = static_cache(cfg, 3, 32, torch.float32, "cpu", block_size=4)
    ctx = BatchContext(cache, seqs, [5, 9, 5])
    plan = ctx.plan
    assert isinstance(plan, StepPlan) and isinstance(plan.groups, tuple)
    with pytest.raises(dataclasses.FrozenInstanceError):
        plan.num_tokens = 3  # type: ignore[misc]
    with pytest.raises(dataclasses.FrozenInstanceError):
        plan.groups[0].read = GATHER  # type: ignore[misc]
    assert [g.rows for g in plan.groups] == [[0, 2], [1]]  # by new tokens, in order of first row
    assert plan.positions.tolist() == [list(range(5)) + list(range(9)) + list(range(5))]
    assert plan.last_index.tolist() == [4, 13, 18] and plan.offsets == (0, 5, 14)
    # rows 0 and 2 sit in their slots' home runs (slots 0 and 2 of the range 0..3); a lone row reads a view
    assert isinstance(plan.groups[0].read, Home) and plan.groups[0].home[:2] == (0, 3)
    assert plan.groups[0].home[2].tolist() == [0, 2] and plan.groups[1].read == Run(cache.block_table(seqs[1])[0])
    ctx.commit()
    decode = plan_step(cache, seqs, [1, 1, 1])
    assert decode.groups[0].read == Home(0, 3, None)  # rows in their slots' home runs, in order
    assert decode.groups[0].home == (0, 3, None) and decode.groups[0].run is None
    # interleaved blocks with per-row views allowed at any size: pieces
    cache = PagedKVCache(cfg, num_blocks=40, block_size=4, max_seqs=3, max_seq_len=40)
    seqs = [cache.add_sequence() for _ in range(3)]
    for _ in range(3):
        for s in seqs:
            cache.extend(s, 4)
            cache.commit(s, 4)
    read = plan_step(cache, seqs, [1, 1, 1], policy=ReadPolicy(row_view_min_bytes=0)).groups[0].read
    assert isinstance(read, Pieces) and [len(p) for p in read.rows] == [4, 4, 4]
    assert isinstance(plan_step(cache, seqs, [1, 1, 1], policy=ReadPolicy(views=False)).groups[0].read, Gather)


def test_length_split_is_the_best_cut_of_at_most_three_parts():
    from itertools import combinations

    from kvgraft.model.plan import length_split

    rng = np.random.default_rng(0)
    for _ in range(60):
        G, T, cost = int(rng.integers(1, 9)), int(rng.integers(1, 4)), int(rng.integers(0, 400))
        ends = rng.integers(1, 300, G)
        parts = length_split(ends, T, cost)
        assert sorted(np.concatenate(parts).tolist()) == list(range(G))
        assert all((np.diff(p) > 0).all() for p in parts)  # row order within a part

        def total(ps, ends=ends, T=T, cost=cost):
            return sum(len(p) * int(ends[p].max()) * T for p in ps) + cost * (len(ps) - 1)

        e = np.argsort(ends, kind="stable")
        brute = min(total(np.split(e, list(c))) for k in range(0, min(2, G - 1) + 1) for c in combinations(range(1, G), k))
        assert total(parts) == brute


def test_rows_at_different_lengths_are_not_padded_to_the_longest():
    """Decode rows of 10 to 400 tokens: gathered, the plan cuts them by length (fewer padded pairs read) and the
    engine gives the same tokens as with every row padded to the longest and as each request alone."""
    from pathlib import Path

    from kvgraft.hf import load_pretrained
    from kvgraft.runtime.engine import Engine
    from kvgraft.runtime.options import EngineOptions
    from kvgraft.runtime.sampling import SamplingParams

    model = load_pretrained(Path(__file__).resolve().parents[1] / "models" / "kvgraft-llama-8m").eval()
    g = torch.Generator().manual_seed(5)
    lengths = [10, 400, 14, 380, 30, 200, 12, 390, 8, 250]
    prompts = [torch.randint(0, 8192, (n,), generator=g).tolist() for n in lengths]
    params = SamplingParams(max_new_tokens=6)

    def run(split: bool) -> tuple[list[list[int]], dict]:
        old = BatchContext.home, BatchContext.split_lengths, BatchContext.paged
        # gathered decode rows, group by group (not the CPU kernel's one call over every row's block table)
        BatchContext.home, BatchContext.split_lengths, BatchContext.paged = False, split, False
        try:
            engine = Engine(model, EngineOptions(max_seqs=10, max_batch_tokens=2048, max_seq_len=416))
            return engine.generate(prompts, params), engine.stats
        finally:
            BatchContext.home, BatchContext.split_lengths, BatchContext.paged = old

    padded, stats_padded = run(False)
    split, stats_split = run(True)
    alone = [Engine(model, EngineOptions(max_seqs=1, max_seq_len=416)).generate([p], params)[0] for p in prompts]
    assert split == padded == alone
    assert stats_split["keys_needed"] == stats_padded["keys_needed"]
    # the padding (pairs read beyond those needed) of the decode steps: cut by length, a small part is left
    pad_split = stats_split["keys_read"] - stats_split["keys_needed"]
    pad_padded = stats_padded["keys_read"] - stats_padded["keys_needed"]
    assert 0 <= pad_split < 0.25 * pad_padded, (pad_split, pad_padded)
    cache = PagedKVCache(model.config, num_blocks=300, block_size=16, max_seqs=10, max_seq_len=416)
    seqs = [cache.add_sequence() for _ in lengths]
    for s, n in zip(seqs, lengths):
        cache.extend(s, n)
        cache.commit(s, n)
    plan = plan_step(cache, seqs, [1] * 10, policy=ReadPolicy(home=False, row_view_min_bytes=1 << 40, paged=False))
    assert len(plan.groups) == 3 and all(isinstance(gr.read, Gather) for gr in plan.groups)
    assert plan.keys_read < 0.7 * 10 * 401


def test_decode_steps_reserve_only_for_rows_that_need_a_block(monkeypatch):
    """The scheduler checks every decoding row at once (PagedKVCache.reserved): the cache's extend runs only for
    rows whose next token opens a block (one step in block_size) or copies a shared one; tokens unchanged."""
    from pathlib import Path

    from kvgraft.hf import load_pretrained
    from kvgraft.runtime.engine import Engine
    from kvgraft.runtime.options import EngineOptions
    from kvgraft.runtime.sampling import SamplingParams

    model = load_pretrained(Path(__file__).resolve().parents[1] / "models" / "kvgraft-llama-8m").eval()
    g = torch.Generator().manual_seed(1)
    prompts = [torch.randint(0, 8192, (n,), generator=g).tolist() for n in (5, 16, 30, 47)]
    params = SamplingParams(max_new_tokens=20)
    expected = [Engine(model, EngineOptions(max_seqs=1, max_seq_len=80)).generate([p], params)[0] for p in prompts]
    engine = Engine(model, EngineOptions(max_seqs=4, max_seq_len=80))
    calls = []
    extend = engine.cache.extend
    monkeypatch.setattr(engine.cache, "extend", lambda seq, n: (calls.append((seq, n)), extend(seq, n))[1])
    assert engine.generate(prompts, params) == expected
    decode_calls = [n for _, n in calls if n == 1]
    # 4 rows x 19 decode tokens: a block opens every 16 tokens, so each row reserves for one or two of them
    assert 4 <= len(decode_calls) <= 8, decode_calls
