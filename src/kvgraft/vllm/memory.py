"""What vLLM actually allocates for one request: cache groups, bytes per block, blocks held at a context.

Measured on a running engine (``vllm.LLM`` with the engine core in this process,
``VLLM_ENABLE_V1_MULTIPROCESSING=0``): one request of ``n`` prompt tokens is prefilled and decoded one
step (a sliding-window manager frees the blocks that left the window when the next step allocates),
then the blocks its request holds in every cache group are counted (the null block excluded). vLLM's
cache groups share one pool of block ids and every id spans one page of every layer position of a
group, so a request's bytes are ``held blocks x bytes per block id`` (``KVCacheTensor.size /
num_blocks``), padding layers and padded pages included: what the pool gives up for it.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any


@dataclass(frozen=True)
class VllmGroup:
    layers: list[str]  # layer names vLLM put in the group
    spec: str  # the spec's class name
    block_size: int  # tokens per block
    page_bytes: int  # bytes per block per layer


@dataclass(frozen=True)
class VllmKVUsage:
    """One request of ``context`` tokens on a running vLLM engine."""

    context: int  # tokens computed for the request when measured (prompt + one decoded token)
    bytes_per_block_id: int  # bytes one block id spans in the pool (all layer positions of a group)
    held_blocks: list[int]  # per cache group, blocks the request holds
    groups: list[VllmGroup] = field(default_factory=list)

    @property
    def bytes(self) -> int:
        return sum(self.held_blocks) * self.bytes_per_block_id

    @property
    def bytes_per_token(self) -> float:
        return self.bytes / self.context

    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d.update(bytes=self.bytes, bytes_per_token=self.bytes_per_token)
        return d


def engine_core(llm: Any) -> Any:
    """The in-process ``EngineCore`` of a ``vllm.LLM`` (needs ``VLLM_ENABLE_V1_MULTIPROCESSING=0``)."""
    client = llm.llm_engine.engine_core
    core = getattr(client, "engine_core", None)
    if core is None:
        raise RuntimeError("the engine core runs in another process: set VLLM_ENABLE_V1_MULTIPROCESSING=0")
    return core


def cache_groups(llm: Any) -> tuple[list[VllmGroup], int]:
    """The engine's cache groups and the bytes one block id spans."""
    config = engine_core(llm).scheduler.kv_cache_manager.kv_cache_config
    sizes = {t.size for t in config.kv_cache_tensors}
    if len(sizes) != 1:
        raise RuntimeError(f"cache tensors of different sizes {sorted(sizes)}: not one pool of block ids")
    groups = [
        VllmGroup(
            list(g.layer_names), type(g.kv_cache_spec).__name__, g.kv_cache_spec.block_size, g.kv_cache_spec.page_size_bytes
        )
        for g in config.kv_cache_groups
    ]
    return groups, sizes.pop() // config.num_blocks


def request_usage(llm: Any, prompt: list[int]) -> VllmKVUsage:
    """Prefill ``prompt`` alone, decode one token, count the blocks held; then finish the request.
    Nothing else may be running on the engine."""
    from vllm import SamplingParams  # deliberately lazy: this module imports without vLLM

    if not prompt:
        raise ValueError("prompt must hold at least one token")
    engine = llm.llm_engine
    if engine.has_unfinished_requests():
        raise RuntimeError("request_usage needs an idle engine")
    manager = engine_core(llm).scheduler.kv_cache_manager
    rid = f"kvgraft-usage-{len(prompt)}"
    engine.add_request(rid, {"prompt_token_ids": list(prompt)}, SamplingParams(temperature=0.0, max_tokens=3, ignore_eos=True))
    engine.step()  # prefill (one step: the caller's max_num_batched_tokens must cover the prompt)
    engine.step()  # one decode: window managers free what left the window before allocating
    held = []
    for m in manager.coordinator.single_type_managers:
        keys = [k for k in m.req_to_blocks if k.startswith(rid)]
        held.append(sum(1 for b in m.req_to_blocks[keys[0]] if not b.is_null) if keys else 0)
    while engine.has_unfinished_requests():
        engine.step()
    groups, per_block = cache_groups(llm)
    return VllmKVUsage(len(prompt) + 1, per_block, held, groups)
