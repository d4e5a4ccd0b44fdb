"""bench/decode_cost.py's analytic decode-step cost against what one real step does: matmul FLOPs against
torch's FlopCounterMode, weights read against the parameter count, cache read against the cache layout.
No timings are asserted."""

import os
import sys
from pathlib import Path
from unittest import mock

import pytest
import torch
from torch.utils.flop_counter import FlopCounterMode

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "bench"))

from decode_cost import build, configs, mla_folds, mla_of, prefilled_cache, step_cost  # noqa: E402

from kvgraft.model import ModelConfig, cpu_kernels  # noqa: E402
from kvgraft.model.config import cache_layout  # noqa: E402
from kvgraft.model.presets import get_preset  # noqa: E402

# a tiny 1B-like shape: 4:1 GQA, MLA ranks that fold nothing (as at the real 1B shape)
SMALL = ModelConfig(
    vocab_size=256,
    hidden_size=64,
    num_layers=4,
    num_heads=8,
    num_kv_heads=2,
    head_dim=16,
    intermediate_size=96,
    max_position_embeddings=256,
    rms_norm_eps=1e-5,
    tie_word_embeddings=True,
)


def _small(kind: str) -> ModelConfig:
    if kind == "gqa":
        return SMALL
    mla = SMALL.replace(attention_kinds=("mla",) * 4, kv_lora_rank=24, qk_rope_head_dim=8, qk_nope_head_dim=16, v_head_dim=16)
    if kind == "mla":
        return mla
    if kind == "mla-bias":
        return mla.replace(qkv_bias=True, o_bias=True)
    if kind == "ced":
        return SMALL.replace(
            kv_source_layers=(1, 2),
            sliding_window=8,
            compress_rate=2,
            kv_lora_rank=24,
            qk_rope_head_dim=8,
            qk_nope_head_dim=16,
            v_head_dim=16,
            mla_latent_norm=True,
        )
    if kind == "ced-m1":
        return SMALL.replace(
            kv_source_layers=(2,),
            sliding_window=4,
            compress_rate=1,
            kv_lora_rank=24,
            qk_rope_head_dim=8,
            qk_nope_head_dim=16,
            v_head_dim=16,
        )
    return {
        "llama-tiny-mla": lambda: mla_of(get_preset("llama-tiny")),
        "ced-tiny": lambda: get_preset("ced-tiny"),
        "8m-mla": lambda: configs("8m")["mla"],
    }[kind]()


def _counted(cfg: ModelConfig, context: int, batch: int):
    """(counted matmul FLOPs of one decode step at ``context``, the model, the cache's max_len)."""
    torch.manual_seed(0)
    model = build(cfg)
    max_len = context + 2
    cache = prefilled_cache(model, batch, context - 1, max_len)
    ids = torch.zeros(batch, 1, dtype=torch.long)
    # torch's ops only: a compiled kernel's work is invisible to the counter
    with torch.inference_mode(), mock.patch.dict(os.environ, {cpu_kernels.ENV: "off"}):
        model(ids, cache=cache)  # one step first: MLA builds (and caches) its folded weights on the first
        with FlopCounterMode(display=False) as counter:
            model(ids, cache=cache)
    return counter.get_total_flops(), model, max_len


@pytest.mark.parametrize("kind", ["gqa", "mla", "mla-bias", "ced", "ced-m1", "llama-tiny-mla", "ced-tiny", "8m-mla"])
@pytest.mark.parametrize("context,batch", [(5, 1), (37, 3)])
def test_flops_match_flop_counter(kind, context, batch):
    cfg = _small(kind)
    counted, _, max_len = _counted(cfg, context, batch)
    assert step_cost(cfg, context, batch, 4, max_len).flops == counted


@pytest.mark.parametrize("kind", ["gqa", "mla", "mla-bias", "ced", "ced-m1"])
def test_weights_read_are_the_parameters(kind):
    """Without folds, a decode step applies every parameter once (tied embedding = the lm_head)."""
    cfg = _small(kind)
    if "mla" in cfg.attention_kinds:
        assert mla_folds(cfg) == (False, False)
    model = build(cfg)
    assert model.lm_head.weight is model.embed_tokens.weight
    assert step_cost(cfg, 50, 2).weight_params == sum(p.numel() for p in model.parameters())


@pytest.mark.parametrize("kind", ["gqa", "mla", "ced", "ced-m1"])
def test_cache_read_matches_layout(kind):
    cfg = _small(kind)
    S, B, max_len = 40, 3, 60
    cost = step_cost(cfg, S, B, 4, max_len)
    lay = cache_layout(cfg)
    if not cfg.is_ced:  # every paged layer reads its whole cache, the new token included
        assert cost.cache_read == B * lay.values(S + 1)
    else:  # every layer reads its full ring; each reader reads its source's visible segment
        R = min(cfg.sliding_window, max_len)
        readers = [layer for layer in range(cfg.num_layers) if cfg.kv_source_of(layer) is not None]
        seg = sum(lay.segments[cfg.kv_source_of(layer)] for layer in readers) * ((S + 1) // cfg.compress_rate)
        assert cost.cache_read == B * (sum(lay.rings.values()) * R + seg)
    assert cost.cache_stored == cfg.kv_cache_bytes(S, 1)


def test_1b_shape_trade():
    """At the 1B shape MLA reads 4x less cache but spends more FLOPs per cached token than GQA."""
    c = configs("1b")
    g, m = step_cost(c["gqa"], 8192, 16, 2), step_cost(c["mla"], 8192, 16, 2)
    assert g.cache_read == 4 * m.cache_read
    # per key and head: GQA 2 (d + d) = 256 FLOPs; absorbed MLA 2 ((d_c + d_rope) + d_c) = 960 at the rule's 224 + 32
    mla = c["mla"]
    assert (mla.kv_lora_rank, mla.qk_rope_head_dim) == (224, 32)
    assert m.attn_flops * 256 == g.attn_flops * 960
