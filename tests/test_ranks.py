"""kvgraft.graft.ranks: the one rule for default MLA ranks (convert and doctor), and its table in docs/ranks.md."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from kvgraft.graft.ranks import default_ranks
from kvgraft.model.config import ModelConfig, RopeConfig

DOC = Path(__file__).resolve().parents[1] / "docs" / "ranks.md"


def _cfg(kv_heads: int, head_dim: int, layers: int = 2, heads: int = 8, **kw) -> ModelConfig:
    return ModelConfig(
        vocab_size=64,
        hidden_size=64,
        num_layers=layers,
        num_heads=heads,
        num_kv_heads=kv_heads,
        head_dim=head_dim,
        intermediate_size=64,
        **kw,
    )


@pytest.mark.parametrize("kv_heads", [1, 2, 4, 8])
@pytest.mark.parametrize("head_dim", [8, 16, 32, 64, 80, 128, 256])
@pytest.mark.parametrize("compression", [2, 3.5, 4, 8])
@pytest.mark.parametrize("stock", [False, True])
def test_the_rule_fits_every_shape(kv_heads, head_dim, compression, stock):
    cfg = _cfg(kv_heads, head_dim)
    budget = int(cfg.kv_width / compression)
    if budget < 3:
        with pytest.raises(ValueError, match="cached values per layer"):
            default_ranks(cfg, compression=compression, stock=stock)
        return
    r = default_ranks(cfg, compression=compression, stock=stock)
    assert r.kv_lora_rank + r.qk_rope_head_dim == r.budget == budget
    assert r.qk_rope_head_dim >= 2 and r.qk_rope_head_dim % 2 == 0 and r.qk_rope_head_dim <= min(64, head_dim)
    assert r.kv_lora_rank >= r.qk_rope_head_dim or r.qk_rope_head_dim == 2  # d_c gets at least half
    if stock:  # the default stock layout ("prefix"): any even width <= 3/4 head_dim (one pair at least)
        assert r.qk_rope_head_dim <= max(2, 3 * head_dim // 4)
        s = default_ranks(cfg, compression=compression, stock=True, stock_layout="stride")
        assert head_dim % s.qk_rope_head_dim == 0 and s.kv_lora_rank + s.qk_rope_head_dim == budget
    # at most half the head, but the cap never below 32 (32 + 32 on head_dim 32; 64 + 32 on head_dim 64 at 96)
    assert r.qk_rope_head_dim <= max(2, max(32, head_dim // 2))
    if budget >= 128 and head_dim >= 128:
        assert r.qk_rope_head_dim == 64  # DeepSeek's d_rope once the budget and the head allow it
    if budget >= 64 and head_dim == 64:
        assert r.qk_rope_head_dim == 32  # SmolLM2's shape: half the head, the latent is the scarce part
    if budget >= 64 and head_dim == 32 and not stock:
        assert r.qk_rope_head_dim == 32  # the reference model's shape: the even split measured best there


def test_deepseek_budget_gives_deepseek_ranks():
    cfg = _cfg(kv_heads=4, head_dim=128)  # KV width 1024
    r = default_ranks(cfg, compression=1024 / 576)
    assert (r.kv_lora_rank, r.qk_rope_head_dim) == (512, 64)


def test_explicit_values_are_kept_or_complete_the_budget():
    cfg = _cfg(kv_heads=2, head_dim=16)  # KV width 64
    r = default_ranks(cfg, kv_lora_rank=24, qk_rope_head_dim=6)
    assert (r.kv_lora_rank, r.qk_rope_head_dim, r.how) == (24, 6, ())
    r = default_ranks(cfg, kv_lora_rank=24)
    assert (r.kv_lora_rank, r.qk_rope_head_dim, r.budget) == (24, 16, None)
    r = default_ranks(cfg, qk_rope_head_dim=4)  # 4x: budget 16
    assert (r.kv_lora_rank, r.qk_rope_head_dim) == (12, 4)
    r = default_ranks(cfg, kv_lora_rank=3)
    assert r.qk_rope_head_dim == 2  # <= d_c, at least one pair


@pytest.mark.parametrize(
    "kwargs, message",
    [
        (dict(compression=0), "compression (0)"),
        (dict(compression=1), "compression (1)"),
        (dict(compression=float("nan")), "compression (nan)"),
        (dict(compression=-4), "compression (-4)"),
        (dict(kv_lora_rank=0), "kv_lora_rank (0)"),
        (dict(qk_rope_head_dim=0), "qk_rope_head_dim (0)"),
        (dict(compression=4, kv_lora_rank=8), "not both"),
        (dict(qk_rope_head_dim=16), "not enough for qk_rope_head_dim (16)"),
        (dict(compression=32), "leaves 2 cached values"),
    ],
)
def test_bad_values_are_named(kwargs, message):
    with pytest.raises(ValueError, match=re.escape(message)):
        default_ranks(_cfg(kv_heads=2, head_dim=16), **kwargs)


def test_stock_dynamic_rope_needs_the_whole_head():
    cfg = _cfg(kv_heads=2, head_dim=16, rope=RopeConfig(rope_type="dynamic", factor=2.0))
    assert default_ranks(cfg, compression=2).qk_rope_head_dim == 16  # budget 32: 16 + 16
    assert default_ranks(cfg, compression=2, stock=False).qk_rope_head_dim == 16
    assert default_ranks(cfg, compression=4, stock=False).qk_rope_head_dim == 8
    with pytest.raises(ValueError, match="--format kvgraft"):
        default_ranks(cfg, compression=4, stock=True)  # budget 16 cannot hold d_rope 16 plus a latent
    assert default_ranks(cfg, compression=1.5, stock=True).qk_rope_head_dim == 16


def test_docs_table_matches_the_rule():
    rows = [
        line
        for line in DOC.read_text().splitlines()
        if line.startswith("| ") and " x " in line and not line.startswith("| model")
    ]
    assert len(rows) >= 8
    for row in rows:
        cells = [c.strip() for c in row.strip("|").split("|")]
        layers, (kv, hd) = int(cells[1]), map(int, cells[2].split(" x "))
        cfg = ModelConfig(
            vocab_size=64, hidden_size=64, num_layers=layers, num_heads=kv, num_kv_heads=kv, head_dim=hd, intermediate_size=64
        )
        assert int(cells[3]) == cfg.kv_width, row
        for cell, compression in ((cells[4], 4), (cells[6], 8), (cells[7], 2)):
            r = default_ranks(cfg, compression=compression)
            assert cell == f"{r.kv_lora_rank} + {r.qk_rope_head_dim}", (row, compression)
        for cell, compression in ((cells[8], 4), (cells[9], 8)):  # the stock export's (prefix layout)
            s = default_ranks(cfg, compression=compression, stock=True)
            assert cell == f"{s.kv_lora_rank} + {s.qk_rope_head_dim}", (row, compression)
