"""kvgraft's own checkpoint format as transformers Auto classes.

After ``import kvgraft.hf`` (which calls :func:`register_auto_classes`; ``import kvgraft`` alone stays light and does not import transformers), a directory written by
``kvgraft.hf.save_pretrained(model, dir, model_type="kvgraft")`` loads with
``transformers.AutoConfig.from_pretrained(dir)`` and ``transformers.AutoModelForCausalLM.from_pretrained(dir)``
(MLA grafts, cross-layer sharing, causal encoder-decoders: anything kvgraft's Transformer runs).

The wrapper's state-dict names are the file's: ``model.*`` for kvgraft's Transformer, ``lm_head.weight``
at the top level (absent from the file with tied embeddings). ``save_pretrained`` of the wrapper writes
a directory ``kvgraft.hf.load_pretrained`` reads back.
"""

from __future__ import annotations

import copy
import functools
import json
import sys
from contextlib import contextmanager
from typing import Any

import torch
import transformers
from torch import nn
from transformers import (
    AutoConfig,
    AutoModelForCausalLM,
    ContinuousBatchingConfig,
    GenerationMixin,
    PreTrainedConfig,
    PreTrainedModel,
)
from transformers import initialization as init
from transformers.modeling_outputs import CausalLMOutputWithPast

from kvgraft.errors import ConfigError
from kvgraft.hf.config_map import KVGRAFT_MODEL_TYPE, _kvgraft_config, kvgraft_config_dict
from kvgraft.hf.continuous import continuous_hidden, guard_request_length, is_continuous_batching_call, kvgraft_cb_config
from kvgraft.model.batch import BatchContext
from kvgraft.model.cache import PagedKVCache
from kvgraft.model.ced import Compressor
from kvgraft.model.config import ModelConfig
from kvgraft.model.mla import MLAttention
from kvgraft.model.norm import RMSNorm
from kvgraft.model.rope import RotaryEmbedding, rope_frequencies
from kvgraft.model.sizes import default_block_size
from kvgraft.model.transformer import Transformer
from kvgraft.runtime.engine import Engine
from kvgraft.runtime.options import EngineOptions
from kvgraft.runtime.sampling import SamplingParams

# top-level config.json fields copied from the ModelConfig (kvgraft_config_dict writes the same)
_TOP_LEVEL = (
    "vocab_size",
    "hidden_size",
    "num_hidden_layers",
    "num_attention_heads",
    "max_position_embeddings",
    "tie_word_embeddings",
    "bos_token_id",
    "eos_token_id",
)


class KvgraftConfig(PreTrainedConfig):
    """transformers config of kvgraft's format: the full ModelConfig under ``kvgraft`` (authoritative).

    The top-level fields are copies of the ModelConfig's, refreshed from ``kvgraft`` on construction.
    """

    model_type = KVGRAFT_MODEL_TYPE

    kvgraft: dict[str, Any] | None = None
    kvgraft_format_version: int = 1
    vocab_size: int | None = None
    hidden_size: int | None = None
    num_hidden_layers: int | None = None
    num_attention_heads: int | None = None
    max_position_embeddings: int | None = None
    tie_word_embeddings: bool = False
    bos_token_id: int | None = None
    eos_token_id: int | None = None
    pad_token_id: int | None = None

    def __post_init__(self, **kwargs: Any) -> None:
        if self.kvgraft is not None:
            cfg = _model_config(self.kvgraft)
            self.kvgraft = json.loads(json.dumps(cfg.to_dict()))  # JSON types: what config.json holds
            top = kvgraft_config_dict(cfg)
            for name in _TOP_LEVEL:
                setattr(self, name, top[name])
            self.pad_token_id = cfg.pad_token_id
        super().__post_init__(**kwargs)

    @classmethod
    def from_model_config(cls, cfg: ModelConfig, **kwargs: Any) -> KvgraftConfig:
        """The transformers config of a kvgraft ModelConfig (``kwargs``: other config fields, e.g. dtype)."""
        return cls(kvgraft=cfg.to_dict(), **kwargs)

    @property
    def model_config(self) -> ModelConfig:
        """The kvgraft ModelConfig this config carries."""
        if self.kvgraft is None:
            raise ConfigError(
                "KvgraftConfig has no 'kvgraft' ModelConfig; build it with KvgraftConfig.from_model_config(cfg) "
                "or load a kvgraft checkpoint directory"
            )
        return _model_config(self.kvgraft)


def _model_config(body: Any) -> ModelConfig:
    """The ModelConfig held under ``kvgraft`` (errors are ValueErrors naming the field)."""
    return _kvgraft_config({"kvgraft": body}, "the 'kvgraft' config field")


class KvgraftForCausalLM(PreTrainedModel, GenerationMixin):
    """kvgraft's Transformer as a transformers causal LM (``self.model``), with ``lm_head`` at the top level.

    ``generate`` runs kvgraft's continuous-batching engine over its paged cache (greedy or sampling with
    temperature/top-p, eos and max_new_tokens from the generation config; left- or right-padded prompts
    with an ``attention_mask``); other decoding strategies (beams, ...) are refused by name. It runs the
    wrapper's own modules, so PEFT adapters injected into it (``peft.PeftModel``) decode with their active
    adapter, and ``PeftModel.generate(..., adapter_names=[...])`` routes each row to its adapter.
    ``forward`` accepts a padded ``attention_mask``: each row's real tokens are attended at positions
    0..n-1 of that row, and the logits of padding positions are zero.

    transformers' continuous batching (``generate_batch``, ``transformers serve --continuous-batching``)
    calls ``forward`` with its paged-attention arguments; kvgraft keeps each request's KV in its own paged
    cache instead of transformers' (see :mod:`kvgraft.hf.continuous` for why and what is refused).
    ``attn_implementation`` "eager" (the default) and "sdpa" are accepted and run the same kvgraft
    attention (which calls torch's SDPA where it can); flash and flex implementations are refused.
    """

    config_class = KvgraftConfig
    base_model_prefix = "model"
    _tied_weights_keys = {"lm_head.weight": "model.embed_tokens.weight"}
    _no_split_modules = ["Block"]
    _supports_sdpa = True  # kvgraft's own attention either way (see the class docstring)

    def __init__(self, config: KvgraftConfig) -> None:
        super().__init__(config)
        cfg = config.model_config
        self._init_std = cfg.initializer_range
        self.model = Transformer(cfg)
        # the backbone returns normed hidden states; the head is ours (Transformer declares lm_head a Linear)
        self.model.lm_head = nn.Identity()  # type: ignore[assignment]
        self.lm_head = nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
        self.post_init()

    @torch.no_grad()
    def _init_weights(self, module: nn.Module) -> None:
        """kvgraft's random init (Transformer.init_weights) and RoPE tables; loaded tensors are skipped."""
        std = self._init_std
        if isinstance(module, (nn.Linear, nn.Embedding)):
            init.normal_(module.weight, mean=0.0, std=std)
            if isinstance(module, nn.Linear) and module.bias is not None:
                init.zeros_(module.bias)
        elif isinstance(module, RMSNorm):
            init.ones_(module.weight)
        elif isinstance(module, Compressor) and module.m > 1:
            init.zeros_(module.gate_bias)
        elif isinstance(module, MLAttention) and module.qk_norm:
            init.normal_(module.q_mix, mean=0.0, std=module.q_mix.shape[-1] ** -0.5)
        elif isinstance(module, RotaryEmbedding):  # non-persistent: never in a checkpoint
            inv_freq, _ = rope_frequencies(module.rope, module.dim, module.max_position_embeddings)
            init.copy_(module.inv_freq, inv_freq)

    @classmethod
    def _supports_default_dynamic_cache(cls) -> bool:
        return False  # kvgraft's attention kinds do not fit transformers' caches; see the class docstring

    def prepare_inputs_for_generation(
        self, input_ids: torch.Tensor, attention_mask: torch.Tensor | None = None, **kwargs: Any
    ) -> dict[str, Any]:
        """No cache: each step feeds the whole sequence generated so far."""
        return {"input_ids": input_ids, "attention_mask": attention_mask}

    def forward(
        self,
        input_ids: torch.Tensor | None = None,  # (B, T)
        attention_mask: torch.Tensor | None = None,  # (B, T), all ones
        position_ids: torch.Tensor | None = None,  # (B, T); default 0..T-1
        labels: torch.Tensor | None = None,  # (B, T); shifted inside, -100 ignored
        inputs_embeds: torch.Tensor | None = None,
        return_dict: bool | None = None,
        logits_to_keep: int | torch.Tensor = 0,  # 0: every position; n: the last n; a tensor: those positions
        **kwargs: Any,  # cache / use_cache (ignored: no cache), loss options such as num_items_in_batch,
        # or transformers' continuous-batching arguments (a PagedAttentionCache as `cache`, cu_seq_lens_q, ...)
    ) -> CausalLMOutputWithPast | tuple:
        if inputs_embeds is not None or input_ids is None:
            raise ConfigError("KvgraftForCausalLM needs input_ids; inputs_embeds is not supported")
        if is_continuous_batching_call(kwargs):  # transformers' paged path: rows packed on one axis
            hidden = continuous_hidden(self, self.model, input_ids, dict(kwargs, position_ids=position_ids))
            logits = self.lm_head(_keep(hidden, logits_to_keep))
            out = CausalLMOutputWithPast(logits=logits)
            return out if (return_dict if return_dict is not None else self.config.return_dict) else out.to_tuple()
        if attention_mask is not None and attention_mask.shape != input_ids.shape:
            raise ConfigError(f"attention_mask shape {tuple(attention_mask.shape)} != input_ids shape {tuple(input_ids.shape)}")
        if attention_mask is not None and not bool(attention_mask.all()):
            logits = _keep(self._padded_logits(input_ids, attention_mask.bool()), logits_to_keep)
        else:
            logits = self.lm_head(_keep(self.model(input_ids, positions=position_ids), logits_to_keep))
        loss = None
        if labels is not None:
            loss = self.loss_function(logits=logits, labels=labels, vocab_size=self.config.vocab_size, **kwargs)
        out = CausalLMOutputWithPast(loss=loss, logits=logits)
        return_dict = return_dict if return_dict is not None else self.config.return_dict
        return out if return_dict else out.to_tuple()

    def _padded_logits(self, input_ids: torch.Tensor, keep: torch.Tensor) -> torch.Tensor:
        """Logits (B, T, vocab) of padded rows: the real tokens of each row run as one row of a batch
        context over a throwaway paged cache (rows of different lengths, no padding attended)."""

        lens = keep.sum(dim=1).tolist()
        if min(lens) == 0:
            raise ConfigError("attention_mask has a row with no tokens")
        cfg = self.config.model_config
        bs = default_block_size(cfg)
        cache = PagedKVCache(
            cfg,
            num_blocks=sum(-(-n // bs) for n in lens),
            block_size=bs,
            max_seqs=len(lens),
            max_seq_len=max(lens),
            dtype=self.lm_head.weight.dtype,
            device=input_ids.device,
        )
        ctx = BatchContext(cache, [cache.add_sequence() for _ in lens], lens)
        hidden = self.model(input_ids[keep], ctx=ctx)[0]  # (N, h), rows packed in order
        logits = self.lm_head(hidden)
        out = logits.new_zeros(*input_ids.shape, logits.shape[-1])
        out[keep] = logits
        return out

    @torch.no_grad()
    def generate(
        self,
        input_ids: torch.Tensor | None = None,
        attention_mask: torch.Tensor | None = None,
        generation_config: Any = None,
        **kwargs: Any,
    ) -> torch.Tensor:
        """(B, T + n) ids: each row's prompt (padding kept) then its new tokens, padded with pad_token_id
        (else eos) after a row stops; decoded by kvgraft's engine (``kvgraft.runtime.engine``)."""

        if input_ids is None or input_ids.dim() != 2:
            raise ConfigError("generate needs input_ids of shape (batch, length)")
        gc = copy.deepcopy(generation_config if generation_config is not None else self.generation_config)
        unused = gc.update(**kwargs)
        unused = {k: v for k, v in unused.items() if v is not None and k not in ("use_cache", "return_dict")}
        if unused:
            raise ConfigError(f"KvgraftForCausalLM.generate does not support {sorted(unused)}")
        for name, ok in (("num_beams", 1), ("num_return_sequences", 1)):
            if (getattr(gc, name, None) or 1) != ok:
                raise ConfigError(f"KvgraftForCausalLM.generate supports {name}=1 only, got {getattr(gc, name)}")
        B, T = input_ids.shape
        keep = torch.ones_like(input_ids, dtype=torch.bool) if attention_mask is None else attention_mask.bool()
        prompts = [input_ids[r][keep[r]].tolist() for r in range(B)]
        if any(not p for p in prompts):
            raise ConfigError("attention_mask has a row with no tokens")
        max_new = gc.max_new_tokens if gc.max_new_tokens is not None else max(0, (gc.max_length or T) - T)
        eos = gc.eos_token_id
        eos = () if eos is None else ((eos,) if isinstance(eos, int) else tuple(eos))
        sample = bool(gc.do_sample)
        seeds = torch.randint(0, 2**62, (B,)).tolist() if sample else [None] * B  # follows torch.manual_seed
        params = [
            SamplingParams(
                max_new_tokens=max_new,
                temperature=float(gc.temperature or 1.0) if sample else 0.0,
                top_p=float(gc.top_p or 1.0) if sample else 1.0,
                seed=seeds[r],
                stop_token_ids=eos,
            )
            for r in range(B)
        ]
        if max_new == 0:
            return input_ids.clone()
        total = max(len(p) for p in prompts) + max_new

        bs = default_block_size(self.config.model_config)
        routes = _peft_adapter_names(self)  # PeftModel.generate(..., adapter_names=[...]): a mixed batch
        if routes is not None and len(routes) != B:
            raise ConfigError(f"adapter_names has {len(routes)} entries for {B} rows")
        with _eval_mode(self):
            engine = Engine(
                self.to_kvgraft(),
                EngineOptions(
                    num_blocks=B * -(-total // bs),
                    block_size=bs,
                    max_seqs=B,
                    max_batch_tokens=max(sum(len(p) for p in prompts), 256),
                    max_seq_len=total,
                ),
            )
            outs: list[list[int]]
            if routes is None:
                outs = engine.generate(prompts, params)
            else:  # the rows of each adapter together, that adapter active on PEFT's layers (kvgraft's forward
                # packs rows on one token axis, which PEFT's per-row mixed-batch forward cannot index)
                outs = [[] for _ in range(B)]
                with _peft_hooks_removed(self):
                    for name in dict.fromkeys(routes):
                        rows = [r for r in range(B) if routes[r] == name]
                        with _peft_active(self, name):
                            got = engine.generate([prompts[r] for r in rows], [params[r] for r in rows])
                        for r, o in zip(rows, got):
                            outs[r] = o
        pad = gc.pad_token_id if gc.pad_token_id is not None else (eos[0] if eos else 0)
        width = max(len(o) for o in outs)
        new = torch.tensor([o + [pad] * (width - len(o)) for o in outs], dtype=input_ids.dtype, device=input_ids.device)
        return torch.cat([input_ids, new], dim=1)

    def to_kvgraft(self) -> Transformer:
        """kvgraft's Transformer made of this model's modules (shared, not copied: its parameters, and the
        adapter layers PEFT injected into them, e.g. ``...q_proj.base_layer`` / ``lora_A``), with this model's
        ``lm_head``; in the same mode (changing its mode changes this model's)."""
        with torch.device("meta"):
            model = Transformer(self.config.model_config)
        inner = self.model
        model.embed_tokens, model.layers, model.norm = inner.embed_tokens, inner.layers, inner.norm
        model.rotary = inner.rotary  # non-persistent RoPE tables
        model.lm_head = self.lm_head  # with tied embeddings its weight is the embedding
        model.gradient_checkpointing = inner.gradient_checkpointing
        model.training = self.training
        return model

    def init_continuous_batching(
        self, generation_config: Any = None, continuous_batching_config: Any = None, workload_hints: Any = None
    ) -> Any:
        """transformers' continuous-batching manager for this model, with the settings kvgraft's paged forward
        needs (:func:`kvgraft.hf.continuous.kvgraft_cb_config`: no block sharing, CPU offload, CUDA graphs,
        compile or async batching); ``num_return_sequences > 1`` (forked requests) is refused, and so is, at
        ``add_request``, a request whose prompt + max_new_tokens exceeds ``max_position_embeddings``."""

        gen = generation_config if generation_config is not None else self.generation_config
        if (getattr(gen, "num_return_sequences", None) or 1) != 1:
            raise ConfigError(
                "KvgraftForCausalLM under continuous batching supports num_return_sequences=1 only "
                "(a forked request would start mid-sequence with no kvgraft state)"
            )
        cb = continuous_batching_config
        if cb is None:
            cb = getattr(gen, "continuous_batching_config", None)
            cb = cb if isinstance(cb, ContinuousBatchingConfig) else ContinuousBatchingConfig()
        manager = super().init_continuous_batching(
            generation_config=generation_config, continuous_batching_config=kvgraft_cb_config(cb), workload_hints=workload_hints
        )
        guard_request_length(manager, self.config.model_config.max_position_embeddings)
        return manager


def _keep(hidden: torch.Tensor, logits_to_keep: int | torch.Tensor) -> torch.Tensor:
    """``hidden`` (B, T, ...) at the positions transformers' ``logits_to_keep`` names (0: all)."""
    if isinstance(logits_to_keep, torch.Tensor):
        return hidden[:, logits_to_keep.long()]
    return hidden[:, -logits_to_keep:] if logits_to_keep else hidden


def _lora_layers(model: nn.Module) -> list[Any]:
    """PEFT's LoRA layers inside ``model`` (empty without PEFT)."""
    lora = sys.modules.get("peft.tuners.lora")  # PEFT wrapped this model only if PEFT is imported already
    if lora is None:
        return []
    return [m for m in model.modules() if isinstance(m, lora.LoraLayer)]


def _adapter_name_hooks(model: nn.Module) -> list[tuple[nn.Module, int, Any]]:
    """(module, hook id, hook) of the pre-forward hooks ``PeftModel.generate(adapter_names=...)`` registers."""
    out = []
    for m in model.modules():
        for hid, hook in m._forward_pre_hooks.items():
            if isinstance(hook, functools.partial) and "adapter_names" in (hook.keywords or {}):
                out.append((m, hid, hook))
    return out


def _peft_adapter_names(model: nn.Module) -> list[str] | None:
    """Each row's adapter name of a PEFT mixed-adapter ``generate`` (``"__base__"``: none), else None."""
    hooks = _adapter_name_hooks(model)
    return list(hooks[0][2].keywords["adapter_names"]) if hooks else None


@contextmanager
def _peft_hooks_removed(model: nn.Module):
    """Without PEFT's adapter_names pre-forward hooks (put back after)."""
    hooks = _adapter_name_hooks(model)
    kw = {(id(m), hid): hid in m._forward_pre_hooks_with_kwargs for m, hid, _ in hooks}
    for m, hid, _ in hooks:
        del m._forward_pre_hooks[hid]
        m._forward_pre_hooks_with_kwargs.pop(hid, None)
    try:
        yield
    finally:
        for m, hid, hook in hooks:
            m._forward_pre_hooks[hid] = hook
            if kw[(id(m), hid)]:
                m._forward_pre_hooks_with_kwargs[hid] = True


@contextmanager
def _peft_active(model: nn.Module, name: str):
    """Every PEFT LoRA layer runs adapter ``name`` alone (``"__base__"``: no adapter), without touching which
    parameters train; restored after."""
    layers = _lora_layers(model)
    saved = [(m._active_adapter, m._disable_adapters) for m in layers]
    try:
        for m in layers:
            m._disable_adapters = name == "__base__"
            if name != "__base__":
                m._active_adapter = [name]
        yield
    finally:
        for m, (active, disabled) in zip(layers, saved):
            m._active_adapter, m._disable_adapters = active, disabled


@contextmanager
def _eval_mode(model: nn.Module):
    """``model`` in eval mode, its previous modes restored after (generate must not leave a training model in
    eval mode: to_kvgraft shares its modules)."""
    modes = [(m, m.training) for m in model.modules()]
    model.eval()
    try:
        yield
    finally:
        for m, was in modes:
            m.training = was


_registered = False


def register_auto_classes() -> None:
    """Register KvgraftConfig and KvgraftForCausalLM for model_type "kvgraft" (once; later calls do nothing).

    Both are also set as attributes of the ``transformers`` module (where absent): ``transformers serve``
    finds a checkpoint's class as ``getattr(transformers, config.architectures[0])``."""
    global _registered
    if _registered:
        return

    AutoConfig.register(KVGRAFT_MODEL_TYPE, KvgraftConfig, exist_ok=True)
    AutoModelForCausalLM.register(KvgraftConfig, KvgraftForCausalLM, exist_ok=True)
    for cls in (KvgraftConfig, KvgraftForCausalLM):
        if getattr(transformers, cls.__name__, None) is None:
            setattr(transformers, cls.__name__, cls)
    _registered = True


__all__ = ["KvgraftConfig", "KvgraftForCausalLM", "register_auto_classes"]
