"""The CPU kernel for a causal encoder-decoder layer's decode rows (kvgraft.model.cpu_kernels.ced_decode): each row's
query over its window ring and its source layer's shared entries, read in place through their tables, under one
softmax, equal to the same math over gathered tensors; the engine's tokens and logits with the kernel equal those of
the gather-and-mask path it replaces (adapters, key/value biases, compression, rows before and past the window);
clear refusals of counts or blocks outside a row's tables."""

from __future__ import annotations

import pytest
import torch

from kvgraft.model import cpu_kernels as ck
from kvgraft.model.batch import BatchContext
from kvgraft.model.cache import PagedKVCache
from kvgraft.model.presets import get_preset
from kvgraft.model.transformer import Transformer

pytestmark = pytest.mark.skipif(
    ck.kernel() is None or not ck.kernel().ced_supported(16, 16, 16, 16), reason="kvgraft's CPU kernels are not built"
)


def reference(qw, ql, bias, ring, rtab, seg, stab, counts, K, dc):
    """Per row: its ring slots and shared entries gathered through its tables, one softmax over both."""
    G, H, dk = qw.shape
    E = ring.shape[2]
    dv = (E - K * dk) // K
    yw, yl, mass = torch.zeros(G, H, dv), torch.zeros(G, H, dc), torch.zeros(G, H)
    for g, (nw, nl) in enumerate(counts.tolist()):
        rows = ring[rtab[g]].reshape(-1, E)[:nw]  # (nw, E) by ring slot
        k = rows[:, : K * dk].view(nw, K, dk).repeat_interleave(H // K, 1)  # (nw, H, dk)
        v = rows[:, K * dk :].view(nw, K, dv).repeat_interleave(H // K, 1)
        s = torch.einsum("hd,nhd->hn", qw[g], k)
        if nl:
            e = seg[stab[g]].reshape(-1, seg.shape[-1])[:nl]
            s_lat = ql[g] @ e[:, : ql.shape[-1]].T + (bias[g][:, None] if bias is not None else 0)
            s = torch.cat([s, s_lat], dim=1)
        p = torch.softmax(s, dim=-1)
        yw[g] = torch.einsum("hn,nhd->hd", p[:, :nw], v)
        if nl:
            yl[g] = p[:, nw:] @ e[:, :dc]
            mass[g] = p[:, nw:].sum(-1)
    return yw, yl, mass


def case(
    H=8, K=4, dk=32, dv=32, dc=64, dr=16, rb=16, R=64, epb=16, counts=((1, 0), (64, 0), (64, 1), (40, 0), (64, 117)), seed=0
):
    """Ring and segment pools of scattered blocks, strided queries (as a matmul leaves them), each row's counts."""
    g = torch.Generator().manual_seed(seed)
    G, E = len(counts), K * (dk + dv)
    ring = torch.randn(4 * G * (R // rb), rb, E, generator=g)
    rtab = torch.stack([torch.randperm(ring.shape[0], generator=g)[: R // rb] for _ in range(G)])
    nb = max(-(-nl // epb) for _, nl in counts) + 1
    seg = torch.randn(3 * G * nb, epb, dc + dr + 5, generator=g)  # entries wider than read (an indexer key)
    stab = torch.stack([torch.randperm(seg.shape[0], generator=g)[:nb] for _ in range(G)])
    qw = torch.randn(G, H + 3, dk, generator=g)[:, :H] * dk**-0.5  # strided rows, pre-scaled as the layer's are
    ql = torch.randn(G, H, dc + dr, generator=g) * (dc + dr) ** -0.5
    bias = torch.randn(G, H, generator=g)
    return qw, ql, bias, ring, rtab, seg, stab, torch.tensor(counts), K, dc


@pytest.mark.parametrize(
    "shape",
    [{}, {"dk": 16, "dv": 16, "dc": 16, "dr": 8, "H": 4, "K": 2}, {"dk": 40, "dv": 24, "dc": 20, "dr": 12, "H": 6, "K": 1}],
    ids=["ced-8m", "ced-tiny", "odd-widths-mqa"],
)
@pytest.mark.parametrize("with_bias", [True, False])
def test_each_row_equals_one_softmax_over_its_gathered_ring_and_entries(shape, with_bias):
    qw, ql, bias, *rest = case(**shape)
    args = (qw, ql, bias if with_bias else None, *rest)
    got = ck.ced_decode(*args)
    assert got is not None
    for a, b in zip(got, reference(*args)):
        torch.testing.assert_close(a, b, atol=2e-6, rtol=1e-5)


def test_a_layer_without_shared_entries_reads_its_ring_only():
    qw, _, _, ring, rtab, _, _, counts, K, dc = case(counts=((1, 0), (64, 0), (17, 0)))
    got = ck.ced_decode(qw, None, None, ring, rtab, None, None, counts, K, dc)
    assert got is not None
    want = reference(qw, None, None, ring, rtab, None, None, counts, K, dc)
    torch.testing.assert_close(got[0], want[0], atol=2e-6, rtol=1e-5)
    assert got[2].abs().sum() == 0  # no mass on shared entries


def test_reads_outside_a_rows_tables_are_refused():
    qw, ql, bias, ring, rtab, seg, stab, counts, K, dc = case()
    with pytest.raises(RuntimeError, match="reads 65 ring slots"):
        ck.ced_decode(qw, ql, bias, ring, rtab, seg, stab, counts + torch.tensor([[1, 0]]), K, dc)
    bad = stab.clone()
    bad[4, 0] = seg.shape[0]
    with pytest.raises(RuntimeError, match="segment block"):
        ck.ced_decode(qw, ql, bias, ring, rtab, seg, bad, counts, K, dc)
    with pytest.raises(RuntimeError, match="at least one"):
        ck.ced_decode(qw, ql, bias, ring, rtab, seg, stab, torch.zeros_like(counts), K, dc)
    assert ck.ced_decode(qw.double(), ql, bias, ring, rtab, seg, stab, counts, K, dc) is None  # not float32: declined


CED = get_preset("ced-tiny").replace(num_layers=6, kv_source_layers=(1, 3), qkv_bias=True)  # window 8, rate 2


def run(model, monkeypatch, kernel: bool, prompts, steps: int):
    """Prompts prefilled in one step, then greedy decode steps of every row together: (logits each step, tokens)."""
    monkeypatch.setattr(BatchContext, "ring_kernel", kernel)
    calls = []
    real = ck.ced_decode
    monkeypatch.setattr(ck, "ced_decode", lambda *a: calls.append(1) or real(*a))
    cache = PagedKVCache(model.config, num_blocks=64, block_size=4, max_seqs=len(prompts), max_seq_len=64)
    seqs = [cache.add_sequence() for _ in prompts]
    logits, out = [], []
    with torch.no_grad():
        ids = torch.tensor([t for p in prompts for t in p])
        x = model(ids, ctx=BatchContext(cache, seqs, [len(p) for p in prompts]), last_only=True)[0]
        for _ in range(steps):
            tok = x.argmax(-1)
            out.append(tok)
            logits.append(x)
            x = model(tok, ctx=BatchContext(cache, seqs, [1] * len(seqs)), last_only=True)[0]
    return torch.stack(logits), torch.stack(out), len(calls)


def test_the_engine_decodes_the_same_with_the_kernel_and_with_gathers(monkeypatch):
    """Rows before the window fills, across it and long past it (shared entries on), at different lengths."""
    model = Transformer(CED).eval()
    prompts = [[5], [1, 2, 3, 4, 5, 6, 7], list(range(10, 31)), list(range(40, 45))]
    want, want_tok, none = run(model, monkeypatch, False, prompts, 12)
    got, got_tok, calls = run(model, monkeypatch, True, prompts, 12)
    # every layer of every decode step through the kernel, and of the prefill step (its 1-token prompt is a decode row)
    assert none == 0 and calls == 13 * CED.num_layers
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
    assert torch.equal(got_tok, want_tok)
