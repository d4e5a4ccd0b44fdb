"""``KvgraftCEDForCausalLM``: kvgraft's causal encoder-decoder as a vLLM model (registered by ``kvgraft.vllm``).

The model is kvgraft's own ``Transformer`` (same modules, same parameter names as the checkpoint's
``model.*``), run layer by layer over vLLM's packed token axis, plus one cache module per storage kind
(``kvgraft.vllm.cache``) that vLLM allocates. vLLM schedules, batches, samples and manages blocks; the
projections, the compressor's pooling and the masks are kvgraft's code.

Each layer's attention is one custom op, ``torch.ops.vllm.kvgraft_ced_attention`` (opaque to torch.compile, as
vLLM's own attention ops are): it writes the step's rows to vLLM's blocks and attends for the whole step
(``kvgraft.vllm.batched``). Everything around it is plain tensor code, so vLLM's compiled mode (the default,
no ``enforce_eager``) compiles the model; on CUDA the op is a splitting op, so piecewise CUDA graphs capture
the code between the ops. Steps with adapters run the same ops with each token's adapter routed by a
:class:`VllmStepContext`; configs with an indexer run kvgraft's layer code per request. Eager only: with
``enable_lora``, an indexer or ``KVGRAFT_VLLM_CED_PATH=per-request`` the model is not compiled. In eager
mode, vLLM's profiling and warm-up runs (no attention metadata) run the layers cache-free over the dummy
batch; compiled, the op leaves their attention output at zero. Neither touches a cache.
"""

from __future__ import annotations

import functools
import os
from collections import Counter
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import torch
from torch import nn

try:
    from vllm.compilation.decorators import support_torch_compile
    from vllm.config import VllmConfig
    from vllm.forward_context import get_forward_context
    from vllm.model_executor.layers.linear import ReplicatedLinear
    from vllm.model_executor.models.interfaces import SupportsLoRA
    from vllm.utils.torch_utils import direct_register_custom_op
except ImportError as exc:  # the optional extra is missing
    from kvgraft.vllm import EXTRA_HINT

    raise ImportError(EXTRA_HINT) from exc

from kvgraft.hf.config_map import model_config_from_hf
from kvgraft.hf.keys import hf_to_kvgraft
from kvgraft.model.batch import DenseContext, StepContext, active_context, current_context
from kvgraft.model.ced import rope_tables
from kvgraft.model.transformer import Transformer
from kvgraft.runtime.adapters import AdapterRegistry, MultiLoraLinear
from kvgraft.vllm.batched import ced_attention
from kvgraft.vllm.batched import compress as compress_step
from kvgraft.vllm.cache import PENDING, STREAM, WINDOW, CEDCacheLayer
from kvgraft.vllm.context import VllmStepContext
from kvgraft.vllm.gemm import use_vllm_cpu_gemm
from kvgraft.vllm.geometry import page_geometry
from kvgraft.vllm.lora import install as install_lora_bridge
from kvgraft.vllm.lora import step_adapters

# the linears a kvgraft adapter may target, by their last name: vLLM's LoRA loader accepts an adapter's target
# modules only when the model has vLLM linears so named (the stand-ins below; kvgraft applies the deltas)
PATH_ENV = "KVGRAFT_VLLM_CED_PATH"  # "batched" (default) or "per-request" (kvgraft's layer code per request)
ADAPTER_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "kv_b_proj", "kv_a_proj", "gate_proj", "up_proj", "down_proj")
OP_NAME = "kvgraft_ced_attention"  # torch.ops.vllm.<this>; a splitting op of vLLM's compiled graph


def _ced_attention_op(
    q: torch.Tensor,
    entry: torch.Tensor,
    entries: torch.Tensor | None,
    scores: torch.Tensor | None,
    out: torch.Tensor,
    layer_name: str,
) -> None:
    """One CED layer's step, opaque to torch.compile: the layer is found by its window cache's vLLM name in
    the forward context (as vLLM's ``unified_attention`` finds its layer), which calls back into the model."""
    layer: Any = get_forward_context().no_compile_layers[layer_name]
    layer.attend(q, entry, entries, scores, out)


def _ced_attention_fake(
    q: torch.Tensor,
    entry: torch.Tensor,
    entries: torch.Tensor | None,
    scores: torch.Tensor | None,
    out: torch.Tensor,
    layer_name: str,
) -> None:
    return None


def _register_op() -> None:
    """Define ``torch.ops.vllm.kvgraft_ced_attention`` once per process (this module may be imported again)."""
    try:
        getattr(torch.ops.vllm, OP_NAME)
        return
    except AttributeError:
        pass
    direct_register_custom_op(OP_NAME, _ced_attention_op, mutates_args=["out"], fake_impl=_ced_attention_fake)


_register_op()


def compiles(vllm_config: VllmConfig) -> bool:
    """Whether vLLM may compile the model (in its compiled modes): only when every step takes the batched path
    and nothing in the forward depends on the data (no adapters, no indexer, no dynamic RoPE)."""
    config = model_config_from_hf(vllm_config.model_config.hf_config.to_dict(), "vLLM's hf_config")
    return (
        vllm_config.lora_config is None
        and not config.index_topk
        and config.rope.rope_type != "dynamic"
        and os.environ.get(PATH_ENV, "batched") == "batched"
    )


@support_torch_compile(dynamic_arg_dims={"input_ids": 0, "positions": 0, "inputs_embeds": 0}, enable_if=compiles)
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
        for layer in range(self.config.num_layers):  # the op's way back into the model (``_ced_attention_op``)
            self.cache_layers[(layer, WINDOW)].attend = functools.partial(self._attend, layer)
        splitting = vllm_config.compilation_config.splitting_ops
        if splitting is not None and f"vllm::{OP_NAME}" not in splitting and splitting:
            splitting.append(f"vllm::{OP_NAME}")  # piecewise CUDA graphs run the op outside the graphs
        self.steps: Counter[str] = Counter()  # forwards per path (batched, batched+adapters, per-request, profile)
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

    def _context(self, positions: torch.Tensor) -> StepContext | None:
        """The step's kvgraft context: None for the batched path without adapters; a
        :class:`VllmStepContext` for steps with adapters (on the batched path only their routing: which
        token and request carries which adapter) and for the per-request path; a ``DenseContext`` for vLLM's
        profiling and warm-up runs (no cache)."""
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
            return None
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
        if not getattr(self, "do_not_compile", True):  # compiled: the traced forward is the ops path only
            x = self._forward_ops(x, pos, cos, sin)
        else:
            ctx = self._context(pos)
            path = "batched" if ctx is None else "profile" if isinstance(ctx, DenseContext) else "per-request"
            if ctx is None:
                x = self._forward_ops(x, pos, cos, sin)
            elif self.batched and isinstance(ctx, VllmStepContext):  # adapters: the packed axis knows its rows
                path = "batched+adapters"
                with active_context(ctx):
                    x = self._forward_ops(x, pos, cos, sin)
            else:
                with active_context(ctx):
                    for block in self.model.layers:
                        x = block(x, cos, sin, ctx)
            self.steps[path] += 1
        out: torch.Tensor = self.model.norm(x[0])
        return out

    def _forward_ops(self, x: torch.Tensor, pos: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        """kvgraft's blocks (pre-norm attention, pre-norm MLP) with each layer's attention as one call of
        ``torch.ops.vllm.kvgraft_ced_attention`` for the whole step: x (1, N, h) -> (1, N, h). Tensor code
        only (no host sync, no branch on the step), so torch.compile traces it once for every step."""
        for layer, module in enumerate(self.model.layers):
            block: Any = module  # kvgraft's Block, with a CEDAttention
            attn = block.self_attn
            h = block.input_layernorm(x)
            entries = scores = None
            if attn.is_source:
                entries = attn.compressor.token_entries(h, cos, sin)[0]  # (N, E)
                if attn.compressor.m > 1:
                    scores = attn.compressor.gate_scores(h, pos[None])[0]  # (N, D)
            q, entry = attn._qkv(h, cos, sin)  # (1, H, N, dk), (1, N, K (dk + dv))
            out = h.new_zeros(h.shape[1], attn.num_heads * attn.dv)
            name = self.cache_layers[(layer, WINDOW)].layer_name
            torch.ops.vllm.kvgraft_ced_attention(q, entry, entries, scores, out, name)
            x = x + attn.o_proj(out[None])
            x = x + block.mlp(block.post_attention_layernorm(x))
        return x

    def _attend(
        self,
        layer: int,
        q: torch.Tensor,
        entry: torch.Tensor,
        entries: torch.Tensor | None,
        scores: torch.Tensor | None,
        out: torch.Tensor,
    ) -> None:
        """The op's body for ``layer`` (``kvgraft.vllm.batched``): the source's writes, then the attention of
        every scheduled token into ``out`` (N, H dv). No metadata (vLLM's profiling and warm-up runs): nothing."""
        metadata = get_forward_context().attn_metadata
        if not isinstance(metadata, dict) or self.cache_layers[(layer, WINDOW)].layer_name not in metadata:
            return

        def ix(at: int, kind: str) -> Any:
            batch = metadata[self.cache_layers[(at, kind)].layer_name].batch
            if batch is None:
                raise ValueError(f"layer {at} {kind}: the metadata builder computed no batched indices")
            return batch

        attn: Any = self.model.layers[layer].self_attn
        if attn.is_source:
            if entries is None:
                raise ValueError(f"layer {layer} writes the shared stream: give its tokens' entries")
            pending = self.cache_layers.get((layer, PENDING))
            compress_step(
                attn.compressor,
                entries,
                scores,
                self.cache_layers[(layer, STREAM)].rows(),
                ix(layer, STREAM),
                None if pending is None else pending.rows(),
                None if pending is None else ix(layer, PENDING),
            )
        src = attn.source
        ctx = current_context()
        kv_b_delta = None  # the requests' adapters on this layer's kv_b (the absorbed stream read applies them)
        if src is not None and isinstance(ctx, VllmStepContext) and isinstance(attn.kv_b_proj, MultiLoraLinear):
            kv_b_delta = attn.kv_b_proj.row_factors(ctx.request_adapters)
        y = ced_attention(
            attn,
            q,
            entry,
            self.cache_layers[(layer, WINDOW)].rows(),
            ix(layer, WINDOW),
            None if src is None else self.cache_layers[(src, STREAM)].rows(),
            None if src is None else ix(src, STREAM),
            kv_b_delta,
        )
        out[: y.shape[0]] = y

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
        use_vllm_cpu_gemm(self.model)  # on the CPU: packed weights, as vLLM's own models (after loading)
        return {n for n, _ in self.named_parameters()}
