"""kvgraft's compiled CPU kernels (kvgraft.model.cpu_kernels): decode and prefill attention equal to torch's
batched matmuls / SDPA over strided views of a pool, rows placed by an index, any mask, never reading a key
outside the range a row's queries see; rope bit-identical to torch's ops, RMSNorm (and a residual add with it)
equal to rounding; the engine gives the same tokens with them and without; bad modes and failed builds are
reported. The tests build the kernels (``require``): a
machine that cannot fails here."""

from __future__ import annotations

import pytest
import torch

import kvgraft.model.cpu_kernels as ck
from kvgraft.errors import ConfigError
from kvgraft.model.attention_ops import grouped_attention_head_major
from kvgraft.reference import resolve_model

AVX512 = torch.backends.cpu.get_cpu_capability() == "AVX512"  # the build's tuned paths; elsewhere the portable ones


@pytest.fixture(autouse=True)
def required(monkeypatch):
    monkeypatch.setenv(ck.ENV, "require")


def pool_views(g, K, n, S, d, dv, spare=5):
    """Keys and values of n slots as strided views of a larger pool (rows at home: (2K, slots, S, d))."""
    pool = torch.randn(2 * K, n + 2, S + spare, max(d, dv), generator=g)
    return pool[:K, 1 : n + 1, :S, :d], pool[K:, 1 : n + 1, :S, :dv]


def reference(q, k, v, mask, index, scale):
    if index is not None:
        k, v = k[:, index], v[:, index]
    return grouped_attention_head_major(q, k.contiguous(), v.contiguous(), mask, scale)


@pytest.mark.parametrize("d,dv", [(32, 32), (64, 64), (128, 128), (64, 32)])
@pytest.mark.parametrize("heads,kv_heads,t", [(9, 3, 1), (8, 8, 1), (8, 1, 3), (4, 2, 16)])
@pytest.mark.parametrize("indexed", [False, True])
def test_kernel_equals_batched_matmuls(d, dv, heads, kv_heads, t, indexed):
    g = torch.Generator().manual_seed(d + heads + t)
    n, S = 7, 41
    k, v = pool_views(g, kv_heads, n, S, d, dv)
    index = torch.tensor([5, 0, 3, 6]) if indexed else None
    G = 4 if indexed else n
    q = torch.randn(G, t, heads, d, generator=g).transpose(1, 2)  # (G, H, t, d) strided, as a layer's queries
    lengths = torch.randint(t, S + 1, (G,), generator=g)
    pos = torch.arange(S)
    # causal over each row's last t positions, and a sliding window of 9 on odd rows: masks need not be prefixes
    last = lengths[:, None, None] - t + torch.arange(t)[None, :, None]  # (G, t, 1) each query's position
    mask = (pos <= last) & ((pos > last - 9) | (torch.arange(G) % 2 == 0)[:, None, None])
    y = ck.decode_attention(q, k, v, mask, index, 0.3)
    assert y is not None
    torch.testing.assert_close(y, reference(q, k, v, mask, index, 0.3), atol=1e-5, rtol=1e-4)


def test_keys_outside_a_rows_visible_range_are_never_read():
    """NaN in every key and value a row's mask does not reach: the kernel's output stays finite and equal
    to the clean reference (torch's matmuls would turn it into NaN), so a row pays only for its own keys."""
    g = torch.Generator().manual_seed(1)
    K, n, S, d = 3, 6, 50, 64
    k, v = pool_views(g, K, n, S, d, d)
    q = torch.randn(n, 9, 1, d, generator=g)
    lo, hi = torch.tensor([0, 3, 10, 0, 20, 49]), torch.tensor([50, 9, 30, 1, 21, 50])
    mask = ((torch.arange(S) >= lo[:, None]) & (torch.arange(S) < hi[:, None]))[:, None]
    want = reference(q, k, v, mask, None, 0.125)
    for r in range(n):
        k[:, r, : lo[r]] = v[:, r, : lo[r]] = float("nan")
        k[:, r, hi[r] :] = v[:, r, hi[r] :] = float("nan")
    y = ck.decode_attention(q, k, v, mask, None, 0.125)
    assert y is not None and torch.isfinite(y).all()
    torch.testing.assert_close(y, want, atol=1e-5, rtol=1e-4)


def test_a_query_that_sees_no_key_gets_zeros():
    g = torch.Generator().manual_seed(2)
    k, v = pool_views(g, 2, 3, 10, 32, 32)
    q = torch.randn(3, 4, 2, 32, generator=g)
    mask = torch.ones(3, 2, 10, dtype=torch.bool)
    mask[1, 0] = False  # row 1's first query sees nothing; its second sees every key
    y = ck.decode_attention(q, k, v, mask, None, 0.2)
    assert y is not None
    assert torch.equal(y[1, :, 0], torch.zeros_like(y[1, :, 0]))
    torch.testing.assert_close(y[1, :, 1], reference(q, k, v, mask, None, 0.2)[1, :, 1])


def test_where_the_kernel_does_not_apply_it_returns_none(monkeypatch):
    g = torch.Generator().manual_seed(3)
    k, v = pool_views(g, 2, 3, 10, 32, 32)
    q, mask = torch.randn(3, 4, 1, 32, generator=g), torch.ones(3, 1, 10, dtype=torch.bool)
    assert ck.decode_attention(q.bfloat16(), k.bfloat16(), v.bfloat16(), mask, None, 0.2) is None
    assert ck.decode_attention(q.requires_grad_(), k, v, mask, None, 0.2) is None  # autograd: torch's ops
    k48, v48 = pool_views(g, 2, 3, 10, 48, 48)  # AVX-512: a width without a tuned path; else the portable path's
    q48 = torch.randn(3, 4, 1, 48)
    if AVX512:
        assert ck.decode_attention(q48, k48, v48, mask, None, 0.2) is None
    else:
        torch.testing.assert_close(ck.decode_attention(q48, k48, v48, mask, None, 0.2), reference(q48, k48, v48, mask, None, 0.2))
    monkeypatch.setenv(ck.ENV, "off")
    assert ck.decode_attention(q.detach(), k, v, mask, None, 0.2) is None


def test_a_bad_mode_is_refused_by_name(monkeypatch):
    monkeypatch.setenv(ck.ENV, "fast")
    with pytest.raises(ConfigError, match=r"KVGRAFT_CPU_KERNELS \('fast'\) must be one of auto, off, require"):
        ck.kernel()


def test_a_failed_build_raises_under_require_and_falls_back_under_auto(monkeypatch, tmp_path, caplog):
    broken = tmp_path / "decode_attention.cpp"
    broken.write_text("this is not C++\n")
    monkeypatch.setattr(ck, "SOURCES", (broken,))
    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(tmp_path / "ext"))
    ck._module.cache_clear()
    try:
        with pytest.raises(RuntimeError, match="KVGRAFT_CPU_KERNELS=require, but the kernels could not be built"):
            ck.kernel()
        monkeypatch.setenv(ck.ENV, "auto")
        assert ck.kernel() is None
        assert "could not be built" in caplog.text
    finally:
        ck._module.cache_clear()


@pytest.mark.parametrize(
    "paged,whole", [(True, True), (True, False), (False, False)], ids=["layer-in-one-call", "rows-in-one-call", "by-group"]
)
def test_the_engine_gives_the_same_tokens_with_the_kernel_and_without(monkeypatch, paged, whole):
    from kvgraft.hf import load_pretrained
    from kvgraft.model.batch import BatchContext
    from kvgraft.runtime.engine import Engine
    from kvgraft.runtime.options import EngineOptions
    from kvgraft.runtime.sampling import SamplingParams

    monkeypatch.setattr(BatchContext, "paged", paged)  # attention over every row at once, or group by group
    monkeypatch.setattr(BatchContext, "whole_layers", whole)  # each layer in one kernel call, or op by op
    model = load_pretrained(resolve_model("kvgraft-llama-8m")).eval().float()  # head width 32: the vector path
    g = torch.Generator().manual_seed(4)
    prompts = [torch.randint(0, model.config.vocab_size, (int(n),), generator=g).tolist() for n in (5, 40, 90, 17, 130, 64)]
    params = SamplingParams(max_new_tokens=12)
    calls = []
    built = ck.kernel()
    assert built is not None

    class Counting:
        def __getattr__(self, name):
            def counted(*args):
                calls.append(name)
                return getattr(built, name)(*args)

            return counted

    monkeypatch.setattr(ck, "kernel", lambda: Counting())
    with_kernel = Engine(model, EngineOptions(max_seqs=4, max_batch_tokens=64, max_seq_len=256)).generate(prompts, params)
    attention = {"paged_attention"} if paged else {"decode_attention", "prefill_attention"}
    kernels = (
        {"gqa_layer", "rms_norm"} if whole else attention | {"add_rms_norm", "rms_norm", "rope_", "silu_mul", "index_copy_rows_"}
    )
    assert kernels <= set(calls), "the engine's steps ran the kernels"
    assert whole == ("gqa_layer" in calls) and (paged or "paged_attention" not in calls)
    monkeypatch.setattr(ck, "kernel", lambda: None)
    without = Engine(model, EngineOptions(max_seqs=4, max_batch_tokens=64, max_seq_len=256)).generate(prompts, params)
    assert with_kernel == without


def test_a_layer_in_one_call_is_bit_identical_to_its_ops(monkeypatch):
    """cpu_kernels.gqa_layer runs a Llama layer's kernels and matmuls in Block.forward's order: a mixed step (prompt
    chunks and decode rows) gives the same logits and writes the same cache, bit for bit."""
    from kvgraft.hf import load_pretrained
    from kvgraft.model.batch import BatchContext
    from kvgraft.model.cache import PagedKVCache
    from kvgraft.model.packed import pack_linears

    model = load_pretrained(resolve_model("kvgraft-llama-8m")).eval().float()
    pack_linears(model)
    calls = []
    layer = ck.gqa_layer
    monkeypatch.setattr(ck, "gqa_layer", lambda *a: calls.append(1) or layer(*a))
    g = torch.Generator().manual_seed(6)
    prompts = [torch.randint(0, model.config.vocab_size, (n,), generator=g) for n in (3, 50, 21, 70)]

    def run(whole: bool) -> tuple[list[torch.Tensor], PagedKVCache]:
        monkeypatch.setattr(BatchContext, "whole_layers", whole)
        cache = PagedKVCache(model.config, num_blocks=40, block_size=16, max_seqs=4, max_seq_len=160)
        seqs = [cache.add_sequence() for _ in prompts]
        out = []
        with torch.inference_mode():
            out.append(model(torch.cat([prompts[0], prompts[1][:30]]), ctx=BatchContext(cache, seqs[:2], [3, 30])))
            chunk = torch.cat([prompts[0][:1], prompts[1][30:], prompts[2], prompts[3]])
            out.append(model(chunk, ctx=BatchContext(cache, seqs, [1, 20, 21, 70])))
            out.append(model(torch.tensor([5, 6, 7, 8]), ctx=BatchContext(cache, seqs, [1, 1, 1, 1])))
        return out, cache

    whole, cache_whole = run(True)
    assert len(calls) == 3 * model.config.num_layers  # every layer of every step ran in one call
    by_op, cache_by_op = run(False)
    assert len(calls) == 3 * model.config.num_layers
    assert all(torch.equal(a, b) for a, b in zip(whole, by_op))
    assert all(torch.equal(cache_whole.paged[x], cache_by_op.paged[x]) for x in cache_whole.paged)


def test_rope_is_bit_identical_to_torchs_ops():
    from kvgraft.model.rope import apply_rope

    g = torch.Generator().manual_seed(5)
    qkv = torch.randn(2, 11, 9 * 64 + 2 * 3 * 64, generator=g)  # q, k, v side by side, as one matmul gives them
    q = qkv[..., : 9 * 64].view(2, 11, 9, 64).transpose(1, 2)  # (B, H, T, d), strided
    cos, sin = torch.randn(2, 11, 64, generator=g), torch.randn(2, 11, 64, generator=g)
    y = ck.rope(q, cos, sin)
    assert y is not None and torch.equal(y, apply_rope(q, cos, sin))
    assert torch.equal(apply_rope(q, cos[:1], sin[:1], fused=True), apply_rope(q, cos[:1], sin[:1]))  # cos shared
    assert ck.rope(q.double(), cos.double(), sin.double()) is None


def test_rope_in_place_rotates_q_and_k_where_the_projection_wrote_them():
    from kvgraft.model.rope import apply_rope, apply_rope_

    g = torch.Generator().manual_seed(6)
    H, K, d = 9, 3, 64
    qkv = torch.randn(2, 11, (H + 2 * K) * d, generator=g)
    before = qkv.clone()
    qk = qkv[..., : (H + K) * d].unflatten(-1, (H + K, d)).transpose(1, 2)  # (B, H + K, T, d), strided
    cos, sin = torch.randn(2, 11, d, generator=g), torch.randn(2, 11, d, generator=g)
    expected = apply_rope(qk.clone(), cos, sin)
    assert ck.rope_(qk, cos, sin)
    assert torch.equal(qk, expected)  # bit for bit, in place
    assert torch.equal(qkv[..., (H + K) * d :], before[..., (H + K) * d :])  # v untouched
    fallback = before.clone()
    view = fallback[..., : (H + K) * d].unflatten(-1, (H + K, d)).transpose(1, 2)
    assert apply_rope_(view, cos, sin, fused=False) is view and torch.equal(view, expected)  # torch's ops, copied in
    assert not ck.rope_(qk.double(), cos.double(), sin.double())  # float32 only: x left as it was


def test_silu_mul_is_torchs_silu_times_up_in_one_pass():
    g = torch.Generator().manual_seed(7)
    gate_up = torch.randn(1, 13, 2 * 40, generator=g) * 6  # f = 40: two vectors and a tail of 8
    gate, up = gate_up[..., :40], gate_up[..., 40:]
    y = ck.silu_mul(gate_up)
    assert y is not None and y.shape == (1, 13, 40) and y.is_contiguous()
    want = torch.nn.functional.silu(gate) * up
    if torch.backends.cpu.get_cpu_capability() == "AVX512":
        assert torch.equal(y, want)  # torch's formula and vector exp: bit for bit
    torch.testing.assert_close(y, want, rtol=1e-6, atol=1e-6)
    rows = torch.randn(13, 3 * 40, generator=g)[:, :80]  # rows at a stride wider than [gate | up]
    torch.testing.assert_close(ck.silu_mul(rows), torch.nn.functional.silu(rows[:, :40]) * rows[:, 40:], rtol=1e-6, atol=1e-6)
    assert ck.silu_mul(gate_up.double()) is None and ck.silu_mul(gate_up[..., :79]) is None  # float32, even width


def test_index_copy_rows_writes_what_torchs_index_copy_writes():
    g = torch.Generator().manual_seed(8)
    pool = torch.randn(6, 40, 64, generator=g)
    entries = torch.randn(5, 9 * 64 + 6 * 64, generator=g)[:, 9 * 64 :]  # a step's k|v columns, rows strided
    src = entries.reshape(5, 6, 64).transpose(0, 1)  # (P, n, d), as the engine passes them
    index = torch.tensor([3, 17, 0, 39, 8])
    want = pool.clone().index_copy_(1, index, src)
    ck.index_copy_rows_(pool, index, src)
    assert torch.equal(pool, want)
    with pytest.raises(RuntimeError, match="out of range"):
        ck.index_copy_rows_(pool, torch.tensor([3, 40, 0, 1, 2]), src)
    double = pool.double()  # where the kernel does not apply: torch's op
    ck.index_copy_rows_(double, index, src.double() * 2)
    assert torch.equal(double[:, index], src.double() * 2)


def test_rms_norm_equals_torchs_ops_to_rounding():
    from kvgraft.model.norm import RMSNorm

    g = torch.Generator().manual_seed(6)
    norm = RMSNorm(576, 1e-5)
    with torch.no_grad():
        norm.weight.copy_(torch.randn(576, generator=g))
    for shape in [(1, 37, 576), (5, 576), (2, 3, 4, 576)]:
        x = torch.randn(*shape, generator=g) * 3
        with torch.no_grad():
            y = norm(x, fused=True)
        assert y.shape == x.shape
        torch.testing.assert_close(y, norm(x).detach(), atol=1e-5, rtol=1e-5)
    assert ck.rms_norm(x.requires_grad_(), norm.weight, 1e-5) is None  # training: torch's ops


@pytest.mark.parametrize("d,dv", [(32, 32), (64, 64), (128, 128), (64, 32)])
@pytest.mark.parametrize("heads,kv_heads", [(9, 3), (8, 8), (8, 1)])
@pytest.mark.parametrize("indexed", [False, True])
def test_prefill_kernel_equals_batched_matmuls(d, dv, heads, kv_heads, indexed):
    """Chunks of 1-70 new tokens a row (query blocks of 16, key blocks of 32: whole, partial and single) over
    strided pool views, causal after each row's cached tokens, a window of 23 on odd rows, rows by index."""
    g = torch.Generator().manual_seed(d + heads + 7)
    n, S = 5, 131
    k, v = pool_views(g, kv_heads, n, S, d, dv)
    index = torch.tensor([4, 0, 2]) if indexed else None
    G, t = (3 if indexed else n), 70
    q = torch.randn(G, t, heads, d, generator=g).transpose(1, 2)  # (G, H, t, d) strided, as a layer's queries
    starts = torch.tensor([0, 61, 3, 40, 0])[:G]  # each row's first new position; its queries are t positions on
    pos = torch.arange(S)
    last = starts[:, None, None] + torch.arange(t)[None, :, None]
    mask = (pos <= last) & ((pos > last - 23) | (torch.arange(G) % 2 == 0)[:, None, None])
    y = ck.prefill_attention(q, k, v, mask, index, 0.3)
    assert y is not None
    torch.testing.assert_close(y, reference(q, k, v, mask, index, 0.3), atol=1e-5, rtol=1e-4)


def test_prefill_kernel_never_reads_past_what_a_block_sees_and_zeros_blind_queries():
    """NaN in keys and values after every row's last visible key (the pool's tail) leaves the output finite;
    a query whose mask row is empty gets zeros."""
    g = torch.Generator().manual_seed(8)
    K, n, S, d = 3, 2, 90, 64
    k, v = pool_views(g, K, n, S, d, d)
    q = torch.randn(n, 9, 40, d, generator=g)
    last = torch.tensor([49, 39])[:, None, None] - 39 + torch.arange(40)[None, :, None]
    mask = torch.arange(S) <= last
    mask[1, 5] = False
    want = torch.nan_to_num(reference(q, k, v, mask, None, 0.125))
    k[:, 0, 50:] = v[:, 0, 50:] = float("nan")
    k[:, 1, 40:] = v[:, 1, 40:] = float("nan")
    y = ck.prefill_attention(q, k, v, mask, None, 0.125)
    assert y is not None and torch.isfinite(y).all()
    assert torch.equal(y[1, :, 5], torch.zeros_like(y[1, :, 5]))
    torch.testing.assert_close(y, want, atol=1e-5, rtol=1e-4)


def test_prefill_kernel_does_not_apply_where_it_cannot():
    g = torch.Generator().manual_seed(9)
    k, v = pool_views(g, 2, 3, 40, 48, 48)  # AVX-512: a width without a tuned path; else the portable path's
    q, mask = torch.randn(3, 4, 20, 48, generator=g), torch.ones(3, 20, 40, dtype=torch.bool)
    if AVX512:
        assert ck.prefill_attention(q, k, v, mask, None, 0.2) is None
    else:
        torch.testing.assert_close(ck.prefill_attention(q, k, v, mask, None, 0.2), reference(q, k, v, mask, None, 0.2))
    k, v = pool_views(g, 2, 3, 40, 64, 64)
    q = torch.randn(3, 4, 20, 64, generator=g)
    assert ck.prefill_attention(q.bfloat16(), k.bfloat16(), v.bfloat16(), mask, None, 0.2) is None
    assert ck.prefill_attention(q.requires_grad_(), k, v, mask, None, 0.2) is None


def test_a_residual_add_with_rms_norm_equals_torchs_ops():
    from kvgraft.model.norm import RMSNorm

    g = torch.Generator().manual_seed(10)
    norm = RMSNorm(576, 1e-5)
    with torch.no_grad():
        norm.weight.copy_(torch.randn(576, generator=g))
        x, a = torch.randn(1, 37, 576, generator=g), torch.randn(1, 37, 576, generator=g)
        s, y = norm.add_forward(x, a, fused=True)
        assert torch.equal(s, x + a)  # the residual sum exactly
        torch.testing.assert_close(y, norm(x + a), atol=1e-5, rtol=1e-5)
    assert ck.add_rms_norm(x, a[:, :5], norm.weight, 1e-5) is None  # shapes that differ: torch's ops


def test_argmax_gives_torchs_indices():
    """The first maximum of each row, a NaN first (as torch's argmax), at lengths that end mid-vector."""
    g = torch.Generator().manual_seed(7)
    for V in (1, 5, 16, 31, 32, 33, 1000, 49152):
        x = torch.randn(9, V, generator=g)
        x[1] = 0.0  # all ties: index 0
        if V > 3:
            x[2, V // 2] = x[2, V - 1] = 1e9  # a tie: the first one
            x[3, V - 1] = float("nan")  # NaN wins
            x[4, 2] = float("inf")
            x[5, 1] = x[5, V - 2] = float("nan")  # the first NaN
        got = ck.argmax(x)
        assert torch.equal(got, x.argmax(dim=-1)), V
    strided = torch.randn(4, 64, generator=g)[:, ::2]  # rows not contiguous: torch's op
    assert torch.equal(ck.argmax(strided), strided.argmax(dim=-1))


def test_a_lock_left_by_an_interrupted_build_is_cleared_and_a_fresh_one_kept(tmp_path, caplog):
    """torch's loader waits forever on its build folder's lock: one older than any build (a killed build's) is
    removed with a warning; a recent one (a build running now in another process) is left alone."""
    lock = tmp_path / "lock"
    assert not ck.clear_stale_lock(tmp_path)  # none
    lock.write_text("")
    now = lock.stat().st_mtime
    assert not ck.clear_stale_lock(tmp_path, now=now + 60) and lock.exists()
    with caplog.at_level("WARNING", logger=ck.__name__):
        assert ck.clear_stale_lock(tmp_path, now=now + ck.STALE_LOCK_S + 1)
    assert not lock.exists() and "interrupted build" in caplog.text
