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

import json
from typing import Any

import torch
from torch import nn
from transformers import AutoConfig, AutoModelForCausalLM, GenerationMixin, PreTrainedConfig, PreTrainedModel
from transformers import initialization as init
from transformers.modeling_outputs import CausalLMOutputWithPast

from kvgraft.hf.config_map import KVGRAFT_MODEL_TYPE, _kvgraft_config, kvgraft_config_dict
from kvgraft.model.ced import Compressor
from kvgraft.model.config import ModelConfig
from kvgraft.model.mla import MLAttention
from kvgraft.model.norm import RMSNorm
from kvgraft.model.rope import RotaryEmbedding, rope_frequencies
from kvgraft.model.transformer import Transformer

# top-level config.json fields copied from the ModelConfig (kvgraft_config_dict writes the same)
_TOP_LEVEL = ("vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads", "max_position_embeddings",
              "tie_word_embeddings", "bos_token_id", "eos_token_id")


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
            raise ValueError(
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
    with an ``attention_mask``); other decoding strategies (beams, ...) are refused by name.
    ``forward`` accepts a padded ``attention_mask``: each row's real tokens are attended at positions
    0..n-1 of that row, and the logits of padding positions are zero.
    """

    config_class = KvgraftConfig
    base_model_prefix = "model"
    _tied_weights_keys = {"lm_head.weight": "model.embed_tokens.weight"}
    _no_split_modules = ["Block"]

    def __init__(self, config: KvgraftConfig) -> None:
        super().__init__(config)
        cfg = config.model_config
        self._init_std = cfg.initializer_range
        self.model = Transformer(cfg)
        self.model.lm_head = nn.Identity()  # the backbone returns normed hidden states; the head is ours
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
        **kwargs: Any,  # cache / use_cache (ignored: no cache), loss options such as num_items_in_batch
    ) -> CausalLMOutputWithPast | tuple:
        if inputs_embeds is not None or input_ids is None:
            raise ValueError("KvgraftForCausalLM needs input_ids; inputs_embeds is not supported")
        if attention_mask is not None and attention_mask.shape != input_ids.shape:
            raise ValueError(f"attention_mask shape {tuple(attention_mask.shape)} != input_ids shape "
                             f"{tuple(input_ids.shape)}")
        if attention_mask is not None and not bool(attention_mask.all()):
            logits = self._padded_logits(input_ids, attention_mask.bool())
        else:
            logits = self.lm_head(self.model(input_ids, positions=position_ids))
        loss = None
        if labels is not None:
            loss = self.loss_function(logits=logits, labels=labels, vocab_size=self.config.vocab_size, **kwargs)
        out = CausalLMOutputWithPast(loss=loss, logits=logits)
        return_dict = return_dict if return_dict is not None else self.config.return_dict
        return out if return_dict else out.to_tuple()

    def _padded_logits(self, input_ids: torch.Tensor, keep: torch.Tensor) -> torch.Tensor:
        """Logits (B, T, vocab) of padded rows: the real tokens of each row run as one row of a batch
        context over a throwaway paged cache (rows of different lengths, no padding attended)."""
        from kvgraft.model.batch import BatchContext
        from kvgraft.model.cache import PagedKVCache, default_block_size

        lens = keep.sum(dim=1).tolist()
        if min(lens) == 0:
            raise ValueError("attention_mask has a row with no tokens")
        cfg = self.config.model_config
        bs = default_block_size(cfg)
        cache = PagedKVCache(cfg, num_blocks=sum(-(-n // bs) for n in lens), block_size=bs, max_seqs=len(lens),
                             max_seq_len=max(lens), dtype=self.lm_head.weight.dtype, device=input_ids.device)
        ctx = BatchContext(cache, [cache.add_sequence() for _ in lens], lens)
        hidden = self.model(input_ids[keep], ctx=ctx)[0]  # (N, h), rows packed in order
        logits = self.lm_head(hidden)
        out = logits.new_zeros(*input_ids.shape, logits.shape[-1])
        out[keep] = logits
        return out

    @torch.no_grad()
    def generate(self, input_ids: torch.Tensor | None = None, attention_mask: torch.Tensor | None = None,
                 generation_config: Any = None, **kwargs: Any) -> torch.Tensor:
        """(B, T + n) ids: each row's prompt (padding kept) then its new tokens, padded with pad_token_id
        (else eos) after a row stops; decoded by kvgraft's engine (``kvgraft.serve.engine``)."""
        import copy

        from kvgraft.serve.engine import Engine
        from kvgraft.serve.sampling import SamplingParams

        if input_ids is None or input_ids.dim() != 2:
            raise ValueError("generate needs input_ids of shape (batch, length)")
        gc = copy.deepcopy(generation_config if generation_config is not None else self.generation_config)
        unused = gc.update(**kwargs)
        unused = {k: v for k, v in unused.items() if v is not None and k not in ("use_cache", "return_dict")}
        if unused:
            raise ValueError(f"KvgraftForCausalLM.generate does not support {sorted(unused)}")
        for name, ok in (("num_beams", 1), ("num_return_sequences", 1)):
            if (getattr(gc, name, None) or 1) != ok:
                raise ValueError(f"KvgraftForCausalLM.generate supports {name}=1 only, got {getattr(gc, name)}")
        B, T = input_ids.shape
        keep = torch.ones_like(input_ids, dtype=torch.bool) if attention_mask is None else attention_mask.bool()
        prompts = [input_ids[r][keep[r]].tolist() for r in range(B)]
        if any(not p for p in prompts):
            raise ValueError("attention_mask has a row with no tokens")
        max_new = gc.max_new_tokens if gc.max_new_tokens is not None else max(0, (gc.max_length or T) - T)
        eos = gc.eos_token_id
        eos = () if eos is None else ((eos,) if isinstance(eos, int) else tuple(eos))
        sample = bool(gc.do_sample)
        seeds = torch.randint(0, 2**62, (B,)).tolist() if sample else [None] * B  # follows torch.manual_seed
        params = [SamplingParams(max_new_tokens=max_new, temperature=float(gc.temperature or 1.0) if sample else 0.0,
                                 top_p=float(gc.top_p or 1.0) if sample else 1.0, seed=seeds[r],
                                 stop_token_ids=eos) for r in range(B)]
        if max_new == 0:
            return input_ids.clone()
        total = max(len(p) for p in prompts) + max_new
        from kvgraft.model.cache import default_block_size

        bs = default_block_size(self.config.model_config)
        engine = Engine(self.to_kvgraft().eval(), num_blocks=B * -(-total // bs), block_size=bs, max_seqs=B,
                        max_batch_tokens=max(sum(len(p) for p in prompts), 256), max_seq_len=total)
        outs = engine.generate(prompts, params)
        pad = gc.pad_token_id if gc.pad_token_id is not None else (eos[0] if eos else 0)
        width = max(len(o) for o in outs)
        new = torch.tensor([o + [pad] * (width - len(o)) for o in outs], dtype=input_ids.dtype, device=input_ids.device)
        return torch.cat([input_ids, new], dim=1)

    def to_kvgraft(self) -> Transformer:
        """kvgraft's Transformer holding this model's parameters (shared, not copied), in the same mode."""
        with torch.device("meta"):
            model = Transformer(self.config.model_config)
        # keep_vars: the Parameters themselves; with tied embeddings lm_head.weight is the embedding
        state = {k.removeprefix("model."): v for k, v in self.state_dict(keep_vars=True).items()}
        model.load_state_dict(state, strict=True, assign=True)
        model.rotary = self.model.rotary  # non-persistent RoPE tables
        return model.train(self.training)


_registered = False


def register_auto_classes() -> None:
    """Register KvgraftConfig and KvgraftForCausalLM for model_type "kvgraft" (once; later calls do nothing)."""
    global _registered
    if _registered:
        return
    AutoConfig.register(KVGRAFT_MODEL_TYPE, KvgraftConfig, exist_ok=True)
    AutoModelForCausalLM.register(KvgraftConfig, KvgraftForCausalLM, exist_ok=True)
    _registered = True


__all__ = ["KvgraftConfig", "KvgraftForCausalLM", "register_auto_classes"]
