"""``kvgraft convert``: a checkpoint directory in, an MLA-grafted (``--to mla``) or causal encoder-decoder
(``--to ced``: MLA graft with one RoPE layout, then the share graft of ``kvgraft.graft.ced``) directory out.

The output directory is written atomically (an interrupted conversion leaves nothing). It is itself the
converted model in kvgraft's own format (``model_type: kvgraft``; ``kvgraft eval OUT`` works), plus
``conversion.json`` (what was done, with timings), the tokenizer and the eval slices of the input when it
has them, and, with ``--format deepseek_v3`` or ``both``, a stock DeepSeek-V3 export in ``deepseek_v3/``.
"""

from __future__ import annotations

import json
import shutil
import time
from dataclasses import asdict
from pathlib import Path

import numpy as np
import torch

from kvgraft.atomic import atomic_dir
from kvgraft.graft.mla import GraftConfig, graft_mla
from kvgraft.model import ModelConfig

FORMATS = ("kvgraft", "deepseek_v3", "both")
TARGETS = ("mla", "ced")
CALIBRATION = Path("eval") / "calibration.npy"


def ranks_for_compression(config: ModelConfig, compression: float, qk_rope_head_dim: int) -> int:
    """d_c such that each layer caches KV width / compression values (d_c + d_rope), rounded down."""
    if compression <= 1:
        raise ValueError(f"compression ({compression}) must be > 1 (original bytes / converted bytes)")
    per_layer = int(config.kv_width / compression)
    d_c = per_layer - qk_rope_head_dim
    if d_c <= 0:
        raise ValueError(
            f"compression {compression}x leaves {per_layer} cached values per layer, not enough for "
            f"qk_rope_head_dim ({qk_rope_head_dim}) plus a latent; lower the compression or the RoPE width"
        )
    return d_c


def load_calibration(
    model_dir: Path, calibration: str | Path | None, tokens: int, seq_len: int, tokenizer=None
) -> torch.Tensor:
    """(N, seq_len) calibration ids: from a .npy token file, a text file, or the model's shipped slice."""
    if calibration is None:
        if not (model_dir / CALIBRATION).is_file():
            raise ValueError(
                f"{model_dir} has no {CALIBRATION}; pass calibration text (a .txt or a .npy of token ids) "
                "or use objective 'weights'"
            )
        calibration = model_dir / CALIBRATION
    path = Path(calibration)
    if not path.is_file():
        raise FileNotFoundError(f"calibration file {path} does not exist")
    if path.suffix == ".npy":
        stream = np.load(path, mmap_mode="r")
    else:
        if tokenizer is None:
            raise ValueError(f"{model_dir} has no tokenizer to tokenize {path}; pass a .npy of token ids")
        stream = np.asarray(tokenizer.encode(path.read_text(encoding="utf-8")), dtype=np.int64)
    n = min(tokens, len(stream)) // seq_len
    if n == 0:
        raise ValueError(f"calibration {path} has {len(stream)} tokens, fewer than one window of {seq_len}")
    return torch.from_numpy(np.asarray(stream[: n * seq_len], dtype=np.int64)).view(n, seq_len)


def convert(
    model: str | Path,
    out: str | Path,
    *,
    kv_lora_rank: int | None = None,
    qk_rope_head_dim: int | None = None,
    compression: float | None = None,
    objective: str = "attention",
    rope_selection: str = "auto",
    layerwise: bool = True,
    rope_expectation: bool = True,
    layers: tuple[int, ...] | None = None,
    calibration: str | Path | None = None,
    calibration_tokens: int = 32768,
    calibration_seq_len: int = 512,
    output_format: str = "kvgraft",
    overwrite: bool = False,
    progress: bool = True,
    device: str = "cpu",
    to: str = "mla",
    kv_source_layers: tuple[int, ...] | None = None,
    sliding_window: int = 64,
    compress_rate: int = 1,
) -> dict:
    """Convert ``model`` (a local checkpoint directory) to MLA and write it to ``out``.

    ``kv_lora_rank`` (d_c) defaults to what ``compression`` leaves after the RoPE key;
    ``qk_rope_head_dim`` defaults to the model's head_dim (one head's worth of RoPE frequencies).
    Defaults (objective "attention", layer-wise, RoPE expectation, rope_selection "auto" = "norm", or
    "stride" when a stock DeepSeek-V3 export is asked for) are the best of ``bench/mla_oneshot.py``.
    ``device`` holds the model and the calibration activations (e.g. "cuda" for a 7B model); the
    per-layer factorisations run on the CPU in fp64. Returns the record written to ``conversion.json``.

    ``to="ced"`` makes a causal encoder-decoder: ``kv_source_layers`` (default: pivot at the middle layer,
    see ``default_kv_sources``), ``sliding_window`` and ``compress_rate`` as in ModelConfig. A Llama-family
    input is first grafted to MLA with one RoPE layout for all layers (rope_selection "shared": the
    frequencies with the largest measured contribution over all layers, or "stride"; d_c from
    ``compression``, default 2 since several layers read each shared latent); an all-MLA input with one
    layout is used as it is. Readers are fitted by least squares on the calibration tokens.
    ``compression`` defaults to 4 for MLA.
    """
    from kvgraft.hf import load_pretrained, save_pretrained
    from kvgraft.hf.load import load_tokenizer_dir
    from kvgraft.reference import resolve_model

    if output_format not in FORMATS:
        raise ValueError(f"format {output_format!r} is not one of {', '.join(FORMATS)}")
    if to not in TARGETS:
        raise ValueError(f"target {to!r} is not one of {', '.join(TARGETS)}")
    if to == "ced":
        if output_format != "kvgraft":
            raise ValueError(f"a causal encoder-decoder is written in kvgraft's format only, not {output_format!r}")
        if rope_selection == "norm":
            raise ValueError("rope_selection 'norm' picks frequencies per layer; the shared RoPE keys of --to ced "
                             "need one layout ('shared', 'stride' or 'auto')")
        if objective == "weights":
            raise ValueError("--to ced fits the readers on calibration text; objective 'weights' has none")
    compression = compression or (2.0 if to == "ced" else 4.0)
    src = resolve_model(model)
    out = Path(out)
    if out.exists() and not overwrite:
        raise FileExistsError(f"{out} already exists; pass --overwrite to replace it")
    t0 = time.perf_counter()
    original = load_pretrained(src, dtype=torch.float32, device=device)
    config = original.config
    d_rope = qk_rope_head_dim or config.head_dim
    already_mla = to == "ced" and set(config.attention_kinds) == {"mla"}  # skip the MLA step
    if already_mla:
        d_rope, d_c = config.qk_rope_head_dim, config.kv_lora_rank
    else:
        d_c = kv_lora_rank or ranks_for_compression(config, compression, d_rope)
    if rope_selection == "auto":  # the best measured ("norm") unless a stock export needs DeepSeek's layout
        rope_selection = ("stride" if output_format in ("deepseek_v3", "both")
                          else "shared" if to == "ced" else "norm")
    ced_graft = None
    if to == "ced":
        from kvgraft.graft.ced import CEDGraftConfig, default_kv_sources

        ced_graft = CEDGraftConfig(kv_source_layers=kv_source_layers or default_kv_sources(config.num_layers),
                                   sliding_window=sliding_window, compress_rate=compress_rate)
        if already_mla:
            ced_graft.check_against(config)
    graft = GraftConfig(kv_lora_rank=d_c, qk_rope_head_dim=d_rope, objective=objective,
                        rope_selection=rope_selection, layerwise=layerwise, layers=layers,
                        rope_expectation=rope_expectation and objective != "weights")
    if not already_mla:
        graft.check_against(config)
    tokenizer = load_tokenizer_dir(src)
    calib = None
    if objective != "weights":
        seq_len = min(calibration_seq_len, config.max_position_embeddings)
        calib = load_calibration(src, calibration, calibration_tokens, seq_len, tokenizer)
    t_load = time.perf_counter() - t0
    t1 = time.perf_counter()
    converted = original if already_mla else graft_mla(original, graft, calib, progress=progress)
    ced_report = None
    if ced_graft is not None:
        from kvgraft.graft.ced import graft_ced

        if not already_mla:
            ced_graft.check_against(converted.config)
        converted, ced_report = graft_ced(converted, ced_graft, calib, progress=progress)
    t_convert = time.perf_counter() - t1
    params = sum(p.numel() for p in original.parameters())
    del original  # a 7B model should not be held twice while writing
    record = {
        "source": str(src),
        "to": to,
        "graft": None if already_mla else asdict(graft),
        "share_graft": ced_report,
        "kv_cache_bytes_bf16": {str(n): {"original": config.kv_cache_bytes(n, 2),
                                         "converted": converted.config.kv_cache_bytes(n, 2)} for n in (512, 4096)},
        "kv_bytes_per_token_bf16": {"original": config.kv_bytes_per_token(2),
                                    "converted": converted.config.kv_bytes_per_token(2)},
        "compression": config.kv_bytes_per_token(2) / converted.config.kv_bytes_per_token(2),
        "calibration": None if calib is None else {"sequences": calib.shape[0], "seq_len": calib.shape[1],
                                                   "source": str(calibration or src / CALIBRATION)},
        "seconds": {"load": t_load, "convert": t_convert},
        "parameters": {"original": params, "converted": sum(p.numel() for p in converted.parameters())},
        "convert_seconds_per_million_params": t_convert / (params / 1e6),
        "formats": [],
    }
    with atomic_dir(out, overwrite=overwrite) as tmp:
        tok_dir = src if tokenizer is not None else None
        if output_format in ("kvgraft", "both"):  # the output directory itself is the kvgraft model
            save_pretrained(converted, tmp, tokenizer_dir=tok_dir, model_type="kvgraft", overwrite=True)
            record["formats"].append("kvgraft")
        if output_format in ("deepseek_v3", "both"):
            from kvgraft.hf.deepseek import export_deepseek_v3

            report = export_deepseek_v3(converted, tmp / "deepseek_v3", tokenizer_dir=tok_dir, calibration=calib)
            record["formats"].append("deepseek_v3")
            record["deepseek_v3"] = report.to_dict() if hasattr(report, "to_dict") else asdict(report)
        if (src / "eval").is_dir():
            shutil.copytree(src / "eval", tmp / "eval")
        (tmp / "conversion.json").write_text(json.dumps(record, indent=2, default=str) + "\n")
    return record
