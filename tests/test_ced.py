"""The causal encoder-decoder: causality, cache == full forward, cache size == formula, checkpointing
gradients, the shared KV really being shared, and config errors."""

from __future__ import annotations

import json

import pytest
import torch

from kvgraft.hf import load_config
from kvgraft.model.config import ModelConfig
from kvgraft.model.presets import get_preset
from kvgraft.model.shapes import num_parameters
from kvgraft.model.transformer import Transformer
from kvgraft.reference import reference_model_dir


def tiny(**changes) -> ModelConfig:
    return get_preset("ced-tiny").replace(**changes)


def build(cfg: ModelConfig, seed: int = 0) -> Transformer:
    torch.manual_seed(seed)
    model = Transformer(cfg)
    model.init_weights(seed)
    # non-zero gate biases and larger weights make every path matter
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "gate_bias" in name:
                p.normal_(0.0, 1.0)
    return model.eval()


VARIANTS = [
    dict(compress_rate=1, sliding_window=8),
    dict(compress_rate=2, sliding_window=8),
    dict(compress_rate=3, sliding_window=5, qkv_bias=True, o_bias=True),
    dict(compress_rate=4, sliding_window=64, mla_latent_norm=True, tie_word_embeddings=True),
    dict(compress_rate=2, sliding_window=3, kv_source_layers=(0,), num_kv_heads=4),
]


@pytest.mark.parametrize("changes", VARIANTS)
def test_causal_no_future_token_changes_earlier_logits(changes):
    model = build(tiny(**changes))
    ids = torch.randint(0, 512, (2, 40), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        base = model(ids)
        for t in (0, 7, 8, 9, 23, 39):
            other = ids.clone()
            other[:, t] = (other[:, t] + 17) % 512
            out = model(other)
            assert torch.equal(out[:, :t], base[:, :t]), f"token {t} leaked into earlier positions"
            assert (out[:, t] - base[:, t]).abs().max() > 1e-4  # and it does reach its own position


def test_shared_path_reads_a_block_once_it_left_the_window():
    # m = 4, W = 4: token 5 is in block 1 (tokens 4..7). Query i reads block 1 through the shared path
    # once 4 <= i - 4, i.e. from i = 8 on; queries 5..8 see it through their windows. With the shared
    # path emptied, only the window remains: exactly queries 5..8 change.
    m, W = 4, 4
    cfg = tiny(compress_rate=m, sliding_window=W, kv_source_layers=(0,), num_layers=1)
    model = build(cfg)
    ids = torch.randint(0, 512, (1, 20), generator=torch.Generator().manual_seed(2))
    other = ids.clone()
    other[:, 5] = (other[:, 5] + 1) % 512
    with torch.no_grad():
        diff = (model(ids) - model(other)).abs().amax(dim=(0, 2))
        assert torch.all(diff[:5] == 0)  # causal
        assert torch.all(diff[5:] > 0)  # windows 5..8, then the shared block
        model.layers[0].self_attn.kv_b_proj.weight.zero_()  # shared keys/values carry no content now
        model.layers[0].self_attn.compressor.kv_a_proj.weight.zero_()
        diff = (model(ids) - model(other)).abs().amax(dim=(0, 2))
    assert torch.all(diff[5:9] > 0) and torch.all(diff[9:] == 0), "the window must cover exactly i-W < j <= i"


def test_visibility_rule():
    from kvgraft.model.batch import DenseContext
    from kvgraft.model.ced import shared_visible

    pos = torch.arange(12)[None]
    window_mask = DenseContext(pos, True).window_mask(0, pos, 4, "ring")[0]
    shared_mask = shared_visible(torch.arange(6)[None] * 2, pos, 4)[0]
    i = torch.arange(12)[:, None]
    j = torch.arange(12)[None, :]
    assert torch.equal(window_mask, (j <= i) & (i - j < 4))
    b = torch.arange(6)[None, :]
    assert torch.equal(shared_mask, 2 * b <= i - 4)
    assert (2 * b + 1 < i).expand(12, 6)[shared_mask].all()  # visible blocks end before the query
    covered = window_mask.clone()
    for blk in range(6):
        covered[:, 2 * blk : 2 * blk + 2] |= shared_mask[:, blk : blk + 1]
    assert torch.equal(covered, (j <= i).expand(12, 12)), "every earlier token is seen, no later one"


@pytest.mark.parametrize("changes", VARIANTS)
def test_incremental_decode_equals_full_forward(changes):
    model = build(tiny(**changes))
    ids = torch.randint(0, 512, (2, 45), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        full = model(ids)
        cache = model.new_cache(2, 48)
        parts = [model(ids[:, :11], cache=cache)]  # prefill
        parts += [model(ids[:, i : i + 1], cache=cache) for i in range(11, 30)]  # one-token steps
        parts.append(model(ids[:, 30:33], cache=cache))  # a short chunk (absorbed path)
        parts.append(model(ids[:, 33:45], cache=cache))
        inc = torch.cat(parts, dim=1)
    assert [cache.length(s) for s in cache.sequences] == [45, 45]
    torch.testing.assert_close(inc, full, atol=2e-5, rtol=0)


def test_absorbed_equals_expanded_decode():
    model = build(tiny(qkv_bias=True))
    ids = torch.randint(0, 512, (1, 30), generator=torch.Generator().manual_seed(4))
    outs = []
    for grad in (False, True):  # with grad enabled a decode step takes the expanded path
        cache = model.new_cache(1, 30)
        with torch.set_grad_enabled(grad):
            model(ids[:, :20], cache=cache)
            outs.append(torch.cat([model(ids[:, i : i + 1], cache=cache) for i in range(20, 30)], 1).detach())
    torch.testing.assert_close(outs[0], outs[1], atol=2e-5, rtol=0)


@pytest.mark.parametrize("m,window,max_len,block", [(1, 8, 40, 8), (2, 8, 42, 6), (4, 64, 32, 8), (3, 5, 102, 6)])
def test_cache_bytes_equal_formula(m, window, max_len, block):
    cfg = tiny(compress_rate=m, sliding_window=window)
    model = Transformer(cfg)
    for dtype, size in ((torch.float32, 4), (torch.bfloat16, 2)):
        cache = model.new_cache(3, max_len, dtype, block_size=block)
        assert cache.nbytes == 3 * cfg.kv_cache_bytes(max_len, size)
    # the formula, spelled out: shared segments + pending block + one window per layer
    D, K = cfg.kv_lora_rank + cfg.qk_rope_head_dim, cfg.num_kv_heads
    dk, dv = cfg.qk_nope_head_dim + cfg.qk_rope_head_dim, cfg.v_head_dim
    expected = len(cfg.kv_source_layers) * ((max_len // m) * D + (2 * (m - 1) * D if m > 1 else 0))
    expected += cfg.num_layers * min(window, max_len) * K * (dk + dv)
    assert cfg.kv_cache_bytes(max_len, 1) == expected


def test_cache_is_much_smaller_than_llama_at_long_context():
    ced, llama = get_preset("ced-8m"), get_preset("llama-8m")
    assert ced.kv_cache_bytes(4096) * 10 < llama.kv_cache_bytes(4096)
    assert ced.kv_cache_bytes(512) * 5 < llama.kv_cache_bytes(512)


@pytest.mark.parametrize("name, preset", [("kvgraft-ced-8m", "ced-8m"), ("kvgraft-ced-8m-deep", "ced-8m-deep")])
def test_the_shipped_encoder_decoders_are_their_presets_as_carded(name, preset):
    """The shipped models' config is the preset they were trained from, and the card's figures are theirs."""
    directory = reference_model_dir(name)
    card = json.loads((directory / "training.json").read_text())
    cfg = load_config(directory)
    assert cfg == get_preset(preset)
    assert num_parameters(cfg) == card["parameters"] and card["steps"] == 1100
    assert card["kv_cache_bytes_bf16"] == {str(n): cfg.kv_cache_bytes(n) for n in (512, 4096)}


def test_cache_overflow_is_a_clear_error():
    model = build(tiny())
    cache = model.new_cache(1, 10)
    with torch.no_grad(), pytest.raises(ValueError, match="cache overflow: 12 tokens > max_seq_len 10"):
        model(torch.zeros(1, 12, dtype=torch.long), cache=cache)


@pytest.mark.parametrize("m", [1, 3])
def test_checkpointing_gradients_equal(m):
    cfg = tiny(compress_rate=m, qkv_bias=True, mla_latent_norm=True)
    ids = torch.randint(0, 512, (2, 33), generator=torch.Generator().manual_seed(5))
    grads = []
    for ckpt in (False, True):
        model = build(cfg).train()
        model.gradient_checkpointing = ckpt
        logits = model(ids)
        torch.nn.functional.cross_entropy(logits[:, :-1].flatten(0, 1), ids[:, 1:].flatten()).backward()
        grads.append({n: p.grad.clone() for n, p in model.named_parameters()})
    assert grads[0].keys() == grads[1].keys()
    for name in grads[0]:
        torch.testing.assert_close(grads[1][name], grads[0][name], atol=1e-6, rtol=1e-5, msg=name)
    # the compressors get gradient from the layers that read their shared entries
    assert grads[0]["layers.1.self_attn.compressor.kv_a_proj.weight"].abs().sum() > 0


def test_reader_layers_have_no_compressor_and_read_the_nearest_source():
    cfg = tiny(num_layers=6, kv_source_layers=(1, 3))
    model = build(cfg)
    kinds = [(hasattr(b.self_attn, "compressor"), getattr(b.self_attn, "kv_b_proj", None) is not None) for b in model.layers]
    assert kinds == [(False, False), (True, True), (False, True), (True, True), (False, True), (False, True)]
    assert [cfg.kv_source_of(i) for i in range(6)] == [None, 1, 1, 3, 3, 3]
    assert cfg.pivot_layer == 3
    # changing the compressor of layer 1 changes layers 1-2 only: layer 3 writes a new segment
    ids = torch.randint(0, 512, (1, 30), generator=torch.Generator().manual_seed(6))
    feats = {}

    def hook(i):
        def fn(module, args, out):
            feats[i] = out[0].detach().clone()

        return fn

    for i, b in enumerate(model.layers):
        b.self_attn.register_forward_hook(hook(i))
    with torch.no_grad():
        model(ids)
        before = dict(feats)
        # perturb only what layer 4 reads through the shared path: layer 3's compressor
        model.layers[3].self_attn.compressor.kv_a_proj.weight.mul_(2.0)
        model(ids)
    assert torch.equal(feats[2], before[2])
    assert not torch.equal(feats[3], before[3]) and not torch.equal(feats[4], before[4])


def test_parameter_count_matches_formula():
    for changes in VARIANTS:
        cfg = tiny(**changes)
        assert num_parameters(cfg) == sum(p.numel() for p in Transformer(cfg).parameters())
    cfg = get_preset("ced-8m")
    assert num_parameters(cfg) == sum(p.numel() for p in Transformer(cfg).parameters())


@pytest.mark.parametrize(
    "changes,message",
    [
        (dict(kv_source_layers=(2, 1)), "strictly increasing"),
        (dict(kv_source_layers=(0, 4)), r"in \[0, 4\)"),
        (dict(kv_source_layers=()), "'ced' in every layer|at least one"),
        (dict(sliding_window=None), "needs sliding_window"),
        (dict(compress_rate=0), "compress_rate"),
        (dict(compress_rate=4, sliding_window=3), "sliding_window \\(3\\) must be >= compress_rate \\(4\\)"),
        (dict(kv_lora_rank=None), "kv_lora_rank"),
        (dict(qk_norm=True), "qk_norm"),
    ],
)
def test_bad_configs_are_named(changes, message):
    with pytest.raises(ValueError, match=message):
        tiny(**changes)


def test_generate_runs_on_the_cache():
    from kvgraft.runtime import generate

    model = build(tiny())
    prompt = torch.randint(0, 512, (2, 9), generator=torch.Generator().manual_seed(7))
    out = generate(model, prompt, max_new_tokens=12)
    # greedy decoding with the cache equals argmax over full forwards
    ids = prompt
    with torch.no_grad():
        for _ in range(12):
            ids = torch.cat([ids, model(ids)[:, -1].argmax(-1, keepdim=True)], dim=1)
    assert torch.equal(out, ids)


# ---- the optional indexer ---------------------------------------------------------------------------


def indexed(topk: int, **changes) -> Transformer:
    return build(tiny(index_topk=topk, index_heads=2, index_head_dim=8, **changes))


def test_indexer_selecting_everything_changes_nothing():
    model = indexed(1000, compress_rate=2)
    ids = torch.randint(0, 512, (2, 40), generator=torch.Generator().manual_seed(8))
    with torch.no_grad():
        with_indexer = model(ids)
        for block in model.layers:
            block.self_attn.topk = None
        dense = model(ids)
    torch.testing.assert_close(with_indexer, dense, atol=1e-5, rtol=0)


@pytest.mark.parametrize("m", [1, 2])
def test_indexer_top_k_is_causal_and_matches_the_cache_path(m):
    model = indexed(2, compress_rate=m)
    ids = torch.randint(0, 512, (2, 44), generator=torch.Generator().manual_seed(9))
    with torch.no_grad():
        full = model(ids)
        for block in model.layers:  # a real selection: fewer entries than visible ones
            block.self_attn.topk = 1000
        dense = model(ids)
        for block in model.layers:
            block.self_attn.topk = 2
        assert (full - dense).abs().max() > 1e-3
        other = ids.clone()
        other[:, 30] = (other[:, 30] + 3) % 512
        assert torch.equal(model(other)[:, :30], full[:, :30])
        cache = model.new_cache(2, 44)
        parts = [model(ids[:, :13], cache=cache)] + [model(ids[:, i : i + 1], cache=cache) for i in range(13, 44)]
    torch.testing.assert_close(torch.cat(parts, 1), full, atol=2e-5, rtol=0)


def test_indexer_is_trained_by_its_own_loss_only():
    model = indexed(2, compress_rate=2).train()
    ids = torch.randint(0, 512, (2, 40), generator=torch.Generator().manual_seed(10))
    logits = model(ids)
    assert model.aux_loss is not None and model.aux_loss.item() >= 0
    index_params = {n for n, _ in model.named_parameters() if ".index_" in n}
    assert index_params, "the indexer has parameters"
    lm = torch.nn.functional.cross_entropy(logits[:, :-1].flatten(0, 1), ids[:, 1:].flatten())
    lm_grads = torch.autograd.grad(lm, list(model.parameters()), allow_unused=True, retain_graph=True)
    aux_grads = torch.autograd.grad(model.aux_loss, list(model.parameters()), allow_unused=True)
    for (name, _), g_lm, g_aux in zip(model.named_parameters(), lm_grads, aux_grads):
        if name in index_params:
            assert g_lm is None or g_lm.abs().max() == 0, f"LM loss reached {name}"
            assert g_aux is not None and g_aux.abs().max() > 0, f"indexer loss did not reach {name}"
        else:
            assert g_aux is None or g_aux.abs().max() == 0, f"indexer loss reached {name}"
    with torch.no_grad():
        model.eval()(ids)
    assert model.aux_loss is None


def test_indexer_cache_and_parameter_formulas():
    cfg = tiny(index_topk=4, index_heads=2, index_head_dim=8, compress_rate=3)
    assert Transformer(cfg).new_cache(2, 48, block_size=6).nbytes == 2 * cfg.kv_cache_bytes(48, 4)
    assert num_parameters(cfg) == sum(p.numel() for p in Transformer(cfg).parameters())
    with pytest.raises(ValueError, match="index_head_dim"):
        tiny(index_topk=4, index_head_dim=0)


def test_indexer_loss_is_added_by_the_training_loop(tmp_path):
    import json

    from kvgraft.train.config import TrainConfig
    from kvgraft.train.loop import train

    class Seqs(torch.utils.data.Dataset):
        def __init__(self):
            self.x = torch.randint(0, 512, (16, 33), generator=torch.Generator().manual_seed(11))

        def __len__(self):
            return len(self.x)

        def __getitem__(self, i):
            return {"input_ids": self.x[i, :-1], "labels": self.x[i, 1:]}

    model = indexed(2)
    cfg = TrainConfig(
        max_steps=4,
        micro_batch_size=4,
        lr=3e-3,
        warmup_steps=1,
        eval_every=0,
        save_every=10,
        log_every=1,
        precision="fp32",
        progress=False,
    )
    before = model.layers[2].self_attn.index_q_proj.weight.clone()
    train(model, Seqs(), cfg, tmp_path)
    rows = [json.loads(line) for line in (tmp_path / "log.jsonl").read_text().splitlines()]
    assert all("aux_loss" in r and r["aux_loss"] >= 0 for r in rows if "loss" in r)
    assert not torch.equal(before, model.layers[2].self_attn.index_q_proj.weight)


@pytest.mark.parametrize("changes", [dict(), dict(index_topk=3, index_heads=2, index_head_dim=8, qkv_bias=True)])
def test_save_and_load_round_trip(tmp_path, changes):
    from kvgraft.hf import load_pretrained, save_pretrained

    model = build(tiny(**changes))
    save_pretrained(model, tmp_path / "m", model_type="kvgraft")
    loaded = load_pretrained(tmp_path / "m")
    assert loaded.config == model.config
    ids = torch.randint(0, 512, (1, 30), generator=torch.Generator().manual_seed(12))
    with torch.no_grad():
        assert torch.equal(loaded(ids), model(ids))
