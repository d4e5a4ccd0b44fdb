"""``known``: a ``ModelConfig`` field that must be set where it is read, as its non-optional type.

``ModelConfig`` types the MLA widths (``kv_lora_rank``, ``qk_rope_head_dim``, ``qk_nope_head_dim``,
``v_head_dim``: set on MLA configs only) and the fields it derives on construction as Optional; code that
runs on an MLA model reads them through ``known``, which says which one was missing when that does not hold.
"""

from __future__ import annotations

from typing import TypeVar

from kvgraft.errors import ConfigError

T = TypeVar("T")


def known(value: T | None, name: str) -> T:
    """``value``, or ValueError naming the config field ``name`` when it is None."""
    if value is None:
        raise ConfigError(f"the model config has no {name}")
    return value


__all__ = ["known"]
