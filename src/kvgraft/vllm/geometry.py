"""How a causal encoder-decoder's storage maps onto vLLM's paged blocks (no vLLM import: a pure function
of the config, so the numbers can be checked anywhere).

vLLM's hybrid KV cache manager needs one physical page size for every cache group (``get_uniform_page_size``
in ``vllm/v1/core/kv_cache_utils.py``). Per layer the CED stores three kinds of rows (``cache_layout``):

- a window row per token, ``K (d_nope + d_rope + d_v)`` values, in every layer (a sliding window of W);
- a pooled entry per ``m`` tokens, ``d_c + d_rope`` (+ indexer key) values, in each kv_source layer;
- with m > 1, a pending row per token, entry + gate scores, of which a layer needs the last m - 1 tokens.

The window's block (``WINDOW_BLOCK`` tokens) fixes the page; a stream block holds as many whole entries
as fit in that page (so ``stream_entries * m`` tokens) and a pending block as many rows, both rounded down
so that their block sizes are multiples of the window's: vLLM's scheduler block, the granularity of its
prefix-cache hits, is the lcm of the groups' block sizes (with 51 entries and 25 pending rows, the 8m's
would be lcm(16, 25, 102) = 20,400 tokens at 16-token window blocks; rounded, 96; at 8, 48). The bytes that do not fill a page are padding
(``page_size_padded``), reported by :func:`padding_bytes`.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from kvgraft.checks import check_int
from kvgraft.model.config import ModelConfig, cache_layout

# tokens per window block: vLLM frees a window's blocks whole as they leave it, so a window of W holds up to
# ceil((W - 1) / block) + 1 blocks. Measured on kvgraft-ced-8m (test_vllm_ced_memory, one request of 65-481
# tokens, bytes vLLM holds / kvgraft's formula): 16 -> 1.49-1.59x, 8 -> 1.30-1.37x, 4 -> 1.20-1.24x (4 not run
# through the parity tests). 8 also halves vLLM's scheduler block (prefix-cache granularity) to 48 tokens
WINDOW_BLOCK = 8
WINDOW, STREAM, PENDING = "window_cache", "stream_cache", "pending_cache"  # the cache kinds (vLLM layer names' last part)


@dataclass(frozen=True)
class PageGeometry:
    """Block sizes (tokens) and row widths (values) of the three kinds of CED cache on one page size."""

    itemsize: int  # bytes per cached value
    page_bytes: int  # bytes of every block of every group
    window_block: int  # tokens per window block
    window_width: int  # values per token of a window row: K (d_nope + d_rope + d_v)
    window: int  # W
    compress_rate: int  # m
    entry_width: int  # values per pooled entry: d_c + d_rope (+ indexer key)
    stream_entries: int  # pooled entries per stream block
    pending_width: int  # values per pending token (0 when m == 1)
    pending_block: int  # tokens per pending block (0 when m == 1)

    @property
    def stream_block(self) -> int:
        """Tokens one stream block covers (its entries pool ``m`` tokens each)."""
        return self.stream_entries * self.compress_rate

    def padding_bytes(self) -> dict[str, int]:
        """Bytes per block that no row fills, by kind (window, stream, pending)."""
        pad = {
            "window": self.page_bytes - self.window_block * self.window_width * self.itemsize,
            "stream": self.page_bytes - self.stream_entries * self.entry_width * self.itemsize,
        }
        if self.pending_width:
            pad["pending"] = self.page_bytes - self.pending_block * self.pending_width * self.itemsize
        return pad


def page_geometry(config: ModelConfig, itemsize: int, window_block: int = WINDOW_BLOCK) -> PageGeometry:
    """The page geometry of ``config`` at ``itemsize`` bytes per value; ValueError for a non-CED config."""
    if not config.is_ced or config.sliding_window is None:
        raise ValueError("kvgraft's vLLM model serves causal encoder-decoders (a config with kv_source_layers)")
    for name, value in (("itemsize", itemsize), ("window_block", window_block)):
        check_int(name, value, low=1)
    layout = cache_layout(config)
    source = config.pivot_layer
    row = layout.rings[0]
    entry = layout.segments[source]
    pending = layout.pending.get(source, 0)
    block = window_block
    while block * row < max(entry, pending):  # a page holds at least one entry and one pending row
        block *= 2
    page = block * row * itemsize
    # whole entries per stream block, and pending rows per block, chosen so that every group's block size is a
    # multiple of the window's: vLLM's scheduler block (and prefix-cache hit granularity) is their lcm
    per_entry = page // (entry * itemsize)
    step = block // math.gcd(block, config.compress_rate)  # entries whose m tokens make whole window blocks
    entries = per_entry // step * step or per_entry
    pend_rows = page // (pending * itemsize) if pending else 0
    if pending and pend_rows >= block:
        pend_rows = pend_rows // block * block
    return PageGeometry(
        itemsize=itemsize,
        page_bytes=page,
        window_block=block,
        window_width=row,
        window=config.sliding_window,
        compress_rate=config.compress_rate,
        entry_width=entry,
        stream_entries=entries,
        pending_width=pending,
        pending_block=pend_rows,
    )
