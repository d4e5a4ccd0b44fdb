"""``KvgraftCEDForCausalLM``: kvgraft's causal encoder-decoder as a vLLM model (registered by ``kvgraft.vllm``).

The model is kvgraft's own ``Transformer`` (same modules, same parameter names as the checkpoint's
``model.*``), run layer by layer over vLLM's packed token axis with a :class:`VllmStepContext`, plus one
cache module per storage kind (``kvgraft.vllm.cache``) that vLLM allocates. vLLM schedules, batches,
samples and manages blocks; the attention, the compressor's pooling and the masks are kvgraft's code.

Runs eager (``enforce_eager=True``; the step context is Python per request). Without attention metadata
(vLLM's profiling and warm-up runs) the layers run cache-free over the dummy batch, which touches no cache.
"""

from __future__ import annotations

import os
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import torch
from torch import nn

try:
    from vllm.config import VllmConfig
    from vllm.forward_context import get_forward_context
    from vllm.model_executor.layers.linear import ReplicatedLinear
    from vllm.model_executor.models.interfaces import SupportsLoRA
except ImportError as exc:  # the optional extra is missing
    from kvgraft.vllm import EXTRA_HINT

    raise ImportError(EXTRA_HINT) from exc

from kvgraft.hf.config_map import model_config_from_hf
from kvgraft.hf.keys import hf_to_kvgraft
from kvgraft.model.batch import DenseContext, StepContext, active_context
from kvgraft.model.ced import rope_tables
from kvgraft.model.transformer import Transformer
from kvgraft.runtime.adapters import AdapterRegistry
from kvgraft.vllm.batched import ced_attention
from kvgraft.vllm.batched import compress as compress_step
from kvgraft.vllm.cache import PENDING, STREAM, WINDOW, CEDCacheLayer, CEDCacheMetadata
from kvgraft.vllm.context import VllmStepContext
from kvgraft.vllm.geometry import page_geometry
from kvgraft.vllm.lora import install as install_lora_bridge
from kvgraft.vllm.lora import step_adapters

# the linears a kvgraft adapter may target, by their last name: vLLM's LoRA loader accepts an adapter's target
# modules only when the model has vLLM linears so named (the stand-ins below; kvgraft applies the deltas)
PATH_ENV = "KVGRAFT_VLLM_CED_PATH"  # "batched" (default) or "per-request" (kvgraft's layer code per request)
ADAPTER_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "kv_b_proj", "kv_a_proj", "gate_proj", "up_proj", "down_proj")


class KvgraftCEDForCausalLM(nn.Module, SupportsLoRA):
    """vLLM's model interface (``forward``, ``compute_logits``, ``load_weights``) over kvgraft's Transformer.

    With ``enable_lora``, each request's adapter (vLLM's ``LoRARequest``: its name and directory, a
    ``kvgraft adapt`` output) is loaded into kvgraft's ``AdapterRegistry`` on first use, checked against this
    base, and applied by kvgraft's layers per request (``kvgraft.vllm.lora``)."""

    packed_modules_mapping: dict[str, list[str]] = {}
    embedding_modules: dict[str, str] = {}

    def __init__(self, *, vllm_config: VllmConfig, prefix: str = "") -> None:
        super().__init__()
        hf = vllm_config.model_config.hf_config
        self.config = model_config_from_hf(hf.to_dict(), "vLLM's hf_config")
        if not self.config.is_ced:
            raise ValueError(
                "kvgraft's vLLM model serves causal encoder-decoders (kv_source_layers set); "
                f"this checkpoint has attention kinds {sorted(set(self.config.attention_kinds))}"
            )
        dtype = vllm_config.model_config.dtype
        cache_dtype = vllm_config.cache_config.cache_dtype
        if cache_dtype not in ("auto", str(dtype).removeprefix("torch.")):
            raise ValueError(f"kv cache dtype {cache_dtype!r}: kvgraft's CED caches store the model dtype ('auto')")
        self.model = Transformer(self.config)
        itemsize = torch.empty((), dtype=dtype).element_size()
        self.geometry = page_geometry(self.config, itemsize)
        self.caches = nn.ModuleDict()
        self.cache_layers: dict[tuple[int, str], CEDCacheLayer] = {}
        kinds = [(layer, WINDOW) for layer in range(self.config.num_layers)]
        for s in self.config.kv_source_layers or ():
            kinds.append((s, STREAM))
            if self.config.compress_rate > 1:
                kinds.append((s, PENDING))
        for layer, kind in sorted(kinds):
            name = f"model.layers.{layer}.self_attn.{kind}"
            cache = CEDCacheLayer(kind, self.geometry, dtype, name)
            self.caches[f"{layer}_{kind}"] = cache
            self.cache_layers[(layer, kind)] = cache
        # the batched path (``kvgraft.vllm.batched``) for every step without adapters; the indexer's top-k and
        # KVGRAFT_VLLM_CED_PATH=per-request keep kvgraft's own layer code, one request at a time
        path = os.environ.get(PATH_ENV, "batched")
        if path not in ("batched", "per-request"):
            raise ValueError(f"{PATH_ENV}={path!r}: expected 'batched' or 'per-request'")
        self.batched = path == "batched" and not self.config.index_topk
        for cache in self.cache_layers.values():
            cache.batched = self.batched
        self.lora_enabled = vllm_config.lora_config is not None
        self.adapters = AdapterRegistry(self.model)
        self.adapter_paths: dict[str, Path] = {}
        if self.lora_enabled:
            install_lora_bridge()
            # stand-ins (1 x 1, never run) that make vLLM's LoRA manager accept kvgraft's module names
            self.lora_stand_ins = nn.ModuleDict(
                {n: ReplicatedLinear(1, 1, bias=False, prefix=f"lora_stand_ins.{n}") for n in ADAPTER_TARGETS}
            )

    def embed_input_ids(self, input_ids: torch.Tensor) -> torch.Tensor:
        out: torch.Tensor = self.model.embed_tokens(input_ids)
        return out

    def _context(self, positions: torch.Tensor) -> StepContext | dict[tuple[int, str], CEDCacheMetadata]:
        """The step's storage: a kvgraft step context (profiling, adapters, the indexer), or each cache's
        metadata for the batched path."""
        metadata = get_forward_context().attn_metadata
        if isinstance(metadata, list):  # micro-batches: one dict each (not used on the CPU)
            raise NotImplementedError("kvgraft's CED model runs without micro-batching (ubatching)")
        names = [c.layer_name for c in self.cache_layers.values()]
        if not metadata or any(n not in metadata for n in names):  # profiling / warm-up: no cache
            return DenseContext(positions[None], False, self.config.compress_rate)
        window = self.config.sliding_window
        if window is None:
            raise ValueError("a causal encoder-decoder config has sliding_window")
        adapters = None
        if self.lora_enabled:
            first = metadata[names[0]]
            adapters = [self._adapter(a) for a in step_adapters(first.query_start)]
        if self.batched and not any(a is not None for a in adapters or ()):
            return {key: metadata[c.layer_name] for key, c in self.cache_layers.items()}
        return VllmStepContext(self.cache_layers, metadata, positions, window, self.config.compress_rate, adapters)

    def _adapter(self, request: tuple[str, Path] | None) -> str | None:
        """The registry name of a request's adapter, loading it on first use (None: the base, or one of vLLM's
        warm-up adapters, whose directories do not exist)."""
        if request is None:
            return None
        name, path = request
        if not path.exists():
            return None
        if not (path / "kvgraft_adapter.json").is_file():
            raise ValueError(f"adapter {name!r} at {path}: not a kvgraft adapter directory (no kvgraft_adapter.json)")
        if self.adapter_paths.get(name) != path:
            if name in self.adapters:
                self.adapters.unload(name)
            self.adapters.load(name, path)
            self.adapter_paths[name] = path
        return name

    @torch.no_grad()
    def forward(
        self,
        input_ids: torch.Tensor | None,
        positions: torch.Tensor,
        intermediate_tensors: Any = None,
        inputs_embeds: torch.Tensor | None = None,
        **kwargs: Any,
    ) -> torch.Tensor:
        """(N,) token ids at (N,) positions -> (N, hidden) final-normed hidden states."""
        if inputs_embeds is None:
            if input_ids is None:
                raise ValueError("give input_ids or inputs_embeds")
            inputs_embeds = self.embed_input_ids(input_ids)
        x = inputs_embeds[None]
        pos = positions.long()
        cos, sin = self.model.rotary(pos[None], x.dtype)
        cos, sin = rope_tables(self.config, cos, sin)
        ctx = self._context(pos)
        if isinstance(ctx, dict):
            x = self._forward_batched(x, pos, cos, sin, ctx)
        else:
            with active_context(ctx):
                for block in self.model.layers:
                    x = block(x, cos, sin, ctx)
        out: torch.Tensor = self.model.norm(x[0])
        return out

    def _forward_batched(
        self,
        x: torch.Tensor,
        pos: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        md: dict[tuple[int, str], CEDCacheMetadata],
    ) -> torch.Tensor:
        """kvgraft's blocks (pre-norm attention, pre-norm MLP) with each layer's attention for the whole step
        (``kvgraft.vllm.batched``): x (1, N, h) -> (1, N, h)."""

        def ix(layer: int, kind: str) -> Any:
            batch = md[(layer, kind)].batch
            if batch is None:
                raise ValueError(f"layer {layer} {kind}: the metadata builder computed no batched indices")
            return batch

        for layer, module in enumerate(self.model.layers):
            block: Any = module  # kvgraft's Block, with a CEDAttention
            attn = block.self_attn
            h = block.input_layernorm(x)
            if attn.is_source:
                pending = self.cache_layers.get((layer, PENDING))
                compress_step(
                    attn.compressor,
                    h,
                    cos,
                    sin,
                    pos,
                    self.cache_layers[(layer, STREAM)].rows(),
                    ix(layer, STREAM),
                    None if pending is None else pending.rows(),
                    None if pending is None else ix(layer, PENDING),
                )
            src = attn.source
            y = ced_attention(
                attn,
                h,
                cos,
                sin,
                self.cache_layers[(layer, WINDOW)].rows(),
                ix(layer, WINDOW),
                None if src is None else self.cache_layers[(src, STREAM)].rows(),
                None if src is None else ix(src, STREAM),
            )
            x = x + attn.o_proj(y)[None]
            x = x + block.mlp(block.post_attention_layernorm(x))
        return x

    def compute_logits(self, hidden_states: torch.Tensor) -> torch.Tensor:
        logits: torch.Tensor = self.model.lm_head(hidden_states)
        return logits

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        """The checkpoint's tensors (transformers names), checked name by name and shape by shape
        (``kvgraft.hf.keys``), copied into the Transformer; returns every parameter's name."""
        state = hf_to_kvgraft(dict(weights), self.config, source="the checkpoint vLLM read")
        params = dict(self.model.named_parameters())
        with torch.no_grad():
            for name, tensor in state.items():
                if name not in params:
                    raise KeyError(f"checkpoint tensor {name!r} has no parameter in kvgraft's model")
                params[name].copy_(tensor.to(params[name].dtype))
        loaded = {f"model.{n}" for n in state}
        if self.config.tie_word_embeddings:
            loaded.add("model.lm_head.weight")
        missing = {f"model.{n}" for n in params} - loaded
        if missing:
            raise KeyError(f"the checkpoint has no tensor for {sorted(missing)}")
        return {n for n, _ in self.named_parameters()}
