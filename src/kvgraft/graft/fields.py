"""``known``: a ``ModelConfig`` field the graft needs set, as its non-optional type.

``ModelConfig`` types the fields it derives on construction (``head_dim``, ``attention_kinds``,
``rope_freq_index``, ...) and the MLA widths (set on MLA configs only) as Optional; the graft reads them
where they are set, and says which one was not when that does not hold.
"""

from __future__ import annotations

from typing import TypeVar

T = TypeVar("T")


def known(value: T | None, name: str) -> T:
    """``value``, or ValueError naming the config field ``name`` when it is None."""
    if value is None:
        raise ValueError(f"the model config has no {name}")
    return value


__all__ = ["known"]
