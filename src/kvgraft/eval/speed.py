"""Decode throughput through the serving engine: prefill random prompts, then time single-token steps.

A measuring function only: it never asserts on timings. For every (context, batch) and repeat it
builds an engine (``kvgraft.runtime.engine``) whose paged cache holds ``batch`` sequences of
``context + new_tokens + 1`` tokens, adds ``batch`` greedy requests, times the first step (the whole
prefill, which also samples the first token), then times each of the ``new_tokens`` decode steps
(all rows at once) with ``time.perf_counter`` (synchronising the GPU when there is one). The first
``warmup`` steps of each repeat are run but not counted. Per repeat the median step latency is taken;
the point reports the median over repeats (and the median prefill time).
"""

from __future__ import annotations

import copy
import statistics
import time
import warnings
from dataclasses import asdict, dataclass
from typing import Any

import torch

from kvgraft.checks import check_int, is_int
from kvgraft.errors import ConfigError
from kvgraft.model.sizes import default_block_size
from kvgraft.model.transformer import Transformer
from kvgraft.runtime.engine import Engine
from kvgraft.runtime.options import EngineOptions
from kvgraft.runtime.sampling import SamplingParams


@dataclass(frozen=True)
class SpeedPoint:
    context: int  # prompt tokens already in the cache when decoding starts
    batch_size: int
    tokens_per_s: float  # batch_size / median step latency
    ms_per_token_median: float  # median latency of one decode step (all rows), milliseconds
    prefill_s: float  # median prefill time of the prompt, seconds
    beyond_max_positions: bool = False  # context + new_tokens > config.max_position_embeddings

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    elif device.type == "mps":
        torch.mps.synchronize()


def _check_positive(name: str, values: tuple[int, ...]) -> None:
    if not values or any(not is_int(v) or v < 1 for v in values):
        raise ConfigError(f"{name} must be a non-empty sequence of positive ints, got {values!r}")


def decode_speed(
    model: Transformer,
    contexts: tuple[int, ...] = (128, 512, 2048),
    batch_sizes: tuple[int, ...] = (1, 8),
    new_tokens: int = 32,
    warmup: int = 4,
    repeats: int = 3,
    dtype: torch.dtype | None = None,
    seed: int = 0,
) -> list[SpeedPoint]:
    """One :class:`SpeedPoint` per (context, batch size), contexts outer, batch sizes inner.

    ``dtype`` (default: the model's) is the compute and cache dtype; if it differs from the model's,
    a converted copy of the model is measured and the model itself is left untouched. Prompts are
    random ids from a generator seeded with ``seed``. Warns once when some context plus
    ``new_tokens`` runs past ``config.max_position_embeddings`` (speed is still meaningful there,
    output quality is not).
    """
    contexts, batch_sizes = tuple(contexts), tuple(batch_sizes)
    _check_positive("contexts", contexts)
    _check_positive("batch_sizes", batch_sizes)
    check_int("new_tokens", new_tokens, low=1)
    if not 0 <= warmup < new_tokens:
        raise ConfigError(f"warmup ({warmup}) must be in [0, new_tokens) = [0, {new_tokens})")
    if repeats < 1:
        raise ConfigError(f"repeats ({repeats}) must be >= 1")

    config = model.config
    param = next(model.parameters())
    device = param.device
    if dtype is not None and dtype != param.dtype:
        model = copy.deepcopy(model).to(dtype)
    dtype = dtype or param.dtype
    max_pos = config.max_position_embeddings
    beyond = [c for c in contexts if c + new_tokens > max_pos]
    if beyond:
        warnings.warn(
            f"decode_speed: contexts {beyond} plus {new_tokens} new tokens run past max_position_embeddings "
            f"({max_pos}); speed is still measured, output quality there is meaningless",
            stacklevel=2,
        )

    generator = torch.Generator().manual_seed(seed)
    points: list[SpeedPoint] = []
    was_training = model.training
    model.eval()
    try:
        with torch.inference_mode():
            for context in contexts:
                for batch in batch_sizes:
                    prompt = torch.randint(0, config.vocab_size, (batch, context), generator=generator).to(device)
                    step_medians: list[float] = []
                    prefills: list[float] = []
                    for _ in range(repeats):
                        total = context + new_tokens + 1
                        bs = default_block_size(config)
                        engine = Engine(
                            model,
                            EngineOptions(
                                num_blocks=batch * -(-total // bs),
                                block_size=bs,
                                max_seqs=batch,
                                max_batch_tokens=batch * context,
                                max_seq_len=total,
                                dtype=dtype,
                            ),
                        )
                        for row in prompt.tolist():
                            engine.add_request(row, SamplingParams(max_new_tokens=new_tokens + 1))
                        _sync(device)
                        t0 = time.perf_counter()
                        engine.step()  # every prompt in one step
                        _sync(device)
                        prefills.append(time.perf_counter() - t0)
                        steps: list[float] = []
                        for step in range(new_tokens):
                            t0 = time.perf_counter()
                            out = engine.step()
                            _sync(device)
                            if len(out) != batch:
                                raise RuntimeError(f"decode step {step} ran {len(out)} rows, expected {batch}")
                            if step >= warmup:
                                steps.append(time.perf_counter() - t0)
                        step_medians.append(statistics.median(steps))
                        del engine
                    latency = statistics.median(step_medians)
                    points.append(
                        SpeedPoint(
                            context=context,
                            batch_size=batch,
                            tokens_per_s=batch / latency,
                            ms_per_token_median=latency * 1e3,
                            prefill_s=statistics.median(prefills),
                            beyond_max_positions=context + new_tokens > max_pos,
                        )
                    )
    finally:
        model.train(was_training)
    return points
