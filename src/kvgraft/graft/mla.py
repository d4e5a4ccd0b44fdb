"""Graft MLA onto a loaded Llama-family model: calibration, per-layer conversion, the new model.

``graft_mla(model, GraftConfig(...), calibration_tokens)`` returns a new ``Transformer`` whose chosen
layers use latent attention (``attention_kinds[l] == "mla"``); everything else (embeddings, MLP, norms,
unconverted layers) is copied unchanged. Per-layer math lives in ``mla_math``; the per-layer work (statistics,
factorisation, propagation) is :class:`LayerGraft`'s, which ``graft_mla`` runs over a model in memory and
``kvgraft.graft.layerwise`` over blocks read from a checkpoint one at a time.

Layer-wise calibration (default): layer l is calibrated on the attention inputs that the already
converted layers 0..l-1 produce, so each layer corrects for the error of those below it.
"""

from __future__ import annotations

import time
import warnings
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, cast

import torch
from torch import nn
from tqdm.auto import tqdm

from kvgraft.checks import check_number
from kvgraft.errors import ConfigError
from kvgraft.graft import layer_stats
from kvgraft.graft.layer_stats import gqa
from kvgraft.graft.mla_math import (
    ROPE_ROTATIONS,
    GQAWeights,
    LayerSpec,
    MLAWeights,
    convert_layer,
    head_rotations,
    pair_scores,
    shared_rope_pairs,
)
from kvgraft.graft.refine import RefineConfig, RefineResult, refine_attention
from kvgraft.model import ModelConfig, Transformer
from kvgraft.model.fields import known
from kvgraft.model.mla import MLAttention
from kvgraft.model.rope import RotaryEmbedding
from kvgraft.model.transformer import Block, GQAttention

OBJECTIVES = ("weights", "activations", "attention")
ROPE_SELECTIONS = ("stride", "norm", "shared", "prefix")
QK_NORMS = ("keep", "linearise")
# The calibration stream's last sequences are run one at a time (the rest in batches): exactly as
# ``kvgraft convert`` runs its calibration tail (``kvgraft.graft.record.TAIL_SEQUENCES``, the same number), so
# the layer-by-layer executor reads the tail's converted-stack states off the stream instead of running them
# again. 0: every sequence in batches (what the graft did before; for side-by-side timings).
TAIL_ROWS = 8


@dataclass(frozen=True)
class GraftConfig:
    """How to convert. ``kv_lora_rank`` is d_c; ``qk_rope_head_dim`` the shared RoPE key width."""

    kv_lora_rank: int
    qk_rope_head_dim: int
    objective: str = "activations"  # weights | activations | attention
    # stride (stock DeepSeek-V3 exportable) | norm (per layer, kvgraft format) | shared (by measured
    # contribution, one frequency layout for all layers: what a causal encoder-decoder needs) | prefix (the
    # principal rotated head at the d_rope/2 fastest frequencies; stock DeepSeek-V3 could hold it with
    # rope_theta^(d_rope/head_dim), which the exporter does not write yet)
    rope_selection: str = "stride"
    layerwise: bool = True  # calibrate each layer on the converted layers' activations
    balance_kv: bool = True
    # Pairs that lose RoPE keep their expected rotation E[R(delta)] under the layer's measured
    # attention-distance profile instead of none (identity); needs calibration text.
    rope_expectation: bool = True
    layers: tuple[int, ...] | None = None  # progressive grafting: convert only these (default all)
    # Per-head q/k RMSNorms (Qwen3): the key norm is always replaced by its least-squares linear fit (no
    # linear latent can reproduce it); "keep" keeps the query norm (q_norm + a per-head map q_mix),
    # "linearise" fits it too, so the result has no norms inside attention (what the share graft needs).
    qk_norm: str = "keep"
    # Shrink each layer's calibration second moment toward the weights-only fit's isotropic one,
    # C <- (1 - s) C + s (tr C / h) I, before the factorisation (0: the calibrated fit as measured,
    # 1: weights only in the activations' scale). Guards the fit against text unlike the calibration's;
    # 0.5 measured best on held-out and out-of-domain text, both formats (bench/mla_ood.py, RESULTS.md).
    calibration_shrinkage: float = 0.5
    # How the KV heads' RoPE pairs are mixed per frequency before the kept pairs are chosen: "real"
    # (orthogonal, PCA of the key energy) or "complex" (unitary: the kept rotated head is the best rank-1
    # complex fit of the heads' pair, a per-head phase folded into the queries; mla_math.head_rotations).
    # "complex" measured better in both formats, in and out of domain (bench/mla_ood.py, RESULTS.md); kvgraft
    # convert --to ced keeps "real" for the share graft, where it is unmeasured.
    rope_rotation: str = "complex"
    # Local refinement after each layer's factorisation (kvgraft.graft.refine): epochs of Adam on the converted
    # attention alone against the original stack's residual stream on the calibration text (0: none), at this LR.
    refine_epochs: int = 0
    refine_lr: float = 1e-3
    # An RMSNorm on the latent before it is cached, as DeepSeek-V3 always has (kv_a_layernorm): the converted
    # model then computes exactly what a stock DeepSeek-V3 export of it computes. Initialised to the latent's
    # mean rms on the calibration text (so it starts as the closest constant scale), then refined through.
    latent_norm: bool = False

    def __post_init__(self) -> None:
        RefineConfig(epochs=self.refine_epochs, lr=self.refine_lr)  # validates both
        if self.kv_lora_rank <= 0:
            raise ConfigError(f"kv_lora_rank ({self.kv_lora_rank}) must be a positive integer")
        if self.qk_rope_head_dim <= 0 or self.qk_rope_head_dim % 2:
            raise ConfigError(f"qk_rope_head_dim ({self.qk_rope_head_dim}) must be a positive even integer")
        if self.objective not in OBJECTIVES:
            raise ConfigError(f"objective {self.objective!r} is not one of {', '.join(OBJECTIVES)}")
        if self.rope_selection not in ROPE_SELECTIONS:
            raise ConfigError(f"rope_selection {self.rope_selection!r} is not one of {', '.join(ROPE_SELECTIONS)}")
        if self.rope_rotation not in ROPE_ROTATIONS:
            raise ConfigError(f"rope_rotation {self.rope_rotation!r} is not one of {', '.join(ROPE_ROTATIONS)}")
        if self.qk_norm not in QK_NORMS:
            raise ConfigError(f"qk_norm {self.qk_norm!r} is not one of {', '.join(QK_NORMS)}")
        check_number("calibration_shrinkage", self.calibration_shrinkage, low=0, high=1)

    def check_against(self, config: ModelConfig) -> None:
        """Raise ValueError naming the value when this graft cannot apply to ``config``."""
        layers = self.layers if self.layers is not None else tuple(range(config.num_layers))
        bad = [layer for layer in layers if not 0 <= layer < config.num_layers]
        if bad:
            raise ConfigError(f"layers {bad} out of range for a {config.num_layers}-layer model")
        kinds, head_dim = known(config.attention_kinds, "attention_kinds"), known(config.head_dim, "head_dim")
        if any(kinds[layer] != "gqa" for layer in layers):
            raise ConfigError("only GQA/MHA layers can be grafted; some chosen layers are already MLA")
        full_rope = config.num_kv_heads * head_dim
        if self.qk_rope_head_dim > full_rope:
            raise ConfigError(
                f"qk_rope_head_dim ({self.qk_rope_head_dim}) exceeds the model's RoPE key width "
                f"num_kv_heads x head_dim = {full_rope}"
            )
        if self.kv_lora_rank > 2 * config.num_kv_heads * head_dim:
            raise ConfigError(
                f"kv_lora_rank ({self.kv_lora_rank}) exceeds the model's KV width 2 x num_kv_heads x head_dim = {config.kv_width}"
            )
        if config.num_slots != config.num_layers:
            raise ConfigError("models with cross-layer KV sharing cannot be grafted")
        if config.qk_norm and self.qk_norm == "linearise" and len(set(layers)) != config.num_layers:
            raise ConfigError(
                "qk_norm 'linearise' removes the q/k norms from the whole model, so every layer must be converted (layers=None)"
            )


def mla_model_config(config: ModelConfig, g: GraftConfig, rope_index: dict[int, tuple[int, ...]]) -> ModelConfig:
    """The config of ``config``'s model grafted by ``g``, the layers' RoPE frequencies ``rope_index``
    (layer -> frequency index per kept pair; other layers: none)."""
    layers = g.layers if g.layers is not None else tuple(range(config.num_layers))
    kinds = tuple("mla" if i in layers else k for i, k in enumerate(known(config.attention_kinds, "attention_kinds")))
    return config.replace(
        mla_latent_norm=config.mla_latent_norm or g.latent_norm,
        qk_norm=config.qk_norm and g.qk_norm != "linearise",
        attention_kinds=kinds,
        kv_lora_rank=g.kv_lora_rank,
        qk_rope_head_dim=g.qk_rope_head_dim,
        qk_nope_head_dim=config.head_dim,
        v_head_dim=config.head_dim,
        rope_freq_index=tuple(rope_index.get(i, ()) for i in range(config.num_layers)),
    )


def _block(model: Transformer, layer: int) -> Block:
    return cast(Block, model.layers[layer])


def _gqa_weights(attn: GQAttention) -> GQAWeights:
    """The layer's weights on the CPU: the per-layer conversion math runs there, in fp64."""

    def b(lin: nn.Linear) -> torch.Tensor | None:
        return None if lin.bias is None else lin.bias.detach().cpu()

    return GQAWeights(
        attn.q_proj.weight.detach().cpu(),
        attn.k_proj.weight.detach().cpu(),
        attn.v_proj.weight.detach().cpu(),
        attn.o_proj.weight.detach().cpu(),
        b(attn.q_proj),
        b(attn.k_proj),
        b(attn.v_proj),
        b(attn.o_proj),
    )


class LayerGraft:
    """The MLA graft as a walk up the layers, one original block at a time: the one implementation of the
    graft's per-layer work, run by ``graft_mla`` (a model in memory) and by the layer-by-layer executor of
    ``kvgraft convert`` (``kvgraft.graft.layerwise``, blocks read from the checkpoint one at a time).

    ``hidden``: the calibration tokens' embeddings (N, T, h), fp32, on the device the blocks are on (None for
    objective "weights"); ``rotary`` the model's RoPE. For each layer up to ``last`` in order, ``step(layer,
    block)`` takes the statistics of a chosen layer, factorises it (``convert_layer``, fp64) into
    ``converted[layer]`` and advances the calibration stream(s) past the layer. Memory: the streams (one or
    two N x T x h fp32 tensors, two while a layer is run) and what the caller holds of the model.
    ``clock``: seconds per phase ("statistics", "factorisation", "propagation"), added to.
    """

    def __init__(
        self,
        config: ModelConfig,
        g: GraftConfig,
        rotary: RotaryEmbedding,
        hidden: torch.Tensor | None,
        batch_size: int = 8,
        clock: dict[str, float] | None = None,
    ) -> None:
        g.check_against(config)
        if g.objective != "weights" and hidden is None:
            raise ConfigError(f"objective {g.objective!r} needs calibration tokens (or use objective='weights')")
        self.config, self.g, self.rotary, self.batch_size = config, g, rotary, batch_size
        self.clock = clock if clock is not None else {}
        self.refined: dict[int, RefineResult] = {}
        for key in ("statistics", "factorisation", "propagation", "refinement"):
            self.clock.setdefault(key, 0.0)
        self.layers = set(g.layers if g.layers is not None else range(config.num_layers))
        self.last = max(self.layers)  # nothing above the last converted layer is read: the walk stops there
        self.converted: dict[int, MLAWeights] = {}
        self.rope_index: dict[int, tuple[int, ...]] = {}
        self.shared_pairs: dict[int, list[tuple[int, int]]] = {}  # rope selection "shared": set by the caller
        self.device = rotary.inv_freq.device
        # the per-layer fp64 math runs where the model is when that is an accelerator, else on the CPU
        self.math_device: torch.device | None = self.device if self.device.type == "cuda" else None
        # Activations flow layer by layer through the original (x_orig) and converted (x_new) stacks.
        self.x_new: torch.Tensor | None = None
        self.x_orig: torch.Tensor | None = None
        if hidden is not None:
            self.x_orig = hidden.float()
            self.x_new = self.x_orig.clone()
            self.cos, self.sin = rope_tables(rotary, hidden.shape[0], hidden.shape[1])

    def step(self, layer: int, block: Block) -> Block | None:
        """Graft ``layer`` (``block``: the original) when it is chosen, then advance the stream(s) past it.
        Returns the converted block when one was built to advance the stream (else None)."""
        self.convert(layer, block)
        return self.advance(layer, block)

    def convert(self, layer: int, block: Block) -> None:
        """Statistics and factorisation of ``layer`` into ``converted[layer]`` (nothing for a layer not chosen)."""
        g, config, clock, bs = self.g, self.config, self.clock, self.batch_size
        C = None
        source = None  # the stream layer statistics are taken on
        t0 = time.perf_counter()
        if layer not in self.layers:
            return
        if self.x_new is not None:  # statistics only where a layer is converted
            source = self.x_new if g.layerwise else self.x_orig
            assert source is not None  # both streams start with calibration; the one read is kept going
            C = layer_stats.second_moment(block.input_layernorm, source, bs)
        weights = _gqa_weights(gqa(block))
        q_norm = None
        if config.qk_norm:  # Qwen3: linearise the key norm; keep the query norm or linearise it too
            weights.k = layer_stats.linearised_keys(block, source, C, bs)
            if weights.k_bias is not None:  # the fitted map already accounts for it (no intercept kept)
                weights.k_bias = torch.zeros_like(weights.k_bias)
            if g.qk_norm == "linearise":
                weights.q = layer_stats.linearised(block, "q", source, C, bs)
                if weights.q_bias is not None:
                    weights.q_bias = torch.zeros_like(weights.q_bias)
            else:
                q_norm = gqa(block).q_norm.weight.detach().cpu()
        expectation = None
        if g.rope_expectation and source is not None:
            profile = layer_stats.distance_profile(block, source, self.cos, self.sin, bs)
            expectation = layer_stats.rope_expectation(profile, self.rotary.inv_freq.double().cpu())
        t1 = time.perf_counter()
        clock["statistics"] += t1 - t0
        spec = LayerSpec(
            num_heads=config.num_heads,
            num_kv_heads=config.num_kv_heads,
            head_dim=known(config.head_dim, "head_dim"),
            kv_lora_rank=g.kv_lora_rank,
            d_rope=g.qk_rope_head_dim,
            objective=g.objective,
            rope_selection=g.rope_selection,
            balance_kv=g.balance_kv,
            rope_attention_scaling=self.rotary.attention_scaling,
            rope_rotation=g.rope_rotation,
        )
        layer_args: dict[str, Any] = {
            "C": layer_stats.shrink_second_moment(C, g.calibration_shrinkage),
            "q_norm_weight": q_norm,
            "rope_expectation": expectation,
            "pairs": self.shared_pairs.get(layer),
        }
        mla = None
        if self.math_device is not None:  # fp64 on the GPU: the O(rows x h^2) products and the eigh take seconds there
            try:
                mla = convert_layer(weights, spec, device=self.math_device, **layer_args)
            except RuntimeError as exc:  # e.g. no fp64 solver on this device: the CPU path always works
                warnings.warn(
                    f"layer {layer}: the factorisation failed on {self.math_device} ({exc}); running it on the CPU", stacklevel=3
                )
                self.math_device = None
        if mla is None:
            mla = convert_layer(weights, spec, **layer_args)
        if g.latent_norm:
            mla.kv_a_norm = _latent_norm_init(block, mla, g.kv_lora_rank, source, config.rms_norm_eps, bs)
        self.converted[layer] = mla
        self.rope_index[layer] = mla.rope_freq_index
        clock["factorisation"] += time.perf_counter() - t1
        if g.refine_epochs and self.x_new is not None and self.x_orig is not None:
            t2 = time.perf_counter()
            built = self.converted_block(layer, block)
            cfg = RefineConfig(epochs=g.refine_epochs, lr=g.refine_lr, holdout=TAIL_ROWS)
            self.refined[layer] = refine_attention(block, built, self.x_orig, self.x_new, self.cos, self.sin, cfg, seed=layer)
            self.converted[layer] = _mla_weights(cast(MLAttention, built.self_attn), mla)
            clock["refinement"] += time.perf_counter() - t2

    def converted_block(self, layer: int, block: Block) -> Block:
        """The converted ``layer``: an MLA attention (``converted[layer]``, in the block's dtype) between
        ``block``'s own norms and MLP (shared, not copied)."""
        g = self.g
        cfg = mla_model_config(
            self.config,
            GraftConfig(g.kv_lora_rank, g.qk_rope_head_dim, layers=(layer,), qk_norm=g.qk_norm, latent_norm=g.latent_norm),
            {layer: self.rope_index[layer]},
        )
        return _build_block(cfg, layer, block, self.converted[layer], self.device)

    def advance(self, layer: int, block: Block) -> Block | None:
        """Run the stream(s) past ``layer``; the converted stream through a one-layer MLA stand-in (returned).
        Layer-wise calibration reads only the converted stream, so the original one is not run then; nothing
        runs past the last converted layer (its output is never read)."""
        g, bs = self.g, self.batch_size
        t2 = time.perf_counter()
        built = None
        if self.x_new is not None and layer < self.last:
            assert g.layerwise or self.x_orig is not None
            x_orig = self.x_orig
            tail = TAIL_ROWS
            keep_orig = not g.layerwise or g.refine_epochs > 0  # refinement's targets come from the original stack
            x_orig_next = (
                None if x_orig is None or not keep_orig else layer_stats.run_block(block, x_orig, self.cos, self.sin, bs, tail)
            )
            if g.layerwise and layer in self.layers:
                built = self.converted_block(layer, block)
                self.x_new = layer_stats.run_block(built, self.x_new, self.cos, self.sin, bs, tail)
            elif g.layerwise:
                self.x_new = layer_stats.run_block(block, self.x_new, self.cos, self.sin, bs, tail)
            else:
                self.x_new = x_orig_next
            self.x_orig = x_orig_next
        self.clock["propagation"] += time.perf_counter() - t2
        return built

    def refinement_record(self) -> dict[str, Any] | None:
        """What the local refinement did, for ``conversion.json`` (None when it did not run): per layer the
        relative residual-stream error on the held-out calibration tail before and after, and the steps."""
        if not self.refined:
            return None
        return {
            "epochs": self.g.refine_epochs,
            "lr": self.g.refine_lr,
            "layers": {str(k): {"before": r.before, "after": r.after, "steps": r.steps} for k, r in sorted(self.refined.items())},
        }

    def model_config(self) -> ModelConfig:
        """The grafted model's config (every converted layer's RoPE layout known once the walk is done)."""
        return mla_model_config(self.config, self.g, self.rope_index)


def rope_tables(rotary: RotaryEmbedding, sequences: int, seq_len: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(cos, sin) fp32 for ``sequences`` rows at positions 0..seq_len-1 (what a cache-free forward uses)."""
    device = rotary.inv_freq.device
    positions = torch.arange(seq_len, device=device).expand(sequences, seq_len)
    cos, sin = rotary(positions, torch.float32)
    return cos, sin


def layer_progress(total: int, progress: bool, desc: str = "graft MLA") -> Any:
    """The one progress bar over layers (tqdm: the elapsed and estimated remaining time)."""
    return tqdm(range(total), desc=desc, unit="layer", disable=not progress)


def layer_postfix(bar: Any, seconds: float, clock: dict[str, float]) -> None:
    """The bar's postfix: the layer just done's seconds, then the seconds per phase so far."""
    bar.set_postfix_str(f"layer {seconds:.1f} s, " + ", ".join(f"{k} {v:.0f} s" for k, v in clock.items()), refresh=False)


@torch.no_grad()
def graft_mla(
    model: Transformer,
    g: GraftConfig,
    calibration: torch.Tensor | None = None,  # (N, T) token ids; needed unless objective == "weights"
    batch_size: int = 8,
    progress: bool = True,
    timings: dict[str, float] | None = None,
    refinement: dict[str, Any] | None = None,
) -> Transformer:
    """Return a new model with the chosen layers converted to MLA (``model`` is left untouched).

    ``timings``: a dict that receives the seconds spent in each phase: "statistics" (calibration second
    moments, attention-distance profiles, RoPE pair scores: forward work over the calibration tokens),
    "factorisation" (the per-layer fp64 math of ``convert_layer``, independent of the number of calibration
    tokens) and "propagation" (running the converted layers, and the original ones unless layer-wise, over
    the calibration tokens). On a CUDA model the per-layer math runs on its GPU (fp64), else on the CPU.
    The per-layer work is :class:`LayerGraft`'s. ``refinement``: a dict that receives the local refinement's
    record (``LayerGraft.refinement_record``) when ``g.refine_epochs`` > 0.
    """
    device = model.embed_tokens.weight.device
    hidden = None if calibration is None else model.embed_tokens(calibration.to(device))
    run = LayerGraft(model.config, g, model.rotary, hidden, batch_size, timings)
    del hidden
    if g.rope_selection == "shared":
        t0 = time.perf_counter()
        run.shared_pairs = _shared_pairs(
            model.config,
            lambda layer: _block(model, layer),
            model.embed_tokens.weight,
            model.rotary,
            g,
            sorted(run.layers),
            calibration,
            batch_size,
            progress,
        )
        run.clock["statistics"] += time.perf_counter() - t0
    bar = layer_progress(run.last + 1, progress)
    for layer in bar:
        t = time.perf_counter()
        run.step(layer, _block(model, layer))
        if progress:
            layer_postfix(bar, time.perf_counter() - t, run.clock)
    if refinement is not None and run.refinement_record() is not None:
        refinement.update(cast(dict[str, Any], run.refinement_record()))
    new_config = run.model_config()
    new = _uninitialised_like(model, new_config, device)
    state = {k: v for k, v in model.state_dict().items()}
    new_state = new.state_dict()
    for key in new_state:
        layer = int(key.split(".")[1]) if key.startswith("layers.") else None
        if layer in run.converted and ".self_attn." in key:
            continue
        new_state[key] = state[key]
    new.load_state_dict(new_state)
    for layer, mla in run.converted.items():
        attn = cast(MLAttention, _block(new, layer).self_attn)
        _reset_attention(attn)
        _load_mla(attn, mla)
    return new


def _uninitialised_like(model: Transformer, config: ModelConfig, device: torch.device) -> Transformer:
    """``Transformer(config)`` on ``device`` without its random initialisation (built on the meta device,
    then allocated there): every persistent tensor is about to be overwritten, and the non-persistent
    buffers (RoPE's inv_freq) are taken from ``model``, whose RoPE the new model shares. Random init of a
    1B model costs ~10 s on one CPU thread, and building on the CPU first would hold an 8B model twice."""
    with torch.device("meta"):
        new = Transformer(config)
    new = new.to_empty(device=device)
    if config.tie_word_embeddings:  # to_empty gives each module its own tensor; tie them again
        new.lm_head.weight = new.embed_tokens.weight
    persistent = set(new.state_dict())
    old_buffers = dict(model.named_buffers())
    for name, buf in new.named_buffers():
        if name in persistent:
            continue
        old = old_buffers.get(name)
        if old is None or old.shape != buf.shape:  # nothing to copy it from: build the model the slow way
            return Transformer(config).to(device)
        buf.copy_(old)
    return new


def _reset_attention(attn: nn.Module) -> None:
    """Zero every parameter of a freshly allocated (uninitialised) attention module, norms to one: what
    ``_load_mla`` does not write then holds what a constructed module would (zero bias, unit norm)."""
    for name, p in attn.named_parameters():
        p.detach().fill_(1.0 if name.endswith("norm.weight") else 0.0)


def _shared_pairs(
    config: ModelConfig,
    block_at: Callable[[int], Block],
    embed_weight: torch.Tensor,
    rotary: RotaryEmbedding,
    g: GraftConfig,
    layers: list[int],
    calibration: torch.Tensor | None,
    batch_size: int,
    progress: bool,
) -> dict[int, list[tuple[int, int]]]:
    """The "shared" RoPE selection: every converted layer's pair scores on the original model's own
    activations, then one frequency layout for all (``shared_rope_pairs``). ``block_at(layer)``: the original
    block (a model's, or one read from a checkpoint), asked for once per layer in order."""
    if calibration is None:
        raise ConfigError("rope selection 'shared' needs calibration text")
    device = embed_weight.device
    calibration = calibration.to(device)
    x = torch.nn.functional.embedding(calibration, embed_weight).float()
    cos, sin = rope_tables(rotary, calibration.shape[0], calibration.shape[1])
    H, K, d = config.num_heads, config.num_kv_heads, known(config.head_dim, "head_dim")
    scores = {}
    for layer in tqdm(range(max(layers) + 1), desc="RoPE pair scores", unit="layer", disable=not progress):
        block = block_at(layer)
        if layer in layers:
            C = layer_stats.second_moment(block.input_layernorm, x, batch_size).double().cpu()
            w32 = _gqa_weights(gqa(block))
            if config.qk_norm:  # score the pairs on the norms' linear fits (what the graft builds on)
                w32.q, w32.k = (layer_stats.linearised(block, which, x, C, batch_size).float() for which in "qk")
            w = GQAWeights(
                w32.q.double(),
                w32.k.double(),
                w32.v.double(),
                w32.o.double(),
                _double(w32.q_bias),
                _double(w32.k_bias),
                _double(w32.v_bias),
                _double(w32.o_bias),
            )
            expectation = None
            if g.rope_expectation:
                profile = layer_stats.distance_profile(block, x, cos, sin, batch_size)
                expectation = layer_stats.rope_expectation(profile, rotary.inv_freq.double().cpu())
            Cs = cast(torch.Tensor, layer_stats.shrink_second_moment(C, g.calibration_shrinkage))  # C is not None
            scores[layer] = pair_scores(w, Cs, head_rotations(w.k, Cs, K, d, rotation=g.rope_rotation), H, K, d, expectation)
        if layer < max(layers):  # the last scored layer's output is never read
            x = layer_stats.run_block(block, x, cos, sin, batch_size)
    chosen = shared_rope_pairs([scores[layer] for layer in layers], g.qk_rope_head_dim)
    return dict(zip(layers, chosen))


def _double(t: torch.Tensor | None) -> torch.Tensor | None:
    return None if t is None else t.double()


def _build_block(config: ModelConfig, layer: int, original_block: Block, mla: MLAWeights, device: torch.device) -> Block:
    """The converted layer for propagation: a new MLA attention between the original block's own norms
    and MLP (shared, not copied). Built on the meta device and allocated without random initialisation
    (which took ~0.6 s per 1B-shape layer, mostly the MLP's that is then overwritten)."""
    with torch.device("meta"):
        blk = Block(config, layer)
    blk.input_layernorm = original_block.input_layernorm
    blk.post_attention_layernorm = original_block.post_attention_layernorm
    blk.mlp = original_block.mlp
    attn = cast(MLAttention, blk.self_attn.to_empty(device=device))
    blk.self_attn = attn
    _reset_attention(attn)
    _load_mla(attn, mla)
    return blk


def _latent_norm_init(
    block: Block, mla: MLAWeights, dc: int, x: torch.Tensor | None, eps: float, batch_size: int
) -> torch.Tensor:
    """(dc,) fp64 latent-norm weight: the latent's mean rms over the calibration stream ``x`` (1 without
    calibration), so the norm starts as the constant scale closest to no norm."""
    if x is None:
        return torch.ones(dc, dtype=torch.float64)
    a = mla.kv_a_proj[:dc].to(x.device, torch.float32)
    bias = None if mla.kv_a_bias is None else mla.kv_a_bias[:dc].to(x.device, torch.float32)
    total, count = 0.0, 0
    for s in range(0, x.shape[0], batch_size):
        c = torch.nn.functional.linear(block.input_layernorm(x[s : s + batch_size]).float(), a, bias)
        rms = c.pow(2).mean(-1).add(eps).sqrt()
        total, count = total + float(rms.sum()), count + rms.numel()
    return torch.full((dc,), total / max(count, 1), dtype=torch.float64)


def _mla_weights(attn: MLAttention, like: MLAWeights) -> MLAWeights:
    """The weights of a (refined) MLA module as ``MLAWeights`` (fp64 on the CPU), ``like``'s layout."""

    def t(x: torch.Tensor | None) -> torch.Tensor | None:
        return None if x is None else x.detach().to("cpu", torch.float64).clone()

    def b(lin: nn.Linear, was: torch.Tensor | None) -> torch.Tensor | None:
        return t(lin.bias) if lin.bias is not None else was

    return MLAWeights(
        q_proj=cast(torch.Tensor, t(attn.q_proj.weight)),
        kv_a_proj=cast(torch.Tensor, t(attn.kv_a_proj.weight)),
        kv_b_proj=cast(torch.Tensor, t(attn.kv_b_proj.weight)),
        o_proj=cast(torch.Tensor, t(attn.o_proj.weight)),
        rope_freq_index=like.rope_freq_index,
        q_bias=b(attn.q_proj, like.q_bias),
        kv_a_bias=b(attn.kv_a_proj, like.kv_a_bias),
        kv_b_bias=b(attn.kv_b_proj, like.kv_b_bias),
        o_bias=b(attn.o_proj, like.o_bias),
        q_mix=t(attn.q_mix) if like.q_mix is not None else None,
        q_norm=t(attn.q_norm.weight) if like.q_norm is not None else None,
        kv_a_norm=t(attn.kv_a_norm.weight) if attn.kv_a_norm is not None else None,
    )


def _load_mla(attn: MLAttention, mla: MLAWeights) -> None:
    """Copy the converted layer ``mla`` into the MLA module ``attn`` (in its dtype); RuntimeError for a
    non-zero bias ``attn`` has no place for."""
    dtype = attn.q_proj.weight.dtype

    def put(lin: nn.Linear, weight: torch.Tensor, bias: torch.Tensor | None) -> None:
        lin.weight.copy_(weight.to(dtype))
        if lin.bias is not None:
            lin.bias.copy_(bias.to(dtype) if bias is not None else torch.zeros_like(lin.bias))
        elif bias is not None and bias.abs().max() > 0:
            raise RuntimeError("converted layer has a bias the target module cannot hold")

    put(attn.q_proj, mla.q_proj, mla.q_bias)
    if mla.q_mix is not None:
        if mla.q_norm is None:
            raise RuntimeError("converted layer has a query mix without its query norm")
        attn.q_mix.copy_(mla.q_mix.to(dtype))
        attn.q_norm.weight.copy_(mla.q_norm.to(dtype))
    put(attn.kv_a_proj, mla.kv_a_proj, mla.kv_a_bias)
    if (attn.kv_a_norm is None) != (mla.kv_a_norm is None):
        raise RuntimeError("the converted layer's latent norm and the target module's disagree (GraftConfig.latent_norm)")
    if attn.kv_a_norm is not None and mla.kv_a_norm is not None:
        attn.kv_a_norm.weight.copy_(mla.kv_a_norm.to(dtype))
    put(attn.kv_b_proj, mla.kv_b_proj, mla.kv_b_bias)
    put(attn.o_proj, mla.o_proj, mla.o_bias)
