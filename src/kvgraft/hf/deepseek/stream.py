"""The stock DeepSeek-V3 export streamed layer by layer: ``export_deepseek_v3_streamed``.

It writes what ``export_deepseek_v3`` writes for the same model (every tensor bit for bit, config.json, the
report and README card; ``tests/test_deepseek_stream.py``), but reads the converted model from its
checkpoint directory one decoder layer at a time (``kvgraft.hf.shards.CheckpointReader``, memory-mapped,
unmapped after each layer) instead of taking it whole in memory. Three steps: a first look at the bias
tensors (``LayerBiases``), the walk that writes (``_write_layers``), the check of what was written
(``measure_streamed``). Its output
differs from the whole-model export's only in being sharded (with an index, as transformers writes them)
above ``max_shard_bytes``; a tensor beyond fp16's range ("engines") or not finite in the written dtype is
refused (the same message) after the walk instead of before any writing; nothing is left behind then.

Peak memory (fp32 unless said), none of it growing with depth: the embedding (vocab x hidden, written and
dropped before the walk; read again for the check) + the calibration hidden states 2 x N x T x hidden (the
stream and the layer's output) + one converted layer, its fp64 stock tensors (2 x its fp32 bytes) and their
cast + that layer's raw latents (N x T x d_c fp64, kept at most ``max_fit_tokens``) and input moments
(hidden^2) + one pending shard (``max_shard_bytes``); during the check one converted and one stock layer and
the tail's states (4 x tail x T x hidden with a sliding window, else 2), at the end both heads (2 x vocab x
hidden) and one chunk of logits of each (``HEAD_POSITIONS`` x vocab, fp32 and fp64).
"""

from __future__ import annotations

import inspect
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any, cast

import torch
import torch.nn.functional as F
from tqdm.auto import tqdm
from transformers import AutoConfig, AutoModelForCausalLM
from transformers.masking_utils import create_causal_mask
from transformers.models.deepseek_v3.modeling_deepseek_v3 import DeepseekV3RotaryEmbedding

from kvgraft.atomic import atomic_dir
from kvgraft.checks import check_int
from kvgraft.errors import CheckpointError
from kvgraft.hf.deepseek.checks import MLP_PROJECTIONS, config_problems, deepseek_v3_fast_path, mlp_bias_problems
from kvgraft.hf.deepseek.export import (
    ExportOptions,
    ExportReport,
    bias_messages,
    check_arguments,
    check_inputs,
    export_card,
    export_config,
    fold_messages,
    fp16_excess,
    latent_strategy,
    layer_latent,
    measured_ids,
    opening_notes,
    refuse_fp16_overflow,
    refuse_overflow,
    refuse_problems,
    refuse_unfolded_biases,
)
from kvgraft.hf.deepseek.folds import EngineFold, InputMoments, engine_fold
from kvgraft.hf.deepseek.latent import latent_unit, subsample_latents
from kvgraft.hf.deepseek.tensors import attention_bias_needed_from, layer_tensors
from kvgraft.hf.save import write_side_files
from kvgraft.hf.shards import DEFAULT_SHARD_BYTES, CheckpointReader, ShardWriter
from kvgraft.model.batch import DenseContext
from kvgraft.model.config import ModelConfig
from kvgraft.model.mla import MLAttention
from kvgraft.model.norm import RMSNorm
from kvgraft.model.rope import RotaryEmbedding
from kvgraft.model.transformer import Block

EMBED, NORM, LM_HEAD = "model.embed_tokens.weight", "model.norm.weight", "lm_head.weight"
IGNORED_SUFFIXES = ("rotary_emb.inv_freq",)  # buffers old transformers versions saved
SHARD_FLOOR = 256 * 2**20  # export shards of at least this many bytes (a tiny model: one model.safetensors)
HEAD_POSITIONS = 64  # the check's head: this many positions of one sequence at a time
ATTENTION = ("q_proj", "kv_a_proj", "kv_b_proj", "o_proj")
_MARK = torch.empty(0)  # a fold part that was set (its values already written): what fold_messages reads


class ConvertedLayers:
    """The converted kvgraft checkpoint at ``directory`` read one decoder layer at a time (fp32 on ``device``)."""

    def __init__(self, reader: CheckpointReader, config: ModelConfig, device: str | torch.device) -> None:
        self.reader, self.config, self.device = reader, config, torch.device(device)

    def tensor(self, name: str) -> torch.Tensor:
        t = self.reader.get(name, dtype=torch.float32, device=self.device)
        self.reader.release()
        return t

    def bias(self, layer: int, name: str) -> torch.Tensor | None:
        key = f"model.layers.{layer}.{name}.bias"
        return self.tensor(key) if key in self.reader else None

    def block(self, layer: int) -> Block:
        prefix = f"model.layers.{layer}."
        state = {
            k[len(prefix) :]: self.reader.get(k, dtype=torch.float32, device=self.device)
            for k in self.reader.prefixed(prefix)
            if not k.endswith(IGNORED_SUFFIXES)
        }
        self.reader.release()
        with torch.device("meta"):
            block = Block(self.config, layer)
        block.load_state_dict(state, assign=True)
        return block.eval()

    def head(self) -> torch.Tensor:
        return self.tensor(EMBED if self.config.tie_word_embeddings or LM_HEAD not in self.reader else LM_HEAD)


class LayerBiases:
    """What the export decides before any work, from the bias tensors alone (read one at a time): what the
    whole-model export decides from the whole model: what stock cannot hold (MLP biases), the engine-safe
    refusals, which layers need calibration statistics, the low-rank query path, whether attention bias
    tensors are written."""

    def __init__(self, layers: ConvertedLayers) -> None:
        cfg = layers.config
        dn = cfg.latent_dims()[2]
        self.nonzero: list[dict[str, bool]] = []
        self.mlp_layers: list[int] = []
        for i in range(cfg.num_layers):
            flags = {}
            for n in ATTENTION:
                b = layers.bias(i, f"self_attn.{n}")
                flags[n] = b is not None and bool(b.abs().max() > 0)
                if n == "kv_b_proj":  # its value half (the key half is dropped exactly)
                    flags["kv_b_value"] = b is not None and bool(b.view(cfg.num_heads, -1)[:, dn:].abs().max() > 0)
            self.nonzero.append(flags)
            if cfg.mlp_bias and any(
                (b := layers.bias(i, f"mlp.{n}")) is not None and bool(b.abs().max() > 0) for n in MLP_PROJECTIONS
            ):
                self.mlp_layers.append(i)

    def any(self, name: str) -> bool:
        return any(f[name] for f in self.nonzero)

    def layers_with(self, *names: str) -> list[int]:
        return [i for i, f in enumerate(self.nonzero) if any(f[n] for n in names)]


@torch.no_grad()
def export_deepseek_v3_streamed(
    model_dir: str | Path,
    config: ModelConfig,
    out_dir: str | Path,
    options: ExportOptions | None = None,
    *,
    tokenizer_dir: str | Path | None = None,
    calibration: torch.Tensor | None = None,
    device: str | torch.device = "cpu",
    batch_size: int = 8,
    max_shard_bytes: int | None = None,
    progress: bool = False,
) -> ExportReport:
    """Write the all-MLA kvgraft checkpoint at ``model_dir`` (its ``config``) as a stock DeepSeek-V3 checkpoint
    at ``out_dir``, one layer in memory at a time: ``export_deepseek_v3``'s arguments and result (see there and
    the module docstring), the model read from its files. ``options.dtype``: of the written tensors
    (default: the model's embedding's in the file). ``device``: where the layers and calibration states are computed.
    ``batch_size``: calibration sequences per forward (the whole-model export's 8). ``max_shard_bytes``
    (default: one exported layer's bytes, at least ``SHARD_FLOOR``, at most ``DEFAULT_SHARD_BYTES``): the
    largest output shard, the writer's memory. ``progress``: bars over the layers."""
    o = options or ExportOptions()
    target, dtype, tail_sequences = o.target, o.dtype, o.tail_sequences
    out_dir = Path(out_dir)
    latent_norm = check_arguments(out_dir, o.overwrite, target, o.latent_norm, tail_sequences)
    check_int("batch_size", batch_size, low=1)
    cfg = config
    with CheckpointReader(model_dir) as reader:
        layers = ConvertedLayers(reader, cfg, device)
        problems = config_problems(cfg)
        biases = LayerBiases(layers) if not problems else None
        refuse_problems(problems + mlp_bias_problems(biases.mlp_layers if biases else []))
        assert biases is not None
        rope_parameters, q_fold, rope_notes, tokenizer_files = check_inputs(cfg, calibration, tokenizer_dir)
        if target == "engines" and calibration is None:
            refuse_unfolded_biases(biases.layers_with("q_proj", "kv_a_proj", "o_proj", "kv_b_value"))
        notes, approximations, window = opening_notes(cfg, target, rope_notes)
        folded: list[str] = []
        strategy = latent_strategy(cfg, latent_norm, calibration, notes, approximations, folded)
        q_bias_layers = biases.layers_with("q_proj") if cfg.qkv_bias and target == "transformers" else []
        low_rank_q, q_lora_rank, extra = _dry_bias_messages(cfg, target, strategy, q_bias_layers, biases)
        attention_bias = target == "transformers" and attention_bias_needed_from(
            cfg, low_rank_q, strategy == "pad", biases.any("kv_a_proj"), biases.any("kv_b_proj")
        )
        if dtype is None:
            dtype = reader.get(NORM).dtype  # the file's dtype (the whole-model export: the model's)
        shard = max_shard_bytes or _shard_bytes(reader, cfg, dtype)
        with atomic_dir(out_dir, overwrite=o.overwrite) as tmp:
            writer = ShardWriter(tmp, max_shard_bytes=shard)
            how = _Construction(strategy, target, q_fold, attention_bias, low_rank_q, dtype)
            walk = _write_layers(
                layers,
                writer,
                cfg,
                calibration,
                biases,
                how,
                max_fit_tokens=o.max_fit_tokens,
                batch_size=batch_size,
                progress=progress,
            )
            latent_cvs, folds, dc_out = walk.cvs, walk.folds, walk.dc_out
            if target == "engines":
                fold_messages(folds, biases.any("kv_b_proj"), approximations, folded)
            bias_messages(cfg, target, strategy, q_bias_layers, biases.any("kv_a_proj"), biases.any("kv_b_proj"), folded)
            notes = deepseek_v3_fast_path(cfg.replace(kv_lora_rank=dc_out), cfg.kv_width) + notes
            if target == "engines":
                refuse_fp16_overflow(walk.big)
            refuse_overflow(walk.bad, dtype)
            report = ExportReport(
                path=out_dir,
                latent_norm=strategy,
                warnings=notes,
                latent_rms_cv=tuple(latent_cvs),
                exact=not approximations,
                approximations=approximations,
                exact_up_to_tokens=window,
                kv_lora_rank=dc_out,
                q_lora_rank=q_lora_rank,
                extra_parameters=extra,
                folded=folded,
                target=target,
            )
            config_json = export_config(cfg, report, rope_parameters, attention_bias, dtype)
            writer.close()
            write_side_files(tmp, config_json, cfg, tokenizer_files, {"README.md": export_card(report)})
            if o.measure:
                ids = measured_ids(report, cfg, calibration, tail_sequences)
                m = measure_streamed(layers, tmp, ids, window=window, device=device, progress=progress)
                report.max_abs_logit_diff, report.mean_kl = m["max_abs_logit_diff"], m["mean_kl"]
                report.perplexity = m["perplexity"]
                report.max_abs_logit_diff_within_window = m.get("max_abs_logit_diff_within_window")
                (tmp / "README.md").write_text(export_card(report), encoding="utf-8")
    if o.verbose:
        print("\n".join(report.summary()), flush=True)
    return report


def _dry_bias_messages(
    cfg: ModelConfig, target: str, strategy: str, q_bias_layers: list[int], biases: LayerBiases
) -> tuple[bool, int | None, int]:
    """``bias_messages``' decisions before the walk (its messages are appended after the fold messages, in
    the whole-model export's order)."""
    return bias_messages(cfg, target, strategy, q_bias_layers, biases.any("kv_a_proj"), biases.any("kv_b_proj"), [])


def _shard_bytes(reader: CheckpointReader, cfg: ModelConfig, dtype: torch.dtype) -> int:
    """One converted layer's elements (from the headers) x ``dtype``'s size, in [SHARD_FLOOR, DEFAULT_SHARD_BYTES]."""
    layer = sum(math.prod(reader.shape(k)) for k in reader.prefixed("model.layers.0."))
    return min(DEFAULT_SHARD_BYTES, max(SHARD_FLOOR, layer * dtype.itemsize))


@dataclass(frozen=True)
class _Construction:
    """How each layer's stock tensors are built: the latent norm ``strategy``, the ``target``, the factor
    ``q_fold`` folded into the queries, whether attention biases and the low-rank query path are written, and
    the written ``dtype``."""

    strategy: str
    target: str
    q_fold: float
    attention_bias: bool
    low_rank_q: bool
    dtype: torch.dtype


@dataclass
class _Walked:
    """What the walk wrote: the per-layer latent cvs, the folds' summaries, the exported d_c, and the tensors
    beyond fp16's range (``big``, by how much) or not finite in the written dtype (``bad``)."""

    cvs: list[float]
    folds: list[EngineFold | None]
    dc_out: int
    big: dict[str, float]
    bad: list[str]


def _write_layers(
    layers: ConvertedLayers,
    writer: ShardWriter,
    cfg: ModelConfig,
    calibration: torch.Tensor | None,
    biases: LayerBiases,
    how: _Construction,
    *,
    max_fit_tokens: int,
    batch_size: int,
    progress: bool,
) -> _Walked:
    """The walk: the embedding, each layer's stock tensors (calibration statistics streamed through the
    converted layers), the final norm and the untied head, all handed to ``writer``. The calibration hidden
    states (N x T x hidden fp32, in memory) go through each converted layer in batches of ``batch_size``
    sequences, as the whole model's forward runs them, with a hook at kv_a_proj collecting that layer's raw
    latents (the "fit"/"scale" latent norm, and the unit of a value fold) and its attention input's moments
    (``EngineFold``); the layer's stock tensors are computed (``layer_tensors``) and written, and the layer
    is dropped."""
    strategy, target, dtype = how.strategy, how.target, how.dtype
    device = layers.device
    fit = strategy in ("fit", "scale") and calibration is not None
    # the whole-model export collects the input moments of every layer when any layer has a bias
    has_bias = target == "engines" and any(biases.any(n) for n in ATTENTION)
    need_moments = has_bias and calibration is not None
    big: dict[str, float] = {}
    bad: list[str] = []

    def write(name: str, tensor: torch.Tensor) -> None:
        if target == "engines" and (m := fp16_excess(tensor)) is not None:
            big[name] = m
        t = tensor.to(dtype).contiguous()
        if not bool(torch.isfinite(t).all()):
            bad.append(name)
        writer.add(name, t)

    embed = layers.tensor(EMBED)
    hidden = F.embedding(calibration.to(device), embed) if calibration is not None and (fit or need_moments) else None
    write(EMBED, embed)
    del embed
    rotary = RotaryEmbedding(cfg).to(device)
    cvs: list[float] = []
    folds: list[EngineFold | None] = []
    dc_out = 0
    dc = cfg.latent_dims()[0]
    for i in tqdm(range(cfg.num_layers), desc="deepseek_v3 export", unit="layer", disable=not progress):
        block = layers.block(i)
        attn = cast(MLAttention, block.self_attn)
        # a value fold rides on the latent's unit, fitted on that layer's raw latents
        value_fold = has_bias and calibration is not None and (biases.nonzero[i]["kv_b_value"] or biases.nonzero[i]["o_proj"])
        keep_latents = fit or (value_fold and strategy in ("exact", "pad"))
        stats = _LayerStats(dc, keep_latents, InputMoments(cfg.hidden_size, device) if need_moments else None)
        if hidden is not None:
            hidden = _run_block(block, hidden, rotary, batch_size, stats if keep_latents or stats.moments else None)
        raw = subsample_latents(stats.chunks, max_fit_tokens) if stats.chunks else None
        moments = stats.moments
        del stats
        lat = layer_latent(strategy, block, cfg, raw if fit else None)
        fold = engine_fold(cfg, i, attn, None if moments is None else moments.result()) if target == "engines" else None
        if fold is not None and fold.value is not None and lat.unit is None:
            assert raw is not None  # engine_fold refuses a value fold without calibration
            lat.unit = latent_unit(lat, raw)
        del raw, moments
        tensors = layer_tensors(cfg, i, block, lat, how.q_fold, how.attention_bias, how.low_rank_q, fold)
        del block
        for name in list(tensors):
            write(name, tensors.pop(name))
        cvs.append(lat.cv)
        dc_out = dc_out or lat.M.shape[0]
        folds.append(_summary(fold))
    del hidden
    write(NORM, layers.tensor(NORM))
    write(LM_HEAD, layers.head())  # untied even if tied
    return _Walked(cvs, folds, dc_out, big, bad)


class _LayerStats:
    """What one layer's kv_a_proj hook collects: its raw latents (fp64 CPU, with ``keep_latents``) and its
    input's moments (``moments``, or None)."""

    def __init__(self, dc: int, keep_latents: bool, moments: InputMoments | None) -> None:
        self.dc, self.keep_latents, self.moments = dc, keep_latents, moments
        self.chunks: list[torch.Tensor] = []

    def __call__(self, x: torch.Tensor, out: torch.Tensor) -> None:
        if self.keep_latents:
            self.chunks.append(out[..., : self.dc].detach().reshape(-1, self.dc).to("cpu", torch.float64))
        if self.moments is not None:
            self.moments.add(x)


def _summary(fold: EngineFold | None) -> EngineFold | None:
    """The fold without its (written) matrices: which parts were set, its input cv and o_proj residual."""
    if fold is None:
        return None
    return EngineFold(
        q_delta=None if fold.q_delta is None else _MARK,
        a_delta=None if fold.a_delta is None else _MARK,
        value=None if fold.value is None else _MARK,
        input_cv=fold.input_cv,
        o_residual=fold.o_residual,
    )


def _run_block(block: Block, x: torch.Tensor, rotary: RotaryEmbedding, batch_size: int, on_kv_a: Any = None) -> torch.Tensor:
    """``block`` over hidden states ``x`` (N, T, hidden) ``batch_size`` sequences at a time, as
    ``Transformer.forward`` runs each batch (positions 0..T-1); ``on_kv_a(input, output)`` at its kv_a_proj."""
    attn = cast(MLAttention, block.self_attn)
    hook = None if on_kv_a is None else attn.kv_a_proj.register_forward_hook(lambda _m, inp, out: on_kv_a(inp[0], out))
    try:
        out = []
        for start in range(0, x.shape[0], batch_size):
            out.append(_block_forward(block, x[start : start + batch_size], rotary))
        return torch.cat(out)
    finally:
        if hook is not None:
            hook.remove()


def _block_forward(block: Block, x: torch.Tensor, rotary: RotaryEmbedding) -> torch.Tensor:
    B, T = x.shape[:2]
    positions = torch.arange(T, device=x.device).expand(B, T)
    cos, sin = rotary(positions, x.dtype)
    return cast(torch.Tensor, block(x, cos, sin, DenseContext(positions, True)))


@torch.no_grad()
def measure_streamed(
    layers: ConvertedLayers,
    export_dir: Path,
    ids: torch.Tensor,
    window: int | None = None,
    device: str | torch.device = "cpu",
    progress: bool = False,
) -> dict:
    """``measure_export``'s figures for the export written at ``export_dir`` against the converted model read
    by ``layers``, one layer of each in memory at a time (stock transformers' decoder layers loaded with the
    written tensors; fp32, CPU for stock as ``measure_export`` runs it).

    Stock transformers' own ``DeepseekV3DecoderLayer`` (built from the written config.json, loaded strictly
    with that layer's written tensors) runs over the calibration tail's hidden states one layer at a time,
    beside the kvgraft converted layer, then transformers' final norm and head; the written names and shapes
    are checked against transformers' ``DeepseekV3ForCausalLM`` built from the config on the meta device
    (what ``from_pretrained`` would call missing, unexpected or mismatched). The logits agree bit for bit
    with the whole models' (the layers run the same batches; the head runs one sequence and
    ``HEAD_POSITIONS`` positions at a time, which gives the same rows on the CPU BLAS tested), and the KL and
    perplexity are reduced over the same (B, T) values in the same order (tests: equal, not merely close)."""
    cfg = layers.config
    stock_cfg = AutoConfig.from_pretrained(str(export_dir))
    with torch.device("meta"):  # transformers' model, no weights: the names and shapes it loads
        stock = AutoModelForCausalLM.from_config(stock_cfg, dtype=torch.float32)
    stock.eval()
    with CheckpointReader(export_dir) as written:
        _check_loads(stock, written, export_dir)
        T = ids.shape[1]
        lengths = [T] + ([min(window, T)] if window is not None else [])
        ours_rotary = RotaryEmbedding(cfg).to(layers.device)
        stock_rotary = DeepseekV3RotaryEmbedding(config=stock.config)
        embed = layers.tensor(EMBED)
        ours = [F.embedding(ids[:, :n].to(layers.device), embed) for n in lengths]
        del embed
        stock_embed = written.get(EMBED, dtype=torch.float32)
        written.release()
        theirs = [F.embedding(ids[:, :n].cpu(), stock_embed) for n in lengths]
        del stock_embed
        tables = [_stock_inputs(stock.config, stock_rotary, h) for h in theirs]
        for i in tqdm(range(cfg.num_layers), desc="deepseek_v3 check", unit="layer", disable=not progress):
            block = layers.block(i)
            ours = [_block_forward(block, h, ours_rotary) for h in ours]
            del block
            layer = stock.model.layers[i]
            prefix = f"model.layers.{i}."
            layer.load_state_dict(
                {k[len(prefix) :]: written.get(k, dtype=torch.float32) for k in written.prefixed(prefix)},
                strict=True,
                assign=True,
            )
            written.release()
            theirs = [
                layer(h, attention_mask=mask, position_ids=pos, position_embeddings=pe)
                for h, (mask, pos, pe) in zip(theirs, tables)
            ]
            layer.to_empty(device="meta")  # its weights dropped
        norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps).to(layers.device)
        norm.weight.copy_(layers.tensor(NORM))
        head = layers.head()
        stock.model.norm.load_state_dict({"weight": written.get(NORM, dtype=torch.float32)}, assign=True)
        stock.lm_head.load_state_dict({"weight": written.get(LM_HEAD, dtype=torch.float32)}, assign=True)
        written.release()
        figures = [_head_figures(norm, head, stock, o, t, ids[:, :n]) for o, t, n in zip(ours, theirs, lengths)]
    out = {
        "max_abs_logit_diff": figures[0]["max"],
        "mean_kl": figures[0]["kl"],
        "perplexity": {"kvgraft": figures[0]["ppl_a"], "deepseek_v3": figures[0]["ppl_b"]},
    }
    if window is not None:
        out["max_abs_logit_diff_within_window"] = figures[1]["max"]
    return out


def _check_loads(stock: torch.nn.Module, written: CheckpointReader, export_dir: Path) -> None:
    """``load_stock``'s check without loading: the written names and shapes against transformers' model."""
    expected = {k: tuple(v.shape) for k, v in stock.state_dict().items()}
    names = set(written.keys())
    info = {
        "missing_keys": sorted(set(expected) - names),
        "unexpected_keys": sorted(names - set(expected)),
        "mismatched_keys": sorted(k for k in names & set(expected) if written.shape(k) != expected[k]),
    }
    bad = {k: v for k, v in info.items() if v}
    if bad:
        raise CheckpointError(f"{export_dir} does not load cleanly in transformers: {bad}")


def _stock_inputs(config: Any, rotary: torch.nn.Module, h: torch.Tensor) -> tuple[Any, torch.Tensor, Any]:
    """(causal mask, position ids, position embeddings) as ``DeepseekV3Model.forward`` builds them for ``h``."""
    position_ids = torch.arange(h.shape[1], device=h.device).unsqueeze(0)
    return _causal_mask(config, h, position_ids), position_ids, rotary(h, position_ids)


def _causal_mask(config: Any, h: torch.Tensor, position_ids: torch.Tensor) -> Any:
    """transformers' causal mask for ``h`` with no cache, whatever the release names its arguments: the cache is
    ``past_key_values`` in 5.19 (vLLM's pin) and ``cache`` in 5.24; ``cache_position`` and ``input_embeds`` are
    passed where a release asks for them."""
    params = inspect.signature(create_causal_mask).parameters
    kwargs: dict[str, Any] = {"config": config, "attention_mask": None, "position_ids": position_ids}
    kwargs["inputs_embeds" if "inputs_embeds" in params else "input_embeds"] = h
    for name in ("cache", "past_key_values"):
        if name in params:
            kwargs[name] = None
    if "cache_position" in params:
        kwargs["cache_position"] = position_ids[0]
    return create_causal_mask(**kwargs)


def _head_figures(
    norm: RMSNorm, head: torch.Tensor, stock: Any, ours: torch.Tensor, theirs: torch.Tensor, ids: torch.Tensor
) -> dict[str, float]:
    """max |logit diff|, mean KL(ours || stock) and both perplexities from the last hidden states, the heads
    applied one sequence and ``HEAD_POSITIONS`` positions at a time (fp64 figures as ``measure_export``'s)."""
    B, T = ids.shape
    worst = torch.zeros((), dtype=torch.float64)
    kl = torch.empty(B, T, dtype=torch.float64)
    nll = [torch.empty(B, T - 1, dtype=torch.float64) for _ in range(2)]
    hidden_b = stock.model.norm(theirs)
    for i in range(B):
        for s in range(0, T, HEAD_POSITIONS):
            e = min(s + HEAD_POSITIONS, T)
            a = F.linear(norm(ours[i : i + 1, s:e]), head).double().cpu()
            b = stock.lm_head(hidden_b[i : i + 1, s:e]).double()
            worst = torch.maximum(worst, (a - b).abs().max())
            log_p, log_q = torch.log_softmax(a, -1), torch.log_softmax(b, -1)
            kl[i, s:e] = (log_p.exp() * (log_p - log_q)).sum(-1)[0]
            t_end = min(e, T - 1)  # position t predicts token t + 1
            if t_end > s:
                target = ids[i, s + 1 : t_end + 1].cpu()
                for k, lp in enumerate((log_p, log_q)):
                    nll[k][i, s:t_end] = lp[0, : t_end - s].gather(-1, target[:, None])[:, 0]
    ppl = [_perplexity(n) for n in nll]
    return {"max": float(worst), "kl": float(kl.mean()), "ppl_a": ppl[0], "ppl_b": ppl[1]}


def _perplexity(logp: torch.Tensor) -> float:
    """``measure.perplexity`` from the targets' log-probabilities (B, T - 1): cross entropy's mean, reduced as it is."""
    if logp.shape[1] < 1:
        return float("nan")
    flat = logp.reshape(-1, 1)
    return float(torch.exp(F.nll_loss(flat, torch.zeros(flat.shape[0], dtype=torch.long))))


__all__ = ["HEAD_POSITIONS", "SHARD_FLOOR", "ConvertedLayers", "export_deepseek_v3_streamed", "measure_streamed"]
