"""The frozen-prefix cache (kvgraft.train.frozen_prefix): a step through the cache gives the same loss and
gradients as the plain forward, bit for bit, on tiny random models of every attention kind and on the
shipped encoder-decoder; it is keyed to the base and the example, bounded in bytes, refused where the
prefix is not frozen."""

from __future__ import annotations

import json

import pytest
import torch
from factories import sharp_model

from kvgraft.adapters.lora import AdapterConfig, add_adapter, randomize_adapter
from kvgraft.adapters.placement import Placement
from kvgraft.model.presets import get_preset
from kvgraft.train.config import TrainConfig
from kvgraft.train.frozen_prefix import CachedLMLoss, FrozenPrefixCache, boundary, cache_obstacle, read_keys
from kvgraft.train.loop import TrainOptions, lm_loss, train

CED = get_preset("ced-tiny").replace(num_layers=8, kv_source_layers=(1, 3, 4), qkv_bias=True)  # the reference's layout
LLAMA_SHARED = get_preset("llama-tiny").replace(num_layers=4, kv_slots=(0, 1, 1, 2))  # layer 2 reads layer 1's KV
MLA = get_preset("llama-tiny").replace(
    num_layers=4, attention_kinds=("mla",) * 4, kv_lora_rank=6, qk_rope_head_dim=8, qk_nope_head_dim=8, v_head_dim=16
)
DECODER = Placement("decoder-half", ("all-linear",), freeze_kv_writers=True)


def adapted(cfg, placement, seed=0):
    model = sharp_model(cfg, seed).train()
    torch.manual_seed(seed)
    pm = add_adapter(model, placement, AdapterConfig(rank=4))
    randomize_adapter(pm, seed=seed)  # non-zero B: the adapter changes the outputs
    pm.train()
    return pm


def batch(cfg, n=4, t=24, seed=1):
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, cfg.vocab_size, (n, t + 1), generator=g)
    labels = ids[:, 1:].clone()
    labels[:, : t // 3] = -100  # a masked prompt, as the tasks have
    return {"input_ids": ids[:, :-1], "labels": labels}


def loss_and_grads(pm, loss_fn, b):
    pm.zero_grad(set_to_none=True)
    loss, _ = loss_fn(pm, b)
    loss.backward()
    grads = {n: p.grad.clone() for n, p in pm.named_parameters() if p.requires_grad}
    pm.zero_grad(set_to_none=True)
    return loss.detach(), grads


@pytest.mark.parametrize(
    "cfg,placement,k",
    [
        (CED, DECODER, 4),  # the pivot: its segment recomputed from the cached hidden state
        (CED, Placement("from:5", ("all-linear",)), 5),  # layers 5.. read the pivot's segment from the cache
        (CED, Placement("from:2", ("all-linear",), freeze_kv_writers=True), 2),  # reads segment 1 from the cache
        (LLAMA_SHARED, Placement("from:2", ("all-linear",)), 2),  # a GQA layer reading a cached KV slot
        (MLA, Placement("decoder-half", ("all-linear",)), 2),
    ],
    ids=["ced-decoder-half", "ced-from5", "ced-from2", "llama-shared-slot", "mla"],
)
@pytest.mark.parametrize("checkpointing", [False, True], ids=["plain", "checkpointed"])
def test_a_cached_step_equals_the_plain_forward_bit_for_bit(cfg, placement, k, checkpointing):
    pm = adapted(cfg, placement)
    pm.get_base_model().model.gradient_checkpointing = checkpointing
    assert boundary(pm) == k and cache_obstacle(pm) is None
    cache = FrozenPrefixCache(1 << 24)
    cached = CachedLMLoss(pm, cache)
    b1, b2 = batch(cfg, seed=1), batch(cfg, seed=2)
    for b in (b1, b2, b1, b2):  # first a miss per row, then hits (entries from the cache alone)
        ref, ref_grads = loss_and_grads(pm, lm_loss, b)
        got, got_grads = loss_and_grads(pm, cached, b)
        assert torch.equal(ref, got)
        assert ref_grads.keys() == got_grads.keys()
        for n in ref_grads:
            assert torch.equal(ref_grads[n], got_grads[n]), n
    assert cache.stats.misses == 8 and cache.stats.hits == 8 and cache.stats.entries == 8
    # a batch mixing cached and new rows: the prefix reruns over the whole batch, equal again
    mixed = {key: torch.cat([b1[key][:2], batch(cfg, seed=3)[key][:2]]) for key in b1}
    assert torch.equal(loss_and_grads(pm, lm_loss, mixed)[0], loss_and_grads(pm, cached, mixed)[0])
    assert cache.stats.entries == 10


def test_what_the_cache_holds_per_example():
    """The hidden state entering the boundary, plus exactly the shared KV the trainable layers read and do
    not write; nothing that aliases a batch."""
    assert read_keys(CED, 4) == [] and read_keys(CED, 5) == [("seg", 4)] and read_keys(CED, 2) == [("seg", 1)]
    assert read_keys(CED, 3) == []  # layer 3 is a kv_source layer: layers 3.. read segments 3 and 4, written there
    assert read_keys(LLAMA_SHARED, 2) == [("kv", 1)] and read_keys(LLAMA_SHARED, 3) == []
    pm = adapted(CED, Placement("from:5", ("all-linear",)))
    cache = FrozenPrefixCache(1 << 24)
    loss = CachedLMLoss(pm, cache)
    b = batch(CED, n=3, t=24)
    loss(pm, b)
    (entry, size), *_ = cache._entries.values()
    assert set(entry) == {("x", 5), ("seg", 4)}
    assert entry[("x", 5)].shape == (24, CED.hidden_size)
    assert entry[("seg", 4)].shape[0] == 24 // CED.compress_rate
    assert all(t.untyped_storage().nbytes() == t.numel() * t.element_size() for t in entry.values())  # own storage
    assert size == sum(t.numel() * t.element_size() for t in entry.values()) and cache.stats.bytes == 3 * size


def test_the_key_names_the_base_weights_and_the_example():
    pm = adapted(CED, DECODER)
    a = CachedLMLoss(pm, FrozenPrefixCache(1 << 20))
    ids = batch(CED)["input_ids"]
    assert a.key(ids[0]) == a.key(ids[0].clone()) and a.key(ids[0]) != a.key(ids[1])
    other = adapted(CED, DECODER, seed=5)  # another base (other weights), same architecture
    assert CachedLMLoss(other, FrozenPrefixCache(1 << 20)).key(ids[0]) != a.key(ids[0])
    assert CachedLMLoss(pm, FrozenPrefixCache(1 << 20), precision="bf16").key(ids[0]) != a.key(ids[0])
    from5 = adapted(CED, Placement("from:5", ("all-linear",)))  # same base, another boundary
    assert CachedLMLoss(from5, FrozenPrefixCache(1 << 20)).key(ids[0]) != a.key(ids[0])


def test_the_byte_bound_evicts_least_recently_used_and_still_gives_the_same_loss():
    pm = adapted(CED, DECODER)
    b = batch(CED, n=4)
    per_entry = 24 * CED.hidden_size * 4  # one example's hidden state entering the pivot, fp32
    cache = FrozenPrefixCache(3 * per_entry)  # room for 3 of the batch's 4 rows
    cached = CachedLMLoss(pm, cache)
    for _ in range(3):
        assert torch.equal(loss_and_grads(pm, cached, b)[0], loss_and_grads(pm, lm_loss, b)[0])
        assert cache.stats.bytes <= cache.max_bytes and cache.stats.entries == 3
    assert cache.stats.peak_bytes == 3 * per_entry and cache.stats.evictions >= 1
    tiny = FrozenPrefixCache(per_entry - 1)  # no entry fits: nothing stored, the loss is still right
    assert torch.equal(CachedLMLoss(pm, tiny)(pm, b)[0], lm_loss(pm, b)[0]) and tiny.stats.entries == 0
    with pytest.raises(ValueError, match=r"max_bytes \(0\) must be a positive integer"):
        FrozenPrefixCache(0)
    with pytest.raises(ValueError, match="precision 'fp16'"):
        CachedLMLoss(pm, cache, precision="fp16")


def test_a_placement_with_a_trainable_first_layer_is_refused_with_why():
    pm = adapted(CED, Placement("all", ("all-linear",)))
    assert boundary(pm) == 0
    assert "layer 0 has trainable parameters" in cache_obstacle(pm)
    with pytest.raises(ValueError, match="frozen-prefix cache does not apply: layer 0 has trainable parameters"):
        CachedLMLoss(pm, FrozenPrefixCache(1 << 20))
    dropout = sharp_model(CED).train()
    add = add_adapter(dropout, Placement("all", ("all-linear",)), AdapterConfig(rank=4, dropout=0.1))
    for n, p in add.named_parameters():  # freeze layers 0-3's adapters: their dropout still draws
        if any(f"layers.{i}." in n for i in range(4)):
            p.requires_grad_(False)
    assert boundary(add) == 4 and "dropout with p=0.1" in cache_obstacle(add)


def test_training_with_the_cache_logs_the_same_losses(tmp_path):
    """The training loop over several epochs (8 examples, batches of 4, 6 steps), with and without the
    cache: the same logged losses, validation losses and adapter weights."""
    data = [{k: v[0] for k, v in batch(CED, n=1, seed=s).items()} for s in range(8)]
    cfg = TrainConfig(
        max_steps=6,
        micro_batch_size=4,
        lr=1e-2,
        warmup_steps=1,
        eval_every=3,
        eval_batches=1,
        log_every=1,
        progress=False,
        precision="fp32",
    )
    runs = []
    for name in ("plain", "cached"):
        pm = adapted(CED, DECODER)
        fn = lm_loss if name == "plain" else CachedLMLoss(pm, FrozenPrefixCache(1 << 24))
        r = train(
            pm, data, cfg, tmp_path / name, val_data=data[:4], options=TrainOptions(loss_fn=fn, checkpoint_trainable_only=True)
        )
        runs.append((r, {n: p.detach().clone() for n, p in pm.named_parameters() if p.requires_grad}, fn))
    (plain, wp, _), (cached, wc, fn) = runs
    losses = [[(h["step"], h.get("loss"), h.get("val_loss")) for h in r.history] for r in (plain, cached)]
    assert losses[0] == losses[1] and len(losses[0]) >= 6
    assert all(torch.equal(wp[n], wc[n]) for n in wp)
    stats = fn.summary()
    assert stats["boundary"] == 4 and stats["entries"] == 8 and stats["misses"] == 8  # each example run once
    assert stats["hits"] == (6 * 4 - 8) + 2 * 4  # training rows after the first epoch, and both evaluations
    json.dumps(stats)
