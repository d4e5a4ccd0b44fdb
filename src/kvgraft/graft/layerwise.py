"""The layer-by-layer executor of ``kvgraft convert`` (every target and format): one decoder layer in memory.

This module runs a walk up the layers (``Walk``): the MLA graft's here (``--to mla``), the MLA graft's with
the share graft's in ``kvgraft.graft.ced_layerwise`` (``--to ced``, which documents its own memory and state).

The source is read lazily (``kvgraft.hf.shards.CheckpointReader``, memory-mapped safetensors); for each
layer in order the original block is read (fp32, on the plan's device), grafted by the same per-layer code
as ``graft_mla`` (``kvgraft.graft.mla.LayerGraft``), its converted block's tensors handed to a
``kvgraft.hf.shards.ShardWriter`` in the atomic output directory, and both are dropped. The calibration
hidden states stream through the layers in memory, and so do the calibration tail's (its last
``TAIL_SEQUENCES`` sequences) through both the original and the converted stack; after the last layer the
final norm and the head give the tail figures. The tensors written, the config and ``conversion.json``
(apart from timings) are those of the whole-model executor, bit for bit (``tests/test_convert_layerwise.py``).
With ``--format deepseek_v3``/``both`` the stock export then reads the converted model from the shards just
written one layer at a time (``kvgraft.hf.deepseek.stream``: its calibration statistics streamed through the
converted layers, its tensors written shard by shard, its error measured by transformers' own decoder
layers one at a time), so it does not grow with depth either. Its files are the whole-model executor's too.
"""

from __future__ import annotations

import shutil
import sys
import time
from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F
from tqdm.auto import tqdm

from kvgraft.errors import ConfigError
from kvgraft.graft.layer_stats import run_block
from kvgraft.graft.mla import TAIL_ROWS, GraftConfig, LayerGraft, _shared_pairs, layer_postfix, rope_tables
from kvgraft.graft.plan import ConvertPlan
from kvgraft.graft.record import TAIL_SEQUENCES, ConversionReport, TailFigures, conversion_record, finish_output
from kvgraft.graft.refine import RefineResult
from kvgraft.graft.resume import Checkpoint, fingerprint, staging_dir
from kvgraft.graft.stock import refuse_stock_weights, write_stock_streamed
from kvgraft.hf.config_map import hf_config_from_model
from kvgraft.hf.deepseek.checks import MLP_PROJECTIONS, has_nonzero, mlp_bias_problems
from kvgraft.hf.keys import hf_to_kvgraft
from kvgraft.hf.load import WEIGHTS, WEIGHTS_INDEX, check_finite
from kvgraft.hf.save import tokenizer_files_of, write_side_files
from kvgraft.hf.shards import DEFAULT_SHARD_BYTES, CheckpointReader, ShardWriter
from kvgraft.model import ModelConfig
from kvgraft.model.norm import RMSNorm
from kvgraft.model.rope import RotaryEmbedding
from kvgraft.model.shapes import num_parameters, parameter_shapes
from kvgraft.model.transformer import Block

HF_PREFIX = "model."
EMBED, NORM, LM_HEAD = "model.embed_tokens.weight", "model.norm.weight", "lm_head.weight"
IGNORED_SUFFIXES = ("rotary_emb.inv_freq",)  # buffers old transformers versions saved (as kvgraft.hf.keys)
SHARD_FLOOR = 256 * 2**20  # output shards of at least this many bytes (tiny models: one model.safetensors)
REUSE_TAIL = True  # the tail's states read off the calibration stream where it has them (False: run again)
CONVERTED = ".kvgraft"  # the converted model's shards with --format deepseek_v3 (removed after the export)
DTYPE = torch.float32  # the output's dtype, the whole-model executor's (it grafts an fp32 model)


def shard_bytes(config: ModelConfig) -> int:
    """The output's shard size: one converted layer's fp32 bytes, at least ``SHARD_FLOOR``, at most
    transformers-like ``DEFAULT_SHARD_BYTES``. The writer holds at most one shard, so this bounds its memory."""
    layer = sum(int(torch.Size(s).numel()) for k, s in parameter_shapes(config).items() if k.startswith("layers.0."))
    return min(DEFAULT_SHARD_BYTES, max(SHARD_FLOOR, layer * DTYPE.itemsize))


class SourceLayers:
    """The source checkpoint read a tensor at a time (fp32, on ``device``); ``seconds`` spent reading."""

    def __init__(self, reader: CheckpointReader, config: ModelConfig, device: str | torch.device) -> None:
        self.reader, self.config, self.device = reader, config, device
        self.seconds = 0.0

    def check(self, source: str, progress: bool = False) -> None:
        """What ``load_pretrained`` refuses, refused the same way and in its order, before any work: every
        tensor finite (read one at a time, in file order; with ``progress`` a bar once it takes over 2 s), then names and shapes
        against the config (from the headers)."""
        r = self.reader
        for name in tqdm(r.keys(), desc="check weights", unit="tensor", disable=not progress, leave=False, delay=2.0):
            check_finite({name: r.get(name)}, source)
            r.release()  # unmapped as read: the file's pages would count in the resident memory
        state = {k: torch.empty(r.shape(k), device="meta") for k in r.keys()}
        if self.config.tie_word_embeddings and LM_HEAD in state and EMBED in state:  # compared by value
            state[LM_HEAD], state[EMBED] = r.get(LM_HEAD), r.get(EMBED)
        hf_to_kvgraft(state, self.config, source=source)

    def nonzero_mlp_bias_layers(self) -> list[int]:
        """The layers whose MLP has a non-zero bias (read one tensor at a time; none without ``mlp_bias``)."""
        if not self.config.mlp_bias:
            return []
        out = []
        for layer in range(self.config.num_layers):
            names = [f"{HF_PREFIX}layers.{layer}.mlp.{n}.bias" for n in MLP_PROJECTIONS]
            if any(name in self.reader and has_nonzero(self.tensor(name)) for name in names):
                out.append(layer)
        return out

    def tensor(self, name: str, release: bool = True) -> torch.Tensor:
        """``name`` in fp32 on the device; ``release``: unmap the file after (see ``CheckpointReader.release``)."""
        t0 = time.perf_counter()
        t = self.reader.get(name, dtype=DTYPE, device=self.device)
        if release:
            self.reader.release()
        self.seconds += time.perf_counter() - t0
        return t

    def block(self, layer: int) -> Block:
        """The original decoder block ``layer`` (eval mode), its weights read now."""
        prefix = f"{HF_PREFIX}layers.{layer}."
        state = {
            k[len(prefix) :]: self.tensor(k, release=False)
            for k in self.reader.prefixed(prefix)
            if not k.endswith(IGNORED_SUFFIXES)
        }
        self.reader.release()
        with torch.device("meta"):
            block = Block(self.config, layer)
        block.load_state_dict(state, assign=True)
        return block.eval()


# a walk up the layers: (plan, source, calibration, writer, checkpoint, times) -> (the converted model's config,
# the calibration-tail figures or None, the share graft's report or None); it writes every tensor but the
# side files and checkpoints after each layer
Walk = Callable[..., tuple[ModelConfig, dict[str, Any] | None, dict[str, Any] | None]]


@torch.no_grad()
def execute_layerwise(plan: ConvertPlan, calib: torch.Tensor | None, walk: Walk | None = None) -> ConversionReport:
    """Convert ``plan`` one layer at a time and write ``plan.out`` atomically; returns the ``conversion.json``
    record (what ``execute_whole`` returns). ``walk``: the walk up the layers (default the MLA graft's, for
    ``to == "mla"``; ``kvgraft.graft.ced_layerwise`` passes the share graft's for ``--to ced``). Its
    "seconds", counted as ``execute_whole`` counts them: "load" is the time spent reading (and checking) the
    source, "convert" the graft, without the calibration-tail figures and the writing (summed over the runs
    of a resumed conversion).

    The output is staged in ``.<out>.partial`` with a checkpoint after each layer (``kvgraft.graft.resume``):
    with ``plan.options.resume`` a conversion interrupted after layer k continues at layer k + 1.

    Peak memory, roughly, the larger of two moments. During the walk: one layer's original and converted weights
    (fp32) + the calibration states (2-3 x N x T x hidden fp32 while a layer runs: the stream, the layer's output
    and the statistics' batches) + the tail's (2 x 8 x T x hidden fp32) + one pending output shard
    (``shard_bytes``: about one layer, at least 256 MiB; twice while it is written) + the checkpoint's write (no
    copy). At the end: the head (vocab x hidden fp32; the embedding is read again for a tied head, not held
    through the walk) + one tail sequence's logits of both stacks (2 x T x vocab fp32). None of it grows with
    depth; the embedding (vocab x hidden fp32) is held only until the first shard is written."""
    config = plan.source_config
    if walk is None:
        if plan.mla is None or plan.to != "mla":
            raise ConfigError("the MLA graft's walk converts --to mla only (--to ced: kvgraft.graft.ced_layerwise)")
        walk = _mla_walk

    weights_file = plan.source / (WEIGHTS if (plan.source / WEIGHTS).is_file() else WEIGHTS_INDEX)
    times = {"start": time.perf_counter(), "before": 0.0, "tail": 0.0}  # "before": seconds of earlier runs
    with staging_dir(plan.out, plan.overwrite, plan.options.resume, fingerprint(plan, calib)) as checkpoint:
        with CheckpointReader(plan.source) as reader:
            src = SourceLayers(reader, config, plan.device)
            t0 = time.perf_counter()
            src.check(str(weights_file), plan.progress)
            if plan.stock:  # what stock DeepSeek-V3 cannot hold, refused before any work (as load_source does)
                refuse_stock_weights(plan, mlp_bias_problems(src.nonzero_mlp_bias_layers()))
            src.seconds += time.perf_counter() - t0
            tmp = checkpoint.directory
            kvgraft_format = plan.output_format in ("kvgraft", "both")
            model_dir = tmp if kvgraft_format else tmp / CONVERTED  # the export reads the converted model back
            model_dir.mkdir(exist_ok=True)
            writer = ShardWriter(model_dir, max_shard_bytes=shard_bytes(plan.predicted_config()))
            new_config, tail, share_report = walk(plan, src, calib, writer, checkpoint, times)
            _check_written(writer.close(), new_config)
            checkpoint.discard()  # the shards have their final names: an interruption from here starts over
            # as the whole-model executor counts: "convert" is the graft, without the tail figures and the writing
            elapsed = times["before"] + time.perf_counter() - times["start"]
            seconds = {"load": src.seconds, "convert": elapsed - src.seconds - times["tail"] - writer.seconds}
            parameters = {"original": num_parameters(config), "converted": num_parameters(new_config)}
            record = conversion_record(
                plan, new_config, share_report=share_report, tail=tail, seconds=seconds, parameters=parameters
            )
            hf_config = hf_config_from_model(new_config, "kvgraft", dtype=str(DTYPE).removeprefix("torch."))
            tok_dir = plan.source if plan.has_tokenizer else None
            write_side_files(model_dir, hf_config, new_config, tokenizer_files_of(tok_dir if kvgraft_format else None))
            if kvgraft_format:
                record.formats.append("kvgraft")
            if plan.stock:  # the export reads the converted model from its shards, one layer at a time
                write_stock_streamed(plan, model_dir, new_config, calib, record, tmp, tok_dir)
                if not kvgraft_format:
                    shutil.rmtree(model_dir)
            finish_output(plan, tmp, record)
    return record


def _mla_walk(
    plan: ConvertPlan,
    src: SourceLayers,
    calib: torch.Tensor | None,
    writer: ShardWriter,
    checkpoint: Checkpoint,
    times: dict[str, float],
) -> tuple[ModelConfig, dict[str, Any] | None, None]:
    """The MLA graft's walk (``_graft_layers``) as a ``Walk``."""
    run, tail = _graft_layers(plan, src, calib, writer, checkpoint, times)
    return run.model_config(), tail, None


def _graft_layers(
    plan: ConvertPlan,
    src: SourceLayers,
    calib: torch.Tensor | None,
    writer: ShardWriter,
    checkpoint: Checkpoint,
    times: dict[str, float],
) -> tuple[LayerGraft, dict[str, Any] | None]:
    """The walk up the layers: graft, write, run the tail through both stacks and checkpoint each layer;
    then the head. Starts after the checkpoint's last layer when it has one. ``times["tail"]`` receives the
    seconds spent on the tail."""
    g, config, device = plan.mla, plan.source_config, torch.device(plan.device)
    assert g is not None
    rotary = RotaryEmbedding(config).to(device)
    tail_ids = None if calib is None else calib[-TAIL_SEQUENCES:].to(device)
    tails: list[torch.Tensor] = []  # the tail's hidden states: [original stack, converted stack]
    if checkpoint.state is None:
        start = 0
        embed = src.tensor(EMBED)
        writer.add(EMBED, embed)
        hidden = None if calib is None else F.embedding(calib.to(device), embed)
        run = LayerGraft(config, g, rotary, hidden, clock={})
        del hidden
        if g.rope_selection == "shared":  # scores every chosen layer on the original stack first: a first pass
            t0 = time.perf_counter()
            run.shared_pairs = _shared_pairs(config, src.block, embed, rotary, g, sorted(run.layers), calib, 8, plan.progress)
            run.clock["statistics"] += time.perf_counter() - t0
        if tail_ids is not None:
            x = F.embedding(tail_ids, embed)
            tails = [x, x]
        # read again at the end when it is the head (tied): not held through the walk (fp32, 1 GB at a 128k
        # vocabulary and hidden 2048)
        del embed
    else:
        start = int(checkpoint.state["next_layer"])
        run, tails = _restore(checkpoint, config, g, rotary, writer, src, times)
        if plan.progress:
            print(f"resuming at layer {start} of {config.num_layers} from {checkpoint.directory}", file=sys.stderr, flush=True)
    if tail_ids is not None:
        tail_cos, tail_sin = rope_tables(rotary, tail_ids.shape[0], tail_ids.shape[1])
    bar = tqdm(total=config.num_layers, initial=start, desc="convert", unit="layer", disable=not plan.progress)
    for layer in range(start, config.num_layers):
        t = time.perf_counter()
        block = src.block(layer)
        built = run.step(layer, block) if layer <= run.last else None
        if built is None and layer in run.converted:
            built = run.converted_block(layer, block)
        new = built if built is not None else block
        if tails:  # one sequence at a time, as tail_figures runs the whole model on each
            t_tail = time.perf_counter()
            tails = [
                _tail_state(run, layer, 0, block, tails, tail_cos, tail_sin),
                _tail_state(run, layer, 1, new, tails, tail_cos, tail_sin),
            ]
            times["tail"] += time.perf_counter() - t_tail
        prefix = f"{HF_PREFIX}layers.{layer}."
        for key, tensor in new.state_dict().items():
            writer.add(prefix + key, tensor)
        run.converted.pop(layer, None)  # written: its factors (fp64) would add up over the layers
        del block, built, new
        _save(checkpoint, layer + 1, run, tails, writer, src, times)
        bar.update(1)
        if plan.progress:
            layer_postfix(bar, time.perf_counter() - t, run.clock)
    bar.close()
    norm, head = write_final_norm_and_head(src, writer, config, device)
    if tail_ids is None:
        return run, None
    t_tail = time.perf_counter()
    tail = TailFigures(tail_ids)
    for i in range(tail_ids.shape[0]):  # the head as Transformer.forward applies it, one sequence at a time
        tail.add(i, *(F.linear(norm(x[i : i + 1]), head) for x in tails))
    times["tail"] += time.perf_counter() - t_tail
    record = tail.record()
    if run.refinement_record() is not None:  # measured on the same tail sequences, which it does not train on
        record["refinement"] = run.refinement_record()
    return run, record


def write_final_norm_and_head(
    src: SourceLayers, writer: ShardWriter, config: ModelConfig, device: str | torch.device
) -> tuple[RMSNorm, torch.Tensor]:
    """After the last layer: the final norm (read, written) and the head (the embedding when tied, else read and
    written), returned for the calibration tail's figures."""
    norm = RMSNorm(config.hidden_size, config.rms_norm_eps).to(device)
    norm.weight.copy_(src.tensor(NORM))
    writer.add(NORM, norm.weight)
    if config.tie_word_embeddings:
        return norm, src.tensor(EMBED)
    head = src.tensor(LM_HEAD)
    writer.add(LM_HEAD, head)
    return norm, head


def _tail_state(
    run: LayerGraft, layer: int, stack: int, block: Block, tails: list[torch.Tensor], cos: torch.Tensor, sin: torch.Tensor
) -> torch.Tensor:
    """The tail's hidden states after ``layer`` in ``stack`` (0: original, 1: converted): read off the
    calibration stream when it has just run them through ``block`` (its last ``TAIL_ROWS`` sequences, which
    are the tail's, are run one at a time as here: the same values bit for bit, ``tests/test_convert_layerwise``),
    else ``block`` run on them one sequence at a time."""
    n = tails[stack].shape[0]
    advanced = layer < run.last and n <= TAIL_ROWS
    stream = (run.x_new if run.g.layerwise else None) if stack == 1 else (None if run.g.layerwise else run.x_orig)
    if REUSE_TAIL and advanced and stream is not None and stream.shape[0] >= n:
        return stream[-n:].clone()  # a copy: the stream is replaced after the next layer
    return run_block(block, tails[stack], cos, sin, 1)


def _save(
    checkpoint: Checkpoint,
    next_layer: int,
    run: LayerGraft,
    tails: list[torch.Tensor],
    writer: ShardWriter,
    src: SourceLayers,
    times: dict[str, float],
) -> None:
    """Checkpoint the walk after layer ``next_layer - 1``: what ``_restore`` reads back."""
    checkpoint.write(next_layer, *walk_state(run, tails, writer, src, times))


def walk_state(
    run: LayerGraft | None, tails: list[torch.Tensor], writer: ShardWriter, src: SourceLayers, times: dict[str, float]
) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
    """(tensors, JSON-ready state) of a walk to checkpoint: the writer's, the tail's states, the seconds so
    far, and the MLA graft's streams, layouts and clocks when it has one (``run``)."""
    tensors = {f"pending/{k}": v for k, v in writer.pending.items()}
    for i, x in enumerate(tails):
        tensors[f"tail/{i}"] = x
    elapsed = times["before"] + time.perf_counter() - times["start"]
    state: dict[str, Any] = {
        "writer": writer.state(),
        "seconds": {"elapsed": elapsed, "load": src.seconds, "tail": times["tail"]},
    }
    if run is not None:
        for name, stream in (("x_new", run.x_new), ("x_orig", run.x_orig)):
            if stream is not None:
                tensors[f"stream/{name}"] = stream
        state["rope_index"] = {str(k): [int(f) for f in v] for k, v in run.rope_index.items()}
        state["shared_pairs"] = {str(k): [[int(a), int(b)] for a, b in v] for k, v in run.shared_pairs.items()}
        state["clock"] = dict(run.clock)
        state["refined"] = {str(k): [r.before, r.after, r.steps] for k, r in run.refined.items()}
    return tensors, state


def _restore(
    checkpoint: Checkpoint,
    config: ModelConfig,
    g: GraftConfig,
    rotary: RotaryEmbedding,
    writer: ShardWriter,
    src: SourceLayers,
    times: dict[str, float],
) -> tuple[LayerGraft, list[torch.Tensor]]:
    """The walk as ``_save`` left it: the graft's streams, layouts and clocks, the tail's states, the writer."""
    run, tails, _ = restore_walk(checkpoint, config, g, rotary, writer, src, times)
    assert run is not None
    return run, tails


def restore_walk(
    checkpoint: Checkpoint,
    config: ModelConfig,
    g: GraftConfig | None,
    rotary: RotaryEmbedding,
    writer: ShardWriter,
    src: SourceLayers,
    times: dict[str, float],
) -> tuple[LayerGraft | None, list[torch.Tensor], dict[str, torch.Tensor]]:
    """A walk as ``walk_state`` left it: (the MLA graft with ``g``, else None; the tail's states; every
    tensor of the checkpoint, for what the caller added); the writer, seconds and times restored."""
    state = checkpoint.state
    assert state is not None
    tensors = checkpoint.tensors()
    tails = [tensors[f"tail/{i}"] for i in range(2) if f"tail/{i}" in tensors]
    writer.restore(state["writer"], {k.removeprefix("pending/"): v for k, v in tensors.items() if k.startswith("pending/")})
    src.seconds += float(state["seconds"]["load"])
    times["before"], times["tail"] = float(state["seconds"]["elapsed"]), float(state["seconds"]["tail"])
    if g is None:
        return None, tails, tensors
    x_new = tensors.get("stream/x_new")
    # built on a stand-in of the stream's shape (meta: no copy), then given the saved streams
    run = LayerGraft(
        config, g, rotary, None if x_new is None else torch.empty(x_new.shape, device="meta"), clock=dict(state["clock"])
    )
    run.x_new, run.x_orig = x_new, tensors.get("stream/x_orig")
    run.rope_index = {int(k): tuple(v) for k, v in state["rope_index"].items()}
    run.shared_pairs = {int(k): [(a, b) for a, b in v] for k, v in state["shared_pairs"].items()}
    run.refined = {int(k): RefineResult(float(b), float(a), int(n)) for k, (b, a, n) in state.get("refined", {}).items()}
    return run, tails, tensors


def _check_written(weight_map: dict[str, str], config: ModelConfig) -> None:
    """The names written are exactly the converted model's (transformers' names; tied head not written)."""
    expected = {k if k == "lm_head.weight" else HF_PREFIX + k for k in parameter_shapes(config)}
    written = set(weight_map)
    if written != expected:
        raise RuntimeError(
            f"layer-by-layer writer bug: missing {sorted(expected - written)}, unexpected {sorted(written - expected)}"
        )


__all__ = ["SHARD_FLOOR", "SourceLayers", "Walk", "execute_layerwise", "restore_walk", "shard_bytes", "walk_state"]
