"""``kvgraft convert --to ced`` layer by layer: the MLA graft and the share graft in one walk up the layers.

The layer-by-layer executor (``kvgraft.graft.layerwise.execute_layerwise``: the source read lazily, the output
staged in ``.<out>.partial`` and written shard by shard, a checkpoint after each layer for ``--resume``) runs
this module's walk. For each layer in order: the original block is read (fp32), grafted to MLA by
``kvgraft.graft.mla.LayerGraft`` (the same per-layer code as ``graft_mla``; an all-MLA source is used as it
is), the MLA layer's latents are taken from the calibration hidden states of the MLA stack entering it and,
for a reading layer, its up-projection fitted by ``kvgraft.graft.ced.ShareGraft`` (the same code as
``graft_ced``), and the CED layer's tensors are handed to the shard writer; all three blocks are then dropped.

The share graft fits on the MLA-grafted stack's own activations (what ``graft_ced`` runs: the MLA model's
forward), not the original's and not the CED stack's. With layer-wise calibration (the default) that is the
MLA graft's own calibration stream (``LayerGraft.x_new``, run through each converted layer), so nothing is
added; without it (``--no-layerwise``, whose stream is the original stack's) or for an all-MLA source, the walk
runs its own MLA stream (one more N x T x hidden fp32). Across layers the share graft holds one kv_source
layer's latents (N x T x d_c fp32) and their second moment ((d_c + 1)^2 fp64), never one per layer.

The calibration tail (its last ``TAIL_SEQUENCES`` sequences) streams through the original stack and through
the CED stack one sequence at a time, as ``tail_figures`` runs each model on each; the CED stack's shared
entries pass from its kv_source layers to its readers in one step context per tail sequence, which the
checkpoint keeps (a few (T / m) x (d_c + d_rope) tensors). The tensors written, the config and
``conversion.json`` (apart from timings) are the whole-model executor's bit for bit
(``tests/test_ced_layerwise.py``).
"""

from __future__ import annotations

import sys
import time
from typing import Any

import torch
import torch.nn.functional as F
from tqdm.auto import tqdm

from kvgraft.errors import ConfigError
from kvgraft.graft.ced import ShareGraft
from kvgraft.graft.layer_stats import run_block
from kvgraft.graft.layerwise import (
    EMBED,
    HF_PREFIX,
    SourceLayers,
    _tail_state,
    execute_layerwise,
    restore_walk,
    walk_state,
    write_final_norm_and_head,
)
from kvgraft.graft.mla import (
    TAIL_ROWS,
    LayerGraft,
    _shared_pairs,
    layer_postfix,
    mla_model_config,
    rope_tables,
)
from kvgraft.graft.plan import ConvertPlan
from kvgraft.graft.record import TAIL_SEQUENCES, ConversionReport, TailFigures
from kvgraft.graft.resume import Checkpoint
from kvgraft.hf.shards import ShardWriter
from kvgraft.model import ModelConfig
from kvgraft.model.batch import DenseContext
from kvgraft.model.ced import rope_tables as ced_rope_columns
from kvgraft.model.rope import RotaryEmbedding
from kvgraft.model.transformer import Block

SHARE_CLOCK = "share graft"  # the walk's seconds in the share graft (latents, fits, CED layers)


@torch.no_grad()
def execute_layerwise_ced(plan: ConvertPlan, calib: torch.Tensor | None) -> ConversionReport:
    """Convert ``plan`` (``to == "ced"``) one layer at a time and write ``plan.out`` atomically; returns the
    ``conversion.json`` record (what ``execute_whole`` returns, the share graft's report in it).

    Peak memory: the ``--to mla`` walk's (``kvgraft.graft.layerwise``) with the CED layer beside the original and
    MLA ones (its attention fp32: about the MLA layer's plus window keys and values, H x (d_nope + d_rope + d_v)
    x hidden), plus the held latents N x T x d_c x 4 B (+ N x T x hidden x 4 B for the walk's own stream where it
    runs one). None of it grows with depth."""
    if plan.to != "ced" or plan.ced is None:
        raise ConfigError(f"the share graft's walk converts --to ced only, not --to {plan.to}")
    if calib is None:  # ConvertPlan refuses this; said again for the type checker
        raise ConfigError("the share graft needs calibration tokens")
    return execute_layerwise(plan, calib, walk=_ced_walk)


class _TailStack:
    """The calibration tail through the CED stack, one sequence at a time, each with its own step context
    (the kv_source layers' shared entries for the readers above them)."""

    def __init__(self, config: ModelConfig, x: torch.Tensor, device: torch.device) -> None:
        self.x = x  # (n, T, h): the tail's hidden states entering the next layer
        n, T = x.shape[0], x.shape[1]
        positions = torch.arange(T, device=device).expand(1, T)
        self.contexts = [DenseContext(positions, True, config.compress_rate if config.is_ced else 1) for _ in range(n)]
        # what the CED model's forward computes for a (1, T) row: its RoPE, the d_rope columns of the layout
        cos, sin = RotaryEmbedding(config).to(device)(positions, torch.float32)
        self.cos, self.sin = ced_rope_columns(config, cos, sin)

    def advance(self, layer: int, block: Block) -> None:
        out = []
        for i, ctx in enumerate(self.contexts):
            out.append(block(self.x[i : i + 1], self.cos, self.sin, ctx))
            ctx.scratch.pop(("kv", layer), None)  # a layer's window entries are read by that layer only
        self.x = torch.cat(out)

    def state(self) -> dict[str, torch.Tensor]:
        return {
            f"share/tail_seg/{i}/{key[1]}": t
            for i, ctx in enumerate(self.contexts)
            for key, t in ctx.scratch.items()
            if isinstance(key, tuple) and key[0] == "seg"
        }

    def restore(self, tensors: dict[str, torch.Tensor]) -> None:
        for name, t in tensors.items():
            if name.startswith("share/tail_seg/"):
                i, layer = name.removeprefix("share/tail_seg/").split("/")
                self.contexts[int(i)].scratch[("seg", int(layer))] = t


def _one_layout_config(config: ModelConfig, plan: ConvertPlan, run: LayerGraft | None) -> ModelConfig:
    """The MLA model's config the share graft starts from: the source's when it is all-MLA, else the graft's
    with layer 0's RoPE layout for every layer (one layout: each layer's is checked as it is grafted)."""
    if run is None:
        return config
    assert plan.mla is not None
    return mla_model_config(config, plan.mla, {i: run.rope_index[0] for i in range(config.num_layers)})


def _check_layout(run: LayerGraft | None, layer: int) -> None:
    """The error ``graft_ced`` gives (``CEDGraftConfig.check_against``) for layouts that differ per layer."""
    if run is not None and run.rope_index[layer] != run.rope_index[0]:
        raise ConfigError(
            "the MLA layers use different RoPE frequencies per layer, but shared RoPE keys need one layout; "
            "graft MLA with rope_selection='stride' (what `kvgraft convert --to ced` does)"
        )


def _ced_walk(
    plan: ConvertPlan,
    src: SourceLayers,
    calib: torch.Tensor,
    writer: ShardWriter,
    checkpoint: Checkpoint,
    times: dict[str, float],
) -> tuple[ModelConfig, dict[str, Any], dict[str, Any]]:
    """The walk up the layers (a ``kvgraft.graft.layerwise.Walk``): MLA graft, share graft, write, the tail
    through the original and the CED stack, checkpoint, each layer; then the head and the tail figures."""
    g, config, device = plan.mla, plan.source_config, torch.device(plan.device)
    assert plan.ced is not None
    rotary = RotaryEmbedding(config).to(device)
    tail_ids = calib[-TAIL_SEQUENCES:].to(device)
    cos, sin = rope_tables(rotary, calib.shape[0], calib.shape[1])  # the walk's own MLA stream, where it runs one
    tail_cos, tail_sin = rope_tables(rotary, tail_ids.shape[0], tail_ids.shape[1])
    own_stream = g is None or not g.layerwise  # the MLA graft's stream is not the MLA stack's
    share: ShareGraft | None = None
    ced_tail: _TailStack | None = None
    if checkpoint.state is None:
        start = 0
        run, x_mla, tails, clock = _fresh_walk(plan, src, calib, writer, rotary, tail_ids, own_stream)
    else:
        start = int(checkpoint.state["next_layer"])
        run, tails, tensors = restore_walk(checkpoint, config, g, rotary, writer, src, times)
        x_mla = tensors.get("share/x_mla")
        clock = run.clock if run is not None else dict(checkpoint.state["share"]["clock"])
        share = ShareGraft(_one_layout_config(config, plan, run), plan.ced)
        share.restore(tensors, checkpoint.state["share"])
        ced_tail = _TailStack(share.config, tails[1], device)
        ced_tail.restore(tensors)
        del tensors
        if plan.progress:
            print(f"resuming at layer {start} of {config.num_layers} from {checkpoint.directory}", file=sys.stderr, flush=True)
    bar = tqdm(total=config.num_layers, initial=start, desc="convert", unit="layer", disable=not plan.progress)
    for layer in range(start, config.num_layers):
        t = time.perf_counter()
        block = src.block(layer)
        mla_block = block
        if run is not None:
            run.convert(layer, block)
            _check_layout(run, layer)
            mla_block = run.converted_block(layer, block)
        t0 = time.perf_counter()
        if share is None:
            share = ShareGraft(_one_layout_config(config, plan, run), plan.ced)
        if ced_tail is None:
            ced_tail = _TailStack(share.config, tails[1], device)
        stream = x_mla if own_stream else (run.x_new if run is not None else None)
        if layer in share.needed:
            if stream is None:
                raise RuntimeError(f"share graft: no calibration stream entering layer {layer}")
            share.observe(layer, mla_block, stream)
        ced_block = share.ced_block(layer, mla_block)
        clock[SHARE_CLOCK] += time.perf_counter() - t0
        if run is not None:
            run.advance(layer, block)
        t2 = time.perf_counter()
        if x_mla is not None:  # the walk's own stream, past this layer while a layer above takes latents
            x_mla = run_block(mla_block, x_mla, cos, sin, 8, TAIL_ROWS) if share.streams_past(layer) else None
        clock[SHARE_CLOCK] += time.perf_counter() - t2
        t_tail = time.perf_counter()
        if run is not None:  # the original stack's: off the graft's original stream where it runs one
            original = _tail_state(run, layer, 0, block, tails, tail_cos, tail_sin)
        else:
            original = run_block(block, tails[0], tail_cos, tail_sin, 1)
        ced_tail.advance(layer, ced_block)
        tails = [original, ced_tail.x]
        times["tail"] += time.perf_counter() - t_tail
        prefix = f"{HF_PREFIX}layers.{layer}."
        for key, tensor in ced_block.state_dict().items():
            writer.add(prefix + key, tensor)
        if run is not None:
            run.converted.pop(layer, None)  # written: its factors (fp64) would add up over the layers
        del block, mla_block, ced_block
        tensors, state = walk_state(run, tails, writer, src, times)
        share_tensors, share_state = share.state()
        tensors |= share_tensors | ced_tail.state()
        if x_mla is not None:
            tensors["share/x_mla"] = x_mla
        state["share"] = share_state | {"clock": dict(clock)}
        checkpoint.write(layer + 1, tensors, state)
        bar.update(1)
        if plan.progress:
            layer_postfix(bar, time.perf_counter() - t, clock)
    bar.close()
    if share is None or ced_tail is None:
        raise RuntimeError("the share graft's walk ran no layer")
    norm, head = write_final_norm_and_head(src, writer, config, device)
    t_tail = time.perf_counter()
    tail = TailFigures(tail_ids)
    for i in range(tail_ids.shape[0]):  # the head as Transformer.forward applies it, one sequence at a time
        tail.add(i, *(F.linear(norm(x[i : i + 1]), head) for x in tails))
    times["tail"] += time.perf_counter() - t_tail
    return share.config, tail.record(), share.report


def _fresh_walk(
    plan: ConvertPlan,
    src: SourceLayers,
    calib: torch.Tensor,
    writer: ShardWriter,
    rotary: RotaryEmbedding,
    tail_ids: torch.Tensor,
    own_stream: bool,
) -> tuple[LayerGraft | None, torch.Tensor | None, list[torch.Tensor], dict[str, float]]:
    """The start of a walk that resumes nothing: the embedding written, the MLA graft's run over the
    calibration states (None: the source is all MLA already), the walk's own MLA stream (None: the graft's is
    used), the tail's states entering layer 0 ([original stack, CED stack]) and the clock."""
    g, config, device = plan.mla, plan.source_config, torch.device(plan.device)
    embed = src.tensor(EMBED)
    writer.add(EMBED, embed)
    hidden = F.embedding(calib.to(device), embed)
    run = None if g is None else LayerGraft(config, g, rotary, hidden, clock={})
    x_mla = hidden.float() if own_stream else None
    del hidden
    if run is not None and g is not None and g.rope_selection == "shared":  # a first pass: see _graft_layers
        t0 = time.perf_counter()
        run.shared_pairs = _shared_pairs(config, src.block, embed, rotary, g, sorted(run.layers), calib, 8, plan.progress)
        run.clock["statistics"] += time.perf_counter() - t0
    x = F.embedding(tail_ids, embed)
    tails = [x, x]  # [original stack, CED stack]
    del embed  # read again at the end when it is the head (tied)
    clock = run.clock if run is not None else {}
    clock.setdefault(SHARE_CLOCK, 0.0)
    return run, x_mla, tails, clock


__all__ = ["SHARE_CLOCK", "execute_layerwise_ced"]
