"""The one rule for the MLA graft's default ranks, used by ``kvgraft convert`` and ``kvgraft doctor``.

Each converted layer caches ``d_c + d_rope`` values per token: the latent (``kv_lora_rank``, d_c) and
the shared RoPE key (``qk_rope_head_dim``, d_rope). Given the budget -- a compression factor (default 4:
``budget = floor(KV width / compression)``, KV width = 2 x num_kv_heads x head_dim) or an explicit d_c --
the rule picks what was not given:

- **d_rope** = the largest allowed value <= min(64, head_dim, budget / 2, max(32, head_dim / 2)) (with an
  explicit d_c: <= min(64, head_dim, d_c, max(32, head_dim / 2))); allowed = even (RoPE rotates pairs), and for a stock DeepSeek-V3 export
  one whose frequencies stock DeepSeek-V3 reproduces in the export's layout (dynamic NTK and some yarn
  settings need d_rope = head_dim; the "stride" layout also needs d_rope to divide head_dim). For the stock
  export's default "prefix" layout (the d_rope/2 fastest frequencies, ``STOCK_ROPE_SELECTION``) the cap is
  also 3/4 of head_dim: on the reference model (head_dim 32, 4x) the prefix layout at d_rope 24 + d_c 39
  measured better in and out of domain than 32 + 31 (bench/RESULTS.md), since one shared key that rotates
  each frequency once spends its last pairs on the slowest frequencies, which barely turn within the
  context (their expected rotation stands in for them) while d_c is scarce.
  At least one frequency pair (d_rope >= 2) always.
- **d_c** = budget - d_rope.

So d_c always gets at least half of the budget, and all of it beyond 128 values: at DeepSeek's own
budget (576) the rule gives DeepSeek's 512 + 64, the shape FlashMLA's kernels are built for. The
half-head cap with its floor of 32 fits the two models measured (bench/RESULTS.md: the even split on the
reference model, head_dim 32; 64 + 32 rather than 48 + 48 on SmolLM2-135M, head_dim 64, whose latent is the
scarce part). ``docs/ranks.md`` tabulates what the rule picks for common checkpoints.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import NoReturn, cast

from kvgraft.checks import check_int, is_number
from kvgraft.errors import ConfigError, UnsupportedModelError
from kvgraft.hf.deepseek import stock_rope_parameters
from kvgraft.model.config import ModelConfig
from kvgraft.model.fields import known

DEFAULT_COMPRESSION = 4.0  # --to mla
DEFAULT_CED_COMPRESSION = 2.0  # --to ced: several layers read each shared latent
ROPE_CAP = 64  # DeepSeek-V2/V3's d_rope (next to d_c = 512), FlashMLA's shape
# d_rope takes at most half of head_dim, but this cap never goes below 32 (measured, see above)
HALF_HEAD_FLOOR = 32
# The RoPE layout of kvgraft convert --format deepseek_v3/both by default ("stride" or "prefix"), and the
# share of head_dim its d_rope may take ("prefix" only; measured on the reference model, see above)
STOCK_ROPE_SELECTION = "prefix"
STOCK_PREFIX_ROPE_SHARE = 0.75
STOCK_LAYOUTS = ("stride", "prefix")


@dataclass(frozen=True)
class Ranks:
    """The chosen ranks. ``budget``: d_c + d_rope when a compression set it (None for explicit ranks);
    ``how``: one line per value the rule chose (empty when both were given)."""

    kv_lora_rank: int
    qk_rope_head_dim: int
    budget: int | None
    how: tuple[str, ...] = ()


def _positive_int(name: str, value: object) -> int:
    check_int(name, value, low=1)
    return cast(int, value)  # an int: checked above


def check_compression(compression: object) -> float:
    """``compression`` as a float > 1, or ValueError naming the value (0, negative, NaN, inf, not a number)."""
    if not is_number(compression):
        raise ConfigError(f"compression ({compression!r}) must be a number > 1 (original bytes / converted bytes)")
    if not math.isfinite(compression) or compression <= 1:
        raise ConfigError(f"compression ({compression}) must be a finite number > 1 (original bytes / converted bytes per token)")
    return float(compression)


def stock_rope_problem(config: ModelConfig, d_rope: int, layout: str = STOCK_ROPE_SELECTION) -> str | None:
    """Why a stock DeepSeek-V3 export in ``layout`` ("stride" or "prefix") cannot carry ``config``'s RoPE at this
    d_rope (None: it can)."""
    if layout not in STOCK_LAYOUTS:
        raise ConfigError(f"stock layout {layout!r} is not one of {', '.join(STOCK_LAYOUTS)}")
    hd = known(config.head_dim, "head_dim")
    if layout == "stride" and (d_rope > hd or hd % d_rope or d_rope % 2):
        return (
            f"the stock DeepSeek-V3 layout (rope selection 'stride') needs an even d_rope dividing head_dim ({hd}), got {d_rope}"
        )
    if layout == "prefix" and (d_rope > hd or d_rope % 2):
        return f"the stock DeepSeek-V3 layout (rope selection 'prefix') needs an even d_rope <= head_dim ({hd}), got {d_rope}"
    if config.rope.rope_type in ("default", "linear") or (layout == "stride" and config.rope.rope_type == "llama3"):
        return None  # functions of each base frequency alone, which both layouts reproduce exactly

    try:
        stock_rope_parameters(config.replace(qk_rope_head_dim=d_rope), layout=layout)
    except UnsupportedModelError as exc:
        return str(exc)
    return None


def _half_head(head_dim: int) -> int:
    """The cap on d_rope from the head's width: half of it, but not below ``HALF_HEAD_FLOOR``."""
    return max(HALF_HEAD_FLOOR, head_dim // 2)


def _allowed(config: ModelConfig, stock: bool, layout: str = STOCK_ROPE_SELECTION) -> list[int]:
    """d_rope values the rule may pick, ascending."""
    hd = known(config.head_dim, "head_dim")
    values = [v for v in range(2, hd + 1, 2) if not stock or layout == "prefix" or hd % v == 0]
    if stock:
        values = [v for v in values if stock_rope_problem(config, v, layout) is None]
    return values


def default_ranks(
    config: ModelConfig,
    *,
    compression: float | None = None,
    kv_lora_rank: int | None = None,
    qk_rope_head_dim: int | None = None,
    stock: bool = False,
    default_compression: float = DEFAULT_COMPRESSION,
    stock_layout: str = STOCK_ROPE_SELECTION,
) -> Ranks:
    """(d_c, d_rope) for grafting ``config`` by the rule above; explicit values are kept as given.

    ``compression`` and ``kv_lora_rank`` are two ways to set the budget: give at most one (neither:
    ``default_compression``). ``stock``: the result must export to stock DeepSeek-V3 in ``stock_layout`` (the
    rope selection, "prefix" or "stride"). Raises ValueError
    naming the value for a non-positive rank, a compression that is not a finite number > 1, both budgets,
    or a budget too small for one RoPE pair plus a latent. Structural limits (d_rope even and within the
    model's RoPE width, d_c within its KV width) are ``GraftConfig``'s to check.
    """
    if kv_lora_rank is not None:
        _positive_int("kv_lora_rank", kv_lora_rank)
        if compression is not None:
            raise ConfigError(
                f"give the budget once: compression ({compression}) or kv_lora_rank ({kv_lora_rank}), "
                "not both (--compression sets d_c from the KV width)"
            )
    if qk_rope_head_dim is not None:
        _positive_int("qk_rope_head_dim", qk_rope_head_dim)
    if kv_lora_rank is not None and qk_rope_head_dim is not None:
        return Ranks(kv_lora_rank, qk_rope_head_dim, None)
    hd, width = known(config.head_dim, "head_dim"), config.kv_width
    how: list[str] = []
    budget = None
    if kv_lora_rank is None:
        compression = check_compression(default_compression if compression is None else compression)
        budget = int(width / compression)
        if qk_rope_head_dim is not None:
            d_c = budget - qk_rope_head_dim
            if d_c <= 0:
                raise ConfigError(
                    f"compression {compression:g}x leaves {budget} cached values per layer (KV width {width} / "
                    f"{compression:g}), not enough for qk_rope_head_dim ({qk_rope_head_dim}) plus a latent; "
                    "lower the compression or the RoPE width"
                )
            how.append(
                f"d_c = budget - d_rope = {budget} - {qk_rope_head_dim} = {d_c} (budget: KV width {width} / {compression:g}x)"
            )
            return Ranks(d_c, qk_rope_head_dim, budget, tuple(how))
        if budget < 3:
            raise ConfigError(
                f"compression {compression:g}x leaves {budget} cached values per layer (KV width {width} / "
                f"{compression:g}): MLA needs at least 3 (one RoPE pair plus a latent); lower the compression"
            )
        cap = min(ROPE_CAP, hd, budget // 2, _half_head(hd))
        what = f"min(64, head_dim {hd}, budget/2 = {budget // 2}, max(32, head_dim/2) = {_half_head(hd)})"
        if stock and stock_layout == "prefix":
            share = int(STOCK_PREFIX_ROPE_SHARE * hd)
            cap = min(cap, share)
            what = f"min(64, 3/4 head_dim = {share}, budget/2 = {budget // 2}) (stock, prefix layout)"
    else:
        cap = min(ROPE_CAP, hd, kv_lora_rank, _half_head(hd))
        what = f"min(64, head_dim {hd}, d_c {kv_lora_rank}, max(32, head_dim/2) = {_half_head(hd)})"
    if stock_layout not in STOCK_LAYOUTS:
        raise ConfigError(f"stock layout {stock_layout!r} is not one of {', '.join(STOCK_LAYOUTS)}")
    allowed = _allowed(config, stock, stock_layout)
    kind = (
        "even divisor of head_dim that stock DeepSeek-V3 can rotate"
        if stock and stock_layout == "stride"
        else "even value that stock DeepSeek-V3 can rotate"
        if stock
        else "even value"
    )
    fitting = [v for v in allowed if v <= cap]
    limit = budget - 1 if budget is not None else None  # leave at least one latent value
    if fitting:
        d_rope = fitting[-1]
    elif allowed and (limit is None or allowed[0] <= limit):
        d_rope = allowed[0]  # one frequency pair (or stock's smallest workable width) above the cap
        what += "; none fits, so the smallest workable d_rope"
    else:
        _refuse_rope_width(config, allowed, budget, stock, stock_layout)
    how.append(f"d_rope = largest {kind} <= {what}: {d_rope}")
    if budget is None:
        assert kv_lora_rank is not None  # no budget: d_c was given
        return Ranks(kv_lora_rank, d_rope, None, tuple(how))
    d_c = budget - d_rope
    how.insert(0, f"budget = KV width / compression = {width} / {compression:g} = {budget} values per layer")
    how.append(f"d_c = budget - d_rope = {d_c}")
    return Ranks(d_c, d_rope, budget, tuple(how))


def _refuse_rope_width(config: ModelConfig, allowed: list[int], budget: int | None, stock: bool, stock_layout: str) -> NoReturn:
    """ConfigError: no RoPE width fits the budget; says which widths a stock export needs, why, and the
    compression that would fit them."""
    hd, width = known(config.head_dim, "head_dim"), config.kv_width
    reason, fix = "", "lower the compression"
    if stock and allowed:  # only stock's widths are too wide: say which, why, and the budget they need
        smaller = [v for v in range(2, allowed[0], 2) if stock_layout == "prefix" or hd % v == 0]
        why = stock_rope_problem(config, smaller[-1], stock_layout) if smaller else None
        need = allowed[0] + 1
        reason = (
            f"; a stock DeepSeek-V3 export of this model needs d_rope in {allowed}"
            + (f" (at d_rope {smaller[-1]}: {why})" if why else "")
            + f", so at least {need} values"
        )
        fix = f"pass --compression {math.floor(width / need * 1000) / 1000:g} or lower (or --kv-lora-rank with --rope-dim {allowed[0]})"
    elif stock:
        reason = "; stock DeepSeek-V3 export: " + (
            stock_rope_problem(config, hd, stock_layout) or "no even divisor of head_dim fits"
        )
    raise ConfigError(
        f"no RoPE width fits: compression leaves {budget} cached values per layer{reason}; {fix}, or export "
        "kvgraft's own format (--format kvgraft)"
    )


__all__ = [
    "DEFAULT_CED_COMPRESSION",
    "DEFAULT_COMPRESSION",
    "HALF_HEAD_FLOOR",
    "ROPE_CAP",
    "STOCK_PREFIX_ROPE_SHARE",
    "STOCK_ROPE_SELECTION",
    "Ranks",
    "check_compression",
    "default_ranks",
    "stock_rope_problem",
]
