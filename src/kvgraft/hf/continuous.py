"""transformers' continuous batching (``generate_batch``, ``transformers serve --continuous-batching``) on
kvgraft's own format (:class:`kvgraft.hf.auto.KvgraftForCausalLM`).

transformers' continuous-batching manager schedules requests, gives each one blocks of its
``PagedAttentionCache`` and calls ``model(**kwargs)`` with the rows of a step packed on one token axis
(``input_ids`` / ``position_ids`` (1, N), ``cu_seq_lens_q``, ``write_index`` / ``read_index``,
``logits_indices``); its cache holds one key and value row of ``num_key_value_heads x head_dim`` per token
and layer. What kvgraft's attention kinds store does not fit that (``kvgraft.model.cache.cache_layout``):
the causal encoder-decoder's pooled, cross-layer shared stream with per-sequence pending tokens, its
per-layer windows read under one softmax with that stream, MLA's latent cache, cross-layer KV sharing.

So the wrapper **does not use transformers' paged cache** (transformers still allocates it, sized by the
``ContinuousBatchingConfig``; it is never read or written). It uses the request bookkeeping only: each
row is matched to its transformers request through the block its last token is written to, and every
request gets a sequence of kvgraft's own :class:`~kvgraft.model.cache.PagedKVCache` (the engine's cache),
kept from step to step (:class:`ContinuousRequests`). A step's rows then run as one kvgraft
``BatchContext`` per cache shard, exactly as kvgraft's engine runs them, so the tokens are the engine's.
"""

from __future__ import annotations

import copy
import logging
import math
from typing import Any, cast

import torch
from torch import nn
from transformers import ContinuousBatchingConfig
from transformers.generation.continuous_batching.cache import PagedAttentionCache

from kvgraft.errors import ConfigError
from kvgraft.model.batch import BatchContext
from kvgraft.model.cache import PagedKVCache
from kvgraft.model.config import ModelConfig
from kvgraft.model.sizes import default_block_size

logger = logging.getLogger(__name__)

# ContinuousBatchingConfig fields this forward cannot honour, and the value it runs with instead
FORCED = {
    "allow_block_sharing": False,  # a prefix hit would start a request mid-sequence, with no kvgraft state
    "cpu_offload_space": 0.0,  # an offloaded request comes back mid-sequence after its blocks were freed
    "use_cuda_graph": False,  # the forward keeps per-request state in Python: nothing to capture
    "use_async_batching": False,
    "q_padding_interval_size": 0,  # (non-zero asks for CUDA graphs)
    "kv_padding_interval_size": 0,
    "varlen_compile_config": None,
    "decode_compile_config": None,
    "default_compile_level": 0,
    "max_blocks_per_request": 0,  # the flash decode fast path (block tables) is never taken
}
MIN_SHARD = 8  # sequences of the first kvgraft cache; each further shard holds as many as are live


def kvgraft_cb_config(cb_config: Any) -> Any:
    """A copy of a ``ContinuousBatchingConfig`` with :data:`FORCED`'s values (warns for each field that asked for
    something else than transformers' default)."""

    default = ContinuousBatchingConfig()
    out = copy.deepcopy(cb_config)
    for name, value in FORCED.items():
        if not hasattr(out, name):
            continue
        mine = getattr(out, name)
        if mine != value and mine != getattr(default, name, value) and mine is not None:
            logger.warning(
                "kvgraft: continuous batching runs with %s=%r (asked: %r); see kvgraft.hf.continuous", name, value, mine
            )
        setattr(out, name, value)
    return out


def guard_request_length(manager: Any, max_seq_len: int) -> None:
    """Make ``manager.add_request`` (and so ``add_requests``, ``generate_batch``, ``transformers serve``) refuse a
    request of more than ``max_seq_len`` tokens (prompt + max_new_tokens) with a ValueError, before it is queued:
    under way, it could only fail the whole step it runs in (once per manager)."""
    if getattr(manager, "_kvgraft_guarded", False):
        return
    add = manager.add_request

    def add_request(input_ids, request_id=None, max_new_tokens=None, *args, **kwargs):
        new = manager.generation_config.max_new_tokens if max_new_tokens is None else max_new_tokens
        if len(input_ids) + (new or 0) > max_seq_len:
            raise ConfigError(
                f"kvgraft: a request of {len(input_ids)} prompt tokens + {new} new tokens exceeds the "
                f"model's max_position_embeddings ({max_seq_len})"
            )
        return add(input_ids, request_id, max_new_tokens, *args, **kwargs)

    manager.add_request = add_request
    manager._kvgraft_guarded = True


def is_continuous_batching_call(kwargs: dict) -> bool:
    """Whether a forward's kwargs come from transformers' continuous-batching runner (a paged cache and rows)."""
    cache = kwargs.get("cache")
    if cache is None or "cu_seq_lens_q" not in kwargs:
        return False

    return isinstance(cache, PagedAttentionCache)


class ContinuousRequests:
    """kvgraft KV state for the requests of one transformers ``PagedAttentionCache``: request id -> a sequence
    of one of a few kvgraft caches (shards: a shard holds ``slots`` sequences of up to ``max_seq_len``
    tokens each, so a sequence admitted never runs short; a new shard is added when every slot is taken).

    Lifecycle: a request whose blocks transformers freed (finished, failed, cancelled, soft-reset) loses its
    sequence at the next step; a request seen again at position 0 (a soft reset re-prefills from scratch)
    starts a fresh one. What cannot be followed is refused by name: a row that continues at a position
    kvgraft holds no state for (a fork for ``num_return_sequences > 1``, a prefix-cache hit, a CPU-offloaded
    request restored); :func:`kvgraft_cb_config` turns off the features that would produce them (block
    sharing, CPU offloading) and those that need a static, capturable forward (CUDA graphs, torch.compile,
    async double-buffering), since this forward keeps Python-side state per request. One request may hold up
    to ``max_position_embeddings`` tokens (the engine's default ``max_seq_len``; :func:`guard_request_length`
    refuses longer ones when they are added).
    """

    def __init__(self, config: ModelConfig, dtype: torch.dtype, device: torch.device) -> None:
        self.config, self.dtype, self.device = config, dtype, device
        self.block_size = default_block_size(config)
        self.max_seq_len = config.max_position_embeddings
        self.shards: list[PagedKVCache] = []
        self.seqs: dict[str, tuple[int, int]] = {}  # request id -> (shard, kvgraft sequence)

    # ---- bookkeeping ---------------------------------------------------------------------------------
    def _new_shard(self) -> int:
        slots = max(MIN_SHARD, len(self.seqs))
        per_seq = math.ceil(self.max_seq_len / self.block_size)
        self.shards.append(
            PagedKVCache(
                self.config,
                num_blocks=slots * per_seq,
                block_size=self.block_size,
                max_seqs=slots,
                max_seq_len=self.max_seq_len,
                dtype=self.dtype,
                device=self.device,
            )
        )
        return len(self.shards) - 1

    def _add(self, rid: str) -> tuple[int, int]:
        for i, shard in enumerate(self.shards):
            if shard.free_slots:
                break
        else:
            i = self._new_shard()
        entry = (i, self.shards[i].add_sequence(expect_tokens=self.max_seq_len))
        self.seqs[rid] = entry
        return entry

    def _drop(self, rid: str) -> None:
        i, seq = self.seqs.pop(rid)
        self.shards[i].free(seq)

    def _collect(self, live: set[str]) -> None:
        """Free the sequences of requests transformers no longer holds blocks for; drop empty extra shards."""
        for rid in [r for r in self.seqs if r not in live]:
            self._drop(rid)
        while len(self.shards) > 1 and not self.shards[-1].sequences:
            self.shards.pop()

    @staticmethod
    def _owners(tcache: Any, write_index: list[torch.Tensor], ends: list[int]) -> list[str | None]:
        """The transformers request id of each row, from the block its last token is written to."""
        alloc = min(tcache.cache_allocators.values(), key=lambda a: a.index)
        owner = {b: rid for rid, table in alloc.block_table.items() for b in table}
        idx = write_index[alloc.index]
        last = idx[torch.tensor([e - 1 for e in ends], device=idx.device)].tolist() if ends else []
        return [owner.get(int(i) // alloc.block_physical_stride) for i in last]

    def rows(
        self, tcache: Any, write_index: list[torch.Tensor], ends: list[int], starts: list[int], lens: list[int]
    ) -> list[tuple[int, int]]:
        """(shard, sequence) of each row (``ends``: one past its last token on the packed axis; ``starts``: its
        first position), after checking it continues where kvgraft's state for it ends."""
        live = set().union(*(a.block_table.keys() for a in tcache.cache_allocators.values()))
        self._collect(live)
        rids = self._owners(tcache, write_index, ends)
        if len(set(rids)) != len(rids) or None in rids:
            raise RuntimeError(
                f"kvgraft: could not match the rows of this continuous-batching step to requests "
                f"(found {rids}); the row's last token must be written to a block of its request"
            )
        out = []
        for rid, start, n in zip(rids, starts, lens):
            if start + n > self.max_seq_len:
                raise ConfigError(
                    f"kvgraft: request {rid!r} reaches {start + n} tokens, beyond the model's "
                    f"max_position_embeddings ({self.max_seq_len}); lower max_new_tokens"
                )
            if rid in self.seqs and start == 0:  # re-prefilled from scratch (soft reset), or an id reused
                self._drop(rid)
            if rid in self.seqs:
                i, seq = self.seqs[rid]
                have = self.shards[i].length(seq)
                if have != start:
                    raise RuntimeError(
                        f"kvgraft: request {rid!r} continues at position {start} but kvgraft holds {have} tokens of it"
                    )
                out.append((i, seq))
            elif start == 0:
                assert rid is not None  # checked above: every row has an owner
                out.append(self._add(rid))
            else:
                raise RuntimeError(
                    f"kvgraft: request {rid!r} starts at position {start} with no kvgraft state: a forked "
                    "(num_return_sequences > 1), prefix-shared or CPU-offloaded request, which kvgraft's models do "
                    "not support under continuous batching (their KV lives in kvgraft's cache, not transformers')"
                )
        return out

    # ---- the step ------------------------------------------------------------------------------------
    def forward(
        self,
        backbone: nn.Module,
        input_ids: torch.Tensor,
        position_ids: torch.Tensor,
        cu_seq_lens_q: torch.Tensor,
        write_index: list[torch.Tensor],
        tcache: Any,
    ) -> torch.Tensor:
        """Hidden states (1, N, h) of the step's packed tokens (zeros at padding tokens after the last row)."""
        cu = [int(c) for c in cu_seq_lens_q.tolist()]
        bounds = [(a, b) for a, b in zip(cu[:-1], cu[1:]) if b > a]  # padding rows have no tokens
        ids = input_ids.reshape(-1)
        pos = position_ids.reshape(-1)
        starts = pos[torch.tensor([a for a, _ in bounds], device=pos.device)].tolist() if bounds else []
        lens = [b - a for a, b in bounds]
        where = self.rows(tcache, write_index, [b for _, b in bounds], [int(s) for s in starts], lens)
        out = None
        for shard in sorted({i for i, _ in where}):
            rows = [r for r, (i, _) in enumerate(where) if i == shard]
            tok = torch.cat([torch.arange(*bounds[r], device=ids.device) for r in rows])
            ctx = BatchContext(self.shards[shard], [where[r][1] for r in rows], [lens[r] for r in rows])
            hidden = backbone(ids[tok].long(), ctx=ctx)[0]  # (n, h); the forward commits the tokens
            if out is None:
                out = hidden.new_zeros(ids.shape[0], hidden.shape[-1])
            out[tok] = hidden
        if out is None:
            raise ConfigError("kvgraft: a continuous-batching step with no tokens")
        return out[None]


def continuous_hidden(model: nn.Module, backbone: nn.Module, input_ids: torch.Tensor, kwargs: dict) -> torch.Tensor:
    """The backbone's hidden states for one transformers continuous-batching step (see the module docstring);
    the kvgraft state lives on transformers' cache object, so it ends with the manager that owns it."""
    tcache = kwargs["cache"]
    if kwargs.get("block_table") is not None:
        raise ConfigError(
            "kvgraft: the flash decode fast path (block tables) is not supported; run continuous "
            "batching with attn_implementation 'eager' or 'sdpa'"
        )
    position_ids = kwargs.get("position_ids")
    if position_ids is None:
        raise ConfigError("kvgraft: a continuous-batching step without position_ids")
    state = getattr(tcache, "_kvgraft_requests", None)
    if state is None:
        weight = cast(nn.Embedding, backbone.embed_tokens).weight
        state = ContinuousRequests(cast(Any, model.config).model_config, weight.dtype, weight.device)
        tcache._kvgraft_requests = state
    return state.forward(backbone, input_ids, position_ids, kwargs["cu_seq_lens_q"], kwargs["write_index"], tcache)
